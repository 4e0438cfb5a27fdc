"""Lightning glue: a thin callback over :class:`neighbor_ckpt.checkpointer.NeighborCheckpointer`."""

from neighbor_ckpt.lightning.callback import NeighborCheckpoint

__all__ = ["NeighborCheckpoint"]
