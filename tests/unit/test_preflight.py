"""Tier 1: the host-memory preflight gives the numbers and refuses a store that does not fit."""

from __future__ import annotations

from pathlib import Path

import psutil

from neighbor_ckpt.runtime.preflight import check_host_memory
from neighbor_ckpt.snapshot.store import store_bytes_per_rank


def test_store_size_is_two_own_and_two_replica_slots_plus_lazy_room() -> None:
    one = store_bytes_per_rank(unique_bytes=10 << 20, lazy_bytes=0, versions=2, extras_bytes=None)
    assert 4 * (10 << 20) < one < 4 * (10 << 20) + 4 * (3 << 20)
    with_lazy = store_bytes_per_rank(unique_bytes=10 << 20, lazy_bytes=50 << 20, versions=2, extras_bytes=None)
    assert with_lazy - one > 50 << 20
    assert store_bytes_per_rank(unique_bytes=10 << 20, lazy_bytes=0, versions=3, extras_bytes=None) > one


def test_a_store_that_fits_passes(tmp_path: Path) -> None:
    chk = check_host_memory(tmp_path / "store", tmp_path / "store/u/job", need_per_rank=1 << 20, ranks_on_node=4,
                            mem_available=1 << 40)
    assert chk.ok and chk.need_on_node == 4 << 20


def test_a_store_larger_than_the_filesystem_fails_with_the_numbers(tmp_path: Path) -> None:
    chk = check_host_memory(tmp_path, tmp_path / "job", need_per_rank=1 << 60, ranks_on_node=8, mem_available=None)
    assert not chk.ok
    msg = chk.message()
    assert "per rank x 8 ranks on this node" in msg and "free of" in msg and "neighbor_ckpt.store.versions" in msg
    assert "\n" not in msg


def test_too_little_available_memory_fails_even_if_the_filesystem_is_large(tmp_path: Path) -> None:
    chk = check_host_memory(tmp_path, tmp_path / "job", need_per_rank=1 << 20, ranks_on_node=2, mem_available=1 << 20)
    assert chk.fs_free > chk.need_on_node
    assert not chk.ok and "the node has 0.00 GB available" in chk.message()


def test_slots_this_job_already_holds_are_not_counted_twice(tmp_path: Path) -> None:
    job = tmp_path / "u" / "job"
    (job / "rank0").mkdir(parents=True)
    (job / "rank0" / "own.0.slot").write_bytes(b"\0" * (3 << 20))
    chk = check_host_memory(tmp_path, job, need_per_rank=2 << 20, ranks_on_node=2, mem_available=(1 << 20) + 1)
    assert chk.existing == 3 << 20 and chk.need_on_node == 1 << 20 and chk.ok


def test_by_default_the_check_asks_the_machine_for_its_available_memory(tmp_path: Path) -> None:
    chk = check_host_memory(tmp_path, tmp_path / "job", need_per_rank=1, ranks_on_node=1)
    assert chk.mem_available is not None and 0 < chk.mem_available <= psutil.virtual_memory().total
