"""The data position of NeMo 2's Megatron samplers (``MegatronDataSampler``), read and restored.

NeMo's pretraining samplers start at ``data_sampler.init_consumed_samples``; NeMo itself only restores it
through ``PreTrainingDataModule.load_state_dict`` from a disk checkpoint (``MockDataModule`` has no such
state at all). This does the same from a neighbor_ckpt snapshot: set the sampler's counters and megatron's
micro-batch calculator before the training dataloader is built (``on_fit_start``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["megatron_data_sampler", "consumed_samples", "resume_consumed_samples", "steps_for_consumed_samples",
           "constant_global_batch"]


def megatron_data_sampler(trainer: Any) -> Any:
    """The datamodule's (or strategy's) ``MegatronDataSampler``, or None."""
    for owner in (getattr(trainer, "datamodule", None), getattr(trainer, "strategy", None)):
        sampler = getattr(owner, "data_sampler", None)
        if sampler is not None and hasattr(sampler, "compute_consumed_samples"):
            return sampler
    return None


def consumed_samples(trainer: Any) -> int | None:
    """Samples consumed after ``trainer.global_step`` optimizer steps (None without a Megatron sampler)."""
    sampler = megatron_data_sampler(trainer)
    if sampler is None:
        return None
    return int(sampler.compute_consumed_samples(trainer.global_step - getattr(sampler, "init_global_step", 0)))


def constant_global_batch(trainer: Any) -> tuple[int, int] | None:
    """``(global_batch_size, micro_batch_size)`` of the Megatron sampler, or None (no Megatron sampler, or a
    batch-size ramp-up: the global batch then changes by design)."""
    sampler = megatron_data_sampler(trainer)
    gbs = getattr(sampler, "global_batch_size", None)
    mbs = getattr(sampler, "micro_batch_size", None)
    if sampler is None or not gbs or not mbs or getattr(sampler, "rampup_batch_size", None):
        return None
    return int(gbs), int(mbs)


def steps_for_consumed_samples(trainer: Any, consumed: int) -> int | None:
    """Optimizer steps that consumed ``consumed`` samples at a constant global batch (None: no Megatron sampler,
    a batch-size ramp-up, or a count that is not a whole number of global batches)."""
    sampler = megatron_data_sampler(trainer)
    gbs = getattr(sampler, "global_batch_size", None)
    if sampler is None or not gbs or getattr(sampler, "rampup_batch_size", None) or consumed % gbs:
        return None
    return consumed // gbs


def resume_consumed_samples(trainer: Any, consumed: int) -> bool:
    """Make the next training dataloader start after ``consumed`` samples; False without a Megatron sampler."""
    from megatron.core.num_microbatches_calculator import update_num_microbatches

    sampler = megatron_data_sampler(trainer)
    if sampler is None:
        return False
    sampler.init_consumed_samples = consumed
    sampler.prev_consumed_samples = consumed
    sampler.if_first_step = 1
    sampler.init_global_step = trainer.global_step
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and hasattr(datamodule, "init_global_step"):
        datamodule.init_global_step = trainer.global_step
    update_num_microbatches(consumed_samples=consumed, consistency_check=False)
    return True
