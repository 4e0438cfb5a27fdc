"""What a client of the control plane sends to a store and gets back: operations, keys and payload bytes.

Generic (no binding to a control plane's internals): :func:`counting` wraps any ``op(method, *args)`` callable of a
store client, :func:`measure` says what one operation of torch's store API weighs. A *key* is one key named by an
operation (``check`` and ``multi_get`` of 511 keys count 511 each; ``compare_set`` counts one, read and written);
*bytes* are the payload both ways (key names with their prefix, values written, values returned; a ``check`` answers
one byte), not the wire's framing. An operation that raises is not counted (it did not complete).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Tally", "Counter", "measure", "counting"]

_LIST_METHODS = ("check", "multi_get", "wait")


@dataclass
class Tally:
    """Operations, keys and payload bytes (a sum, or the difference of two sums)."""

    ops: int = 0
    keys: int = 0
    bytes: int = 0

    def plus(self, other: "Tally") -> "Tally":
        return Tally(self.ops + other.ops, self.keys + other.keys, self.bytes + other.bytes)

    def minus(self, other: "Tally") -> "Tally":
        return Tally(self.ops - other.ops, self.keys - other.keys, self.bytes - other.bytes)

    def as_dict(self) -> dict[str, int]:
        return {"ops": self.ops, "keys": self.keys, "bytes": self.bytes}


def _size(value: Any) -> int:
    """Payload bytes of an argument or a result (text as UTF-8; a bool one byte, an int eight)."""
    if value is None:
        return 0
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bool):
        return 1
    if isinstance(value, int):
        return 8
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 0  # a timedelta (wait's timeout), an object the wire does not carry as payload


def measure(method: str, args: tuple[Any, ...], result: Any) -> tuple[int, int]:
    """(keys, payload bytes) of one completed store operation ``method(*args) -> result``."""
    if method in _LIST_METHODS:
        keys = list(args[0]) if args else []
        answer = _size(result) if method == "multi_get" else 1
        return len(keys), _size(keys) + answer
    if method == "multi_set":
        return len(args[0]), _size(args[0]) + _size(args[1])
    return 1, _size(args) + _size(result)


@dataclass
class Counter:
    """A thread-safe running :class:`Tally`, also by method."""

    total: Tally = field(default_factory=Tally)
    by_method: dict[str, Tally] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, method: str, keys: int, nbytes: int) -> None:
        one = Tally(1, keys, nbytes)
        with self._lock:
            self.total = self.total.plus(one)
            self.by_method[method] = self.by_method.get(method, Tally()).plus(one)

    def snapshot(self) -> Tally:
        with self._lock:
            return Tally(self.total.ops, self.total.keys, self.total.bytes)

    def methods(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {m: t.as_dict() for m, t in sorted(self.by_method.items())}

    def reset(self) -> None:
        with self._lock:
            self.total, self.by_method = Tally(), {}


def counting(op: Callable[..., Any], counter: Counter) -> Callable[..., Any]:
    """``op(method, *args)`` that records each completed operation in ``counter``."""
    def counted(method: str, *args: Any) -> Any:
        result = op(method, *args)
        keys, nbytes = measure(method, args, result)
        counter.record(method, keys, nbytes)
        return result

    return counted
