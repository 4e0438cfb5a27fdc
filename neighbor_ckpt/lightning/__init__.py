"""Lightning glue: a thin callback over :class:`neighbor_ckpt.checkpointer.NeighborCheckpointer`.

Works with ``lightning.pytorch`` and ``pytorch_lightning`` trainers and NeMo's ``MegatronStrategy``.
May import (:data:`neighbor_ckpt.layers.LAYERS`): :mod:`neighbor_ckpt.glue`, the checkpointer,
:mod:`neighbor_ckpt.inprocess`, ``megatron_patches``, the errors and the configuration; nothing else of the library.
"""

from neighbor_ckpt.lightning.callback import NeighborCheckpoint

__all__ = ["NeighborCheckpoint"]
