"""Generations over a real TCP store in one process: the barrier, the failure record, fencing, deaths of spares,
and the monitor's hang decision (pure)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from neighbor_ckpt.inprocess.assignment import initial_assignment
from neighbor_ckpt.inprocess.generation import (BarrierTimeout, Fault, Fenced, GenerationStore, Members, QuorumLost,
                                                exited, gate, parse_dead, parse_list, quorum)
from neighbor_ckpt.inprocess.monitor import laggards, parse_heartbeat, ring_predecessor
from neighbor_ckpt.inprocess.protocol import key
from tests.conftest import free_port


@pytest.fixture()
def store() -> Any:
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True,
                           timeout=timedelta(seconds=10))
    yield lambda: dist.PrefixStore("job/0/", dist.TCPStore("127.0.0.1", port, is_master=False,
                                                            wait_for_workers=False, use_libuv=True,
                                                            timeout=timedelta(seconds=10)))
    del master


def test_list_and_dead_keys_parse_as_written() -> None:
    assert parse_list(b"3,5,") == [3, 5] and parse_list(None) == []
    assert parse_dead(b"3:exited with status -9;5:silent: no beat;3:again;") == {3: "exited with status -9",
                                                                                  5: "silent: no beat"}


def test_every_process_reads_the_same_barrier_outcome(store: Any) -> None:
    results: dict[int, Members] = {}

    def join(p: int) -> None:
        results[p] = GenerationStore(store(), process=p).join(0, expected=range(3), timeout_s=10)

    threads = [threading.Thread(target=join, args=(p,)) for p in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {m.to_json() for m in results.values()} == {results[0].to_json()}
    assert results[0].members == frozenset({0, 1, 2}) and results[0].progressed


def test_the_barrier_goes_on_without_a_process_declared_dead(store: Any) -> None:
    a, b = GenerationStore(store(), process=0), GenerationStore(store(), process=1)
    b.declare_dead([2], "exited with status -9")
    out: list[Members] = []
    t = threading.Thread(target=lambda: out.append(b.join(1, expected={0, 1, 2}, timeout_s=10)))
    t.start()
    m = a.join(1, expected={0, 1, 2}, timeout_s=10)
    t.join()
    assert m.members == frozenset({0, 1}) and out[0] == m
    assert not m.progressed, "generation 0 never marked a completed step"


def test_a_minority_does_not_form_a_generation_and_a_majority_does(store: Any) -> None:
    """Quorum 3 (a majority of five), at every generation, the store moved or not: two live processes, the other
    three declared dead (suspected: no launcher saw them exit), wait and stop with QuorumLost; three form the next
    generation."""
    a, b = GenerationStore(store(), process=0), GenerationStore(store(), process=1)
    b.declare_dead([2, 3, 4], "silent: no heartbeat")
    errors: list[BaseException] = []

    def join_b() -> None:
        try:
            b.join(1, expected={0, 1, 2, 3, 4}, timeout_s=1, quorum_of={0, 1, 2, 3, 4})
        except QuorumLost as e:
            errors.append(e)

    t = threading.Thread(target=join_b)
    t.start()
    with pytest.raises(QuorumLost, match=r"2 process\(es\), fewer than a majority \(3\) of"):
        a.join(1, expected={0, 1, 2, 3, 4}, timeout_s=1, quorum_of={0, 1, 2, 3, 4})
    t.join()
    assert len(errors) == 1, "both stop"
    assert not a.store.check([key("gen", 1, "members")]), "nothing formed"
    c = GenerationStore(store(), process=5)
    out: list[Members] = []
    threads = [threading.Thread(target=lambda g=g: out.append(g.join(2, expected={0, 1, 5}, timeout_s=10,
                                                                     quorum_of={0, 1, 2, 3, 4})))
               for g in (a, b, c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {m.members for m in out} == {frozenset({0, 1, 5})}
    assert a.seen_dead.keys() == {2, 3, 4}, "what a client read in `dead` is kept"


def test_a_short_barrier_waits_for_the_launchers_reports_of_exits_and_then_forms(store: Any) -> None:
    """Members {0, 1, 2}: 1 and 2 declared silent (suspicions: the base stays 3, quorum 2, 0 alone is short), then
    their launcher reports both exited: the base shrinks to {0} and 0 forms the generation alone."""
    a = GenerationStore(store(), process=0)
    a.declare_dead([1, 2], "silent: no heartbeat")
    out: list[Members] = []
    t = threading.Thread(target=lambda: out.append(a.join(1, expected={0, 1, 2}, timeout_s=60, quorum_of={0, 1, 2})))
    t.start()
    while not a.store.check([key("gen", 1, "arrived")]):
        threading.Event().wait(0.01)
    assert not a.store.check([key("gen", 1, "members")])
    GenerationStore(store(), process=-1).declare_dead([1, 2], "exited: killed by signal 9 (SIGKILL)")
    t.join()
    assert out[0].members == frozenset({0})


def test_a_missing_process_times_the_barrier_out_and_is_named(store: Any) -> None:
    with pytest.raises(BarrierTimeout, match=r"\[1\]"):
        GenerationStore(store(), process=0).join(0, expected={0, 1}, timeout_s=0.3)


def test_a_process_declared_dead_is_fenced_at_the_barrier(store: Any) -> None:
    g = GenerationStore(store(), process=1)
    GenerationStore(store(), process=0).declare_dead([1], "silent: no heartbeat")
    with pytest.raises(Fenced, match="silent"):
        g.join(1, expected={0, 1}, timeout_s=5)
    with pytest.raises(Fenced):
        g.check_fenced()


def test_the_first_failure_record_stands_for_everyone(store: Any) -> None:
    a, b = GenerationStore(store(), process=0), GenerationStore(store(), process=1)
    first = a.fail(3, kind="exception", ranks=[0], reason="boom")
    second = b.fail(3, kind="exited", ranks=[1], reason="status -9")
    assert first == second and a.won(first) and not b.won(second)
    assert b.failure(3) == first and b.failure(2) is None
    with pytest.raises(ValueError):
        a.fail(4, kind="bogus", reason="?")


def test_an_idle_spares_death_fails_no_generation(store: Any) -> None:
    g = GenerationStore(store(), process=0)
    g.store.set("gen", "0")
    g.publish_assignment(0, initial_assignment(5, 1))
    assert g.report_death([4], kind="exited", reason="status -9") is None
    assert g.failure(0) is None and 4 in g.dead()
    record = g.report_death([1], kind="exited", reason="status -9", by="launcher:node1")
    assert record is not None and record.ranks == (1,) and record.by == "launcher:node1"


def test_the_last_active_rank_to_finish_completes_the_job(store: Any) -> None:
    a = GenerationStore(store(), process=0)
    a.finished(2, world_size=2)
    assert not a.complete()
    GenerationStore(store(), process=1).finished(2, world_size=2)
    assert a.complete() and a.wait_outcome(2, threading.Event()) is None


def test_a_hang_on_equal_tags_is_counted_into_the_next_generation(store: Any) -> None:
    a = GenerationStore(store(), process=0)
    a.join(0, expected={0}, timeout_s=5)
    a.mark_progress(0)
    a.fail(0, kind="hang_all", reason="no progress anywhere")
    m1 = a.join(1, expected={0}, timeout_s=5)
    assert m1.hangs == 1 and m1.progressed
    a.fail(1, kind="exception", reason="boom")
    assert a.join(2, expected={0}, timeout_s=5).hangs == 1


def test_the_rank_whose_tag_lags_is_blamed_and_equal_tags_blame_nobody() -> None:
    assert laggards({0: (9, 4, "optimizer"), 1: (7, 4, "forward"), 2: (9, 4, "optimizer")}) == (1,)
    assert laggards({0: (9, 4, "optimizer"), 1: (9, 4, "optimizer")}) == ()
    assert laggards({}) == ()


def test_heartbeats_parse_and_garbage_is_ignored() -> None:
    assert parse_heartbeat(b"12 3 40 7 optimizer") == (12, 3, (40, 7, "optimizer"))
    assert parse_heartbeat("1 0 0 None idle") == (1, 0, (0, None, "idle"))
    assert parse_heartbeat(b"nonsense") is None and parse_heartbeat(None) is None


def test_each_member_is_watched_by_its_ring_predecessor() -> None:
    assert ring_predecessor(0, {0, 2, 5}) == 5 and ring_predecessor(5, {0, 2, 5}) == 2
    assert ring_predecessor(3, {3}) is None and ring_predecessor(1, {0, 2}) is None


def _members(g: int, *, progressed: bool = True, hangs: int = 0) -> Members:
    return Members(generation=g, members=frozenset({0, 1}), progressed=progressed, hangs=hangs)


def test_the_gate_lets_a_generation_go_on_unless_a_fallback_rule_says_why_not() -> None:
    assert gate(_members(1), max_restarts=3) is None
    assert gate(_members(1, progressed=False), max_restarts=3) is None, "generation 0 may fail before its first step"
    assert "failed before completing a step" in gate(_members(2, progressed=False), max_restarts=3)
    assert "more than 3 in-process restarts" in gate(_members(4), max_restarts=3)
    assert gate(_members(40), max_restarts=None) is None
    assert gate(_members(2, hangs=1), max_restarts=None) is None
    assert "second hang" in gate(_members(3, hangs=2), max_restarts=None)


def test_grow_back_waits_for_the_generation_after_the_last_that_held_the_dead_process(store: Any) -> None:
    """The survivors may re-form before the dead process's launcher reaps it: the replacement then waits for the
    progress of that new generation, not of one more (which would never come without another failure)."""
    from neighbor_ckpt.inprocess.launcher import _last_generation_with

    s = store()
    gens = GenerationStore(s, process=-1)
    assert _last_generation_with(gens, 0) == 0, "generation 0 holds everyone"
    s.set("gen", "1")
    assert _last_generation_with(gens, 0) == 0, "generation 1 is forming: the dead process is not in it"
    s.set(key("gen", 1, "members"), Members(1, frozenset({1, 2, 3, 4}), True, 0).to_json())
    assert _last_generation_with(gens, 0) == 0, "generation 1 formed without process 0"
    assert _last_generation_with(gens, 2) == 1, "process 2 died in generation 1"


def test_the_majority_after_a_failover_counts_only_the_processes_that_may_still_run() -> None:
    """A process whose exit a launcher saw (an ``exited:`` entry, even after a ``silent:`` one) is gone for sure and
    is not waited for as a possible other side; a silent one may run on, cut off with a standby of its own."""
    raw = "3:silent: no heartbeat for 3.1 s;3:exited: exited with status 77 (hygiene: replaced);0:silent: 3.2 s;"
    assert exited(raw) == {3} and exited(None) == set()
    assert quorum(frozenset({0, 1, 2, 3}), exited(raw)) == 2, "of 0, 1, 2: two (0 may still run elsewhere)"
    assert quorum(frozenset({0, 1, 2, 3}), set()) == 3


def test_after_a_store_move_a_peer_is_silent_only_once_a_live_process_could_have_followed(store: Any) -> None:
    """A healthy peer whose store operation was in flight on the lost store reaches the promoted one up to
    ``StoreSet.move_bound_s`` later (the campaign saw one declared silent, and fenced, 8.5 s after the move with the
    old 3 s + 3 s allowance): after a move the watch starts when that bound has passed, then waits ``timeout_s``."""
    from types import SimpleNamespace

    from neighbor_ckpt.inprocess.monitor import Monitor

    gens = GenerationStore(store(), process=1)
    stores = SimpleNamespace(epoch=1, move_bound_s=8.0)
    monitor = Monitor(gens, state=lambda: (0, frozenset({0, 1, 2}), None, False), progress=lambda: (0, None, "idle"),
                      listener=None, interval_s=0.5, timeout_s=3.0, hang_timeout_s=None, stores=stores)
    monitor.moved(1, now=100.0)
    assert monitor._silent_peer(0, frozenset({0, 1, 2}), 100.5) is None
    assert monitor._silent_peer(0, frozenset({0, 1, 2}), 110.5) is None, "declared within the time to follow + timeout_s"
    assert 0 not in gens.dead()
    record = monitor._silent_peer(0, frozenset({0, 1, 2}), 111.5)
    assert record is not None and record.kind == "silent" and 0 in gens.dead()


def test_a_store_set_says_how_long_a_live_process_may_take_to_follow_a_move() -> None:
    from neighbor_ckpt.inprocess.stores import FOLLOW_EVERY_S, StoreAddresses, StoreSet

    stores = StoreSet(StoreAddresses.parse("127.0.0.1:1,127.0.0.1:2", "test"), run_id="r", timeout_s=6.0)
    assert stores.move_bound_s == 6.0 + FOLLOW_EVERY_S
    stores.on_failover(lambda old, new, why: None)  # the set is whole after the bound was added
    stores.close()


def _node_monitor(store: Any, *, process: int, nodes: dict[int, str], members: frozenset[int]) -> Any:
    """A monitor of ``process`` whose peers' ``proc/<p>`` records place them on ``nodes``."""
    import json

    from neighbor_ckpt.inprocess.monitor import Monitor

    gens = GenerationStore(store(), process=process)
    for p, node in nodes.items():
        gens.store.set(key("proc", p), json.dumps({"pid": 1000 + p, "node": node, "start": 1}))
    gens.store.set("gen", "0")
    gens.publish_assignment(0, initial_assignment(len(members), 0))
    return Monitor(gens, state=lambda: (0, members, None, False), progress=lambda: (0, None, "idle"),
                   listener=None, interval_s=0.2, timeout_s=2.0, hang_timeout_s=None)


def test_a_silent_predecessor_whose_launcher_is_silent_too_takes_its_whole_node_in_one_decision(store: Any) -> None:
    """3 nodes x 2 processes: process 4 (node c) watches process 3 (node b) and node b's launcher. Both stand still:
    2 and 3 are declared dead in one record, before process 2 itself was ever watched (4 of 6 are left: a
    majority)."""
    members = frozenset(range(6))
    monitor = _node_monitor(store, process=4, nodes={0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"},
                            members=members)
    gens = monitor.gens
    gens.store.set(key("hb", 3), "7 0 1 None idle")
    gens.store.set(key("lhb", "b"), "40")
    assert monitor._silent_peer(0, members, 100.0) is None
    assert monitor._silent_peer(0, members, 101.5) is None, "not yet silent"
    record = monitor._silent_peer(0, members, 102.5)
    assert record is not None and record.kind == "silent" and set(record.ranks) == {2, 3}, record
    assert {2, 3} <= gens.dead().keys() and "node b is lost" in record.reason


def test_a_node_lost_whole_that_leaves_no_majority_is_not_declared(store: Any, caplog: Any) -> None:
    """2 nodes x 2 processes: node b silent with its launcher leaves 2 of 4, not a majority: from node a, a node lost
    and a cut between the nodes look the same, so nothing is declared (node a stops on its lease instead)."""
    members = frozenset({0, 1, 2, 3})
    monitor = _node_monitor(store, process=0, nodes={0: "a", 1: "a", 2: "b", 3: "b"}, members=members)
    gens = monitor.gens
    gens.store.set(key("hb", 3), "7 0 1 None idle")
    gens.store.set(key("lhb", "b"), "40")
    assert monitor._silent_peer(0, members, 100.0) is None
    with caplog.at_level("ERROR"):
        assert monitor._silent_peer(0, members, 102.5) is None
        assert monitor._silent_peer(0, members, 103.5) is None
    assert not gens.dead() and gens.failure(0) is None
    assert caplog.text.count("not declaring process(es) [2, 3] dead") == 1, "said once"


def test_a_silent_predecessor_whose_launcher_beats_on_is_declared_alone(store: Any) -> None:
    """A stopped process on a node whose launcher lives (it beats): only that process."""
    members = frozenset({0, 1, 2, 3})
    monitor = _node_monitor(store, process=0, nodes={0: "a", 1: "a", 2: "b", 3: "b"}, members=members)
    gens = monitor.gens
    gens.store.set(key("hb", 3), "7 0 1 None idle")
    for i, now in enumerate((100.0, 100.5, 101.0, 101.5, 102.0, 102.5)):
        gens.store.set(key("lhb", "b"), str(i))
        record = monitor._silent_peer(0, members, now)
    assert record is not None and record.ranks == (3,), record
    assert 2 not in gens.dead()


def test_a_predecessor_on_the_same_node_is_watched_without_its_launcher(store: Any) -> None:
    """Process 1 watches process 0 on its own node: its launcher (this process's own) is not watched, and a silent
    process 0 is declared alone."""
    members = frozenset({0, 1, 2, 3})
    monitor = _node_monitor(store, process=1, nodes={0: "a", 1: "a", 2: "b", 3: "b"}, members=members)
    monitor.gens.store.set(key("hb", 0), "7 0 1 None idle")
    assert monitor._silent_peer(0, members, 100.0) is None
    record = monitor._silent_peer(0, members, 102.5)
    assert record is not None and record.ranks == (0,), record


def test_a_death_decided_about_a_generation_never_fails_the_next_one_formed_meanwhile(store: Any) -> None:
    """The monitor decides about generation 0 (node 1 lost); once 2 and 3 are declared, the others form generation
    1 without them before the decision's record is written. The record belongs to generation 0 (its fault witness
    there), and generation 1 stays whole (the campaign saw it failed by the stale decision, then a give-up)."""
    g = GenerationStore(store(), process=4)
    g.store.set("gen", "0")
    g.publish_assignment(0, initial_assignment(6, 2))
    g.fail(0, kind="exception", ranks=(), reason="a collective lost a peer")
    g.store.set("gen", "1")  # formed meanwhile, with the spares in 2 and 3's places
    g.publish_assignment(1, initial_assignment(6, 2))
    g.report_death((2, 3), kind="silent", reason="node node1 is lost", generation=0,
                   fault=Fault(1.0, "last heartbeat of process 3 seen by process 4"))
    assert g.failure(1) is None, "the next generation was failed by a decision about the one before"
    assert g.failure(0).kind == "exception" and [f.what for f in g.faults(0)] == [
        "last heartbeat of process 3 seen by process 4"]
    assert {2, 3} <= g.dead().keys()


def test_the_monitor_renews_the_lease_with_the_members_beats_or_their_launchers_and_disarms_it_at_completion(
        store: Any) -> None:
    """Members 0..4 on nodes a..e: process 0 sees 1's heartbeat and node c's launcher (2 is stopped, its launcher
    beats: on this side of any cut): 3 of 5, the lease is renewed; 3 and 4 are never seen. Once the job completed
    the lease is disarmed (the others leave)."""
    from neighbor_ckpt.inprocess.monitor import Monitor
    from neighbor_ckpt.inprocess.quorum import MajorityLease

    members = frozenset(range(5))
    base = _node_monitor(store, process=0, nodes={0: "a", 1: "b", 2: "c", 3: "d", 4: "e"}, members=members)
    lease = MajorityLease(60.0, me=0, now=0.0)
    monitor = Monitor(base.gens, state=lambda: (0, members, None, False), progress=lambda: (0, None, "idle"),
                      listener=None, interval_s=0.2, timeout_s=2.0, hang_timeout_s=None, lease=lease)
    monitor._look_at_majority(members, {})
    assert not lease.armed, "only itself: 1 of 5"
    monitor.gens.store.set(key("hb", 1), "1 0 0 None idle")
    monitor._look_at_majority(members, {})
    assert not lease.armed, "2 of 5"
    monitor.gens.store.set(key("lhb", "c"), "9")
    monitor._look_at_majority(members, {})
    assert lease.armed and monitor.answered_at > 0
    monitor.gens.store.set("complete", "0")
    monitor._look_at_majority(members, {})
    assert not lease.armed and not lease.expired(1e9)


def _hang_monitor(store: Any, *, process: int, tags: dict[int, int]) -> Any:
    """A monitor of ``process`` in generation 0 whose active ranks' heartbeats carry ``tags`` (process -> progress
    marks), stalled for good: its own progress never moves."""
    from neighbor_ckpt.inprocess.monitor import Monitor

    members = frozenset(tags)
    gens = GenerationStore(store(), process=process)
    gens.store.set("gen", "0")
    gens.publish_assignment(0, initial_assignment(len(members), 0))
    for p, marks in tags.items():
        gens.store.set(key("hb", p), f"7 0 {marks} 4 forward")
    return Monitor(gens, state=lambda: (0, members, {p: p for p in members}, False),
                   progress=lambda: (tags[process], 4, "forward"), listener=None, interval_s=0.2, timeout_s=2.0,
                   hang_timeout_s=3.0)


def test_laggards_that_are_the_larger_side_of_a_cut_are_never_declared_by_the_smaller(store: Any) -> None:
    """A cut of the ranks' network where the smaller side (0, 1) got one more progress mark than the larger (2, 3, 4):
    the lagging tags name a majority. On 2c061fd they were declared dead (``vouched`` took them out of the
    denominator) and the minority kept the job; now nobody is declared on the tags, the reach probe is asked instead."""
    monitor = _hang_monitor(store, process=0, tags={0: 10, 1: 10, 2: 9, 3: 9, 4: 9})
    monitor._hang(0, {p: p for p in range(5)}, 100.0)
    assert monitor._hang(0, {p: p for p in range(5)}, 104.0) is None, "no decision on the tags"
    assert monitor.gens.dead() == {} and monitor.gens.failure(0) is None


def test_laggards_that_are_a_minority_are_still_declared_hung(store: Any) -> None:
    monitor = _hang_monitor(store, process=0, tags={0: 10, 1: 10, 2: 10, 3: 9, 4: 9})
    monitor._hang(0, {p: p for p in range(5)}, 100.0)
    record = monitor._hang(0, {p: p for p in range(5)}, 104.0)
    assert record is not None and record.kind == "hung" and record.ranks == (3, 4), record
    assert set(monitor.gens.dead()) == {3, 4}


def test_suspected_culprits_count_in_the_majority_and_exits_seen_do_not() -> None:
    from neighbor_ckpt.inprocess.quorum import majority_left

    members = range(5)
    assert not majority_left(members, dead=(), lost=(2, 3, 4), exited=()), "3 of 5 suspected: 2 left, no majority"
    assert majority_left(members, dead=(), lost=(3, 4), exited=())
    assert majority_left(members, dead=(), lost=(2,), exited=(3, 4)), "of 0, 1, 2: two left"


def test_generation_0_needs_a_majority_of_every_process_of_the_launch(store: Any) -> None:
    """The quorum set of generation 0 is the launch's every process (on 2c061fd it had none: a side that declared the
    others dead on a suspicion formed generation 0 alone); a process whose exit a launcher saw is gone for sure."""
    from neighbor_ckpt.inprocess.generation import quorum_set

    assert quorum_set(0, processes=5, last=frozenset()) == frozenset(range(5))
    assert quorum_set(3, processes=5, last=frozenset({0, 2, 4})) == frozenset({0, 2, 4})
    g = GenerationStore(store(), process=0)
    g.declare_dead((1, 2), "silent: no heartbeat")  # suspicions, as a side cut off would write them
    with pytest.raises(QuorumLost):
        g.join(0, expected=range(3), timeout_s=0.3, quorum_of=quorum_set(0, processes=3, last=frozenset()))
    g.declare_dead((1, 2), "exited: never started")  # facts: gone for sure
    assert g.join(0, expected=range(3), timeout_s=2.0,
                  quorum_of=quorum_set(0, processes=3, last=frozenset())).members == frozenset({0})
