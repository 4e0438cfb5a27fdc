"""The failure path of one rank: what a surviving process leaves behind for the recovery that follows.

Two things, once each, from whichever thread notices the failure first (the main thread's exception or SIGTERM
handler, or the failure detector's thread while the main thread is blocked in a collective with the dead rank):

* the failure event (:func:`~neighbor_ckpt.recovery.journal.record_failure_event`): when the failure was noticed,
  the start of the next recovery's timeline, and the in-flight step's input fingerprint (the data-position check's
  record of the failure, :mod:`neighbor_ckpt.recovery.datacheck`);
* the lazy backup: the DP group's redundant state (weights and optimizer state under plain DDP) written into the
  host store, tagged with the iteration the live weights belong to. Under plain DDP this is the only copy of that
  state the recovery can use: snapshots carry only the small per-rank state.

The live weights must not be torn: the training thread's step tags say which iteration they belong to, and a
backup during which the tag changed (the training thread may have touched the weights) is discarded.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from neighbor_ckpt.recovery.journal import EVENTS_FILE, record_failure_event
from neighbor_ckpt.snapshot.engine import write_lazy_backup
from neighbor_ckpt.snapshot.razor import ShardPlan
from neighbor_ckpt.snapshot.store import ROLE_LAZY, HostStore
from neighbor_ckpt.snapshot.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["FailureBackup", "WeightsTag"]


@dataclass(frozen=True)
class WeightsTag:
    """What the live weights belong to, read from the training thread's step tags."""

    seq: int
    """Changes whenever the training thread changes the step tag."""
    iteration: int | None
    """The iteration the weights belong to (None: torn inside an optimizer step, or nothing snapshotted yet)."""


@dataclass(frozen=True)
class _Source:
    plan: ShardPlan
    tensors: tuple[torch.Tensor, ...]
    layout: str


class FailureBackup:
    """Records the failure event and writes the lazy backup of one rank, each at most once.

    Args:
        store: this rank's host store (the backup and the event file go there; both survive a restart).
        topology: the rank's DP group names the backup.
        attempt: the launcher's restart count (in the event, for the timeline).
        enabled: ``lazy_backup.enabled``.
        weights: reads the step tags (:class:`WeightsTag`); called from any thread.
        inflight_input: the in-flight step and its input fingerprint (``{"step": i, "fp": hex}`` or None), for the
            failure event; called from any thread.
    """

    def __init__(self, *, store: HostStore, topology: Topology, attempt: int | str, enabled: bool,
                 weights: Callable[[], WeightsTag],
                 inflight_input: Callable[[], dict[str, Any] | None] | None = None) -> None:
        self.store = store
        self.topology = topology
        self.attempt = attempt
        self.enabled = enabled
        self.weights = weights
        self.inflight_input = inflight_input
        self.noticed: float | None = None
        """Wall-clock time the failure was first noticed in this process (None: no failure)."""
        self._lock = threading.RLock()
        self._source: _Source | None = None
        self._written = False

    @property
    def events_path(self) -> Path:
        return self.store.dir / EVENTS_FILE

    def arm(self, plan: ShardPlan, lazy_tensors: Sequence[torch.Tensor], layout: str) -> None:
        """The live tensors of the plan's lazy part (in plan order), once the plan exists (the first snapshot)."""
        self._source = _Source(plan, tuple(lazy_tensors), layout)

    def on_failure(self, reason: str = "", *, background: bool = False) -> bool:
        """Record the failure, then write the lazy backup unless done already; True if one is written.

        ``background``: called off the training thread, which may change the step tag meanwhile. Never raises: it
        runs inside exception and signal handlers, where the original error must stay visible."""
        with self._lock:
            if self.noticed is None:
                self.noticed = time.time()
                record_failure_event(self.events_path, rank=self.topology.rank, attempt=self.attempt,
                                     reason=reason, when=self.noticed,
                                     inflight_input=self.inflight_input() if self.inflight_input else None)
            if self._written:
                return True
            try:
                return self._write(reason, background=background)
            except Exception as e:  # noqa: BLE001 - failure path: report, never mask the original error
                logger.error("rank %d: lazy backup failed: %s", self.topology.rank, e)
                return False

    def _write(self, reason: str, *, background: bool) -> bool:
        src = self._source
        if src is None or not src.plan.has_lazy or not self.enabled:
            return False
        tag = self.weights()
        if tag.iteration is None:
            logger.warning("rank %d: no lazy backup: weights are inside an optimizer step", self.topology.rank)
            return False
        hdr = write_lazy_backup(self.store, planned=src.plan.lazy, sources=src.tensors,
                                payload_bytes=src.plan.lazy_bytes, iteration=tag.iteration, layout=src.layout,
                                meta={"dp_group": min(self.topology.dp_ranks), "reason": reason[:200]})
        if background and self.weights().seq != tag.seq:
            self.store.invalidate_after(ROLE_LAZY, None)
            logger.warning("rank %d: discarded the lazy backup of iteration %d: the training thread entered another "
                           "step phase while it was written", self.topology.rank, tag.iteration)
            return False
        self._written = True
        logger.warning("rank %d: wrote lazy backup of iteration %d (%d bytes) after: %s", self.topology.rank,
                       hdr.iteration, hdr.payload_nbytes, reason or "failure")
        return True
