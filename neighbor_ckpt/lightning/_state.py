"""What a Lightning snapshot carries, read from and written to the trainer: Lightning's plumbing under the callback.

The training state (``{"fit_loop", "schedulers", "rng", "batches_in_epoch"[, "consumed_samples"]}``) is the snapshot's
user state and, inside every Lightning checkpoint, the callback's ``state_dict()["training_state"]``; its format is
unchanged since the first release (an insurance checkpoint written then still resumes). Which state is applied and
what its data position means is :mod:`neighbor_ckpt.glue`'s policy.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from neighbor_ckpt.errors import NeighborCkptError
from neighbor_ckpt.glue import rng
from neighbor_ckpt.glue.session import DataPosition

__all__ = ["single_optimizer", "training_state", "apply_training_state", "load_insurance_checkpoint"]


def single_optimizer(trainer: Any) -> Any:
    """The one optimizer of a plain Lightning strategy (its state adapter: :func:`neighbor_ckpt.glue.adapters.
    data_parallel_adapter`)."""
    if len(trainer.optimizers) != 1:
        raise NeighborCkptError(f"NeighborCheckpoint supports exactly one optimizer, the module configured "
                                f"{len(trainer.optimizers)}")
    return trainer.optimizers[0]


def _mark_batch_completed(fit_loop_state: dict[str, Any]) -> dict[str, Any]:
    """The snapshot is taken in ``on_train_batch_end``, before Lightning counts the batch as completed.
    Record it as completed so a restore resumes with the next batch."""
    bp = fit_loop_state.get("epoch_loop.batch_progress")
    if isinstance(bp, dict):
        for scope in ("total", "current"):
            if isinstance(bp.get(scope), dict):
                bp[scope]["completed"] = bp[scope]["processed"]
    return fit_loop_state


def training_state(trainer: Any, *, megatron: bool) -> dict[str, Any]:
    """The training state of the step that just ended (``on_train_batch_end``)."""
    state = {
        "fit_loop": _mark_batch_completed(trainer.fit_loop.state_dict()),
        "schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        "rng": rng.capture(),
        "batches_in_epoch": trainer.fit_loop.epoch_loop.batch_progress.current.processed,
    }
    if megatron:
        from megatron_patches.nemo_data import consumed_samples

        state["consumed_samples"] = consumed_samples(trainer)
    return state


def apply_training_state(trainer: Any, state: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Load loops and schedulers, set a Megatron sampler's consumed samples; returns what the callback applies later:
    the RNG state (right before the first resumed step) and the batches to skip (when the epoch's iterator starts)."""
    trainer.fit_loop.load_state_dict(state["fit_loop"])
    configs = trainer.lr_scheduler_configs
    if len(configs) != len(state["schedulers"]):
        raise NeighborCkptError(f"the snapshot has {len(state['schedulers'])} LR schedulers, the module "
                                f"configured {len(configs)}")
    for cfg, sd in zip(configs, state["schedulers"]):
        cfg.scheduler.load_state_dict(sd)
    position = DataPosition.of(state)
    if position.consumed_samples is not None:
        # NeMo's Megatron sampler resumes from a consumed-samples counter (set before the dataloader is built).
        from megatron_patches.nemo_data import resume_consumed_samples

        if not resume_consumed_samples(trainer, position.consumed_samples):
            raise NeighborCkptError("the snapshot carries a Megatron data position but this job has no "
                                    "MegatronDataSampler")
    return state["rng"], position.batches_in_epoch


def _numpy_globals() -> list[Any]:
    """What unpickling the numpy arrays of an RNG state needs (numpy 1.x and 2.x spell the module differently)."""
    import numpy as np

    multiarray = getattr(getattr(np, "_core", None), "multiarray", None) or np.core.multiarray
    dtypes = getattr(np, "dtypes", None)
    kinds = [] if dtypes is None else [getattr(dtypes, n) for n in ("UInt32DType", "Int64DType", "Float64DType")
                                       if hasattr(dtypes, n)]
    return [multiarray._reconstruct, np.ndarray, np.dtype, *kinds]


def _load_weights_only(path: Path) -> dict[str, Any]:
    """An insurance checkpoint loaded without running code from it (``weights_only=True``): tensors, containers and
    the numpy arrays of the RNG state only. Anything else in the file is refused in one line (a file of another
    program, or one that was tampered with), never executed."""
    import pickle

    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NeighborCkptError(f"insurance checkpoint {path}: holds an object that is not loaded without running "
                                f"code from it ({why}); a checkpoint this library wrote holds none: move the file "
                                "away, or remove the insurance directory to start without it") from None


def load_insurance_checkpoint(trainer: Any, callback: Any, path: Path) -> None:
    """Load our insurance checkpoint (Lightning's own checkpoint format): weights, optimizer, and the callback's state
    through its ``load_state_dict``, looked up as Lightning does when it restores callbacks (``state_key``, then the
    legacy key)."""
    ckpt = _load_weights_only(path)
    trainer.lightning_module.load_state_dict(ckpt["state_dict"])
    trainer.optimizers[0].load_state_dict(ckpt["optimizer_states"][0])
    states = ckpt.get("callbacks") or {}
    state = states.get(callback.state_key, states.get(getattr(callback, "_legacy_state_key", None)))
    if state:
        callback.load_state_dict(copy.deepcopy(state))
