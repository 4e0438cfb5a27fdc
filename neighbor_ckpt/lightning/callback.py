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

What it reports (global rank 0, ``neighbor_ckpt.report.status``): a status line every ``trainer.log_every_n_steps``
steps (``report.status_every_n_steps`` overrides; 0 = never); the same figures as metrics to every trainer
logger (``neighbor_ckpt/snapshot_ms``, ``wait_ms``, ``unique_bytes``, ``replica_lag``, ``stream_gbps``); after a
recovery, at the end of the first resumed step, the MTTR breakdown as one log line, as metrics
(``neighbor_ckpt/recovery/<phase>_s``) and as ``recovery_timeline.attempt<N>.png`` / ``.json`` in ``report.dir``
or ``<trainer.log_dir or default_root_dir>/neighbor_ckpt_reports/`` (:attr:`NeighborCheckpoint.last_timeline`).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from neighbor_ckpt.adapters import StateAdapter, TorchOptimizerAdapter, ZeroOptimizerAdapter, pin_bucket_layout
from neighbor_ckpt.checkpointer import NeighborCheckpointer, Phase, RecoveryResult
from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.runtime.detector import PAUSED
from neighbor_ckpt.errors import ConfigError, NeighborCkptError
from neighbor_ckpt.runtime.torchrun import prepare_torchrun_restart
from neighbor_ckpt.lightning._compat import callback_bases
from neighbor_ckpt.lightning._data import install_skip, uninstall_skip
from neighbor_ckpt.lightning._megatron import is_megatron_strategy, megatron_setup
from neighbor_ckpt.lightning._resume import (disk_checkpoint_consumed_samples, disk_checkpoint_step,
                                              skip_pending_disk_restore)
from neighbor_ckpt.report.status import resolve_status_interval
from neighbor_ckpt.snapshot.rng import capture_rng, restore_rng
from neighbor_ckpt.report.timeline import RecoveryTimeline

logger = logging.getLogger(__name__)

__all__ = ["NeighborCheckpoint"]

_INSURANCE_RE = re.compile(r"neighbor-insurance-step(\d+)\.ckpt$")


def default_report_dir(log_dir: str | Path) -> Path:
    """``<log_dir>/neighbor_ckpt_reports`` (not ``neighbor_ckpt``: a run started without a logger from a checkout of
    this repository has the package's source directory there)."""
    return Path(log_dir) / "neighbor_ckpt_reports"


def _mark_batch_completed(fit_loop_state: dict[str, Any]) -> dict[str, Any]:
    """The snapshot is taken in ``on_train_batch_end``, before Lightning counts the batch as completed.
    Record it as completed so a restore resumes with the next batch."""
    bp = fit_loop_state.get("epoch_loop.batch_progress")
    if isinstance(bp, dict):
        for scope in ("total", "current"):
            if isinstance(bp.get(scope), dict):
                bp[scope]["completed"] = bp[scope]["processed"]
    return fit_loop_state


class NeighborCheckpoint(*callback_bases()):  # type: ignore[misc]
    """Lightning callback: snapshot after every optimizer step, recover automatically on restart.

    Args:
        config: configuration (defaults when None).

    Raises:
        ConfigError: ``config`` is not a :class:`NeighborCkptConfig`.
    """

    def __init__(self, config: NeighborCkptConfig | None = None) -> None:
        super().__init__()
        if config is not None and not isinstance(config, NeighborCkptConfig):
            raise ConfigError(f"NeighborCheckpoint expects a NeighborCkptConfig, got {type(config).__name__}; "
                              "build one with NeighborCkptConfig.from_yaml(...) or NeighborCkptConfig(...)")
        self.config = config or NeighborCkptConfig()
        self.checkpointer: NeighborCheckpointer | None = None
        self.last_recovery: RecoveryResult | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._skip_batches = 0
        self._last_step = -1
        self._last_state: dict[str, Any] | None = None
        self._insurance_state: dict[str, Any] | None = None
        self._trainer: Any = None
        self._megatron = False
        self._hooks: Any = None
        self._group_ready: float | None = None
        self.attempt: Any = None
        """Which attempt this is, for the checkpointer (``attempt=``); set by in-process recovery
        (:mod:`neighbor_ckpt.lightning.inprocess`), else None: the launcher's restart count."""
        if self.config.enabled:
            # Must happen before the strategy creates its process group (the trainer has not connected yet).
            prepare_torchrun_restart()

    # -- set-up and recovery ----------------------------------------------------------------------------

    def _adapter(self, trainer: Any, pl_module: Any) -> StateAdapter:
        if len(trainer.optimizers) != 1:
            raise NeighborCkptError(f"NeighborCheckpoint supports exactly one optimizer, the module configured "
                                    f"{len(trainer.optimizers)}")
        opt = trainer.optimizers[0]
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(opt, ZeroRedundancyOptimizer):
            return ZeroOptimizerAdapter(pl_module, opt)
        return TorchOptimizerAdapter(pl_module, opt)

    @property
    def last_timeline(self) -> RecoveryTimeline | None:
        """MTTR breakdown of the recovery of this run (global rank 0, from the end of the first resumed step;
        ``.phases``, ``.path_png``, ``.path_json``). None on other ranks, and when nothing was recovered."""
        return self.checkpointer.last_timeline if self.checkpointer is not None else None

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # The first hook after the strategy created the process group: a marker of the recovery timeline.
        if self._group_ready is None:
            self._group_ready = time.time()

    @override
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.config.enabled:
            return
        if not dist.is_available() or not dist.is_initialized():
            logger.warning("NeighborCheckpoint: torch.distributed is not initialized (single-process run); disabled")
            self.config.enabled = False
            return
        self._trainer = trainer
        insurance = self._load_insurance if self._insurance_dir(trainer) is not None else None
        self._megatron = is_megatron_strategy(trainer.strategy)
        if self._megatron:
            from megatron_patches import install_hooks

            if insurance is not None:
                raise ConfigError("neighbor_ckpt.insurance under NeMo's MegatronStrategy: use NeMo's ModelCheckpoint "
                                  "(distributed checkpoint) as the insurance checkpoint and leave "
                                  "neighbor_ckpt.insurance.every_n_steps at 0")
            mc = megatron_setup(trainer)
            self.checkpointer = NeighborCheckpointer(self.config, adapter=mc.adapter, dp_group=mc.dp_group,
                                                     model_parallel_coord=mc.coord, capture_rng_state=False,
                                                     insurance=self._nemo_disk_resume, **self._attempt_kw())
            # NeMo runs backward inside training_step (no on_before_backward): the wait point and the step tags
            # come from mcore's gradient collectives and the mcore optimizer's step.
            self._hooks = install_hooks(self.checkpointer, mc.optimizer)
        else:
            # Same DDP bucket layout in every run, so the first step after a restart reduces like the original.
            pin_bucket_layout(trainer.strategy.model)
            self.checkpointer = NeighborCheckpointer(self.config, adapter=self._adapter(trainer, pl_module),
                                                     insurance=insurance, capture_rng_state=False,
                                                     **self._attempt_kw())
        self._attach_reporting(trainer)
        result = self.checkpointer.recover()
        self.last_recovery = result
        if result.restored and self._megatron and result.report.outcome == "insurance":
            pass  # NeMo's own resume loads everything (weights, optimizer, loops, data position) right after this hook
        elif result.restored:
            state = result.user_state if result.report.outcome == "restored" else self._insurance_state
            if state is None:
                raise NeighborCkptError("restored version carries no Lightning training state")
            self._apply(trainer, state)
            self._last_step = trainer.global_step
            if result.report.outcome == "restored":
                skip_pending_disk_restore(trainer, trainer.global_step)
            if trainer.is_global_zero:
                logger.warning("NeighborCheckpoint: resumed at global step %d (%s)", trainer.global_step,
                               result.report.summary())

    def _attempt_kw(self) -> dict[str, Any]:
        return {} if self.attempt is None else {"attempt": self.attempt}

    def _attach_reporting(self, trainer: Any) -> None:
        """The trainer's log interval, loggers and log directory for the checkpointer's reporter (all ranks:
        ``trainer.log_dir`` is a broadcast)."""
        assert self.checkpointer is not None  # noqa: S101
        rep = self.config.report
        report_dir = Path(rep.dir) if rep.dir else None
        if report_dir is None and rep.timeline:
            report_dir = default_report_dir(self._log_dir(trainer))
        self.checkpointer.reporter.attach(
            every_n_steps=resolve_status_interval(rep.status_every_n_steps, trainer.log_every_n_steps),
            loggers=list(trainer.loggers) if rep.log_metrics else [], report_dir=report_dir,
            process_group_ready=self._group_ready)

    @staticmethod
    def _log_dir(trainer: Any) -> str:
        try:
            log_dir = trainer.log_dir
        except Exception as e:  # noqa: BLE001 - a logger without a directory
            logger.debug("NeighborCheckpoint: trainer.log_dir unavailable (%s)", e)
            log_dir = None
        return str(log_dir or trainer.default_root_dir)

    def _apply(self, trainer: Any, state: dict[str, Any]) -> None:
        trainer.fit_loop.load_state_dict(state["fit_loop"])
        configs = trainer.lr_scheduler_configs
        if len(configs) != len(state["schedulers"]):
            raise NeighborCkptError(f"the snapshot has {len(state['schedulers'])} LR schedulers, the module "
                                    f"configured {len(configs)}")
        for cfg, sd in zip(configs, state["schedulers"]):
            cfg.scheduler.load_state_dict(sd)
        self._pending_rng = state["rng"]
        if state.get("consumed_samples") is not None:
            # NeMo's Megatron sampler resumes from a consumed-samples counter (set before the dataloader is built).
            from megatron_patches.nemo_data import resume_consumed_samples

            if not resume_consumed_samples(trainer, int(state["consumed_samples"])):
                raise NeighborCkptError("the snapshot carries a Megatron data position but this job has no "
                                        "MegatronDataSampler")
        else:
            self._skip_batches = int(state["batches_in_epoch"])

    def _insurance_dir(self, trainer: Any) -> Path | None:
        if self.config.insurance.every_n_steps <= 0 and self.config.insurance.dirpath is None:
            return None
        if self.config.insurance.dirpath is not None:
            return Path(self.config.insurance.dirpath)
        return Path(trainer.default_root_dir) / "neighbor_ckpt_insurance"

    def _insurance_files(self, trainer: Any) -> list[tuple[int, Path]]:
        d = self._insurance_dir(trainer)
        if d is None or not d.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _INSURANCE_RE.search(p.name))]
        return sorted(found)

    def _nemo_disk_resume(self) -> int | None:
        """Insurance under NeMo: the distributed checkpoint ``AutoResume`` points the trainer at (``trainer.ckpt_path``),
        which Lightning loads right after ``on_fit_start``. Nothing is loaded here; returns its step (None: none)."""
        path = self._trainer.ckpt_path if self._trainer is not None else None
        if not path:
            return None
        step = disk_checkpoint_step(path)
        consumed = disk_checkpoint_consumed_samples(path)
        if step is None and consumed is not None:
            from megatron_patches.nemo_data import steps_for_consumed_samples

            step = steps_for_consumed_samples(self._trainer, consumed)
        if step is None:
            raise NeighborCkptError(f"NeMo resumes from {path}, whose name carries neither step=N nor a whole number "
                                    f"of global batches in consumed_samples=: cannot tell which iteration it "
                                    f"restores. Keep {{step}} or {{consumed_samples}} in ModelCheckpoint's filename")
        logger.warning("NeighborCheckpoint: NeMo loads its distributed checkpoint %s (step %d) next", path, step)
        return step

    def _load_insurance(self) -> int | None:
        trainer = self._trainer
        files = self._insurance_files(trainer)
        if not files:
            return None
        step, path = files[-1]
        ckpt = torch.load(path, map_location="cpu", weights_only=False)  # Lightning's own checkpoint format
        trainer.lightning_module.load_state_dict(ckpt["state_dict"])
        trainer.optimizers[0].load_state_dict(ckpt["optimizer_states"][0])
        self._insurance_state = ckpt["callbacks"][self.state_key]["training_state"]
        logger.warning("NeighborCheckpoint: loaded insurance checkpoint %s (global step %d)", path, step)
        return step

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
        self._apply_pending_rng()
        if self.checkpointer is not None:
            self.checkpointer.mark("forward")
            if not self._megatron:  # under MegatronStrategy the batch is drawn inside NeMo's data step
                self.checkpointer.observe_input(batch)

    def _apply_pending_rng(self) -> None:
        if self._pending_rng is not None:
            restore_rng(self._pending_rng)
            self._pending_rng = None

    @override
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # A restore at the last batch of an epoch resumes at the epoch boundary: apply the RNG here, before the
        # next epoch's dataloader iterator draws its seed, exactly as the uninterrupted run did.
        self._apply_pending_rng()
        uninstall_skip(trainer.train_dataloader)

    @override
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.checkpointer is not None:
            self.checkpointer.mark("backward")
            self.checkpointer.wait()

    @override
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.mark(PAUSED)  # no step tags during validation: the hang clock stops

    @override
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.mark("validated")

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.phase = Phase.OPTIMIZER

    def _training_state(self, trainer: Any) -> dict[str, Any]:
        state = {
            "fit_loop": _mark_batch_completed(trainer.fit_loop.state_dict()),
            "schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
            "rng": capture_rng(),
            "batches_in_epoch": trainer.fit_loop.epoch_loop.batch_progress.current.processed,
        }
        if self._megatron:
            from megatron_patches.nemo_data import consumed_samples

            state["consumed_samples"] = consumed_samples(trainer)
        return state

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        ckpt = self.checkpointer
        if ckpt is None or trainer.global_step == self._last_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._last_step = trainer.global_step
        ckpt.phase = Phase.STEPPED
        self._last_state = self._training_state(trainer)
        ckpt.snapshot(trainer.global_step, user_state=self._last_state)
        n = self.config.insurance.every_n_steps
        if n > 0 and trainer.global_step % n == 0:
            self._save_insurance(trainer)

    def _save_insurance(self, trainer: Any) -> None:
        d = self._insurance_dir(trainer)
        assert d is not None  # noqa: S101
        trainer.save_checkpoint(d / f"neighbor-insurance-step{trainer.global_step}.ckpt")
        if trainer.is_global_zero:
            for _, old in self._insurance_files(trainer)[:-2]:
                old.unlink(missing_ok=True)

    @override
    def state_dict(self) -> dict[str, Any]:
        # Carried inside Lightning checkpoints (the insurance): the exact training state of that step.
        return {"training_state": self._last_state}

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
