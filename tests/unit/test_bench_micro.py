"""Pure parts of the micro-benchmark (tools.bench.micro): rows, ratios, cells. No timing is asserted."""

from __future__ import annotations

import math

import pytest

from tools.bench import micro
from tools.bench.micro.common import MiB, Row
from tools.bench.micro.report import row_cells
from tools.bench.micro.restore import RESTORE_PHASES, phase_summary, restore_rows


def _restore_result(lost: list[float], raw: list[float], local: list[float], copy: list[float]) -> dict:
    ph = {k: 0.01 for k in RESTORE_PHASES}
    return {"restore": {
        "victim": 0, "source_rank": 1, "unique_bytes": 256 * MiB, "image_bytes": 256 * MiB + 8192,
        "pulled_bytes": 256 * MiB + 8192, "phase_names": list(RESTORE_PHASES),
        "lost": {"restore": lost, "raw": raw, "phases": [dict(ph, transfer=t) for t in lost],
                 "unprepared": [t + 0.5 for t in lost], "unprepared_phases": [dict(ph, transfer=t + 0.5) for t in lost],
                 "slowest_rank_restore": lost, "raw_gloo": [0.5 * t for t in raw],
                 "slowest_inventory": [0.2] * len(lost), "prepare_seconds": 0.25},
        "local": {"restore": local, "copy": copy, "phases": [dict(ph, verify=0.03)] * len(local)},
    }}


@pytest.fixture(autouse=True)
def _median(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(micro.common, "STAT", "median")


def test_restore_rows_ratio_is_restore_time_over_raw_time() -> None:
    rows, notes = restore_rows(_restore_result([1.2, 1.3, 1.4], [1.0, 1.0, 1.0], [0.2, 0.3], [0.1, 0.1]), 4, 16.0)
    lost, unprepared, local = rows
    assert lost.section == unprepared.section == local.section == "restore"
    assert lost.unit == local.unit == "s"
    assert lost.value == pytest.approx(1.3) and lost.baseline == pytest.approx(1.0)
    assert lost.ratio == pytest.approx(1.3)
    assert (lost.target, lost.op, lost.status) == (1.5, "<=", "PASS")
    assert local.ratio == pytest.approx(2.5)
    assert local.status == "INFO"  # no target: informational
    assert lost.detail["paired_ratio_median"] == pytest.approx(1.3)
    assert lost.detail["phases"]["transfer"] == pytest.approx(1.3)
    assert lost.detail["gbps"] == pytest.approx((256 * MiB + 8192) / 1.3 / 1e9)
    assert lost.detail["raw_gloo_seconds"] == pytest.approx(0.5)
    assert lost.detail["prepare_seconds"] == pytest.approx(0.25)
    assert "receive slot prepared" in lost.metric and "made by the pull" in unprepared.metric
    assert unprepared.ratio == pytest.approx(1.8) and unprepared.status == "INFO"  # the target is the prepared row's
    assert unprepared.detail["phases"]["transfer"] == pytest.approx(1.8)
    assert len(notes) == 2 and "W=4" in notes[0] and "transfer 1.300" in notes[0] and "(0.250s" in notes[0]


def test_restore_rows_judge_todays_order_when_it_was_measured() -> None:
    """With the slot's preparation started right before the recovery (the checkpointer's constructor: today's
    order) measured too, the target is that row's; the slot prepared before the clock is the best case."""
    res = _restore_result([1.2, 1.3, 1.4], [1.0, 1.0, 1.0], [0.2, 0.3], [0.1, 0.1])
    lost = res["restore"]["lost"]
    lost["constructed"] = [1.6, 1.7, 1.8]
    lost["constructed_phases"] = [dict(p, transfer=t) for p, t in zip(lost["phases"], lost["constructed"])]
    lost["constructed_wait"] = [0.2, 0.25, 0.3]
    rows, notes = restore_rows(res, 4, 16.0)
    early, today, unprepared, local = rows
    assert early.status == "INFO" and "before the recovery" in early.metric
    assert (today.target, today.op, today.status) == (1.5, "<=", "MISS") and today.ratio == pytest.approx(1.7)
    assert "construction" in today.metric and today.detail["slot_wait_seconds"] == pytest.approx(0.25)
    assert "made by the pull" in unprepared.metric and unprepared.ratio == pytest.approx(1.8)
    assert len(notes) == 3 and "waited 0.250s for the slot" in notes[1] and "transfer 1.800" in notes[0]


def test_restore_rows_miss_above_target() -> None:
    rows, _ = restore_rows(_restore_result([2.0], [1.0], [1.0], [1.0]), 2, 16.0)
    assert rows[0].ratio == pytest.approx(2.0) and rows[0].status == "MISS"


def test_restore_rows_min_stat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(micro.common, "STAT", "min")
    rows, _ = restore_rows(_restore_result([1.2, 3.0], [1.0, 0.8], [0.2], [0.1]), 2, 16.0)
    assert rows[0].value == pytest.approx(1.2) and rows[0].baseline == pytest.approx(0.8)
    assert rows[0].ratio == pytest.approx(1.5) and rows[0].status == "PASS"


def test_phase_summary_keeps_phase_order_and_skips_absent() -> None:
    ph = phase_summary([{"transfer": 1.0, "inventory": 0.1}, {"transfer": 3.0, "inventory": 0.3}])
    assert list(ph) == ["inventory", "transfer"]
    assert ph == {"inventory": pytest.approx(0.2), "transfer": pytest.approx(2.0)}
    assert phase_summary([]) == {}


def test_row_cells_seconds_and_throughput() -> None:
    r = Row("restore", "m", 1.25, "s", 1.0, "raw", 1.25, 1.5, "<=", detail={"gbps": 0.21}).judge()
    assert row_cells(r) == ["m", "1.250 s (0.21 GB/s)", "1.000 s (raw)", "1.2500x", "<= 1.5x", "PASS"]
    nan = Row("restore", "m", math.nan, "s", None, "failed", None, 1.5, "<=").judge()
    assert row_cells(nan)[1:4] == ["-", "- (failed)", "-"] and nan.status == "ERROR"


def test_row_cells_existing_units_unchanged() -> None:
    g = Row("stream", "ring", 0.25, "GB/s", 0.2, "raw gloo", 1.25, 0.9, ">=").judge()
    assert row_cells(g) == ["ring", "0.25 GB/s", "0.20 GB/s (raw gloo)", "1.2500x", ">= 0.9x", "PASS"]
    h = Row("host", "host bytes", 4.0, "x", 256.0 * MiB, "plan.unique_bytes", 4.0, 4.05, "<=",
            detail={"host_bytes": 1024 * MiB}).judge()
    assert row_cells(h)[1:3] == ["1024.00 MiB", "256.0 MiB (plan.unique_bytes)"]


def test_help_lists_no_restore(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # argument parsing only, nothing is run
        micro.main(["--help"])
    assert e.value.code == 0
    assert "--no-restore" in capsys.readouterr().out
