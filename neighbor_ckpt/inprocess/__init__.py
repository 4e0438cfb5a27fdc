"""In-process recovery with hot spares (issue 17): the plain megatron-core loop (``recipes/mcore_gpt_plain_loop.py``
with ``neighbor_ckpt.inprocess.enabled``) and, through :mod:`neighbor_ckpt.lightning.inprocess`, Lightning / NeMo.

The surviving processes of a failure never restart: NVIDIA resiliency-ext's in-process wrapper
(``nvidia_resiliency_ext.inprocess``) aborts their process groups, re-assigns ranks (a hot spare, started with the
job and idle, takes the dead rank's place; survivors keep their rank numbers and so find their own host slots),
and calls the training function again, which rebuilds its process group, megatron-core's parallel state, model and
optimizer, and calls :meth:`~neighbor_ckpt.NeighborCheckpointer.recover` (the spare's store is empty: it pulls the
dead rank's unique state from the ring successor).

* :mod:`neighbor_ckpt.inprocess.wrapper` — :class:`InprocessRecovery`: the NVRx ``Wrapper`` built for this
  (timers, rank assignment, the gloo abort of :mod:`megatron_patches.nvrx_gloo`, the fallback), the per-attempt
  process group, the per-attempt clean-ups, the recovery timeline events;
* :mod:`neighbor_ckpt.inprocess.store_host` — the TCP store in a long-lived process of its own
  (``python -m neighbor_ckpt.inprocess.store_host``): rank 0's death must not take the stores down.

Launch: NVRx ``ft_launcher`` with one agent per node and ``--ft-restart-policy min-healthy`` (other agents' workers
keep running when one worker dies; plain torchrun stops the whole local worker group).

What is contained in process (``tests/e2e/test_inprocess_recovery.py``): a SIGKILLed rank (the spare takes its
place), an exception on one rank (every process stays), a SIGSTOPped rank (NVRx's monitor process terminates it at
``hard_timeout``, then as a kill). What falls back to the launcher's restart, announced (one line per rank, exit
:data:`FALLBACK_EXIT_CODE`): no spare left (a loss without spares, two ranks lost with one spare), a failure during
the recovery window, more than ``max_restarts``, a failure of the wrapper itself.

**Failure detection under in-process recovery is NVRx's, not** :mod:`neighbor_ckpt.runtime.detector`'s: with
``neighbor_ckpt.inprocess.enabled`` the checkpointer turns its own detector off and says so in one log line. Why:

* what ours does on a failure is wrong here: it SIGKILLs the failed local rank and *exits* the process with status
  75 so the launcher restarts the job, the very restart in-process recovery avoids; turning that into "interrupt the
  wrapper" would mean raising into a main thread blocked inside a gloo collective, which only the wrapper's abort
  (the socket shutdown of :mod:`megatron_patches.nvrx_gloo`) can free, and recording the interruption in NVRx's
  store in its private format;
* NVRx already watches each rank from two places: a monitor *thread* in the rank (interruptions recorded by any rank,
  an exception, a soft timeout: no Python progress of the main thread for ``soft_timeout``) and a monitor *process*
  beside it, which keeps running when the rank is SIGSTOPped or stuck in C code: it records the soft timeout, then
  after ``hard_timeout`` records the rank as terminated and kills it (SIGTERM, SIGKILL after
  ``termination_grace_time``), and it watches its siblings' heartbeats (``heartbeat_timeout``: a whole node gone).
  So every failure ours catches (a dead rank, a stopped rank, a hang) reaches the wrapper through NVRx;
* our detector's store is the rendezvous store at ``MASTER_PORT``, which nothing serves once rank 0 is gone under
  ``ft_launcher``; NVRx's stores live in the store host process (:mod:`neighbor_ckpt.inprocess.store_host`).

What ours did besides detecting, the lazy backup of the redundant state on a survivor, the worker does in its
exception handler (``ckpt.on_failure`` runs after the abort raised into the main thread), and a survivor keeps its
memory anyway. Cost: a hang is noticed after ``soft_timeout`` (5 s), a stopped rank replaced after ``hard_timeout``
(8 s) + ``termination_grace_time``, against ~3 s for ours.

**Attempts.** The launcher's restart count does not change across in-process restarts; :meth:`InprocessRecovery.
attempt_info` gives the checkpointer an :class:`~neighbor_ckpt.recovery.attempt.AttemptInfo` (restart count +
in-process iteration, and the abort times and spare activation for the recovery timeline, whose ``mode`` is then
``"in-process"``).

May import: the checkpointer and everything below it, :mod:`megatron_patches`; never the framework glue
(:mod:`neighbor_ckpt.glue`, ``lightning``, ``bridge``) nor :mod:`neighbor_ckpt.cli` (the rule:
:data:`neighbor_ckpt.layers.LAYERS`, checked by ``tests/unit/test_layers.py``).
"""

from neighbor_ckpt.inprocess.wrapper import FALLBACK_EXIT_CODE, InprocessRecovery, InprocessTimers

__all__ = ["InprocessRecovery", "InprocessTimers", "FALLBACK_EXIT_CODE"]
