"""How to read and write the state of a training setup: one adapter per optimizer family.

An adapter exposes a rank's big tensors with their :class:`~neighbor_ckpt.snapshot.razor.StateKind` and loads a
restored set back. The core never imports a framework; adapters for mcore live next to this one.

May import (the rule: :data:`neighbor_ckpt.layers.LAYERS`, checked by ``tests/unit/test_layers.py``):
:mod:`neighbor_ckpt.snapshot` (the razor's vocabulary), :mod:`megatron_patches` (mcore's optimizer state and RNG
tracker), :mod:`neighbor_ckpt.errors`, :mod:`neighbor_ckpt.validation`, :mod:`neighbor_ckpt.config`; megatron-core
only inside ``megatron.py``, lazily.
"""

from neighbor_ckpt.adapters.base import classify_buffers, declare_buffers
from neighbor_ckpt.adapters.ddp import pin_bucket_layout
from neighbor_ckpt.adapters.torch_optim import TorchOptimizerAdapter

# The API README shows.
__all__ = ["TorchOptimizerAdapter", "MegatronOptimizerAdapter", "pin_bucket_layout", "declare_buffers",
           "classify_buffers"]


def __getattr__(name: str) -> type:
    # megatron-core is an optional dependency: import its adapter only when asked for.
    if name == "MegatronOptimizerAdapter":
        from neighbor_ckpt.adapters.megatron import MegatronOptimizerAdapter
        return MegatronOptimizerAdapter
    raise AttributeError(name)
