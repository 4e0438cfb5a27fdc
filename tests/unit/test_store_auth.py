"""The per-job store token (:mod:`neighbor_ckpt.inprocess.store_auth`), in one process: the token file's rules and
the handshake, over a socket pair (the gate and the tunnel against real store hosts:
tests/multiproc/test_inprocess_stores.py)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.inprocess.store_auth import challenge, new_token_file, prove, read_token
from neighbor_ckpt.inprocess.store_handshake import MAGIC, Refused


def test_the_token_file_is_made_once_private_to_the_user_and_kept(tmp_path: Path) -> None:
    path = new_token_file(tmp_path / "run" / "store.token")
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    token = read_token(path)
    assert len(token) == 32
    assert new_token_file(path) == path and read_token(path) == token, "a second launch of the job keeps it"
    assert read_token(new_token_file(tmp_path / "other.token")) != token


@pytest.mark.parametrize("mode,text,match", [
    (0o644, "ab" * 32, "readable by others"),
    (0o640, "ab" * 32, "readable by others"),
    (0o600, "not hex", "holds no token"),
    (0o600, "abcd", "holds no token"),
])
def test_a_token_file_that_others_can_read_or_that_holds_no_token_is_refused(
        tmp_path: Path, mode: int, text: str, match: str) -> None:
    path = tmp_path / "store.token"
    path.write_text(text)
    path.chmod(mode)
    with pytest.raises(ConfigError, match=match):
        read_token(path)
    if mode != 0o600:
        with pytest.raises(ConfigError, match="readable by others"):
            new_token_file(path)  # an existing file is checked, not trusted


def test_a_missing_token_file_says_who_makes_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="makes it in the run directory"):
        read_token(tmp_path / "store.token")


def _handshake(gate_token: bytes, client_token: bytes) -> tuple[bool, BaseException | None]:
    gate, client = socket.socketpair()
    for s in (gate, client):
        s.settimeout(5)
    result: list[bool] = []
    t = threading.Thread(target=lambda: (result.append(challenge(gate, gate_token)), gate.close()))
    t.start()
    err = None
    try:
        prove(client, client_token)
    except (Refused, OSError) as e:
        err = e
    t.join()
    client.close()
    return result[0], err


def test_the_holder_of_the_token_is_admitted_and_any_other_refused() -> None:
    token = os.urandom(32)
    assert _handshake(token, token) == (True, None)
    admitted, err = _handshake(token, os.urandom(32))
    assert not admitted and isinstance(err, Refused), "another job's token"


def test_what_is_not_a_gate_is_refused_by_the_client_and_the_token_never_crosses_the_wire() -> None:
    a, b = socket.socketpair()
    a.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 64)
    with pytest.raises(Refused, match="not a neighbor_ckpt store gate"):
        prove(b, b"t" * 32)
    a.close()
    b.close()
    gate, client = socket.socketpair()
    token = b"s" * 32
    seen = bytearray()

    def gate_side() -> None:
        challenge(gate, token)
        gate.close()

    t = threading.Thread(target=gate_side)
    t.start()
    hello = client.recv(len(MAGIC) + 16)
    client.sendall(b"\0" * 48)  # a wrong answer (and a nonce): no reply, closed
    while chunk := client.recv(64):
        seen += chunk
    t.join()
    client.close()
    assert hello.startswith(MAGIC) and token not in hello and not seen


@pytest.mark.parametrize("impostor", ["accepts anything", "another job's token"])
def test_a_client_refuses_a_gate_that_cannot_prove_the_token(impostor: str) -> None:
    """Mutual: whatever took a store's address (a gate of another job, or a listener that answers as the gate of an
    earlier release did) is refused by the client before any store operation goes through it."""
    gate, client = socket.socketpair()
    for s in (gate, client):
        s.settimeout(5)
    token = os.urandom(32)

    def fake_gate() -> None:
        if impostor == "accepts anything":
            gate.sendall(MAGIC + os.urandom(16))
            gate.recv(48)
            gate.sendall(b"\x01" + bytes(31))
        else:
            challenge(gate, os.urandom(32))  # a real gate, with another token: it refuses and closes
        gate.close()

    t = threading.Thread(target=fake_gate)
    t.start()
    with pytest.raises(Refused):
        prove(client, token)
    t.join()
    client.close()


def test_the_refusal_log_writes_one_line_per_address_per_period_with_the_count_it_stands_for() -> None:
    from neighbor_ckpt.inprocess.store_auth import RefusalLog

    log = RefusalLog(every_s=60.0)
    assert log.refused("10.0.0.9", 0.0) == 1, "the first refusal is said at once"
    assert [log.refused("10.0.0.9", t) for t in (1.0, 2.0, 59.0)] == [None, None, None]
    assert log.refused("10.0.0.8", 3.0) == 1, "another address has a line of its own"
    assert log.refused("10.0.0.9", 61.0) == 4, "the next line counts the three held back and itself"
    log.refused("10.0.0.9", 62.0)
    assert log.held() == {"10.0.0.9": 1} and log.held() == {}


def test_a_flood_of_unauthenticated_connections_is_refused_in_a_bounded_log_and_the_job_is_still_admitted(
        caplog: pytest.LogCaptureFixture) -> None:
    """1,000 connections that never answer the challenge, within a few seconds, against a gate with 8 handshake
    slots: every one refused (closed unanswered once the slots are taken), the log grows by a few lines only, and a
    client holding the token is admitted afterwards and reaches the store behind the gate."""
    import logging
    import time

    from neighbor_ckpt.inprocess.store_auth import Gate

    backend = socket.create_server(("127.0.0.1", 0))
    served: list[bytes] = []

    def store() -> None:
        conn, _ = backend.accept()
        served.append(conn.recv(16))
        conn.close()

    threading.Thread(target=store, daemon=True).start()
    listen = socket.create_server(("127.0.0.1", 0), backlog=4096)
    token = os.urandom(32)
    gate = Gate(listen, backend.getsockname()[:2], token, max_handshakes=8)
    address = listen.getsockname()[:2]
    caplog.set_level(logging.WARNING, logger="neighbor_ckpt.inprocess.store_auth")
    flood = []
    for _ in range(1000):
        s = socket.create_connection(address)
        s.sendall(b"\0" * 48)  # a wrong answer (or none: a full gate closes it first)
        flood.append(s)
    for s in flood:
        s.close()
    deadline = time.monotonic() + 120
    while gate.refused() < 1000 and time.monotonic() < deadline:  # a wait for the event, not a time limit
        time.sleep(0.05)
    assert gate.refused() == 1000
    lines = [r for r in caplog.records if "store gate: refused" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
    client = socket.create_connection(address, timeout=10)
    prove(client, token)
    client.sendall(b"hello store")
    deadline = time.monotonic() + 30
    while not served and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served == [b"hello store"]
    client.close()
    gate.close()
    assert any("more client(s) from 127.0.0.1 refused since the last line" in r.getMessage() for r in caplog.records)
    backend.close()
