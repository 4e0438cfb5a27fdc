"""The store survives the node that hosts it (issue 29): every simulated node's launcher runs a store host, node 0's
is the primary, the others hot standbys (:mod:`neighbor_ckpt.inprocess.stores`). Real launchers, real store host
processes, real SIGKILL and SIGSTOP; the training is compared bit for bit with the failure-free run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import RunResult, assert_same_training
from tests.e2e.inprocess_launch import assert_no_orphans, failures, launch_inprocess, launcher_exits, load
from tests.e2e.test_inprocess_recovery import ACTIVE, by_process

pytestmark = pytest.mark.e2e


def store_moves(res: RunResult) -> list[tuple[str, int, int]]:
    """``(who, old epoch, new epoch)`` of every move to another store the log shows."""
    return [(who, int(a), int(b)) for who, a, b in
            re.findall(r"(process \d+|launcher:node\d+): store epoch (\d+) -> (\d+)", res.log)]


def test_the_node_hosting_the_store_is_lost_and_the_next_generation_forms_on_a_standby(
        inprocess_baseline: RunResult, tmp_path: Path) -> None:
    """Node 0 (its launcher, the primary store host it runs and rank 0) is SIGKILLed inside rank 0's optimizer step
    5, one hot spare. The survivors and the launchers lose the store, move to store 1 (node 1's standby), write
    again what it must know, and generation 1 forms there without rank 0, which the spare replaces: bit for bit,
    nothing restarted on the lost node's behalf."""
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="kill", KILL_RANK=0, KILL_STEP=5, STORE_NODE="1")
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert res.log.count(", a gate before the store on 127.0.0.1:") == ACTIVE + 1, "every store behind the job's token"
    assert "refused a client" not in res.log and "refused this process's token" not in res.log
    assert load(res.out / "fault.json")["rank"] == 0
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    moves = store_moves(res)
    assert moves and all((a, b) == (0, 1) for _, a, b in moves), moves
    movers = {who for who, _, _ in moves}
    assert {f"process {p}" for p in (1, 2, 3, ACTIVE)} <= movers, moves
    assert {f"launcher:node{i}" for i in (1, 2, 3, ACTIVE)} <= movers, moves
    kinds = {k for g, k, _ in failures(res) if g == 0}
    assert kinds <= {"store", "silent", "exited", "exception"}, failures(res)
    procs = by_process(res)
    assert [(a["iteration"], a["rank"]) for a in procs[ACTIVE]] == [(1, 0)], procs.get(ACTIVE)
    for p in (1, 2, 3):
        assert [a["iteration"] for a in procs[p]] == [0, 1] and len({a["pid"] for a in procs[p]}) == 1, procs[p]
    rep = res.report(0, 1)
    assert (rep["outcome"], rep["iteration"], rep["source"]) == ("restored", 4, "replica"), rep
    assert "in-process recovery gives up" not in res.log
    exits = launcher_exits(res)
    assert exits.pop("node0") == -9 and set(exits.values()) == {0}, launcher_exits(res)


def test_a_stopped_store_host_is_left_behind_and_fenced_when_it_resumes(inprocess_baseline: RunResult,
                                                                       tmp_path: Path) -> None:
    """The primary store host is SIGSTOPped inside rank 0's optimizer step 5 and resumed 15 s later. Its clients'
    operations go unanswered: every process and launcher moves to store 1. Training needs no store between steps, so
    by then the ranks may still be training (generation 0 fails, kind ``store``, and generation 1 forms on store 1
    with the same processes: nobody died) or may have finished (their ``finished`` entries, written again on store 1,
    complete the job there). When the old host resumes it has lost its epoch: its launcher stops it (fenced) and
    nothing goes back to it. Bit for bit either way."""
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="none", STOP_STORE_AT_STEP=5, STOP_STORE_FOR=15)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert load(res.out / "fault.json")["kind"] == "stop_store"
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    moves = store_moves(res)
    assert moves and all((a, b) == (0, 1) for _, a, b in moves), moves
    assert {f"process {p}" for p in range(ACTIVE + 1)} <= {who for who, _, _ in moves}, moves
    assert {k for _, k, _ in failures(res)} <= {"store"}, failures(res)
    assert re.search(r"store 0 hosted here: stale since store 1 took over \(fenced\): stopping it", res.log), \
        res.log[-8000:]
    procs = by_process(res)
    runs = [0, 1] if failures(res) else [0]  # still training when the store went, or finished already
    for p in range(ACTIVE):
        assert [a["iteration"] for a in procs[p]] == runs and {a["rank"] for a in procs[p]} == {p}, procs[p]
    assert "in-process recovery gives up" not in res.log
    assert set(launcher_exits(res).values()) == {0}, launcher_exits(res)
