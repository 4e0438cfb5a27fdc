"""Fault injection for demos and fault campaigns: ``neighbor_ckpt.fault_injection`` in a job's YAML.

:class:`FaultInjector` kills (SIGKILL) or hangs (SIGSTOP) one rank once, in one phase of one step, on the first
attempt of the job only (``TORCHELASTIC_RESTART_COUNT == 0``), so the restarted job trains through. With
``replace_store`` the victim restarts with an empty host store, as a replacement node would; with ``permanent`` its
launcher agent is killed with it (its node is gone: no restart brings it back).

Phases: ``forward`` (start of the training batch), ``backward`` (when the first gradient is computed: a tensor
hook, so it fires inside megatron-core's forward-backward too) and ``optimizer`` (Lightning's
``on_before_optimizer_step``, after the gradients were reduced).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from typing import Any

from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.lightning._compat import callback_bases
from neighbor_ckpt.runtime.failpoints import lose_node
from neighbor_ckpt.snapshot.store import rank_dir

__all__ = ["FaultInjector"]

logger = logging.getLogger(__name__)


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class FaultInjector(*callback_bases()):  # type: ignore[misc]
    """Attach next to :class:`~neighbor_ckpt.NeighborCheckpoint` (before it in ``callbacks``) to inject the fault
    ``config.fault_injection`` describes. Does nothing when that section is not enabled."""

    def __init__(self, config: NeighborCkptConfig) -> None:
        super().__init__()
        self.config = config
        self.fault = config.fault_injection
        self._rank = int(os.environ.get("RANK", "0"))
        self._armed = self.fault.enabled and _attempt() == 0 and self._rank == self.fault.rank
        self._hook: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        f = self.fault
        if f.enabled and f.replace_store and _attempt() > 0 and self._rank == f.rank:
            d = rank_dir(self.config.resolved_store_dir(), self.config.resolved_job_id(), self._rank)
            if d.exists():
                shutil.rmtree(d)
            logger.warning("fault injection: rank %d restarts on a 'replaced node': its host store %s was emptied",
                           self._rank, d)

    def _fire(self, where: str) -> None:
        self._armed = False
        sig = getattr(signal, self.fault.signal)
        logger.warning("fault injection: %s of rank %d in the %s phase of step %d", self.fault.signal, self._rank,
                       where, self.fault.step)
        for h in logging.getLogger().handlers:
            h.flush()
        if self.fault.permanent and sig == signal.SIGKILL:
            lose_node()  # its node is gone: no restart brings this rank back
        os.kill(os.getpid(), sig)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._armed or trainer.global_step != self.fault.step:
            return
        if self.fault.phase == "forward":
            self._fire("forward")
        elif self.fault.phase == "backward" and self._hook is None:
            param = next(p for p in pl_module.parameters() if p.requires_grad)
            self._hook = param.register_hook(lambda grad: self._fire("backward") if self._armed else None)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._armed and self.fault.phase == "optimizer" and trainer.global_step == self.fault.step:
            self._fire("optimizer")
