"""The majority rules of a launch cut in two (:mod:`neighbor_ckpt.inprocess.quorum`): who may be declared dead, the
cut-off lease and its guard, promotion by a majority of the launchers' votes, a failover's replay that writes facts
only, and the launchers' handling of a process cut off. Pure rules with given clocks, and real TCP stores in one
process."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Iterator, Optional

import pytest
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from neighbor_ckpt.inprocess import protocol
from neighbor_ckpt.inprocess.failover_replay import ReplayFacts, replay
from neighbor_ckpt.inprocess.generation import GenerationStore, parse_dead
from neighbor_ckpt.inprocess.launcher_plan import Action, classify_exit, describe_exit
from neighbor_ckpt.inprocess.quorum import (CUT_OFF, LeaseGuard, MajorityLease, cut_off, cut_off_lease_s,
                                            launcher_lease_s, majority, majority_left)
from neighbor_ckpt.inprocess.stores import (NoPromotedStore, StoreAddresses, StoreSet, StoreUnreachable, epoch_key,
                                            vote_key)
from tests.conftest import free_port


def test_a_declaration_must_leave_a_majority_of_the_members_that_may_still_run() -> None:
    five = range(5)
    assert majority(five) == 3 and majority(range(4)) == 3 and majority(range(2)) == 2
    assert majority_left(five, dead=(), lost=(3, 4), exited=())
    assert not majority_left(five, dead=(), lost=(2, 3, 4), exited=()), "2 of 5 left: maybe the side cut off"
    assert not majority_left(five, dead=(4,), lost=(2, 3), exited=()), "a suspicion still counts in the base"
    assert majority_left(five, dead=(4,), lost=(3,), exited=(4,)), "gone for sure: out of the base (3 of 4)"
    assert not majority_left(range(4), dead=(), lost=(2, 3), exited=()), "2 nodes x 2: a node lost whole is a tie"
    assert majority_left(range(6), dead=(), lost=(2, 3), exited=()), "3 nodes x 2: 4 of 6"
    assert not majority_left(range(2), dead=(), lost=(1,), exited=()), "1 + 1 spare on two nodes: a tie"
    assert majority_left(range(2), dead=(), lost=(1,), exited=(), vouched=(1,)), \
        "its launcher beats here: declared, it is killed, not running elsewhere"
    assert majority_left(range(3), dead=(1,), lost=(2,), exited=(1,), vouched=(2,))
    assert not majority_left(range(3), dead=(), lost=(2,), exited=(), alive=(0,)), \
        "1 is silent too (not seen lately): declaring 2 would leave 0 alone"
    assert majority_left(range(3), dead=(), lost=(2,), exited=(), alive=(0, 1))


def test_the_lease_is_renewed_by_a_majority_of_changing_beats_and_armed_only_once_one_was_seen() -> None:
    assert cut_off_lease_s(5.0, 1.0) == pytest.approx(3.8) and cut_off_lease_s(2.0, 0.25) == pytest.approx(1.55)
    assert launcher_lease_s(2.0, 0.5) == 2.5
    lease = MajorityLease(1.0, me=0, now=0.0)
    assert not lease.observe({0, 1, 2, 3, 4}, {1: "a", 2: "x"}, 0.0), "the first look only learns the values"
    assert not lease.expired(100.0), "never armed (the others may still be starting)"
    lease.observe({0, 1, 2, 3, 4}, {1: "a", 2: "x"}, 99.5)
    assert lease.observe({0, 1, 2, 3, 4}, {1: "b", 2: "y"}, 100.0) and lease.armed
    assert lease.renewed() == 99.5, "stamped at the look before: the beats were written after it, no later is known"
    assert not lease.expired(100.4) and lease.expired(100.6)
    assert not lease.observe({0, 1, 2, 3, 4}, {1: "b", 2: "y"}, 100.6), "beats that stand still are not seen"
    assert lease.observe({0, 1, 2, 3, 4}, {1: "c", 2: "y", 3: "q"}, 101.0), "1 and 3 changed: 0, 1, 3"
    assert lease.renewed() == 100.6


def test_the_lease_runs_from_the_first_generation_even_before_a_majority_was_seen() -> None:
    """Issue 53, item 3: on 2c061fd a lease that had never seen a majority never expired, so a process cut off right
    after its first generation formed never stopped itself."""
    lease = MajorityLease(1.0, me=0, now=0.0)
    lease.observe({0, 1, 2}, {}, 4.0)
    lease.arm(5.0)
    assert lease.armed and not lease.expired(5.9) and lease.expired(6.1)
    lease.disarm()
    lease.arm(7.0)
    assert not lease.armed and not lease.expired(100.0), "the job completed: never again"


def test_after_a_move_the_grace_holds_only_until_a_majority_is_seen_on_the_new_store() -> None:
    """Issue 53, item 3: on 2c061fd a move pushed the lease out by the whole grace (>= timeout_s) whatever was seen
    next; now the first majority seen on the promoted store replaces it, so a process cut off there is back on the
    ordinary lease."""
    lease = MajorityLease(1.0, me=0, now=0.0)
    lease.arm(0.0)
    lease.restart(10.0)
    assert not lease.expired(10.9) and lease.expired(11.1), "nothing seen there: the grace, then the lease"
    assert not lease.observe({0, 1, 2}, {1: "a", 2: "b"}, 3.0), "values on the new store: when written, unknown"
    assert lease.observe({0, 1, 2}, {1: "a2", 2: "b2"}, 3.5)
    assert lease.renewed() == 3.0 and lease.expired(4.1), "the grace gave way to what was seen"


def _first_verdict(guard: LeaseGuard, lease: MajorityLease, *, looks: list[tuple[float, dict]], ticks: list[float],
                   answered: list[float], members: set[int]) -> tuple[Optional[float], Optional[str]]:
    """Run looks (time, what was read) and the guard's ticks in time order: the first tick with a verdict."""
    events = sorted([(t, 0, seen) for t, seen in looks] + [(t, 1, None) for t in ticks], key=lambda e: (e[0], e[1]))
    for t, kind, seen in events:
        if kind == 0:
            answered[0] = t
            lease.observe(members, seen, t)
            continue
        why = guard.check(t)
        if why is not None:
            return t, why
    return None, None


@settings(max_examples=400, deadline=None)
@given(timeout_s=st.floats(0.3, 120.0), ratio=st.floats(0.01, 0.999), phases=st.tuples(*[st.floats(0.0, 0.999)] * 4),
       cut_periods=st.floats(3.0, 40.0))
def test_for_every_accepted_setting_a_process_cut_off_stops_before_the_majority_may_declare_it(
        timeout_s: float, ratio: float, phases: tuple[float, float, float, float], cut_periods: float) -> None:
    """Issue 53, item 3 (on 2c061fd the renewal was stamped when a look saw the beats and the lease ran on from
    there: at the defaults the cut-off came up to two intervals after the majority could declare the process). Members
    0, 1, 2; process 0 is cut off from 1 and 2 at ``c`` with the store on its side: its looks answer, 1 and 2's beats
    stand still. 1 and 2 beat every interval; process 0 beats and looks once a round, every interval; the real guard
    looks at the real lease every tick. For every (T, I) the configuration accepts: no verdict while the majority is
    healthy, and process 0 is cut off "while the store answers" before ``T`` after its last beat before ``c``, the
    earliest the majority may declare it."""
    from neighbor_ckpt.config import LEASE_TICK_S, NeighborCkptConfig
    from neighbor_ckpt.inprocess.quorum import lease_precedes_decision

    interval_s = ratio * (timeout_s - 3 * LEASE_TICK_S) / 3
    assume(interval_s >= 0.01)
    NeighborCkptConfig(inprocess={"enabled": True, "barrier_timeout_s": 10 * timeout_s + 60},
                       detector={"timeout_s": timeout_s, "interval_s": interval_s})  # accepted
    assert lease_precedes_decision(timeout_s, interval_s)
    look_phase, beat1, beat2, tick_phase = phases
    cut = cut_periods * interval_s
    n = int(cut_periods + timeout_s / interval_s) + 4
    lease = MajorityLease(cut_off_lease_s(timeout_s, interval_s), me=0, now=0.0)
    answered = [0.0]
    guard = LeaseGuard(lease, answered_at=lambda: answered[0], epoch=lambda: 0, name="process 0", doubt_s=1e9,
                       grace_s=timeout_s)
    lease.arm(0.0)  # the first generation formed: every member beats from here on

    def beats(phase: float, t: float) -> int:
        return sum(1 for k in range(n) if (phase + k) * interval_s <= min(t, cut))

    looks = [(t, {1: beats(beat1, t), 2: beats(beat2, t)}) for t in ((look_phase + k) * interval_s for k in range(n))]
    ticks = [(tick_phase + j) * LEASE_TICK_S for j in range(int(looks[-1][0] / LEASE_TICK_S) + 2)]
    stop, why = _first_verdict(guard, lease, looks=looks, ticks=ticks, answered=answered, members={0, 1, 2})
    last_own_beat = max(t for t, _ in looks if t <= cut)  # process 0 beats in the round of its look
    assert stop is not None and stop > cut, (stop, cut, "cut off while the majority was healthy")
    assert "while the store answers" in why
    assert stop < last_own_beat + timeout_s, (stop, last_own_beat + timeout_s)


def test_a_setting_where_the_cut_off_could_come_after_the_decision_is_refused() -> None:
    from neighbor_ckpt.config import NeighborCkptConfig
    from neighbor_ckpt.errors import ConfigError
    from neighbor_ckpt.inprocess.quorum import lease_precedes_decision

    assert not lease_precedes_decision(3.2, 1.0) and lease_precedes_decision(3.3, 1.0)
    with pytest.raises(ConfigError, match="detector.timeout_s: 3.2 is too short for detector.interval_s"):
        NeighborCkptConfig(inprocess={"enabled": True}, detector={"timeout_s": 3.2, "interval_s": 1.0})
    NeighborCkptConfig(detector={"timeout_s": 3.2, "interval_s": 1.0})  # the restart path has no lease


def _guard(lease: MajorityLease, answered: list[float], epoch: list[int]) -> LeaseGuard:
    return LeaseGuard(lease, answered_at=lambda: answered[0], epoch=lambda: epoch[0], name="process 0",
                      doubt_s=20.0, grace_s=3.0)


def _renewed_at(t: float) -> MajorityLease:
    lease = MajorityLease(1.0, me=0, now=0.0)
    lease.observe({0, 1, 2}, {1: "a"}, t - 0.2)
    lease.observe({0, 1, 2}, {1: "b"}, t)
    assert lease.renewed() == t - 0.2
    return lease


def test_the_guard_cuts_off_when_a_look_answered_after_the_lease_ran_out_and_waits_in_doubt_otherwise() -> None:
    lease = _renewed_at(0.2)
    answered, epoch = [0.2], [0]
    guard = _guard(lease, answered, epoch)
    assert guard.check(0.5) is None
    assert guard.check(1.1) is None, "expired, but no look has answered since: the next one tells"
    answered[0] = 1.05
    why = guard.check(1.15)
    assert why is not None and "while the store answers" in why, "a minority that holds the store: now"

    lease = _renewed_at(0.2)
    guard = _guard(lease, [0.2], epoch)
    assert guard.check(1.5) is None, "no store answers either: in doubt"
    assert guard.check(21.0) is None
    why = guard.check(21.6)
    assert why is not None and "no store promoted by a majority of the launchers" in why

    lease = _renewed_at(0.2)
    guard = _guard(lease, [0.2], epoch)
    assert guard.check(1.5) is None
    epoch[0] = 1  # moved to a store the majority promoted: the lease starts again there, after the grace
    assert guard.check(10.0) is None and guard.check(13.9) is None
    assert guard.check(14.2) is None, "nothing answered since: in doubt again, not cut off"


def test_a_majority_process_whose_store_is_lost_right_after_its_renewal_waits_in_doubt() -> None:
    """What the first attempt at item 3 (2358791) got wrong: with the renewal one look back, a majority process whose
    store went silent found its lease expired while the store's last answer was younger than the lease, and was cut
    off "while the store answers" (processes 1-3 exited 79 in the partition e2e). Its last look renewed the lease."""
    lease = _renewed_at(5.0)  # renewed as of 4.8, by the look at 5.0, the last the store answered
    guard = _guard(lease, [5.0], [0])
    assert all(guard.check(t) is None for t in (5.7, 5.9, 6.5, 10.0, 24.0))
    why = guard.check(26.0)
    assert why is not None and "no store promoted" in why


def test_cut_off_says_the_line_and_exits_with_its_own_status(caplog: Any) -> None:
    codes: list[int] = []
    with caplog.at_level("ERROR"):
        cut_off("process 3", "no majority seen for 1.2 s", exit=codes.append)
    assert codes == [protocol.EXIT_CUT_OFF] and caplog.text.count(CUT_OFF) == 1


def test_a_launcher_takes_a_cut_off_exit_as_final() -> None:
    assert classify_exit(protocol.EXIT_CUT_OFF, False) is Action.CUT_OFF
    assert classify_exit(protocol.EXIT_CUT_OFF, True) is Action.CUT_OFF, "declared or not: nothing restarts it"
    assert "cut off from the majority" in describe_exit(protocol.EXIT_CUT_OFF)


@pytest.fixture()
def stores() -> Iterator[tuple[list[Any], StoreAddresses]]:
    """Store 0 is gone (nothing listens), stores 1 and 2 are up."""
    ports = [free_port() for _ in range(3)]
    masters = [dist.TCPStore("127.0.0.1", p, is_master=True, wait_for_workers=False, use_libuv=True,
                             timeout=timedelta(seconds=10)) for p in ports[1:]]
    yield masters, StoreAddresses(tuple(("127.0.0.1", p) for p in ports))
    del masters


def test_a_store_is_promoted_by_the_vote_that_makes_a_majority_of_the_launchers_and_processes_never_promote(
        stores: tuple[list[Any], StoreAddresses]) -> None:
    import threading

    masters, addresses = stores

    def voter(node: str) -> StoreSet:
        return StoreSet(addresses, run_id="r", timeout_s=0.5, connect_timeout_s=1.0, name=f"launcher:{node}",
                        voter=node, voters=3)

    alone = voter("node1")
    with pytest.raises(NoPromotedStore, match="no later store promoted by a majority of the 3 launcher"):
        alone.lost(0, "refused")
    assert not masters[0].check([epoch_key("r")]), "one vote of three promotes nothing"
    assert masters[0].get(vote_key("r", 1)) == b"node1,"

    process = StoreSet(addresses, run_id="r", timeout_s=0.5, connect_timeout_s=1.0, name="process 3")
    moved: list[int] = []
    t = threading.Thread(target=lambda: moved.append(process.lost(0, "refused")))
    t.start()
    assert voter("node2").lost(0, "refused") == 1, "the second vote of three promotes store 1"
    t.join()
    assert masters[0].get(epoch_key("r")) == b"1" and moved == [1] and process.epoch == 1
    assert not masters[1].check([epoch_key("r")]) and not masters[1].check([vote_key("r", 2)])


def test_a_process_that_finds_no_promoted_store_is_cut_off(stores: tuple[list[Any], StoreAddresses]) -> None:
    _, addresses = stores
    process = StoreSet(addresses, run_id="r", timeout_s=0.5, connect_timeout_s=1.0, name="process 3")
    with pytest.raises(NoPromotedStore):
        process.lost(0, "refused")
    assert process.epoch == 0


def test_a_store_slow_in_the_failovers_rush_gets_a_second_look_after_the_promotion_wait(
        stores: tuple[list[Any], StoreAddresses], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every client connects to the promoted store at once: a first look there may run out its timeout, and then the
    other stores' looks use up the wait (a launcher that took the job for lost exited 79 while the others moved on).
    Each later store gets a second look."""
    import time

    _, addresses = stores
    process = StoreSet(addresses, run_id="r", timeout_s=0.5, connect_timeout_s=1.0, name="launcher:node3")
    looks: list[int] = []

    def promotion(k: int, *, vote: bool) -> Any:
        looks.append(k)
        if looks == [1]:
            time.sleep(process.promotion_wait_s + 0.1)  # the first look outlasts the whole wait
            raise StoreUnreachable("no answer to check within 1.5 s")
        return None if k == 2 else False  # store 2 answers, not promoted; store 1 was promoted meanwhile

    monkeypatch.setattr(process, "_promotion", promotion)
    assert process.lost(0, "refused") == 1 and process.epoch == 1
    assert looks == [1, 2, 1]


def test_a_look_without_a_vote_at_a_store_nobody_voted_for_is_no_error(
        stores: tuple[list[Any], StoreAddresses]) -> None:
    """A launcher's second look at a later store it did not vote for (it voted for the first that answered): no
    ballot there is no vote yet (a ``get`` of the missing key would wait out the timeout and raise: the launcher
    exited 1)."""
    masters, addresses = stores
    launcher = StoreSet(addresses, run_id="r", timeout_s=0.5, connect_timeout_s=1.0, name="launcher:node2",
                        voter="node2", voters=5)
    assert launcher._promotion(2, vote=False) is None
    assert not masters[1].check([vote_key("r", 2)])


def test_the_last_look_before_a_cut_off_asks_the_current_store_once_and_never_fails_over(
        stores: tuple[list[Any], StoreAddresses]) -> None:
    """A cut-off verdict's last look (did the job complete meanwhile?) is one bounded operation on the store the
    client is on: a failover there could outlast the cut, find the majority's store after a heal and keep a
    launcher of the minority alive."""
    masters, addresses = stores
    launcher = StoreSet(addresses, run_id="r", timeout_s=0.5, connect_timeout_s=1.0, name="launcher:node3",
                        voter="node3", voters=3)
    masters[0].set(epoch_key("r"), "1")  # store 1 promoted by the others
    with pytest.raises(StoreUnreachable):
        launcher.once("last-look", "job/0").check(["complete"])
    assert launcher.epoch == 0 and not launcher.history
    launcher.epoch = 1
    masters[0].set("job/0/complete", "1")
    assert launcher.once("last-look", "job/0").check(["complete"])


def test_a_store_that_answers_again_by_the_end_of_the_wait_is_kept_when_no_later_one_was_promoted() -> None:
    """Two operations that timed out (a tunnel slow on a loaded machine) are no lost store when it answers a fresh
    connection after the promotion wait and nobody promoted a later one: the client stays (it would leave for a
    store nobody uses and be cut off)."""
    ports = [free_port() for _ in range(2)]
    masters = [dist.TCPStore("127.0.0.1", p, is_master=True, wait_for_workers=False, use_libuv=True,
                             timeout=timedelta(seconds=10)) for p in ports]
    addresses = StoreAddresses(tuple(("127.0.0.1", p) for p in ports))
    process = StoreSet(addresses, run_id="r", timeout_s=0.5, connect_timeout_s=1.0, name="process 0")
    assert process.lost(0, "no answer to check within 0.5 s") == 0 and process.epoch == 0 and not process.history
    assert not masters[1].check([epoch_key("r")])


def test_a_failover_replay_writes_exits_only_never_a_suspicion(stores: tuple[list[Any], StoreAddresses]) -> None:
    """A client back from the minority's side suspected the majority's processes (silent): none of that reaches
    the store it moves to; the exits it saw (facts) do."""
    masters, _ = stores
    gens = GenerationStore(dist.PrefixStore("job/0/", masters[0]), process=4)
    facts = ReplayFacts(record="{}", dead={0: "silent: no heartbeat for 2.1 s", 1: "hung: lagging",
                                           2: "exited: killed by signal 9 (SIGKILL)",
                                           3: "exited: after silent: no heartbeat"}, generation=1)
    replay(gens, facts, by="process 4", why="store 0 lost", new_store="store 1")
    assert parse_dead(gens.store.get("dead")).keys() == {2, 3}


def test_what_a_client_read_as_exited_is_kept_as_a_fact_whatever_was_suspected_first(
        stores: tuple[list[Any], StoreAddresses]) -> None:
    masters, _ = stores
    gens = GenerationStore(dist.PrefixStore("job/0/", masters[0]), process=0)
    gens.declare_dead([1], "silent: no heartbeat")
    gens.declare_dead([2], "silent: no heartbeat")
    gens.declare_dead([1], "exited: killed by signal 9 (SIGKILL)")
    assert gens.dead().keys() == {1, 2} and gens.exited == {1}
    assert gens.seen_dead[1].startswith("exited:") and gens.seen_dead[2].startswith("silent:")


def test_the_guard_stops_a_client_whose_lease_ran_out_unless_the_job_completed_meanwhile() -> None:
    """The others leave when the job completed: that is no cut (the last look before a cut-off says so)."""
    for completed in (True, False):
        import time

        lease = MajorityLease(0.05, me=0, now=time.monotonic())
        lease.arm(time.monotonic())
        stopped: list[str] = []
        guard = LeaseGuard(lease, answered_at=time.monotonic, epoch=lambda: 0, name="process 0", doubt_s=20.0,
                           grace_s=3.0, tick_s=0.01, stop=stopped.append, last_look=lambda c=completed: c)
        guard.start()
        assert guard._thread is not None
        guard._thread.join(timeout=60)
        assert not guard._thread.is_alive()
        assert (stopped == []) is completed, stopped
    lease = MajorityLease(1.0, me=0, now=0.0)
    lease.observe({0, 1, 2}, {1: "a"}, 0.0)
    lease.disarm()
    assert not lease.expired(50.0) and not lease.observe({0, 1, 2}, {}, 50.0)
    lease.observe({0, 1, 2}, {1: "b", 2: "c"}, 51.0)
    assert not lease.expired(99.0), "never armed again once the job completed"


def test_a_launchers_quorum_set_is_every_node_then_the_nodes_of_the_last_generation(
        stores: tuple[list[Any], StoreAddresses]) -> None:
    """4 nodes: before a generation formed every node counts (node0 alone with node3: 2 of 4, no majority); once
    generation 1 formed on nodes 0, 2, 3 (node 1 lost for good), node0 with node3 are 2 of 3."""
    import json
    from types import SimpleNamespace

    from neighbor_ckpt.inprocess.quorum import LauncherLease

    masters, _ = stores
    s = dist.PrefixStore("job/0/", masters[0])
    fake = SimpleNamespace(timeout_s=4.0, promotion_wait_s=14.0, move_bound_s=6.0, epoch=0, over=False)
    lease = LauncherLease(node="node0", nodes=4, timeout_s=2.0, beat_s=0.5, stores=fake,
                          owner=SimpleNamespace(_att=None))
    s.set("nodes", "node0,node1,node2,node3,")
    s.set("lhb/node3", "1")
    lease.look(s)
    assert not lease.lease.armed
    for p, node in enumerate(("node0", "node1", "node2", "node3")):
        s.set(f"proc/{p}", json.dumps({"node": node}))
    s.set("gen/1/members", json.dumps({"members": [0, 2, 3], "progressed": True, "hangs": 0}))
    s.set("gen", "1")
    s.set("lhb/node3", "2")
    lease.look(s)
    assert lease.lease.armed and lease._base == {"node0", "node2", "node3"}
