"""In-process recovery (:mod:`neighbor_ckpt.inprocess`) under Megatron-Bridge: ``pretrain`` called again, in the same
processes, after every contained failure. Usage (under ``neighbor-ckpt launch`` with ``inprocess.enabled``)::

    inproc = InprocessRecovery.from_config(nc_config)
    callbacks = [NeighborCheckpoint(nc_config)]             # built once: the same instance in every generation

    run_pretrain(inproc, lambda attempt: make_config(), forward_step, callbacks)

What each generation does (:func:`run_pretrain`; :func:`attach` is the part around a user's own ``pretrain`` call):

* **Process group.** The generation's default group is created first, on the launch's store
  (:meth:`InprocessRecovery.init_process_group`, the backend of ``cfg.dist.distributed_backend``). Megatron-Bridge
  0.6's ``initialize.torch_dist_init`` then finds torch.distributed initialised and skips its own
  ``init_process_group`` (which would go to ``MASTER_ADDR:MASTER_PORT``, served by nobody in process); megatron-core's
  parallel state is built on it as always. ``pretrain`` does not destroy a group it did not create
  (``_maybe_destroy_process_group``): the engine does, after a failure.
* **The callbacks survive.** The user's callback instances are handed to every ``pretrain`` call.
  :class:`~neighbor_ckpt.bridge.NeighborCheckpoint` drops its previous attempt's state and takes the generation's
  ``AttemptInfo`` (:meth:`~neighbor_ckpt.bridge.NeighborCheckpoint.begin_attempt`: its records and timeline are the
  generation's, its progress tag goes to the engine's monitor); a failed attempt's checkpointer is closed with host
  slots kept by the engine's clean-ups, after the abort.
* **Bridge's global state** that outlives a failed ``pretrain`` (its ``_finish_train`` never ran) is dropped after the
  abort: :func:`megatron_patches.bridge.reset_global_state` (the engine resets megatron-core's parallel state).
* **Progress.** :class:`InprocessProgress` (appended for each call, after the user's callbacks) marks the
  generation's first completed step, which the engine's fallback rules read, and records ``recovered`` when training
  starts.

A spare must be hot when it is activated: import Megatron-Bridge (``pretrain``, the forward step) before
:func:`run_pretrain`.

May import: what :mod:`neighbor_ckpt.bridge` may (:mod:`neighbor_ckpt.inprocess`, :mod:`megatron_patches` among it).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Sequence

import torch
from megatron.bridge.training.callbacks import Callback

from neighbor_ckpt.bridge.callback import NeighborCheckpoint
from neighbor_ckpt.inprocess import InprocessRecovery
from neighbor_ckpt.inprocess.engine_state import Attempt

__all__ = ["attach", "run_pretrain", "InprocessProgress"]

logger = logging.getLogger(__name__)


class InprocessProgress(Callback):
    """The generation's first completed step (after the snapshot of every callback before it) and timeline events."""

    def __init__(self, inproc: InprocessRecovery) -> None:
        super().__init__()
        self.inproc = inproc
        self._marked = False

    def on_train_start(self, context: Any) -> None:
        self.inproc.event("recovered")  # after NeighborCheckpoint restored (or started fresh) at data init

    def on_train_step_end(self, context: Any) -> None:
        if not self._marked:
            self._marked = True
            self.inproc.mark_progress()


def attach(inproc: InprocessRecovery, callbacks: Sequence[Any]) -> list[Any]:
    """Make the next ``pretrain`` call one in-process attempt (inside the function given to ``inproc.run``, after
    the generation's process group exists): every :class:`NeighborCheckpoint` in ``callbacks`` starts a new attempt
    with the generation's ``AttemptInfo`` and is closed (host slots kept) if the attempt fails; Bridge's global state
    is dropped then. Returns the callbacks to give ``pretrain`` (``callbacks`` and an :class:`InprocessProgress`)."""
    from megatron_patches.bridge import reset_global_state

    for cb in callbacks:
        if isinstance(cb, NeighborCheckpoint):
            cb.begin_attempt(inproc.attempt_info())
            inproc.on_restart(cb.close_failed)
    inproc.on_restart(reset_global_state)  # runs before the engine's own megatron-core reset
    return [*callbacks, InprocessProgress(inproc)]


def run_pretrain(inproc: InprocessRecovery, make_config: Callable[[Attempt], Any], forward_step: Callable[..., Any],
                 callbacks: Sequence[Any], *, pretrain: Callable[..., Any] | None = None) -> Any:
    """``inproc.run`` over generations that each build their ``ConfigContainer`` with ``make_config(attempt)``
    (``pretrain`` changes the one it is given: a new one per call), create the generation's process group and call
    Bridge's ``pretrain(cfg, forward_step, callbacks=...)`` with the same ``callbacks`` every time. Returns None;
    raises ``SystemExit`` when in-process recovery gives up (the launchers then restart the job).

    ``pretrain``: Megatron-Bridge's (default) or a stand-in with its signature."""
    if pretrain is None:
        from megatron.bridge.training.pretrain import pretrain

    def attempt_fn(attempt: Attempt) -> Any:
        cfg = make_config(attempt)
        inproc.event("built")
        if torch.cuda.is_available():  # what Bridge does before its own init_process_group, which it skips now
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        inproc.init_process_group(backend=cfg.dist.distributed_backend)
        return pretrain(cfg, forward_step, callbacks=attach(inproc, callbacks))

    return inproc.run(attempt_fn)
