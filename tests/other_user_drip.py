"""Another Unix user that tries to starve a store gate (issue 53, item 5): a second user made for the module with
``useradd`` (no home, no login shell: ``/usr/sbin/nologin``) and removed afterwards (``userdel``), running the system's
Python (standard library only) with ``runuser``: :data:`CONNECTIONS` connections to a gate, each dripping a byte of
its answer every :data:`DRIP_S` and made again when dropped. CI runs as root; elsewhere the fixture skips, saying why.

Used by tests/multiproc/test_store_gate_slots.py (one store host's gate) and tests/e2e/test_gate_starvation.py (every
gate of a running in-process launch)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

SYSTEM_PYTHON = "/usr/bin/python3"
CONNECTIONS = 256
DRIP_S = 4.0
AGAIN_S = 0.2
"""The other user reconnects a dropped connection after this long (as soon as a slot could be free again)."""

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


class Dripper:
    """The other user's program (:data:`DRIPPER`) against the gate at ``host:port``, its counts read as they come
    (``last``; ``history``: every line with the Unix time it was read)."""

    def __init__(self, user: str, port: int, host: str = "127.0.0.1") -> None:
        from neighbor_ckpt.inprocess.store_handshake import MAGIC, NONCE_BYTES

        self.address = (host, port)
        self.proc = subprocess.Popen([shutil.which("runuser") or "runuser", "-u", user, "--", SYSTEM_PYTHON, "-c",
                                      DRIPPER, host, str(port), str(CONNECTIONS), str(DRIP_S), str(AGAIN_S),
                                      str(len(MAGIC) + NONCE_BYTES)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        self.last: dict[str, Any] = {}
        self.history: list[tuple[float, dict[str, Any]]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.last = json.loads(line)
            except ValueError:
                continue
            self.history.append((time.time(), self.last))

    def wait_for(self, what: str, ok: Callable[[dict[str, Any]], bool], within_s: float = 60.0) -> dict[str, Any]:
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


TCP_ESTABLISHED = 1
_SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NLM_F_DUMP, _NLMSG_DONE, _NLMSG_ERROR = 20, 1, 0x300, 3, 2


def connections_of(uid: int, ports: set[int]) -> dict[int, int]:
    """Port -> how many TCP connections (IPv4) of user ``uid`` to that port are established now in this network
    namespace, as the kernel lists them: the connecting side's sockets, which ``uid`` owns. Asked as ``ss`` does
    (a ``NETLINK_SOCK_DIAG`` dump of the established sockets only: the thousands a flood of connections leaves in
    TIME_WAIT are not walked), or read from ``/proc/net/tcp`` where netlink is forbidden."""
    counts = dict.fromkeys(ports, 0)
    try:
        for owner, dport in _established():
            if owner == uid and dport in counts:
                counts[dport] += 1
        return counts
    except OSError:
        pass
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) < 8 or int(parts[3], 16) != TCP_ESTABLISHED or int(parts[7]) != uid:
            continue
        port = int(parts[2].rpartition(":")[2], 16)
        if port in counts:
            counts[port] += 1
    return counts


def _established() -> list[tuple[int, int]]:
    """(owner's uid, remote port) of every established IPv4 TCP socket of this network namespace (sock_diag dump)."""
    import socket
    import struct

    req = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, 1 << TCP_ESTABLISHED) + bytes(48)
    msg = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + req
    found = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4) as nl:  # NETLINK_SOCK_DIAG
        nl.settimeout(5.0)
        nl.sendto(msg, (0, 0))
        while True:
            data = nl.recv(1 << 20)
            at = 0
            while at + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, at)
                if kind == _NLMSG_DONE:
                    return found
                if kind == _NLMSG_ERROR:
                    err = -struct.unpack_from("=i", data, at + 16)[0]
                    raise OSError(err, os.strerror(err))
                # struct inet_diag_msg: family, state, timer, retrans, id (sport, dport, ...: 48 bytes), expires,
                # rqueue, wqueue, uid, inode
                dport = struct.unpack_from("!H", data, at + 16 + 6)[0]
                owner = struct.unpack_from("=I", data, at + 16 + 64)[0]
                found.append((owner, dport))
                at += (length + 3) & ~3
