"""End to end, nodes of several ranks in process (plain megatron-core loop): a whole node lost at once is one failure.

2 simulated nodes x 2 ranks (``node0``: ranks 0, 1; ``node1``: ranks 2, 3) and, where said, a spare node of 2 hot
spares (``node2``: processes 4, 5), as ``neighbor-ckpt launch`` starts a job with ``trainer.num_nodes: 2`` and
``trainer.devices: 2`` on one machine (:func:`neighbor_ckpt.cli.launch.simulated_nodes`): one of our launchers per
node, each with its processes, its own host store directory and a store host. The DP ring crosses nodes (node ids
``node<i>``), so every rank's replica lives on the other node.

In step 5 node 1 is lost whole: its ranks SIGKILL their launcher, which takes its processes and its store host with it
(parent-death signal), so nobody reports an exit. The next node's first process watches node 1's last process and
node 1's launcher: both silent, it declares both of node 1's processes dead in one decision. The spare node takes
both ranks and pulls their state from node 0 (or, with ``elastic.enabled`` and one spare for two lost ranks, the
spare takes one and the job goes on at DP 3). Compared with the failure-free run of the same topology: bit for bit (or within 1e-4 after
a shrink).

Two nodes alone never survive a node lost whole: one node of two is no majority, and from node 0 a lost node and a
cut network look the same, so node 0 stops (cut off from the majority) rather than train beside a node 1 that may
go on. The layouts that lose a node therefore have a third node (a spare node, of one spare where the test is about
running short of spares)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import Baselines, RunResult, assert_same_training, warm_workers
from tests.e2e.inprocess_launch import (assert_no_orphans, attempts, failures, launch_config, launch_inprocess,
                                        launcher_exits, timeline)
from tests.e2e.test_elastic import ELASTIC_ENV, _global_losses

pytestmark = pytest.mark.e2e

ACTIVE, DEVICES, KILL_STEP = 4, 2, 5
NODE_KILL = dict(FAULT="kill", KILL_RANK="2,3", KILL_STEP=KILL_STEP, KILL_NODE=1)
"""Both ranks of node 1 kill their launcher (the first one to get there takes the node down)."""


def by_process(res: RunResult) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for a in attempts(res):
        out.setdefault(a["initial_rank"], []).append(a)
    return {p: sorted(v, key=lambda a: a["iteration"]) for p, v in out.items()}


def assert_node_lost_once(res: RunResult, *, watcher: int) -> None:
    """Node 1 was found lost in one decision of process ``watcher`` (the next node's first process), naming both of
    its processes; generation 0 is the only one that failed; node 1's launcher died by SIGKILL."""
    assert "node node1 is lost: process 3 sent no heartbeat for" in res.log, res.log[-6000:]
    assert "declaring its process(es) [2, 3] dead together" in res.log, res.log[-6000:]
    assert "process 2 sent no heartbeat" not in res.log, "node 1's processes were found one after the other"
    assert {g for g, _, _ in failures(res)} == {0}, failures(res)
    assert launcher_exits(res)["node1"] == -9, launcher_exits(res)
    assert f"process {watcher}: node node1 is lost" in res.log


def assert_survivors_kept(res: RunResult, survivors: tuple[int, ...]) -> None:
    procs = by_process(res)
    for p in survivors:
        assert [a["iteration"] for a in procs[p]] == [0, 1], procs[p]
        assert len({(a["pid"], a["pid_start"]) for a in procs[p]}) == 1, f"process {p} changed: {procs[p]}"


@pytest.fixture(scope="module")
def nodes_baseline(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    with warm_workers():
        res = launch_inprocess(tmp_path_factory.mktemp("nodes-base"), active=ACTIVE, spares=2, devices=DEVICES,
                               STEPS=10, FAULT="none")
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert failures(res) == [], failures(res)
    return res


def test_a_node_of_two_ranks_lost_whole_is_one_failure_and_the_spare_node_takes_both_ranks_bit_exact(
        nodes_baseline: RunResult, tmp_path) -> None:
    res = launch_inprocess(tmp_path, active=ACTIVE, spares=2, devices=DEVICES, STEPS=10, **NODE_KILL)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert_same_training(nodes_baseline, res, nranks=ACTIVE)
    assert_node_lost_once(res, watcher=4)
    assert_survivors_kept(res, (0, 1))
    procs = by_process(res)
    # the spare node took both ranks of node 1; each pulled its rank's state from node 0, where its replica lives
    assert sorted((procs[p][0]["iteration"], procs[p][0]["rank"]) for p in (4, 5)) == [(1, 2), (1, 3)], procs
    for r in (2, 3):
        rep = res.report(r, 1)
        assert (rep["outcome"], rep["iteration"], rep["source"]) == ("restored", KILL_STEP - 1, "replica"), rep
    tl = timeline(res, "0.1")
    assert tl["mode"] == "in-process" and tl["restarted_ranks"] == [] and sorted(tl["spare_ranks"]) == [2, 3], tl
    assert not (res.out / "reports" / "recovery_timeline.attempt0.2.json").exists(), "one recovery, one timeline"
    assert {n: c for n, c in launcher_exits(res).items() if n != "node1"} == {"node0": 0, "node2": 0}


def test_a_second_node_lost_during_the_recovery_restarts_the_job_on_the_last_spare_node_bit_exact(
        nodes_baseline: RunResult, tmp_path) -> None:
    """Two spare nodes (node 2, node 3). Node 1 is lost whole in step 5; while node 2's processes load ranks 2 and
    3's state, node 2 is lost whole too: in-process recovery gives up (a failure during the recovery, announced),
    the launchers restart the job without the two lost nodes (the processes left cover the ranks: node 3's spares
    take ranks 2 and 3) and it finishes bit for bit, restored from node 0's host memory."""
    res = launch_inprocess(tmp_path, active=ACTIVE, spares=4, devices=DEVICES, max_restarts=1, STEPS=10,
                           RECOVERY_KILL_RANK=2, RECOVERY_KILL_NODE=1, **NODE_KILL)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert_same_training(nodes_baseline, res, nranks=ACTIVE)
    assert "node node1 is lost" in res.log and "in-process recovery gives up" in res.log, res.log[-6000:]
    assert "restart 1: node(s) node1, node2 lost for good" in res.log, res.log[-6000:]
    assert "spares take their places" in res.log
    assert launcher_exits(res) == {"node0": 0, "node1": -9, "node2": -9, "node3": 0}, launcher_exits(res)
    restarted = attempts(res, launch=1)
    assert sorted(a["rank"] for a in restarted if a["initial_rank"] in (6, 7) and a["rank"] is not None) == [2, 3], \
        restarted


@pytest.mark.cold  # a hung node's processes must go with its launcher: a warm fork's watch thread would be stopped
def test_a_node_that_hangs_whole_is_one_failure_and_the_spare_node_takes_both_ranks_bit_exact(
        nodes_baseline: RunResult, tmp_path) -> None:
    """Node 1's launcher and both its ranks SIGSTOPped in step 5 (its store host runs on): the same one decision (its
    last process and its launcher silent), the spare node takes ranks 2 and 3, bit for bit; once the job completed
    the launch ends the launcher that is still stopped, and node 1's processes with it."""
    res = launch_inprocess(tmp_path, active=ACTIVE, spares=2, devices=DEVICES, STEPS=10,
                           **{**NODE_KILL, "FAULT": "stop"})
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert_same_training(nodes_baseline, res, nranks=ACTIVE)
    assert_node_lost_once(res, watcher=4)
    assert "is still stopped (its node hung for good): SIGKILL" in res.log, res.log[-4000:]


@pytest.fixture(scope="module")
def nodes_elastic_baseline(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    with warm_workers():
        res = launch_inprocess(tmp_path_factory.mktemp("nodes-elastic-base"), active=ACTIVE, spares=0,
                               devices=DEVICES, FAULT="none", **ELASTIC_ENV)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    return res


def test_a_node_lost_with_one_spare_for_two_ranks_under_elastic_goes_on_at_dp2_with_the_same_samples(
        nodes_elastic_baseline: RunResult, tmp_path) -> None:
    """A third node of one spare (the majority with node 0: 3 processes of 5): node 1 lost whole, one spare for two
    ranks: the spare takes rank 2 and the job goes on at DP 3 (the global batch divides by 3), the same samples."""
    res = launch_inprocess(tmp_path, active=ACTIVE, spares=1, devices=DEVICES, ELASTIC=1, **NODE_KILL, **ELASTIC_ENV)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert_node_lost_once(res, watcher=4)
    assert_survivors_kept(res, (0, 1))
    assert "continuing on 3 of 4 ranks (elastic)" in res.log, res.log[-6000:]
    base, got = _global_losses(nodes_elastic_baseline), _global_losses(res)
    steps = ELASTIC_ENV["STEPS"]
    assert sorted(got) == list(range(steps)), sorted(got)
    for step in range(steps):
        ref = base[step][-1]
        for rec in got[step]:
            assert rec["consumed_samples"] == ref["consumed_samples"], (step, rec, ref)
            if step < KILL_STEP:
                assert (rec["loss"], rec["dp"]) == (ref["loss"], 4), (step, rec)
            else:
                a, b = float.fromhex(rec["loss"]), float.fromhex(ref["loss"])
                assert rec["dp"] == 3 and abs(a - b) <= 1e-4 * abs(b), (step, a, b)
    tl = timeline(res, "0.1")
    assert (tl["data_parallel_before"], tl["data_parallel_after"]) == (4, 3), tl


@pytest.mark.timeout(2400)
def test_nemo_recipe_on_two_nodes_of_two_ranks_loses_node_1_whole_and_the_spare_node_takes_it_bit_exact(
        baseline: Baselines, tmp_path) -> None:
    """``neighbor-ckpt launch configs/gpt_tiny_cpu.yaml trainer.num_nodes=2 trainer.devices=2`` in process with 2
    spares (a spare node), ``fault_injection.target: node``, ``node: 1`` in step 5: node 1's launcher, store host and
    both ranks die at once; one decision declares both; the spare node takes ranks 2 and 3. Compared with the
    failure-free run of the same job file on one node of 4 (the numbers do not depend on where the ranks run: same
    ranks, same data), bit for bit."""
    pytest.importorskip("nemo.collections.llm")
    base = baseline.launch("gpt_tiny_cpu.yaml", "trainer.max_steps=10", warm=True)
    res = launch_config("gpt_tiny_cpu.yaml", tmp_path / "fault", "trainer.max_steps=10", "trainer.num_nodes=2",
                        "trainer.devices=2", "neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=2",
                        "neighbor_ckpt.fault_injection.enabled=true", "neighbor_ckpt.fault_injection.target=node",
                        "neighbor_ckpt.fault_injection.node=1", "neighbor_ckpt.fault_injection.step=5",
                        timeout=1800)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert sorted(launcher_exits(res).items()) == [("node0", 0), ("node1", -9), ("node2", 0)], launcher_exits(res)
    assert_same_training(base, res)
    assert_node_lost_once(res, watcher=4)
    assert "in-process recovery gives up" not in res.log and not list(res.out.glob("*.launch*"))
    for r in (2, 3):
        rep = res.report(r, 1)
        assert (rep["outcome"], rep["source"]) == ("restored", "replica"), rep
    tls = [json.loads(p.read_text()) for p in (tmp_path / "fault" / "run").rglob("recovery_timeline.*.json")]
    assert [(t["mode"], sorted(t["spare_ranks"])) for t in tls] == [("in-process", [2, 3])], tls


def test_a_node_lost_for_good_without_enough_spares_or_elastic_stops_the_restart_at_once_naming_the_setting(
        tmp_path) -> None:
    """One spare (a third node) for two lost ranks, no elastic: in-process recovery gives up (no spare left for rank
    3), the launchers restart the job, and the launchers find node 1 lost for good (its launcher silent, both
    processes declared dead): one line naming the node and the setting, exit 1, without waiting out the rendezvous
    timeout."""
    res = launch_inprocess(tmp_path, active=ACTIVE, spares=1, devices=DEVICES, max_restarts=1, STEPS=10,
                           **NODE_KILL)
    assert res.returncode != 0, res.log[-6000:]
    assert_no_orphans(res)
    assert "no hot spare left to replace the lost rank(s) [3]" in res.log, res.log[-6000:]
    assert "restart 1: node(s) node1 lost for good (processes [2, 3]" in res.log, res.log[-6000:]
    assert "set neighbor_ckpt.elastic.enabled: true" in res.log
    assert "launcher(s) joined within" not in res.log, "waited for the lost node's launcher"
    assert launcher_exits(res) == {"node0": 1, "node1": -9, "node2": 1}, launcher_exits(res)


def test_two_nodes_that_lose_one_whole_stop_cut_off_from_the_majority_and_write_nothing_more(tmp_path) -> None:
    """2 nodes x 2 ranks, no spare: node 1 lost whole leaves 2 processes of 4 and 1 launcher of 2, no majority; from
    node 0 that is what a cut between the nodes looks like, where node 1 might go on. Node 0 declares nobody dead,
    forms no generation, and stops: its processes and its launcher each say "cut off from the majority" once and
    exit 79 (the launch's status); no generation after the first."""
    res = launch_inprocess(tmp_path, active=ACTIVE, spares=0, devices=DEVICES, max_restarts=1, STEPS=10,
                           **NODE_KILL)
    assert res.returncode == 79, res.log[-6000:]
    assert_no_orphans(res)
    assert launcher_exits(res) == {"node0": 79, "node1": -9}, launcher_exits(res)
    assert "declaring its process(es) [2, 3] dead" not in res.log and "generation 1:" not in res.log, res.log[-6000:]
    assert res.log.count("cut off from the majority") >= 1, res.log[-6000:]
    assert "in-process recovery gives up" not in res.log and "restart 1" not in res.log, res.log[-6000:]


def test_a_node_lost_for_good_then_a_failure_in_recovery_restarts_the_job_without_it_at_dp3(
        nodes_elastic_baseline: RunResult, tmp_path) -> None:
    """Elastic, one spare on a third node (the majority with node 0): node 1 lost in step 5, then rank 0 killed while
    it loads the resharded state: in-process recovery gives up, the launchers restart the job, and the restart goes
    on without node 1 (lost for good): the restarted job (node 0's two processes and the spare) reshards the DP-4
    snapshots of node 0's host memory to DP 3 (one version back: the one the dead recovery loaded is never chosen
    again) and finishes, the same samples, the losses within 1e-4 from there."""
    res = launch_inprocess(tmp_path, active=ACTIVE, spares=1, devices=DEVICES, max_restarts=1, ELASTIC=1,
                           RECOVERY_KILL_RANK=0, **NODE_KILL, **ELASTIC_ENV)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert "restart 1: node(s) node1 lost for good (processes [2, 3])" in res.log, res.log[-6000:]
    assert "a smaller data-parallel size" in res.log
    assert launcher_exits(res) == {"node0": 0, "node1": -9, "node2": 0}, launcher_exits(res)
    base, got = _global_losses(nodes_elastic_baseline), _global_losses(res)
    steps = ELASTIC_ENV["STEPS"]
    assert set(range(steps)) <= set(got), sorted(got)
    # The iteration the dead recovery restored (4) is never chosen again (the restore journal): the restarted job
    # reshards iteration 3 and runs steps 4.. at DP 3.
    assert "resharded iteration 3 from data-parallel size 4 (4 ranks) to 3 (3 ranks)" in res.log, res.log[-6000:]
    for step in range(steps):
        ref = base[step][-1]
        first, last = got[step][0], got[step][-1]  # the first launch attempt's, the restarted job's
        assert last["consumed_samples"] == ref["consumed_samples"], (step, last, ref)
        if step < KILL_STEP:
            assert (first["loss"], first["dp"]) == (ref["loss"], 4), (step, first, ref)
        if step >= KILL_STEP - 1:
            a, b = float.fromhex(last["loss"]), float.fromhex(ref["loss"])
            assert last["launch_attempt"] == 1 and last["dp"] == 3 and abs(a - b) <= 1e-4 * abs(b), (step, a, b)
