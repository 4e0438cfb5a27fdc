"""The adapter interface between the core and a model + optimizer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from neighbor_ckpt.errors import SnapshotMismatchError
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta

__all__ = ["StateAdapter", "declare_buffers", "classify_buffers", "buffer_tensors", "load_buffers", "BUFFER_PREFIX"]

BUFFER_PREFIX = "buffer/"
"""Name prefix of module buffers in a rank's state (``buffer/<module path>.<buffer name>``)."""

_DECLARED = "_neighbor_ckpt_buffers"


def declare_buffers(module: nn.Module, *, constant: Iterable[str] = (), changing: Iterable[str] = ()) -> None:
    """The escape hatch of the buffer rule (:func:`classify_buffers`): declare buffers of ``module`` itself (names as
    in ``module.register_buffer``) as ``constant`` (never snapshotted: the model's constructor recomputes them, e.g.
    a persistent lookup table) or ``changing`` (snapshotted every iteration, e.g. a non-persistent counter that
    training updates and resuming needs). Call it before the checkpointer starts (e.g. in the module's
    ``__init__``); it survives ``module.train()`` / ``eval()``."""
    declared = module.__dict__.setdefault(_DECLARED, {})
    for kind, names in (("constant", constant), ("changing", changing)):
        for name in names:
            if name not in module._buffers:
                raise KeyError(f"{type(module).__qualname__} has no buffer {name!r} (declare_buffers names the "
                               f"module's own buffers: {sorted(module._buffers)})")
            declared[name] = kind


def classify_buffers(model: nn.Module, prefix: str = "") -> list[tuple[str, torch.Tensor, StateKind]]:
    """Every buffer of ``model`` once (shared buffers: the first name), with what the razor should do with it.

    The rule, per buffer, from the module that owns it:

    * declared with :func:`declare_buffers`: as declared;
    * non-persistent (``register_buffer(..., persistent=False)``, not in ``state_dict``): constant. Frameworks
      register what they recompute at build time this way (RoPE ``inv_freq``, causal masks);
    * persistent, of a module in training mode: changing (BatchNorm running statistics and its batch counter,
      megatron-core's MoE router ``expert_bias``);
    * persistent, of a module in eval mode (e.g. a frozen BatchNorm): constant.

    Changing buffers are :attr:`~StateKind.BUFFER` (staged every iteration), constant ones
    :attr:`~StateKind.CONSTANT_BUFFER` (regenerable: never saved). Adapters classify once, when they are built, so
    a later ``eval()`` (validation) does not change the plan."""
    out: list[tuple[str, torch.Tensor, StateKind]] = []
    seen: set[int] = set()
    for mod_name, mod in model.named_modules(remove_duplicate=True):
        declared = mod.__dict__.get(_DECLARED, {})
        for name, buf in mod._buffers.items():
            if buf is None or id(buf) in seen:
                continue
            seen.add(id(buf))
            if name in declared:
                changing = declared[name] == "changing"
            elif name in mod._non_persistent_buffers_set:
                changing = False
            else:
                changing = mod.training
            full = f"{prefix}{mod_name}.{name}" if mod_name else f"{prefix}{name}"
            out.append((full, buf, StateKind.BUFFER if changing else StateKind.CONSTANT_BUFFER))
    return out


def buffer_tensors(classified: list[tuple[str, torch.Tensor, StateKind]]) -> list[tuple[TensorMeta, torch.Tensor]]:
    """The classified buffers as (meta, live tensor) entries of :meth:`StateAdapter.named_tensors`."""
    return [(TensorMeta.of(BUFFER_PREFIX + name, kind, buf), buf.detach()) for name, buf, kind in classified]


def load_buffers(classified: list[tuple[str, torch.Tensor, StateKind]], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy the restored changing buffers into the live ones (constant ones are as the constructor made them)."""
    with torch.no_grad():
        for name, buf, kind in classified:
            if kind is not StateKind.BUFFER:
                continue
            key = BUFFER_PREFIX + name
            if key not in tensors:
                raise SnapshotMismatchError(f"restored state lacks the module buffer {key!r}: the snapshot was taken "
                                            f"with another model")
            buf.copy_(tensors[key])


class StateAdapter(ABC):
    """Exposes one rank's training state to the core.

    Call order, per iteration: :meth:`named_tensors` (cached by the engine once the plan is built) and
    :meth:`capture_extras` after every optimizer step. At recovery: :meth:`load` with every non-regenerable
    tensor by name and the extras of the restored version, then :meth:`regenerate` on all ranks together.
    """

    distributed_optimizer: bool = False
    """True when optimizer state is sharded across DP ranks (so it is unique per rank)."""

    @abstractmethod
    def named_tensors(self) -> list[tuple[TensorMeta, torch.Tensor]]:
        """The live tensors of this rank's state, in a stable order. Must not copy."""

    @abstractmethod
    def capture_extras(self) -> dict[str, Any]:
        """Small, adapter-specific state that is not a planned tensor (e.g. optimizer param_groups)."""

    @abstractmethod
    def load(self, tensors: Mapping[str, torch.Tensor], extras: Mapping[str, Any]) -> None:
        """Load restored tensors (CPU, possibly views of host memory: copy them) and extras."""

    def layout_key(self) -> Any:
        """JSON-able facts about where this rank's state lives (e.g. shard ranges in a flat buffer) that a
        snapshot must match besides tensor names and shapes. Default: nothing more."""
        return None

    def materialize(self) -> None:  # noqa: B027 - optional hook
        """Create state that exists only after a first optimizer step (torch optimizers create theirs lazily), so
        :meth:`named_tensors` names every tensor :meth:`load` will fill. Default: nothing to create."""

    def dp_shards(self) -> dict[str, tuple[int, int, int]] | None:
        """For an elastic reshard (``neighbor_ckpt.elastic``): the tensors of :meth:`named_tensors` that are slices of
        a larger tensor cut over the data-parallel group, by name: ``(numel of the whole, start, end)`` in flattened
        elements. Every other unique tensor is whole (the same in any data-parallel layout). None (the default for a
        sharded optimizer): this adapter cannot say, and its state cannot be resharded."""
        return None if self.distributed_optimizer else {}

    def regenerate(self, dp_group: dist.ProcessGroup | None) -> None:  # noqa: B027 - optional hook
        """Rebuild regenerable tensors (collective over ``dp_group``). Default: nothing is regenerable."""
