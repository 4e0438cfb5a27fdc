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
from neighbor_ckpt.inprocess.store_auth import MAGIC, Refused, challenge, new_token_file, prove, read_token


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
    client.sendall(b"\0" * 32)  # a wrong answer: no reply, closed
    while chunk := client.recv(64):
        seen += chunk
    t.join()
    client.close()
    assert hello.startswith(MAGIC) and token not in hello and not seen
