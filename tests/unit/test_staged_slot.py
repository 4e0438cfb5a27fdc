"""A slot staged before the process knows its rank (a hot spare while it idles, ``snapshot.store.stage_own_slot``):
taken by the first store of the same root and job that asks for an own slot, moved into its rank directory and
cut (or grown) to the capacities asked, memory already faulted in; nobody taking it leaves no file behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from neighbor_ckpt.snapshot import store as store_mod
from neighbor_ckpt.snapshot.slot import slot_file_size
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore, discard_staged_slot, stage_own_slot, take_staged_slot

CAPS = (8192, 1 << 20, 4096)


@pytest.fixture(autouse=True)
def _clean_registry():
    yield
    for key in list(store_mod._staged):
        discard_staged_slot(store_mod._staged.pop(key))


def test_a_store_with_the_same_capacities_takes_the_staged_slot(tmp_path: Path) -> None:
    assert stage_own_slot(tmp_path, "job-a", header_cap=CAPS[0], payload_cap=CAPS[1], extras_cap=CAPS[2])
    assert not stage_own_slot(tmp_path, "job-a", header_cap=1, payload_cap=1, extras_cap=1), "once per job"
    st = HostStore(tmp_path, job_id="job-a", rank=3)
    assert st.prefault(ROLE_OWN, header_cap=CAPS[0], payload_cap=CAPS[1], extras_cap=CAPS[2])
    assert st.preparing is not None and st.preparing.staged
    slot = st.ensure(ROLE_OWN, 0, header_cap=CAPS[0], payload_cap=CAPS[1], extras_cap=CAPS[2])
    prepared = st.prepared
    assert prepared is not None and prepared.used and prepared.staged and slot is prepared.slot
    assert Path(slot.path) == st.path(ROLE_OWN, 0) and st.path(ROLE_OWN, 0).exists()
    assert not list(st.job_dir.glob("staged-*")), "moved, not copied"
    assert slot.capacities == CAPS
    st.close()


@pytest.mark.parametrize("factor", [0.5, 2.0], ids=["smaller", "larger"])
def test_a_store_asking_other_capacities_gets_the_staged_slot_reshaped(tmp_path: Path, factor: float) -> None:
    """A spare stages the largest slot any rank needs; the rank it takes may need less (cut) or, after the ranks
    published again, more (grown): either way a valid, empty slot of exactly those capacities."""
    assert stage_own_slot(tmp_path, "job-b", header_cap=CAPS[0], payload_cap=CAPS[1], extras_cap=CAPS[2])
    st = HostStore(tmp_path, job_id="job-b", rank=0)
    other = (CAPS[0], int(CAPS[1] * factor), CAPS[2])
    assert st.prefault(ROLE_OWN, header_cap=other[0], payload_cap=other[1], extras_cap=other[2])
    assert st.preparing is not None and st.preparing.staged
    slot = st.ensure(ROLE_OWN, 0, header_cap=other[0], payload_cap=other[1], extras_cap=other[2])
    assert st.prepared is not None and st.prepared.used and slot is st.prepared.slot
    assert slot.capacities == other and not list(st.job_dir.glob("staged-*"))
    assert st.path(ROLE_OWN, 0).stat().st_size == slot_file_size(*other)
    assert list(st.committed(ROLE_OWN, verify=False)) == [], "empty: nothing committed in it"
    assert take_staged_slot(tmp_path, "job-b") is None
    st.close()


def test_another_job_does_not_take_it_and_an_untaken_slot_leaves_no_file(tmp_path: Path) -> None:
    assert stage_own_slot(tmp_path, "job-c", header_cap=CAPS[0], payload_cap=CAPS[1], extras_cap=CAPS[2])
    st = HostStore(tmp_path, job_id="job-d", rank=0)
    assert take_staged_slot(tmp_path, "job-d") is None
    st.close()
    assert store_mod.discard_staged_slots() == 1  # what the process's exit runs
    assert not list(tmp_path.rglob("staged-*"))


# -- a replaced rank, before it builds its model (recovery.replacement_slot) ----------------------------------------


@pytest.fixture
def launch_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A launch store as torchrun's agent keeps it (the address prepare_torchrun_restart records), this process as
    rank 1 of job ``job-r``, the host stores under ``tmp_path``."""
    from datetime import timedelta

    import torch.distributed as dist

    from neighbor_ckpt.runtime.launch_store import AGENT_STORE_ENV

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv(AGENT_STORE_ENV, f"127.0.0.1:{server.port}")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("NEIGHBOR_CKPT_JOB_ID", "job-r")
    monkeypatch.setenv("NEIGHBOR_CKPT_STORE_DIR", str(tmp_path))
    yield server


def test_a_replaced_rank_stages_the_slot_it_published_and_its_store_takes_it(launch_store, tmp_path: Path) -> None:
    from neighbor_ckpt.recovery.replacement_slot import prepare_replacement_slot
    from neighbor_ckpt.runtime.launch_store import SlotCapacities

    assert not prepare_replacement_slot(), "nothing published yet: nothing staged"
    assert SlotCapacities(job_id="job-r", generation=0, store=launch_store).publish(1, CAPS)
    assert prepare_replacement_slot()
    st = HostStore(tmp_path, job_id="job-r", rank=1)
    assert st.prefault(ROLE_OWN, header_cap=CAPS[0], payload_cap=CAPS[1], extras_cap=CAPS[2])
    st.ensure(ROLE_OWN, 0, header_cap=CAPS[0], payload_cap=CAPS[1], extras_cap=CAPS[2])
    assert st.prepared is not None and st.prepared.used and st.prepared.staged_when == \
        "before this process built its model"
    st.close()


def test_a_rank_whose_store_survived_stages_nothing_and_leftovers_are_discarded(launch_store, tmp_path: Path) -> None:
    from neighbor_ckpt.recovery.replacement_slot import prepare_replacement_slot
    from neighbor_ckpt.runtime.launch_store import SlotCapacities
    from neighbor_ckpt.snapshot.store import discard_staged_slots

    assert SlotCapacities(job_id="job-r", generation=0, store=launch_store).publish(1, CAPS)
    kept = HostStore(tmp_path, job_id="job-r", rank=1)
    kept.ensure(ROLE_OWN, 0, header_cap=CAPS[0], payload_cap=CAPS[1], extras_cap=CAPS[2])
    kept.close()
    assert not prepare_replacement_slot(), "the node kept its store: a restart on the same node needs no new slot"
    assert stage_own_slot(tmp_path / "elsewhere", "job-r", header_cap=CAPS[0], payload_cap=CAPS[1],
                          extras_cap=CAPS[2])
    assert discard_staged_slots() == 1 and not list(tmp_path.rglob("staged-*"))


def test_a_launcher_sweeps_the_staged_slots_of_processes_gone_and_leaves_the_live_ones(tmp_path: Path) -> None:
    """A launcher SIGKILLed or cut off before it dropped its spares' staged slots leaked them (a full slot of
    /dev/shm each); the next launcher on the node sweeps those whose process is gone at its start."""
    import subprocess
    import sys

    from neighbor_ckpt.snapshot.store import staged_slot_files, sweep_staged_slots

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    job = tmp_path / store_mod._user() / "job-a"
    job.mkdir(parents=True)
    (job / f"staged-{gone.pid}.own.slot").write_bytes(b"x")
    (job / f"staged-{gone.pid}.own.slot.tmp").write_bytes(b"x")
    live = job / f"staged-{__import__('os').getpid()}.own.slot"
    live.write_bytes(b"x")
    removed = sweep_staged_slots(tmp_path)
    assert sorted(p.name for p in removed) == [f"staged-{gone.pid}.own.slot", f"staged-{gone.pid}.own.slot.tmp"]
    assert staged_slot_files(tmp_path) == [live]


def test_a_launcher_cut_off_drops_its_staged_slots_before_it_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from neighbor_ckpt.inprocess import quorum

    said: list[str] = []
    dropped: list[bool] = []
    monkeypatch.setattr(quorum, "cut_off", lambda name, why: said.append(why))
    owner = SimpleNamespace(_att=SimpleNamespace(children={}), drop_staged_slots=lambda: dropped.append(True),
                            known_complete=lambda: False)
    stores = SimpleNamespace(over=False, timeout_s=1.0, promotion_wait_s=1.0, move_bound_s=1.0, epoch=0)
    lease = quorum.LauncherLease(node="node0", nodes=3, timeout_s=2.0, beat_s=0.5, stores=stores, owner=owner)
    lease.stop("no majority")
    assert dropped == [True] and said == ["no majority"]
