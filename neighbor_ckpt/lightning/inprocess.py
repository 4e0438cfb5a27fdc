"""In-process recovery (:mod:`neighbor_ckpt.inprocess`) for a Lightning / NeMo 2 trainer.

The training entry point (``trainer.fit``, NeMo's ``llm.pretrain``) is called again in the same process after every
contained failure; each attempt builds its own trainer, strategy and model (imports, the host store and the host
slots stay). Usage::

    inproc = InprocessRecovery.from_config(job.neighbor_ckpt, ranks=job.world_size)  # under `neighbor-ckpt launch`
    prepare_process()                         # once, before the first attempt (after the imports)

    def make(attempt):                        # -> (trainer, entry point), built anew for every attempt
        fn = fdl.build(recipe)                # e.g. NeMo's llm.pretrain partial
        return fn.keywords["trainer"], fn

    run_trainer(inproc, make)

What :func:`attach` does to an attempt's trainer:

* **Process group.** Lightning's strategy creates the default group itself (``init_process_group`` with ``env://``
  at ``MASTER_ADDR:MASTER_PORT``, which in process nobody serves, with keys the previous attempt already used).
  NeMo's ``MegatronStrategy`` takes the store to create it on as its public ``store`` attribute: it gets this
  generation's prefix of the launch's store, and then does everything else
  as always (megatron-core parallel state, the data sampler). A plain Lightning strategy has no such attribute: the
  group is created before ``fit`` (:meth:`InprocessRecovery.init_process_group`) and Lightning skips its own.
  Ranks and world size come from ``RANK`` / ``WORLD_SIZE``, which the engine rewrites for every generation (Lightning's
  ``TorchElasticEnvironment`` reads them).
* **Clean-up after the abort.** A failed attempt's :class:`~neighbor_ckpt.NeighborCheckpoint` is closed with
  ``close(success=False)`` (host slots kept) by the engine's clean-ups, after the abort freed its threads, and
  megatron-core's parallel state and the process group are dropped there (:mod:`megatron_patches.parallel_reset`).
* **NeMo's telemetry.** The spans a failed attempt left open are stopped after the abort
  (:mod:`megatron_patches.nemo_telemetry`).
* **Progress.** :class:`InprocessProgress` marks the attempt's first completed step (after the snapshot), which the
  engine's fallback rules read, and records timeline events (``pg_ready``, ``recovered``).

**Start.** Every process (spares included) imports everything its attempts need before :func:`run_trainer` (a spare
must be hot when it is activated). There is no wait of its own for the slowest process's imports: generation 0's
barrier is that wait (``inprocess.barrier_timeout_s``, in the job file), and unlike a count of arrivals it stops
waiting for a process its launcher declared dead (one that died while importing).

``prepare_process`` turns off :func:`~neighbor_ckpt.runtime.torchrun.prepare_torchrun_restart` (the callback calls
it at construction): that fix re-hosts torchrun's rendezvous store on rank 0 for launcher restarts; in process the
group lives on the external store, and rank 0 must not host anything the survivors need.

May import: what :mod:`neighbor_ckpt.lightning` may (:mod:`neighbor_ckpt.inprocess` among it); never :mod:`neighbor_ckpt.cli`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from neighbor_ckpt.inprocess import InprocessRecovery
from neighbor_ckpt.inprocess.engine_state import Attempt
from neighbor_ckpt.lightning._compat import callback_bases
from neighbor_ckpt.lightning._megatron import is_megatron_strategy
from neighbor_ckpt.lightning.callback import NeighborCheckpoint

__all__ = ["prepare_process", "attach", "run_trainer", "InprocessProgress"]

logger = logging.getLogger(__name__)


def prepare_process() -> None:
    """Once per process, before the first attempt (see the module docstring)."""
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


class InprocessProgress(*callback_bases()):  # type: ignore[misc]
    """Timeline events of an attempt and its first completed step (appended after every other callback)."""

    def __init__(self, inproc: InprocessRecovery) -> None:
        super().__init__()
        self.inproc = inproc
        self._marked = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.inproc.event("pg_ready")  # the first hook after the strategy created the process group

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.inproc.event("recovered")  # after NeighborCheckpoint.on_fit_start restored (or started fresh)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._marked:
            self._marked = True
            self.inproc.mark_progress()


def _close_failed(cb: NeighborCheckpoint) -> Callable[[], None]:
    def close() -> None:
        cb.close_failed()

    return close


def attach(inproc: InprocessRecovery, attempt: Attempt, trainer: Any) -> None:
    """Make ``trainer`` (built for ``attempt``, not yet fitted) run as one in-process attempt."""
    strategy = trainer.strategy
    if hasattr(strategy, "store"):  # NeMo's MegatronStrategy: init_process_group(..., store=strategy.store)
        strategy.store = inproc.process_group_store()
    else:
        inproc.init_process_group()
    for cb in trainer.callbacks:
        if isinstance(cb, NeighborCheckpoint):
            # Before fit: the callback's on_fit_start builds the checkpointer with it, which hands its progress tag
            # to the engine's monitor (AttemptInfo.progress_sink) instead of starting a detector of its own.
            cb.attempt = inproc.attempt_info()  # in-process attempts: their own records, timeline mode
            inproc.on_restart(_close_failed(cb))
    if is_megatron_strategy(strategy):
        from megatron_patches.nemo_telemetry import end_open_spans

        inproc.on_restart(end_open_spans)  # NeMo's telemetry refuses a second training_loop span otherwise
    trainer.callbacks.append(InprocessProgress(inproc))


def run_trainer(inproc: InprocessRecovery, make: Callable[[Attempt], tuple[Any, Callable[[], Any]]]) -> Any:
    """``inproc.run`` over attempts that each build a trainer with ``make(attempt)`` and call its entry point.
    Returns the entry point's value (None on a spare that was never used); raises ``SystemExit`` when in-process
    recovery gives up (the launcher then restarts the job)."""

    def attempt_fn(attempt: Attempt) -> Any:
        trainer, entry = make(attempt)
        inproc.event("built")
        attach(inproc, attempt, trainer)
        return entry()

    return inproc.run(attempt_fn)
