"""Which state adapter a framework callback hands the checkpointer, by the optimizer the framework trains with.

* :func:`data_parallel_adapter`: a plain data-parallel job (torch DDP, ZeRO): DDP's bucket layout is pinned first (the
  same in every run, so the first step after a restart reduces like the original), then ZeRO's adapter for a
  ``ZeroRedundancyOptimizer``, else the torch optimizer's.
* :func:`megatron_adapter`: megatron-core's optimizer (NeMo 2's ``MegatronStrategy``, Megatron-Bridge): the distributed
  optimizer's fp32 main-param shards and moments, weights regenerated. megatron-core is imported only then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from neighbor_ckpt.adapters.base import StateAdapter
from neighbor_ckpt.adapters.ddp import pin_bucket_layout
from neighbor_ckpt.adapters.torch_optim import TorchOptimizerAdapter, ZeroOptimizerAdapter

if TYPE_CHECKING:
    from neighbor_ckpt.adapters.megatron import MegatronOptimizerAdapter

__all__ = ["data_parallel_adapter", "megatron_adapter"]


def data_parallel_adapter(ddp_model: Any, module: Any, optimizer: Any) -> StateAdapter:
    """The adapter of ``module``'s ``optimizer`` under plain data parallelism, ``ddp_model``'s bucket layout pinned
    (``ddp_model``: the DDP wrapper, or the module itself when there is none)."""
    pin_bucket_layout(ddp_model)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return ZeroOptimizerAdapter(module, optimizer)
    return TorchOptimizerAdapter(module, optimizer)


def megatron_adapter(model_chunks: Any | Sequence[Any], optimizer: Any) -> MegatronOptimizerAdapter:
    """The adapter of megatron-core's ``optimizer`` over ``model_chunks``; NeMo's wrapper is unwrapped (the adapter's
    ``.optimizer`` is the megatron-core optimizer inside it)."""
    from neighbor_ckpt.adapters.megatron import MegatronOptimizerAdapter

    return MegatronOptimizerAdapter(model_chunks, optimizer)
