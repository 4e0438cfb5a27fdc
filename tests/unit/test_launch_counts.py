"""The launchers' counts are sets and claims, so a write applied twice counts once
(:mod:`neighbor_ckpt.inprocess.launch_counts`), and attempt 0's roll call of launchers that never reached a store
(:mod:`neighbor_ckpt.inprocess.roll_call`), over a real TCP store in one process. A store host that drops replies:
``tests/multiproc/test_idempotent_writes.py``."""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from neighbor_ckpt.inprocess.launch_counts import (claim_index, everyone_exited, exited, handed_out, id_list,
                                                   mark_exited, raise_processes)
from neighbor_ckpt.inprocess.roll_call import RollCall, absent_processes, reach_any
from tests.conftest import free_port


@pytest.fixture()
def store() -> Any:
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True,
                           timeout=timedelta(seconds=10))
    yield dist.PrefixStore("job/0", dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                                  use_libuv=True, timeout=timedelta(seconds=10)))
    del master


def test_exited_is_a_set_written_again_without_counting_twice(store: Any) -> None:
    assert id_list({3, 1, 3}) == "1,3," and exited(store) == set()
    mark_exited(store, [1])
    mark_exited(store, [1, 2])  # a retry, or the failover handler's rewrite, and a queued write
    mark_exited(store, [])
    assert exited(store) == {1, 2}
    raise_processes(store, 3)
    assert not everyone_exited(store), "process 0 still runs"
    mark_exited(store, [0])
    assert everyone_exited(store)


def test_processes_is_only_raised_and_a_retried_claim_takes_its_own_index(store: Any) -> None:
    assert handed_out(store) == 0 and not everyone_exited(store)
    assert raise_processes(store, 3) == 3 and raise_processes(store, 2) == 3, "never lowered"
    assert claim_index(store, "node1:7:0:0", first=3) == 3
    assert claim_index(store, "node1:7:0:0", first=3) == 3, "the same write id again: the same index"
    assert handed_out(store) == 4
    assert claim_index(store, "node0:9:0:0", first=3) == 4 and handed_out(store) == 5


def test_a_launcher_that_never_came_has_its_processes_found_absent_once_the_others_wrote_theirs() -> None:
    kw: dict[str, Any] = {"processes": 5, "nodes": 5, "dead": {}, "gone": set()}
    came = ["node0", "node1", "node3", "node4"]
    records = {"node0": (0,), "node1": (1,), "node3": (3,), "node4": (4,)}
    assert absent_processes(came=came, records=records, **kw) == (2,)
    assert absent_processes(came=came + ["node2"], records={**records, "node2": (2,)}, **kw) is None, "all came"
    assert absent_processes(came=came, records={k: v for k, v in records.items() if k != "node4"}, **kw) is None, \
        "a launcher that came has not said which processes it runs yet"
    assert absent_processes(came=came, records={**records, "node4": ()}, **{**kw, "dead": {4: "exited: x"}}) == (2,), \
        "a process that already exited (its launcher's record without it) is not absent"


def test_the_roll_call_waits_for_a_ready_process_and_the_bound_then_names_the_absent(store: Any) -> None:
    roll = RollCall(processes=3, nodes=3, bound_s=5.0)
    store.append("nodes", "node0,")
    store.append("nodes", "node2,")
    store.set("launcher/node0", json.dumps({"pid": 1, "processes": [0]}))
    store.set("launcher/node2", json.dumps({"pid": 2, "processes": [2]}))
    assert roll.look(store, 100.0) is None and roll.ready_at is None, "no process ready yet: nothing is judged"
    store.append("ready", "0,")
    assert roll.look(store, 101.0) is None and roll.ready_at == 101.0
    assert roll.look(store, 105.0) is None, "within the bound: a launcher may still come"
    assert roll.look(store, 106.5) == ((1,), ["node0", "node2"])
    assert roll.done and roll.look(store, 200.0) is None, "found once"
    assert roll.lost(["node0", "node2"], (1,)) == {"unreached0": (1,)}
    go = roll.verdict((1,), ["node0", "node2"], spares=1, elastic=False)
    assert go.go_on and "1 of the 3 launchers never reached a store" in go.message and "[1] never started" in go.message
    stop = roll.verdict((1,), ["node0", "node2"], spares=0, elastic=False)
    assert not stop.go_on and "cannot cover the job's 3 ranks" in stop.message


def test_every_launcher_came_ends_the_roll_call(store: Any) -> None:
    roll = RollCall(processes=2, nodes=2, bound_s=0.0)
    store.append("ready", "1,")
    store.append("nodes", "node0,node1,")
    assert roll.look(store, 1.0) is None and roll.look(store, 2.0) is None and roll.done


def test_generation_0_formed_ends_the_roll_call(store: Any) -> None:
    """Its barrier waited for every process, so nobody was absent (a store moved since holds fewer ``nodes``)."""
    roll = RollCall(processes=3, nodes=3, bound_s=0.0)
    store.append("ready", "1,")
    store.append("nodes", "node1,")
    store.set("launcher/node1", json.dumps({"pid": 1, "processes": [1]}))
    store.set("gen/0/members", "{}")
    assert roll.look(store, 1.0) is None and roll.look(store, 2.0) is None and roll.done


def test_reach_any_finds_a_listening_store_and_names_why_the_others_were_not() -> None:
    with socket.socket() as closed, socket.socket() as listening:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused, and nobody takes the port
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        dead, live = ("127.0.0.1", closed.getsockname()[1]), ("127.0.0.1", listening.getsockname()[1])
        assert reach_any([dead, live], 5.0) == (1, {0: "Connection refused"})
        assert reach_any([dead], 0.5) == (None, {0: "Connection refused"})


def test_reach_any_proves_the_token_to_a_gate_so_the_gate_refuses_nobody() -> None:
    import time

    from neighbor_ckpt.inprocess.store_auth import Gate

    token = b"t" * 32
    with socket.socket() as backend, socket.socket() as listen:
        backend.bind(("127.0.0.1", 0))
        backend.listen()
        listen.bind(("127.0.0.1", 0))
        listen.listen()
        gate = Gate(listen, backend.getsockname(), token)
        try:
            assert reach_any([listen.getsockname()], 5.0, token=token)[0] == 0
            backend.settimeout(5.0)
            backend.accept()[0].close()  # the gate admitted the probe and spliced it to the store
            assert gate.refused() == 0
            assert reach_any([listen.getsockname()], 5.0)[0] == 0, "reached, whatever the gate thinks of it"
            deadline = time.monotonic() + 10
            while gate.refused() == 0 and time.monotonic() < deadline:  # without the token: refused (and logged)
                time.sleep(0.05)
            assert gate.refused() == 1
        finally:
            gate.close()


def test_a_roll_call_of_a_minority_of_the_launchers_forms_nothing_and_is_cut_off() -> None:
    """Node 0 (the primary store's host) cut off while the others start: it alone reached its store, and with
    elastic (or spares enough) its processes could cover the ranks. On 2c061fd it declared the others never started
    and went on beside them, both sides training; now the verdict is ``cut off from the majority``."""
    from neighbor_ckpt.inprocess.quorum import CUT_OFF

    roll = RollCall(processes=4, nodes=4, bound_s=0.0)
    for spares, elastic in ((0, True), (3, False)):
        alone = roll.verdict((1, 2, 3), ["node0"], spares=spares, elastic=elastic)
        assert alone.cut_off and not alone.go_on and CUT_OFF in alone.message, alone
        half = roll.verdict((2, 3), ["node0", "node1"], spares=spares, elastic=elastic)
        assert half.cut_off and not half.go_on, "2 of 4 is no majority"
    most = roll.verdict((3,), ["node0", "node1", "node2"], spares=0, elastic=True)
    assert most.go_on and not most.cut_off, most


def test_the_stores_a_launcher_timed_out_on_at_start_get_the_store_timeout_not_the_connect_timeout() -> None:
    """A cut at start-up: no connection to store 0 completes (timed out) while store 1 accepts. Its first operation
    then gets the store timeout, so the failover comes in seconds (it took 124 s); a refusal (a host still
    starting) keeps the connect timeout's patience."""
    from neighbor_ckpt.inprocess.roll_call import unreached_stores
    from neighbor_ckpt.inprocess.stores import StoreAddresses, StoreSet

    assert unreached_stores({0: "TimeoutError", 1: "Connection refused"}, before=2) == (0,)
    assert unreached_stores({0: "No route to host"}, before=1) == (0,)
    assert unreached_stores({}, before=0) == ()
    stores = StoreSet(StoreAddresses.parse("127.0.0.1:1,127.0.0.1:2", "test"), run_id="r", timeout_s=3.0,
                      connect_timeout_s=120.0)
    stores.unreached((0,))
    assert stores._client("main", 0).connect_timeout_s == 3.0
    assert stores._client("main", 1).connect_timeout_s == 120.0
    stores.close()
