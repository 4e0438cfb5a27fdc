"""A slot staged before the process knows its rank (a hot spare while it idles, ``snapshot.store.stage_own_slot``):
taken by the first store of the same root and job that asks for an own slot, moved into its rank directory and
cut (or grown) to the capacities asked, memory already faulted in; nobody taking it leaves no file behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from neighbor_ckpt.snapshot import store as store_mod
from neighbor_ckpt.snapshot.store import (ROLE_OWN, HostStore, discard_staged_slot, slot_file_size, stage_own_slot,
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
    store_mod._discard_all_staged()  # what the process's exit runs
    assert not list(tmp_path.rglob("staged-*"))
