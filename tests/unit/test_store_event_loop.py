"""The store hosts' event loop (issue 52, step 4): the handshake as a state machine on a loop
(:class:`~neighbor_ckpt.inprocess.store_handshake.Exchange`: its deadline, a wrong token, bytes that come in pieces,
what follows the answer left for the store) and splicing with a bounded buffer per direction
(:class:`~neighbor_ckpt.inprocess.splice.Splice`: back-pressure, half-close, a reset passed on), each over real
sockets in one process. Thousands of connections through a real gate to a real store, with the store host's
threads counted: tests/multiproc/test_store_gate_many.py."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from neighbor_ckpt.inprocess.event_loop import Connect, Loop
from neighbor_ckpt.inprocess.splice import Splice
from neighbor_ckpt.inprocess.store_handshake import (ANSWER_BYTES, HELLO_BYTES, MAGIC, Exchange, Refused,
                                                     client_steps, gate_steps)
from neighbor_ckpt.inprocess.store_auth import challenge, prove

WAIT_S = 30.0
"""How long a test waits for an event (generous: nothing here measures time)."""


def _until(ok: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (got := ok()):
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.01)
    return got


@pytest.fixture()
def loop() -> Iterator[Loop]:
    loop = Loop("test-loop")
    yield loop
    loop.linger()  # its thread ends once it holds nothing


def challenge_answer(token: bytes, hello: bytes) -> bytes:
    """The client's answer to a gate's hello, written out here as the wire protocol says (not the library's code)."""
    return hmac.new(token, b"client\n" + MAGIC + hello[len(MAGIC):], hashlib.sha256).digest()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname()[:2])
        b, _ = listener.accept()
    return a, b


def _exchange(loop: Loop, sock: socket.socket, steps: Any, deadline_s: float) -> list:
    """Start an :class:`Exchange` of ``steps`` on ``sock`` on the loop; the list it puts ``(result, error)`` in."""
    out: list = []

    def start() -> None:
        loop.hold(sock)
        Exchange(loop, sock, steps, time.monotonic() + deadline_s, lambda r, e: out.append((r, e)))

    loop.call(start)
    return out


def test_the_gate_side_admits_an_answer_that_comes_a_byte_at_a_time_and_leaves_what_follows_for_the_store(
        loop: Loop) -> None:
    token = os.urandom(32)
    gate, client = socket.socketpair()
    out = _exchange(loop, gate, gate_steps(token), 30.0)
    hello = b""
    while len(hello) < HELLO_BYTES:
        hello += client.recv(HELLO_BYTES - len(hello))
    answer = challenge_answer(token, hello) + b"m" * 16
    for b in answer[:-1]:  # in pieces: each a read of its own at the gate
        client.send(bytes([b]))
        time.sleep(0.002)
    client.sendall(answer[-1:] + b"torch's first request")  # the rest of the answer and what follows it
    result, error = _until(lambda: out, "the handshake ended")[0]
    assert (result, error) == (True, None)
    proof = b""
    while len(proof) < 32:
        proof += client.recv(32)
    assert len(proof) == 32
    gate.setblocking(True)
    gate.settimeout(5)
    assert gate.recv(64) == b"torch's first request", "the gate read no byte past the answer"
    gate.close()
    client.close()


def test_the_gate_side_refuses_a_wrong_token_and_sends_nothing_more(loop: Loop) -> None:
    gate, client = socket.socketpair()
    out = _exchange(loop, gate, gate_steps(os.urandom(32)), 30.0)
    hello = client.recv(HELLO_BYTES)
    assert hello.startswith(MAGIC)
    client.sendall(challenge_answer(os.urandom(32), hello) + b"m" * 16)
    assert _until(lambda: out, "the handshake ended")[0] == (False, None)
    gate.close()
    assert client.recv(64) == b"", "no proof for a wrong token"
    client.close()


def test_the_deadline_ends_a_handshake_whose_bytes_drip_in(loop: Loop) -> None:
    """One deadline for the whole handshake, however the bytes come: each byte well within any per-read timeout."""
    gate, client = socket.socketpair()
    out = _exchange(loop, gate, gate_steps(os.urandom(32)), 0.5)
    client.recv(HELLO_BYTES)
    while not out:
        try:
            client.send(b"\0")
        except OSError:
            break
        time.sleep(0.05)
    result, error = out[0]
    assert result is None and isinstance(error, TimeoutError)
    assert f"the handshake's deadline passed" in str(error) and f"of {ANSWER_BYTES} bytes got" in str(error)
    assert 0 < int(str(error).split("(")[1].split(" of")[0]) < ANSWER_BYTES
    gate.close()
    client.close()


def test_a_connection_closed_during_the_handshake_ends_it_saying_how_far_it_got(loop: Loop) -> None:
    gate, client = socket.socketpair()
    out = _exchange(loop, gate, gate_steps(os.urandom(32)), 30.0)
    client.recv(HELLO_BYTES)
    client.sendall(b"\0" * 5)
    client.close()
    result, error = _until(lambda: out, "the handshake ended")[0]
    assert isinstance(error, ConnectionError) and "closed after 5 of 48 bytes" in str(error)
    gate.close()


def test_the_client_side_on_the_loop_speaks_to_the_blocking_gate_side(loop: Loop) -> None:
    """The tunnel's steps against :func:`challenge`: admitted with the token (the hello split in pieces on the
    way), :class:`Refused` with another, and by something that is not a gate."""
    token = os.urandom(32)
    for gate_token, refused in ((token, None), (os.urandom(32), "refused this process's token")):
        gate, client = socket.socketpair()
        verdict: list = []

        def gate_side(gate: socket.socket = gate, gate_token: bytes = gate_token) -> None:
            gate.settimeout(30)
            verdict.append(challenge(gate, gate_token))
            gate.close()

        out = _exchange(loop, client, client_steps(token), 30.0)
        t = threading.Thread(target=gate_side)
        t.start()
        result, error = _until(lambda: out, "the handshake ended")[0]
        t.join()
        if refused is None:
            assert (result, error, verdict) == (None, None, [True])
        else:
            assert isinstance(error, Refused) and refused in str(error) and verdict == [False]
        client.close()
    impostor, client = socket.socketpair()
    out = _exchange(loop, client, client_steps(token), 30.0)
    impostor.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 64)
    result, error = _until(lambda: out, "the handshake ended")[0]
    assert isinstance(error, Refused) and "not a neighbor_ckpt store gate" in str(error)
    impostor.close()
    client.close()


def test_the_blocking_sides_speak_to_the_loops_sides(loop: Loop) -> None:
    """:func:`prove` (a rank's ``roll_call``, the scale harness) against a gate's steps on the loop: the same bytes."""
    token = os.urandom(32)
    gate, client = socket.socketpair()
    out = _exchange(loop, gate, gate_steps(token), 30.0)
    client.settimeout(30)
    prove(client, token, time.monotonic() + 30)
    assert _until(lambda: out, "the handshake ended")[0] == (True, None)
    gate.close()
    client.close()


def _splice(loop: Loop, cap: int) -> tuple[socket.socket, socket.socket, list[Splice]]:
    """``a`` - [splice] - ``b`` over TCP on loopback: the two outer ends and the splice."""
    a, a_in = _tcp_pair()
    b_in, b = _tcp_pair()
    made: list[Splice] = []
    loop.call(lambda: made.append(Splice(loop, a_in, b_in, cap=cap)))
    return a, b, made


def test_a_full_buffer_stops_reading_its_source_so_the_sender_waits_and_nothing_is_lost(loop: Loop) -> None:
    """Back-pressure: ``b`` reads nothing while ``a`` sends all it can; the splice holds at most its buffer, the
    kernel's buffers fill, and ``a``'s sends stop being taken (bounded memory, nothing dropped); then ``b`` reads
    everything, in order."""
    cap = 4096
    a, b, (splice,) = _splice(loop, cap)
    a.setblocking(False)
    data = os.urandom(64 << 20)
    sent, stalled = 0, 0
    while sent < len(data) and stalled < 50:  # until the sender has waited for 0.5 s in all
        try:
            sent += a.send(data[sent:sent + 65536])
            stalled = 0
        except BlockingIOError:
            stalled += 1
            time.sleep(0.01)
            assert splice.buffered() <= cap
    assert sent < len(data), "the sender was never held back: the splice read everything into memory"
    assert splice.buffered() <= cap
    got = bytearray()
    b.settimeout(30)
    a.setblocking(True)
    rest = threading.Thread(target=lambda: (a.sendall(data[sent:sent + (1 << 20)]), a.shutdown(socket.SHUT_WR)))
    rest.start()
    while chunk := b.recv(1 << 20):
        got += chunk
    rest.join()
    total = sent + min(1 << 20, len(data) - sent)
    assert hashlib.sha256(got).digest() == hashlib.sha256(data[:total]).digest(), "every byte, in order"
    a.close()
    b.close()


def test_an_end_is_passed_on_as_a_half_close_and_both_ends_close_the_splice(loop: Loop) -> None:
    a, b, (splice,) = _splice(loop, 4096)
    for s in (a, b):
        s.settimeout(30)
    a.sendall(b"request")
    a.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := b.recv(64):
        got += chunk
    assert got == b"request", "b saw the bytes, then the end"
    b.sendall(b"answer after the end")  # the other direction is still open
    assert a.recv(64) == b"answer after the end"
    assert not splice.closed and loop.held() == 2
    b.close()
    assert a.recv(64) == b"", "a sees b's end"
    _until(lambda: splice.closed and loop.held() == 0, "the splice closed once both ends were passed on")
    a.close()


def test_a_reset_on_one_side_closes_both(loop: Loop) -> None:
    a, b, (splice,) = _splice(loop, 4096)
    b.settimeout(30)
    a.sendall(b"x")
    assert b.recv(1) == b"x"
    a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # close with a reset
    a.close()
    try:
        assert b.recv(64) == b""
    except ConnectionResetError:
        pass
    _until(lambda: splice.closed and loop.held() == 0, "the splice closed both sides")
    b.close()


def test_a_connect_that_is_refused_says_so_and_holds_nothing(loop: Loop) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        out: list = []
        loop.call(lambda: Connect(loop, ("127.0.0.1", port), 5.0, lambda sock, e: out.append((sock, e))))
        sock, error = _until(lambda: out, "the connect ended")[0]
    assert sock is None and isinstance(error, ConnectionRefusedError)
    assert loop.held() == 0


def test_a_name_is_resolved_off_the_loop_and_connected(loop: Loop) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        out: list = []
        loop.call(lambda: Connect(loop, ("localhost", listener.getsockname()[1]), 5.0,
                                  lambda sock, e: out.append((sock, e))))
        sock, error = _until(lambda: out, "the connect ended")[0]
        assert error is None and sock is not None and sock.getpeername()[1] == listener.getsockname()[1]
        loop.call(lambda: loop.close(sock))


def _echo_server() -> tuple[socket.socket, threading.Event]:
    """A store stand-in: echoes what each connection sends, on one thread of its own (selectors)."""
    import selectors

    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    listener.setblocking(False)
    stop = threading.Event()

    def run() -> None:
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ)
        while not stop.is_set():
            for key, _ in sel.select(0.1):
                if key.fileobj is listener:
                    try:
                        conn, _ = listener.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj  # type: ignore[assignment]
                try:
                    data = conn.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    conn.setblocking(True)
                    conn.sendall(data)
                    conn.setblocking(False)
                else:
                    sel.unregister(conn)
                    conn.close()
        sel.close()
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    return listener, stop


def test_a_gate_serves_hundreds_of_connections_on_its_one_thread_and_passes_the_stores_end_on() -> None:
    """300 clients with the token through a real gate to an echo store: each is admitted and answered, and the gate
    runs one thread (the release before: two per connection, and one per handshake); a client's end reaches the
    store, and the store's answer to it still comes back (half-close), then both ends close the connection."""
    from neighbor_ckpt.inprocess.store_auth import Gate

    backend, stop = _echo_server()
    token = os.urandom(32)
    before = set(threading.enumerate())
    gate = Gate(socket.create_server(("127.0.0.1", 0), backlog=1024), backend.getsockname()[:2], token)
    address = gate._sock.getsockname()[:2]
    clients = []
    for i in range(300):
        c = socket.create_connection(address, timeout=30)
        prove(c, token, time.monotonic() + 30)
        c.sendall(f"ping {i}".encode())
        clients.append(c)
    for i, c in enumerate(clients):
        assert c.recv(64) == f"ping {i}".encode()
    new = [t.name for t in set(threading.enumerate()) - before]
    assert gate.threads() == 1 and new == ["neighbor_ckpt-store-gate"], f"one thread for them all: {new}"
    assert gate.refused() == 0
    last = clients.pop()
    last.shutdown(socket.SHUT_WR)
    assert last.recv(64) == b"", "the store saw the end and closed; its end came back"
    for c in clients + [last]:
        c.close()
    gate.close()
    stop.set()
    _until(lambda: gate.threads() == 0, "the gate's loop ended once its listener closed and its connections ended")


def test_out_of_descriptors_the_listener_waits_and_accepts_later_instead_of_spinning_or_refusing(
        loop: Loop, caplog: pytest.LogCaptureFixture) -> None:
    """``accept`` failing with EMFILE leaves the connection in the kernel's queue: the acceptor says so once, waits,
    and accepts it afterwards (the loop neither spins on a listener that stays readable nor drops the client)."""
    import errno
    import logging

    from neighbor_ckpt.inprocess.event_loop import Acceptor

    class Full(socket.socket):
        failures = 3

        def accept(self):  # type: ignore[no-untyped-def]
            if Full.failures:
                Full.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return super().accept()

    plain = socket.create_server(("127.0.0.1", 0))
    listener = Full(fileno=plain.detach())
    accepted: list = []
    caplog.set_level(logging.WARNING, logger="neighbor_ckpt.inprocess.event_loop")
    acceptor = Acceptor(loop, listener, lambda conn, peer: accepted.append(conn), "test listener")
    client = socket.create_connection(listener.getsockname()[:2], timeout=30)
    _until(lambda: accepted, "the waiting connection accepted")
    assert Full.failures == 0
    said = [r.getMessage() for r in caplog.records if "cannot accept" in r.getMessage()]
    assert len(said) == 1 and "Too many open files" in said[0], said
    acceptor.close(shutdown=True)
    accepted[0].close()
    client.close()
