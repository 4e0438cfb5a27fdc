"""Judging a recorded campaign run again (tools/campaign/rejudge.py): the same run directory and log, this checkout's
judge, both outcomes kept; refused where the run's exit status is not known to be 0."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.unit.campaign_runs import same_training_runs
from tools.campaign.cases import CUTTING_RANK, KINDS, Case, Outcome, draw_cases
from tools.campaign.judge import CUT_OFF
from tools.campaign.rejudge import REJUDGED, why_not_rejudged
from tools.campaign.report import load_outcomes
from tools.campaign.runner import baseline_dir, case_dir, main

RECORDED = "process 4 (cut off) never said it is cut off from the majority"
LOG = ("[rank1] x WARNING fault injection: node(s) [0, 4] cut off (all traffic)\n"
       f"[rank0] x ERROR process 0: {CUT_OFF} (no majority seen for 1.8 s): exiting with status 79\n"
       f"2026-11-28 15:32:13,047 neighbor_ckpt launcher node4 (pid 1): launcher node4: {CUT_OFF} (no majority seen "
       "for 2.3 s): stopping without writing anything more; exiting with status 79\n"
       "[rank5] x INFO neighbor_ckpt: hot spare (process 5) takes rank 0's place in generation 1\n")


def _campaign(tmp_path: Path) -> tuple[Path, Case, Case]:
    """A recorded campaign of two cases: a minority partition recorded FAILED by a judge that wanted process 4's own
    line (its launcher said it), and a data-misplaced case, stopped."""
    cases = draw_cases(len(KINDS), 2027, steps=6)
    cut = next(c for c in cases if c.kind == "inproc-partition-minority-with-spare")
    stopped = next(c for c in cases if c.kind == "data-misplaced")
    work = tmp_path / "campaign"
    work.mkdir()
    base, run = same_training_runs(tmp_path)
    base.rename(baseline_dir(work, cut.flavour))
    run.rename(case_dir(work, cut))
    fault = {"rank": CUTTING_RANK, "step": cut.step, "phase": "optimizer", "unix": 1_700_000_000.0,
             "target": "partition"}
    (case_dir(work, cut) / "fault.json").write_text(json.dumps(fault))
    (case_dir(work, cut) / "faults.jsonl").write_text(json.dumps(fault) + "\n")
    (case_dir(work, cut) / "launch.log").write_text(LOG)
    (work / "campaign.json").write_text(json.dumps({"seed": 2027, "faults": 2, "steps": 6, "source": "abc1234",
                                                    "detector_timeout_s": 3.0, "detector_interval_s": 0.5}))
    recorded = [Outcome(cut, "FAILED", RECORDED, wall_s=85.0), Outcome(stopped, "stopped", "stopped by the data check")]
    (work / "outcomes.jsonl").write_text("".join(json.dumps(dataclasses.asdict(o)) + "\n" for o in recorded))
    return work, cut, stopped


def test_a_recorded_run_judged_again_keeps_the_run_and_both_outcomes_and_the_results_name_the_judge(
        tmp_path: Path) -> None:
    work, cut, _ = _campaign(tmp_path)
    results = tmp_path / "results.json"
    assert main(["--out", str(work), "--rejudge", str(cut.index + 1), "--results", str(results)]) == 0
    now = load_outcomes(work / "outcomes.jsonl")
    assert [o.result for o in now] == ["exact", "stopped"], now
    assert now[0].wall_s == 85.0 and now[0].detail.startswith("judged again by ") \
        and now[0].detail.endswith(f": recorded FAILED ({RECORDED})"), now[0].detail
    (record,) = json.loads((work / REJUDGED).read_text())
    assert record["case"] == cut.index + 1 and record["was"] == {"result": "FAILED", "detail": RECORDED}
    assert record["now"]["result"] == "exact" and record["judge"]
    document = json.loads(results.read_text())
    assert document["rejudged"] == [record] and document["verdict"]["failed_cases"] == []
    assert document["campaign"]["source"] == "abc1234", "the cases' commit stays the one they ran on"


def test_a_run_whose_exit_status_was_not_zero_or_a_case_not_recorded_is_not_judged_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work, cut, stopped = _campaign(tmp_path)
    before = (work / "outcomes.jsonl").read_text()
    for number, why in ((stopped.index + 1, "exited non-zero"), (999, "not recorded")):
        with pytest.raises(SystemExit):
            main(["--out", str(work), "--rejudge", f"{cut.index + 1},{number}"])
        assert why in capsys.readouterr().err
    assert (work / "outcomes.jsonl").read_text() == before and not (work / REJUDGED).exists(), "nothing changed"
    assert "before the exit-status check" in why_not_rejudged(Outcome(cut, "FAILED", "exit 1: boom"))
    assert why_not_rejudged(Outcome(cut, "FAILED", "the fault never fired"))
    assert why_not_rejudged(Outcome(cut, "FAILED", RECORDED)) == ""
