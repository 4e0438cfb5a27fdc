"""Fault injection: failpoints fire once and only when armed; damage is exactly what it says and is always refused."""

from __future__ import annotations

import random

import pytest

from neighbor_ckpt.runtime import failpoints
from neighbor_ckpt.snapshot.damage import damage_newest_slot
from neighbor_ckpt.errors import SnapshotCorruptError
from neighbor_ckpt.snapshot.slot import SlotFile
from neighbor_ckpt.snapshot.store import HostStore
from tests.unit.test_store import JOB, write


@pytest.fixture(autouse=True)
def _disarmed():
    failpoints.disarm()
    yield
    failpoints.disarm()


def test_unarmed_failpoint_does_nothing_and_an_armed_one_fires_once() -> None:
    fired: list[str] = []
    failpoints.failpoint("snapshot.copy")
    failpoints.arm("snapshot.copy", lambda: fired.append("copy"))
    failpoints.failpoint("snapshot.stream")
    assert fired == []
    failpoints.failpoint("snapshot.copy")
    failpoints.failpoint("snapshot.copy")
    assert fired == ["copy"]


def test_disarm_cancels_and_unknown_failpoints_are_refused() -> None:
    failpoints.arm("recovery.load", lambda: pytest.fail("disarmed failpoint fired"))
    failpoints.disarm("recovery.load")
    failpoints.failpoint("recovery.load")
    with pytest.raises(ValueError, match="unknown failpoint 'engine.copy'"):
        failpoints.arm("engine.copy", lambda: None)


def _committed_bytes(path) -> tuple[bytes, int, int, int, int]:
    s = SlotFile.open(path)
    try:
        hdr = s.read_header()
        return path.read_bytes(), s.payload_off, hdr.payload_nbytes, s.extras_off, hdr.extras_nbytes
    finally:
        s.close()


@pytest.mark.parametrize("seed", range(8))
def test_random_bitflip_changes_one_committed_bit_and_the_checksum_refuses_the_slot(tmp_path, seed: int) -> None:
    store = HostStore(tmp_path / "store", job_id=JOB, rank=3, versions=2)
    slot, _, _, _ = write(store, 5)
    path = slot.path
    store.close()
    before, poff, pn, eoff, en = _committed_bytes(path)
    assert damage_newest_slot(path.parent, "bitflip", rng=random.Random(seed)) == (5, path)
    after = path.read_bytes()
    diff = [i for i in range(len(before)) if before[i] != after[i]]
    assert len(diff) == 1 and bin(before[diff[0]] ^ after[diff[0]]).count("1") == 1
    assert poff <= diff[0] < poff + pn or eoff <= diff[0] < eoff + en
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotCorruptError, match="checksum"):
            s.verify(s.read_header())
    finally:
        s.close()


def test_damage_of_a_store_without_a_committed_slot_is_none(tmp_path) -> None:
    (tmp_path / "rank0").mkdir()
    assert damage_newest_slot(tmp_path / "rank0", "truncate") is None


def test_the_copy_failpoint_fires_inside_every_snapshot_even_one_without_tensors(tmp_path) -> None:
    """A plain-DDP snapshot holds small state only; a kill 'in the middle of the copy' must still happen there
    (the slot invalidated, nothing committed)."""
    from neighbor_ckpt.snapshot.engine import SnapshotEngine
    from neighbor_ckpt.snapshot.razor import plan_shards

    store = HostStore(tmp_path / "store", job_id=JOB, rank=0, versions=2)
    engine = SnapshotEngine(store=store, plan=plan_shards([], dp_size=2, distributed_optimizer=False), sources=[],
                            layout="L", meta={})
    fired: list[int] = []
    failpoints.arm("snapshot.copy", lambda: fired.append(len(list(store.committed("own", verify=False)))))
    try:
        engine.snapshot(0, {"step": 0})
        engine.wait()
    finally:
        engine.close()
        store.close()
    assert fired == [0]
