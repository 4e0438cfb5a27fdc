"""neighbor_ckpt.inprocess.abort in one process: the scoped socket abort on plain sockets, the watchdog, the thread
interruption. Real gloo groups in several processes: tests/multiproc/test_scoped_abort.py.

The socket tests run in the pytest process itself: the abort only touches sockets opened since its baseline, which
is the point (other tests' stores and connections are older)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Iterator

import pytest

from neighbor_ckpt.inprocess import abort as ab
from neighbor_ckpt.inprocess.protocol import EXIT_ABORT_HUNG


class _Pair:
    """A listener and one connection to it: ``cli`` (connecting side) and ``acc`` (accepted side)."""

    def __init__(self, srv: socket.socket | None = None) -> None:
        self.own_srv = srv is None
        self.srv = srv or socket.create_server(("127.0.0.1", 0))
        self.cli = socket.create_connection(self.srv.getsockname())
        self.acc, _ = self.srv.accept()

    @property
    def port(self) -> int:
        return int(self.srv.getsockname()[1])

    def works(self) -> bool:
        self.cli.sendall(b"p")
        self.acc.settimeout(5)
        return self.acc.recv(1) == b"p"

    def close(self) -> None:
        for s in (self.cli, self.acc) + ((self.srv,) if self.own_srv else ()):
            s.close()


@pytest.fixture()
def pairs() -> Iterator[list[_Pair]]:
    made: list[_Pair] = []
    yield made
    for p in made:
        p.close()


def _recv_in_thread(sock: socket.socket) -> tuple[threading.Thread, list[bytes]]:
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(sock.recv(10)), daemon=True)
    t.start()
    time.sleep(0.1)
    return t, got


def test_abort_frees_a_receive_blocked_on_a_connection_accepted_since_the_baseline(pairs: list[_Pair]) -> None:
    before = _Pair()  # the user's connection (and server) from before the attempt
    pairs.append(before)
    baseline = ab.SocketBaseline.capture()
    ours = _Pair()  # stands for a gloo pair: a new listener and a connection accepted on it
    pairs.append(ours)
    assert ab.new_listeners(baseline) == {ab.Endpoint("127.0.0.1", ours.port)}
    t, got = _recv_in_thread(ours.cli)
    res = ab.abort_gloo(baseline)
    t.join(120)
    assert not t.is_alive() and got == [b""], "the blocked recv was not freed"
    # the accepted side only: the connecting side is this process's too, but its remote is no peer listener given
    assert (res.accepted, res.to_peers, res.closed) == (1, 0, 1) and res.seconds >= 0
    assert before.works(), "a connection from before the baseline was shut down"


def test_abort_keeps_new_connections_to_other_servers_and_kept_ports(pairs: list[_Pair]) -> None:
    server = socket.create_server(("127.0.0.1", 0))  # the user's server, listening before the attempt
    store_srv = socket.create_server(("127.0.0.1", 0))
    try:
        baseline = ab.SocketBaseline.capture()
        user = _Pair(server)  # a connection opened during the attempt to a non-gloo server
        kept = _Pair()  # a new listener, but its port is kept (a store hosted in this process)
        pairs.extend([user, kept])
        res = ab.abort_gloo(baseline, keep_ports={kept.port})
        assert res.closed == 0
        assert user.works() and kept.works()
    finally:
        server.close()
        store_srv.close()


def test_abort_shuts_down_connections_to_peer_listeners(pairs: list[_Pair]) -> None:
    peer_srv = socket.create_server(("127.0.0.1", 0))  # stands for a peer's gloo listener (older than the baseline:
    try:                                                # only the published endpoint marks it)
        baseline = ab.SocketBaseline.capture()
        to_peer = _Pair(peer_srv)
        pairs.append(to_peer)
        t, got = _recv_in_thread(to_peer.cli)
        peers = ab.parse_endpoints(ab.format_endpoints([ab.Endpoint("127.0.0.1", to_peer.port)]))
        res = ab.abort_gloo(baseline, peer_listeners=peers)
        t.join(120)
        assert not t.is_alive(), "the blocked recv was not freed"
        assert got == [b""] and (res.accepted, res.to_peers) == (0, 1)
        assert ab.abort_gloo(baseline, peer_listeners=peers).closed <= 1  # repeatable (a shut socket may stay listed)
    finally:
        peer_srv.close()


def test_the_wide_abort_frees_a_wait_on_a_peer_whose_listeners_are_unknown_and_keeps_only_kept_ports(
        pairs: list[_Pair]) -> None:
    """A peer cut off by the network that published its listeners only on the store this process lost: the scoped
    abort cannot tell the connection this process opened to it from the user's, and leaves it; the escalation
    (``wide``) shuts down every connection opened since the baseline but the kept ports', and a connect still in
    progress; the connections from before the baseline stay up."""
    before = _Pair()
    pairs.append(before)
    peer_srv = socket.create_server(("127.0.0.1", 0))  # the cut peer's gloo listener, never published here
    store_srv = socket.create_server(("127.0.0.1", 0))  # the live store
    try:
        baseline = ab.SocketBaseline.capture()
        to_peer, store = _Pair(peer_srv), _Pair(store_srv)
        pairs.extend([to_peer, store])
        connecting = socket.socket()  # a connect in progress (to a peer behind a cut: SYN_SENT), or never made
        try:
            t, got = _recv_in_thread(to_peer.cli)
            assert ab.abort_gloo(baseline, keep_ports={store.port}).closed == 0 and t.is_alive()
            res = ab.abort_gloo(baseline, keep_ports={store.port}, wide=True)
            t.join(120)
            assert not t.is_alive() and got == [b""], "the blocked recv was not freed"
            assert (res.accepted, res.to_peers) == (0, 0) and res.others >= 2  # both ends of the pair (one process)
            assert store.works() and before.works(), "a kept or older connection was shut down"
        finally:
            connecting.close()
    finally:
        peer_srv.close()
        store_srv.close()


def test_endpoints_round_trip_and_match_unspecified_hosts() -> None:
    eps = {ab.Endpoint("10.0.0.2", 4000), ab.Endpoint("fe80::1", 5000), ab.Endpoint("0.0.0.0", 6000)}
    text = ab.format_endpoints(eps)
    assert text == "0.0.0.0:6000,10.0.0.2:4000,[fe80::1]:5000"
    assert ab.parse_endpoints(text) == eps and ab.parse_endpoints("") == frozenset()
    assert ab.parse_endpoints("::ffff:10.0.0.3:7") == {ab.Endpoint("10.0.0.3", 7)}
    assert ab.Endpoint.of(("::ffff:10.0.0.3", 7)) == ab.Endpoint("10.0.0.3", 7)
    assert ab.Endpoint("0.0.0.0", 6000).matches(ab.Endpoint("10.0.0.9", 6000))
    assert not ab.Endpoint("10.0.0.2", 6000).matches(ab.Endpoint("10.0.0.9", 6000))
    with pytest.raises(ValueError, match="host:port"):
        ab.parse_endpoints("10.0.0.2")


# -- the watchdog -------------------------------------------------------------------------------------------------


def test_watchdog_exits_with_abort_hung_when_the_abort_does_not_return(caplog: pytest.LogCaptureFixture) -> None:
    exited: list[int] = []
    release = threading.Event()

    def fake_exit(code: int) -> None:  # os._exit would not return; let the hung "abort" go instead
        exited.append(code)
        release.set()

    t0 = time.monotonic()
    ab.call_with_watchdog(lambda: release.wait(120), timeout_s=0.2, what="fake abort", exit_fn=fake_exit)
    assert exited == [EXIT_ABORT_HUNG] and time.monotonic() - t0 > 0.15, "the watchdog waits its timeout first"
    assert any("fake abort did not return within 0.2 s" in r.getMessage() for r in caplog.records)


def test_watchdog_stays_quiet_for_a_prompt_abort_and_passes_its_result_and_errors() -> None:
    exited: list[int] = []
    # a generous bound: a loaded machine must not make a prompt call look hung
    assert ab.call_with_watchdog(lambda: 42, timeout_s=60, what="x", exit_fn=exited.append) == 42

    def boom() -> None:
        raise RuntimeError("abort failed")

    with pytest.raises(RuntimeError, match="abort failed"):
        ab.call_with_watchdog(boom, timeout_s=60, what="x", exit_fn=exited.append)
    assert exited == []  # the watchdog thread was joined before the call returned
    assert not any(t.name == "neighbor_ckpt-abort-watchdog" for t in threading.enumerate())
    with pytest.raises(ValueError, match="timeout_s"):
        ab.call_with_watchdog(lambda: None, timeout_s=0, what="x")


def test_nccl_abort_is_a_no_op_without_nccl_groups(group: object) -> None:
    import torch.distributed as dist

    assert ab.abort_nccl(timeout_s=60, exit_fn=lambda code: pytest.fail("no watchdog exit expected")) is False
    assert dist.is_initialized()  # the gloo groups were left alone


def test_nccl_abort_aborts_the_world_under_the_watchdog_when_a_group_is_nccl(
        group: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path with torch's pieces faked: gloo groups alone are no reason to abort; an NCCL group is, and a
    hanging abort ends the process with EXIT_ABORT_HUNG."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(c10d, "_abort_process_group", lambda: pytest.fail("gloo only: must not abort"))
    assert ab.abort_nccl(timeout_s=60) is False
    pg = next(iter(c10d._world.pg_map))
    monkeypatch.setitem(c10d._world.pg_map, pg, ("cpu:gloo,cuda:nccl", c10d._world.pg_map[pg][1]))
    calls: list[str] = []
    monkeypatch.setattr(c10d, "_abort_process_group", lambda: calls.append("abort"))
    assert ab.abort_nccl(timeout_s=60, exit_fn=lambda code: pytest.fail("no hang")) is True and calls == ["abort"]
    release, exited = threading.Event(), []
    monkeypatch.setattr(c10d, "_abort_process_group", lambda: release.wait(120))
    ab.abort_nccl(timeout_s=0.1, exit_fn=lambda code: (exited.append(code), release.set()))
    assert exited == [EXIT_ABORT_HUNG]


# -- interrupting the training thread ------------------------------------------------------------------------------


def _python_loop(seen: list[BaseException], started: threading.Event) -> None:
    started.set()
    try:
        while True:
            try:
                time.sleep(0.001)
            except Exception:  # noqa: BLE001 - user code that swallows errors must not swallow the abort
                pass
    except ab.GenerationAborted as e:
        seen.append(e)


def test_interrupt_thread_raises_generation_aborted_through_except_exception() -> None:
    seen: list[BaseException] = []
    started = threading.Event()
    t = threading.Thread(target=_python_loop, args=(seen, started), daemon=True)
    t.start()
    assert started.wait(120), "the thread did not start"
    assert t.ident is not None and ab.interrupt_thread(t.ident)
    t.join(120)
    assert not t.is_alive() and len(seen) == 1 and isinstance(seen[0], ab.GenerationAborted)
    assert not isinstance(seen[0], Exception)


def test_interrupt_thread_refuses_non_exceptions_and_reports_unknown_threads() -> None:
    with pytest.raises(TypeError, match="exception class"):
        ab.interrupt_thread(threading.get_ident(), "boom")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ab.interrupt_thread(threading.get_ident(), ab.GenerationAborted())  # type: ignore[arg-type]
    assert ab.interrupt_thread(2**31 + 12345) is False


def test_clear_pending_withdraws_an_exception_that_has_not_fired() -> None:
    go = threading.Event()
    hit: list[BaseException] = []
    ready = threading.Event()

    def worker() -> None:
        ready.set()
        go.wait(120)  # blocked in C: the exception is pending, not fired
        try:
            for _ in range(1000):
                pass
        except ab.GenerationAborted as e:
            hit.append(e)

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    assert ready.wait(120), "the thread did not start"
    assert t.ident is not None and ab.interrupt_thread(t.ident)
    ab.clear_pending(t.ident)
    go.set()
    t.join(120)
    assert not t.is_alive() and hit == []
