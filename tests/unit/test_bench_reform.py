"""``python -m tools.bench --reform``: its summaries over rounds and launches (pure, on made-up records)."""

from __future__ import annotations

import json
from pathlib import Path

from tools.bench import reform


def _round(mode: str, rnd: int, rank: int, pg: float, mp: float) -> dict:
    return {"round": rnd, "mode": mode, "rank": rank, "member_groups": [4, 1],
            "s": {"init_process_group": pg, "initialize_model_parallel": mp, "first_all_reduce": 0.01, "destroy": 0.1}}


def test_groups_summary_takes_the_slowest_rank_of_each_round_and_leaves_round_zero_out() -> None:
    recs = [_round("gated", 0, 0, 9.0, 9.0)]  # first calls: left out
    recs += [_round(m, r, k, 0.01 * (k + 1), 0.1 * r) for m in reform.MODES for r in (1, 2, 3) for k in (0, 1)]
    recs.append({"round": -1, "mode": "count", "rank": 0, "member_groups": [4, 1], "store_ops": {"set": 2}})
    out = reform.summarize_groups(recs, world=2)
    gated = out["modes"]["gated"]
    assert gated["median_s"]["init_process_group"] == 0.02  # rank 1 is the slower one in every round
    assert gated["median_s"]["initialize_model_parallel"] == 0.2
    assert gated["samples_s"]["initialize_model_parallel"] == [0.1, 0.2, 0.30000000000000004]
    assert out["store_ops_per_rank"] == {"0": {"set": 2}} and out["groups_created_per_rank"] == 2


def test_a_launch_is_read_from_its_record_events_and_probe_files(tmp_path: Path) -> None:
    run, probe = tmp_path / "run", tmp_path / "probe"
    rec = run / "record"
    rec.mkdir(parents=True)
    probe.mkdir()
    t0 = 1000.0
    (rec / "fault.json").write_text(json.dumps({"unix": t0}))
    (rec / "losses.rank0.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"attempt": 0, "unix": t0 - 1, "step": 4}, {"attempt": 1, "unix": t0 + 1.2, "step": 5})))
    (rec / "losses.rank1.jsonl").write_text(json.dumps({"attempt": 1, "unix": t0 + 1.1, "step": 5}))
    (rec / "events.initial0.json").write_text(json.dumps({"events": [
        {"name": "abort_end", "iteration": 0, "unix": t0 + 0.2}, {"name": "initialize", "iteration": 1, "unix": t0 + 0.3},
        {"name": "first_step_end", "iteration": 1, "unix": t0 + 1.2}]}))
    (rec / "events.initial4.json").write_text(json.dumps({"events": [
        {"name": "initialize", "iteration": 1, "unix": t0 + 0.35}]}))
    (probe / "probe.11.json").write_text(json.dumps({"process": 0, "spans": [
        ["torch.new_group", t0 + 0.5, t0 + 0.51, "MainThread"], ["torch.new_group", t0 + 0.52, t0 + 0.55, "MainThread"],
        ["mcore.initialize_model_parallel", t0 + 0.5, t0 + 0.8, "MainThread"]]}))
    res = reform.analyse_launch(run, probe)
    assert abs(res["mttr_s"] - 1.2) < 1e-9  # the slowest rank's first step after the kill
    assert abs(res["milestones_s"]["initialize"] - 0.35) < 1e-9  # the latest process
    assert abs(res["milestones_s"]["mcore.initialize_model_parallel"] - 0.8) < 1e-9
    assert abs(res["spans_s"]["torch.new_group"]["0"] - 0.04) < 1e-9 and res["span_calls"]["torch.new_group"]["0"] == 2
    summary = reform.summarize_launches([{**res, "mode": "gated"}])
    assert summary["measured"] == 1 and abs(summary["spans_slowest_s"]["mcore.initialize_model_parallel"] - 0.3) < 1e-9
