"""The docs/benchmarks.md figures are drawn from the committed raw results (nothing measured, nothing timed)."""

from __future__ import annotations

import json
from pathlib import Path

from tools.bench import plots

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_overheads_are_median_step_minus_the_base_median() -> None:
    run = {"main": {"variants": {"base": {"step_s": [1.0, 3.0, 2.0]}, "neighbor": {"step_s": [2.01, 2.03, 2.02]},
                                 "dcp_async": {"step_s": [4.0, 5.0, 6.0]}}}}
    ovh = plots.overheads_ms(run)
    assert round(ovh["neighbor"], 6) == 20.0 and ovh["dcp_async"] == 3000.0


def test_the_three_figures_are_written_from_the_committed_results(tmp_path: Path) -> None:
    compare = sorted(RESULTS.glob("compare_h100_*.json"))[-1]
    micro = sorted(RESULTS.glob("micro_cpu_*.json"))[-1]
    assert plots.main(["--compare", str(compare), "--micro", str(micro), "--out", str(tmp_path)]) == 0
    for name in ("step_overhead_h100.png", "restore_breakdown.png", "goodput_1024_h100.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(compare.read_text())["main"]["variants"]["neighbor"]["step_s"]
