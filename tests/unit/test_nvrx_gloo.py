"""megatron_patches.nvrx_gloo: the CPU/gloo pieces NVRx's in-process restart needs (one process)."""

from __future__ import annotations

import importlib.metadata
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_patches import nvrx_gloo
from neighbor_ckpt.errors import UnsupportedVersionError


def test_nvrx_version_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert nvrx_gloo.check_nvrx_version() == importlib.metadata.version("nvidia-resiliency-ext")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.0")
    with pytest.raises(UnsupportedVersionError, match="min-healthy"):
        nvrx_gloo.check_nvrx_version()


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    return srv, cli, peer


def test_socket_shutdown_frees_a_blocked_receive_and_keeps_the_store_port() -> None:
    # In a child process: the shutdown takes down every established TCP connection of the process it runs in, and
    # the pytest process holds other tests' stores and sockets.
    proc = subprocess.run([sys.executable, "-c", "from tests.unit.test_nvrx_gloo import _shutdown_case; _shutdown_case()"],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _shutdown_case() -> None:
    srv_a, blocked, peer_a = _pair()
    srv_k, kept, peer_k = _pair()
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(blocked.recv(10)), daemon=True)
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    n = nvrx_gloo.shutdown_tcp_connections(keep_ports=[srv_k.getsockname()[1]])
    t.join(5)
    assert not t.is_alive() and got == [b""], "the blocked recv was not freed"
    assert time.monotonic() - t0 < 1.0
    assert n >= 2  # both ends of the first pair live in this process
    kept.sendall(b"x")
    assert peer_k.recv(1) == b"x", "a connection to a kept port was shut down"
    for s in (srv_a, blocked, peer_a, srv_k, kept, peer_k):
        s.close()


def test_client_prefix_store_has_no_critical_rank() -> None:
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    store = nvrx_gloo.ClientPrefixStore("127.0.0.1", host.port, "job/0/nvrx/", timeout=timedelta(seconds=5))
    store.set("k", "v")
    assert store.get("k") == b"v" and host.check(["job/0/nvrx//k"])  # torch's PrefixStore joins with "/"
    assert store.critical_ranks == ()
    store.record_terminated_ranks([3])
    assert store.get_terminated_ranks() == {3}


def test_abort_and_finalize_are_nvrx_interfaces() -> None:
    from nvidia_resiliency_ext.inprocess.abort import Abort
    from nvidia_resiliency_ext.inprocess.finalize import Finalize

    events: list[str] = []
    abort = nvrx_gloo.gloo_abort(keep_ports=[1], on_event=lambda name, t: events.append(name))
    assert isinstance(abort, Abort)
    assert abort("state") == "state"  # no process group: AbortTorchDistributed does nothing
    assert events == ["abort_start", "abort_end"]
    ran: list[int] = []
    fin = nvrx_gloo.FinalizeMegatron(cleanups=lambda: [lambda: ran.append(1), lambda: ran.append(2)])
    assert isinstance(fin, Finalize)
    assert fin("state") == "state" and ran == [2, 1]  # last registered first
