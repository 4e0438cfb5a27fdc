"""End to end, the single-machine in-process launch's start and end: no silent waits.

4 active ranks + 1 hot spare of the plain megatron-core loop, one launcher per simulated node, as ``neighbor-ckpt
launch`` starts them (:mod:`tests.e2e.inprocess_launch`):

* a store port another process takes between its choice and the launch: the launch binds another one and the job
  trains bit for bit as the failure-free one;
* a store host that cannot listen for the whole launch (a cluster's launchers bind their own ports): its launcher
  says so in one line naming the node and the port, its process is declared dead before it starts, the spare takes
  its rank, bit for bit, and nothing waits for a barrier or a rendezvous to time out;
* a launcher that reaches no store (its store list points to ports nobody listens on): it says so in one line and
  exits; the other launchers' roll call declares its process dead once the first process is ready, and the spare takes
  its rank, bit for bit, with no barrier or rendezvous timeout;
* a grow-back replacement still starting when the job completes: it finds the completion marker and exits 0 without
  a store, and its launcher ends with the others.

Behaviour only (what was logged, who took which rank, exit statuses), never a wall-clock limit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import RunResult, assert_same_training
from tests.e2e.inprocess_launch import (assert_no_orphans, attempts, failures, launch_inprocess, launcher_exits,
                                        load)

pytestmark = pytest.mark.e2e

ACTIVE = 4
SILENT_WAITS = ("inprocess.barrier_timeout_s", "did not form within", "launcher(s) joined within",
                "has not answered for")


def ranks_by_process(res: RunResult) -> dict[int, list[tuple[int, int]]]:
    """Process index -> its (generation, rank) records."""
    out: dict[int, list[tuple[int, int]]] = {}
    for a in attempts(res):
        out.setdefault(a["initial_rank"], []).append((a["iteration"], a["rank"]))
    return {p: sorted(v) for p, v in out.items()}


def test_a_store_port_taken_between_its_choice_and_the_launch_is_replaced(inprocess_baseline: RunResult,
                                                                          tmp_path: Path) -> None:
    """The runner takes the primary store's port after the launch chose it and holds it for the whole launch: the
    launch binds another port for the primary, every launcher and process uses that one, the job trains bit for bit
    and nothing fails."""
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="none", steal_store=0)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    taken = re.search(r"port (\d+) of store 0 taken by the runner", res.log)
    assert taken, res.log[-8000:]
    assert re.search(rf"store 0 \(node node0\): port {taken.group(1)} was taken since it was chosen \(.*\): port "
                     rf"\d+ instead", res.log), res.log[-8000:]
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    assert failures(res) == [], failures(res)
    assert set(launcher_exits(res).values()) == {0}, launcher_exits(res)


def test_a_store_host_that_cannot_listen_declares_its_process_dead_and_the_spare_takes_its_rank(
        inprocess_baseline: RunResult, tmp_path: Path) -> None:
    """node2's store port is held by another process for the whole launch and the store hosts bind their own ports
    (as on a cluster): node2's launcher says so in one line (node, store, port, cause), declares process 2 dead before
    it starts (``exited by launcher:node2``), and the spare (process 4) takes rank 2 from the start. Bit for bit; no
    barrier, rendezvous or store timeout in the log."""
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="none", hold_store=2)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    held = re.search(r"port (\d+) of store 2 taken by the runner", res.log)
    assert held, res.log[-8000:]
    line = re.search(rf"node node2 cannot host store 2: port {held.group(1)}: the store host exited with status 1 "
                     r"\(cannot listen on 127\.0\.0\.1:\d+: Address already in use\): its process\(es\) \[2\] are "
                     r"declared dead", res.log)
    assert line, res.log[-8000:]
    for wait in SILENT_WAITS:
        assert wait not in res.log, f"a silent wait ({wait!r}): {res.log[-8000:]}"
    assert "in-process recovery gives up" not in res.log
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    procs = ranks_by_process(res)
    assert 2 not in procs, f"process 2 never started: {procs.get(2)}"
    assert procs[4][-1][1] == 2 and all(r == 2 for _, r in procs[4]), procs
    assert (0, "exited", "launcher:node2") in failures(res), failures(res)
    assert set(launcher_exits(res).values()) == {0}, launcher_exits(res)


def test_a_launcher_that_reaches_no_store_exits_at_once_and_the_spare_takes_its_rank(inprocess_baseline: RunResult,
                                                                                      tmp_path: Path) -> None:
    """node2's launcher gets a store list of ports nobody listens on: it says so in one line naming every store it
    tried and exits ``EXIT_NO_STORE`` without starting anything; the other launchers' roll call declares process 2
    dead once the first process is ready and the bound passed (never started), and the spare (process 4) takes rank
    2 in generation 0's barrier. Bit for bit; no barrier, rendezvous or store timeout in the log; the launch
    succeeds."""
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="none", unreachable_node=2)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    line = re.search(r"node node2 reached no store of the launch within \d+ s \((store \d \(127\.0\.0\.1:\d+\): "
                     r"Connection refused(; )?){5}\): nothing started", res.log)
    assert line, res.log[-8000:]
    assert re.search(r"1 of the 5 launchers never reached a store \(4 came: .*\): their process\(es\) \[2\] never "
                     r"started: declared dead", res.log), res.log[-8000:]
    for wait in SILENT_WAITS:
        assert wait not in res.log, f"a silent wait ({wait!r}): {res.log[-8000:]}"
    assert "in-process recovery gives up" not in res.log
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    procs = ranks_by_process(res)
    assert 2 not in procs, f"process 2 never started: {procs.get(2)}"
    assert procs[4][-1][1] == 2, procs
    exits = launcher_exits(res)
    assert exits.pop("node2") == 68 and set(exits.values()) == {0}, launcher_exits(res)


def test_a_grow_back_replacement_starting_as_the_job_completes_exits_0_and_its_launcher_ends_with_the_others(
        inprocess_baseline: RunResult, tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed in step 5, the spare takes it; with ``--grow-back`` node1's launcher starts a replacement
    (process 5) once generation 1 completed a step. The replacement is still starting when the job completes (the
    worker holds it until its launcher wrote the completion marker): it reads the marker, returns from the engine
    without asking any store, exits 0, and node1's launcher exits 0 with the others (no ``--complete-grace`` wait,
    no stop)."""
    # detector.timeout_s 5 s (the default) for the workers and the launchers alike: the time a late process gets to
    # read the marker on a loaded machine before its launcher stops it
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="kill", KILL_RANK=1, KILL_STEP=5, grow_back=True,
                           detector_timeout_s=5.0, DETECTOR_TIMEOUT=5.0, REPLACEMENT_WAITS_FOR_COMPLETION=1)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    assert re.search(r"replacement process 5 \(pid \d+\) started, joins as a spare", res.log), res.log[-8000:]
    late = load(res.out / "late_start.5.json")
    assert late["marker"], late
    assert "the job completed before this process joined it" in res.log, res.log[-8000:]
    events = load(res.out / "events.initial5.json")
    assert events["code"] == 0 and events["events"] == [], events
    assert re.search(r"process 5 \(pid \d+\) exited with status 0 after the job completed", res.log), res.log[-8000:]
    assert "still run after" not in res.log and "stopping it" not in res.log, res.log[-8000:]
    for wait in SILENT_WAITS:
        assert wait not in res.log, f"a silent wait ({wait!r}): {res.log[-8000:]}"
    assert set(launcher_exits(res).values()) == {0}, launcher_exits(res)
