"""What a node says it holds before a generation forms, and what the shrink's assignment reads of it (one process)."""

from __future__ import annotations

import json
from pathlib import Path

from neighbor_ckpt.inprocess.holdings import holdings_of, local_holdings
from neighbor_ckpt.recovery.elastic import LocalGeneration


def _raw(generation: int, world: int, copies: list[tuple[int, int]]) -> bytes:
    return json.dumps(LocalGeneration(generation, world, world, tuple(copies)).to_json()).encode()


def test_the_shrink_reads_the_copies_of_the_newest_store_generation_taken_at_the_failed_world_size() -> None:
    published = {0: _raw(1, 4, [(0, 5), (3, 5)]), 1: _raw(1, 4, [(1, 5), (0, 5)]),
                 2: _raw(0, 4, [(2, 1)]),                 # an older store generation on its node: holds nothing of 1
                 3: _raw(2, 2, [(0, 9)])}                 # another layout: not the one that failed
    assert holdings_of(published, world_size=4) == {0: {(0, 5), (3, 5)}, 1: {(1, 5), (0, 5)}}
    assert holdings_of(published, world_size=3) == {} and holdings_of({}, world_size=4) == {}


def test_a_node_without_snapshots_of_the_job_holds_nothing(tmp_path: Path) -> None:
    assert LocalGeneration.from_json(json.loads(local_holdings(tmp_path / "none", "job"))) == LocalGeneration()
    assert LocalGeneration.from_json(json.loads(local_holdings(tmp_path, "job"))).copies == ()
