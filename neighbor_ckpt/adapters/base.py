"""The adapter interface between the core and a model + optimizer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Mapping

import torch
import torch.distributed as dist

from neighbor_ckpt.snapshot.razor import TensorMeta

__all__ = ["StateAdapter"]


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

    def regenerate(self, dp_group: dist.ProcessGroup | None) -> None:  # noqa: B027 - optional hook
        """Rebuild regenerable tensors (collective over ``dp_group``). Default: nothing is regenerable."""
