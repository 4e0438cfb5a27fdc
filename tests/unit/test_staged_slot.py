"""A slot staged before the process knows its rank (a hot spare while it idles, ``snapshot.store.stage_own_slot``):
taken by the first store of the same root and job that asks for the same capacities, moved into its rank
directory, memory already faulted in; other capacities discard it; nobody taking it leaves no file behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from neighbor_ckpt.snapshot import store as store_mod
from neighbor_ckpt.snapshot.store import (ROLE_OWN, HostStore, discard_staged_slot, stage_own_slot,
                                          take_staged_slot)

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


def test_other_capacities_discard_the_staged_slot_and_prepare_their_own(tmp_path: Path) -> None:
    assert stage_own_slot(tmp_path, "job-b", header_cap=CAPS[0], payload_cap=CAPS[1], extras_cap=CAPS[2])
    st = HostStore(tmp_path, job_id="job-b", rank=0)
    other = (CAPS[0], CAPS[1] * 2, CAPS[2])
    assert st.prefault(ROLE_OWN, header_cap=other[0], payload_cap=other[1], extras_cap=other[2])
    assert st.preparing is not None and not st.preparing.staged
    slot = st.ensure(ROLE_OWN, 0, header_cap=other[0], payload_cap=other[1], extras_cap=other[2])
    assert slot.capacities == other and not list(st.job_dir.glob("staged-*"))
    assert take_staged_slot(tmp_path, "job-b") is None
    st.close()


def test_another_job_does_not_take_it_and_an_untaken_slot_leaves_no_file(tmp_path: Path) -> None:
    assert stage_own_slot(tmp_path, "job-c", header_cap=CAPS[0], payload_cap=CAPS[1], extras_cap=CAPS[2])
    st = HostStore(tmp_path, job_id="job-d", rank=0)
    assert take_staged_slot(tmp_path, "job-d") is None
    st.close()
    store_mod._discard_all_staged()  # what the process's exit runs
    assert not list(tmp_path.rglob("staged-*"))
