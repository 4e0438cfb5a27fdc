"""Patch: optimizer step-phase tags (FlashRecovery's step tags) on one megatron-core optimizer.

Recovery and lazy backup must know whether a rank's weights belong to iteration i or i+1, and never take
weights from the middle of an optimizer step. This wraps ``step`` of one optimizer *instance* (the object
the training loop or NeMo calls, e.g. a ``DistributedOptimizer`` or ``ChainedOptimizer``): ``on_enter``
runs before it (neighbor_ckpt's wait point, then the tag "inside the step of i+1"), ``on_exit`` after it
returns (tag "weights belong to i+1"). If ``step`` raises, the tag stays "inside", which is what it is.

Reversible: :meth:`StepTags.remove` deletes the instance attribute, so the class method shows through again.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

__all__ = ["StepTags", "tag_optimizer_steps"]


class StepTags:
    """Handle of the wrapped ``step``; :meth:`remove` is idempotent."""

    def __init__(self, optimizer: Any, had_instance_attr: bool, previous: Any) -> None:
        self._optimizer = optimizer
        self._had = had_instance_attr
        self._previous = previous
        self._active = True

    def remove(self) -> None:
        if not self._active:
            return
        self._active = False
        if self._had:
            self._optimizer.step = self._previous
        else:
            del self._optimizer.step

    def __enter__(self) -> StepTags:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def tag_optimizer_steps(optimizer: Any, *, on_enter: Callable[[], None], on_exit: Callable[[], None]) -> StepTags:
    """Run ``on_enter`` / ``on_exit`` around every ``optimizer.step()`` call."""
    had = "step" in vars(optimizer)
    previous = vars(optimizer).get("step")
    inner = optimizer.step

    @functools.wraps(inner)
    def step(*args: Any, **kwargs: Any) -> Any:
        on_enter()
        out = inner(*args, **kwargs)
        on_exit()
        return out

    optimizer.step = step
    return StepTags(optimizer, had, previous)
