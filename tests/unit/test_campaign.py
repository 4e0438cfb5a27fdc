"""The fault campaign's pure parts: reproducible case drawing, the recipe arguments of each kind, the comparison
and the table."""

from __future__ import annotations

import json
from pathlib import Path

from neighbor_ckpt.bench.campaign import KINDS, Case, Outcome, compare, draw_cases, summarize


def test_cases_are_reproducible_from_the_seed_and_cover_every_kind_in_turn() -> None:
    a, b = draw_cases(40, 11, steps=8), draw_cases(40, 11, steps=8)
    assert a == b and a != draw_cases(40, 12, steps=8)
    assert [c.kind for c in a[:len(KINDS)]] == list(KINDS)
    assert all(0 <= c.rank < 4 and 1 <= c.step <= 6 for c in a)
    assert {c.dist_opt for c in a} == {True, False}


def test_each_kind_becomes_the_recipe_flags_that_inject_it() -> None:
    def args(kind: str, dist_opt: bool = True) -> list[str]:
        return Case(index=0, kind=kind, rank=2, step=4, dist_opt=dist_opt).recipe_args()

    assert args("kill-forward") == ["--kill", "2:4", "--kill-phase", "forward", "--kill-signal", "SIGKILL"]
    assert args("hang-optimizer")[3:] == ["optimizer", "--kill-signal", "SIGSTOP"]
    assert "--replace-store" in args("kill-replaced-store")
    assert args("kill-truncate")[-2:] == ["--damage", "truncate"]
    assert args("kill-bad-header")[-2:] == ["--damage", "header"]
    assert args("kill-bitflip", dist_opt=False)[-1] == "--no-dist-opt"


def _write_run(out: Path, losses: dict[int, list[tuple[int, float, int]]], final: dict) -> Path:
    out.mkdir(parents=True)
    for rank, recs in losses.items():
        (out / f"losses.rank{rank}.jsonl").write_text(
            "".join(json.dumps({"step": s, "loss": v.hex(), "attempt": a}) + "\n" for s, v, a in recs))
        (out / f"final.rank{rank}.json").write_text(json.dumps(final))
    return out


def test_compare_accepts_only_identical_losses_recomputations_included_and_identical_finals(tmp_path: Path) -> None:
    base = _write_run(tmp_path / "base", {0: [(0, 2.5, 0), (1, 2.25, 0)]}, {"params": "x"})
    same = _write_run(tmp_path / "same", {0: [(0, 2.5, 0), (1, 2.25, 0), (1, 2.25, 1)]}, {"params": "x"})
    drift = _write_run(tmp_path / "drift", {0: [(0, 2.5, 0), (1, 2.25, 0), (1, 2.2500000000000004, 1)]},
                       {"params": "x"})
    other = _write_run(tmp_path / "other", {0: [(0, 2.5, 0), (1, 2.25, 0)]}, {"params": "y"})
    assert compare(base, same) == ""
    assert "step 1" in compare(base, drift)
    assert "final" in compare(base, other)


def test_table_counts_outcomes_per_kind_and_reports_detection_times() -> None:
    c = [Case(index=i, kind=k, rank=0, step=3, dist_opt=True) for i, k in enumerate(["hang-forward"] * 2 + ["kill-forward"])]
    table = summarize([Outcome(c[0], "exact", detection_s=3.1, mttr_s=20.0), Outcome(c[1], "exact", detection_s=3.3),
                       Outcome(c[2], "FAILED", "exit 1")])
    rows = {line.split("|")[1].strip(): [x.strip() for x in line.split("|")[2:-1]] for line in table.splitlines()[2:]}
    assert rows["hang-forward"] == ["2", "2", "0", "0", "3.20 / 3.30", "20.0"]
    assert rows["kill-forward"][:4] == ["1", "0", "0", "1"]
    assert rows["all"][:4] == ["3", "2", "0", "1"]


def test_cases_only_insurance_can_cover_come_after_the_first_insurance_checkpoint() -> None:
    cases = draw_cases(200, 2026, steps=6)
    covered = [c for c in cases if c.needs_insurance]
    assert covered and all(c.step >= 2 for c in covered)
    assert any(c.step == 1 for c in cases if not c.needs_insurance)
