"""The fault campaign's partition kinds (pure parts): what each draws, the config that injects it, the launch in
network namespaces, and how the judge reads the log (the scenarios of tests/e2e/test_partitions.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.campaign_runs import same_training_runs
from tools.campaign.cases import CUTTING_RANK, KINDS, PARTITIONS, WORLD, Case, Outcome, draw_cases
from tools.campaign.judge import CUT_OFF, partition
from tools.campaign.runner import inprocess_job, write_config
from neighbor_ckpt.cli.launch import LAUNCHER
from neighbor_ckpt.runtime.procs import python_module_command

LAUNCHER_HEAD = python_module_command(LAUNCHER)
"""How a launcher's command line starts (this interpreter, ``-P -m`` the launcher): its own arguments follow."""

PARTITION_KINDS = ("inproc-partition-primary", "inproc-partition-minority-with-spare", "inproc-partition-heal",
                   "inproc-partition-ranks")


def test_the_partition_kinds_come_after_the_earlier_kinds_and_leave_every_earlier_draw_of_a_seed_as_it_was() -> None:
    end = KINDS.index(PARTITION_KINDS[-1]) + 1  # inproc-other-user follows them (test_campaign_other_user.py)
    assert KINDS[end - len(PARTITION_KINDS):end] == PARTITION_KINDS
    earlier = KINDS[:end - len(PARTITION_KINDS)]
    for seed in (7, 149, 2027):
        assert draw_cases(len(earlier), seed, steps=6, kinds=earlier) == draw_cases(len(KINDS), seed, steps=6)[
            :len(earlier)]


@pytest.mark.parametrize("kind, spares, nodes, traffic, heal", [
    ("inproc-partition-primary", 1, [0], "all", None),
    ("inproc-partition-minority-with-spare", 2, [0, WORLD], "all", None),
    ("inproc-partition-heal", 2, [0, WORLD], "all", 10.0),
    ("inproc-partition-ranks", 1, [1], "ranks", None),
])
def test_each_partition_kind_plans_its_cut_in_the_config_of_an_in_process_case_in_namespaces(
        tmp_path: Path, kind: str, spares: int, nodes: list[int], traffic: str, heal: float | None) -> None:
    from neighbor_ckpt.config import NeighborCkptConfig

    drawn = [c for c in draw_cases(3 * len(KINDS), 5, steps=6) if c.kind == kind]
    assert len(drawn) == 3
    for c in drawn:
        assert c.inprocess and c.simulate_network and c.dist_opt and c.tp == 1 and c.phase == "optimizer"
        assert (c.step == 1 if heal else 1 <= c.step <= 4) and not c.may_fall_back
        assert c.expected == "exact" and c.acceptable == ("exact",)
        assert (c.spares, c.devices, list(c.victims), c.rank) == (spares, 1, nodes, nodes[0])
        assert c.flavour == (True, 1, False), "the failure-free run of the other in-process cases"
        assert c.recipe_args() == [], "the config's fault_injection cuts it, not --kill"
        cfg = NeighborCkptConfig.from_yaml(write_config(tmp_path / f"{c.index}.yaml",
                                                        base=write_config(tmp_path / "base.yaml"),
                                                        inprocess_spares=c.spares, faults=c.planned_faults,
                                                        hang=True))
        assert [(f.target, f.rank, f.step, f.phase, f.nodes, f.traffic, f.heal_after_s)
                for f in cfg.fault_injection.planned()] == [
            ("partition", CUTTING_RANK, c.step, "optimizer", nodes, traffic, heal)]
        assert cfg.inprocess.enabled and cfg.inprocess.spares == spares
        # the ranks stall in a collective with their heartbeats alive: the progress tags' bound of test_partitions.py
        assert cfg.detector.hang_timeout_s == 3.0 and cfg.inprocess.abort_timeout_s == 60.0
    assert not any(c.simulate_network for c in draw_cases(len(KINDS), 5, steps=6) if c.kind not in PARTITION_KINDS)


def test_a_partition_case_runs_each_launcher_in_its_nodes_namespace_with_the_stores_on_the_node_addresses(
        tmp_path: Path) -> None:
    from neighbor_ckpt.inprocess.launcher_plan import parse_args
    from neighbor_ckpt.runtime.network_plan import NetworkPlan

    case = next(c for c in draw_cases(len(KINDS), 7, steps=6) if c.kind == "inproc-partition-minority-with-spare")
    nodes = WORLD + case.spares
    plan = NetworkPlan(tag="0abc", nodes=nodes, subnet=3, launch_pid=4242)  # a plan only: nothing is made
    own = write_config(tmp_path / "nckpt.yaml", base=write_config(tmp_path / "base.yaml"),
                       inprocess_spares=case.spares, faults=case.planned_faults)
    procs = inprocess_job(tmp_path / "case", case.recipe_args(), job_id="campaign-7", store=tmp_path / "store",
                          config=own, steps=6, store_port=list(range(4001, 4001 + nodes)),
                          max_restarts=case.max_restarts, spares=case.spares, network=(plan, tmp_path / "plan.json"))
    assert procs.network == plan and len(procs.agents) == nodes == 6
    assert procs.stores == ",".join(f"{plan.address(i)}:{4001 + i}" for i in range(nodes))
    for i, (cmd, _env) in enumerate(procs.agents):
        enter = list(plan.enter(i))
        assert list(cmd[:len(enter)]) == enter, "node i's launcher runs in node i's namespace"
        launcher = list(cmd[len(enter):])
        assert parse_args(launcher[len(LAUNCHER_HEAD):]).node == f"node{i}"


def _run(tmp_path: Path, kind: str) -> tuple[Case, Path, Path]:
    """A finished partition case whose training equals its failure-free run, with the cutting rank's fault record."""
    case = next(c for c in draw_cases(len(KINDS), 2027, steps=6) if c.kind == kind)
    runs = same_training_runs(tmp_path)
    fault = {"rank": CUTTING_RANK, "step": case.step, "phase": "optimizer", "unix": 1_700_000_000.0,
             "target": "partition"}
    (runs[1] / "fault.json").write_text(json.dumps(fault))
    (runs[1] / "faults.jsonl").write_text(json.dumps(fault) + "\n")
    return case, runs[0], runs[1]


def _judge(case: Case, base: Path, run: Path, log: str, *, store: Path | None = None) -> Outcome:
    from tools.campaign.runner import judge_run

    return judge_run(case, out=run, rc=0, log=log, wall=1.0, base=base, work=run.parent, steps=6,
                     config=run / "nckpt.yaml", store=store)


def _cut_off(*processes: int) -> str:
    return "".join(f"[node{p}] 2026-11-28 05:00:00,000 WARNING process {p}: {CUT_OFF} (saw 2 of 6 for 2.0 s): "
                   "exiting with status 76\n" for p in processes)


PRIMARY_LOG = ("[node1] x WARNING fault injection: node(s) [0] cut off (all traffic)\n" + _cut_off(0)
               + "[node4] x INFO neighbor_ckpt: hot spare (process 4) takes rank 0's place in generation 1\n")
MINORITY_LOG = ("[node1] x WARNING fault injection: node(s) [0, 4] cut off (all traffic)\n" + _cut_off(0, 4)
                + "[node5] x INFO neighbor_ckpt: hot spare (process 5) takes rank 0's place in generation 1\n")
HEAL_LOG = MINORITY_LOG + "x neighbor_ckpt netns: fault injection: the partition of node(s) [0, 4] healed after 10 s\n"
RANKS_LOG = ("[node1] x WARNING fault injection: node(s) [1] cut off (ranks traffic)\n"
             "[node0] x WARNING process 0: process(es) [1] unreachable from a majority over the ranks' network\n"
             "[node4] x INFO neighbor_ckpt: hot spare (process 4) takes rank 1's place in generation 1\n")


@pytest.mark.parametrize("kind, log", [("inproc-partition-primary", PRIMARY_LOG),
                                       ("inproc-partition-minority-with-spare", MINORITY_LOG),
                                       ("inproc-partition-heal", HEAL_LOG), ("inproc-partition-ranks", RANKS_LOG)])
def test_a_partition_is_exact_when_the_minority_said_it_is_cut_off_and_a_spare_took_the_rank(
        tmp_path: Path, kind: str, log: str) -> None:
    case, base, run = _run(tmp_path, kind)
    o = _judge(case, base, run, log)
    assert (o.result, o.detail) == ("exact", ""), o


@pytest.mark.parametrize("kind, log, why", [
    ("inproc-partition-primary", PRIMARY_LOG.replace("node(s) [0] cut off", "node(s) [0] not cut"), "not made"),
    ("inproc-partition-primary", PRIMARY_LOG.replace(CUT_OFF, "still here"), "process 0 (cut off) never said"),
    ("inproc-partition-minority-with-spare", MINORITY_LOG.replace(f"process 4: {CUT_OFF}", "process 4: idle"),
     "process 4 (cut off) never said"),
    ("inproc-partition-minority-with-spare",
     MINORITY_LOG + "[node4] x INFO process 4: generation 1: 2 member(s) [0, 4]\n", "formed a generation"),
    ("inproc-partition-heal", MINORITY_LOG, "did not heal"),
    ("inproc-partition-heal", HEAL_LOG + "[node2] x ERROR process 2: declared dead by the others: exiting\n",
     "[2] of the majority fenced"),
    ("inproc-partition-ranks", RANKS_LOG.replace("unreachable", "silent"), "unreachable from a majority"),
    ("inproc-partition-ranks", RANKS_LOG.replace("(process 4) takes rank 1", "(process 4) takes rank 2"),
     "takes rank 1's place"),
])
def test_a_partition_fails_when_the_minority_goes_on_never_says_so_or_the_majority_is_fenced(
        tmp_path: Path, kind: str, log: str, why: str) -> None:
    case, base, run = _run(tmp_path, kind)
    o = _judge(case, base, run, log)
    assert o.result == "FAILED" and why in o.detail, o


def test_a_cut_off_process_its_launcher_stopped_first_counts_as_said_and_is_still_judged_on_what_it_did(
        tmp_path: Path) -> None:
    """The launcher's lease is the backstop of its processes' (a process may be late to look on a loaded machine):
    a process its launcher stopped with the cut-off line did say it, through its launcher; it must still have formed
    no generation."""
    case, base, run = _run(tmp_path, "inproc-partition-minority-with-spare")
    launcher = ("2026-11-28 15:32:13,047 neighbor_ckpt launcher node4 (pid 19684): launcher node4: "
                f"{CUT_OFF} (no majority of the last generation seen for 2.3 s (the lease: 2.25 s) while the store "
                "answers): stopping without writing anything more; exiting with status 79\n")
    quiet = MINORITY_LOG.replace(f"process 4: {CUT_OFF}", "process 4: idle")
    o = _judge(case, base, run, quiet + launcher)
    assert (o.result, o.detail) == ("exact", ""), o
    other = launcher.replace("launcher node4: ", "launcher node3: ")
    o = _judge(case, base, run, quiet + other)
    assert o.result == "FAILED" and "process 4 (cut off) never said it is" in o.detail and "node4" in o.detail, o
    o = _judge(case, base, run, quiet + launcher + "[node4] x INFO process 4: generation 1: 2 member(s) [0, 4]\n")
    assert o.result == "FAILED" and "formed a generation" in o.detail, o


def test_a_minority_node_that_wrote_a_snapshot_slot_after_the_cut_fails(tmp_path: Path) -> None:
    import os

    case, base, run = _run(tmp_path, "inproc-partition-primary")
    slot = tmp_path / "store" / "node0" / "job" / "rank0" / "0.slot"
    slot.parent.mkdir(parents=True)
    slot.write_bytes(b"x")
    os.utime(slot, (1_600_000_000.0, 1_600_000_000.0))  # before the cut: fine
    assert _judge(case, base, run, PRIMARY_LOG, store=tmp_path / "store").result == "exact"
    os.utime(slot, (1_700_000_001.0, 1_700_000_001.0))
    o = _judge(case, base, run, PRIMARY_LOG, store=tmp_path / "store")
    assert o.result == "FAILED" and "node0 (cut off) wrote snapshot slots after the cut" in o.detail, o
    assert partition(PRIMARY_LOG, nodes=[0], traffic="all", heal_after_s=None, processes=5, spare=4, rank=0) == ""


def test_the_campaign_refuses_the_partition_kinds_in_one_line_where_no_network_can_be_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from neighbor_ckpt.errors import ConfigError
    from neighbor_ckpt.runtime import netns
    from tools.campaign import runner

    def refuse() -> None:
        raise ConfigError("launch.simulate_network: true needs root; run as root")

    monkeypatch.setattr(netns, "refuse_impossible", refuse)
    rc = runner.main(["--faults", "1", "--kinds", "inproc-partition-ranks", "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "partition kinds cannot run here" in err and "needs root" in err, err
    assert not (tmp_path / "c" / "baseline-distopt-tp1").exists(), "nothing ran"
    assert set(PARTITIONS) == {"primary", "minority-with-spare", "heal", "ranks"}


def test_a_partitions_mttr_and_detection_are_measured_from_the_cut_not_the_timelines_own_fault_estimate(
        tmp_path: Path) -> None:
    case, base, run = _run(tmp_path, "inproc-partition-primary")  # cut at unix 1_700_000_000
    (run / "reports").mkdir()
    (run / "reports" / "recovery_timeline.attempt0.1.json").write_text(json.dumps({
        "attempt": "0.1", "mode": "in-process", "restarted_ranks": [], "spare_ranks": [0], "mttr_s": 3.5,
        "phases_s": {"detect": 0.0, "reform": 3.4}, "detect_from": "the fault: last heartbeat of process 0 seen by "
                                                                   "process 1",
        "events_unix": {"fault": 1_700_000_020.0, "failure_noticed": 1_700_000_016.5,
                        "first_step_end": 1_700_000_023.5}}))
    o = _judge(case, base, run, PRIMARY_LOG)
    assert o.result == "exact" and (o.detection_s, o.mttr_s) == (16.5, 23.5), o
    assert [(r["mttr_s"], r["detection_s"], r["measured_from"]) for r in o.recoveries] == [(23.5, 16.5, "the cut")]
