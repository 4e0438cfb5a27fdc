"""apex ``FusedAdam``'s semantics for megatron-core's Adam on a GPU machine without Transformer Engine or apex.

Without either, megatron-core 0.15 falls back to ``torch.optim.AdamW``, whose per-parameter ``'step'`` tensor breaks
the distributed optimizer's checkpoint code (``sharded_state_dict`` with ``dp_reshardable`` asserts on it), so
megatron-core's own ``dist_checkpointing`` and NVRx cannot save. This patch points megatron-core at
:class:`megatron_patches.cpu.FusedAdamSemanticsAdam` (FusedAdam's state layout and update, in unfused torch ops)
through exactly the five module attributes :func:`megatron_patches.enable_cpu` sets for the optimizer, and nothing
else. It is for benchmarks and tests on bare GPU images; with TE or apex installed it does nothing.

Call :func:`use_fused_adam_semantics` before ``get_megatron_optimizer``; undo with :meth:`FusedAdamPatch.restore`.
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_patches._versions import check_versions
from megatron_patches.cpu import _MCORE_DISTOPT, _MCORE_OPT, PATCHED_ATTRIBUTES

__all__ = ["FusedAdamPatch", "OPTIMIZER_ATTRIBUTES", "use_fused_adam_semantics"]

OPTIMIZER_ATTRIBUTES = tuple(a for a in PATCHED_ATTRIBUTES if a.module in (_MCORE_OPT, _MCORE_DISTOPT))
"""The optimizer part of the CPU patch: ``megatron.core.optimizer.{Adam, USING_PYTORCH_OPTIMIZER}`` and
``megatron.core.optimizer.distrib_optimizer.{Adam, HAVE_APEX_OR_TE, USING_APEX_OPTIMIZER}``."""


class FusedAdamPatch:
    """The applied patch; :meth:`restore` puts every original back (identity-exact)."""

    def __init__(self, saved: list[tuple[Any, str, Any]]) -> None:
        self._saved = saved

    def replaced(self) -> list[tuple[str, str]]:
        return [(m.__name__, n) for m, n, _ in self._saved]

    def restore(self) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved = []


def use_fused_adam_semantics() -> FusedAdamPatch | None:
    """Apply the patch if megatron-core fell back to torch's Adam; None when TE or apex provides FusedAdam."""
    check_versions()
    mcore_optimizer = importlib.import_module(_MCORE_OPT)
    if not getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False):
        return None
    saved: list[tuple[Any, str, Any]] = []
    for attr in OPTIMIZER_ATTRIBUTES:
        module = importlib.import_module(attr.module)
        if attr.name not in module.__dict__:
            FusedAdamPatch(saved).restore()
            raise RuntimeError(f"megatron_patches.fused_adam: {attr.module}.{attr.name} does not exist; the installed "
                               f"megatron-core is not one this patch was written for")
        saved.append((module, attr.name, module.__dict__[attr.name]))
        setattr(module, attr.name, attr.replacement())
    return FusedAdamPatch(saved)
