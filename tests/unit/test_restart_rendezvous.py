"""The launchers' restart rendezvous without a node lost for good (:mod:`neighbor_ckpt.inprocess.restart_rendezvous`):
which nodes count as lost (launcher silent for ``detector.timeout_s`` and every process of it declared dead, or never
seen on the store the launch moved to: cut off by a partition), whether the restart goes on without them (spares
cover them, or elastic) or says what to set, and that it never restarts without a majority of the launchers. The
rules pure, then three launchers' rendezvous over a real TCP store in one process."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch.distributed as dist

from neighbor_ckpt.inprocess.protocol import key, launch_prefix
from neighbor_ckpt.inprocess.quorum import CUT_OFF
from neighbor_ckpt.inprocess.restart_rendezvous import (STOP, STOPPED, LostNodes, RestartRendezvous, parse_nodes,
                                                         rendezvous_verdict, restart_verdict, wait_said)
from tests.conftest import free_port


def test_node_lists_parse_each_node_once_in_order() -> None:
    assert parse_nodes(b"node0,node1,node0,") == ["node0", "node1"] and parse_nodes(None) == []


def test_a_node_is_lost_only_when_its_launcher_stood_still_for_the_timeout_and_its_processes_are_dead() -> None:
    watch = LostNodes(timeout_s=2.0, bound_s=6.0)
    procs = {"node1": (2, 3), "node2": (4, 5)}
    watch.observe("node1", "17", 100.0)
    watch.observe("node2", "3", 100.0)
    dead = {2: "silent", 3: "silent"}
    assert watch.lost(["node1", "node2"], processes=procs, dead=dead, now=101.0) == (), "not silent long enough"
    watch.observe("node2", "4", 101.5)  # node2's launcher beats on
    assert watch.lost(["node1", "node2"], processes=procs, dead=dead, now=102.5) == ("node1",)
    assert watch.lost(["node1"], processes=procs, dead={2: "silent"}, now=102.5) == (), \
        "a live process of the node: its launcher may only be slow"
    assert watch.lost(["node3"], processes=procs, dead=dead, now=200.0) == (), "never seen: not judged"
    watch.observe("node4", None, 100.0)  # a launcher with no beat (and no record) on this store: cut off while it moved
    assert watch.lost(["node4"], processes=procs, dead=dead, now=105.0) == ()
    assert watch.lost(["node4"], processes=procs, dead=dead, now=106.5) == ("node4",), "silent past the bound"
    assert watch.lost(["node1"], processes=procs, dead={}, now=106.5) == ("node1",), \
        "silent past the bound: lost although nobody declared its processes (the job gave up first)"


def test_the_restart_goes_on_without_a_lost_node_when_spares_or_elastic_allow_else_names_the_setting() -> None:
    lost = {"node1": (2, 3)}
    ok = restart_verdict(lost=lost, processes=6, spares=2, elastic=False)
    assert ok.go_on and "spares take their places" in ok.message
    shrink = restart_verdict(lost=lost, processes=4, spares=0, elastic=True)
    assert shrink.go_on and "smaller data-parallel size" in shrink.message
    no = restart_verdict(lost=lost, processes=4, spares=0, elastic=False)
    assert not no.go_on
    assert "node(s) node1 lost for good" in no.message and "neighbor_ckpt.elastic.enabled: true" in no.message
    assert "2 more process(es) than the 2 left" in no.message


def test_the_majority_restarts_without_the_launchers_cut_off_and_the_spares_take_their_processes() -> None:
    """The campaign's minority case: nodes 0 and 4 (process 0, spare 4) cut off, their launchers never seen on the
    store the majority moved to; the 4 that joined restart processes 1, 2, 3, 5 for the job's 4 ranks."""
    joined = {"node1": (1,), "node2": (2,), "node3": (3,), "node5": (5,)}
    verdict, found = rendezvous_verdict(launchers=6, lost_before={}, joined=joined,
                                        lost={"unseen1.0": (), "unseen1.1": ()}, processes=6, spares=2, elastic=False)
    assert verdict.go_on and not verdict.cut_off and "4 processes for 4 ranks" in verdict.message
    assert found == {"unseen1.0": (0, 4), "unseen1.1": ()}, "what no joined launcher restarts is lost, once"


def test_a_minority_never_restarts_it_says_it_is_cut_off() -> None:
    verdict, found = rendezvous_verdict(launchers=6, lost_before={}, joined={"node0": (0,), "node4": (4,)},
                                        lost={n: (i,) for i, n in ((1, "node1"), (2, "node2"), (3, "node3"),
                                                                   (5, "node5"))},
                                        processes=6, spares=2, elastic=True)
    assert not verdict.go_on and verdict.cut_off and CUT_OFF in verdict.message and found == {}
    half, _ = rendezvous_verdict(launchers=4, lost_before={}, joined={"a": (0,), "b": (1,)}, lost={"c": (2,), "d": (3,)},
                                 processes=4, spares=0, elastic=True)
    assert half.cut_off, "half is no majority: a cut in two equal halves restarts on neither side"


def test_nodes_lost_at_an_earlier_restart_leave_the_quorum_set_and_a_records_gap_goes_to_a_lost_node() -> None:
    before = {"node0": (0, 1)}
    verdict, found = rendezvous_verdict(launchers=4, lost_before=before, joined={"node1": (2, 3), "node2": (4, 5)},
                                        lost={"node3": (6,)}, processes=8, spares=4, elastic=False)
    assert verdict.go_on and found == {"node3": (6, 7)}, "process 7 exited before node3's record was written"
    alone, _ = rendezvous_verdict(launchers=4, lost_before=before, joined={"node1": (2, 3)},
                                  lost={"node2": (4, 5), "node3": (6, 7)}, processes=8, spares=4, elastic=False)
    assert alone.cut_off, "1 of the 3 left is no majority"
    short, _ = rendezvous_verdict(launchers=3, lost_before={}, joined={"node0": (0, 1), "node1": (2, 3)},
                                  lost={"node2": (4, 5)}, processes=6, spares=1, elastic=False)
    assert not short.go_on and not short.cut_off and "neighbor_ckpt.elastic.enabled: true" in short.message


def test_a_node_the_last_generation_left_out_is_out_of_the_quorum_set_so_two_survivors_of_four_restart() -> None:
    """Four nodes (node0, node1 and two spare nodes): node1 lost, generation 1 formed without it (a majority did), then
    node2 lost during that recovery: node0 and node3 are a majority of the three the last generation held."""
    joined = {"node0": (0, 1), "node3": (6, 7)}
    lost = {"node1": (2, 3), "node2": (4, 5)}
    verdict, found = rendezvous_verdict(launchers=4, lost_before={}, joined=joined, lost=lost, processes=8, spares=4,
                                        elastic=False, members=frozenset({0, 1, 4, 5, 6, 7}))
    assert verdict.go_on and found == lost and "node(s) node1, node2 lost for good" in verdict.message
    none_formed, _ = rendezvous_verdict(launchers=4, lost_before={}, joined=joined, lost=lost, processes=8, spares=4,
                                        elastic=False, members=None)
    assert none_formed.cut_off, "without a generation that left node1 out, 2 of 4 is no majority"


@pytest.fixture()
def tcp() -> Any:
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True,
                           timeout=timedelta(seconds=10))
    yield port
    del master


def _rendezvous(port: int, node: str, indices: tuple[int, ...], *, nodes: int, timeout_s: float = 1.0,
                spares: int = 2) -> RestartRendezvous:
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, use_libuv=True,
                           timeout=timedelta(seconds=10))
    lock = threading.Lock()

    def call(attempt: int, fn: Callable[[Any], Any]) -> Any:
        with lock:
            return fn(dist.PrefixStore(launch_prefix("r", attempt), client))

    beats = [0]

    def beat(attempt: int) -> None:
        beats[0] += 1
        call(attempt, lambda s: s.set(key("lhb", node), str(beats[0])))

    return RestartRendezvous(node=node, nodes=nodes, indices=indices, call=call, later=call, pending=lambda: False,
                             beat=beat, timeout_s=timeout_s, store_timeout_s=1.0, poll_s=0.05,
                             rendezvous_timeout_s=600, processes=6, spares=spares, elastic=False,
                             stopped=lambda: False, store_lost=lambda: False)


def _meet_all(rendezvous: list[RestartRendezvous], number: int) -> list[bool]:
    out: list[bool] = [False] * len(rendezvous)

    def run(i: int) -> None:
        out[i] = rendezvous[i].meet(number)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(rendezvous))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_launchers_never_seen_on_the_moved_store_are_not_waited_for_and_one_launcher_declares_their_processes(
        tcp: int) -> None:
    """Attempt 0's keys on the store the majority moved to hold only the 4 launchers that wrote their part there
    again; nodes 0 and 4 (cut off) never did. Attempt 1's rendezvous goes on without them, within the bound (no
    300 s wait): every launcher agrees, and the processes 0 and 4 are declared dead by exactly one of them."""
    mine = {"node1": (1,), "node2": (2,), "node3": (3,), "node5": (5,)}
    rdzv = [_rendezvous(tcp, n, p, nodes=6) for n, p in mine.items()]
    for r in rdzv:
        r.announce(0)
        r._call(0, lambda s, r=r: s.set(key("launcher", r.node), json.dumps({"pid": 1, "processes": list(r.indices)})))
    assert _meet_all(rdzv, 1) == [True] * 4
    assert all(not r.cut_off and sorted(p for v in r.lost.values() for p in v) == [0, 4] for r in rdzv)
    declared = [r.to_declare(1) for r in rdzv]
    assert sorted(p for d in declared for p in d) == [0, 4], declared
    store = dist.PrefixStore(launch_prefix("r", 1), dist.TCPStore("127.0.0.1", tcp, is_master=False,
                                                                  wait_for_workers=False, use_libuv=True,
                                                                  timeout=timedelta(seconds=10)))
    assert set(parse_nodes(store.get("joined"))) == set(mine)
    assert {n: tuple(json.loads(store.get(key("joined", n)))) for n in mine} == mine


def test_a_minority_of_the_launchers_stops_its_restart_as_cut_off_instead_of_waiting(tcp: int) -> None:
    """Two of five launchers (the side cut off, still on its old store): the three others' beats stand still there.
    Neither restarts: both end the rendezvous cut off, without the rendezvous timeout."""
    rdzv = [_rendezvous(tcp, n, (i,), nodes=5) for i, n in enumerate(("node0", "node1"))]
    others = _rendezvous(tcp, "node2", (2,), nodes=5)
    for n in ("node2", "node3", "node4"):
        others._call(0, lambda s, n=n: (s.append("nodes", f"{n},"), s.set(key("lhb", n), "7")))
    for r in rdzv:
        r.announce(0)
    assert _meet_all(rdzv, 1) == [False, False]
    assert all(r.cut_off and not r.lost for r in rdzv)


@pytest.mark.timeout(120)
def test_every_launcher_takes_the_first_stop_verdict_and_the_store_host_waits_until_each_said_it_stops(
        tcp: int, caplog: pytest.LogCaptureFixture) -> None:
    """Node 1 (processes 2, 3) lost for good, one spare for two lost ranks, no elastic: the restart stops. Node 0's
    watch reaches that verdict at once; node 2's would take 600 s (so without the written verdict this test would
    wait out its 120 s limit): it takes node 0's ``stop`` at its next look, so it is not still watching when node 0,
    hosting the store, exits with it (CI, stop 50: node 2 then took itself for cut off, exit 79 beside node 0's 1).
    Neither is cut off; both say they stop, so the store's host waits for nobody; a joined launcher that never says
    so is waited for only up to the bound."""
    fast = _rendezvous(tcp, "node0", (0, 1), nodes=3, timeout_s=0.3, spares=1)
    slow = _rendezvous(tcp, "node2", (4, 5), nodes=3, timeout_s=600, spares=1)
    fast._call(0, lambda s: (s.append("nodes", "node0,node1,node2,"), s.set(key("lhb", "node1"), "7"),
                             s.set(key("launcher", "node1"), json.dumps({"pid": 1, "processes": [2, 3]})),
                             s.append("dead", "2:silent for 2.1 s;3:silent for 2.1 s;")))
    assert _meet_all([fast, slow], 1) == [False, False]
    assert not fast.cut_off and not slow.cut_off and not slow.lost
    store = dist.PrefixStore(launch_prefix("r", 1), dist.TCPStore("127.0.0.1", tcp, is_master=False,
                                                                  wait_for_workers=False, use_libuv=True,
                                                                  timeout=timedelta(seconds=10)))
    assert "node(s) node1 lost for good" in store.get(STOP).decode()
    assert sorted(parse_nodes(store.get(STOPPED))) == ["node0", "node2"]
    fast.wait_stopped(1, bound_s=60)  # returns at its first look
    assert "not every launcher said it stops" not in caplog.text
    store.append("joined", "node3,")
    fast.wait_stopped(1, bound_s=0.3)
    assert "restart 1: not every launcher said it stops within 0 s: exiting anyway" in caplog.text


@pytest.mark.timeout(120)
def test_once_complete_the_store_host_waits_until_every_other_launcher_left_and_no_longer_than_its_bound(
        tcp: int) -> None:
    """The host of the store in use waits for every other launcher of the attempt to say it leaves (each does once
    its processes exited: they and its idle spares read ``complete`` there); without them it would have to wait
    a fixed time. A node that never leaves (lost) is waited for only up to the bound."""
    host = _rendezvous(tcp, "node0", (0,), nodes=3)
    others = [_rendezvous(tcp, n, (i,), nodes=3) for n, i in (("node1", 1), ("node2", 2))]
    for r in (host, *others):
        r.announce(0)
    waited = threading.Thread(target=host.leave, args=(0,), kwargs=dict(hosting=True, reachable=True, bound_s=600))
    waited.start()
    for r in others:
        r.leave(0, hosting=False, reachable=True, bound_s=600)
    waited.join(timeout=60)
    assert not waited.is_alive(), "the host still waits though every other launcher left"
    others[0].leave(1, hosting=False, reachable=True, bound_s=600)  # attempt 1: node2 never leaves
    for r in (host, *others):
        r.announce(1)
    assert not wait_said(host._call, 1, listed="nodes", said="left", but=("node0",), bound_s=0.3, poll_s=0.05)
    others[1].leave(1, hosting=False, reachable=False, bound_s=600)  # its store unreachable: it writes nothing
    assert not wait_said(host._call, 1, listed="nodes", said="left", but=("node0",), bound_s=0.3, poll_s=0.05)
