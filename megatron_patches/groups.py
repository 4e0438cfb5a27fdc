"""The process groups megatron-core created, read from ``parallel_state`` (the only place that does).

neighbor_ckpt's core takes groups as arguments; this module is how a Megatron or NeMo job gets them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["McoreGroups", "mcore_groups"]


@dataclass(frozen=True)
class McoreGroups:
    """What neighbor_ckpt needs to know about one rank's place in the mcore layout."""

    dp_group: dist.ProcessGroup
    """The group the distributed optimizer shards over (data parallel x context parallel): the DP ring."""
    dp_size: int
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    ep_rank: int = 0
    """Expert-parallel rank (mixture of experts): which ``E / ep`` experts of every layer this rank holds."""
    ep_size: int = 1
    """Expert-parallel size; 1 without expert parallelism."""
    expert_dp_size: int = 1
    """Expert-data-parallel size, world / (expert TP x EP x PP): the group mcore's distributed optimizer shards the
    expert params over (its own buffers and param all-gather; the snapshot ring stays on ``dp_group``, whose members
    each hold their own shard of both)."""

    @property
    def coord(self) -> tuple[int, int]:
        """(TP rank, PP rank): ranks with the same coordinate hold the same slice of the model."""
        return (self.tp_rank, self.pp_rank)


def mcore_groups() -> McoreGroups:
    """Read the groups of ``megatron.core.parallel_state`` (initialize_model_parallel must have run)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron.core.parallel_state.initialize_model_parallel() has not been called yet")
    dp = ps.get_data_parallel_group(with_context_parallel=True)
    return McoreGroups(dp_group=dp, dp_size=dist.get_world_size(dp),
                       tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                       tp_size=ps.get_tensor_model_parallel_world_size(),
                       pp_size=ps.get_pipeline_model_parallel_world_size(),
                       ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
                       expert_dp_size=ps.get_expert_data_parallel_world_size())
