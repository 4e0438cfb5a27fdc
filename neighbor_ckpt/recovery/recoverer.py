"""The recovery policy in one place: which outcome a (re)start gets, and everything that follows from it.

Outcomes, and when each is chosen (:func:`decide_outcome`, :func:`settle_insurance`; pure, identical on every
rank because every input is the result of a collective or the same configuration everywhere):

* **restore** an in-memory version: every rank can restore the same iteration (own slot, the replica on its
  successor, the DP group's lazy backup); :func:`~neighbor_ckpt.recovery.reconcile.reconcile` picks it;
* **insurance**: snapshots exist but no iteration is complete on every rank (a node and its successor lost, a
  corrupted copy, ...), or a restart finds no snapshot anywhere while an insurance checkpoint is configured (every
  store lost: training must not silently begin again at step 0). The persistent checkpoint is loaded, said
  clearly in the log;
* **fresh start**: no snapshot anywhere on the first attempt (or without insurance): iteration 0;
* **start over** (announced): nothing complete, no insurance checkpoint, but no rank holds a snapshot newer than
  the first ``versions`` iterations (the startup window: the ring never held a full set of versions, and a
  single kill can leave nothing complete). Starting over repeats at most ``versions`` seeded iterations exactly:
  better than refusing to train;
* **refuse**: nothing complete and no insurance outside the startup window: :class:`NoRecoverableStateError`,
  nothing loaded. Never a partial or corrupted state.

Where the in-memory version comes from: the restore flow (:func:`~neighbor_ckpt.recovery.flow.run_recovery`: this
layout's own snapshots), or, when the checkpointer found the newest snapshots taken with another data-parallel size
and ``neighbor_ckpt.elastic`` is on (a :class:`Reshard` request), the elastic reshard
(:func:`~neighbor_ckpt.recovery.elastic.run_reshard`): the only place a layout change is accepted. Both end in the
same outcomes.

The restore journal (:class:`~neighbor_ckpt.recovery.journal.RestoreJournal`) is part of the policy: a restored
state whose attempt dies before completing a step is never chosen again.

The checkpointer wires a :class:`Recoverer` and applies what it returns (loads the tensors into the adapter,
regenerates weights, restores RNG, hands back the user state).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from neighbor_ckpt.errors import NoRecoverableStateError
from neighbor_ckpt.recovery.elastic import run_reshard
from neighbor_ckpt.recovery.flow import RecoveryReport, Restored, all_gather_int64, no_progress, run_recovery
from neighbor_ckpt.recovery.journal import RestoreJournal
from neighbor_ckpt.recovery.reshard import RankLayout
from neighbor_ckpt.snapshot.store import ROLE_LAZY, ROLE_OWN, ROLE_REPLICA, HostStore
from neighbor_ckpt.snapshot.topology import Topology
from neighbor_ckpt.snapshot.transport import NeighborTransport

logger = logging.getLogger(__name__)

__all__ = ["Recoverer", "RecoveryResult", "Outcome", "OutcomeDecision", "decide_outcome", "settle_insurance",
           "InsuranceLoader", "Reshard"]

InsuranceLoader = Callable[[], "int | None"]
"""Loads the newest persistent checkpoint into the live model/optimizer; returns its iteration or None."""

NO_INSURANCE_CONFIGURED = "no insurance checkpoint is configured"
NO_INSURANCE_WRITTEN = "no insurance checkpoint has been written yet"


class Outcome(str, enum.Enum):
    """What a recovery ends in (see the module docstring for when)."""

    RESTORE = "restore"
    """Load the in-memory version the flow validated."""
    INSURANCE = "insurance"
    """Load the persistent checkpoint (:func:`settle_insurance` says what to do with the loader's answer)."""
    FRESH = "fresh"
    """Nothing to restore anywhere: iteration 0."""
    START_OVER = "start_over"
    """Nothing complete, no insurance, inside the startup window: iteration 0, announced."""
    REFUSE = "refuse"
    """Nothing complete, no insurance: raise :class:`NoRecoverableStateError`."""


@dataclass(frozen=True)
class OutcomeDecision:
    """The outcome, and what it depends on."""

    outcome: Outcome
    fresh_if_none: bool = False
    """For :attr:`Outcome.INSURANCE`: when there is no insurance checkpoint, start over instead of refusing."""
    iteration: int | None = None
    """The iteration resumed from (restore: the flow's; insurance: the loader's, once settled)."""
    why: str = ""
    """For :attr:`Outcome.START_OVER` / :attr:`Outcome.REFUSE`: what was missing."""


def decide_outcome(report: RecoveryReport, *, versions: int, insurance_configured: bool,
                   restarted: bool) -> OutcomeDecision:
    """Pure: the outcome of a finished restore flow (``report``, identical on every rank).

    Args:
        report: what :func:`~neighbor_ckpt.recovery.flow.run_recovery` found (``restored``, ``insurance``: snapshots
            but no complete version, ``fresh``: no snapshot anywhere).
        versions: versions kept per role (the startup window is the first ``versions`` iterations).
        insurance_configured: an insurance loader exists.
        restarted: this is not the job's first attempt (the launcher restarted it).
    """
    if report.outcome == "restored":
        return OutcomeDecision(Outcome.RESTORE, iteration=report.iteration)
    if report.outcome == "insurance":
        # The startup window: no rank holds a snapshot newer than the first ``versions`` iterations.
        window = report.newest is not None and report.newest < versions
        return OutcomeDecision(Outcome.INSURANCE, fresh_if_none=window)
    if insurance_configured and restarted:
        # A restart that finds no snapshot anywhere (every store lost) is not a fresh start if an insurance
        # checkpoint exists: training must not silently begin again from step 0.
        return OutcomeDecision(Outcome.INSURANCE, fresh_if_none=True)
    return OutcomeDecision(Outcome.FRESH)


def settle_insurance(decision: OutcomeDecision, *, configured: bool, iteration: int | None) -> OutcomeDecision:
    """Pure: an :attr:`Outcome.INSURANCE` decision once the loader answered (``iteration``: what it loaded, None:
    nothing; ``configured``: False when there is no loader, which was then not asked)."""
    if decision.outcome is not Outcome.INSURANCE:
        return decision
    if configured and iteration is not None:
        return OutcomeDecision(Outcome.INSURANCE, iteration=iteration)
    why = NO_INSURANCE_WRITTEN if configured else NO_INSURANCE_CONFIGURED
    return OutcomeDecision(Outcome.START_OVER if decision.fresh_if_none else Outcome.REFUSE, why=why)


@dataclass(frozen=True)
class Reshard:
    """Restore by an elastic reshard: the snapshots of store generation ``from_generation`` were taken with another
    data-parallel size; this rank's part of them in ``layout`` (its unique tensors and their shard spans)."""

    from_generation: int
    layout: RankLayout


@dataclass(frozen=True)
class RecoveryResult:
    """Outcome of :meth:`NeighborCheckpointer.recover <neighbor_ckpt.checkpointer.NeighborCheckpointer.recover>`."""

    report: RecoveryReport
    iteration: int | None
    """Restored iteration (None: fresh start)."""
    user_state: Any = None
    """What was passed as ``user_state`` to :meth:`NeighborCheckpointer.snapshot` for that iteration."""

    @property
    def restored(self) -> bool:
        return self.iteration is not None

    @property
    def next_step(self) -> int:
        return 0 if self.iteration is None else self.iteration + 1


class Recoverer:
    """Runs a recovery and owns its outcome: restore, insurance, fresh start, start over or refuse.

    Args:
        store: this rank's host store.
        topology: ranks, DP groups, the ring.
        transport: moves the slot images and the reshard's shards between ranks
            (:class:`~neighbor_ckpt.snapshot.transport.NeighborTransport`); the recovery's small collectives run on its
            group (the snapshot group).
        insurance: loads the last persistent checkpoint (None: not configured).
        attempt: the launcher's restart count (0: the job's first attempt).
    """

    def __init__(self, *, store: HostStore, topology: Topology, transport: NeighborTransport,
                 insurance: InsuranceLoader | None, attempt: int) -> None:
        self.store = store
        self.topology = topology
        self.transport = transport
        self.group = transport.group
        self.insurance = insurance
        self.attempt = attempt
        self.journal = RestoreJournal(store.dir, rank=topology.rank)

    def recover(self, *, layout: str, load: Callable[[Restored], None],
                on_phase: Callable[[str], None] = no_progress, reshard: Reshard | None = None) -> RecoveryResult:
        """Collective over the snapshot group: restore the newest version every rank can, or the fallback.

        ``load`` applies a validated in-memory version to the live training state (the adapter load, weight
        regeneration, RNG); it runs after the restore journal is written, so a load that kills the process marks
        that version as failed. ``on_phase`` is told each phase as it starts (progress display).

        Collectives on the snapshot group, in this order on every rank (each step's "whether" depends only on
        gathered data or the configuration, the same everywhere):

        1. journal verdict: one all-gather of every rank's restore journal (:meth:`_failed_restores`);
        2. the restore flow (:func:`~neighbor_ckpt.recovery.flow.run_recovery`): the inventory exchange, then per
           round the transfers (point-to-point, through the transport) and the restore verdict; with ``reshard``,
           the elastic reshard instead (:func:`~neighbor_ckpt.recovery.elastic.run_reshard`: the exchange, per round
           the verification verdict, the moves through the transport's exchange);
        3. nothing else: the insurance loader may use its own collectives (on the trainer's groups), the timeline
           gather is the checkpointer's, after this returns.

        Raises:
            NoRecoverableStateError: no complete version, no insurance checkpoint, outside the startup window.
        """
        t0 = time.perf_counter()
        failed = self._failed_restores()
        if reshard is None:
            report, restored = run_recovery(store=self.store, topology=self.topology, transport=self.transport,
                                            layout=layout, on_phase=on_phase, failed_iterations=failed)
        else:
            report, restored = run_reshard(root=self.store.root, job_id=self.store.job_id,
                                           generation=reshard.from_generation, rank=self.topology.rank,
                                           new_layout=reshard.layout, transport=self.transport,
                                           versions=self.store.versions,
                                           verify=self.store.use_checksum, failed_iterations=failed,
                                           on_phase=on_phase)
        decision = decide_outcome(report, versions=self.store.versions,
                                  insurance_configured=self.insurance is not None, restarted=self.attempt > 0)
        if decision.outcome is Outcome.RESTORE:
            if restored is None:  # the flow reports "restored" only with a version in hand
                raise NoRecoverableStateError(f"rank {self.topology.rank}: the restore flow returned no version")
            on_phase("restore")
            return self._restore(report, restored, load, t0)
        if decision.outcome is Outcome.INSURANCE:
            report.outcome = "insurance"
            on_phase("insurance")
            loaded = self.insurance() if self.insurance is not None else None
            decision = settle_insurance(decision, configured=self.insurance is not None, iteration=loaded)
        return self._apply_fallback(report, decision, t0)

    # -- outcomes --------------------------------------------------------------------------------------

    def _restore(self, report: RecoveryReport, restored: Restored, load: Callable[[Restored], None],
                 t0: float) -> RecoveryResult:
        t1 = time.perf_counter()
        self.journal.begin(restored.iteration, attempt=self.attempt)
        load(restored)
        report.phases["restore"] = time.perf_counter() - t1
        report.phases["total"] = time.perf_counter() - t0
        self._drop_newer(restored.iteration)
        logger.info("rank %d: neighbor_ckpt %s", self.topology.rank, report.summary())
        return RecoveryResult(report, restored.iteration, restored.extras.get("user"))

    def _apply_fallback(self, report: RecoveryReport, decision: OutcomeDecision, t0: float) -> RecoveryResult:
        """Every outcome but a restore: nothing newer than what is resumed from may be mistaken for this timeline,
        and no journal stays open (nothing restored from memory can fail)."""
        rank = self.topology.rank
        if decision.outcome is Outcome.REFUSE:
            advice = ("Configure neighbor_ckpt.insurance.every_n_steps (or a ModelCheckpoint) so such failures "
                      f"resume from disk, or delete {self.store.job_dir} to start over."
                      if decision.why == NO_INSURANCE_CONFIGURED else f"Delete {self.store.job_dir} to start over.")
            raise NoRecoverableStateError(f"rank {rank}: no complete in-memory version exists ({report.reason}) and "
                                          f"{decision.why}. Nothing was loaded. {advice}")
        self._drop_newer(None)
        self.journal.clear()
        if decision.outcome is Outcome.INSURANCE:
            it = decision.iteration
            logger.warning("rank %d: neighbor_ckpt: falling back to the insurance checkpoint of iteration %d "
                           "because %s; the iterations after %d are trained again", rank, it, report.reason, it)
            report.iteration = it
            return RecoveryResult(report, it)
        if decision.outcome is Outcome.FRESH:
            report.phases["total"] = time.perf_counter() - t0
            logger.info("rank %d: neighbor_ckpt: fresh start (%s)", rank, report.reason)
            return RecoveryResult(report, None)
        report.outcome = "fresh"  # START_OVER
        if report.newest is None:
            logger.info("rank %d: neighbor_ckpt: fresh start (%s; %s)", rank, report.reason, decision.why)
        else:
            logger.warning("rank %d: neighbor_ckpt: starting over from the initial state because %s; %s and no "
                           "rank holds a snapshot newer than iteration %d (within the first %d iterations): training "
                           "starts again at iteration 0", rank, report.reason, decision.why, report.newest,
                           self.store.versions)
        return RecoveryResult(report, None)

    def _drop_newer(self, keep: int | None) -> None:
        """After a restore (or a fallback) no newer version may be mistaken for this timeline; older ones are its
        history and stay (the next choice if the restored one fails)."""
        self.store.invalidate_after(ROLE_OWN, keep)
        self.store.invalidate_after(ROLE_REPLICA, keep)
        self.store.invalidate_after(ROLE_LAZY, None)

    # -- the restore journal ---------------------------------------------------------------------------

    def _failed_restores(self) -> frozenset[int]:
        """Collective: iterations that any rank's previous attempt restored and then died before a step ended."""
        mine = self.journal.read()
        rows = all_gather_int64(torch.tensor([-1 if mine is None else mine], dtype=torch.int64), self.group)
        failed = frozenset(int(f.item()) for f in rows if int(f.item()) >= 0)
        if failed:
            logger.warning("rank %d: iteration(s) %s were restored by the previous attempt, which died before "
                           "completing a step after them: they are not chosen again", self.topology.rank,
                           sorted(failed))
        return failed

    def step_completed(self) -> None:
        """A training step completed after the restore: that state did not fail (closes the journal)."""
        self.journal.step_completed()
