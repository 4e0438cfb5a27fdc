"""What fault injection does to this process, for every framework's injector (``neighbor_ckpt.fault_injection``).

:func:`fire` injects one planned fault now; :func:`empty_host_store` gives a rank the empty host store of a replaced
node. When a fault is due (which step, phase, rank and generation) is :meth:`~neighbor_ckpt.fault_config.FaultSpec.fires`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path

from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.fault_config import FaultSpec
from neighbor_ckpt.runtime import netns
from neighbor_ckpt.runtime.failpoints import lose_node
from neighbor_ckpt.runtime.network_plan import PLAN_ENV
from neighbor_ckpt.snapshot.store import rank_dir

__all__ = ["fire", "empty_host_store", "partition_possible"]

logger = logging.getLogger(__name__)


def partition_possible() -> bool:
    """Whether this process runs in a launch with a simulated network (``launch.simulate_network``), where
    ``target: partition`` can be injected: what an injector passes to
    :meth:`~neighbor_ckpt.fault_config.FaultInjectionConfig.refuse_unsupported`."""
    return bool(os.environ.get(PLAN_ENV))


def fire(fault: FaultSpec, rank: int, phase: str) -> None:
    """Inject ``fault`` into this process now (rank ``rank``, in ``phase``): log it, flush the logs, lose the node if
    ``permanent`` or ``target: node`` (SIGKILL of this node's launcher: every process of the node and its store host
    die with it), send the signal. ``target: partition``: cut the network (:func:`neighbor_ckpt.runtime.netns.cut`,
    healed later by a timer of its own if ``heal_after_s``) and return: this process trains on."""
    if fault.target == "partition":
        logger.warning("fault injection: %s, cut by rank %d", fault.describe(), rank)
        netns.cut(fault.nodes or (), fault.traffic, fault.heal_after_s)
        logger.warning("fault injection: node(s) %s cut off (%s traffic)", fault.nodes, fault.traffic)
        for h in logging.getLogger().handlers:
            h.flush()
        return
    sig = getattr(signal, fault.signal)
    logger.warning("fault injection: %s of %s in the %s phase of step %d", fault.signal,
                   f"node {fault.node} (rank {rank})" if fault.target == "node" else f"rank {rank}", phase, fault.step)
    for h in logging.getLogger().handlers:
        h.flush()
    if fault.target == "node":
        lose_node(sig)  # the node whole: its launcher, then this rank (SIGSTOP: both hang)
    elif fault.permanent and sig == signal.SIGKILL:
        lose_node()  # its node is gone: no restart brings this rank back
    os.kill(os.getpid(), sig)


def empty_host_store(config: NeighborCkptConfig, rank: int) -> Path:
    """Remove rank ``rank``'s host store directory (its slots), as on a replacement node; returns the directory."""
    d = rank_dir(config.resolved_store_dir(), config.resolved_job_id(), rank)
    if d.exists():
        shutil.rmtree(d)
    return d
