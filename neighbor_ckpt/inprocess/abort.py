"""Aborting a failed generation inside a live process: free the training thread wherever it is blocked, touching
nothing but the attempt's own process groups.

Why each piece (measured on CPU, torch 2.13, ``/work/shared/notes/cpu-stack.md``):

* **gloo has no working abort.** Neither ``ProcessGroup.abort()``, ``_abort_process_group()`` nor
  ``destroy_process_group()`` frees a thread blocked in a gloo collective; only closing its sockets does (the blocked
  call raises "Connection closed by peer" within ~10 ms). :func:`abort_gloo` shuts down the connections of *this
  attempt's* process groups only, unlike the patch it replaces (``megatron_patches.nvrx_gloo``), which shut down
  every connection of the process and so also the user's loggers and data streams.
* **NCCL has an abort, which can itself hang** (a wedged communicator): :func:`abort_nccl` runs torch's
  under :func:`call_with_watchdog`, which ends the process with :data:`~neighbor_ckpt.inprocess.protocol.
  EXIT_ABORT_HUNG` when it does not return in time (the launcher starts a new process in its place).
* **User code may catch the collective's error** (``except Exception``) and carry on: :func:`interrupt_thread`
  raises :class:`GenerationAborted` (a ``BaseException``) into the training thread at its next Python bytecode.

**How gloo's sockets are told apart** (measured): every ``ProcessGroupGloo`` (the default group, each ``new_group``,
megatron-core's gloo groups) has its own LISTEN socket on an ephemeral port, and each pair of ranks shares one TCP
connection which one side *accepted* on its listener and the other *connected* to the peer's listener (which side is
which depends on the addresses, not on the rank). :class:`SocketBaseline` records the sockets (by inode) that exist
before the attempt's ``init_process_group``; :func:`abort_gloo` then shuts down, among the sockets opened since:

1. connections whose local port is one of our new listeners' (the side we accepted), and
2. connections whose remote end is a gloo listener of a peer, ``peer_listeners``: what each peer's
   :func:`new_listeners` returned, published through the store.

(1) alone is not enough. A survivor whose wait is on the pair to a *stopped* peer (SIGSTOP, a GIL-holding C call, a
lost node), where the survivor is the connecting side, stayed blocked until gloo's own timeout in our experiments:
the stopped peer cannot close its accepted side, and failures on other pairs do not wake a wait on that one. With
(2) every survivor was freed within ~10 ms. Without (2) the abort still frees everything once the stopped peer is
SIGKILLed (its kernel closes its sockets). Peers must publish *after* creating their groups (megatron's included):
a listener created later and not published leaves that fallback only.

(1) and (2) miss the connections this process opened to a peer whose listeners it never read: a peer *cut off by the
network* that published them only on the store the survivors lost (a cut early in training, before the survivors
kept them in memory: :mod:`~neighbor_ckpt.inprocess.peer_listeners`). Such a peer never closes its side, and no RST
ever comes, so a wait on that pair lasts until gloo's own timeout. The escalation, ``wide=True``, shuts down every
connection the process opened since the baseline (and aborts a connect still in progress), but those from or to
``keep_ports``: used only when the training thread is still blocked after the scoped abort, when the alternative is
declaring the process dead (its kill closes every connection anyway).

Never touched: sockets that existed before the baseline (the store client, the user's own connections opened
before), connections from or to ``keep_ports``, and connections opened during the attempt to anything that is not
a gloo listener (the user's new connections to other servers). **Limit:** a *listening* socket the process opens
during the attempt cannot be told from a gloo listener; connections accepted on it are shut down (open servers
before the attempt, or name their ports in ``keep_ports``). Linux only (``/proc/self/fd``).

Usage (the engine; ``store`` is the long-lived store, its port kept)::

    baseline = SocketBaseline.capture()                   # before init_process_group
    ...init_process_group, new_group, megatron's groups...
    # a per-generation store key (not in protocol.py yet), refreshed if groups are added later:
    store.set(f"gen/{g}/listen/{p}", format_endpoints(new_listeners(baseline)))
    # on a failure, from the monitor thread (a peer that never published: skip it, see above):
    peers = [parse_endpoints(store.get(f"gen/{g}/listen/{q}").decode()) for q in members if q != p]
    result = abort_gloo(baseline, keep_ports={store_port}, peer_listeners=set().union(*peers))
    abort_nccl(timeout_s=30.0)                            # GPU: torch's abort, or os._exit(EXIT_ABORT_HUNG)
    if training_thread_inside_the_training_function:
        interrupt_thread(main_tid, GenerationAborted)
    # once the training thread has unwound: clear_pending(main_tid), destroy the groups, hygiene.check(...)
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from neighbor_ckpt.inprocess.protocol import EXIT_ABORT_HUNG
from neighbor_ckpt.runtime.procs import flush_logs

__all__ = ["GenerationAborted", "Endpoint", "SocketBaseline", "GlooAbortResult", "new_listeners",
           "format_endpoints", "parse_endpoints", "abort_gloo", "call_with_watchdog", "abort_nccl",
           "interrupt_thread", "clear_pending"]

logger = logging.getLogger(__name__)

class GenerationAborted(BaseException):
    """Raised into the training thread when its generation was aborted. A ``BaseException`` so that the user's
    ``except Exception`` (a retry loop, a logging wrapper) does not swallow it; the engine catches it."""


@dataclass(frozen=True, order=True)
class Endpoint:
    """A TCP address. ``host`` is the textual IP as the kernel reports it (IPv4-mapped IPv6 addresses unmapped);
    an unspecified host (``0.0.0.0``, ``::``) matches any host."""

    host: str
    port: int

    @classmethod
    def of(cls, addr: Any) -> Endpoint:
        """From a ``getsockname()`` / ``getpeername()`` tuple."""
        host = str(addr[0])
        return cls(host.removeprefix("::ffff:"), int(addr[1]))

    def matches(self, other: Endpoint) -> bool:
        """Same port, and the same host unless either is unspecified."""
        wild = ("0.0.0.0", "::", "")
        return self.port == other.port and (self.host == other.host or self.host in wild or other.host in wild)


@dataclass(frozen=True)
class _Sock:
    """A TCP socket of this process: ``listening`` (a LISTEN socket), else connected when ``raddr`` is set."""

    fd: int
    inode: int
    listening: bool
    laddr: Endpoint | None
    raddr: Endpoint | None


def _inode(fd: int) -> int | None:
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None  # closed meanwhile
    if not link.startswith("socket:["):
        return None
    return int(link[len("socket:["):-1])


def _describe(fd: int, inode: int) -> _Sock | None:
    """The TCP socket behind ``fd``, asked through a duplicate of it (the owner's fd is untouched); None: not a TCP
    socket, or closed meanwhile."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if dup.type != socket.SOCK_STREAM or dup.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        listening = bool(dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        laddr = Endpoint.of(dup.getsockname())
        try:
            raddr: Endpoint | None = Endpoint.of(dup.getpeername())
        except OSError:
            raddr = None  # not connected (any more)
        return _Sock(fd, inode, listening, laddr, raddr)
    except OSError:
        return None
    finally:
        dup.close()


def _tcp_sockets(skip: frozenset[int] = frozenset()) -> list[_Sock]:
    """This process's TCP sockets but those whose inode is in ``skip``, each with the inode that identifies it for
    its life (fd numbers and ports are reused). Read from the process's own fds, never from ``/proc/net/tcp``
    (every socket of the machine: thousands on a busy node, parsed in Python while the training thread waits)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        inode = _inode(fd)
        if inode is None or inode in skip:
            continue
        sock = _describe(fd, inode)
        if sock is not None:
            out.append(sock)
    return out


@dataclass(frozen=True)
class SocketBaseline:
    """The sockets of this process before an attempt's process groups exist: none of them is ever shut down by
    :func:`abort_gloo`. Capture it at the start of each attempt, before ``init_process_group``."""

    inodes: frozenset[int]

    @classmethod
    def capture(cls) -> SocketBaseline:
        """Every socket of the process (TCP or not, whatever its state: a socket created but not yet connected
        stays the user's)."""
        inodes = set()
        for name in os.listdir("/proc/self/fd"):
            inode = _inode(int(name))
            if inode is not None:
                inodes.add(inode)
        return cls(frozenset(inodes))

    def new(self) -> list[_Sock]:
        """The TCP sockets opened since."""
        return _tcp_sockets(skip=self.inodes)


def new_listeners(baseline: SocketBaseline) -> frozenset[Endpoint]:
    """The LISTEN sockets opened since ``baseline``: this attempt's gloo listeners (one per gloo process group), to
    publish to the peers for their :func:`abort_gloo`."""
    return frozenset(s.laddr for s in baseline.new() if s.listening and s.laddr)


def format_endpoints(endpoints: Iterable[Endpoint]) -> str:
    """``"host:port,host:port"`` (sorted), the store value of a process's listeners; IPv6 hosts in brackets."""
    return ",".join(f"[{e.host}]:{e.port}" if ":" in e.host else f"{e.host}:{e.port}" for e in sorted(endpoints))


def parse_endpoints(text: str) -> frozenset[Endpoint]:
    """The inverse of :func:`format_endpoints`; raises ``ValueError`` on a malformed entry."""
    out = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"not host:port: {item!r}")
        out.add(Endpoint(host.removeprefix("[").removesuffix("]").removeprefix("::ffff:"), int(port)))
    return frozenset(out)


@dataclass(frozen=True)
class GlooAbortResult:
    """What :func:`abort_gloo` did: connections shut down on our accepted side and towards peers' listeners, and
    how long the scan and shutdowns took."""

    accepted: int
    to_peers: int
    seconds: float
    others: int = 0
    """With ``wide``: the other connections (and connects in progress) of the attempt shut down."""

    @property
    def closed(self) -> int:
        return self.accepted + self.to_peers + self.others


def _shutdown(fd: int) -> bool:
    """``shutdown(SHUT_RDWR)`` through a duplicate of ``fd``: the owner's fd stays open (gloo closes it when its
    group is destroyed), but a send/recv blocked on it fails now, here and, through the FIN, at the peer."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False  # closed meanwhile
    try:
        s.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False  # not connected any more
    finally:
        s.close()


def abort_gloo(baseline: SocketBaseline, *, keep_ports: Iterable[int] = (),
               peer_listeners: Iterable[Endpoint] = (), wide: bool = False) -> GlooAbortResult:
    """Shut down the connections of the process groups created since ``baseline`` (see the module docstring: our
    accepted side, and our side of connections to ``peer_listeners``), so that every collective blocked in this
    process raises within milliseconds, and its peers' too. ``wide``: every connection opened since ``baseline``
    and every connect in progress (the escalation). Connections from or to a port in ``keep_ports`` are kept. Safe
    from any thread; safe to repeat."""
    t0 = time.monotonic()
    keep = {int(p) for p in keep_ports}
    peers = tuple(peer_listeners)
    new = baseline.new()
    ours = [s.laddr for s in new if s.listening and s.laddr]
    accepted = to_peers = others = 0
    for s in new:
        if s.listening or s.laddr is None or s.laddr.port in keep:
            continue
        if s.raddr is None:  # not connected: a connect in progress (to a peer cut off: SYN_SENT), or never
            if wide:
                others += _shutdown(s.fd)
            continue
        if s.raddr.port in keep:
            continue
        if any(s.laddr.matches(lis) for lis in ours):
            accepted += _shutdown(s.fd)
        elif any(s.raddr.matches(lis) for lis in peers):
            to_peers += _shutdown(s.fd)
        elif wide:
            others += _shutdown(s.fd)
    result = GlooAbortResult(accepted, to_peers, time.monotonic() - t0, others)
    logger.info("gloo abort%s: shut down %d accepted and %d outgoing connection(s) of this attempt%s in %.1f ms",
                " (every connection of the attempt)" if wide else "", accepted, to_peers,
                f" and {others} other(s)" if wide else "", result.seconds * 1e3)
    return result


def call_with_watchdog(fn: Callable[[], Any], *, timeout_s: float, what: str,
                       exit_fn: Callable[[int], None] = os._exit) -> Any:
    """``fn()`` in the calling thread, watched: if it has not returned after ``timeout_s``, log one line, flush and
    end the process with :data:`EXIT_ABORT_HUNG` (a hung abort leaves a process nobody can clean; its launcher
    starts a new one). ``exit_fn`` is for tests. Returns what ``fn`` returns; its exception propagates."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, not {timeout_s}")
    done = threading.Event()

    def watch() -> None:
        if done.wait(timeout_s):
            return
        logger.critical("%s did not return within %.1f s: exiting with status %d (abort hung)", what, timeout_s,
                        EXIT_ABORT_HUNG)
        flush_logs()
        exit_fn(EXIT_ABORT_HUNG)

    watchdog = threading.Thread(target=watch, name="neighbor_ckpt-abort-watchdog", daemon=True)
    watchdog.start()
    try:
        return fn()
    finally:
        done.set()
        watchdog.join()


def _nccl_in_world() -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    from torch.distributed import distributed_c10d as c10d

    return any("nccl" in str(backend).lower() for backend, _store in c10d._world.pg_map.values())


def abort_nccl(*, timeout_s: float, exit_fn: Callable[[int], None] = os._exit) -> bool:
    """Abort every process group of the default world if any of them is NCCL (torch's ``_abort_process_group()``:
    all groups inside one ``ncclGroupStart/End``, which avoids the deadlock of aborting communicators one by one,
    pytorch#119797; it also empties torch's group registry, so ``destroy_process_group`` is not needed after it).
    Under :func:`call_with_watchdog`. Returns whether it aborted; no-op (False) without CUDA or NCCL groups."""
    import torch

    if not torch.cuda.is_available() or not _nccl_in_world():
        return False
    from torch.distributed import distributed_c10d as c10d

    t0 = time.monotonic()
    call_with_watchdog(c10d._abort_process_group, timeout_s=timeout_s, what="NCCL abort", exit_fn=exit_fn)
    logger.info("NCCL abort: every process group aborted in %.1f ms", (time.monotonic() - t0) * 1e3)
    return True


def _set_async_exc(thread_id: int, exc: Any) -> int:
    return int(ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc))


def interrupt_thread(thread_id: int, exc_type: type[BaseException] = GenerationAborted) -> bool:
    """Raise ``exc_type`` in thread ``thread_id`` (``threading.get_ident()`` of it) at its next Python bytecode. A
    thread blocked in a C call (a gloo collective, ``time.sleep``) gets it only when the call returns: free it first
    (:func:`abort_gloo`). Returns False if no such thread exists. Replaces an exception still pending there."""
    if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
        raise TypeError(f"exc_type must be an exception class, not {exc_type!r}")
    n = _set_async_exc(thread_id, ctypes.py_object(exc_type))
    if n > 1:  # cannot happen for a valid id; undo rather than hit several threads
        _set_async_exc(thread_id, None)
        raise SystemError(f"PyThreadState_SetAsyncExc hit {n} threads for id {thread_id}")
    return n == 1


def clear_pending(thread_id: int) -> None:
    """Withdraw an exception :func:`interrupt_thread` raised in ``thread_id`` that has not fired yet (the thread
    left the training function on its own before reaching a bytecode): it must not fire in the engine's code."""
    _set_async_exc(thread_id, None)
