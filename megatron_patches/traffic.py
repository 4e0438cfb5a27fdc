"""Patch: tell neighbor_ckpt when mcore DDP's training collectives are in flight (FFTrainer §5.3).

Wraps four methods of ``megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup``:
``start_grad_sync`` / ``finish_grad_sync`` (gradient all-reduce or reduce-scatter) and
``start_param_sync`` / ``finish_param_sync`` (the distributed optimizer's param all-gather). While any
of them is in flight (synchronous call, or async handle not yet waited for) every listener's gate is
closed, so snapshot streaming pauses and TRAIN traffic has the network to itself.

Before the *first* gradient collective of an iteration (nothing else in flight), listeners' wait point
runs: no rank can get through step i+1's gradient collectives before every rank of its DP group has
committed and replicated its snapshot of step i. That keeps ranks at most one version apart.

Reversible: :meth:`TrafficHooks.remove` drops the listener, and the class methods are restored when the
last listener is gone.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Protocol

logger = logging.getLogger(__name__)

__all__ = ["TrafficListener", "TrafficHooks", "mark_training_traffic"]


class TrafficListener(Protocol):
    def train_begin(self) -> None: ...

    def train_end(self) -> None: ...


_METHODS = ("start_grad_sync", "finish_grad_sync", "start_param_sync", "finish_param_sync")
_lock = threading.Lock()
_listeners: list[tuple[TrafficListener, Callable[[], None] | None]] = []
_originals: dict[str, Callable[..., Any]] = {}
_in_flight: set[tuple[int, str]] = set()


def _bucket_group_cls() -> type:
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    return _ParamAndGradBucketGroup


def _begin(key: tuple[int, str]) -> None:
    if key not in _in_flight:
        _in_flight.add(key)
        for gate, _ in list(_listeners):
            gate.train_begin()


def _end(key: tuple[int, str]) -> None:
    if key in _in_flight:
        _in_flight.discard(key)
        for gate, _ in list(_listeners):
            gate.train_end()


def _start_grad_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
    if not _in_flight:
        for _, before in list(_listeners):
            if before is not None:
                before()
    key = (id(self), "grad")
    _begin(key)
    try:
        return _originals["start_grad_sync"](self, *args, **kwargs)
    finally:
        if getattr(self, "grad_reduce_handle", None) is None:
            _end(key)


def _finish_grad_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return _originals["finish_grad_sync"](self, *args, **kwargs)
    finally:
        if getattr(self, "grad_reduce_handle", None) is None:
            _end((id(self), "grad"))


def _start_param_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
    key = (id(self), "param")
    _begin(key)
    try:
        return _originals["start_param_sync"](self, *args, **kwargs)
    finally:
        if getattr(self, "param_gather_handle", None) is None:
            _end(key)


def _finish_param_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return _originals["finish_param_sync"](self, *args, **kwargs)
    finally:
        if getattr(self, "param_gather_handle", None) is None:
            _end((id(self), "param"))


_WRAPPERS = {"start_grad_sync": _start_grad_sync, "finish_grad_sync": _finish_grad_sync,
             "start_param_sync": _start_param_sync, "finish_param_sync": _finish_param_sync}


class TrafficHooks:
    """Handle of one listener; :meth:`remove` is idempotent."""

    def __init__(self, entry: tuple[TrafficListener, Callable[[], None] | None]) -> None:
        self._entry = entry

    def remove(self) -> None:
        with _lock:
            if self._entry not in _listeners:
                return
            _listeners.remove(self._entry)
            if not _listeners:
                cls = _bucket_group_cls()
                for name, fn in _originals.items():
                    setattr(cls, name, fn)
                _originals.clear()
                _in_flight.clear()
                logger.debug("training-traffic hooks removed")

    def __enter__(self) -> TrafficHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def mark_training_traffic(gate: TrafficListener, before_grad_sync: Callable[[], None] | None = None) -> TrafficHooks:
    """Close ``gate`` while mcore DDP collectives are in flight; call ``before_grad_sync`` (the wait point)
    before the first gradient collective of every iteration."""
    from megatron_patches._versions import check_versions

    check_versions()
    entry = (gate, before_grad_sync)
    with _lock:
        if not _listeners:
            cls = _bucket_group_cls()
            for name in _METHODS:
                _originals[name] = cls.__dict__[name]
                setattr(cls, name, _WRAPPERS[name])
            logger.debug("training-traffic hooks installed on %s", cls.__qualname__)
        _listeners.append(entry)
    return TrafficHooks(entry)
