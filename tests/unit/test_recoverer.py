"""The recovery policy: which outcome a (re)start gets (pure), the restore journal, the Recoverer on one rank, and
the failure path (failure event, lazy backup)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from neighbor_ckpt.config import TransportConfig
from neighbor_ckpt.errors import NoRecoverableStateError
from neighbor_ckpt.recovery.backup import FailureBackup, WeightsTag
from neighbor_ckpt.recovery.flow import RecoveryReport, Restored
from neighbor_ckpt.recovery.journal import RESTORE_JOURNAL, RestoreJournal, take_failure_event
from neighbor_ckpt.recovery.reconcile import RankVersions, reconcile
from neighbor_ckpt.recovery.recoverer import (NO_INSURANCE_CONFIGURED, NO_INSURANCE_WRITTEN, Outcome,
                                              OutcomeDecision, Recoverer, decide_outcome, settle_insurance)
from neighbor_ckpt.snapshot.engine import write_image
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
from neighbor_ckpt.snapshot.store import ROLE_LAZY, ROLE_OWN, HostStore
from neighbor_ckpt.snapshot.topology import build_topology
from neighbor_ckpt.snapshot.transport_kinds import make_transport


def report(outcome: str, newest: int | None = None, iteration: int | None = None) -> RecoveryReport:
    return RecoveryReport(outcome=outcome, newest=newest, iteration=iteration, reason="test")


# -- the outcome decision (pure) -----------------------------------------------------------------------------


def test_a_restorable_version_is_restored_whatever_the_insurance() -> None:
    for insurance in (False, True):
        d = decide_outcome(report("restored", newest=9, iteration=8), versions=2, insurance_configured=insurance,
                           restarted=True)
        assert d == OutcomeDecision(Outcome.RESTORE, iteration=8)


def test_snapshots_without_a_complete_version_fall_back_to_insurance_and_only_the_startup_window_may_start_over():
    inside = decide_outcome(report("insurance", newest=1), versions=2, insurance_configured=False, restarted=True)
    outside = decide_outcome(report("insurance", newest=2), versions=2, insurance_configured=True, restarted=True)
    assert inside == OutcomeDecision(Outcome.INSURANCE, fresh_if_none=True)
    assert outside == OutcomeDecision(Outcome.INSURANCE, fresh_if_none=False)


def test_no_snapshot_anywhere_is_a_fresh_start_unless_a_restart_has_an_insurance_checkpoint() -> None:
    first = decide_outcome(report("fresh"), versions=2, insurance_configured=True, restarted=False)
    no_insurance = decide_outcome(report("fresh"), versions=2, insurance_configured=False, restarted=True)
    every_store_lost = decide_outcome(report("fresh"), versions=2, insurance_configured=True, restarted=True)
    assert first.outcome is Outcome.FRESH and no_insurance.outcome is Outcome.FRESH
    assert every_store_lost == OutcomeDecision(Outcome.INSURANCE, fresh_if_none=True)


@pytest.mark.parametrize("configured,loaded,window,expected", [
    (True, 7, False, OutcomeDecision(Outcome.INSURANCE, iteration=7)),
    (True, 7, True, OutcomeDecision(Outcome.INSURANCE, iteration=7)),
    (True, None, True, OutcomeDecision(Outcome.START_OVER, why=NO_INSURANCE_WRITTEN)),
    (True, None, False, OutcomeDecision(Outcome.REFUSE, why=NO_INSURANCE_WRITTEN)),
    (False, None, True, OutcomeDecision(Outcome.START_OVER, why=NO_INSURANCE_CONFIGURED)),
    (False, None, False, OutcomeDecision(Outcome.REFUSE, why=NO_INSURANCE_CONFIGURED)),
])
def test_the_insurance_answer_settles_the_outcome(configured: bool, loaded: int | None, window: bool,
                                                  expected: OutcomeDecision) -> None:
    asked = OutcomeDecision(Outcome.INSURANCE, fresh_if_none=window)
    assert settle_insurance(asked, configured=configured, iteration=loaded) == expected


def test_settling_leaves_other_outcomes_alone() -> None:
    for d in (OutcomeDecision(Outcome.RESTORE, iteration=3), OutcomeDecision(Outcome.FRESH)):
        assert settle_insurance(d, configured=True, iteration=9) is d


def test_every_rank_reaches_the_same_outcome_from_the_same_table() -> None:
    """Ranks 1 and 2 (ring neighbours) lost their stores: nothing is complete; every rank decides alike."""
    world, versions = 4, 2
    rows = []
    for r in range(world):
        topo = build_topology(rank=r, world_size=world, dp_ranks=range(world), policy="next")
        alive = r not in (1, 2)
        rows.append(RankVersions(rank=r, successor=topo.successor, dp_group=0,
                                 own=frozenset({5, 6}) if alive else frozenset(),
                                 replica=frozenset({5, 6}) if alive and topo.predecessor not in (1, 2) else frozenset(),
                                 needs_lazy=False if alive else None))
    decisions = set()
    for _ in range(world):  # what every rank computes from the gathered table
        rec = reconcile(rows)
        rep = RecoveryReport(outcome="restored" if rec.recoverable else "insurance", newest=6, reason=rec.reason)
        decisions.add(decide_outcome(rep, versions=versions, insurance_configured=True, restarted=True))
    assert decisions == {OutcomeDecision(Outcome.INSURANCE, fresh_if_none=False)}


# -- the restore journal -------------------------------------------------------------------------------------


def test_restore_journal_is_private_open_until_a_step_completes_and_survives_the_process(tmp_path: Path) -> None:
    j = RestoreJournal(tmp_path, rank=3)
    assert j.read() is None and not j.open
    j.begin(12, attempt=2)
    assert j.open and j.read() == 12
    assert stat.S_IMODE(os.stat(tmp_path / RESTORE_JOURNAL).st_mode) == 0o600
    assert RestoreJournal(tmp_path, rank=3).read() == 12, "the next process finds it"
    j.step_completed()
    assert not j.open and not (tmp_path / RESTORE_JOURNAL).exists()
    j.step_completed()  # cheap and harmless when closed


def test_an_unreadable_restore_journal_is_ignored_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / RESTORE_JOURNAL).write_text("{not json")
    assert RestoreJournal(tmp_path, rank=0).read() is None
    assert "unreadable restore journal" in caplog.text


# -- the Recoverer on a one-rank group -----------------------------------------------------------------------



def one_rank(tmp_path: Path, group: dist.ProcessGroup, *, attempt: int, insurance=None) -> Recoverer:
    store = HostStore(tmp_path / "store", job_id="j", rank=0, versions=2)
    topo = build_topology(rank=0, world_size=1, dp_ranks=[0])
    transport = make_transport(TransportConfig(chunk_mb=1 / 16), topology=topo, store=store, group=group)
    return Recoverer(store=store, topology=topo, transport=transport, insurance=insurance, attempt=attempt)


def snapshot(rec: Recoverer, iteration: int) -> torch.Tensor:
    t = torch.full((64,), float(iteration))
    plan = plan_shards([TensorMeta.of("w", StateKind.MAIN_PARAM, t)], dp_size=1, distributed_optimizer=True)
    write_image(rec.store, ROLE_OWN, planned=plan.unique, sources=[t], payload_bytes=plan.unique_bytes,
                iteration=iteration, layout="L", meta={}, extras={"adapter": None, "user": {"it": iteration}})
    return t


def test_recoverer_restores_journals_and_never_chooses_a_failed_restore_again(tmp_path: Path,
                                                                              group: dist.ProcessGroup) -> None:
    first = one_rank(tmp_path, group, attempt=0)
    none = first.recover(layout="L", load=lambda r: pytest.fail("nothing to load"))
    assert none.report.outcome == "fresh" and not none.restored
    for it in (1, 2):
        snapshot(first, it)

    loaded: list[Restored] = []
    second = one_rank(tmp_path, group, attempt=1)
    res = second.recover(layout="L", load=loaded.append)
    assert (res.iteration, res.user_state, res.report.outcome) == (2, {"it": 2}, "restored")
    assert torch.equal(loaded[0].tensors["w"], torch.full((64,), 2.0))
    assert second.journal.open, "no step completed yet: the journal guards this state"

    third = one_rank(tmp_path, group, attempt=2)  # the second attempt died before completing a step
    res = third.recover(layout="L", load=loaded.append)
    assert res.iteration == 1, "the state that failed once is not chosen again; its predecessor is"
    third.step_completed()
    assert not (third.store.dir / RESTORE_JOURNAL).exists()


def test_recoverer_falls_back_to_insurance_and_refuses_without_it(tmp_path: Path, group: dist.ProcessGroup) -> None:
    rec = one_rank(tmp_path, group, attempt=0)
    snapshot(rec, 2)
    rec.journal.begin(2, attempt=0)  # its only version failed once: nothing is complete, past the startup window

    with pytest.raises(NoRecoverableStateError, match="no insurance checkpoint is configured"):
        one_rank(tmp_path, group, attempt=1).recover(layout="L", load=lambda r: pytest.fail("refused"))

    asked: list[int] = []
    insured = one_rank(tmp_path, group, attempt=1, insurance=lambda: asked.append(1) or 5)
    res = insured.recover(layout="L", load=lambda r: pytest.fail("insurance, not memory"))
    assert (res.report.outcome, res.iteration, asked) == ("insurance", 5, [1])
    assert not (insured.store.dir / RESTORE_JOURNAL).exists(), "nothing restored from memory: no journal"


def test_recoverer_starts_over_inside_the_startup_window(tmp_path: Path, group: dist.ProcessGroup) -> None:
    rec = one_rank(tmp_path, group, attempt=0)
    snapshot(rec, 1)
    rec.journal.begin(1, attempt=0)  # iteration 1 was restored and failed: nothing else is held
    res = one_rank(tmp_path, group, attempt=1).recover(layout="L", load=lambda r: pytest.fail("start over"))
    assert (res.report.outcome, res.iteration) == ("fresh", None)


# -- the failure path ----------------------------------------------------------------------------------------


def lazy_backup(tmp_path: Path, tags: list[WeightsTag]) -> FailureBackup:
    """A rank of a 2-way plain-DDP group whose weights are redundant (lazy); ``tags`` are read in turn."""
    store = HostStore(tmp_path / "store", job_id="j", rank=1, versions=2)
    topo = build_topology(rank=1, world_size=2, dp_ranks=[0, 1])
    fb = FailureBackup(store=store, topology=topo, attempt=3, enabled=True,
                       weights=lambda: tags.pop(0) if len(tags) > 1 else tags[0])
    w = torch.arange(32, dtype=torch.float32)
    plan = plan_shards([TensorMeta.of("w", StateKind.WEIGHT, w)], dp_size=2, distributed_optimizer=False)
    assert plan.has_lazy
    fb.arm(plan, [w], "L")
    return fb


def lazy_iterations(fb: FailureBackup) -> list[int]:
    return [ref.header.iteration for ref in fb.store.committed(ROLE_LAZY, verify=True)]


def test_failure_backup_records_the_first_failure_and_writes_one_backup(tmp_path: Path) -> None:
    fb = lazy_backup(tmp_path, [WeightsTag(seq=4, iteration=7)])
    assert fb.on_failure("RuntimeError: boom")
    first = fb.noticed
    assert fb.on_failure("SIGTERM from the launcher", background=True), "already written: nothing more to do"
    assert fb.noticed == first and lazy_iterations(fb) == [7]
    assert take_failure_event(fb.events_path, not_after=first + 1) == first


def test_failure_backup_never_writes_torn_weights(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fb = lazy_backup(tmp_path, [WeightsTag(seq=4, iteration=None)])
    assert not fb.on_failure("x")
    assert "inside an optimizer step" in caplog.text and lazy_iterations(fb) == []


def test_a_background_backup_across_a_step_tag_change_is_discarded(tmp_path: Path) -> None:
    fb = lazy_backup(tmp_path, [WeightsTag(seq=4, iteration=7), WeightsTag(seq=5, iteration=None)])
    assert not fb.on_failure("detector: rank 0 stopped", background=True)
    assert lazy_iterations(fb) == []


def test_an_unarmed_or_disabled_failure_backup_writes_nothing_but_still_records_the_event(tmp_path: Path) -> None:
    store = HostStore(tmp_path / "store", job_id="j", rank=0)
    fb = FailureBackup(store=store, topology=build_topology(rank=0, world_size=1, dp_ranks=[0]), attempt=0,
                       enabled=True, weights=lambda: WeightsTag(0, 3))
    assert not fb.on_failure("before the first snapshot")
    assert fb.events_path.exists()
