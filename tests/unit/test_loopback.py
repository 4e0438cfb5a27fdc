"""The launch's loopback sockets admit the job only (:mod:`neighbor_ckpt.inprocess.loopback`), as this user: a store
listener sealed with a key, a tunnel that admits its own process only. Another Unix user is in
tests/unit/test_shared_node.py and, against a running launch, tests/e2e/test_shared_node_sockets.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from neighbor_ckpt.inprocess import loopback
from neighbor_ckpt.inprocess.store_auth import Gate, Tunnel, prove
from neighbor_ckpt.cli.launch import LAUNCHER
from neighbor_ckpt.runtime.procs import python_module_command

LAUNCHER_HEAD = python_module_command(LAUNCHER)
"""How a launcher's command line starts (this interpreter, ``-P -m`` the launcher): its own arguments follow."""


def _connects(address: tuple, key: bytes | None = None, timeout_s: float = 3.0) -> bool:
    """Whether a connection to ``address`` completes within ``timeout_s`` (a sealed listener's kernel drops the
    attempt: it never completes)."""
    s = socket.socket()
    try:
        if key is not None:
            loopback.sign(s, key)
        s.settimeout(timeout_s)
        s.connect(address)
        return True
    except OSError:
        return False
    finally:
        s.close()


def test_a_sealed_listener_completes_only_connections_signed_with_its_key() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()[:2]
    before = socket.create_connection(address)  # made before the seal: it stays (intruders() finds such ones)
    key = loopback.new_key()
    loopback.seal(listener, key)
    assert not _connects(address), "an unsigned attempt never completes"
    assert not _connects(address, loopback.new_key()), "nor one signed with another key"
    assert _connects(address, key)
    before.close()
    listener.close()


def test_torch_serves_a_store_sealed_before_its_first_connection_through_the_door() -> None:
    """torch's server and its own client start on a listener sealed beforehand (the client through the store host's
    door, which is closed afterwards); then only a signed connection completes, and it is served."""
    from datetime import timedelta

    import torch.distributed as dist

    from neighbor_ckpt.inprocess.store_auth import Door

    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()[:2]
    key = loopback.new_key()
    door = Door(address, key)
    loopback.seal(listener, key)
    store = dist.TCPStore(door.host, address[1], is_master=True, wait_for_workers=False, use_libuv=True,
                          timeout=timedelta(seconds=60), master_listen_fd=listener.fileno())
    listener.detach()
    door.close()
    store.set("k", "served")
    assert not _connects(address), "unsigned: never completes"
    assert not _connects((door.host, address[1])), "the door is closed"
    signed = socket.socket()
    loopback.sign(signed, key)
    signed.settimeout(30)
    signed.connect(address)  # torch's protocol by hand: VALIDATE, then GET "/k"
    import struct

    signed.sendall(bytes([0]) + struct.pack("=I", 0x3C85F7CE) + bytes([3]) + struct.pack("=Q", 2) + b"/k")
    got = b""
    while len(got) < 8 + 6:
        got += signed.recv(64)
    assert got == struct.pack("=Q", 6) + b"served"
    signed.close()
    del store


@pytest.mark.parametrize("lookup", ["sock_diag", "proc tables"])
def test_foreign_peer_admits_this_process_and_names_another(lookup: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if lookup == "proc tables":  # where netlink is forbidden, /proc/self/net/tcp{,6} gives the same answer
        def no_netlink(*_: object) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(loopback, "_diag", no_netlink)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::ffff:127.0.0.1")):  # torch's: IPv6
        c = socket.socket(family)
        c.connect((host, port))
        conn, _ = listener.accept()
        assert loopback.foreign_peer(conn) is None
        conn.close()
        c.close()
    other = subprocess.Popen([sys.executable, "-c", "import socket, time; s = socket.create_connection(("
                              f"'127.0.0.1', {port})); time.sleep(60)"])
    try:
        conn, _ = listener.accept()
        assert loopback.foreign_peer(conn) == "a socket of another process"
        conn.close()
    finally:
        other.kill()
        other.wait()
        listener.close()


def _store_behind_a_sealed_gate(token: bytes) -> tuple[Gate, socket.socket, list[bytes]]:
    backend = socket.create_server(("127.0.0.1", 0))
    key = loopback.new_key()
    loopback.seal(backend, key)
    served: list[bytes] = []

    def store() -> None:
        while True:
            try:
                conn, _ = backend.accept()
            except OSError:
                return
            served.append(conn.recv(64))
            conn.sendall(b"ok")
            conn.close()

    threading.Thread(target=store, daemon=True).start()
    gate = Gate(socket.create_server(("127.0.0.1", 0)), backend.getsockname()[:2], token, backend_key=key)
    return gate, backend, served


def test_a_tunnel_carries_its_own_process_to_the_sealed_store_and_refuses_another_process(
        caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import os

    token = os.urandom(32)
    gate, backend, served = _store_behind_a_sealed_gate(token)
    assert not _connects(backend.getsockname()[:2]), "the store itself: only the gate reaches it"
    tunnel = Tunnel(gate._sock.getsockname()[:2], token)
    with socket.create_connection(tunnel.address, timeout=30) as c:
        c.sendall(b"mine")
        assert c.recv(2) == b"ok"
    assert served == [b"mine"]
    caplog.set_level(logging.WARNING, logger="neighbor_ckpt.inprocess.store_auth")
    other = subprocess.run([sys.executable, "-c", "import socket; s = socket.create_connection(('127.0.0.1', "
                            f"{tunnel.address[1]})); s.sendall(b'theirs'); print(repr(s.recv(16)))"],
                           capture_output=True, text=True, timeout=60)
    assert other.stdout.strip() in ("b''", ""), other  # closed unanswered (or reset)
    deadline = time.monotonic() + 30
    while tunnel.refused() < 1 and time.monotonic() < deadline:  # the accepting thread counts it
        time.sleep(0.02)
    assert tunnel.refused() == 1 and served == [b"mine"]
    assert any("refused a connection" in r.getMessage() and "another process" in r.getMessage()
               for r in caplog.records)
    # the tunnel's own handshake with the gate is mutual: a direct client holding the token is admitted too
    with socket.create_connection(gate._sock.getsockname()[:2], timeout=30) as c:
        prove(c, token)
    tunnel.close()
    gate.close()
    backend.close()


def _unsealable(*_: object) -> None:
    raise loopback.Unsealable(92, "TCP-MD5 signatures are not available here (Protocol not available)")


def test_the_store_is_sealed_before_it_listens() -> None:
    """Bind, seal, listen: no connection can complete between the listen and the seal (issue 53, item 4: on 2c061fd
    the store host listened first, and a connection completed in between reached torch's store unsigned)."""
    from neighbor_ckpt.inprocess import store_host

    listening_at_seal: list[int] = []
    real_seal = loopback.seal

    def seal(sock: socket.socket, key: bytes) -> None:
        listening_at_seal.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        real_seal(sock, key)

    loopback.seal = seal  # type: ignore[assignment]
    try:
        sock, key, door = store_host._sealed_listener("127.0.0.1")
    finally:
        loopback.seal = real_seal  # type: ignore[assignment]
    try:
        assert listening_at_seal == [0], "sealed while not listening yet"
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1, "and listening afterwards"
        assert key is not None and not _connects(sock.getsockname()[:2])
    finally:
        door.close()
        sock.close()


def test_a_kernel_without_tcp_md5_refuses_an_open_store_unless_the_job_asks_for_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path) -> None:
    import logging

    from neighbor_ckpt.inprocess import store_host

    monkeypatch.setattr(loopback, "seal", _unsealable)
    with pytest.raises(store_host.OpenStoreRefused, match="launch.open_store: true"):
        store_host._sealed_listener("127.0.0.1")
    # the store host says so in one line beside its ready file, for its launcher, and exits 1
    from neighbor_ckpt.inprocess.store_auth import new_token_file

    token = tmp_path / "token"
    new_token_file(token)
    ready = tmp_path / "ready"
    assert store_host.main(["--host", "127.0.0.1", "--port", "0", "--token-file", str(token),
                            "--ready", str(ready)]) == 1
    assert not ready.exists() and "launch.open_store" in store_host.failed_path(ready).read_text()

    caplog.set_level(logging.WARNING, logger="neighbor_ckpt.inprocess.store_host")
    sock, key, door = store_host._sealed_listener("127.0.0.1", allow_open=True)
    assert key is None and door is None
    assert _connects(sock.getsockname()[:2]), "open, as the job file asked"
    assert any("open to every user of this node" in r.getMessage() and "TCP-MD5" in r.getMessage()
               for r in caplog.records)
    sock.close()


def test_the_job_files_open_store_reaches_the_store_host_command() -> None:
    from neighbor_ckpt.cli.launch import launcher_command
    from neighbor_ckpt.inprocess.launcher_plan import parse_args

    for asked in (False, True):
        cmd = launcher_command(["train.py"], store="127.0.0.1:5000", run_id="r", node="node0", first="0",
                               count="1", processes=3, spares=0, max_restarts=0, nodes=3, store_root=None,
                               open_store=asked)
        assert ("--open-store" in cmd) is asked
        assert parse_args(cmd[len(LAUNCHER_HEAD):]).open_store is asked
