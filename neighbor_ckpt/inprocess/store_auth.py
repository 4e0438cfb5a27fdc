"""The launch's stores admit the job's own processes only: a per-job token, a gate before each store, a tunnel in
each client process.

torch's TCPStore server serves whoever connects, and its client cannot present anything. So every store host keeps
its TCPStore on the loopback interface (``127.0.0.1``, an ephemeral port) and puts a :class:`Gate` on the job's
address (the port of the launch's store list): a client proves that it holds the job's token, then the gate splices
its connection to the store. A process reaches a gate through a :class:`Tunnel` of its own (a loopback listener per
store address, :func:`tunnel_address`): it does the handshake for torch's client, then splices too. The loopback
sockets are the job's too: the store behind a gate is sealed with a key only its gate signs with, and a tunnel admits
connections from its own process only (:mod:`~neighbor_ckpt.inprocess.loopback`, which says how). A client without
the token, or with another job's, is refused and the gate logs who it was (one line per address per minute, with the
count it stands for: :class:`RefusalLog`); nothing read from a store is unpickled (the stores hold text and raw bytes
only).

**Nobody starves the job at the gate** (:class:`HandshakeSlots`). A handshake runs on a thread of its own and must be
over :data:`HANDSHAKE_TIMEOUT_S` after the gate accepted the connection: one deadline for the whole handshake, not a
timeout per ``recv``, so a client that drips a byte now and then is closed at the deadline all the same. The threads
are bounded by slots, taken on the accepting thread before a handshake starts; a connection that finds no slot free
for its kind is closed at once, unanswered (counted and logged as refused; a client of the job that meets it
reconnects, as after a lost connection). Whose slot a connection takes is decided by who is at the other end, which
the gate asks the kernel for (``NETLINK_SOCK_DIAG``, as a tunnel does, :mod:`~neighbor_ckpt.inprocess.loopback`):

- *a socket of this node* (the kernel knows the socket at the peer's address: loopback, or one of the node's own
  addresses) *of the store host's own user*, i.e. the job's processes on this node: :data:`MAX_HANDSHAKES` slots
  reserved for them, which nobody else's connection can take;
- *a socket of this node of any other user* (root included, unless the job runs as root): one small pool shared by
  them all, :data:`OTHER_USERS_HANDSHAKES` slots;
- *anything else* (the kernel knows no socket at that address: another node; or IPv6, which the kernel look-up here
  does not speak): :data:`MAX_HANDSHAKES` slots in all, at most :data:`PER_ADDRESS_HANDSHAKES` of them per source
  address, so one address cannot take them all.

So another user of the node can hold :data:`OTHER_USERS_HANDSHAKES` handshakes at once, each for
:data:`HANDSHAKE_TIMEOUT_S` at most, however many connections it makes and however slowly it answers, and the job's
own clients on the node still find their slots free. A user of another node shares its node's address with the job's
processes there: it can hold that address's slots (the gate cannot tell users of another node apart), not the
others'. At most ``2 * MAX_HANDSHAKES + OTHER_USERS_HANDSHAKES`` handshake threads run at once, and a flood of
connections holds neither threads nor log lines.

**The handshake** (:func:`prove`, :func:`challenge`), mutual: the gate sends :data:`MAGIC` and 16 fresh random
bytes; the client answers with their HMAC-SHA256 under the token and 16 fresh bytes of its own; the gate answers with
the HMAC of both under the token (another label: neither answer can be replayed as the other). So the gate knows the
client holds the token, and the client knows it reached a gate of its job, not whatever took the address of a store
that went away. The token never crosses the network, and an answer is good for one connection only.

**The token** (:func:`new_token_file`, :func:`read_token`): 32 random bytes, as hex, in a file of the run directory
(``store.token``, mode 0600, made once per launch before the launchers start); the launchers get its *path*
(``--token-file``) and so do their processes (:data:`~neighbor_ckpt.inprocess.protocol.ENV_STORE_TOKEN`): never the
token itself on a command line or in an environment, where ``ps`` and ``/proc`` show them to other users. A file
that others can read, or that is not the user's, is refused.

**What it does not cover.** The gloo and NCCL connections between ranks are not authenticated (torch's own). The
gate keeps other nodes, other jobs and other users out of the stores.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.inprocess import loopback

__all__ = ["MAGIC", "TOKEN_FILE", "TUNNEL_THREAD", "HANDSHAKE_TIMEOUT_S", "MAX_HANDSHAKES", "OTHER_USERS_HANDSHAKES",
           "PER_ADDRESS_HANDSHAKES", "REFUSAL_LOG_EVERY_S", "RefusalLog", "HandshakeSlots", "peer_uid", "Gate",
           "Tunnel", "Door", "DOOR_HOST", "tunnel_address", "tunnel_ports", "new_token_file", "read_token", "prove",
           "challenge", "Refused"]

logger = logging.getLogger(__name__)

MAGIC = b"NCKPT-STORE-2\n"
"""What a gate says first (a client that reaches something else stops at once; ``-1``: the one-way handshake of
earlier releases)."""
NONCE_BYTES = 16
TOKEN_FILE = "store.token"
"""The token file's name in the run directory."""
HANDSHAKE_TIMEOUT_S = 5.0
"""The deadline of a whole handshake, on either side (a gate: from the accept; a tunnel: from its connection to the
gate), not a timeout per ``recv``: a peer that answers a byte at a time is closed at the deadline all the same (a
stopped host: the connection fails, as an unanswered store operation does)."""
MAX_HANDSHAKES = 64
"""Handshakes a gate runs at once for the store host's own user's clients on this node (the job's: reserved for them,
nobody else's connection takes one), and as many in all for other nodes' clients (:class:`HandshakeSlots`). A
connection that finds no slot of its kind free is closed at once, unanswered (counted and logged as refused), so a
flood of connections that never answer cannot hold a thread each (a client of the job that meets a full gate
reconnects, as after a lost connection)."""
OTHER_USERS_HANDSHAKES = 16
"""Handshakes a gate runs at once for all the other users of its node together (each at most this long:
:data:`HANDSHAKE_TIMEOUT_S`); they never take the job's slots."""
PER_ADDRESS_HANDSHAKES = 16
"""Handshakes a gate runs at once for one source address of another node (out of :data:`MAX_HANDSHAKES` for all of
them): one address cannot take every slot of the other nodes."""
REFUSAL_LOG_EVERY_S = 60.0
"""A gate logs at most one refusal line per peer address per this many seconds; the refusals in between are counted
in the next line (and at :meth:`Gate.close`)."""
TUNNEL_THREAD = "neighbor_ckpt-store-tunnel"
"""The name (prefix) of a tunnel's threads (they live as long as the process)."""
_CLIENT, _GATE = b"client\n", b"gate\n"
_CHUNK = 1 << 16


class Refused(ConnectionError):
    """The gate refused this client (wrong or missing token), or what answered is not a gate of this job."""


# -- the token -------------------------------------------------------------------------------------------------------

def new_token_file(path: Path) -> Path:
    """Make ``path`` (mode 0600, 32 random bytes as hex) unless it exists already (a launch whose launchers were
    restarted keeps its token); either way it must pass :func:`read_token`. Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    try:
        os.link(tmp, path)  # whole or not at all: a launch starting beside this one reads a complete token
    except FileExistsError:
        read_token(path)
    finally:
        os.unlink(tmp)
    return path


def read_token(path: Path) -> bytes:
    """The token in ``path``; :class:`~neighbor_ckpt.errors.ConfigError` when it is missing, not the user's, readable
    by others, or not a token."""
    try:
        st = os.stat(path)
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"in-process recovery: the store token file {path}: {e.strerror or e}; the launch makes it "
                          "in the run directory before its launchers start") from None
    if st.st_uid != os.getuid():
        raise ConfigError(f"in-process recovery: the store token file {path} belongs to uid {st.st_uid}, not to "
                          f"this user ({os.getuid()}): refused")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError(f"in-process recovery: the store token file {path} is readable by others (mode "
                          f"{stat.S_IMODE(st.st_mode):o}): refused; `chmod 600 {path}`")
    try:
        token = bytes.fromhex(text)
    except ValueError:
        token = b""
    if len(token) < 16:
        raise ConfigError(f"in-process recovery: the store token file {path} holds no token (hex, 16 bytes or more)")
    return token


# -- the handshake ---------------------------------------------------------------------------------------------------

def _until(sock: socket.socket, deadline: Optional[float], done: int, n: int) -> None:
    """Give ``sock``'s next call what is left until ``deadline`` (``time.monotonic``; None: leave its timeout as it
    is); ``TimeoutError`` when nothing is left (``done`` of ``n`` bytes got, for the message)."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"the handshake's deadline passed ({done} of {n} bytes got)")
    sock.settimeout(left)


def _send(sock: socket.socket, data: bytes, deadline: Optional[float]) -> None:
    _until(sock, deadline, 0, 0)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    """``n`` bytes from ``sock``; with ``deadline`` (``time.monotonic``), all of them by then, however they come."""
    out = b""
    while len(out) < n:
        _until(sock, deadline, len(out), n)
        try:
            part = sock.recv(n - len(out))
        except TimeoutError:
            if deadline is None:
                raise
            raise TimeoutError(f"the handshake's deadline passed ({len(out)} of {n} bytes got)") from None
        if not part:
            raise ConnectionError(f"the connection closed after {len(out)} of {n} bytes")
        out += part
    return out


_DIGEST = hashlib.sha256().digest_size


def _answer(token: bytes, label: bytes, *nonces: bytes) -> bytes:
    return hmac.new(token, label + MAGIC + b"".join(nonces), hashlib.sha256).digest()


def challenge(sock: socket.socket, token: bytes, deadline: Optional[float] = None) -> bool:
    """The gate's side: True when the client proved the token (it is then given the gate's proof); with
    ``deadline`` (``time.monotonic``), ``TimeoutError`` unless the whole handshake is over by then."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    _send(sock, MAGIC + nonce, deadline)
    got = _recv_exact(sock, _DIGEST + NONCE_BYTES, deadline)
    if not hmac.compare_digest(got[:_DIGEST], _answer(token, _CLIENT, nonce)):
        return False
    _send(sock, _answer(token, _GATE, nonce, got[_DIGEST:]), deadline)
    return True


def prove(sock: socket.socket, token: bytes, deadline: Optional[float] = None) -> None:
    """The client's side; :class:`Refused` when the gate refuses (it closes the connection), is not a gate, or
    cannot prove that it holds the token too; with ``deadline`` (``time.monotonic``), ``TimeoutError`` unless the
    whole handshake is over by then."""
    hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if not hello.startswith(MAGIC):
        raise Refused("what answered is not a neighbor_ckpt store gate (or one of another release)")
    nonce, mine = hello[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
    _send(sock, _answer(token, _CLIENT, nonce) + mine, deadline)
    try:
        proof = _recv_exact(sock, _DIGEST, deadline)
    except ConnectionError:
        raise Refused("the store gate refused this process's token (another job's, or an old token file)") from None
    if not hmac.compare_digest(proof, _answer(token, _GATE, nonce, mine)):
        raise Refused("what answered as a store gate does not hold this job's token (another job's gate, or "
                      "whatever took the address of a store that went away)")


# -- splicing --------------------------------------------------------------------------------------------------------

def _splice(a: socket.socket, b: socket.socket, name: str) -> None:
    """Copy both ways between ``a`` and ``b`` on two daemon threads; when either side ends, both are closed (the
    other side sees the end, as it would see a store that went away)."""
    done = threading.Event()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            if not done.is_set():
                done.set()
                for s in (a, b):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            else:
                a.close()
                b.close()

    for src, dst in ((a, b), (b, a)):
        threading.Thread(target=pump, args=(src, dst), name=name, daemon=True).start()


def _listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    return sock


def _serve(sock: socket.socket, handle, name: str, *, admit=None) -> threading.Thread:  # noqa: ANN001
    """Accept on ``sock`` and run ``handle(conn, peer, *more)`` on a thread per connection; with ``admit``, only for a
    connection it admits (``admit(conn, peer)``, on this thread: the arguments ``more`` to pass on, a tuple; or None:
    it closed the connection)."""
    def run() -> None:
        while True:
            try:
                conn, peer = sock.accept()
            except OSError:
                return  # closed
            more = () if admit is None else admit(conn, peer)
            if more is None:
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=handle, args=(conn, peer, *more), name=name, daemon=True).start()

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


def _close_listener(sock: socket.socket) -> None:
    """Stop listening now: a thread blocked in ``accept`` keeps a merely closed socket listening (Linux), so shut it
    down first (the ``accept`` then fails and its thread ends)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _forward(conn: socket.socket, address: tuple[str, int], key: Optional[bytes], what: str, name: str) -> None:
    """Connect to the store at ``address`` (signed with ``key``, if given) and splice ``conn`` to it on threads
    named ``name``; a store that does not answer is logged (``what``: who says it about which store) and ``conn``
    closed."""
    try:
        store = _connect(address, HANDSHAKE_TIMEOUT_S, key)
    except OSError as e:
        logger.error("%s (%s:%d) does not answer: %s", what, *address, e)
        conn.close()
        return
    conn.settimeout(None)
    store.settimeout(None)
    _splice(conn, store, name)


def _connect(address: tuple[str, int], timeout_s: float, key: Optional[bytes] = None) -> socket.socket:
    """A connection to ``address``; signed with ``key`` (:func:`~neighbor_ckpt.inprocess.loopback.sign`) if given."""
    if key is None:
        sock = socket.create_connection(address, timeout=timeout_s)
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
        try:
            loopback.sign(sock, key)
            sock.settimeout(timeout_s)
            sock.connect(address)
        except OSError:
            sock.close()
            raise
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# -- the gate (in the store host) ------------------------------------------------------------------------------------

class RefusalLog:
    """One log line per peer address per ``every_s`` seconds at most, with the count of the refusals it stands for
    (pure bookkeeping; ``now`` is passed in): a flood of refused connections grows the log by a bounded number of
    lines."""

    def __init__(self, every_s: float = REFUSAL_LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def refused(self, host: str, now: float) -> Optional[int]:
        """Note a refusal from ``host``: the number of refusals to report in a line now (this one and those held
        back since the last line), or None when this one is held back."""
        held = self._held.get(host, 0) + 1
        if host in self._last and now - self._last[host] < self.every_s:
            self._held[host] = held
            return None
        self._last[host] = now
        self._held[host] = 0
        return held

    def held(self) -> dict[str, int]:
        """The refusals not reported yet, by peer address (taken: reported by the caller)."""
        out = {h: n for h, n in self._held.items() if n}
        self._held.clear()
        return out


JOB, OTHER_USER, ADDRESS = "job", "user", "address"
"""The kinds of peer a gate keeps slots for (:class:`HandshakeSlots`): the store host's own user on this node, another
user of this node, a source address the kernel knows no socket of (another node)."""


def _ipv4(host: str) -> Optional[str]:
    """``host`` as dotted IPv4 (an IPv4-mapped IPv6 address unmapped); None for any other IPv6 address."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if ip.version == 6:
        ip = ip.ipv4_mapped
    return None if ip is None else str(ip)


def peer_uid(conn: socket.socket) -> Optional[int]:
    """The uid that owns the other end of ``conn`` (an accepted TCP connection) when that end is a live socket of this
    node (this network namespace): the kernel's answer for the socket at the peer's address connected to ours
    (``NETLINK_SOCK_DIAG``, about 0.03 ms; where netlink is forbidden, ``/proc/self/net/tcp{,6}``, milliseconds).
    None when the kernel knows no such socket (another node; or gone already: closed sockets have no owner, inode
    0), or for an IPv6 peer (the look-up speaks IPv4 and IPv4 mapped into IPv6)."""
    try:
        peer, local = conn.getpeername(), conn.getsockname()
    except OSError:
        return None
    src, dst = _ipv4(str(peer[0])), _ipv4(str(local[0]))
    if src is None or dst is None:
        return None
    src_end, dst_end = (src, int(peer[1])), (dst, int(local[1]))
    try:
        found = loopback._diag(src_end, dst_end)
    except OSError:  # no sock_diag here (a sandbox that forbids netlink): the tables, slower but the same answer
        try:
            found = next(((uid, inode) for _, uid, inode in loopback._entries(local=src_end, remote=dst_end)), None)
        except OSError:
            return None
    if found is None or found[1] == 0:
        return None
    return found[0]


class HandshakeSlots:
    """Which handshakes a gate may start now (pure bookkeeping, thread-safe): :meth:`take` a slot for a peer before
    its handshake starts, :meth:`give` it back when it ended. A peer is ``(JOB, uid)`` (the store host's own user on
    this node: ``job`` slots, reserved), ``(OTHER_USER, uid)`` (another user of this node: ``other_users`` slots
    shared by all of them) or ``(ADDRESS, host)`` (another node: ``other_nodes`` slots in all, ``per_address`` of them
    at most per address). At most ``job + other_users + other_nodes`` are taken at once."""

    def __init__(self, *, job: int = MAX_HANDSHAKES, other_users: int = OTHER_USERS_HANDSHAKES,
                 other_nodes: int = MAX_HANDSHAKES, per_address: int = PER_ADDRESS_HANDSHAKES) -> None:
        self._cap = {JOB: job, OTHER_USER: other_users, ADDRESS: other_nodes}
        self.per_address = min(per_address, other_nodes)
        self._lock = threading.Lock()
        self._kind: dict[str, int] = {JOB: 0, OTHER_USER: 0, ADDRESS: 0}
        self._address: dict[str, int] = {}

    def take(self, peer: tuple[str, object]) -> Optional[str]:
        """Take a slot for ``peer``: None when taken (:meth:`give` it back later), else why none is free."""
        kind, who = peer
        with self._lock:
            if self._kind[kind] >= self._cap[kind]:
                return {JOB: f"the {self._cap[JOB]} handshakes of this store host's user already under way",
                        OTHER_USER: f"the {self._cap[OTHER_USER]} handshakes of this node's other users already under "
                                    "way",
                        ADDRESS: f"the {self._cap[ADDRESS]} handshakes of other nodes already under way"}[kind]
            if kind == ADDRESS:
                if self._address.get(str(who), 0) >= self.per_address:
                    return f"the {self.per_address} handshakes of this address already under way"
                self._address[str(who)] = self._address.get(str(who), 0) + 1
            self._kind[kind] += 1
            return None

    def give(self, peer: tuple[str, object]) -> None:
        kind, who = peer
        with self._lock:
            self._kind[kind] -= 1
            if kind == ADDRESS:
                left = self._address[str(who)] - 1
                if left:
                    self._address[str(who)] = left
                else:
                    del self._address[str(who)]

    def taken(self) -> dict[str, int]:
        """The slots taken now, per kind of peer."""
        with self._lock:
            return dict(self._kind)


class Gate:
    """Admits clients that prove ``token`` on ``listen`` (a bound, listening socket on the job's address) and splices
    each to the store at ``backend`` (loopback; its connections signed with ``backend_key`` when the store is sealed
    with it, :func:`~neighbor_ckpt.inprocess.loopback.seal`). :meth:`refused` counts the clients turned away. Each
    handshake must be over :data:`HANDSHAKE_TIMEOUT_S` after the accept, and runs in a slot of its peer's kind
    (:class:`HandshakeSlots`: ``max_handshakes`` for this user's clients on this node and as many for other nodes',
    ``per_address`` of them per address, ``other_users`` for this node's other users); refusals are logged through a
    :class:`RefusalLog`."""

    def __init__(self, listen: socket.socket, backend: tuple[str, int], token: bytes, *,
                 max_handshakes: int = MAX_HANDSHAKES, other_users: int = OTHER_USERS_HANDSHAKES,
                 per_address: int = PER_ADDRESS_HANDSHAKES, backend_key: Optional[bytes] = None) -> None:
        self.backend, self._token, self._backend_key = backend, token, backend_key
        self._sock = listen
        self._refused = 0
        self._lock = threading.Lock()
        self._uid = os.getuid()
        self.slots = HandshakeSlots(job=max_handshakes, other_users=other_users, other_nodes=max_handshakes,
                                    per_address=per_address)
        self._log = RefusalLog()
        self._thread = _serve(listen, self._admit, "neighbor_ckpt-store-gate", admit=self._take)

    def refused(self) -> int:
        with self._lock:
            return self._refused

    def _refuse(self, conn: socket.socket, peer: tuple, why: str, uid: Optional[int] = None) -> None:
        with self._lock:
            self._refused += 1
            count = self._log.refused(str(peer[0]), time.monotonic())
        conn.close()
        if count is not None:
            more = f" ({count} refusals from this address since the last line)" if count > 1 else ""
            user = "" if uid is None else f" (uid {uid})"
            logger.warning("store gate: refused a client from %s:%s%s: %s%s; at most one line per address per %.0f s",
                           peer[0], peer[1], user, why, more, self._log.every_s)

    def _take(self, conn: socket.socket, peer: tuple) -> Optional[tuple]:
        """The accepting thread: the peer's kind, its slot taken, and the deadline of its handshake (from now), for
        :meth:`_admit`; None when no slot of its kind is free (the connection is closed, unanswered)."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        try:
            uid = peer_uid(conn)
        except Exception as e:  # noqa: BLE001 - a reply it cannot read must not end the accepting thread
            logger.debug("store gate: the peer of %s:%s not looked up: %s", peer[0], peer[1], e)
            uid = None
        kind = (ADDRESS, _ipv4(str(peer[0])) or str(peer[0])) if uid is None else (
            (JOB, uid) if uid == self._uid else (OTHER_USER, uid))
        why = self.slots.take(kind)
        if why is not None:
            self._refuse(conn, peer, f"{why} (closed unanswered)", uid)
            return None
        return kind, deadline

    def _admit(self, conn: socket.socket, peer: tuple, kind: tuple[str, object], deadline: float) -> None:
        uid = None if kind[0] == ADDRESS else int(kind[1])  # type: ignore[call-overload]
        try:
            try:
                ok = challenge(conn, self._token, deadline)
            except (OSError, Refused) as e:
                ok, why = False, f"no answer to the challenge ({e})"
            else:
                why = "wrong token"
        finally:
            self.slots.give(kind)
        if not ok:
            self._refuse(conn, peer, why, uid)
            return
        _forward(conn, self.backend, self._backend_key, "store gate: the store behind the gate",
                 "neighbor_ckpt-store-gate")

    def close(self) -> None:
        self._sock.close()  # only this descriptor: the launcher may hold the port's socket for a next store host
        with self._lock:
            held = self._log.held()
        for host, n in sorted(held.items()):
            logger.warning("store gate: %d more client(s) from %s refused since the last line", n, host)


# -- the tunnel (in each client process) ----------------------------------------------------------------------------

class Tunnel:
    """A loopback listener of this process for torch's store client: each connection it accepts from this very
    process (:func:`~neighbor_ckpt.inprocess.loopback.foreign_peer`; any other is closed unanswered, counted in
    :meth:`refused` and logged through a :class:`RefusalLog`) is carried to the gate at ``remote`` once the handshake
    passed; when the gate does not answer, refuses or goes away, the local connection is closed (torch's client then
    fails, as it would on a lost store)."""

    def __init__(self, remote: tuple[str, int], token: bytes) -> None:
        self.remote, self._token = remote, token
        self._sock = _listener("127.0.0.1", 0)
        self.address: tuple[str, int] = ("127.0.0.1", self._sock.getsockname()[1])
        self._refused = 0
        self._log = RefusalLog()
        self._thread = _serve(self._sock, self._carry, f"{TUNNEL_THREAD}-{remote[1]}", admit=self._admit)

    def refused(self) -> int:
        return self._refused  # written by the accepting thread only

    def _admit(self, conn: socket.socket, peer: tuple) -> Optional[tuple]:
        """The accepting thread: admit ``conn`` only from this process (a look-up per connection, not per operation)."""
        why = loopback.foreign_peer(conn)
        if why is None:
            return ()
        conn.close()
        self._refused += 1
        count = self._log.refused(why, time.monotonic())
        if count is not None:
            more = f" ({count} refusals of this kind since the last line)" if count > 1 else ""
            logger.warning("store tunnel %s:%d: refused a connection from %s:%s: %s%s; at most one line per kind per "
                           "%.0f s", *self.address, peer[0], peer[1], why, more, self._log.every_s)
        return None

    def _carry(self, conn: socket.socket, peer: tuple) -> None:
        try:
            remote = _connect(self.remote, HANDSHAKE_TIMEOUT_S)
        except OSError as e:
            logger.debug("store tunnel: %s:%d: %s", *self.remote, e)
            conn.close()
            return
        try:
            prove(remote, self._token, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        except OSError as e:
            # Refused: not a gate, or not this job's (no failover helps); else a stopped or lost host: the client's
            # operation fails and the stores' failover follows
            logger.log(logging.ERROR if isinstance(e, Refused) else logging.WARNING,
                       "store tunnel: %s:%d: no handshake (%s)", *self.remote, e)
            remote.close()
            conn.close()
            return
        remote.settimeout(None)
        _splice(conn, remote, f"{TUNNEL_THREAD}-{self.remote[1]}")

    def close(self) -> None:
        _close_listener(self._sock)


DOOR_HOST = "127.0.0.2"
"""Where a store host's :class:`Door` listens (at its store's port: loopback, another address)."""


class Door:
    """The store host's own way into its sealed store while torch starts it: torch's server makes a client of its own
    and connects it to the host it is given at the store's port, and that client cannot sign. So the store host
    gives torch :data:`DOOR_HOST` and listens there, at the store's port, for the connections of this very process
    only (:func:`~neighbor_ckpt.inprocess.loopback.foreign_peer`), each carried to the sealed store at ``store``,
    signed with ``key``. Closed once torch's server has started: the store is sealed from before its first connection
    on, with no moment open to anyone. ``OSError`` when :data:`DOOR_HOST` or that port cannot be bound."""

    def __init__(self, store: tuple[str, int], key: bytes) -> None:
        self.store, self._key = store, key
        self._sock = _listener(DOOR_HOST, store[1])
        self.host = DOOR_HOST
        self._thread = _serve(self._sock, self._carry, "neighbor_ckpt-store-door", admit=self._admit)

    def _admit(self, conn: socket.socket, peer: tuple) -> Optional[tuple]:
        why = loopback.foreign_peer(conn)
        if why is not None:
            conn.close()
            logger.warning("store door %s:%d: refused a connection from %s:%s: %s", DOOR_HOST, self.store[1],
                           peer[0], peer[1], why)
            return None
        return ()

    def _carry(self, conn: socket.socket, peer: tuple) -> None:
        _forward(conn, self.store, self._key, "store door: the store", "neighbor_ckpt-store-door")

    def close(self) -> None:
        _close_listener(self._sock)


def tunnel_ports(remotes: Optional[Iterable[tuple[str, int]]] = None) -> set[int]:
    """The loopback ports of this process's tunnels (the in-process abort keeps the connections to them: they are
    the store's); only those to ``remotes`` when given."""
    want = None if remotes is None else {(str(h), int(p)) for h, p in remotes}
    with _TUNNELS_LOCK:
        if os.getpid() != _TUNNELS_PID:
            return set()
        return {t.address[1] for t in _TUNNELS.values() if want is None or tuple(t.remote) in want}


_TUNNELS: dict[tuple[tuple[str, int], bytes], Tunnel] = {}
_TUNNELS_PID = os.getpid()
_TUNNELS_LOCK = threading.Lock()


def tunnel_address(remote: tuple[str, int], token: Optional[bytes]) -> tuple[str, int]:
    """Where torch's client connects to reach the store at ``remote``: this process's :class:`Tunnel` to it (made
    on first use; a forked child makes its own), or ``remote`` itself when the launch has no token."""
    global _TUNNELS_PID
    if token is None:
        return remote
    with _TUNNELS_LOCK:
        if os.getpid() != _TUNNELS_PID:  # a fork: the parent's listener threads did not come along
            _TUNNELS.clear()
            _TUNNELS_PID = os.getpid()
        tunnel = _TUNNELS.get((remote, token))
        if tunnel is None:
            tunnel = _TUNNELS[(remote, token)] = Tunnel(remote, token)
        return tunnel.address


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m neighbor_ckpt.inprocess.store_auth FILE``: make the token file (the Slurm script, before srun)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("file", type=Path)
    args = ap.parse_args(argv)
    try:
        new_token_file(args.file)
    except ConfigError as e:
        print(f"neighbor_ckpt: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
