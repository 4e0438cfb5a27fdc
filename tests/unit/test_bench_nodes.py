"""``python -m tools.bench --nodes``: its grid, faults, per-launch figures and ratios (pure, on made-up records)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench import nodes
from tools.bench.nodes import Point


def test_the_grids_parse_and_every_point_has_a_spare_node_that_covers_a_lost_node() -> None:
    full = nodes.parse_grid(nodes.GRID_FULL)
    assert {p.per_node for p in full} == {1, 2, 4} and {p.world for p in full} == {4, 8, 16}
    assert nodes.parse_grid(nodes.GRID_QUICK) == (Point(4, 1), Point(4, 2))
    p = Point(8, 4)
    assert (p.spares, p.nodes, p.processes, p.name) == (4, 3, 12, "8x4")
    assert (Point(4, 1).nodes, Point(4, 1).processes) == (5, 5)
    assert nodes.parse_grid(" 4x2, 4x2 ,8x2") == (Point(4, 2), Point(8, 2))


@pytest.mark.parametrize("bad", ["4x4", "4", "2x1x1", "6x4", "", "4x0"])
def test_a_point_that_does_not_fill_two_whole_nodes_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        nodes.parse_grid(bad)


def test_faults_kill_node_1_whole_or_one_rank_alone(tmp_path: Path) -> None:
    p = Point(8, 2)
    assert nodes.fault_spec(p, "node", 4) == {"target": "node", "node": 1, "step": 4, "phase": "optimizer",
                                               "signal": "SIGKILL"}
    assert nodes.fault_spec(p, "rank", 4)["rank"] == 7 and nodes.fault_spec(p, "rank", 4, "first")["rank"] == 2
    assert nodes.lost_processes(p, "node") == (2, 3) and nodes.lost_processes(p, "rank") == (7,)
    assert nodes.lost_processes(p, "rank", "first") == (2,)
    assert nodes.lost_processes(Point(4, 1), "node") == (1,)
    with pytest.raises(ValueError):
        nodes.fault_spec(p, "rack", 4)
    with pytest.raises(ValueError):
        nodes.victim_rank(p, "middle")
    cfg = nodes.job_config(tmp_path / "c.yaml", point=p, fault="node", step=4, interval_s=0.5, timeout_s=3.0,
                           report_dir=tmp_path / "reports")
    from neighbor_ckpt.config import NeighborCkptConfig

    c = NeighborCkptConfig.from_yaml(cfg)
    assert (c.inprocess.enabled, c.inprocess.spares, c.detector.timeout_s, c.detector.interval_s) == (True, 2, 3.0, 0.5)
    (fault,) = c.fault_injection.planned()
    assert (fault.target, fault.node, fault.step) == ("node", 1, 4)


def test_a_launch_is_measured_from_the_earliest_fault_line(tmp_path: Path) -> None:
    t0 = 1000.0
    (tmp_path / "faults.jsonl").write_text(json.dumps({"unix": t0 + 0.01}) + "\n" + json.dumps({"unix": t0}) + "\n")
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "recovery_timeline.attempt0.1.json").write_text(json.dumps({
        "mode": "in-process", "mttr_s": 4.2, "phases_s": {"detect": 0.25}, "spare_ranks": [3, 2],
        "detect_from": "the fault: last heartbeat of process 3 seen by process 4",
        "events_unix": {"fault": t0 - 0.1, "failure_noticed": t0 + 0.3, "first_step_end": t0 + 5.0}}))
    log = ("[rank4] x ERROR process 4: node node1 is lost: process 3 sent no heartbeat for 3.4 s "
           "(detector.timeout_s 3) and its launcher none for 3.4 s: declaring its process(es) [2, 3] dead together\n")
    watch = {"dead_unix": {"2": t0 + 3.5, "3": t0 + 3.5}, "dead_why": {"2": "silent: ...", "3": "silent: ..."}}
    m = nodes.measure(tmp_path, log, watch, (2, 3))
    assert m["fault_unix"] == t0
    assert m["detect_s"] == pytest.approx(3.5) and m["noticed_s"] == pytest.approx(0.3)
    assert m["mttr_s"] == pytest.approx(5.0) and m["timeline_mttr_s"] == 4.2 and m["timeline_detect_s"] == 0.25
    assert m["spare_ranks"] == [2, 3] and m["node_decisions"] == [("node1", (2, 3))]
    assert nodes.measure(tmp_path, log, watch, (2, 3, 4))["detect_s"] is None, "a lost process never declared"
    empty = nodes.measure(tmp_path / "nothing", "", None, (1,))
    assert empty["detect_s"] is None and empty["mttr_s"] is None and empty["node_decisions"] == []


def _row(world: int, per_node: int, fault: str, detect: float | None, mttr: float | None, exit: int = 0) -> dict:
    p = Point(world, per_node)
    return {"world": world, "per_node": per_node, "fault": fault, "processes": p.processes, "nodes": p.nodes,
            "exit": exit, "detect_s": detect, "noticed_s": 0.2, "mttr_s": mttr, "timeline_detect_s": 0.2,
            "timeline_mttr_s": mttr}


def test_summary_ratios_against_one_rank_per_node_and_growth_with_the_world() -> None:
    rows = [_row(8, 1, "node", 3.5, 6.0), _row(8, 1, "node", 3.7, 6.4),  # median 3.6, 6.2
            _row(8, 2, "node", 3.9, 7.0), _row(8, 4, "node", 8.0, 12.0),
            _row(8, 2, "rank", 0.2, 4.0), _row(16, 2, "rank", 0.3, 6.0), _row(16, 2, "rank", None, None, exit=1),
            _row(4, 2, "node", 3.6, 5.0), _row(16, 2, "node", 3.7, 9.0)]
    s = nodes.summarize(rows, period_s=3.5)
    cell = {(p["world"], p["per_node"], p["fault"]): p for p in s["points"]}
    assert cell[(8, 1, "node")]["detect_s"] == pytest.approx(3.6) and cell[(8, 1, "node")]["measured"] == 2
    assert (cell[(16, 2, "rank")]["launches"], cell[(16, 2, "rank")]["measured"]) == (2, 1), "a failed launch: left out"
    vs = {v["per_node"]: v for v in s["node_vs_one_per_node"]}
    assert set(vs) == {2, 4} and all(v["world"] == 8 for v in vs.values())
    assert vs[2]["ratio"] == pytest.approx(3.9 / 3.6) and vs[2]["within_one_period"] is True
    assert vs[4]["excess_s"] == pytest.approx(4.4) and vs[4]["within_one_period"] is False
    assert vs[4]["one_rank_at_a_time_s"] == 14.0
    growth = {(g["fault"], g["per_node"], g["world"]): g for g in s["growth"]}
    assert set(growth) == {("node", 2, 4), ("node", 2, 8), ("node", 2, 16), ("rank", 2, 8), ("rank", 2, 16)}
    assert growth[("node", 2, 16)]["mttr_ratio"] == pytest.approx(9.0 / 5.0)
    assert growth[("node", 2, 4)]["base_world"] == 4
    assert growth[("rank", 2, 16)]["detect_ratio"] == pytest.approx(1.5)
    text = nodes.report(s)
    assert "within one period" in text and "MORE than one period" in text and "world 16" in text


@pytest.mark.parametrize("spec", nodes.GRID_FULL.split(","))
def test_the_last_rank_taken_by_a_spare_on_the_spare_node_leaves_the_ring_as_it_was(spec: str) -> None:
    """Why the rank fault kills the last rank by default: the next generation's ``cross_node`` ring (computed from
    the nodes the ranks then run on) is the ring whose replicas exist, so the spare finds the lost rank's replica."""
    from neighbor_ckpt.snapshot.topology import ring_order

    (p,) = nodes.parse_grid(spec)
    before = [f"node{r // p.per_node}" for r in range(p.world)]
    spare_node = f"node{p.world // p.per_node}"
    for victim in ("last", "node"):
        after = list(before)
        lost = nodes.lost_processes(p, "rank" if victim == "last" else "node")
        for r in lost:
            after[r] = spare_node
        assert ring_order(range(p.world), after, "cross_node") == ring_order(range(p.world), before, "cross_node")
