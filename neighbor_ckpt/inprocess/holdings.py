"""What a process's node holds of the job's snapshots, for the choice of the survivors a shrink keeps active.

An elastic shrink (:func:`~neighbor_ckpt.inprocess.assignment.next_assignment`) may leave survivors idle, and an idle
survivor's host store takes no part in the reshard. So before joining a generation every process says which (old
rank, iteration) snapshots its node holds (:func:`local_holdings`, published under ``gen/<g>/holds/<p>``), and the
assignment keeps survivors whose nodes hold a complete version between them (:func:`holdings_of`). Reading the slot
headers of one node takes a few milliseconds; only jobs with ``elastic.enabled`` do it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping

from neighbor_ckpt.inprocess.assignment import Holdings
from neighbor_ckpt.recovery.elastic import LocalGeneration, local_generation

logger = logging.getLogger(__name__)

__all__ = ["holdings_of", "local_holdings"]


def local_holdings(root: Path, job_id: str) -> str:
    """This node's newest store generation of ``job_id`` with a committed snapshot, as the JSON a process publishes
    (an empty generation when there is none, or the store cannot be read)."""
    try:
        found = local_generation(root, job_id)
    except OSError as e:
        logger.warning("neighbor_ckpt: could not read the host store %s for the snapshots it holds: %s", root, e)
        found = LocalGeneration()
    return json.dumps(found.to_json())


def holdings_of(published: Mapping[int, bytes], *, world_size: int) -> Holdings:
    """The :data:`~neighbor_ckpt.inprocess.assignment.Holdings` of the processes that ``published`` theirs: the
    copies in the newest store generation whose snapshots were taken at ``world_size`` (the generation that just
    failed); a process whose node has none of it holds nothing."""
    nodes = {p: LocalGeneration.from_json(json.loads(raw)) for p, raw in published.items()}
    ours = [g.generation for g in nodes.values() if g.world_size == world_size and g.copies]
    if not ours:
        return {}
    newest = max(ours)
    return {p: frozenset(g.copies) for p, g in nodes.items() if g.generation == newest and g.world_size == world_size}
