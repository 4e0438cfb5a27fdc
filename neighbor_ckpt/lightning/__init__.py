"""Lightning glue: a thin callback over :class:`neighbor_ckpt.checkpointer.NeighborCheckpointer`.

Works with ``lightning.pytorch`` and ``pytorch_lightning`` trainers and NeMo's ``MegatronStrategy``.
May import: :mod:`neighbor_ckpt.inprocess` (the NeMo/Lightning in-process glue), the checkpointer and
everything below it; never :mod:`neighbor_ckpt.cli`.
"""

from neighbor_ckpt.lightning.callback import NeighborCheckpoint

__all__ = ["NeighborCheckpoint"]
