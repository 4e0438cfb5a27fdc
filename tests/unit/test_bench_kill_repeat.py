"""The kill-repeat benchmark's verdict on one launch: bit-exact only when every rank's losses and final state match the
failure-free launch's (one process, records written here)."""

from __future__ import annotations

import json
from pathlib import Path

from tools.bench.kill_repeat import identical


def record(root: Path, losses: dict[int, list[tuple[int, str]]], finals: dict[int, dict]) -> Path:
    root.mkdir(parents=True)
    for rank, rows in losses.items():
        (root / f"losses.rank{rank}.jsonl").write_text(
            "".join(json.dumps({"step": s, "loss": v, "attempt": 0}) + "\n" for s, v in rows))
    for rank, fp in finals.items():
        (root / f"final.rank{rank}.json").write_text(json.dumps(fp))
    return root


def test_a_replayed_step_counts_by_its_last_loss_and_any_difference_is_named(tmp_path: Path) -> None:
    base = record(tmp_path / "base", {0: [(1, "0x1p+0"), (2, "0x1p-1")], 1: [(1, "0x1p+0"), (2, "0x1p-1")]},
                  {0: {"w": "a"}, 1: {"w": "b"}})
    # the faulted run recorded step 2 twice (before the kill and after the restore): the last one counts
    same = record(tmp_path / "same", {0: [(1, "0x1p+0"), (2, "0x1.1p-1"), (2, "0x1p-1")],
                                      1: [(1, "0x1p+0"), (2, "0x1p-1")]}, {0: {"w": "a"}, 1: {"w": "b"}})
    assert identical(base, same, 2) == (True, "bit-exact")
    other = record(tmp_path / "other", {0: [(1, "0x1p+0"), (2, "0x1p-1")], 1: [(1, "0x1p+0"), (2, "0x1.8p-1")]},
                   {0: {"w": "a"}, 1: {"w": "b"}})
    assert identical(base, other, 2) == (False, "rank 1: losses differ at step(s) [2]")
    state = record(tmp_path / "state", {0: [(1, "0x1p+0"), (2, "0x1p-1")], 1: [(1, "0x1p+0"), (2, "0x1p-1")]},
                   {0: {"w": "a"}, 1: {"w": "c"}})
    assert identical(base, state, 2)[0] is False
    assert identical(base, tmp_path / "missing", 2)[0] is False
