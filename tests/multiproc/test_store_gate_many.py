"""Thousands of connections through a real store host's gate to its real torch TCPStore, with a bounded number of
threads in the store host (issue 52, step 4: the gate, the tunnels and the door serve their connections on one event
loop each, :mod:`neighbor_ckpt.inprocess.event_loop`).

A store host (``python -m neighbor_ckpt.inprocess.store_host --token-file ...``: gate, sealed store, door) and a few
client processes of this user: each opens its share of 2,000 torch store clients through its own tunnel, many at once
(threads of its own), then every client does store traffic (``set``, ``get``, ``add``) and keeps its connection
open; meanwhile the store host's threads are counted (``/proc/<pid>/task``) every few milliseconds. Then a cold-start
burst: 2,000 connections to the gate at once, every one accepted and challenged before any answers (2,000
handshakes under way together, all of this user), then all answered: every one admitted, none refused. No time is
measured: the waits are generous bounds on events.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import pytest

import torch.distributed as dist

from neighbor_ckpt.inprocess.store_auth import new_token_file, read_token, tunnel_address
from tests.conftest import free_port

pytestmark = pytest.mark.multiproc

CLIENT_PROCESSES = 4
CONNECTIONS = 2000
OPENERS = 32
"""Threads per client process opening torch store clients at once (each through the process's tunnel)."""
WITHIN_S = 300.0
"""A generous bound on each wait (no performance is measured)."""
MORE_THREADS = 2
"""Threads the store host may start beyond those it runs idle: none are expected (the gate's and the door's loops
run from the start); a thread per connection would be thousands."""

# A client process: raises its descriptor limit, waits for "go" on stdin, opens N torch store clients through its
# tunnel from OPENERS threads at once, does set/get/add on each, says what it saw (one JSON line), and keeps every
# connection open until its stdin closes.
CLIENT = r"""
import json, os, resource, sys, threading, logging
from datetime import timedelta
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
import torch.distributed as dist
from neighbor_ckpt.inprocess.store_auth import read_token, tunnel_address, _TUNNELS
port, n, openers, token_file, me = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
refusals = []
class Count(logging.Handler):
    def emit(self, record):
        if "no handshake" in str(record.msg) or "refused" in str(record.msg):
            refusals.append(record.getMessage())
logging.getLogger("neighbor_ckpt.inprocess.store_auth").addHandler(Count())
host, tport = tunnel_address(("127.0.0.1", port), read_token(token_file))
print("ready", flush=True)
sys.stdin.readline()
stores, errors = [None] * n, []
def open_some(idx):
    for i in idx:
        try:
            stores[i] = dist.TCPStore(host, tport, is_master=False, wait_for_workers=False, use_libuv=True,
                                      timeout=timedelta(seconds=120))
        except Exception as e:
            errors.append(str(e).splitlines()[0][:200])
ts = [threading.Thread(target=open_some, args=(range(t, n, openers),)) for t in range(openers)]
for t in ts: t.start()
for t in ts: t.join()
wrong = 0
for i, s in enumerate(stores):
    if s is None:
        continue
    try:
        s.set(f"c/{me}/{i}", str(i))
        wrong += s.get(f"c/{me}/{i}") != str(i).encode()
        s.add("count", 1)
    except Exception as e:
        errors.append(str(e).splitlines()[0][:200])
tunnel = next(iter(_TUNNELS.values()))
print(json.dumps({"opened": sum(s is not None for s in stores), "errors": errors[:5], "n_errors": len(errors),
                  "wrong": wrong, "refusals": refusals[:5], "tunnel_threads": tunnel.threads(),
                  "os_threads": len(os.listdir("/proc/self/task"))}), flush=True)
sys.stdin.readline()
"""

# A cold-start burst of raw connections: connect all N to the gate, read every challenge (so every handshake is
# under way at the gate at once), then answer every one with the token (the wire protocol written out here), and
# check every gate's proof. One JSON line.
BURST = r"""
import hashlib, hmac, json, os, resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
port, n, token = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(open(sys.argv[3]).read().strip())
MAGIC = b"NCKPT-STORE-2\n"
print("ready", flush=True)
sys.stdin.readline()
socks = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(n)]
hellos = []
for s in socks:
    got = b""
    while len(got) < len(MAGIC) + 16:
        part = s.recv(len(MAGIC) + 16 - len(got))
        if not part:
            break
        got += part
    hellos.append(got)
challenged = sum(h.startswith(MAGIC) and len(h) == len(MAGIC) + 16 for h in hellos)
mine = []
for s, h in zip(socks, hellos):
    m = os.urandom(16)
    mine.append(m)
    try:
        s.sendall(hmac.new(token, b"client\n" + MAGIC + h[len(MAGIC):], hashlib.sha256).digest() + m)
    except OSError:
        pass
admitted = 0
for s, h, m in zip(socks, hellos, mine):
    proof = b""
    try:
        while len(proof) < 32:
            part = s.recv(32 - len(proof))
            if not part:
                break
            proof += part
    except OSError:
        pass
    admitted += proof == hmac.new(token, b"gate\n" + MAGIC + h[len(MAGIC):] + m, hashlib.sha256).digest()
print(json.dumps({"challenged": challenged, "admitted": admitted}), flush=True)
sys.stdin.readline()
"""


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Peak:
    """The most threads process ``pid`` ran while this watched (sampled every few milliseconds)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            try:
                self.peak = max(self.peak, _threads(self.pid))
            except OSError:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@pytest.fixture()
def store_host(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int, Path, Path]]:
    """A real store host behind its gate (``--token-file``) on 127.0.0.1; its log in ``host.log``."""
    token_file = new_token_file(tmp_path / "store.token")
    ready, log_path = tmp_path / "ready", tmp_path / "host.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "neighbor_ckpt.inprocess.store_host", "--host", "127.0.0.1",
                                 "--port", str(free_port()), "--ready", str(ready), "--token-file", str(token_file)],
                                env={**os.environ, "TORCH_CPP_LOG_LEVEL": "error"}, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        yield proc, int(ready.read_text().split()[1]), token_file, log_path
    finally:
        proc.kill()
        proc.wait()


def _start(program: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", program, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "error"})


def _line(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"a client process ended: {proc.communicate(timeout=30)[1][-3000:]}"
    return line


def _go(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        assert _line(p).strip() == "ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            assert p.stdin is not None
            p.stdin.close()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(autouse=True)
def _descriptors() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4 * CONNECTIONS:
        pytest.skip(f"{CONNECTIONS} connections need {4 * CONNECTIONS} descriptors in the store host; the hard limit "
                    f"here is {hard}")


def test_2000_store_clients_through_tunnels_and_the_gate_with_a_bounded_number_of_threads(
        store_host: tuple[subprocess.Popen, int, Path, Path]) -> None:
    """Every client admitted, none refused, its store traffic right; the store host runs no more threads with 2,000
    connections open (three descriptors each there: gate, store side, torch's) than idle."""
    host, port, token_file, log_path = store_host
    idle = _threads(host.pid)
    peak = Peak(host.pid)
    per = CONNECTIONS // CLIENT_PROCESSES
    clients = [_start(CLIENT, str(port), str(per), str(OPENERS), str(token_file), str(i))
               for i in range(CLIENT_PROCESSES)]
    try:
        _go(clients)
        seen = [json.loads(_line(c)) for c in clients]
        fds = _fds(host.pid)
        busy = _threads(host.pid)
        most = peak.stop()
        for s in seen:
            assert (s["opened"], s["n_errors"], s["wrong"], s["refusals"]) == (per, 0, 0, []), s
            assert s["tunnel_threads"] == 1, f"a tunnel runs one thread for {per} connections: {s}"
        tunnel = tunnel_address(("127.0.0.1", port), read_token(token_file))
        store = dist.TCPStore(*tunnel, is_master=False, wait_for_workers=False, use_libuv=True,
                              timeout=timedelta(seconds=30))
        assert store.add("count", 0) == CONNECTIONS, "every client's add reached the one store"
        del store
        assert fds >= 3 * CONNECTIONS, f"the connections are open at the store host ({fds} descriptors)"
        assert most <= idle + MORE_THREADS and busy <= idle + MORE_THREADS, \
            f"the store host ran {most} threads at most with {CONNECTIONS} connections ({idle} idle)"
        print(f"store host threads: {idle} idle, {most} at most, {busy} with {CONNECTIONS} connections open "
              f"({fds} descriptors); a client process: {seen[0]['os_threads']} threads, its tunnel "
              f"{seen[0]['tunnel_threads']}")
    finally:
        _stop(clients)
    text = log_path.read_text()
    assert "refused" not in text and "does not answer" not in text, text[-3000:]
    assert host.poll() is None, "the store host goes on"


def test_a_cold_start_of_2000_handshakes_at_once_is_admitted_without_a_refusal(
        store_host: tuple[subprocess.Popen, int, Path, Path]) -> None:
    """All 2,000 connections accepted and challenged before any answers: 2,000 handshakes of this user under way at
    the gate together (the release before ran 64 at once and closed the others unanswered); all admitted."""
    host, port, token_file, log_path = store_host
    idle = _threads(host.pid)
    peak = Peak(host.pid)
    per = CONNECTIONS // CLIENT_PROCESSES
    bursts = [_start(BURST, str(port), str(per), str(token_file)) for _ in range(CLIENT_PROCESSES)]
    try:
        _go(bursts)
        seen = [json.loads(_line(b)) for b in bursts]
        most = peak.stop()
        assert seen == [{"challenged": per, "admitted": per}] * CLIENT_PROCESSES, seen
        assert most <= idle + MORE_THREADS, f"the store host ran {most} threads at most ({idle} idle)"
    finally:
        _stop(bursts)
    text = log_path.read_text()
    assert "refused" not in text, text[-3000:]
