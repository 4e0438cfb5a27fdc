"""The gate's handshakes cannot be starved (:class:`~neighbor_ckpt.inprocess.store_auth.HandshakeSlots`, issue 53
item 5): one deadline per handshake, not a timeout per ``recv``; slots per kind of peer, the job's user's reserved.
Another Unix user holding hundreds of dripping connections on a real store host's gate:
tests/multiproc/test_store_gate_slots.py."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time

import pytest

from neighbor_ckpt.inprocess import store_auth
from neighbor_ckpt.inprocess.store_auth import Gate, prove
from neighbor_ckpt.inprocess.store_handshake import MAGIC, NONCE_BYTES


def test_the_jobs_user_keeps_its_slots_other_users_share_a_small_pool_and_an_address_its_bound() -> None:
    from neighbor_ckpt.inprocess.store_auth import ADDRESS, JOB, OTHER_USER, HandshakeSlots

    slots = HandshakeSlots(job=4, other_users=2, other_nodes=5, per_address=3)
    assert [slots.take((OTHER_USER, 1001)) for _ in range(2)] == [None, None]
    assert "other users" in slots.take((OTHER_USER, 1001))  # type: ignore[operator]
    assert "other users" in slots.take((OTHER_USER, 1002)), "one pool for all other users"  # type: ignore[operator]
    assert [slots.take((ADDRESS, "10.0.0.7")) for _ in range(3)] == [None] * 3
    assert "this address" in slots.take((ADDRESS, "10.0.0.7"))  # type: ignore[operator]
    assert [slots.take((ADDRESS, "10.0.0.8")) for _ in range(2)] == [None, None]
    assert "other nodes" in slots.take((ADDRESS, "10.0.0.9"))  # type: ignore[operator]
    assert [slots.take((JOB, 0)) for _ in range(4)] == [None] * 4, "the others took none of the job's"
    assert "this store host's user" in slots.take((JOB, 0))  # type: ignore[operator]
    assert slots.taken() == {JOB: 4, OTHER_USER: 2, ADDRESS: 5}
    slots.give((ADDRESS, "10.0.0.7"))
    assert slots.take((ADDRESS, "10.0.0.9")) is None, "a slot given back is free again"
    slots.give((JOB, 0))
    assert slots.take((JOB, 0)) is None
    slots.give((OTHER_USER, 1001))
    assert slots.take((OTHER_USER, 1002)) is None


def _own_address() -> str | None:
    """An IPv4 address of this node other than loopback (the one its default route leaves from), or None."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: the kernel only picks the route
        host = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if host.startswith("127.") or host == "0.0.0.0" else host


@pytest.mark.parametrize("lookup", ["sock_diag", "proc tables"])
def test_the_kernel_names_this_users_peer_on_this_node_loopback_or_not(lookup: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate's look-up (:func:`~neighbor_ckpt.inprocess.store_auth.peer_uid`): this user's uid for a client of
    this node, over loopback (IPv4, and mapped into IPv6 as torch's clients are) and over the node's own address (the
    job's processes reach the gate at the job's address); where netlink is forbidden, the same from the tables."""
    from neighbor_ckpt.inprocess import loopback
    from neighbor_ckpt.inprocess.store_auth import peer_uid

    if lookup == "proc tables":
        def no_netlink(*_: object) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(loopback, "_diag", no_netlink)
    cases = [(socket.AF_INET, "127.0.0.1", "127.0.0.1"), (socket.AF_INET6, "::ffff:127.0.0.1", "127.0.0.1")]
    own = _own_address()
    if own is not None:
        cases.append((socket.AF_INET, own, own))
    for family, client_host, server_host in cases:
        listener = socket.create_server((server_host, 0))
        c = socket.socket(family)
        c.connect((client_host, listener.getsockname()[1]))
        conn, _ = listener.accept()
        assert peer_uid(conn) == os.getuid(), (client_host, server_host)
        c.close()
        conn.close()
        listener.close()


def test_a_handshake_deadline_holds_however_the_bytes_come() -> None:
    """``challenge`` with a deadline: a client that sends a byte well within any per-``recv`` timeout but never
    the whole answer in time gets ``TimeoutError`` (the whole handshake is bounded)."""
    from neighbor_ckpt.inprocess.store_auth import challenge

    gate, client = socket.socketpair()
    stop = threading.Event()

    def drip() -> None:
        client.recv(len(MAGIC) + NONCE_BYTES)
        while not stop.wait(0.05):
            try:
                client.send(b"\0")
            except OSError:
                return

    t = threading.Thread(target=drip)
    t.start()
    with pytest.raises(TimeoutError):
        challenge(gate, os.urandom(32), time.monotonic() + 0.5)
    stop.set()
    t.join()
    gate.close()
    client.close()


def test_a_client_that_drips_bytes_is_closed_at_the_handshakes_deadline_not_kept_alive_by_each_byte(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A real gate (its deadline set to 1 s here): a client that gets the challenge and then sends one byte of its
    48-byte answer every 0.25 s (each well within a per-``recv`` timeout of 1 s) is closed by the gate before it has
    sent its whole answer; and a client holding the token is admitted afterwards."""
    monkeypatch.setattr(store_auth, "HANDSHAKE_TIMEOUT_S", 1.0)
    backend = socket.create_server(("127.0.0.1", 0))
    served: list[bytes] = []

    def store() -> None:
        conn, _ = backend.accept()
        served.append(conn.recv(16))
        conn.close()

    threading.Thread(target=store, daemon=True).start()
    token = os.urandom(32)
    gate = Gate(socket.create_server(("127.0.0.1", 0)), backend.getsockname()[:2], token)
    address = gate._sock.getsockname()[:2]
    caplog.set_level(logging.WARNING, logger="neighbor_ckpt.inprocess.store_auth")
    answer = 32 + NONCE_BYTES
    s = socket.create_connection(address, timeout=30)
    got = b""
    while len(got) < len(MAGIC) + NONCE_BYTES:
        got += s.recv(64)
    assert got.startswith(MAGIC)
    sent, closed = 0, False
    while sent < answer:
        readable, _, _ = select.select([s], [], [], 0.25)  # a byte every 0.25 s, unless the gate closed it
        if readable:
            try:
                closed = s.recv(64) == b""
            except OSError:
                closed = True
            if closed:
                break
        try:
            s.sendall(b"\0")
        except OSError:
            closed = True
            break
        sent += 1
    s.close()
    assert closed and sent < answer, f"the gate waited for all {sent} bytes: each byte kept the handshake alive"
    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "store gate: refused" in r.getMessage()]

    deadline = time.monotonic() + 30
    while not said() and time.monotonic() < deadline:  # a wait for the event, not a time limit
        time.sleep(0.02)
    assert gate.refused() == 1
    assert len(said()) == 1 and "no answer to the challenge (the handshake's deadline passed" in said()[0], said()
    assert gate.slots.taken() == {"job": 0, "user": 0, "address": 0}, "its slot was given back"
    client = socket.create_connection(address, timeout=30)
    prove(client, token, time.monotonic() + 30)
    client.sendall(b"hello store")
    while not served and time.monotonic() < deadline + 30:
        time.sleep(0.02)
    assert served == [b"hello store"]
    client.close()
    gate.close()
    backend.close()
