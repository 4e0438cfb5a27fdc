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

**No thread per connection.** A gate, a tunnel and a door each serve all their connections on one event loop
(:mod:`~neighbor_ckpt.inprocess.event_loop`: one thread, ``epoll``): a non-blocking accept, the handshake as a state
machine with its deadline (:mod:`~neighbor_ckpt.inprocess.store_handshake`), then splicing both ways with a bounded
buffer per direction, back-pressure and half-close passed on (:mod:`~neighbor_ckpt.inprocess.splice`). A store host
runs the same few threads with ten or ten thousand connections; a connection costs its descriptors and at most two
buffers of :data:`~neighbor_ckpt.inprocess.splice.BUFFER_BYTES` (none while idle).

**Nobody starves the job at the gate** (:class:`HandshakeSlots`). A handshake must be over
:data:`HANDSHAKE_TIMEOUT_S` after the gate accepted the connection: one deadline for the whole handshake, not a
timeout per ``recv``, so a client that drips a byte now and then is closed at the deadline all the same. Handshakes
under way are bounded by slots, taken at the accept; a connection that finds no slot free for its kind is closed at
once, unanswered (counted and logged as refused; a client of the job that meets it reconnects, as after a lost
connection). Whose slot a connection takes is decided by who is at the other end, which the gate asks the kernel for
(``NETLINK_SOCK_DIAG``, as a tunnel does, :mod:`~neighbor_ckpt.inprocess.loopback`):

- *a socket of this node* (the kernel knows the socket at the peer's address: loopback, or one of the node's own
  addresses) *of the store host's own user*, i.e. the job's processes on this node: :data:`MAX_HANDSHAKES` slots
  (8,192) reserved for them, which nobody else's connection can take;
- *a socket of this node of any other user* (root included, unless the job runs as root): one small pool shared by
  them all, :data:`OTHER_USERS_HANDSHAKES` slots (16);
- *anything else* (the kernel knows no socket at that address: another node; or IPv6, which the kernel look-up here
  does not speak): :data:`OTHER_NODES_HANDSHAKES` slots in all (8,192), at most :data:`PER_ADDRESS_HANDSHAKES` (512)
  of them per source address, so one address cannot take them all.

So another user of the node can hold :data:`OTHER_USERS_HANDSHAKES` handshakes at once, each for
:data:`HANDSHAKE_TIMEOUT_S` at most, however many connections it makes and however slowly it answers, and the job's
own clients on the node still find their slots free; the cold start of every process of a large job (thousands of
handshakes at once, from this node and from the others) finds slots enough. A user of another node shares its node's
address with the job's processes there: it can hold that address's slots (the gate cannot tell users of another node
apart), not the others'. A handshake under way holds a descriptor and a few hundred bytes, no thread, and a flood of
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
import ipaddress
import logging
import os
import resource
import secrets
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.inprocess import loopback
from neighbor_ckpt.inprocess.event_loop import Acceptor, Connect, Loop
from neighbor_ckpt.inprocess.splice import Splice
from neighbor_ckpt.inprocess.store_handshake import (MAGIC, NONCE_BYTES, Exchange, Refused, client_steps,
                                                     gate_steps, run_blocking)

__all__ = ["TOKEN_FILE", "TUNNEL_THREAD", "HANDSHAKE_TIMEOUT_S", "MAX_HANDSHAKES",
           "OTHER_USERS_HANDSHAKES", "OTHER_NODES_HANDSHAKES", "PER_ADDRESS_HANDSHAKES", "REFUSAL_LOG_EVERY_S",
           "RefusalLog", "HandshakeSlots", "peer_uid", "Gate", "Tunnel", "Door", "DOOR_HOST", "tunnel_address",
           "tunnel_ports", "new_token_file", "read_token", "prove", "challenge", "raise_descriptor_limit"]

logger = logging.getLogger(__name__)

TOKEN_FILE = "store.token"
"""The token file's name in the run directory."""
HANDSHAKE_TIMEOUT_S = 5.0
"""The deadline of a whole handshake, on either side (a gate: from the accept; a tunnel: from its connection to the
gate), not a timeout per ``recv``: a peer that answers a byte at a time is closed at the deadline all the same (a
stopped host: the connection fails, as an unanswered store operation does)."""
MAX_HANDSHAKES = 8192
"""Handshakes a gate runs at once for the store host's own user's clients on this node (the job's: reserved for them,
nobody else's connection takes one) (:class:`HandshakeSlots`). A handshake costs no thread (the gate's event loop
runs them all), only a descriptor and a few hundred bytes until its deadline: the cold start of every process of a
large job is admitted at once. A connection that finds no slot of its kind free is closed at once, unanswered
(counted and logged as refused; a client of the job that meets a full gate reconnects, as after a lost
connection)."""
OTHER_USERS_HANDSHAKES = 16
"""Handshakes a gate runs at once for all the other users of its node together (each at most this long:
:data:`HANDSHAKE_TIMEOUT_S`); they never take the job's slots."""
OTHER_NODES_HANDSHAKES = 8192
"""Handshakes a gate runs at once for the clients of other nodes, all of them together (the job's processes on the
other nodes: a cold start of a thousand nodes)."""
PER_ADDRESS_HANDSHAKES = 512
"""Handshakes a gate runs at once for one source address of another node (out of :data:`OTHER_NODES_HANDSHAKES`):
a node's cold start (its processes' 4-6 connections each, its launcher's) fits, and one address cannot take every
slot of the other nodes."""
REFUSAL_LOG_EVERY_S = 60.0
"""A gate logs at most one refusal line per peer address per this many seconds; the refusals in between are counted
in the next line (and at :meth:`Gate.close`)."""
TUNNEL_THREAD = "neighbor_ckpt-store-tunnel"
"""The name (prefix) of a tunnel's thread (its event loop; it lives as long as the process)."""


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

def challenge(sock: socket.socket, token: bytes, deadline: Optional[float] = None) -> bool:
    """The gate's side, blocking: True when the client proved the token (it is then given the gate's proof); with
    ``deadline`` (``time.monotonic``), ``TimeoutError`` unless the whole handshake is over by then. (A :class:`Gate`
    runs the same steps on its event loop.)"""
    return bool(run_blocking(gate_steps(token), sock, deadline))


def prove(sock: socket.socket, token: bytes, deadline: Optional[float] = None) -> None:
    """The client's side, blocking; :class:`Refused` when the gate refuses (it closes the connection), is not a gate,
    or cannot prove that it holds the token too; with ``deadline`` (``time.monotonic``), ``TimeoutError`` unless the
    whole handshake is over by then. (A :class:`Tunnel` runs the same steps on its event loop.)"""
    run_blocking(client_steps(token), sock, deadline)


def _listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    return sock


def _forward(loop: Loop, conn: socket.socket, address: tuple[str, int], key: Optional[bytes], what: str) -> None:
    """On ``loop``'s thread: connect to the store at ``address`` (signed with ``key``, if given) and splice ``conn``
    (held by ``loop``) to it; a store that does not answer is logged (``what``: who says it about which store) and
    ``conn`` closed."""
    def connected(store: Optional[socket.socket], error: Optional[OSError]) -> None:
        if store is None:
            logger.error("%s (%s:%d) does not answer: %s", what, *address, error)
            loop.close(conn)
            return
        Splice(loop, conn, store)

    Connect(loop, address, HANDSHAKE_TIMEOUT_S, connected, key)


_splice = Splice
"""Where the gate's, the tunnels' and the door's connections are spliced (the scale harness names it)."""


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit of open descriptors to its hard limit (a gate holds two per connection, and
    the store behind it one more); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):
            pass
    return soft


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
                 other_nodes: int = OTHER_NODES_HANDSHAKES, per_address: int = PER_ADDRESS_HANDSHAKES) -> None:
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
    with it, :func:`~neighbor_ckpt.inprocess.loopback.seal`), all on one event loop: one thread, however many
    connections (:mod:`~neighbor_ckpt.inprocess.event_loop`). :meth:`refused` counts the clients turned away. Each
    handshake must be over :data:`HANDSHAKE_TIMEOUT_S` after the accept, and runs in a slot of its peer's kind
    (:class:`HandshakeSlots`: ``max_handshakes`` for this user's clients on this node, ``other_nodes`` (default: as
    many) for other nodes', ``per_address`` of them per address, ``other_users`` for this node's other users);
    refusals are logged through a :class:`RefusalLog`. Raises this process's descriptor limit to its hard limit
    (:func:`raise_descriptor_limit`)."""

    def __init__(self, listen: socket.socket, backend: tuple[str, int], token: bytes, *,
                 max_handshakes: int = MAX_HANDSHAKES, other_users: int = OTHER_USERS_HANDSHAKES,
                 per_address: int = PER_ADDRESS_HANDSHAKES, other_nodes: Optional[int] = None,
                 backend_key: Optional[bytes] = None) -> None:
        self.backend, self._token, self._backend_key = backend, token, backend_key
        self._sock = listen
        self._refused = 0
        self._lock = threading.Lock()
        self._uid = os.getuid()
        self.slots = HandshakeSlots(job=max_handshakes, other_users=other_users,
                                    other_nodes=max_handshakes if other_nodes is None else other_nodes,
                                    per_address=per_address)
        self._log = RefusalLog()
        raise_descriptor_limit()
        self._loop = Loop("neighbor_ckpt-store-gate")
        self._acceptor = Acceptor(self._loop, listen, self._accepted, "store gate")

    def refused(self) -> int:
        with self._lock:
            return self._refused

    def threads(self) -> int:
        """The threads this gate runs (its event loop's)."""
        return self._loop.threads()

    def _refuse(self, conn: socket.socket, peer: tuple, why: str, uid: Optional[int] = None) -> None:
        with self._lock:
            self._refused += 1
            count = self._log.refused(str(peer[0]), time.monotonic())
        self._loop.close(conn)
        if count is not None:
            more = f" ({count} refusals from this address since the last line)" if count > 1 else ""
            user = "" if uid is None else f" (uid {uid})"
            logger.warning("store gate: refused a client from %s:%s%s: %s%s; at most one line per address per %.0f s",
                           peer[0], peer[1], user, why, more, self._log.every_s)

    def _accepted(self, conn: socket.socket, peer: tuple) -> None:
        """The loop: a connection accepted; its handshake starts in a slot of its kind, or it is closed unanswered."""
        taken = self._take(conn, peer)
        if taken is None:
            return
        kind, deadline = taken
        self._loop.hold(conn)
        Exchange(self._loop, conn, gate_steps(self._token), deadline,
                 lambda ok, error: self._admit(conn, peer, kind, ok, error))

    def _take(self, conn: socket.socket, peer: tuple) -> Optional[tuple]:
        """The peer's kind, its slot taken, and the deadline of its handshake (from now); None when no slot of its
        kind is free (the connection is closed, unanswered)."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        try:
            uid = peer_uid(conn)
        except Exception as e:  # noqa: BLE001 - a reply it cannot read must not end the loop's work
            logger.debug("store gate: the peer of %s:%s not looked up: %s", peer[0], peer[1], e)
            uid = None
        kind = (ADDRESS, _ipv4(str(peer[0])) or str(peer[0])) if uid is None else (
            (JOB, uid) if uid == self._uid else (OTHER_USER, uid))
        why = self.slots.take(kind)
        if why is not None:
            self._refuse(conn, peer, f"{why} (closed unanswered)", uid)
            return None
        return kind, deadline

    def _admit(self, conn: socket.socket, peer: tuple, kind: tuple[str, object], ok: Any,
               error: Optional[BaseException]) -> None:
        """The loop: the handshake ended (``ok``: the client proved the token; ``error``: what cut it short); its
        slot is given back, and the client spliced to the store or refused."""
        self.slots.give(kind)
        if not ok:
            uid = None if kind[0] == ADDRESS else int(kind[1])  # type: ignore[call-overload]
            self._refuse(conn, peer, "wrong token" if error is None else f"no answer to the challenge ({error})", uid)
            return
        _forward(self._loop, conn, self.backend, self._backend_key, "store gate: the store behind the gate")

    def close(self) -> None:
        """Stop accepting (the admitted connections go on); closes only this descriptor of the listener: the
        launcher may hold the port's socket for a next store host."""
        self._acceptor.close(shutdown=False)
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
    fails, as it would on a lost store). One event loop (one thread) carries all of them."""

    def __init__(self, remote: tuple[str, int], token: bytes) -> None:
        self.remote, self._token = remote, token
        self._sock = _listener("127.0.0.1", 0)
        self.address: tuple[str, int] = ("127.0.0.1", self._sock.getsockname()[1])
        self._refused = 0
        self._log = RefusalLog()
        self._loop = Loop(f"{TUNNEL_THREAD}-{remote[1]}")
        self._acceptor = Acceptor(self._loop, self._sock, self._accepted, f"store tunnel {self.address[1]}")

    def refused(self) -> int:
        return self._refused  # written by the loop's thread only

    def threads(self) -> int:
        """The threads this tunnel runs (its event loop's)."""
        return self._loop.threads()

    def _admit(self, conn: socket.socket, peer: tuple) -> Optional[tuple]:
        """The loop: admit ``conn`` only from this process (a look-up per connection, not per operation)."""
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

    def _accepted(self, conn: socket.socket, peer: tuple) -> None:
        if self._admit(conn, peer) is None:
            return
        loop = self._loop
        loop.hold(conn)

        def connected(remote: Optional[socket.socket], error: Optional[OSError]) -> None:
            if remote is None:
                logger.debug("store tunnel: %s:%d: %s", *self.remote, error)
                loop.close(conn)
                return
            Exchange(loop, remote, client_steps(self._token), time.monotonic() + HANDSHAKE_TIMEOUT_S,
                     lambda _, error: proved(remote, error))

        def proved(remote: socket.socket, error: Optional[BaseException]) -> None:
            if error is None:
                Splice(loop, conn, remote)
                return
            # Refused: not a gate, or not this job's (no failover helps); else a stopped or lost host: the client's
            # operation fails and the stores' failover follows
            logger.log(logging.ERROR if isinstance(error, Refused) else logging.WARNING,
                       "store tunnel: %s:%d: no handshake (%s)", *self.remote, error)
            loop.close(remote)
            loop.close(conn)

        Connect(loop, self.remote, HANDSHAKE_TIMEOUT_S, connected)

    def close(self) -> None:
        self._acceptor.close(shutdown=True)


DOOR_HOST = "127.0.0.2"
"""Where a store host's :class:`Door` listens (at its store's port: loopback, another address)."""


class Door:
    """The store host's own way into its sealed store while torch starts it: torch's server makes a client of its own
    and connects it to the host it is given at the store's port, and that client cannot sign. So the store host
    gives torch :data:`DOOR_HOST` and listens there, at the store's port, for the connections of this very process
    only (:func:`~neighbor_ckpt.inprocess.loopback.foreign_peer`), each carried to the sealed store at ``store``,
    signed with ``key``. Closed once torch's server has started: the store is sealed from before its first connection
    on, with no moment open to anyone (the connection it carried goes on, on the door's event loop). ``OSError``
    when :data:`DOOR_HOST` or that port cannot be bound."""

    def __init__(self, store: tuple[str, int], key: bytes) -> None:
        self.store, self._key = store, key
        self._sock = _listener(DOOR_HOST, store[1])
        self.host = DOOR_HOST
        self._loop = Loop("neighbor_ckpt-store-door")
        self._acceptor = Acceptor(self._loop, self._sock, self._accepted, f"store door {DOOR_HOST}:{store[1]}")

    def _accepted(self, conn: socket.socket, peer: tuple) -> None:
        why = loopback.foreign_peer(conn)
        if why is not None:
            conn.close()
            logger.warning("store door %s:%d: refused a connection from %s:%s: %s", DOOR_HOST, self.store[1],
                           peer[0], peer[1], why)
            return
        self._loop.hold(conn)
        _forward(self._loop, conn, self.store, self._key, "store door: the store")

    def close(self) -> None:
        self._acceptor.close(shutdown=True)


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
