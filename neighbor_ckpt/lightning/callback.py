"""``NeighborCheckpoint``: per-iteration neighbor checkpointing as one Lightning callback.

Example::

    from neighbor_ckpt import NeighborCheckpoint, NeighborCkptConfig
    trainer = Trainer(strategy="ddp", callbacks=[NeighborCheckpoint()])   # or NeighborCheckpoint(NeighborCkptConfig(...))
    trainer.fit(model, datamodule)       # under `torchrun --max-restarts N`: a restarted attempt resumes by itself

What a restart restores: model, optimizer, LR schedulers, RNG states (python, numpy, torch, CUDA), global
step and loop progress, and the data position (a map-style dataset under the DistributedSampler continues
with the next unseen batch).

Hook order (one training step)::

    on_train_start         after a restore: skip the batches of the current epoch already trained on
    on_train_batch_start   apply the restored RNG state once, right before the first resumed step; the batch's
                           fingerprint for the data-position check (``data_check``; checked at the first resumed step)
    on_before_backward     the engine's wait point (before DDP's gradient all-reduce)
    on_before_optimizer_step  step tag: weights are torn from here ...
    on_train_batch_end     ... to here: snapshot of iteration ``global_step`` (returns at once)
    on_exception           lazy backup of the redundant state, then Lightning re-raises

Under NeMo 2's ``MegatronStrategy`` the same callback uses the Megatron adapter (distributed optimizer shards,
weights regenerated), mcore's DP group, and :mod:`megatron_patches` hooks: the wait point runs before mcore's
first gradient collective and the step tags wrap the mcore optimizer's ``step`` (NeMo never calls
``on_before_backward``); the data position is the Megatron sampler's consumed samples. After an in-memory
restore, a pending disk resume of an older checkpoint (``fit(ckpt_path=...)``, NeMo's ``AutoResume``) is skipped.

The policy (what to load, which wins, the data position, when to snapshot and to write insurance) is
:class:`neighbor_ckpt.glue.Session`'s, shared with the other frameworks' callbacks; this module is Lightning's
plumbing around it (hooks, trainer attributes). The callback's own state (the training state of the last
snapshot, carried in every Lightning checkpoint: our insurance, ``ModelCheckpoint``'s) goes through Lightning's
``state_dict`` / ``load_state_dict``.

What it reports (global rank 0, ``neighbor_ckpt.report.status``): a status line every ``trainer.log_every_n_steps``
steps (``report.status_every_n_steps`` overrides; 0 = never); the same figures as metrics to every trainer
logger (``neighbor_ckpt/snapshot_ms``, ``wait_ms``, ``unique_bytes``, ``replica_lag``, ``stream_gbps``); after a
recovery, at the end of the first resumed step, the MTTR breakdown as one log line, as metrics
(``neighbor_ckpt/recovery/<phase>_s``) and as ``recovery_timeline.attempt<N>.png`` / ``.json`` in ``report.dir``
or ``<trainer.log_dir or default_root_dir>/neighbor_ckpt_reports/`` (:attr:`NeighborCheckpoint.last_timeline`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from neighbor_ckpt.checkpointer import NeighborCheckpointer, Phase
from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.glue import rng
from neighbor_ckpt.glue.adapters import data_parallel_adapter, megatron_adapter
from neighbor_ckpt.glue.insurance import InsuranceFiles
from neighbor_ckpt.glue.session import Session
from neighbor_ckpt.glue.setup import set_up_callback
from neighbor_ckpt.lightning._compat import callback_bases
from neighbor_ckpt.lightning._data import install_skip, uninstall_skip
from neighbor_ckpt.lightning._megatron import is_megatron_strategy, megatron_setup, nemo_checkpoint_step
from neighbor_ckpt.lightning._resume import skip_pending_disk_restore
from neighbor_ckpt.lightning._state import (apply_training_state, load_insurance_checkpoint, single_optimizer,
                                           training_state)

logger = logging.getLogger(__name__)

__all__ = ["NeighborCheckpoint"]


def default_report_dir(log_dir: str | Path) -> Path:
    """``<log_dir>/neighbor_ckpt_reports`` (not ``neighbor_ckpt``: a run started without a logger from a checkout of
    this repository has the package's source directory there)."""
    return Path(log_dir) / "neighbor_ckpt_reports"


class NeighborCheckpoint(*callback_bases()):  # type: ignore[misc]
    """Lightning callback: snapshot after every optimizer step, recover automatically on restart.

    Args:
        config: configuration (defaults when None).

    Raises:
        ConfigError: ``config`` is not a :class:`NeighborCkptConfig`.
    """

    def __init__(self, config: NeighborCkptConfig | None = None) -> None:
        super().__init__()
        # The configuration checked; torchrun's restart and a replaced node's slot prepared before the strategy
        # creates its process group (the trainer has not connected yet).
        self.config = set_up_callback(config)
        self.session = Session(self.config, name="NeighborCheckpoint", framework="Lightning")
        """Insurance, resume and data-position policy (:mod:`neighbor_ckpt.glue`); owns the checkpointer."""
        self._pending_rng = rng.PendingRng()
        self._skip_batches = 0
        self._megatron = False
        self._hooks: Any = None
        self._group_ready: float | None = None
        self.attempt: Any = None
        """Which attempt this is, for the checkpointer (``attempt=``); set by in-process recovery
        (:mod:`neighbor_ckpt.lightning.inprocess`), else None: the launcher's restart count."""

    @property
    def checkpointer(self) -> NeighborCheckpointer | None:
        """The plain-loop checkpointer under this callback (None before ``on_fit_start`` and when disabled)."""
        return self.session.checkpointer

    @checkpointer.setter
    def checkpointer(self, value: NeighborCheckpointer | None) -> None:
        self.session.checkpointer = value

    @property
    def last_recovery(self) -> Any:
        """What the recovery of this run did: the checkpointer's ``RecoveryResult`` (None before ``on_fit_start``
        and when disabled)."""
        return self.session.last_recovery

    @property
    def last_timeline(self) -> Any:
        """MTTR breakdown of the recovery of this run, a :class:`~neighbor_ckpt.report.timeline.RecoveryTimeline`
        (global rank 0, from the end of the first resumed step; ``.phases``, ``.path_png``, ``.path_json``). None on
        other ranks, and when nothing was recovered."""
        return self.checkpointer.last_timeline if self.checkpointer is not None else None

    # -- set-up and recovery ----------------------------------------------------------------------------

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # The first hook after the strategy created the process group: a marker of the recovery timeline.
        if self._group_ready is None:
            self._group_ready = time.time()

    @override
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.config.enabled or not self.session.distributed():
            return
        files = InsuranceFiles.from_config(self.config.insurance, trainer.default_root_dir)
        self._megatron = is_megatron_strategy(trainer.strategy)
        if self._megatron:
            from megatron_patches import install_hooks

            if files is not None:
                raise ConfigError("neighbor_ckpt.insurance under NeMo's MegatronStrategy: use NeMo's ModelCheckpoint "
                                  "(distributed checkpoint) as the insurance checkpoint and leave "
                                  "neighbor_ckpt.insurance.every_n_steps at 0")
            mc = megatron_setup(trainer)
            adapter = megatron_adapter(mc.model_chunks, mc.optimizer)
            # Insurance under NeMo: the distributed checkpoint AutoResume points the trainer at (trainer.ckpt_path),
            # which Lightning loads right after on_fit_start.
            insurance = self.session.framework_insurance(lambda: trainer.ckpt_path,
                                                         lambda path: nemo_checkpoint_step(trainer, path),
                                                         announce="NeMo loads its distributed checkpoint")
            batch = {} if mc.batch is None else {"global_batch": mc.batch[0], "micro_batch_size": mc.batch[1]}
            ckpt = self.session.start(adapter=adapter, dp_group=mc.dp_group, model_parallel_coord=mc.coord,
                                      insurance=insurance, attempt=self.attempt, **batch)
            # NeMo runs backward inside training_step (no on_before_backward): the wait point and the step tags
            # come from mcore's gradient collectives and the mcore optimizer's step; the data check's input from
            # the data iterator handed to mcore's forward-backward function.
            self._hooks = install_hooks(ckpt, adapter.optimizer)  # the megatron-core optimizer inside NeMo's wrapper
        else:
            # Same DDP bucket layout in every run, so the first step after a restart reduces like the original.
            adapter = data_parallel_adapter(trainer.strategy.model, pl_module, single_optimizer(trainer))
            self.session.start(adapter=adapter, attempt=self.attempt,
                               insurance=self.session.own_insurance(
                                   files, lambda path: load_insurance_checkpoint(trainer, self, path)))
        self._attach_reporting(trainer)
        resume = self.session.recover()
        # resume.framework_loads: NeMo's own resume loads everything (weights, optimizer, loops, data position) right
        # after this hook.
        if resume.state is not None:
            rng_state, self._skip_batches = apply_training_state(trainer, resume.state)
            self._pending_rng.keep(rng_state)
            self.session.resumed_at(trainer.global_step)
            if resume.in_memory:
                skip_pending_disk_restore(trainer, trainer.global_step)
            if trainer.is_global_zero:
                logger.warning("NeighborCheckpoint: resumed at global step %d (%s)", trainer.global_step,
                               resume.result.report.summary())

    def _attach_reporting(self, trainer: Any) -> None:
        """The trainer's log interval, loggers and log directory for the checkpointer's reporter (all ranks:
        ``trainer.log_dir`` is a broadcast)."""
        self.session.attach_reporting(log_interval=trainer.log_every_n_steps,
                                      default_report_dir=lambda: default_report_dir(self._log_dir(trainer)),
                                      loggers=trainer.loggers, process_group_ready=self._group_ready)

    @staticmethod
    def _log_dir(trainer: Any) -> str:
        try:
            log_dir = trainer.log_dir
        except Exception as e:  # noqa: BLE001 - a logger without a directory
            logger.debug("NeighborCheckpoint: trainer.log_dir unavailable (%s)", e)
            log_dir = None
        return str(log_dir or trainer.default_root_dir)

    # -- per step ----------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Called once the epoch's iterator exists but before it draws its first index, in every Lightning
        # version (pytorch_lightning >= 2.5 no longer calls on_train_epoch_start when resuming mid-epoch).
        if self._skip_batches:
            install_skip(trainer.train_dataloader, self._skip_batches)
            self._skip_batches = 0

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._pending_rng.apply()
        if self.checkpointer is not None:
            self.checkpointer.mark("forward")
            # Under MegatronStrategy the micro-batches are drawn inside NeMo's data step, from the data iterator
            # handed to megatron-core's forward-backward function: install_hooks observes them there.
            if not self._megatron:
                self.checkpointer.observe_input(batch)

    @override
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # A restore at the last batch of an epoch resumes at the epoch boundary: apply the RNG here, before the
        # next epoch's dataloader iterator draws its seed, exactly as the uninterrupted run did.
        self._pending_rng.apply()
        uninstall_skip(trainer.train_dataloader)

    @override
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.checkpointer is not None:
            self.checkpointer.mark("backward")
            self.checkpointer.wait()

    @override
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.session.evaluation_started()  # no step tags during validation: the hang clock stops

    @override
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.evaluation_ended()

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.phase = Phase.OPTIMIZER

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.session.step_completed(step, lambda: training_state(trainer, megatron=self._megatron)) and self.session.insurance_due(step):
            self._save_insurance(trainer, step)

    def _save_insurance(self, trainer: Any, step: int) -> None:
        files = self.session.insurance
        assert files is not None  # noqa: S101
        trainer.save_checkpoint(files.path(step))
        if trainer.is_global_zero:
            files.prune()

    @override
    def state_dict(self) -> dict[str, Any]:
        # Carried inside Lightning checkpoints (the insurance): the exact training state of that step.
        return self.session.checkpoint_state()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning calls this when it restores callbacks from a checkpoint (fit(ckpt_path=...)); so does the
        # insurance fallback (_load_insurance). Kept, not applied: a recovery decides what is applied.
        self.session.load_checkpoint_state(state_dict)

    # -- failure and teardown ----------------------------------------------------------------------------

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.checkpointer is not None:
            self.checkpointer.on_failure(f"{type(exception).__name__}: {exception}")
        self._remove_hooks()

    @override
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._remove_hooks()
        if self.checkpointer is not None:
            self.checkpointer.close(success=True)

    def close_failed(self) -> None:
        """Close after a failed in-process attempt (:mod:`neighbor_ckpt.lightning.inprocess` calls it after the
        abort freed the snapshot threads): hooks removed, host slots kept for the next attempt's recovery."""
        self._remove_hooks()
        if self.checkpointer is not None:
            self.checkpointer.close(success=False)
            self.checkpointer = None

    def _remove_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

