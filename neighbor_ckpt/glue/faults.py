"""What fault injection does to this process, for every framework's injector (``neighbor_ckpt.fault_injection``).

:func:`fire` injects one planned fault now; :func:`empty_host_store` gives a rank the empty host store of a replaced
node. When a fault is due (which step, phase, rank and generation) is :meth:`~neighbor_ckpt.config.FaultSpec.fires`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path

from neighbor_ckpt.config import FaultSpec, NeighborCkptConfig
from neighbor_ckpt.runtime.failpoints import lose_node
from neighbor_ckpt.snapshot.store import rank_dir

__all__ = ["fire", "empty_host_store"]

logger = logging.getLogger(__name__)


def fire(fault: FaultSpec, rank: int, phase: str) -> None:
    """Inject ``fault`` into this process now (rank ``rank``, in ``phase``): log it, flush the logs, lose the node if
    ``permanent``, send the signal."""
    sig = getattr(signal, fault.signal)
    logger.warning("fault injection: %s of rank %d in the %s phase of step %d", fault.signal, rank, phase, fault.step)
    for h in logging.getLogger().handlers:
        h.flush()
    if fault.permanent and sig == signal.SIGKILL:
        lose_node()  # its node is gone: no restart brings this rank back
    os.kill(os.getpid(), sig)


def empty_host_store(config: NeighborCkptConfig, rank: int) -> Path:
    """Remove rank ``rank``'s host store directory (its slots), as on a replacement node; returns the directory."""
    d = rank_dir(config.resolved_store_dir(), config.resolved_job_id(), rank)
    if d.exists():
        shutil.rmtree(d)
    return d
