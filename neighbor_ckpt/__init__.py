"""neighbor_ckpt: per-iteration in-memory neighbor checkpointing for Megatron-Core, NeMo 2 and Lightning.

Public entry points:

* :class:`NeighborCheckpoint` — the Lightning callback (``lightning.pytorch`` and ``pytorch_lightning``);
* :class:`NeighborCheckpointer` — the plain-loop API (``recover`` / ``snapshot`` / ``close``);
* :class:`NeighborCkptConfig` — configuration (YAML section ``neighbor_ckpt:``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.runtime.torchrun import prepare_torchrun_restart
from neighbor_ckpt.errors import (ConfigError, HostMemoryError, NeighborCkptError, NoRecoverableStateError,
                                  SnapshotCorruptError, SnapshotError, SnapshotMismatchError, TopologyError,
                                  TransportError)

if TYPE_CHECKING:
    from neighbor_ckpt.checkpointer import NeighborCheckpointer
    from neighbor_ckpt.lightning.callback import NeighborCheckpoint

__all__ = [
    "NeighborCheckpoint", "NeighborCheckpointer", "NeighborCkptConfig", "NeighborCkptError", "ConfigError",
    "HostMemoryError", "NoRecoverableStateError", "SnapshotCorruptError", "SnapshotError",
    "SnapshotMismatchError", "TopologyError", "TransportError", "prepare_torchrun_restart",
]

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
