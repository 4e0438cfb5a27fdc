"""``NeighborCheckpoint``: per-iteration neighbor checkpointing as one Megatron-Bridge callback.

Example (all a Bridge user adds; on CPU, ``megatron_patches.enable_cpu(nemo=False)`` first)::

    from neighbor_ckpt.bridge import NeighborCheckpoint
    pretrain(cfg, forward_step, callbacks=[NeighborCheckpoint()])   # or NeighborCheckpoint(NeighborCkptConfig(...))
    # under `torchrun --max-restarts N`: a restarted attempt resumes by itself

What happens where (Megatron-Bridge 0.6):

* **construction** (before ``pretrain`` creates the process group): torchrun's restart is prepared (a fresh
  rendezvous store per attempt), and the configuration check is registered for the start of ``pretrain``
  (:func:`megatron_patches.bridge.on_pretrain_config`: before Bridge could wrap ``_pretrain`` in its own in-process
  restart, which is refused, as is its NVRx local checkpointing: both would restore over ours).
* **on_data_init_start** (Bridge's own event inside ``setup()``, after the model, optimizer, scheduler and Bridge's own
  checkpoint load, before the data iterators are built; every rank): the configuration is checked again
  (:func:`~neighbor_ckpt.bridge.checks.check_bridge_config`), the checkpointer is built on the Megatron adapter (the
  distributed optimizer's fp32 main-param shards and Adam moments, the RNG tracker streams; weights regenerate by
  all-gather), the wait point, step tags and the data check's input are hooked into megatron-core
  (:func:`megatron_patches.install_hooks`), and the recovery runs. After a restore, ``train_state`` (step, consumed
  and skipped train samples, consumed valid samples, the FLOPs counter) and the scheduler are set from the restored
  state, so the loop and the data iterators start at the restored step and sample; the torch RNG is set at
  ``on_train_start`` (building the data loader's iterator draws from it, as in the uninterrupted run).
* **which wins**: when Bridge's ``checkpoint.load`` also loaded a checkpoint, the newer iteration wins, announced: an
  in-memory version that is newer is applied over it; a Bridge checkpoint that is newer is loaded again over the
  in-memory version. Bridge's checkpoint is the insurance: when no in-memory version is complete (both copies of a
  rank's state lost), the recovery falls back to it, announced, and Bridge's load stands (the torch RNG it restored
  is set again at ``on_train_start``, after the data iterators drew from it: the replay is bit-exact too).
* **per step**: ``on_train_step_end`` snapshots completed step ``train_state.step`` (Bridge increments the step,
  consumed samples and FLOPs after this event: the snapshot carries the values after the increment).
* **reporting** (global rank 0): the status line every ``logger.log_interval`` steps (``report.status_every_n_steps``
  overrides), the same figures and, after a recovery, the MTTR phases as scalars to ``logger.tensorboard_dir`` (an
  event file of rank 0's own beside Bridge's, which the last rank writes), and
  the recovery timeline in ``report.dir`` (default: ``<checkpoint.save>/neighbor_ckpt_reports``, else the store's
  report directory).

**In process** (:mod:`neighbor_ckpt.bridge.inprocess`): the instance built once is handed to every generation's
``pretrain``; at the start of each it drops the previous attempt's state (:meth:`NeighborCheckpoint.begin_attempt`, or
at ``on_data_init_start`` of a ``pretrain`` called again) and builds its checkpointer with the generation's attempt.

Not covered: a survivor's exception has no Bridge event; the checkpointer's SIGTERM handler (torchrun stops the
survivors) and the failure detector handle it. Our own insurance checkpoints (``insurance.every_n_steps``) are refused:
Bridge's ``checkpoint.save`` / ``save_interval`` is the insurance.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.bridge.training.callbacks import Callback

from neighbor_ckpt.bridge.checks import check_bridge_config
from neighbor_ckpt.checkpointer import NeighborCheckpointer
from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.glue import rng
from neighbor_ckpt.glue.adapters import megatron_adapter
from neighbor_ckpt.glue.insurance import disk_checkpoint_wins
from neighbor_ckpt.glue.session import Session
from neighbor_ckpt.glue.setup import set_up_callback

logger = logging.getLogger(__name__)

__all__ = ["NeighborCheckpoint"]

FRAMEWORK = "Megatron-Bridge"
TRAIN_STATE_KEYS = ("step", "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples",
                    "floating_point_operations_so_far")
"""The ``train_state`` counters a snapshot carries and a restore sets (``do_train`` etc. are set by the iterators)."""


def _announce(msg: str, *args: Any) -> None:
    """Global rank 0, at INFO: Megatron-Bridge's logging drops every WARNING record by default
    (``logger.filter_warnings``), so what is announced under Bridge is announced at INFO."""
    if dist.get_rank() == 0:
        logger.info("NeighborCheckpoint: " + msg, *args)


class _TensorBoard:
    """A TensorBoard writer in Bridge's ``logger.tensorboard_dir`` as the reporter's logger (``log_metrics`` /
    ``save``).

    Bridge writes its TensorBoard from the last global rank only; our figures are reported from global rank 0. So
    rank 0 writes them with a writer of its own into the same directory (an event file of its own, suffix
    ``.neighbor_ckpt``: TensorBoard shows the files of one directory as one run), unless it is that last rank."""

    def __init__(self, writer: Any, *, owned: bool = False) -> None:
        self.writer = writer
        self.owned = owned
        """Whether the writer is ours (closed with the callback) rather than Bridge's."""

    @classmethod
    def for_reporting_rank(cls, state: Any) -> "_TensorBoard | None":
        """The writer for global rank 0 (None elsewhere, or when Bridge's ``logger.tensorboard_dir`` is unset)."""
        log_cfg = state.cfg.logger
        if dist.get_rank() != 0 or not getattr(log_cfg, "tensorboard_dir", None):
            return None
        if dist.get_world_size() == 1:
            return cls(state.tensorboard_logger)
        from torch.utils.tensorboard.writer import SummaryWriter

        return cls(SummaryWriter(log_dir=log_cfg.tensorboard_dir, filename_suffix=".neighbor_ckpt",
                                 max_queue=getattr(log_cfg, "tensorboard_queue_size", 10)), owned=True)

    def close(self) -> None:
        if self.owned:
            self.writer.close()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def save(self) -> None:
        self.writer.flush()


class NeighborCheckpoint(Callback):
    """Megatron-Bridge callback: snapshot after every optimizer step, recover automatically on restart.

    Args:
        config: configuration (defaults when None).
        bridge_config: the ``ConfigContainer`` given to ``pretrain``, to refuse what is not supported at once (it is
            checked again, on every rank, inside ``pretrain``).

    Raises:
        ConfigError: ``config`` is not a :class:`NeighborCkptConfig`, asks for our own insurance checkpoints, or
            ``bridge_config`` has an option :func:`~neighbor_ckpt.bridge.checks.check_bridge_config` refuses.
        UnsupportedVersionError: megatron-bridge is not 0.6 (the configuration check's patch is written for it).
    """

    def __init__(self, config: NeighborCkptConfig | None = None, *, bridge_config: Any = None) -> None:
        super().__init__()

        def refuse(cfg: NeighborCkptConfig) -> None:
            if cfg.enabled and (cfg.insurance.every_n_steps or cfg.insurance.dirpath):
                raise ConfigError("neighbor_ckpt.insurance under Megatron-Bridge: Bridge's own checkpoint "
                                  "(checkpoint.save, save_interval, checkpoint.load) is the insurance; leave "
                                  "neighbor_ckpt.insurance.every_n_steps at 0 and dirpath unset")
            if bridge_config is not None:
                check_bridge_config(bridge_config)

        # The configuration checked (Bridge's refusals first); torchrun's restart and a replaced node's slot prepared
        # before pretrain creates the process group.
        self.config = set_up_callback(config, refuse=refuse)
        self.attempt: Any = None
        """Which attempt this is, for the checkpointer (None: the launcher's restart count); in process, the
        generation's ``AttemptInfo`` (:meth:`begin_attempt`)."""
        self._hooks: Any = None
        self._event: Any = None
        self._tensorboard: _TensorBoard | None = None
        """Rank 0's TensorBoard writer (made at the first ``on_train_start``; kept across in-process generations)."""
        self._new_attempt_state()
        if self.config.enabled:
            from megatron_patches.bridge import on_pretrain_config

            self._event = on_pretrain_config(check_bridge_config)

    def _new_attempt_state(self) -> None:
        """What belongs to one ``pretrain`` call (the rest of the instance lives as long as the process)."""
        self.session = Session(self.config, name="NeighborCheckpoint", framework=FRAMEWORK)
        """Insurance, resume and data-position policy (:mod:`neighbor_ckpt.glue`); owns the checkpointer."""
        self.winner: str | None = None
        """After the recovery: ``"in-memory"``, ``"bridge-checkpoint"`` or None (a fresh start)."""
        self._pending_rng = rng.PendingRng()
        self._dp_size = 1

    def begin_attempt(self, attempt: Any = None) -> None:
        """Before each ``pretrain`` call of an in-process generation (:func:`neighbor_ckpt.bridge.inprocess.attach`
        calls it): the previous call's state is dropped (its checkpointer closed, host slots kept) and ``attempt``
        (the generation's ``AttemptInfo``) is what the next checkpointer is built with. A ``pretrain`` called again
        without it starts over the same way, at its data-init event, with the attempt it had."""
        self._reset_attempt()
        self.attempt = attempt

    def close_failed(self) -> None:
        """Close after a failed in-process attempt (the engine's clean-ups call it after the abort freed the
        snapshot threads): hooks removed, host slots kept for the next generation's recovery."""
        self._remove_hooks()
        ckpt = self.session.checkpointer
        if ckpt is not None:
            ckpt.close(success=False)

    def _reset_attempt(self) -> None:
        if self.session.checkpointer is not None:
            self.close_failed()  # a no-op when on_train_end or the engine's clean-up closed it
        self._remove_hooks()
        self._new_attempt_state()

    @property
    def checkpointer(self) -> NeighborCheckpointer | None:
        """The plain-loop checkpointer under this callback (None before ``pretrain``'s setup and when disabled)."""
        return self.session.checkpointer

    @property
    def last_recovery(self) -> Any:
        """What the recovery of this run did: the checkpointer's ``RecoveryResult`` (None before ``pretrain``'s setup
        and when disabled)."""
        return self.session.last_recovery

    # -- set-up and recovery (the data-init event) ----------------------------------------------------------

    def on_data_init_start(self, context: Any) -> None:
        from megatron_patches.bridge import data_init

        self._on_data_init(data_init(context))

    def _on_data_init(self, ev: Any) -> None:
        if not self.config.enabled:
            return
        if self.session.checkpointer is not None:
            self._reset_attempt()  # pretrain called again (in process: the next generation): a new attempt
        check_bridge_config(ev.cfg)
        if not self.session.distributed():
            return
        from megatron.core import parallel_state

        from megatron_patches import install_hooks, mcore_groups

        cfg = ev.cfg
        groups = mcore_groups()
        self._dp_size = parallel_state.get_data_parallel_world_size()
        load_dir = cfg.checkpoint.load or cfg.checkpoint.pretrained_checkpoint
        loaded = ev.loaded_step  # steps Bridge's checkpoint had completed: its last step is loaded - 1
        insurance = self.session.framework_insurance(
            lambda: load_dir if loaded else None, lambda _path: int(loaded) - 1,
            announce="Megatron-Bridge's own checkpoint (checkpoint.load), already loaded, is the insurance:")
        ckpt = self.session.start(adapter=megatron_adapter(ev.model, ev.optimizer), insurance=insurance,
                                  dp_group=groups.dp_group, model_parallel_coord=groups.coord, attempt=self.attempt,
                                  capture_rng_state=False, global_batch=cfg.train.global_batch_size,
                                  micro_batch_size=cfg.train.micro_batch_size)
        # The wait point before the first gradient collective, step tags on the optimizer step, and every micro-batch
        # megatron-core's forward-backward draws to the data check (train() takes get_forward_backward_func() later).
        self._hooks = install_hooks(ckpt, ev.optimizer)
        self.session.attach_reporting(log_interval=cfg.logger.log_interval, default_report_dir=lambda: (
            Path(cfg.checkpoint.save) / "neighbor_ckpt_reports" if cfg.checkpoint.save else None))
        resume = self.session.recover()
        restored = resume.result.iteration
        if resume.framework_loads:
            self.winner = "bridge-checkpoint"
            self.session.resumed_at(int(ev.train_state.step) - 1)
            self._pending_rng.keep_current()  # as Bridge's load left it: re-set after the iterators draw from it
            _announce("no complete in-memory version: Megatron-Bridge's checkpoint %s stands (iteration %d, %d steps "
                      "done)", load_dir, int(loaded) - 1, int(loaded))
            return
        if resume.state is None:
            return
        if loaded is not None and resume.in_memory and disk_checkpoint_wins(load_dir, restored,
                                                                             disk_step=int(loaded) - 1):
            ev.reload()  # Bridge's checkpoint is newer: loaded again over the in-memory version, announced
            self.winner = "bridge-checkpoint"
            self._pending_rng.keep_current()
            self.session.resumed_at(int(ev.train_state.step) - 1)
            _announce("Megatron-Bridge's checkpoint %s (iteration %d) is newer than the in-memory version (iteration "
                      "%d): loaded again over it", load_dir, int(loaded) - 1, restored)
            return
        self._apply(resume.state, ev.train_state, ev.scheduler)
        self.winner = "in-memory"
        self.session.resumed_at(restored)
        if loaded is not None:
            _announce("the in-memory version (iteration %d) is newer than Megatron-Bridge's checkpoint %s (iteration "
                      "%d, loaded first): applied over it", restored, load_dir, int(loaded) - 1)
        _announce("resumed at step %d, %d samples consumed (%s)", ev.train_state.step,
                  ev.train_state.consumed_train_samples, resume.result.report.summary())

    def _apply(self, state: dict[str, Any], train_state: Any, scheduler: Any) -> None:
        """The restored training state into Bridge's objects (the torch RNG waits for ``on_train_start``)."""
        train_state.step = int(state["step"])
        train_state.consumed_train_samples = int(state["consumed_samples"])
        for key in TRAIN_STATE_KEYS[2:]:
            if key in state:
                setattr(train_state, key, state[key])
        if scheduler is not None and state.get("scheduler") is not None:
            # megatron-core's load_state_dict *adds* the loaded step count (step(increment=num_steps)) to the
            # current one, which Bridge's own checkpoint load may have set already: start from zero
            scheduler.num_steps = 0
            scheduler.load_state_dict(state["scheduler"])
        self._pending_rng.keep(state.get("rng"))

    def _training_state(self, context: Any) -> dict[str, Any]:
        """What a snapshot of the step just completed carries: ``train_state`` as Bridge leaves it after this event
        (step + 1, consumed samples + the global batch, the FLOPs of the batch added; Bridge's own formulas), the
        scheduler, the torch/numpy/python RNG."""
        from megatron.bridge.training.utils import flop_utils
        from megatron.core.num_microbatches_calculator import (get_current_global_batch_size,
                                                                get_current_running_global_batch_size,
                                                                get_num_microbatches)

        ts, cfg = context.state.train_state, context.state.cfg
        batch = self._dp_size * cfg.train.micro_batch_size * get_num_microbatches()
        return {
            "step": ts.step + 1,
            "consumed_samples": ts.consumed_train_samples + batch,
            "skipped_train_samples": ts.skipped_train_samples
            + get_current_global_batch_size() - get_current_running_global_batch_size(),
            "consumed_valid_samples": ts.consumed_valid_samples,
            "floating_point_operations_so_far": ts.floating_point_operations_so_far
            + flop_utils.num_floating_point_operations(cfg, batch),
            "scheduler": context.scheduler.state_dict() if context.scheduler is not None else None,
            "rng": rng.capture(),
        }

    # -- per step --------------------------------------------------------------------------------------------

    def on_train_start(self, context: Any) -> None:
        self._pending_rng.apply()
        ckpt = self.checkpointer
        if ckpt is not None and self.config.report.log_metrics:
            if self._tensorboard is None:
                self._tensorboard = _TensorBoard.for_reporting_rank(context.state)
            if self._tensorboard is not None:
                ckpt.reporter.attach(loggers=[self._tensorboard])

    def on_train_step_start(self, context: Any) -> None:
        self._pending_rng.apply()
        if self.checkpointer is not None:
            self.checkpointer.mark("forward")

    def on_train_step_end(self, context: Any) -> None:
        # Step train_state.step is complete (weights updated); Bridge increments the counters after this event.
        self.session.step_completed(context.state.train_state.step, lambda: self._training_state(context))

    def on_eval_start(self, context: Any) -> None:
        self.session.evaluation_started()  # no step tags during evaluation: the hang clock stops

    def on_eval_end(self, context: Any) -> None:
        self.session.evaluation_ended()

    def on_train_end(self, context: Any) -> None:
        self._remove_hooks()
        if self.checkpointer is not None:
            self.checkpointer.close(success=True)
        if self._tensorboard is not None:
            self._tensorboard.writer.flush()

    def close(self) -> None:
        """Remove every hook and the configuration check (idempotent); ``on_train_end`` removes the training hooks."""
        self._remove_hooks()
        if self._event is not None:
            self._event.remove()
            self._event = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def _remove_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
