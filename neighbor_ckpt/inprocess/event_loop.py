"""One thread for all the connections of a store gate, a tunnel or a door: a selector loop (:class:`Loop`), its
non-blocking accept (:class:`Acceptor`) and its non-blocking connect (:class:`Connect`).

A gate used to run a thread per handshake and two per admitted connection: 8,192 processes with 4-6 store
connections each meant 65-100 thousand threads in one store host. Here each gate, tunnel and door has one
:class:`Loop`: one thread waits on every socket it holds (``epoll`` through :mod:`selectors`), runs each ready
socket's handler, then the timers that are due (a handshake's deadline, a connect's), then what other threads posted
(:meth:`Loop.post`). Handlers never block: sockets are non-blocking, a handshake is a state machine
(:mod:`~neighbor_ckpt.inprocess.store_handshake`), splicing keeps a bounded buffer per direction
(:mod:`~neighbor_ckpt.inprocess.splice`). The only calls that wait are the kernel's answers about a peer's socket
(``NETLINK_SOCK_DIAG``, about 0.03 ms) and a look through this process's descriptors (a tunnel's, milliseconds), once
per accepted connection; a host name to resolve (a tunnel to a gate named by host name) goes to one resolver thread
of the loop, started on first use. So a loop runs one thread, two with names to resolve, however many connections
it serves.

Every socket a loop serves is *held* by it (:meth:`Loop.hold`, :meth:`Loop.close`): a loop whose listener was
closed (:meth:`Loop.linger`) keeps serving the connections it holds and ends its thread when it holds none.
"""

from __future__ import annotations

import errno
import heapq
import ipaddress
import itertools
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections import deque
from typing import Callable, Optional

__all__ = ["Loop", "Timer", "Acceptor", "Connect", "READ", "WRITE"]

logger = logging.getLogger(__name__)

READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
ACCEPTS_PER_WAKE = 256
"""Connections accepted per readiness of a listener before the loop serves the others' sockets again."""
OUT_OF_DESCRIPTORS_PAUSE_S = 0.1
"""A listener that cannot accept for want of descriptors waits this long (the connection stays in the kernel's
queue, not refused) instead of waking the loop at once again."""


class Timer:
    """A call at a time of :func:`time.monotonic`, on the loop's thread, unless :meth:`cancel` came first."""

    __slots__ = ("when", "fn", "cancelled")

    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class Loop:
    """A thread named ``name`` serving sockets through their handlers: :meth:`want` says which events a socket's
    handler (``handler(mask)``) is called for, on this thread; :meth:`at` runs a call at a time; :meth:`post` runs one
    from another thread. Everything but :meth:`post`, :meth:`call` and :meth:`linger` is for the loop's thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._sel = selectors.DefaultSelector()
        self._reg: dict[int, tuple[int, Callable[[int], None]]] = {}
        self._held: set[socket.socket] = set()
        self._timers: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._posted: deque[Callable[[], None]] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._sel.register(self._wake_r, READ, self._woken)
        self._lingering = False
        self._resolver: Optional[queue.SimpleQueue] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- from any thread ---------------------------------------------------------------------------------------

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's thread, soon."""
        self._posted.append(fn)
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # its buffer is full: the loop is awake already (or closed)

    def call(self, fn: Callable[[], None], timeout_s: float = 10.0) -> None:
        """Run ``fn`` on the loop's thread and return once it ran (at once when called there, or when the loop's
        thread is gone: a forked child's copy of the loop has none)."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            fn()
            return
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        self.post(run)
        done.wait(timeout_s)

    def linger(self) -> None:
        """End the loop's thread once it holds no socket (its listener closed: the connections it serves go on)."""
        def mark() -> None:
            self._lingering = True
        self.post(mark)

    def threads(self) -> int:
        """The threads this loop runs now (its own and, once a host name was resolved, its resolver)."""
        return int(self._thread.is_alive()) + int(self._resolver is not None)

    # -- on the loop's thread ----------------------------------------------------------------------------------

    def hold(self, sock: socket.socket) -> None:
        """``sock`` is served here from now on (non-blocking); :meth:`close` closes it."""
        sock.setblocking(False)
        self._held.add(sock)

    def held(self) -> int:
        return len(self._held)

    def want(self, sock: socket.socket, mask: int, handler: Optional[Callable[[int], None]] = None) -> None:
        """Call ``handler(events)`` when ``sock`` is ready for ``mask`` (:data:`READ`, :data:`WRITE`, both; 0:
        nothing)."""
        fd = sock.fileno()
        if fd < 0:
            return
        old = self._reg.get(fd)
        if not mask:
            if old is not None:
                del self._reg[fd]
                self._sel.unregister(fd)
            return
        if old is not None and old[0] == mask and old[1] is handler:
            return
        try:
            if old is None:
                self._sel.register(fd, mask, handler)
            else:
                self._sel.modify(fd, mask, handler)
        except (KeyError, OSError):  # a descriptor closed behind the loop's back and its number used again
            try:
                self._sel.unregister(fd)
            except KeyError:
                pass
            self._sel.register(fd, mask, handler)
        self._reg[fd] = (mask, handler)  # type: ignore[assignment]

    def close(self, sock: socket.socket) -> None:
        """Stop serving ``sock`` and close it."""
        self.want(sock, 0)
        self._held.discard(sock)
        sock.close()

    def at(self, when: float, fn: Callable[[], None]) -> Timer:
        timer = Timer(when, fn)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        return timer

    def resolve(self, host: str, port: int, then: Callable[[list, Optional[OSError]], None]) -> None:
        """``then(addresses, error)`` on the loop's thread with ``getaddrinfo``'s TCP addresses of ``host`` (an IP
        address at once; a name on the loop's resolver thread: a slow name server holds no connection up)."""
        try:
            ip = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            pass
        else:
            family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            then([(family, (host, port))], None)
            return
        if self._resolver is None:
            self._resolver = queue.SimpleQueue()
            threading.Thread(target=self._resolve_names, args=(self._resolver,), name=f"{self.name}-resolver",
                             daemon=True).start()
        self._resolver.put((host, port, then))

    def _resolve_names(self, jobs: queue.SimpleQueue) -> None:
        while True:
            host, port, then = jobs.get()
            try:
                found = [(family, sockaddr[:2]) for family, _, _, _, sockaddr in
                         socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
                self.post(lambda found=found, then=then: then(found, None))
            except OSError as e:
                self.post(lambda e=e, then=then: then([], e))

    def _woken(self, mask: int) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _run(self) -> None:
        sel, timers, posted = self._sel, self._timers, self._posted
        while True:
            timeout: Optional[float] = None
            if posted:
                timeout = 0.0
            elif timers:
                timeout = max(0.0, timers[0][0] - time.monotonic())
            for key, mask in sel.select(timeout):
                try:
                    key.data(mask)
                except Exception:  # noqa: BLE001 - one connection's bug must not end the others' loop
                    logger.exception("%s: a connection's handler failed", self.name)
            now = time.monotonic()
            while timers and timers[0][0] <= now:
                timer = heapq.heappop(timers)[2]
                if not timer.cancelled:
                    self._safely(timer.fn)
            while posted:
                self._safely(posted.popleft())
            if self._lingering and not self._held:
                break
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _safely(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001
            logger.exception("%s: a timer or posted call failed", self.name)


class Acceptor:
    """Accepts on ``sock`` (bound and listening; made non-blocking) on ``loop``: ``accepted(conn, peer)`` for each
    connection (non-blocking, ``TCP_NODELAY``; not held by the loop yet). Out of descriptors, it waits
    :data:`OUT_OF_DESCRIPTORS_PAUSE_S` and accepts again (the connection waits in the kernel's queue), saying so at
    most once a minute. :meth:`close` stops accepting (on the loop's thread) and closes ``sock``; ``shutdown`` first
    when the socket is this process's alone (a listener a launcher shares is only closed: shutting it down would
    stop it for the launcher too)."""

    def __init__(self, loop: Loop, sock: socket.socket, accepted: Callable[[socket.socket, tuple], None],
                 what: str) -> None:
        self.loop, self.sock, self._accepted, self.what = loop, sock, accepted, what
        self._closed = False
        self._said_at = float("-inf")
        sock.setblocking(False)
        loop.post(lambda: self.loop.want(self.sock, READ, self._ready))

    def _ready(self, mask: int) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            if self._closed:
                return
            try:
                conn, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause(e)
                    return
                if e.errno in (errno.EBADF, errno.EINVAL):
                    return  # closed under us
                continue  # ECONNABORTED and the like: that connection is gone, the next one may not be
            conn.setblocking(False)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            self._accepted(conn, peer)

    def _pause(self, e: OSError) -> None:
        now = time.monotonic()
        if now - self._said_at >= 60.0:
            self._said_at = now
            logger.warning("%s: cannot accept (%s): the connections wait in the kernel's queue; accepting again "
                           "every %.1f s (said at most once a minute)", self.what, e.strerror or e,
                           OUT_OF_DESCRIPTORS_PAUSE_S)
        self.loop.want(self.sock, 0)
        self.loop.at(now + OUT_OF_DESCRIPTORS_PAUSE_S,
                     lambda: None if self._closed else self.loop.want(self.sock, READ, self._ready))

    def close(self, *, shutdown: bool) -> None:
        if shutdown:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # stops listening now, whatever the loop is doing
            except OSError:
                pass

        def stop() -> None:
            self._closed = True
            self.loop.want(self.sock, 0)
            self.sock.close()

        self.loop.call(stop)
        self.loop.linger()


class Connect:
    """A non-blocking connect on ``loop`` to ``address`` (``(host, port)``; a name is resolved first, each address
    tried in turn, each for ``timeout_s``), signed with ``key`` (TCP-MD5,
    :func:`~neighbor_ckpt.inprocess.loopback.sign`) when given: ``done(sock, None)`` with the connected socket
    (non-blocking, ``TCP_NODELAY``, held by the loop), or ``done(None, error)``."""

    def __init__(self, loop: Loop, address: tuple[str, int], timeout_s: float,
                 done: Callable[[Optional[socket.socket], Optional[OSError]], None],
                 key: Optional[bytes] = None) -> None:
        self.loop, self.timeout_s, self._done, self._key = loop, timeout_s, done, key
        self._sock: Optional[socket.socket] = None
        self._timer: Optional[Timer] = None
        self._left: list = []
        self._error: Optional[OSError] = None
        loop.resolve(str(address[0]), int(address[1]), self._resolved)

    def _resolved(self, addresses: list, error: Optional[OSError]) -> None:
        if error is not None or not addresses:
            self._done(None, error or OSError(errno.EHOSTUNREACH, "getaddrinfo returns an empty list"))
            return
        self._left = list(addresses)
        self._next()

    def _next(self) -> None:
        if not self._left:
            self._done(None, self._error)
            return
        family, sockaddr = self._left.pop(0)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if self._key is not None:
                from neighbor_ckpt.inprocess import loopback

                loopback.sign(sock, self._key)
            sock.setblocking(False)
            err = sock.connect_ex(sockaddr)
        except OSError as e:
            sock.close()
            self._error = e
            self._next()
            return
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            sock.close()
            self._error = OSError(err, os.strerror(err))
            self._next()
            return
        self._sock = sock
        self.loop.hold(sock)
        self._timer = self.loop.at(time.monotonic() + self.timeout_s, self._expired)
        self.loop.want(sock, WRITE, self._writable)

    def _writable(self, mask: int) -> None:
        sock = self._sock
        if sock is None:
            return
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err == 0:
            self._finish()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.loop.want(sock, 0)
            self._done(sock, None)
            return
        self._fail(OSError(err, os.strerror(err)))

    def _expired(self) -> None:
        if self._sock is not None:
            self._fail(TimeoutError("timed out"))

    def _fail(self, error: OSError) -> None:
        sock = self._sock
        self._finish()
        if sock is not None:
            self.loop.close(sock)
        self._error = error
        self._next()

    def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._sock = None
