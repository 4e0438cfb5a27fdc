"""The store handshake, mutual, written once as steps (:func:`gate_steps`, :func:`client_steps`) and run two ways:
blocking on a socket with a deadline (:func:`run_blocking`: :func:`~neighbor_ckpt.inprocess.store_auth.challenge`,
:func:`~neighbor_ckpt.inprocess.store_auth.prove`), or as a state machine on an event loop (:class:`Exchange`: a
gate's, a tunnel's), so both speak the same bytes.

The gate sends :data:`MAGIC` and 16 fresh random bytes; the client answers with their HMAC-SHA256 under the token
and 16 fresh bytes of its own; the gate answers with the HMAC of both under the token (another label: neither
answer can be replayed as the other). Each side reads exactly what the step expects, never more: what the client
sends after its answer (torch's first request) stays in the socket for the splice.

A step is ``(SEND, bytes)`` or ``(RECV, n)`` (the ``n`` bytes are sent into the steps); the steps' return value is
the handshake's result; what goes wrong in the socket (the connection ended: :class:`ConnectionError`; the deadline
passed: :class:`TimeoutError`) is thrown into them, where the client's steps turn a gate that closed before its
proof into :class:`Refused`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import time
from typing import Any, Callable, Generator, Optional

from neighbor_ckpt.inprocess.event_loop import READ, WRITE, Loop

__all__ = ["MAGIC", "NONCE_BYTES", "Refused", "gate_steps", "client_steps", "run_blocking", "Exchange"]

MAGIC = b"NCKPT-STORE-2\n"
"""What a gate says first (a client that reaches something else stops at once; ``-1``: the one-way handshake of
earlier releases)."""
NONCE_BYTES = 16
SEND, RECV = "send", "recv"
_CLIENT, _GATE = b"client\n", b"gate\n"
_DIGEST = hashlib.sha256().digest_size
HELLO_BYTES = len(MAGIC) + NONCE_BYTES
ANSWER_BYTES = _DIGEST + NONCE_BYTES

Steps = Generator[tuple, Any, Any]


class Refused(ConnectionError):
    """The gate refused this client (wrong or missing token), or what answered is not a gate of this job."""


def _answer(token: bytes, label: bytes, *nonces: bytes) -> bytes:
    return hmac.new(token, label + MAGIC + b"".join(nonces), hashlib.sha256).digest()


def gate_steps(token: bytes) -> Steps:
    """The gate's side: True when the client proved the token (it is then given the gate's proof), False (nothing
    sent) when it did not."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    yield SEND, MAGIC + nonce
    got = yield RECV, ANSWER_BYTES
    if not hmac.compare_digest(got[:_DIGEST], _answer(token, _CLIENT, nonce)):
        return False
    yield SEND, _answer(token, _GATE, nonce, got[_DIGEST:])
    return True


def client_steps(token: bytes) -> Steps:
    """The client's side: :class:`Refused` when the gate refuses (it closes the connection), is not a gate, or cannot
    prove that it holds the token too."""
    hello = yield RECV, HELLO_BYTES
    if not hello.startswith(MAGIC):
        raise Refused("what answered is not a neighbor_ckpt store gate (or one of another release)")
    nonce, mine = hello[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
    yield SEND, _answer(token, _CLIENT, nonce) + mine
    try:
        proof = yield RECV, _DIGEST
    except ConnectionError:
        raise Refused("the store gate refused this process's token (another job's, or an old token file)") from None
    if not hmac.compare_digest(proof, _answer(token, _GATE, nonce, mine)):
        raise Refused("what answered as a store gate does not hold this job's token (another job's gate, or "
                      "whatever took the address of a store that went away)")
    return None


def _late(done: int, n: int) -> TimeoutError:
    return TimeoutError(f"the handshake's deadline passed ({done} of {n} bytes got)")


def _closed(done: int, n: int) -> ConnectionError:
    return ConnectionError(f"the connection closed after {done} of {n} bytes")


# -- blocking ----------------------------------------------------------------------------------------------------

def _until(sock: socket.socket, deadline: Optional[float], done: int, n: int) -> None:
    """Give ``sock``'s next call what is left until ``deadline`` (``time.monotonic``; None: leave its timeout as it
    is); ``TimeoutError`` when nothing is left."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise _late(done, n)
    sock.settimeout(left)


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float]) -> bytes:
    out = b""
    while len(out) < n:
        _until(sock, deadline, len(out), n)
        try:
            part = sock.recv(n - len(out))
        except TimeoutError:
            if deadline is None:
                raise
            raise _late(len(out), n) from None
        if not part:
            raise _closed(len(out), n)
        out += part
    return out


def run_blocking(steps: Steps, sock: socket.socket, deadline: Optional[float]) -> Any:
    """Run ``steps`` on ``sock`` (blocking; with ``deadline``, ``time.monotonic``: all of them by then, however the
    bytes come); their result, or what they raise."""
    advance: Callable[[], tuple] = lambda: next(steps)  # noqa: E731
    while True:
        try:
            op, arg = advance()
        except StopIteration as stop:
            return stop.value
        try:
            if op == SEND:
                _until(sock, deadline, 0, 0)
                sock.sendall(arg)
                got = None
            else:
                got = _recv_exact(sock, arg, deadline)
        except OSError as e:
            advance = lambda e=e: steps.throw(e)  # noqa: E731
            continue
        advance = lambda got=got: steps.send(got)  # noqa: E731


# -- on an event loop --------------------------------------------------------------------------------------------

class Exchange:
    """Runs ``steps`` on ``sock`` (non-blocking, held by ``loop``) on ``loop``'s thread, all of them by ``deadline``
    (``time.monotonic``): ``done(result, None)``, or ``done(None, error)`` with what they raised (:class:`Refused`,
    :class:`ConnectionError`, :class:`TimeoutError`, another :class:`OSError`). ``sock`` is left registered for
    nothing. Memory: what one step sends or expects (a few dozen bytes)."""

    __slots__ = ("loop", "sock", "steps", "_done", "_timer", "_out", "_need", "_got", "_over")

    def __init__(self, loop: Loop, sock: socket.socket, steps: Steps, deadline: float,
                 done: Callable[[Any, Optional[BaseException]], None]) -> None:
        self.loop, self.sock, self.steps, self._done = loop, sock, steps, done
        self._out: Optional[memoryview] = None
        self._need, self._got, self._over = 0, bytearray(), False
        self._timer = loop.at(deadline, self._expired)
        self._advance(lambda: next(steps))

    def _advance(self, step: Callable[[], tuple]) -> None:
        while not self._over:
            try:
                op, arg = step()
            except StopIteration as stop:
                self._end(stop.value, None)
                return
            except Exception as e:  # noqa: BLE001 - what the steps raise is the handshake's outcome
                self._end(None, e)
                return
            if op == RECV:
                self._out, self._need, self._got = None, arg, bytearray()
                self.loop.want(self.sock, READ, self._ready)
                return
            self._out = memoryview(arg)
            try:
                self._send()
            except OSError as e:
                step = lambda e=e: self.steps.throw(e)  # noqa: E731
                continue
            if self._out is not None:
                self.loop.want(self.sock, WRITE, self._ready)
                return
            step = lambda: self.steps.send(None)  # noqa: E731

    def _send(self) -> None:
        """Send what is left of the step's bytes; ``_out`` None once all went."""
        assert self._out is not None
        try:
            sent = self.sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        self._out = self._out[sent:] if sent < len(self._out) else None

    def _ready(self, mask: int) -> None:
        if self._over:
            return
        if self._out is not None:
            try:
                self._send()
            except OSError as e:
                self._advance(lambda: self.steps.throw(e))
                return
            if self._out is None:
                self._advance(lambda: self.steps.send(None))
            return
        try:
            part = self.sock.recv(self._need - len(self._got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._advance(lambda: self.steps.throw(e))
            return
        if not part:
            error = _closed(len(self._got), self._need)
            self._advance(lambda: self.steps.throw(error))
            return
        self._got += part
        if len(self._got) == self._need:
            got = bytes(self._got)
            self._advance(lambda: self.steps.send(got))

    def _expired(self) -> None:
        if self._over:
            return
        error = _late(len(self._got), self._need) if self._out is None else _late(0, 0)
        self._advance(lambda: self.steps.throw(error))

    def _end(self, result: Any, error: Optional[BaseException]) -> None:
        self._over = True
        self._timer.cancel()
        self.steps.close()
        self.loop.want(self.sock, 0)
        self._done(result, error)
