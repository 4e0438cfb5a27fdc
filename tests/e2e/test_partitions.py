"""End to end, network partitions between simulated nodes, cut for real (``launch.simulate_network``; root).

Every simulated node of the in-process launch runs in a network namespace of its own (its launcher, store host and
processes; :mod:`neighbor_ckpt.runtime.netns`): the stores, their gates, the processes' store tunnels and gloo all go
over the node addresses. ``fault_injection.target: partition`` cuts the listed nodes off the others in step 5 (rank 1
runs the cut, in the launch's namespace): the veths of the nodes cut off move to a bridge of their own, so they still
reach each other and nobody else; nothing is killed. The plain megatron-core loop (``recipes/mcore_gpt_plain_loop.py``,
its faults from its YAML), 3 ranks, one process per node, spare nodes of their own; each run compared bit for bit
(``==``) with the failure-free run of the same recipe and ranks in namespaces (which also shows that training over
the node addresses changes nothing).

* node 0 (the primary store, rank 0) cut off for good: the majority (nodes 1, 2 and the spare node 3) fails over to a
  standby and finishes on the spare; node 0's process says it is cut off from the majority and writes nothing more;
* a minority holding the primary store and a spare (nodes 0 and 3 of 3 ranks + 2 spare nodes) cut off, healed after
  10 s: the minority never forms a generation, the majority (nodes 1, 2, 4) finishes, nobody of it fenced;
* ``traffic: ranks`` for node 1 (its rank network cut, the stores reachable): every rank stalls in the same
  collective; the majority cannot reach node 1's gloo listeners, so node 1 is blamed and replaced by the spare, as a
  lost node;
* the same cut with node 1 one progress mark ahead (ranks 0 and 2 held before the optimizer step of the cut's step,
  the recipe's ``--hold``): the lagging tags name the larger side, which is never declared dead; node 1 is blamed by
  the reach probe as above.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from neighbor_ckpt.recipes import RECIPES_DIR
from tests.conftest import RunResult, assert_same_training
from tests.e2e.inprocess_launch import assert_no_orphans, failures, launch_inprocess, launcher_exits, load

pytestmark = [pytest.mark.e2e,
              pytest.mark.cold,  # a worker forked from the warm zygote would run outside its node's namespace
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")]

RECIPE = RECIPES_DIR / "mcore_gpt_plain_loop.py"
ACTIVE, CUT_STEP, STEPS = 3, 5, 10
CUT_OFF = "cut off from the majority"


def run_recipe(tmp: Path, *, spares: int, fault: dict[str, Any] | None = None, timeout: float = 600,
               elastic: bool = False, cut_at_start: tuple[int, ...] = (), args: tuple[str, ...] = ()) -> RunResult:
    """The plain megatron-core loop in process, ``ACTIVE`` ranks + ``spares`` spare nodes, each node in its own
    network namespace; ``fault``: the ``neighbor_ckpt.fault_injection`` keys (enabled); ``elastic``:
    ``elastic.enabled``; ``cut_at_start``: nodes cut off (for good) before the launchers start; ``args``: more of the
    recipe's options."""
    nc: dict[str, Any] = {"inprocess": {"enabled": True, "spares": spares},
                          "detector": {"interval_s": 0.2, "timeout_s": 2.0, "hang_timeout_s": 3.0},
                          "report": {"dir": str(tmp / "out" / "reports")}}
    if elastic:
        nc["elastic"] = {"enabled": True}
    if fault is not None:
        nc["fault_injection"] = {"enabled": True, "step": CUT_STEP, "rank": 1, **fault}
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "job.yaml"
    cfg.write_text(yaml.safe_dump({"neighbor_ckpt": nc}))
    program = [str(RECIPE), "--steps", str(STEPS), "--config", str(cfg), "--out", str(tmp / "out"), *args]
    if elastic:  # elastic needs the global batch named; the one the failure-free run derives (2 x 2 x DP 3)
        program += ["--global-batch", str(2 * 2 * ACTIVE)]
    return launch_inprocess(tmp, active=ACTIVE, spares=spares, program=program, simulate_network=True,
                            timeout=timeout, elastic_launchers=elastic, cut_at_start=cut_at_start)


def cut_unix(res: RunResult) -> float:
    """When the cut was made (the fault record of the rank that ran it)."""
    return float(load(res.out / "fault.json")["unix"])


def lines_of(res: RunResult, process: int) -> list[str]:
    """The log lines process ``process`` wrote about itself (the engine's ``process P: ...`` and
    ``process P (rank R): ...``)."""
    return [line for line in res.log.splitlines() if re.search(rf"(INFO|WARNING|ERROR):? process {process}\b", line)]


def written_after(directory: Path, unix: float, pattern: str = "*") -> list[str]:
    """Files under ``directory`` (named as ``pattern``) modified after ``unix``."""
    return sorted(str(p) for p in directory.rglob(pattern) if p.is_file() and p.stat().st_mtime > unix)


def assert_cut_off(res: RunResult, tmp: Path, processes: tuple[int, ...], nodes: tuple[str, ...]) -> None:
    """``processes`` (on ``nodes``, in order) said they are cut off from the majority and exited with the cut-off
    status (or their launcher said it first and stopped them: the launcher's lease backs its processes' up), the
    nodes' launchers too; none of them formed a generation or wrote a snapshot after the cut (no slot of their nodes'
    host stores written since; the reports and timelines are the majority's: :func:`assert_one_recovery_on`; no
    insurance in these jobs). What a process notes before its lease ends (its failure event, ``events.json``) is not
    a snapshot."""
    said = {int(m.group(1)) for m in re.finditer(rf"{CUT_OFF} .*exiting with status (\d+)", res.log)}
    assert len(said) == 1 and 0 not in said, said  # the cut-off status (protocol.EXIT_CUT_OFF), one for all
    (EXIT_CUT_OFF,) = said
    for p, node in zip(processes, nodes, strict=True):
        mine = lines_of(res, p)
        assert any(CUT_OFF in line and f"status {EXIT_CUT_OFF}" in line for line in mine) \
            or f"launcher {node}: {CUT_OFF}" in res.log, res.log[-10000:]
        assert not [line for line in mine if re.search(r": generation [1-9]\d*: ", line)], mine
    exits = launcher_exits(res)
    for n in nodes:
        # A launcher cut off takes its store host along: another launcher of the minority whose lease ran out just
        # after sees that store no more, is in doubt (nothing it writes reaches the majority), waits for a store the
        # majority promoted, and after a heal joins it with nothing left to run. Either way it started nothing.
        in_doubt = f"launcher {n}: no majority seen for" in res.log and re.search(
            rf"launcher {n} .*this node's processes \[\], ", res.log) is not None
        assert exits[n] == EXIT_CUT_OFF or (exits[n] == 0 and in_doubt), (n, exits, res.log[-10000:])
    assert all(code == 0 for n, code in exits.items() if n not in nodes), exits
    cut = cut_unix(res)
    for node in nodes:
        assert written_after(tmp / "store" / node, cut, "*.slot") == [], node


def assert_one_recovery_on(res: RunResult, spare: int, rank: int) -> None:
    """One recovery (one timeline): spare process ``spare`` took rank ``rank``'s place in generation 1."""
    assert f"hot spare (process {spare}) takes rank {rank}'s place in generation 1" in res.log, res.log[-10000:]
    timelines = sorted(p.name for p in (res.out / "reports").glob("recovery_timeline.*.json"))
    assert timelines == ["recovery_timeline.attempt0.1.json"], timelines
    assert load(res.out / "reports" / timelines[0])["spare_ranks"] == [rank]
    reports = sorted(p.name for p in res.out.glob("report.rank*.json"))
    assert reports == sorted(f"report.rank{r}.attempt0{a}.json" for r in range(ACTIVE) for a in ("", ".1")), reports


@pytest.fixture(scope="module")
def partition_baseline(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    res = run_recipe(tmp_path_factory.mktemp("partition-base"), spares=1)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert failures(res) == [], failures(res)
    return res


def test_node_0_with_the_primary_store_cut_off_for_good_the_majority_finishes_on_the_spare_bit_exact(
        partition_baseline: RunResult, tmp_path: Path) -> None:
    res = run_recipe(tmp_path, spares=1, fault={"target": "partition", "nodes": [0]})
    assert res.returncode == 0, res.log[-10000:]
    assert_no_orphans(res)
    assert_same_training(partition_baseline, res, nranks=ACTIVE)
    assert "fault injection: node(s) [0] cut off (all traffic)" in res.log
    assert_cut_off(res, tmp_path, (0,), ("node0",))
    assert_one_recovery_on(res, spare=3, rank=0)


def test_a_minority_with_the_primary_store_and_a_spare_never_forms_a_generation_and_healed_is_one_training(
        partition_baseline: RunResult, tmp_path: Path) -> None:
    """Nodes 0 and 3 cut off: they stop, cut off, within the lease (writing no slot), long before the cut heals at
    10 s; the majority finishes on spare 4 bit for bit, and after the heal nobody of it is fenced. (The same cut for
    good is the same run up to the heal: the minority has stopped by then.)"""
    res = run_recipe(tmp_path, spares=2, fault={"target": "partition", "nodes": [0, 3], "heal_after_s": 10})
    assert res.returncode == 0, res.log[-10000:]
    assert_no_orphans(res)
    assert_same_training(partition_baseline, res, nranks=ACTIVE)
    assert "fault injection: the partition of node(s) [0, 3] healed after 10 s" in res.log, res.log[-10000:]
    for p in (1, 2, 4):
        assert not [line for line in lines_of(res, p) if "declared dead by the others" in line], lines_of(res, p)
    assert_cut_off(res, tmp_path, (0, 3), ("node0", "node3"))  # within the lease, long before the heal
    assert_one_recovery_on(res, spare=4, rank=0)


def test_the_ranks_network_of_one_node_cut_is_recovered_like_a_lost_node_bit_exact(
        partition_baseline: RunResult, tmp_path: Path) -> None:
    res = run_recipe(tmp_path, spares=1, fault={"target": "partition", "nodes": [1], "traffic": "ranks"})
    assert res.returncode == 0, res.log[-10000:]
    assert_no_orphans(res)
    assert_same_training(partition_baseline, res, nranks=ACTIVE)
    assert "fault injection: node(s) [1] cut off (ranks traffic)" in res.log
    assert "process(es) [1] unreachable from a majority over the ranks' network" in res.log, res.log[-10000:]
    assert [(g, k) for g, k, _ in failures(res)] == [(0, "hung")], failures(res)
    assert "neighbor_ckpt: hot spare (process 3) takes rank 1's place in generation 1" in res.log, res.log[-10000:]


def test_a_cut_of_the_ranks_network_whose_smaller_side_is_one_progress_mark_ahead_never_evicts_the_larger_bit_exact(
        partition_baseline: RunResult, tmp_path: Path) -> None:
    """Ranks 0 and 2 hold just before their optimizer step 5 (``--hold``: the larger side stops one progress mark
    short); rank 1 enters it (its step tag, one mark more), cuts its node's rank network and blocks in the step's first
    collective. Every training thread stalls; the lagging tags are the larger side's, 2 of the 4 members: no minority,
    so nobody declares them (on 2c061fd they were declared dead as laggards and the job stopped: no spare for two
    ranks). The reach probe blames node 1, which the majority cannot reach; the spare takes rank 1, ranks 0 and 2 are
    freed from their hold by the abort and train on, bit for bit."""
    res = run_recipe(tmp_path, spares=1, fault={"target": "partition", "nodes": [1], "traffic": "ranks"},
                     args=("--hold", f"0,2:{CUT_STEP}"), timeout=300)
    assert res.returncode == 0, res.log[-10000:]
    assert_no_orphans(res)
    assert_same_training(partition_baseline, res, nranks=ACTIVE)
    assert sorted(load(p)["rank"] for p in res.out.glob("fault.hold.rank*.json")) == [0, 2]
    assert "fault injection: node(s) [1] cut off (ranks traffic)" in res.log
    assert "the lagging process(es) [0, 2] are no minority of generation 0" in res.log, res.log[-10000:]
    assert "process(es) [1] unreachable from a majority over the ranks' network" in res.log, res.log[-10000:]
    assert [(g, k) for g, k, _ in failures(res)] == [(0, "hung")], failures(res)
    # only the smaller side is declared dead: its launcher kills it, nobody else is killed or fenced
    killed = {int(p) for p in re.findall(r"process (\d+) \(pid \d+\) is listed dead", res.log)}
    fenced = {p for p in range(ACTIVE + 1) if any("declared dead by the others" in line for line in lines_of(res, p))}
    assert killed | fenced == {1}, (killed, fenced)
    assert not re.search(r"declaring (it|its process\(es\)) .*dead", res.log), res.log[-10000:]
    assert_one_recovery_on(res, spare=3, rank=1)


def test_node_0_cut_off_during_the_roll_call_forms_nothing_and_the_majority_trains_on_a_standby_bit_exact(
        partition_baseline: RunResult, tmp_path: Path) -> None:
    """Node 0 (the primary store's host, rank 0) cut off before the launchers start, ``elastic.enabled``: alone it
    reaches its store, and with elastic its process could train; on 2c061fd its roll call declared the others never
    started and it formed generation 0 beside them. Now node 0's side forms no generation and says it is cut off from
    the majority; nodes 1, 2 and the spare node 3 promote standby 1 and train there, the spare in rank 0's place, bit
    for bit; nothing of node 0 is written after the cut."""
    res = run_recipe(tmp_path, spares=1, elastic=True, cut_at_start=(0,))
    assert res.returncode == 0, res.log[-10000:]
    assert_no_orphans(res)
    assert_same_training(partition_baseline, res, nranks=ACTIVE)
    assert "node(s) [0] cut off before the launchers start" in res.log, res.log[-10000:]
    said = re.search(rf"launcher node0: {CUT_OFF} \(.*1 of the 4 launchers are no majority", res.log)
    assert said, res.log[-10000:]
    assert not [line for line in lines_of(res, 0) if re.search(r": generation \d+: ", line)], lines_of(res, 0)
    exits = launcher_exits(res)
    assert exits.pop("node0") == 79 and set(exits.values()) == {0}, launcher_exits(res)
    assert not list((tmp_path / "store" / "node0").rglob("*.slot")), "node 0 wrote no snapshot"
