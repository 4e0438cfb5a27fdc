"""Splicing two connections on an event loop (:class:`Splice`): what a gate does between an admitted client and its
store, a tunnel between torch's client and a gate, a door between torch's own client and its sealed store.

Each direction has one buffer of at most :data:`BUFFER_BYTES`: bytes read from one side are sent to the other at
once, and only what the other side's socket does not take waits in the buffer. While a direction's buffer is full its
source is not read (back-pressure: the kernel's buffers fill, and then the sender's ``send`` waits), so a connection
holds at most ``2 * BUFFER_BYTES`` of this process's memory, and an idle one next to none. An end (EOF) read on one
side is passed on once that direction's buffer is sent: ``shutdown(SHUT_WR)`` of the other side (a half-close;
the other direction goes on until it ends too); both ends passed on, or an error on either side (a reset, a broken
pipe), close both sockets: the peer still there sees the end, as it would see a store that went away.
"""

from __future__ import annotations

import socket
from typing import Callable, Optional

from neighbor_ckpt.inprocess.event_loop import READ, WRITE, Loop

__all__ = ["Splice", "BUFFER_BYTES"]

BUFFER_BYTES = 1 << 16
"""At most this many bytes wait per direction of a spliced connection (the rest waits in the kernel's buffers)."""


class Splice:
    """Copies both ways between ``a`` and ``b`` (connected, held by ``loop``) on ``loop``'s thread; ``on_close()``
    once both are closed. Create it on the loop's thread."""

    __slots__ = ("loop", "socks", "bufs", "eof", "shut", "closed", "cap", "_handlers", "_masks", "_on_close")

    def __init__(self, loop: Loop, a: socket.socket, b: socket.socket, *, cap: int = BUFFER_BYTES,
                 on_close: Optional[Callable[[], None]] = None) -> None:
        self.loop, self.socks, self.cap, self._on_close = loop, (a, b), cap, on_close
        for s in self.socks:
            loop.hold(s)
        self.bufs = (bytearray(), bytearray())  # bufs[i]: read from socks[i], for socks[1 - i]
        self.eof = [False, False]  # socks[i] said it sends no more
        self.shut = [False, False]  # socks[i] was told no more comes (SHUT_WR)
        self.closed = False
        self._handlers = (self._ready_a, self._ready_b)
        self._masks = [-1, -1]  # what each socket is registered for (-1: not known yet)
        self._update()

    def buffered(self) -> int:
        """Bytes waiting in this splice's buffers now."""
        return len(self.bufs[0]) + len(self.bufs[1])

    def _ready_a(self, mask: int) -> None:
        self._ready(0, mask)

    def _ready_b(self, mask: int) -> None:
        self._ready(1, mask)

    def _ready(self, i: int, mask: int) -> None:
        if self.closed:
            return
        try:
            if mask & WRITE and self.bufs[1 - i]:
                self._flush(1 - i)
            if mask & READ and not self.eof[i] and len(self.bufs[i]) < self.cap:
                self._pump(i)
        except OSError:
            self.close()
            return
        if not self.closed:
            self._update()

    def _pump(self, i: int) -> None:
        """Read what ``socks[i]`` has (as much as its buffer has room for) and send it on."""
        buf = self.bufs[i]
        try:
            data = self.socks[i].recv(self.cap - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self.eof[i] = True
            self._pass_end(i)
            return
        if buf:
            buf += data  # behind what waits already
            return
        try:
            sent = self.socks[1 - i].send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):
            buf += memoryview(data)[sent:]

    def _flush(self, i: int) -> None:
        """Send what waits in ``bufs[i]`` to ``socks[1 - i]``."""
        buf = self.bufs[i]
        try:
            sent = self.socks[1 - i].send(buf)
        except (BlockingIOError, InterruptedError):
            return
        del buf[:sent]
        if not buf and self.eof[i]:
            self._pass_end(i)

    def _pass_end(self, i: int) -> None:
        """``socks[i]`` ended: once its buffer is sent, tell ``socks[1 - i]``; both ends passed on: close."""
        j = 1 - i
        if self.bufs[i] or self.shut[j]:
            return
        self.socks[j].shutdown(socket.SHUT_WR)
        self.shut[j] = True
        if self.shut[i]:
            self.close()

    def _update(self) -> None:
        """Register each socket for what it waits for now (only where that changed: the common case, a message
        read and sent on whole, changes nothing)."""
        for i in (0, 1):
            mask = (READ if not self.eof[i] and len(self.bufs[i]) < self.cap else 0) | (WRITE if self.bufs[1 - i]
                                                                                      else 0)
            if mask != self._masks[i]:
                self.loop.want(self.socks[i], mask, self._handlers[i])
                self._masks[i] = mask

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for s in self.socks:
            self.loop.close(s)
        self.bufs[0].clear()
        self.bufs[1].clear()
        if self._on_close is not None:
            self._on_close()
