"""Another Unix user cannot starve a store host's gate (issue 53, item 5): it holds 256 connections on a real store host
(``python -m neighbor_ckpt.inprocess.store_host --token-file ...``), each dripping a byte of its answer every 4 s and
reconnecting when dropped, while the job's own client (this user, holding the token, through its tunnel) connects and
completes store operations; and the other user's handshakes are closed at their deadline, however they drip.

The other user is made for this module with ``useradd`` (no home, no login shell: ``/usr/sbin/nologin``), runs the
system's Python (standard library only) with ``runuser``, and is removed afterwards (``userdel``). CI runs as root;
elsewhere this is skipped, saying why. The gate's rule: :mod:`neighbor_ckpt.inprocess.store_auth`.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest

import torch.distributed as dist

from neighbor_ckpt.inprocess.store_auth import new_token_file, read_token, tunnel_address
from tests.conftest import free_port

pytestmark = pytest.mark.multiproc

SYSTEM_PYTHON = "/usr/bin/python3"
CONNECTIONS = 256
DRIP_S = 4.0
AGAIN_S = 0.2
"""The other user reconnects a dropped connection after this long (as soon as a slot could be free again)."""
WITHIN_S = 30.0
"""How long the job's client may take to be served (generous: no performance is measured)."""

# The other user's program (the system's Python, standard library only): CONNECTIONS connections to the gate, each
# reading what the gate says and sending one byte every DRIP_S (never a whole answer in time); a dropped one is made
# again after AGAIN_S. One JSON line of counts a second on stdout; it ends when its stdin closes.
DRIPPER = r"""
import json, os, selectors, socket, sys, time
host, port, n, drip_s, again_s, hello = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \
    float(sys.argv[5]), int(sys.argv[6])
sel = selectors.DefaultSelector()
sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
conns = {}  # socket -> [bytes received, bytes dripped]
again = []  # when to make a connection again
stats = {"pid": os.getpid(), "uid": os.getuid(), "connects": 0, "dropped": 0, "dropped_after_drips": 0}

def connect():
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex((host, port))
    sel.register(s, selectors.EVENT_READ, "conn")
    conns[s] = [0, 0]
    stats["connects"] += 1

def drop(s):
    sel.unregister(s)
    got, dripped = conns.pop(s)
    s.close()
    stats["dropped"] += 1
    if got >= hello and dripped:
        stats["dropped_after_drips"] += 1
    again.append(time.monotonic() + again_s)

for _ in range(n):
    connect()
next_drip = time.monotonic() + drip_s
next_say = 0.0
while True:
    now = time.monotonic()
    for key, _ in sel.select(timeout=0.1):
        if key.data == "stdin":
            if not sys.stdin.readline():
                sys.exit(0)
            continue
        s = key.fileobj
        try:
            data = s.recv(4096)
        except OSError:
            data = b""
        if data:
            conns[s][0] += len(data)
        else:
            drop(s)
    now = time.monotonic()
    while again and again[0] <= now:
        again.pop(0)
        connect()
    if now >= next_drip:
        next_drip = now + drip_s
        for s in list(conns):
            if conns[s][0] >= hello:
                try:
                    s.send(b"\0")
                    conns[s][1] += 1
                except OSError:
                    drop(s)
    if now >= next_say:
        next_say = now + 1.0
        print(json.dumps({**stats, "open": len(conns),
                          "challenged": sum(1 for g, _ in conns.values() if g >= hello)}), flush=True)
"""


@pytest.fixture(scope="module")
def nologin_user() -> Iterator[pwd.struct_passwd]:
    """A second Unix user for this module: ``useradd`` without a home or a login shell, ``userdel`` afterwards."""
    if os.geteuid() != 0:
        pytest.skip("making a second Unix user (useradd) and running commands as it (runuser) needs root; CI runs "
                    "as root")
    missing = [t for t in ("useradd", "userdel", "runuser") if shutil.which(t) is None]
    if missing or not os.access(SYSTEM_PYTHON, os.X_OK) or not os.path.exists("/usr/sbin/nologin"):
        pytest.skip(f"{', '.join(missing) or SYSTEM_PYTHON + ' or /usr/sbin/nologin'} not installed")
    name = f"nckpt_drip{os.getpid() % 100000}"
    made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], capture_output=True,
                          text=True, timeout=60)
    if made.returncode != 0:
        pytest.fail(f"useradd {name} failed: {made.stderr}")
    try:
        yield pwd.getpwnam(name)
    finally:
        gone = subprocess.run(["userdel", name], capture_output=True, text=True, timeout=60)
        assert gone.returncode == 0, f"userdel {name}: {gone.stderr}"


@pytest.fixture()
def store_host(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int, bytes, Path]]:
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
        yield proc, int(ready.read_text().split()[1]), read_token(token_file), log_path
    finally:
        proc.kill()
        proc.wait()


class Dripper:
    """The other user's program (:data:`DRIPPER`) against the gate at ``port``, its counts read as they come."""

    def __init__(self, user: str, port: int) -> None:
        from neighbor_ckpt.inprocess.store_auth import MAGIC, NONCE_BYTES

        self.proc = subprocess.Popen([shutil.which("runuser") or "runuser", "-u", user, "--", SYSTEM_PYTHON, "-c",
                                      DRIPPER, "127.0.0.1", str(port), str(CONNECTIONS), str(DRIP_S), str(AGAIN_S),
                                      str(len(MAGIC) + NONCE_BYTES)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        self.last: dict[str, Any] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.last = json.loads(line)
            except ValueError:
                continue

    def wait_for(self, what: str, ok, within_s: float = 60.0) -> dict[str, Any]:  # noqa: ANN001
        """The counts once ``ok(counts)`` holds (``what``: for the message when it never does)."""
        deadline = time.monotonic() + within_s
        while not (self.last and ok(self.last)):
            assert self.proc.poll() is None, f"the other user's program ended: {self.proc.communicate()[1]}"
            assert time.monotonic() < deadline, f"never {what}: {self.last}"
            time.sleep(0.1)
        return self.last

    def stop(self) -> None:
        pid = self.last.get("pid")
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # it ends when its stdin closes
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            if pid:
                try:
                    os.kill(int(pid), signal.SIGKILL)  # the Python it ran, by its id
                except ProcessLookupError:
                    pass
            self.proc.kill()
            self.proc.wait()


def _served(port: int, token: bytes, within_s: float) -> tuple[bool, list[str]]:
    """Whether the job's own client (torch's TCPStore client, through this process's tunnel, as a rank's) completes
    ``set``, ``get`` and ``add`` within ``within_s``, trying again after each failure; and the failures."""
    host, tport = tunnel_address(("127.0.0.1", port), token)
    failures: list[str] = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            store = dist.TCPStore(host, tport, is_master=False, wait_for_workers=False, use_libuv=True,
                                  timeout=timedelta(seconds=max(1.0, min(5.0, deadline - time.monotonic()))))
            key = f"job/{time.monotonic_ns()}"
            store.set(key, "mine")
            if store.get(key) == b"mine" and store.add(key + "/n", 1) == 1:
                return True, failures
            failures.append("the store answered something else")
        except (RuntimeError, OSError) as e:  # torch's DistStoreError is a RuntimeError
            failures.append(str(e).splitlines()[0][:200])
        time.sleep(0.2)
    return False, failures


def test_another_user_dripping_on_256_connections_does_not_starve_the_jobs_client_at_the_gate(
        nologin_user: pwd.struct_passwd, store_host: tuple[subprocess.Popen, int, bytes, Path]) -> None:
    """On the release before, the other user's first 64 connections took every handshake slot and each byte kept them
    there (a timeout per ``recv``): the job's client was refused for as long as the test waited."""
    proc, port, token, log_path = store_host
    dripper = Dripper(nologin_user.pw_name, port)
    try:
        # the other user's connections are all made, some are in a handshake, the rest refused (the slots they may
        # have are taken): the gate is as full as this user can make it
        before = dripper.wait_for("all connections made and the gate full for this user",
                                  lambda s: s["connects"] >= CONNECTIONS and s["challenged"] >= 1 and s["dropped"] >= 1)
        assert before["uid"] == nologin_user.pw_uid
        ok, failures = _served(port, token, WITHIN_S)
        assert ok, f"the job's client was starved by the other user: {failures[-5:]} ({dripper.last})"
        # the other user's handshakes end at their deadline, however they drip (one byte every 4 s each)
        dripper.wait_for("a dripping handshake closed by the gate", lambda s: s["dropped_after_drips"] >= 1,
                         within_s=WITHIN_S)
        assert dripper.proc.poll() is None, "the other user's program goes on"
        ok, failures = _served(port, token, WITHIN_S)
        assert ok, f"the job's client was starved by the other user later on: {failures[-5:]}"
        assert proc.poll() is None, "the store host goes on"
        from neighbor_ckpt.inprocess.store_auth import OTHER_USERS_HANDSHAKES

        text = log_path.read_text()
        assert (f"(uid {nologin_user.pw_uid}): the {OTHER_USERS_HANDSHAKES} handshakes of this node's other users "
                "already under way") in text, text[-3000:]
    finally:
        dripper.stop()
