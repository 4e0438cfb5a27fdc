"""Liveness from the kernel (:mod:`neighbor_ckpt.inprocess.kernel_liveness`): the reader of ``/proc/<pid>/stat`` on
real processes (stopped and continued, a zombie, a pid that does not exist), the launcher's watch and its beat's
text; the monitor's rules over a real TCP store (a silent process its launcher vouches for is not declared, one it
reports stopped is, a node whose launcher is quiet is lost whole); and the lease of a process whose own threads were
starved of the GIL (its first look after the gap decides nothing)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from neighbor_ckpt.inprocess.assignment import initial_assignment
from neighbor_ckpt.inprocess.generation import GenerationStore
from neighbor_ckpt.inprocess.kernel_liveness import (DISK, GONE, RUNNING, STOPPED, ChildrenInKernel, KernelState,
                                                     KernelWatch, Verdict, format_beat, parse_beat, read_state)
from neighbor_ckpt.inprocess.monitor import LAUNCHER_LOST, Monitor, vouched_running
from neighbor_ckpt.inprocess.protocol import key
from neighbor_ckpt.inprocess.quorum import LeaseGuard, MajorityLease


def _wait_state(pid: int, letters: str, within_s: float = 10.0) -> KernelState:
    deadline = time.monotonic() + within_s
    while True:
        state = read_state(pid)
        if state is not None and state.letter in letters:
            return state
        assert time.monotonic() < deadline, f"pid {pid} never reached {letters!r}: {state}"
        time.sleep(0.01)


@pytest.fixture()
def sleeper() -> Any:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_the_reader_sees_a_real_process_stopped_continued_a_zombie_and_gone(sleeper: subprocess.Popen) -> None:
    pid = sleeper.pid
    state = _wait_state(pid, "S")
    assert state.status == RUNNING and state.start > 0
    sleeper.send_signal(signal.SIGSTOP)
    stopped = _wait_state(pid, "T")
    assert stopped.status == STOPPED and stopped.start == state.start, "the same process"
    sleeper.send_signal(signal.SIGCONT)
    assert _wait_state(pid, "RS").status == RUNNING
    sleeper.kill()
    zombie = _wait_state(pid, "Z")  # not reaped yet
    assert zombie.status == GONE
    sleeper.wait()
    assert read_state(pid) is None, "reaped: no such pid"
    assert read_state(2 ** 22 + 7) is None, "beyond pid_max: never a process"


def test_a_process_held_longer_than_the_limit_is_overdue_and_continuing_it_clears_that() -> None:
    watch = KernelWatch(limit_s=2.0)
    run, stop = KernelState("S", 10, 1), KernelState("T", 10, 1)
    assert watch.observe(1, [run], 100.0) == Verdict(1, RUNNING)
    watch.observe(1, [stop], 100.5)
    assert watch.observe(1, [stop], 102.4).held_s == pytest.approx(1.9) and watch.overdue(102.4) == []
    assert watch.overdue(102.6) == [Verdict(1, STOPPED, pytest.approx(2.1))]
    watch.observe(1, [run], 102.7)
    assert watch.overdue(110.0) == [], "continued: running again"


def test_an_uninterruptible_sleep_counts_only_while_it_uses_no_cpu_time() -> None:
    watch = KernelWatch(limit_s=2.0)
    for i, now in enumerate((100.0, 101.0, 102.0, 103.0)):  # I/O in D between bursts of CPU: working
        watch.observe(4, [KernelState("D", 10 + i, 1)], now)
    assert watch.overdue(103.0) == []
    watch.observe(4, [KernelState("D", 14, 1)], 104.0)  # the last CPU it used
    watch.observe(4, [KernelState("D", 14, 1)], 105.5)
    assert watch.overdue(105.5) == [] and watch.overdue(106.1) == [Verdict(4, DISK, pytest.approx(2.1))]


def test_the_worst_of_the_processes_that_run_one_index_counts() -> None:
    """The launcher's child and the process its engine runs in (a warm fork): the fork stopped is stopped, the fork
    gone is gone, whatever the child does."""
    watch = KernelWatch(limit_s=2.0)
    child = KernelState("S", 1, 1)
    assert watch.observe(2, [child, KernelState("T", 5, 2)], 0.0).status == STOPPED
    assert watch.observe(2, [child, None], 0.1).status == GONE
    assert watch.observe(2, [child, KernelState("R", 5, 2)], 0.2).status == RUNNING
    watch.keep([])
    assert watch.verdicts(1.0) == []


def test_the_beat_carries_who_runs_and_who_is_held_and_a_bare_counter_vouches_for_nobody() -> None:
    text = format_beat(17, [Verdict(0, RUNNING), Verdict(3, STOPPED, 1.25), Verdict(5, DISK, 0.5),
                            Verdict(6, GONE)])
    assert text == "17 run=0 held=3:T:1.2,5:D:0.5"
    summary = parse_beat(text.encode())
    assert summary is not None and summary.beat == "17" and summary.running == frozenset({0})
    assert dict(summary.held) == {3: ("T", 1.2), 5: ("D", 0.5)}
    assert parse_beat("17 run= held=").running == frozenset()
    assert parse_beat(b"40") is None and parse_beat(None) is None and parse_beat("1 run=x held=") is None
    assert vouched_running(text, 0) and not vouched_running(text, 3) and not vouched_running("40", 0)


def test_the_launchers_children_in_the_kernel_a_real_child_stopped_past_the_limit(sleeper: subprocess.Popen) -> None:
    kernel = ChildrenInKernel(0.3, node="n0")
    children = {7: sleeper.pid}
    _wait_state(sleeper.pid, "S")
    assert kernel.look(children, time.monotonic()) == []
    asked: list[int] = []
    own = json.dumps({"pid": sleeper.pid, "node": "n0", "start": 1}).encode()  # the engine runs in the child itself
    beat = kernel.beat(3, children, time.monotonic(), lambda p: asked.append(p) or own)
    assert beat == "3 run=7 held=" and asked == [7] and kernel.pids(sleeper.pid) == [sleeper.pid]
    kernel.beat(4, children, time.monotonic(), lambda p: asked.append(p) or own)
    assert asked == [7], "a record found is read once"
    sleeper.send_signal(signal.SIGSTOP)
    _wait_state(sleeper.pid, "T")
    t0 = time.monotonic()
    assert kernel.look(children, t0) == []
    overdue = kernel.look(children, t0 + 0.5)
    assert [(v.process, v.status) for v in overdue] == [(7, STOPPED)], overdue
    assert kernel.beat(5, children, t0 + 0.5, lambda p: None) == "5 run= held=7:T:0.5"
    assert kernel.look({}, t0 + 1.0) == [] and kernel.beat(6, {}, t0 + 1.0, lambda p: None) == "6 run= held="


# --- the monitor's rules, on a real store -----------------------------------------------------------------------------


from tests.unit.test_inprocess_generation import store  # noqa: E402,F401 - the same real-store fixture


def _monitor(store: Any, *, process: int, nodes: dict[int, str]) -> Monitor:
    gens = GenerationStore(store(), process=process)
    for p, node in nodes.items():
        gens.store.set(key("proc", p), json.dumps({"pid": 1000 + p, "node": node, "start": 1}))
    gens.store.set("gen", "0")
    gens.publish_assignment(0, initial_assignment(len(nodes), 0))
    members = frozenset(nodes)
    return Monitor(gens, state=lambda: (0, members, None, False), progress=lambda: (0, None, "idle"),
                   listener=None, interval_s=0.2, timeout_s=2.0, hang_timeout_s=None)


def _rounds(monitor: Monitor, node: str, summaries: list[str], start: float, step: float = 0.5) -> Any:
    """One round per summary, the launcher of ``node`` beating it (a new counter each time): the first record."""
    record = None
    for i, text in enumerate(summaries):
        monitor.gens.store.set(key("lhb", node), f"{i} {text}")
        record = record or monitor._silent_peer(0, frozenset(monitor.state()[1]), start + i * step)
    return record


def test_a_silent_process_its_launcher_vouches_running_is_left_to_the_hang_detector(store: Any, caplog: Any) -> None:
    """Process 3 (node b) sends no heartbeat for 4 s, 2x detector.timeout_s (its heartbeat thread starved of the
    GIL): node b's launcher beats on and vouches it running in the kernel, so its watcher declares nothing, and says
    so once. Once its launcher reports it stopped, the stale heartbeat decides as before (silent, alone)."""
    monitor = _monitor(store, process=4, nodes={0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"})
    gens = monitor.gens
    gens.store.set(key("hb", 3), "7 0 1 4 optimizer")
    with caplog.at_level("WARNING"):
        assert _rounds(monitor, "b", ["run=2,3 held="] * 9, 100.0) is None
    assert not gens.dead() and gens.failure(0) is None
    assert caplog.text.count("process 3 sent no heartbeat for") == 1, "said once"
    assert "its launcher vouches it running in the kernel" in caplog.text
    record = _rounds(monitor, "b", ["run=2 held=3:T:0.3", "run=2 held=3:T:0.8"], 104.5)
    assert record is not None and record.kind == "silent" and record.ranks == (3,), record
    assert set(gens.dead()) == {3}


def test_a_launcher_that_vouches_for_other_processes_only_does_not_save_a_silent_one(store: Any) -> None:
    monitor = _monitor(store, process=4, nodes={0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"})
    monitor.gens.store.set(key("hb", 3), "7 0 1 4 optimizer")
    record = _rounds(monitor, "b", ["run=2 held="] * 6, 100.0)
    assert record is not None and record.ranks == (3,), record


def test_a_predecessor_on_the_same_node_is_vouched_for_by_this_nodes_own_launcher(store: Any) -> None:
    monitor = _monitor(store, process=1, nodes={0: "a", 1: "a", 2: "b", 3: "b"})
    monitor.gens.store.set(key("hb", 0), "7 0 1 4 optimizer")
    assert _rounds(monitor, "a", ["run=0,1 held="] * 8, 100.0) is None
    assert not monitor.gens.dead()


def test_a_node_whose_launcher_is_quiet_is_lost_whole_even_while_its_processes_beat(store: Any, caplog: Any) -> None:
    """Node b's launcher SIGSTOPped: its processes beat on, but nobody vouches for them, sees their exits or kills
    them. Once the launcher has been quiet for LAUNCHER_LOST x detector.timeout_s (not before), both of node b's
    processes are declared in one decision."""
    monitor = _monitor(store, process=4, nodes={0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"})
    gens = monitor.gens
    gens.store.set(key("lhb", "b"), "40 run=2,3 held=")
    quiet_for = LAUNCHER_LOST * monitor.timeout_s
    t, record = 100.0, None
    while t < 100.0 + quiet_for - 0.1:
        gens.store.set(key("hb", 3), f"{int(t * 10)} 0 1 4 optimizer")
        assert monitor._silent_peer(0, frozenset(range(6)), t) is None, t
        t += 0.2
    with caplog.at_level("ERROR"):
        for _ in range(3):
            gens.store.set(key("hb", 3), f"{int(t * 10)} 0 1 4 optimizer")
            record = record or monitor._silent_peer(0, frozenset(range(6)), t)
            t += 0.2
    assert record is not None and record.kind == "silent" and set(record.ranks) == {2, 3}, record
    assert "node b is lost: its launcher sent no beat for" in record.reason
    assert "declaring its process(es) [2, 3] dead together" in caplog.text


def test_a_quiet_launcher_takes_nothing_once_the_job_completed(store: Any) -> None:
    monitor = _monitor(store, process=4, nodes={0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"})
    monitor.gens.store.set(key("lhb", "b"), "40 run=2,3 held=")
    monitor.gens.store.set("complete", "0")
    for i in range(30):
        monitor.gens.store.set(key("hb", 3), f"{i} 0 1 4 optimizer")
        assert monitor._silent_peer(0, frozenset(range(6)), 100.0 + i * 0.2) is None
    assert not monitor.gens.dead()


# --- the lease of a process starved of the GIL ------------------------------------------------------------------------


def _looks(lease: MajorityLease, times: list[float], beats: dict[int, int]) -> None:
    for t in times:
        for p in beats:
            beats[p] += 1
        lease.observe({0, 1, 2, 3, 4}, dict(beats), t)


def test_a_look_after_a_gap_longer_than_the_lease_only_learns_and_the_next_one_renews() -> None:
    """Process 0's threads held for 4 s (L = 1.55 s): its first look after the gap sees the majority's beats changed
    but cannot tell when they were written: it renews nothing and decides nothing (the guard is not told it was
    answered); the look one round later renews as of the look before it."""
    lease = MajorityLease(1.55, me=0, now=0.0)
    beats = {1: 0, 2: 0, 3: 0, 4: 0}
    _looks(lease, [0.0, 0.2, 0.4, 0.6], beats)
    assert lease.armed and lease.renewed() == pytest.approx(0.4)
    assert not lease.after_gap(1.9) and lease.after_gap(4.6)
    _looks(lease, [4.6], beats)
    assert lease.learning and lease.renewed() == pytest.approx(0.4), "nothing renewed by the look after the gap"
    assert lease.expired(4.7)
    _looks(lease, [4.8], beats)
    assert not lease.learning and lease.renewed() == pytest.approx(4.6) and not lease.expired(4.9)


def test_after_a_gap_a_side_cut_off_meanwhile_is_cut_off_at_the_next_look() -> None:
    """The same gap, but the majority was cut away during it: the look after the gap learns, the next one (answered,
    no majority changed) decides: cut off, one round later than a look on time would have."""
    lease = MajorityLease(1.55, me=0, now=0.0)
    beats = {1: 0, 2: 0, 3: 0, 4: 0}
    _looks(lease, [0.0, 0.2, 0.4, 0.6], beats)
    answered = [0.6]
    guard = LeaseGuard(lease, answered_at=lambda: answered[0], epoch=lambda: 0, name="process 0", doubt_s=20.0,
                       grace_s=6.0)
    frozen = dict(beats)
    for t in (4.6, 4.8):  # the monitor's rule: a look after a gap is not an answer
        if not lease.after_gap(t):
            answered[0] = t
        lease.observe({0, 1, 2, 3, 4}, frozen, t)
        if t == 4.6:
            assert guard.check(4.65) is None, "the look after the gap decides nothing"
    why = guard.check(4.85)
    assert why is not None and "while the store answers" in why


def test_the_hang_clock_of_a_starved_monitor_fires_no_earlier_than_hang_timeout_after_the_last_progress() -> None:
    """The hang detector reads the process's own progress tag (in memory), not its heartbeat: a monitor starved of
    the GIL for 4 s looks late and stamps a tag when it sees it, never earlier than it changed, so the stall it
    measures is at most the real one; the heartbeat's staleness does not enter it."""
    from neighbor_ckpt.runtime.detector import ProgressClock

    clock = ProgressClock(10.0)
    clock.observe((5, 4, "optimizer"), 100.0)
    assert clock.stalled(104.0) is None, "the 4 s hold: no progress, but less than hang_timeout_s"
    clock.observe((5, 4, "optimizer"), 104.0)  # the first look after the gap: the same tag
    clock.observe((6, 5, "stepped"), 104.3)  # the step it held the GIL in completes
    assert clock.stalled(114.2) is None and clock.stalled(114.4) == pytest.approx(10.1)
