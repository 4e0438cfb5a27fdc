"""A restarted rank whose node lost its store starts preparing its receive slot before it builds its model.

The recovery's pull of a replaced rank lands in a slot file that must first be made and faulted in, which costs about
as much as the transfer itself (docs/benchmarks.md section 6). Started in the checkpointer's constructor, right before
``recover()``, that preparation races the pull and gains nothing (measured). Started here, right after
``prepare_torchrun_restart()`` and before the model is built (seconds for a real model), it is done when the pull
comes. The slot is staged (:func:`~neighbor_ckpt.snapshot.store.stage_own_slot`) with the capacities this rank
published before its failure (:class:`~neighbor_ckpt.runtime.launch_store.SlotCapacities`, newest store generation
that has them) and taken by the checkpointer's store, which cuts or grows it to what it needs.

Best effort: no rank, no job id yet, a store that still holds this rank's slots (a restart on the same node), or no
published capacities mean nothing is staged.
"""

from __future__ import annotations

import logging
import os

from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.runtime.launch_store import SlotCapacities, open_launch_store
from neighbor_ckpt.snapshot.store import ROLE_OWN, generation_dir, stage_own_slot

__all__ = ["prepare_replacement_slot"]

logger = logging.getLogger(__name__)

MAX_GENERATIONS = 64
"""Store generations (elastic reshards) looked through for this rank's published capacities."""


def _store_is_empty(config: NeighborCkptConfig, job_id: str, rank: int) -> bool:
    """No own slot of ``rank`` in any generation of the job's store on this node."""
    job = generation_dir(config.resolved_store_dir(), job_id)
    return not any(job.glob(f"rank{rank}/{ROLE_OWN}.*.slot")) and \
        not any(job.glob(f"g*/rank{rank}/{ROLE_OWN}.*.slot"))


def prepare_replacement_slot(config: NeighborCkptConfig | None = None) -> bool:
    """Stage this rank's own slot now if its store on this node is empty (a replaced node) and it published its
    slot's capacities before the failure; call right after ``prepare_torchrun_restart()``. Returns whether it
    started."""
    cfg = config or NeighborCkptConfig()
    rank = os.environ.get("RANK", "")
    if not cfg.enabled or not rank.isdigit():
        return False
    try:
        job_id = cfg.resolved_job_id()
    except Exception as e:  # noqa: BLE001 - no job id yet: the checkpointer prepares later
        logger.debug("neighbor_ckpt: no replacement slot staged (no job id yet: %s)", e)
        return False
    r = int(rank)
    if not _store_is_empty(cfg, job_id, r):
        return False
    client = open_launch_store()
    if client is None:
        return False
    caps = None
    for generation in range(MAX_GENERATIONS):
        found = SlotCapacities(job_id=job_id, generation=generation, store=client).lookup(r)
        if found is None:
            break
        caps = found
    if caps is None:
        return False
    return stage_own_slot(cfg.resolved_store_dir(), job_id, header_cap=caps[0], payload_cap=caps[1],
                          extras_cap=caps[2], when="before this process built its model")
