"""Who may use a launch's loopback sockets: the store behind each gate, and each process's tunnels.

A store host keeps torch's store server on ``127.0.0.1`` behind its :class:`~neighbor_ckpt.inprocess.store_auth.Gate`,
and every process reaches a gate through a :class:`~neighbor_ckpt.inprocess.store_auth.Tunnel` of its own, a
loopback listener for torch's store client. Loopback is reachable by every user of the node, so each of the two must
turn away whoever is not the job:

**The store behind the gate: sealed with a TCP-MD5 key** (:func:`seal`, :func:`sign`). torch's server cannot serve a
Unix-domain socket (``master_listen_fd`` on one fails, with libuv "operation not supported on socket", without it
"is bound to port ..."; its own client connects by TCP anyway), and it serves whoever it accepts: a check after its
``accept`` would come after it read the first request. So the kernel does the check before torch sees a connection:
before torch serves it, the store host puts a random key (80 bytes, never leaving the process) on the listening
socket for every source address (RFC 2385 TCP-MD5 signatures, ``TCP_MD5SIG_EXT`` with a /0 prefix), and the gate puts
the same key on each of its connections to the store. A connection attempt that does not sign its segments with the
key is dropped by the kernel: another user's ``connect`` never completes, torch never sees it. torch's server makes a
client of its own, which cannot sign: it is given another loopback address to connect to, where a
:class:`~neighbor_ckpt.inprocess.store_auth.Door` of the store host admits this process only (as a tunnel does,
below) and carries it in, signed, until torch's server has started. So the store is sealed from before its first
connection on, with no moment open to anyone. A kernel without TCP-MD5 (``CONFIG_TCP_MD5SIG``, or FIPS mode) makes
:func:`seal` raise :class:`Unsealable` (and a node without the door's address fails the door): the store host then
says, in one warning, that its store is open to the node's users, and goes on. Cost: one MD5 over each segment
between gate and store (small: the store's messages are short).

**A tunnel: this process only** (:func:`foreign_peer`). torch's client connects by TCP to a host and port, so a
tunnel must be a TCP listener; for each connection it accepts it asks the kernel for the peer's socket by its
address (``NETLINK_SOCK_DIAG``, the interface of ``ss``: the owner's uid and the socket's inode, in about 0.03 ms;
where netlink is forbidden, ``/proc/self/net/tcp`` and ``tcp6``, which take milliseconds: the kernel walks its whole
table) and admits it only when that socket belongs to this launch's user *and* is one of this process's own
descriptors (``/proc/self/fd``: about 2 ms for 300 descriptors). Anything else is closed unanswered, counted and
logged through a :class:`~neighbor_ckpt.inprocess.store_auth.RefusalLog`. The check runs once per connection, on the
tunnel's event loop (its one thread: a flood of connections queues there, holding no thread each); a connection then
carries any number of store operations, unchecked. A check per operation (the tunnel does not parse torch's protocol)
would not add anything: the connection is this process's from its first byte to its last.

Out of scope: torch's gloo and NCCL listeners between ranks (torch's own, not authenticated by neighbor_ckpt), and
root.
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
import struct
from typing import Optional

__all__ = ["KEY_BYTES", "Unsealable", "new_key", "seal", "sign", "foreign_peer"]

TCP_MD5SIG_EXT = 32  # linux/tcp.h: struct tcp_md5sig with tcpm_flags / tcpm_prefixlen honoured
_TCP_MD5SIG_FLAG_PREFIX = 1
KEY_BYTES = 80  # TCP_MD5SIG_MAXKEYLEN
_ESTABLISHED = "01"


class Unsealable(OSError):
    """This kernel cannot sign TCP segments (no TCP-MD5): the store behind the gate cannot be sealed."""


def new_key() -> bytes:
    """A fresh random key for one store host (kept in its memory only)."""
    return secrets.token_bytes(KEY_BYTES)


def _md5sig(family: int, key: bytes) -> bytes:
    """``struct tcp_md5sig`` for every address of ``family`` (prefix length 0)."""
    if family == socket.AF_INET6:
        addr = struct.pack("=HHI16sI", socket.AF_INET6, 0, 0, bytes(16), 0)
    else:
        addr = struct.pack("=HH4s", socket.AF_INET, 0, bytes(4))
    return addr.ljust(128, b"\0") + struct.pack("=BBHi", _TCP_MD5SIG_FLAG_PREFIX, 0, len(key), 0) + key.ljust(
        KEY_BYTES, b"\0")


def _set_key(sock: socket.socket, key: bytes) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_MD5SIG_EXT, _md5sig(sock.family, key))
    except OSError as e:
        raise Unsealable(e.errno, f"TCP-MD5 signatures are not available here ({e.strerror or e})") from None


def seal(listener: socket.socket, key: bytes) -> None:
    """From now on ``listener`` (a TCP listening socket) completes only connections that sign with ``key``: the
    kernel drops the others' connection attempts (connections made before stay as they are).
    :class:`Unsealable` when the kernel cannot."""
    _set_key(listener, key)


def sign(sock: socket.socket, key: bytes) -> None:
    """Sign every segment of ``sock`` (a TCP socket, not connected yet) with ``key``, to reach a sealed listener."""
    _set_key(sock, key)


# -- who is on the other end of a loopback connection --------------------------------------------------------------

def _hex_endpoints(address: tuple) -> tuple[str, str]:
    """``host:port`` (IPv4) as ``/proc/net/tcp`` writes it, and as ``/proc/net/tcp6`` writes it mapped into IPv6
    (``::ffff:a.b.c.d``, what torch's client sockets use): the address in native-endian 32-bit words, in hex."""
    raw = socket.inet_aton(address[0])
    port = f"{address[1]:04X}"
    v6 = b"\0" * 10 + b"\xff\xff" + raw
    return (f"{struct.unpack('=I', raw)[0]:08X}:{port}",
            "".join(f"{w:08X}" for w in struct.unpack("=4I", v6)) + f":{port}")


def _entries(local: Optional[tuple] = None, remote: Optional[tuple] = None) -> list[tuple[str, int, int]]:
    """(state, uid, inode) of each TCP socket of this network namespace whose local / remote endpoint is the IPv4
    one given, in ``/proc/self/net/tcp`` or, mapped into IPv6, in ``/proc/self/net/tcp6``."""
    want_l = (None, None) if local is None else _hex_endpoints(local)
    want_r = (None, None) if remote is None else _hex_endpoints(remote)
    out = []
    for i, table in enumerate(("/proc/self/net/tcp", "/proc/self/net/tcp6")):
        try:
            f = open(table)
        except FileNotFoundError:
            continue  # no IPv6 in this kernel
        with f:
            next(f)
            for line in f:
                parts = line.split()
                if (want_l[i] is None or parts[1] == want_l[i]) and (want_r[i] is None or parts[2] == want_r[i]):
                    out.append((parts[3], int(parts[7]), int(parts[9])))
    return out


def _own_socket(inode: int) -> bool:
    """Whether socket ``inode`` is one of this process's descriptors."""
    if inode == 0:
        return False  # no file: closed already, or in TIME_WAIT
    target = f"socket:[{inode}]"
    with os.scandir("/proc/self/fd") as it:
        for entry in it:
            try:
                if os.readlink(entry.path) == target:
                    return True
            except OSError:
                continue  # closed meanwhile
    return False


_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NLMSG_ERROR = 4, 20, 1, 2
_NO_COOKIE = 0xFFFFFFFF


def _diag(src: tuple, dst: tuple) -> Optional[tuple[int, int]]:
    """(uid, inode) of the TCP socket connected from ``src`` to ``dst`` (IPv4 endpoints; an IPv6 socket with the
    addresses mapped is found too), asked of the kernel by its exact address (``NETLINK_SOCK_DIAG``, a hash look-up:
    ``/proc/net/tcp`` walks every bucket of the table, milliseconds); None when there is none."""
    req = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
    req += struct.pack("!HH", src[1], dst[1]) + socket.inet_aton(src[0]) + bytes(12) + socket.inet_aton(dst[0])
    req += bytes(12) + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)  # any interface, no cookie
    msg = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + req
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(5.0)
        nl.sendto(msg, (0, 0))
        data = nl.recv(65536)
    kind = struct.unpack_from("=H", data, 4)[0]
    if kind == _NLMSG_ERROR:
        err = -struct.unpack_from("=i", data, 16)[0]
        if err == errno.ENOENT:
            return None
        raise OSError(err, os.strerror(err))
    uid, inode = struct.unpack_from("=II", data, 16 + 64)  # struct inet_diag_msg: idiag_uid, idiag_inode
    return uid, inode


def foreign_peer(conn: socket.socket) -> Optional[str]:
    """None when the other end of ``conn`` (accepted on a loopback listener of this process) is a socket of this very
    process; else what it is, for the refusal's log line. About 0.03 ms for the kernel's answer, plus a look through
    this process's descriptors (about 2 ms for 300) when it is this user's."""
    try:
        peer, local = conn.getpeername(), conn.getsockname()
    except OSError as e:
        return f"it is gone ({e})"
    try:
        found = _diag(peer, local)
    except OSError:  # no sock_diag here (a sandbox that forbids netlink): the tables, slower but the same answer
        try:
            found = next(((uid, inode) for state, uid, inode in _entries(local=peer, remote=local)
                          if state == _ESTABLISHED), None)
        except OSError as e:
            return f"its socket cannot be looked up ({e})"
    if found is None:
        return "the kernel knows no socket at its address (gone already, or another network namespace)"
    uid, inode = found
    if uid != os.getuid():
        return f"a socket of uid {uid}, not of this launch's user"
    if not _own_socket(inode):
        return "a socket of another process"
    return None
