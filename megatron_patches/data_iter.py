"""Patch: every micro-batch megatron-core's forward-backward function draws goes to the data-position check.

megatron-core trains a step by ``get_forward_backward_func()(forward_step_func=..., data_iterator=..., ...)``: the
schedule calls ``forward_step_func(data_iterator, model)`` once per micro-batch, and the forward step draws the
micro-batch with ``next(data_iterator)``. This wraps the three schedules of
``megatron.core.pipeline_parallel.schedules`` (``forward_backward_no_pipelining``, ``..._pipelining_without_
interleaving``, ``..._pipelining_with_interleaving``; ``get_forward_backward_func`` returns the module global, so a
call made after the patch gets the wrapped one) so that the ``data_iterator`` they are handed is an
:class:`ObservedMicroBatches`: each item ``next()`` returns goes to ``observe`` first (the checkpointer's
``observe_input``), on its way to the forward step. Every loop that trains through megatron-core's schedules is
covered without wiring: a hand-written loop with ``install_hooks``, NeMo 2 (``MegatronStep`` calls
``get_forward_backward_func()`` every step), Megatron-Bridge's ``train_step``.

Not observed: ``forward_only`` calls (validation, evaluation: not the training input), ``data_iterator=None``
(pipeline stages without data), an iterator that is already observed (``hooks.observe(...)``, which wraps it in an
:class:`ObservedMicroBatches` too, marked ``neighbor_ckpt_observed``: never counted twice).
A list of iterators (virtual pipeline chunks): the first one that is not None (the chunk that draws the input).

A function obtained from ``get_forward_backward_func()`` *before* the patch is the unwrapped schedule: build the
hooks first (``install_hooks`` before ``get_forward_backward_func()``), or wrap the iterator yourself
(``hooks.observe``).

Reversible: :meth:`DataIteratorHook.remove` (idempotent); the schedules are restored when the last hook is removed,
by identity (a wrapper somebody installed over ours is left alone, and ours then only passes through). Version
checked: megatron-core 0.15 and 0.19 (:func:`megatron_patches._versions.check_versions`), and each schedule must take a
keyword ``data_iterator``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import Any, Callable

from neighbor_ckpt.errors import UnsupportedVersionError

__all__ = ["SCHEDULES", "ObservedMicroBatches", "DataIteratorHook", "observe_forward_backward", "observe_iterator",
           "installed"]

logger = logging.getLogger(__name__)

SCHEDULES = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
             "forward_backward_pipelining_with_interleaving")
"""The forward-backward functions of ``megatron.core.pipeline_parallel.schedules`` that are wrapped."""

_MODULE = "megatron.core.pipeline_parallel.schedules"
_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_wrappers: dict[str, Callable[..., Any]] = {}
_observers: list[Callable[[Any], None]] = []


class ObservedMicroBatches:
    """Iterator over ``inner`` that hands every item to ``observe`` before returning it; other attributes are the
    inner object's. An iterator is used as it is (megatron-core 0.16's RerunDataIterator has ``__next__`` but no
    ``__iter__``); only an iterable that is not an iterator is iterated with ``iter()``."""

    neighbor_ckpt_observed = True
    """Marks an iterator whose items already reach the data check (not wrapped again)."""

    def __init__(self, inner: Any, observe: Callable[[Any], None]) -> None:
        self.inner = inner
        self._it = inner if hasattr(inner, "__next__") else iter(inner)
        self._observe = observe

    def __iter__(self) -> ObservedMicroBatches:
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        self._observe(item)
        return item

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "_it", "_observe"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def _observed(it: Any) -> bool:
    try:
        return bool(getattr(it, "neighbor_ckpt_observed", False))
    except Exception:  # noqa: BLE001 - an iterator whose __getattr__ raises something else
        return False


def observe_iterator(data_iterator: Any, observe: Callable[[Any], None]) -> Any:
    """``data_iterator`` with its items observed: None stays None, an observed iterator stays as it is, a list
    (virtual pipeline) gets its first non-None element wrapped."""
    if data_iterator is None or _observed(data_iterator):
        return data_iterator
    if isinstance(data_iterator, list):
        for i, it in enumerate(data_iterator):
            if it is not None:
                return [*data_iterator[:i], observe_iterator(it, observe), *data_iterator[i + 1:]]
        return data_iterator
    return ObservedMicroBatches(data_iterator, observe)


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward_backward(*args: Any, **kwargs: Any) -> Any:
        if _observers and not kwargs.get("forward_only", False) and kwargs.get("data_iterator") is not None:
            kwargs["data_iterator"] = observe_iterator(kwargs["data_iterator"], _observers[-1])
        return original(*args, **kwargs)

    forward_backward.__neighbor_ckpt_original__ = original  # type: ignore[attr-defined]
    return forward_backward


class DataIteratorHook:
    """Handle of one observer; :meth:`remove` is idempotent."""

    def __init__(self, observe: Callable[[Any], None]) -> None:
        self._observe = observe
        self._active = True

    def remove(self) -> None:
        with _lock:
            if not self._active:
                return
            self._active = False
            for i in range(len(_observers) - 1, -1, -1):
                if _observers[i] is self._observe:
                    del _observers[i]
                    break
            if not _observers:
                _restore()

    def __enter__(self) -> DataIteratorHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _restore() -> None:
    import sys

    schedules = sys.modules.get(_MODULE)
    if schedules is not None:
        for name, original in _originals.items():
            if getattr(schedules, name, None) is _wrappers.get(name):
                setattr(schedules, name, original)
            else:
                logger.debug("megatron_patches.data_iter: %s was wrapped again over ours; left in place", name)
    _originals.clear()
    _wrappers.clear()


def installed() -> bool:
    """Whether the schedules are wrapped now."""
    return bool(_wrappers)


def observe_forward_backward(observe: Callable[[Any], None]) -> DataIteratorHook:
    """Send every micro-batch of megatron-core's training forward-backward calls to ``observe`` until the returned
    hook is removed (the newest hook's observer is the one called).

    Raises:
        UnsupportedVersionError: megatron-core is not 0.15 or 0.19, or a schedule does not take ``data_iterator``.
    """
    from megatron_patches._versions import check_versions

    check_versions()
    import megatron.core.pipeline_parallel.schedules as schedules

    with _lock:
        if not _wrappers:
            found = {}
            for name in SCHEDULES:
                fn = getattr(schedules, name, None)
                if fn is None or "data_iterator" not in inspect.signature(fn).parameters:
                    raise UnsupportedVersionError(
                        f"megatron-core's {_MODULE}.{name} is missing or takes no data_iterator: this megatron-core "
                        "is not one megatron_patches.data_iter was written against (0.15, 0.19)")
                found[name] = fn
            for name, fn in found.items():
                _originals[name] = fn
                _wrappers[name] = _wrap(fn)
                setattr(schedules, name, _wrappers[name])
        _observers.append(observe)
    return DataIteratorHook(observe)
