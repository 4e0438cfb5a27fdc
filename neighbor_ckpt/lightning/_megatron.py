"""What :class:`~neighbor_ckpt.NeighborCheckpoint` does differently under NeMo 2's ``MegatronStrategy``.

The state adapter is the Megatron one (the mcore optimizer inside NeMo's wrapper), the DP ring is mcore's
data-parallel group, the wait point and the step tags come from :mod:`megatron_patches` (NeMo runs the
backward pass inside ``training_step``, so Lightning's ``on_before_backward`` never fires), and the data
position is the Megatron sampler's consumed-samples counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neighbor_ckpt.errors import NeighborCkptError
from neighbor_ckpt.glue.insurance import iteration_from_name

__all__ = ["is_megatron_strategy", "MegatronSetup", "megatron_setup", "nemo_checkpoint_step"]


def is_megatron_strategy(strategy: Any) -> bool:
    """True for NeMo's ``MegatronStrategy`` (and subclasses), without importing NeMo."""
    return any(c.__name__ == "MegatronStrategy" and c.__module__.startswith("nemo.") for c in type(strategy).__mro__)


@dataclass(frozen=True)
class MegatronSetup:
    model_chunks: list[Any]
    """The strategy's model chunks (megatron-core ``DistributedDataParallel`` wrappers)."""
    optimizer: Any
    """NeMo's optimizer: the megatron-core optimizer it steps is inside (:func:`neighbor_ckpt.glue.adapters.
    megatron_adapter` unwraps it)."""
    dp_group: Any
    coord: tuple[int, ...]
    batch: tuple[int, int] | None = None
    """``(global_batch_size, micro_batch_size)`` of NeMo's Megatron sampler (None without one, or with a batch-size
    ramp-up): the checkpointer refuses a data-parallel size that does not divide it and reports the batch it keeps."""


def megatron_setup(trainer: Any) -> MegatronSetup:
    from megatron_patches import mcore_groups
    from megatron_patches._versions import check_versions
    from megatron_patches.distopt_load import fix_fp32_distopt_load
    from megatron_patches.nemo_data import constant_global_batch

    check_versions(require_nemo=True)
    fix_fp32_distopt_load()  # so that falling back to NeMo's disk checkpoint works for fp32 models too
    optimizers = trainer.strategy.optimizers
    if len(optimizers) != 1:
        raise NeighborCkptError(f"NeighborCheckpoint supports exactly one optimizer, MegatronStrategy has "
                                f"{len(optimizers)}")
    groups = mcore_groups()
    return MegatronSetup(list(trainer.strategy.model), optimizers[0], groups.dp_group, groups.coord,
                         constant_global_batch(trainer))


def nemo_checkpoint_step(trainer: Any, path: Any) -> int:
    """The iteration of the NeMo checkpoint ``path`` (NeMo's insurance): ``step=N`` in its name, else its
    ``consumed_samples=`` in whole global batches."""
    def steps_for_consumed(consumed: int) -> int | None:
        from megatron_patches.nemo_data import steps_for_consumed_samples

        return steps_for_consumed_samples(trainer, consumed)

    return iteration_from_name(path, framework="NeMo", steps_for_consumed=steps_for_consumed,
                               hint="Keep {step} or {consumed_samples} in ModelCheckpoint's filename")
