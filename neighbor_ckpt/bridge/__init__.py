"""Per-iteration neighbor checkpointing for Megatron-Bridge: :class:`NeighborCheckpoint`, one Bridge ``Callback``::

    from megatron_patches import enable_cpu
    enable_cpu(nemo=False)                      # CPU only (smoke runs, tests): before megatron.bridge is imported
    from neighbor_ckpt.bridge import NeighborCheckpoint
    pretrain(cfg, forward_step, callbacks=[NeighborCheckpoint()])   # under torchrun --max-restarts N

In process (hot spares, ``pretrain`` called again in the surviving processes with the same callbacks):
:mod:`neighbor_ckpt.bridge.inprocess` (``run_pretrain``, ``attach``).

:func:`check_bridge_config` holds the refusals (pure; it reads the ``ConfigContainer`` only). Importing this package
imports no Megatron-Bridge; ``NeighborCheckpoint`` imports it on first use.

May import (:data:`neighbor_ckpt.layers.LAYERS`): :mod:`neighbor_ckpt.glue`, the checkpointer,
:mod:`neighbor_ckpt.inprocess`, ``megatron_patches``, the errors and the configuration; nothing else of the library.
"""

from __future__ import annotations

from typing import Any


__all__ = ["NeighborCheckpoint"]


def __getattr__(name: str) -> Any:
    if name == "NeighborCheckpoint":
        from neighbor_ckpt.bridge.callback import NeighborCheckpoint

        return NeighborCheckpoint
    raise AttributeError(f"module 'neighbor_ckpt.bridge' has no attribute {name!r}")
