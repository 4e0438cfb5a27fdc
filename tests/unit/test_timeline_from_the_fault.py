"""An in-process recovery's timeline starts at the fault: when its earliest witness saw it (the launcher's observed
exit, a silent peer's last heartbeat), recorded in the store under ``gen/<g>/faults``; the MTTR runs from there to
the first completed step (one process, a real TCPStore)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from neighbor_ckpt.inprocess.assignment import initial_assignment
from neighbor_ckpt.inprocess.generation import Fault, GenerationStore
from neighbor_ckpt.recovery.attempt import AttemptInfo
from neighbor_ckpt.report.timeline import EVENTS_INPROCESS, RankEvents, compute_timeline
from tests.conftest import free_port

T0 = 1_700_000_000.0


@pytest.fixture()
def store() -> Any:
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True,
                           timeout=timedelta(seconds=10))
    yield dist.PrefixStore("job/0/", dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                                   use_libuv=True, timeout=timedelta(seconds=10)))
    del master


def survivor(*, fault: float | None) -> RankEvents:
    """Snapshot committed at T0, fault at T0 + 0.3 (when known), noticed at T0 + 0.5, abort done at T0 + 0.7."""
    return RankEvents(last_snapshot=T0, failure_noticed=T0 + 0.5, process_start=T0 - 100, process_group_ready=T0 + 1.0,
                      recovery_start=T0 + 1.2, reconcile_end=T0 + 1.25, transfer_end=T0 + 1.3, restore_end=T0 + 1.4,
                      abort_end=T0 + 0.7, activated_spare=0.0, fault=fault)


def test_detect_starts_at_the_fault_its_witness_saw_and_the_mttr_runs_from_it() -> None:
    att = AttemptInfo(launch=0, inprocess=1, fault_unix=T0 + 0.3, fault_what="exit of process 1 seen by its launcher")
    tl = compute_timeline([survivor(fault=T0 + 0.3), survivor(fault=T0 + 0.4)], first_step_end=T0 + 1.6, attempt=att,
                          outcome="restored", iteration=4)
    assert tl.events["fault"] == T0 + 0.3 and tl.last_snapshot == T0
    assert tl.phases["detect"] == pytest.approx(0.2, abs=1e-5) and tl.total_s == pytest.approx(1.3, abs=1e-5)
    assert tl.detect_from == "the fault: exit of process 1 seen by its launcher"
    data = tl.to_json()
    assert list(data["events_unix"]) == list(EVENTS_INPROCESS) and data["events_unix"]["fault"] == T0 + 0.3
    assert data["detect_from"] == tl.detect_from and data["last_snapshot_unix"] == T0
    assert data["mttr_s"] == pytest.approx(1.3, abs=1e-5)


def test_without_a_recorded_fault_detect_starts_at_the_newest_snapshot_and_says_so() -> None:
    tl = compute_timeline([survivor(fault=None)] * 2, first_step_end=T0 + 1.6,
                          attempt=AttemptInfo(launch=0, inprocess=1), outcome="restored", iteration=4)
    assert tl.events["fault"] == T0 and tl.phases["detect"] == pytest.approx(0.5, abs=1e-5)
    assert tl.detect_from == "the newest committed snapshot"


def test_the_witnesses_of_a_fault_are_kept_and_the_earliest_comes_first(store: Any) -> None:
    gens = GenerationStore(store, process=0)
    assert gens.faults(0) == []
    gens.record_fault(0, Fault(T0 + 2.0, "last heartbeat of process 1 seen by process 2"))
    gens.record_fault(0, Fault(T0 + 1.0, "exit of process 1 seen by its launcher; with a semicolon"))
    store.append("gen/0/faults", "garbled;")
    got = gens.faults(0)
    assert [f.unix for f in got] == [T0 + 1.0, T0 + 2.0]
    assert got[0].what == "exit of process 1 seen by its launcher, with a semicolon"
    assert gens.faults(1) == []


def test_a_death_reported_with_its_fault_records_both(store: Any) -> None:
    gens = GenerationStore(store, process=-1, name="launcher:node1")
    gens.publish_assignment(0, initial_assignment(3, 1))
    record = gens.report_death((1,), kind="exited", reason="SIGKILL", fault=Fault(T0, "exit of process 1 seen"))
    assert record is not None and record.kind == "exited" and record.ranks == (1,)
    assert gens.faults(0) == [Fault(T0, "exit of process 1 seen")]


def test_a_survivor_that_noticed_before_the_launcher_saw_the_exit_makes_detect_zero_not_clock_skew() -> None:
    att = AttemptInfo(launch=0, inprocess=1, fault_unix=T0 + 0.6, fault_what="exit of process 1 seen by its launcher")
    tl = compute_timeline([survivor(fault=T0 + 0.6)], first_step_end=T0 + 1.6, attempt=att, outcome="restored",
                          iteration=4)
    assert tl.phases["detect"] == 0.0 and tl.phases["abort"] == pytest.approx(0.1, abs=1e-5)
    assert tl.notes == ("a survivor noticed the failure 0.100 s before exit of process 1 seen by its launcher: "
                        "detect 0",)


def test_a_witness_recorded_after_the_attempt_began_is_found_when_rank_0_asks_again() -> None:
    """The survivors can re-form before the launcher's record of the exit reaches the store (their collective lost
    the peer first): the attempt began knowing no fault, and rank 0's timeline asks the store again."""
    late = (T0 + 0.3, "exit of process 1 seen by its launcher (launcher:node1)")
    att = AttemptInfo(launch=0, inprocess=1, fault_lookup=lambda: late)
    tl = compute_timeline([survivor(fault=None), survivor(fault=None)], first_step_end=T0 + 1.6, attempt=att,
                          outcome="restored", iteration=4)
    assert tl.events["fault"] == T0 + 0.3 and tl.detect_from == f"the fault: {late[1]}"
    assert AttemptInfo(launch=0, inprocess=1, fault_unix=T0 + 0.2, fault_what="x", fault_lookup=lambda: late).fault() \
        == (T0 + 0.2, "x"), "what was known earlier and is earlier stands"

    def unreachable() -> tuple[float, str] | None:
        raise ConnectionError("the store does not answer")

    assert AttemptInfo(launch=0, inprocess=1, fault_lookup=unreachable).fault() is None
