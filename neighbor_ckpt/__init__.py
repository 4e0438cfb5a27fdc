"""neighbor_ckpt: per-iteration in-memory neighbor checkpointing for Megatron-Core, NeMo 2 and Lightning.

Public entry points:

* :class:`NeighborCheckpoint` — the Lightning callback (``lightning.pytorch`` and ``pytorch_lightning``);
* :class:`NeighborCheckpointer` — the plain-loop API (``recover`` / ``snapshot`` / ``close``);
* :class:`NeighborCkptConfig` — configuration (YAML section ``neighbor_ckpt:``);
* :func:`prepare_torchrun_restart` — a plain loop's torchrun restart fix, before ``init_process_group``.

Everything else is imported from the module that defines it (the errors from :mod:`neighbor_ckpt.errors`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.runtime.torchrun import prepare_torchrun_restart

if TYPE_CHECKING:
    from neighbor_ckpt.checkpointer import NeighborCheckpointer
    from neighbor_ckpt.lightning.callback import NeighborCheckpoint

__all__ = ["NeighborCheckpoint", "NeighborCheckpointer", "NeighborCkptConfig", "prepare_torchrun_restart"]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lightning is an optional dependency: import the callback only when asked for.
    if name == "NeighborCheckpoint":
        from neighbor_ckpt.lightning.callback import NeighborCheckpoint
        return NeighborCheckpoint
    if name == "NeighborCheckpointer":
        from neighbor_ckpt.checkpointer import NeighborCheckpointer
        return NeighborCheckpointer
    raise AttributeError(name)
