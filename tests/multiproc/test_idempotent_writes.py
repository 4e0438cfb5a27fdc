"""Writes through a failover count once (:mod:`neighbor_ckpt.inprocess.launch_counts`), against real store host
processes (``python -m neighbor_ckpt.inprocess.store_host``) behind a TCP proxy of the test that forwards every
request and drops replies when told: the request is applied, its reply never comes, and the client sends it again
(a retry on a new connection, or the failover to the next store, where the launcher's failover handler wrote its
facts again meanwhile).

torch's store client waits for a reply to ``add``, ``compare_set``, ``get``, ``check``; ``set`` and ``append`` are
sent without one (so only a lost connection, never a lost reply, makes them go again)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from neighbor_ckpt.inprocess import protocol
from neighbor_ckpt.inprocess.launch_counts import claim_index, exited, mark_exited, raise_processes
from neighbor_ckpt.inprocess.launcher import Launcher, _Attempt
from neighbor_ckpt.inprocess.launcher_plan import parse_args
from neighbor_ckpt.inprocess.restart_rendezvous import parse_nodes
from neighbor_ckpt.inprocess.stores import StoreAddresses, StoreSet
from tests.conftest import free_port

pytestmark = pytest.mark.multiproc


class DropProxy:
    """``127.0.0.1:<port>`` -> ``target``: every request is forwarded; ``drop_reply_to(marker)``: the reply to the
    next request that contains ``marker`` (a key) is discarded, once; ``mute()``: every reply from now on is. Counts
    the replies it dropped."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._ls = socket.socket()
        self._ls.bind(("127.0.0.1", 0))
        self._ls.listen()
        self.port = self._ls.getsockname()[1]
        self._lock = threading.Lock()
        self._marker: bytes | None = None
        self._mute, self.dropped = False, 0
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_reply_to(self, marker: bytes) -> None:
        with self._lock:
            self._marker = marker

    def mute(self) -> None:
        with self._lock:
            self._mute = True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._ls.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._socks += [client, server]
            armed = threading.Event()  # this connection's next reply is to be dropped
            threading.Thread(target=self._requests, args=(client, server, armed), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, armed), daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket, armed: threading.Event) -> None:
        while (data := _recv(src)) is not None:
            with self._lock:
                if self._marker is not None and self._marker in data:
                    self._marker = None
                    armed.set()  # before the request goes on: its reply cannot come first
            if not _send(dst, data):
                return

    def _replies(self, src: socket.socket, dst: socket.socket, armed: threading.Event) -> None:
        while (data := _recv(src)) is not None:
            with self._lock:
                drop = self._mute or armed.is_set()
                if drop:
                    armed.clear()
                    self.dropped += 1
            if not drop and not _send(dst, data):
                return

    def close(self) -> None:  # resets every connection: a client thread abandoned inside torch's client returns
        self._ls.close()
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def _recv(s: socket.socket) -> bytes | None:
    try:
        data = s.recv(65536)
    except OSError:
        return None
    return data or None


def _send(s: socket.socket, data: bytes) -> bool:
    try:
        s.sendall(data)
    except OSError:
        return False
    return True


@pytest.fixture()
def hosts(tmp_path: Path) -> Iterator[list[int]]:
    """Two real store hosts (ports)."""
    procs, ports = [], []
    for i in range(2):
        ready, port = tmp_path / f"ready{i}", free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "neighbor_ckpt.inprocess.store_host", "--host",
                                       "127.0.0.1", "--port", str(port), "--ready", str(ready)],
                                      env={**os.environ, "TORCH_CPP_LOG_LEVEL": "error"}))
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert procs[-1].poll() is None and time.monotonic() < deadline, "the store host did not listen"
            time.sleep(0.05)
        ports.append(port)
    yield ports
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture()
def proxy(hosts: list[int]) -> Iterator[DropProxy]:
    p = DropProxy(("127.0.0.1", hosts[0]))
    yield p
    p.close()


def _direct(port: int, prefix: str) -> Any:
    """A plain torch client of a store host (no proxy), under ``prefix``."""
    import torch.distributed as dist

    return dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                                  use_libuv=True))


def test_a_claim_whose_reply_was_dropped_is_retried_and_takes_one_index(hosts: list[int], proxy: DropProxy) -> None:
    """The replacement index's claim (``compare_set`` of ``index/<i>`` to the claim's write id) is applied, its reply
    dropped, and sent again on a new connection: the retry finds its own id and takes the same index, and
    ``processes`` grows by one. (A counter bumped with ``add`` on the same path counts twice: why there is none.)"""
    stores = StoreSet(StoreAddresses((("127.0.0.1", proxy.port),)), run_id="r", timeout_s=1.0,
                      connect_timeout_s=10.0, name="launcher:node1")
    s = stores.view("launcher", "job/0")
    raise_processes(s, 3)  # connected, the launch's 3 indices handed out
    proxy.drop_reply_to(b"index/3")
    assert claim_index(s, "node1:123:0:0", first=3) == 3
    assert proxy.dropped == 1, "the proxy dropped the claim's reply"
    direct = _direct(hosts[0], "job/0")
    assert direct.get("processes") == b"4" and direct.get("index/3") == b"node1:123:0:0"
    assert not direct.check(["index/4"]), "no second index claimed"
    assert claim_index(s, "node0:456:0:0", first=3) == 4, "the next claim takes the next index"

    proxy.drop_reply_to(b"counter")
    s.add("counter", 1)  # the hazard: applied, reply dropped, sent again
    assert direct.get("counter") == b"2"
    stores.close()


def _launcher(node: str, proxy_port: int, standby: int, tmp: Path) -> Launcher:
    plan = parse_args(["--store", f"127.0.0.1:{proxy_port},127.0.0.1:{standby}", "--run-id", "r", "--node", node,
                       "--first", "0" if node == "node0" else "1", "--count", "1", "--processes", "3",
                       "--spares", "1", "--max-restarts", "1", "--nodes", "2", "--detector-timeout", "1",
                       "--connect-timeout", "10", "--", str(tmp / "never-run.py")])
    return Launcher(plan)


def test_a_replayed_exited_counts_once_and_a_failover_in_the_restart_rendezvous_keeps_every_join(
        hosts: list[int], proxy: DropProxy, tmp_path: Path) -> None:
    """Two launchers (their loops not run: the test drives their store writes) on store 0 behind the proxy, store 1
    a standby. Both joined attempt 1's restart rendezvous; node1's process 1 exited and its ``exited`` write is still
    queued behind a write that needs a reply. Store 0 stops answering (every reply dropped): node1's launcher fails
    over to store 1 (node0's launcher loses it too: their two votes promote store 1), each failover handler writes its
    facts there (``exited``, its join), then the queued write goes there too. On store 1: process 1 exited
    once (no premature "every process exited"), and both launchers joined attempt 1."""
    l0, l1 = _launcher("node0", proxy.port, hosts[1], tmp_path), _launcher("node1", proxy.port, hosts[1], tmp_path)
    try:
        for launcher, index in ((l0, 0), (l1, 1)):
            launcher._att = _Attempt(number=0, started={index})
            launcher._later(0, lambda s: raise_processes(s, 3))
            launcher._rendezvous.announce(0)
            launcher._rendezvous.joining = 1  # as meet(1) does, before it waits
            launcher._later(1, lambda s, n=launcher.plan.node: s.append("joined", f"{n},"))
        old = _direct(hosts[0], protocol.launch_prefix("r", 1))
        deadline = time.monotonic() + 30  # torch's client sends an append without waiting for its reply
        while set(parse_nodes(old.get("joined") if old.check(["joined"]) else None)) != {"node0", "node1"}:
            assert time.monotonic() < deadline, old.get("joined") if old.check(["joined"]) else "no joined key"
            time.sleep(0.05)

        proxy.mute()
        l1._att.exited.add(1)  # as _reap does: the fact first, then its write
        l1._outbox += [(0, lambda s: s.check(["dead"])), (0, lambda s: mark_exited(s, (1,)))]
        # node0 loses store 0 as well: a standby is promoted by a majority of the launchers' votes (2 of 2 here)
        l0._outbox += [(0, lambda s: s.check(["dead"]))]
        other = threading.Thread(target=l0._flush, name="node0-flush")
        other.start()
        l1._flush()  # the check fails over (its reply never comes), the handler writes, then the queued write
        other.join(120)
        assert not other.is_alive()
        assert l1.stores.epoch == 1 and l0.stores.epoch == 1 and not l1._outbox and not l0._outbox

        new0, new1 = _direct(hosts[1], protocol.launch_prefix("r", 0)), _direct(hosts[1], protocol.launch_prefix("r", 1))
        assert new0.get("exited") == b"1,1,", "written twice: by the failover handler and by the queued write"
        assert exited(new0) == {1}
        assert not l1._everyone_exited(l1._att) and new0.get("processes") == b"3"
        assert set(parse_nodes(new1.get("joined"))) == {"node0", "node1"}, "both joins kept through the failover"
        assert set(parse_nodes(new0.get("nodes"))) == {"node0", "node1"}
    finally:
        l0.stores.close()
        l1.stores.close()
