"""The slot a hot spare prepares while it idles, so that its activation pulls into memory already there.

Once per process, on a thread of its own: wait until every active rank of the job has published its own slot's
capacities (at its first snapshot, :class:`~neighbor_ckpt.runtime.launch_store.SlotCapacities`), then stage a slot
as large as the largest (:func:`~neighbor_ckpt.snapshot.store.stage_own_slot`). Best effort: without it the
slot is made at activation; nothing when the snapshots are off.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from neighbor_ckpt.config import NeighborCkptConfig

__all__ = ["SpareSlot", "SPARE_SLOT_THREAD"]

logger = logging.getLogger(__name__)

SPARE_SLOT_THREAD = "neighbor_ckpt-spare-slot"


class SpareSlot:
    """A hot spare's slot preparation (see the module docstring).

    Args:
        snapshots: the whole configuration (where the host stores are, the job id).
        ranks: the active ranks of the job (whose capacities it waits for).
        launch_store: the launch's store as ``(host, port)`` for torch's client, asked when the thread starts.
        idle: whether the process is still idle (an activated spare stops looking: its checkpointer prepares).
        name: who this is, for the log.
    """

    def __init__(self, snapshots: NeighborCkptConfig, *, ranks: int, launch_store: Callable[[], tuple[str, int]],
                 idle: Callable[[], bool], name: Callable[[], str]) -> None:
        self.snapshots, self.ranks, self.launch_store, self.idle, self.name = snapshots, ranks, launch_store, idle, name
        self._started = False

    def start(self) -> None:
        """Start the preparation (once per process; nothing when the snapshots are off)."""
        if self._started or not self.snapshots.enabled:
            return
        self._started = True
        threading.Thread(target=self._stage, name=SPARE_SLOT_THREAD, daemon=True).start()

    def _stage(self) -> None:
        from neighbor_ckpt.runtime.launch_store import SlotCapacities, open_launch_store
        from neighbor_ckpt.snapshot.store import stage_own_slot

        cfg = self.snapshots
        try:
            job_id, root = cfg.resolved_job_id(), cfg.resolved_store_dir()
            # where the ranks publish: the launch's store below every prefix (the ranks reach it through their
            # default group's store; an idle spare has none)
            client = open_launch_store(timeout_s=30.0, fallback=self.launch_store())
            if client is None:
                return
            caps = SlotCapacities(job_id=job_id, generation=0, store=client)
            found: dict[int, tuple[int, int, int]] = {}
            while self.idle():
                for r in range(self.ranks):
                    if r not in found:
                        got = caps.lookup(r)
                        if got is None:
                            break  # not every rank has snapshotted yet
                        found[r] = got
                if len(found) == self.ranks:
                    if self.idle():  # the largest any rank needs: cut to the rank taken at activation
                        h, p, e = (max(c[i] for c in found.values()) for i in range(3))
                        stage_own_slot(root, job_id, header_cap=h, payload_cap=p, extras_cap=e)
                    return
                time.sleep(0.2)  # one store read per wait: for the next rank that has not published yet
        except Exception as e:  # noqa: BLE001 - best effort: the slot is then made at activation
            logger.info("%s: no slot prepared while idle: %s", self.name(), e)
