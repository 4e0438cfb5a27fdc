"""Loading a distributed-optimizer checkpoint into an fp32 model (mcore 0.15): run the state copy under ``no_grad``.

With fp32 parameters (no bf16/fp16 main-param copies), ``DistributedOptimizer``'s main params are views of the
model's leaf parameters. ``DistributedOptimizer._set_main_param_and_optimizer_states``
(``megatron/core/optimizer/distrib_optimizer.py``, the ``dst_tensors[key].copy_(...)`` of every ``load_state_dict``
from a ``dp_reshardable`` checkpoint) copies into them with autograd on and fails with "a view of a leaf Variable
that requires grad is being used in an in-place operation". This is what NeMo's own disk resume runs, so without
the patch an fp32 NeMo job cannot fall back to its insurance checkpoint. Loading optimizer state never needs
autograd: the patch runs the original method under ``torch.no_grad()``.

:func:`fix_fp32_distopt_load` applies it once per process (idempotent, version-checked) and returns a handle whose
``remove()`` restores the original method.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from megatron_patches._versions import check_versions

logger = logging.getLogger(__name__)

__all__ = ["fix_fp32_distopt_load", "DistOptLoadPatch", "without_autograd"]

_NAME = "_set_main_param_and_optimizer_states"
_ACTIVE: DistOptLoadPatch | None = None


@dataclass
class DistOptLoadPatch:
    owner: Any
    original: Any

    def remove(self) -> None:
        global _ACTIVE
        setattr(self.owner, _NAME, self.original)
        _ACTIVE = None


def without_autograd(fn: Any) -> Any:
    """``fn`` run under ``torch.no_grad()`` (``__wrapped__`` is ``fn``)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


def fix_fp32_distopt_load() -> DistOptLoadPatch:
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    check_versions()
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__.get(_NAME)
    if original is None:
        raise RuntimeError(f"megatron_patches.distopt_load: DistributedOptimizer.{_NAME} does not exist; the installed "
                           f"megatron-core is not one this patch was written for")

    setattr(DistributedOptimizer, _NAME, without_autograd(original))
    _ACTIVE = DistOptLoadPatch(DistributedOptimizer, original)
    logger.debug("megatron_patches.distopt_load: DistributedOptimizer.%s runs under no_grad", _NAME)
    return _ACTIVE
