"""One session of neighbor checkpointing inside a training framework: the policy every framework callback follows.

A framework callback (Lightning / NeMo 2 today, Megatron-Bridge next) calls, in this order::

    config = set_up_callback(config)                             # in the callback's __init__ (glue.setup)
    session = Session(config, name="NeighborCheckpoint")
    if not session.distributed(): return                         # a single-process run: the callback turns off
    insurance = session.own_insurance(files, load_file)          # our insurance checkpoints, or
    insurance = session.framework_insurance(path_of, step_of, announce="Bridge loads its checkpoint")  # or theirs
    session.start(adapter=..., insurance=insurance, ...)         # builds the NeighborCheckpointer (collective)
    session.attach_reporting(log_interval=..., default_report_dir=...)   # the framework's interval, loggers, dirs
    resume = session.recover()                                   # collective; before the framework's data iterators
    if resume.state is not None:                                 # apply it (loops, schedulers, RNG) ...
        pos = resume.data_position                               # ... and the data position
        session.resumed_at(step)
    if resume.in_memory and <the framework will load a checkpoint>:
        disk_checkpoint_wins(path, step)                         # the newer iteration wins, announced
    ...
    if session.step_completed(step, training_state):             # after each optimizer step
        if session.insurance_due(step): <the framework saves ``session.insurance.path(step)``>
    session.evaluation_started() ... session.evaluation_ended()  # around validation: the hang clock stops
    callback.state_dict()  -> session.checkpoint_state()         # inside the framework's checkpoints
    callback.load_state_dict(d) -> session.load_checkpoint_state(d)

What is decided here, for every framework alike:

* **which training state is applied after a recovery**: the restored snapshot's user state; after an insurance
  fallback to our own checkpoint, the state carried inside it (the callback's ``state_dict``); after a fallback to the
  framework's checkpoint, none (the framework loads weights, optimizer, loops and data position itself, next);
* **the data position** (:class:`DataPosition`): a global consumed-samples counter when the state has one (Megatron
  samplers), else the batches of the current epoch already trained on (map-style loaders, skipped once);
* **when a snapshot is taken**: once per optimizer step (a repeated step number, gradient accumulation, takes none);
* **when our insurance checkpoint is due**, and the callback state's format inside a framework checkpoint
  (``{"training_state": ...}``, unchanged since the first release).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.distributed as dist

from neighbor_ckpt.checkpointer import NeighborCheckpointer, Phase
from neighbor_ckpt.recovery.recoverer import InsuranceLoader, RecoveryResult
from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.errors import NeighborCkptError
from neighbor_ckpt.glue.insurance import InsuranceFiles
from neighbor_ckpt.report.status import resolve_status_interval
from neighbor_ckpt.runtime.detector import PAUSED

logger = logging.getLogger(__name__)

__all__ = ["Session", "Resume", "DataPosition", "decide_resume", "STATE_KEY"]

STATE_KEY = "training_state"
"""The one key of the callback's state inside a framework checkpoint (``{"training_state": <state or None>}``)."""


@dataclass(frozen=True)
class DataPosition:
    """Where the data continues after a restore."""

    consumed_samples: int | None = None
    """A global consumed-samples counter (Megatron samplers): set it before the framework builds its data iterators."""
    batches_in_epoch: int = 0
    """Otherwise: batches of the current epoch already trained on, skipped once when the epoch's iterator starts."""

    @classmethod
    def of(cls, state: dict[str, Any]) -> DataPosition:
        """The data position a training state carries (``consumed_samples``, else ``batches_in_epoch``).

        Raises:
            NeighborCkptError: it carries neither.
        """
        if state.get("consumed_samples") is not None:
            return cls(consumed_samples=int(state["consumed_samples"]))
        if "batches_in_epoch" not in state:
            raise NeighborCkptError("the restored training state carries no data position (neither consumed_samples "
                                    "nor batches_in_epoch)")
        return cls(batches_in_epoch=int(state["batches_in_epoch"]))


@dataclass(frozen=True)
class Resume:
    """What the framework does after :meth:`Session.recover`."""

    result: RecoveryResult
    state: dict[str, Any] | None
    """The training state to apply now (loops, schedulers, RNG, data position); None: nothing to apply (a fresh start,
    or the framework's own checkpoint is the insurance and the framework loads it itself)."""
    framework_loads: bool = False
    """The insurance fallback chose the framework's own checkpoint: the framework loads everything from it next."""

    @property
    def in_memory(self) -> bool:
        """An in-memory version was restored: a framework checkpoint about to be loaded wins only if newer
        (:func:`~neighbor_ckpt.glue.insurance.disk_checkpoint_wins`)."""
        return self.result.report.outcome == "restored"

    @property
    def data_position(self) -> DataPosition | None:
        return DataPosition.of(self.state) if self.state is not None else None


def decide_resume(result: RecoveryResult, *, insurance_state: dict[str, Any] | None, framework_insurance: bool,
                  framework: str = "Lightning") -> Resume:
    """Pure: which training state the framework applies after a recovery.

    ``insurance_state``: the callback's state read from our insurance checkpoint (when the recovery loaded one);
    ``framework_insurance``: the framework's own checkpoint is the insurance (it loads itself).

    Raises:
        NeighborCkptError: a version was restored that carries no training state.
    """
    if not result.restored:
        return Resume(result, None)
    if result.report.outcome == "insurance" and framework_insurance:
        return Resume(result, None, framework_loads=True)
    state = result.user_state if result.report.outcome == "restored" else insurance_state
    if state is None:
        raise NeighborCkptError(f"restored version carries no {framework} training state")
    return Resume(result, state)


class Session:
    """The framework-agnostic part of a framework callback: owns the checkpointer, the insurance and the resume policy.

    Args:
        config: the configuration (the callback's).
        name: how the log names the callback (``"NeighborCheckpoint"``).
        framework: the framework's name in messages (``"Lightning"``).
    """

    def __init__(self, config: NeighborCkptConfig, *, name: str = "NeighborCheckpoint",
                 framework: str = "Lightning") -> None:
        self.config = config
        self.name = name
        self.framework = framework
        self.checkpointer: NeighborCheckpointer | None = None
        self.last_recovery: RecoveryResult | None = None
        self.last_state: dict[str, Any] | None = None
        """The training state of the last snapshot: what a framework checkpoint written now carries."""
        self.insurance: InsuranceFiles | None = None
        """Our own insurance checkpoints (None: not configured, or the framework's checkpoint is the insurance)."""
        self._framework_insurance = False
        self._loaded_state: dict[str, Any] | None = None
        self._last_step = -1

    # -- insurance ---------------------------------------------------------------------------------------

    def own_insurance(self, files: InsuranceFiles | None, load: Callable[[Path], None]) -> InsuranceLoader | None:
        """The insurance loader for our own insurance checkpoints (None when not configured): the newest one wins.

        ``load(path)`` loads it into the framework's objects (weights, optimizer) and hands the callback's state in it
        to :meth:`load_checkpoint_state` (through the framework's callback-state API); runs on every rank inside
        :meth:`recover`, only when the recovery falls back to insurance."""
        self.insurance = files
        if files is None:
            return None

        def loader() -> int | None:
            newest = files.newest()
            if newest is None:
                return None
            step, path = newest
            self._loaded_state = None
            load(path)
            logger.warning("%s: loaded insurance checkpoint %s (global step %d)", self.name, path, step)
            return step

        return loader

    def framework_insurance(self, path: Callable[[], Any], step_of: Callable[[Any], int],
                            *, announce: str) -> InsuranceLoader:
        """The insurance loader when the framework's own checkpoint is the insurance (NeMo's ``AutoResume``,
        Megatron-Bridge's ``checkpoint.load``): the framework loads it itself after the restore point, so nothing is
        loaded here; the loader returns its iteration (``step_of(path())``; None: no checkpoint to resume from) and
        announces it (``announce``: what the framework does, e.g. "NeMo loads its distributed checkpoint")."""
        self._framework_insurance = True

        def loader() -> int | None:
            where = path()
            if not where:
                return None
            step = step_of(where)
            logger.warning("%s: %s %s (step %d) next", self.name, announce, where, step)
            return step

        return loader

    def insurance_due(self, step: int) -> bool:
        """Whether our insurance checkpoint is written after optimizer step ``step``."""
        return self.insurance is not None and self.insurance.due(step)

    # -- the callback's state inside framework checkpoints ------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """The callback's state for a framework checkpoint: the exact training state of the last snapshot."""
        return {STATE_KEY: self.last_state}

    def load_checkpoint_state(self, state: Any) -> None:
        """The callback's state read back from a framework checkpoint (any release's format: ``{"training_state":
        <dict or None>}``). Kept for an insurance fallback to that checkpoint; nothing is applied here."""
        training = state.get(STATE_KEY) if isinstance(state, dict) else None
        if training is not None and not isinstance(training, dict):
            logger.warning("%s: ignoring a checkpoint's callback state of type %s", self.name, type(training).__name__)
            training = None
        self._loaded_state = training

    # -- start and recovery ------------------------------------------------------------------------------

    def distributed(self) -> bool:
        """Whether torch.distributed is initialized. In a single-process run it is not: a warning says so, the
        callback turns off (``config.enabled = False``) and this returns False."""
        if dist.is_available() and dist.is_initialized():
            return True
        logger.warning("%s: torch.distributed is not initialized (single-process run); disabled", self.name)
        self.config.enabled = False
        return False

    def start(self, *, adapter: Any, insurance: InsuranceLoader | None, attempt: Any = None,
              **kwargs: Any) -> NeighborCheckpointer:
        """Build the checkpointer (collective: every rank). ``kwargs`` go to :class:`NeighborCheckpointer`; the
        training state (RNG included) is the callback's, so the checkpointer captures no RNG of its own."""
        kwargs.setdefault("capture_rng_state", False)
        if attempt is not None:
            kwargs["attempt"] = attempt
        self.checkpointer = NeighborCheckpointer(self.config, adapter=adapter, insurance=insurance, **kwargs)
        return self.checkpointer

    def attach_reporting(self, *, log_interval: int | None, default_report_dir: Callable[[], Path | None],
                         loggers: Sequence[Any] | None = None, process_group_ready: float | None = None) -> None:
        """Hand the framework's reporting to the checkpointer's reporter (after :meth:`start`, on every rank).

        Args:
            log_interval: the framework's log interval in steps: the status line's, unless
                ``report.status_every_n_steps`` sets one.
            default_report_dir: where the recovery timeline goes when ``report.dir`` is unset (None: the reporter's
                default); called only then, and only with ``report.timeline`` on (on every rank: it may be a
                framework collective).
            loggers: the framework's metric loggers (none when ``report.log_metrics`` is off; None: left as they are).
            process_group_ready: when the framework's process group was ready (unix time), for the timeline.
        """
        if self.checkpointer is None:
            raise NeighborCkptError(f"{self.name}: attach_reporting() before start()")
        rep = self.config.report
        report_dir = Path(rep.dir) if rep.dir else (default_report_dir() if rep.timeline else None)
        if loggers is not None:
            loggers = list(loggers) if rep.log_metrics else []
        self.checkpointer.reporter.attach(every_n_steps=resolve_status_interval(rep.status_every_n_steps, log_interval),
                                          loggers=loggers, report_dir=report_dir,
                                          process_group_ready=process_group_ready)

    def recover(self) -> Resume:
        """Collective: run the recovery and say what the framework applies.

        Raises:
            NeighborCkptError: a version was restored whose training state is missing (a snapshot taken without one,
                an insurance checkpoint without the callback's state).
        """
        if self.checkpointer is None:
            raise NeighborCkptError(f"{self.name}: recover() before start()")
        result = self.checkpointer.recover()
        self.last_recovery = result
        return decide_resume(result, insurance_state=self._loaded_state,
                             framework_insurance=self._framework_insurance, framework=self.framework)

    def resumed_at(self, step: int) -> None:
        """The framework's step counter after applying the restored state (the next snapshot is of a later step)."""
        self._last_step = step

    # -- per step ----------------------------------------------------------------------------------------

    def step_completed(self, step: int, training_state: Callable[[], dict[str, Any]]) -> bool:
        """After optimizer step ``step`` (the framework's step counter, already incremented): snapshot it with the
        training state ``training_state()``. False, and nothing taken, when no optimizer step ran since the last call
        (gradient accumulation: the step counter did not move) or before :meth:`start`."""
        ckpt = self.checkpointer
        if ckpt is None or step == self._last_step:
            return False
        self._last_step = step
        ckpt.phase = Phase.STEPPED
        self.last_state = training_state()
        ckpt.snapshot(step, user_state=self.last_state)
        return True

    def evaluation_started(self) -> None:
        """Validation / evaluation begins: no step tags until it ends, so the hang clock stops."""
        if self.checkpointer is not None:
            self.checkpointer.mark(PAUSED)

    def evaluation_ended(self) -> None:
        """Validation / evaluation ended: the hang clock runs again."""
        if self.checkpointer is not None:
            self.checkpointer.mark("validated")
