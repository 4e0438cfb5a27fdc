"""A rank's store (``neighbor_ckpt/snapshot/store.py``): its private directories, its slots (which one a write takes,
which versions it keeps, what it lists as committed), preflight, the slot prepared in advance, and the engine writing
into it. One slot file's format and its validation: ``test_slot.py``."""

from __future__ import annotations

import os
import shutil
import stat
import time

import pytest
import torch
from torch import nn

from neighbor_ckpt.adapters.torch_optim import TorchOptimizerAdapter
from neighbor_ckpt.errors import HostMemoryError
from neighbor_ckpt.recovery.flow import read_tensors
from neighbor_ckpt.snapshot.engine import write_image
from neighbor_ckpt.snapshot.razor import plan_shards
from neighbor_ckpt.snapshot.slot import PREAMBLE_BYTES, SlotFile, slot_file_size
from neighbor_ckpt.snapshot.store import ROLE_LAZY, ROLE_OWN, ROLE_REPLICA, HostStore
from tests.unit.slot_images import (JOB, assert_bit_equal, empty_state, extras, header_dict, new_store, state,
                                    write)

__all__ = ["JOB", "write"]  # test_failpoints_and_damage.py takes them from here


@pytest.fixture
def store(tmp_path):
    s = new_store(tmp_path)
    yield s
    s.close()


# -- directories and files ----------------------------------------------------------------------------------


def test_store_directories_are_private_and_namespaced_per_user_job_and_rank(tmp_path):
    root = tmp_path / "store"
    s = HostStore(root, job_id=JOB, rank=3)
    try:
        rel = s.dir.relative_to(root).parts
        assert len(rel) == 3 and rel[1:] == (JOB, "rank3")
        for d in (root / rel[0], root / rel[0] / JOB, s.dir):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        assert s.job_dir == root / rel[0] / JOB
    finally:
        s.close()


def test_store_directories_are_0700_even_under_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        s = HostStore(tmp_path / "store", job_id=JOB, rank=0)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(s.dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(s.job_dir.stat().st_mode) == 0o700
    finally:
        s.close()


def test_slot_files_are_0600_and_no_temporary_file_is_left(store):
    write(store, 1)
    write(store, 2)
    write(store, 3, role=ROLE_LAZY)
    files = sorted(p.name for p in store.dir.iterdir())
    assert files == ["lazy.0.slot", "own.0.slot", "own.1.slot"]
    for p in store.dir.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


# -- store inventory -------------------------------------------------------------------------------------------


def test_committed_lists_verified_slots_of_this_job(store):
    write(store, 6)
    write(store, 7)
    got = sorted((r.index, r.header.iteration) for r in store.committed(ROLE_OWN, verify=True))
    assert got == [(0, 6), (1, 7)]
    assert list(store.committed(ROLE_REPLICA, verify=True)) == []


def test_committed_skips_a_slot_with_a_corrupt_payload_only_when_verifying(store):
    write(store, 6)
    slot, _, _, _ = write(store, 7)
    slot.payload[0] ^= 0xFF
    assert sorted(r.header.iteration for r in store.committed(ROLE_OWN, verify=False)) == [6, 7]
    assert sorted(r.header.iteration for r in store.committed(ROLE_OWN, verify=True)) == [6]


def test_committed_skips_a_snapshot_of_another_job_whose_header_names_that_job(tmp_path):
    root = tmp_path / "store"
    a = HostStore(root, job_id="job-a", rank=0)
    write(a, 11)
    src = a.path(ROLE_OWN, 0)
    a.close()
    b = HostStore(root, job_id="job-b", rank=0)
    try:
        assert b.dir != a.dir
        shutil.copy(src, b.path(ROLE_OWN, 0))
        assert list(b.committed(ROLE_OWN, verify=True)) == []
        assert list(b.committed(ROLE_OWN, verify=False)) == []
        hdr = b.slot(ROLE_OWN, 0).read_header()
        assert hdr.job_id == "job-a" and hdr.iteration == 11
        a2 = HostStore(root, job_id="job-a", rank=0)
        assert [r.header.iteration for r in a2.committed(ROLE_OWN, verify=True)] == [11]
        a2.close()
    finally:
        b.close()


def test_unreadable_slot_file_is_reported_as_absent(store):
    store.path(ROLE_OWN, 0).write_bytes(b"not a slot at all" * 10)
    assert store.slot(ROLE_OWN, 0) is None
    assert list(store.committed(ROLE_OWN, verify=True)) == []
    assert store.slot_for_write(ROLE_OWN) == 0


def test_slot_for_write_picks_a_missing_or_uncommitted_slot_then_the_oldest(store):
    assert store.slot_for_write(ROLE_OWN) == 0
    write(store, 5)                      # -> slot 0
    assert store.slot_for_write(ROLE_OWN) == 1
    write(store, 6)                      # -> slot 1
    assert store.slot_for_write(ROLE_OWN) == 0  # oldest (5)
    write(store, 7)                      # -> slot 0
    assert store.slot_for_write(ROLE_OWN) == 1  # oldest (6)
    assert store.slot_for_write(ROLE_OWN, keep={6}) == 0
    store.slot(ROLE_OWN, 0).invalidate()
    assert store.slot_for_write(ROLE_OWN) == 0  # uncommitted beats oldest
    iters = {r.index: r.header.iteration for r in store.committed(ROLE_OWN, verify=True)}
    assert iters == {1: 6}


def test_writes_alternate_between_slots_and_keep_the_two_newest(store):
    for it in range(1, 8):
        write(store, it)
        got = sorted(r.header.iteration for r in store.committed(ROLE_OWN, verify=True))
        assert got == list(range(max(1, it - 1), it + 1))


def test_invalidate_after_drops_newer_versions_and_keeps_the_history(store):
    write(store, 6)
    write(store, 7)
    store.invalidate_after(ROLE_OWN, 7)
    assert sorted(r.header.iteration for r in store.committed(ROLE_OWN, verify=True)) == [6, 7]
    store.invalidate_after(ROLE_OWN, 6)
    assert [r.header.iteration for r in store.committed(ROLE_OWN, verify=True)] == [6]
    store.invalidate_after(ROLE_OWN, None)
    assert list(store.committed(ROLE_OWN, verify=True)) == []


def test_ensure_recreates_a_slot_whose_capacities_changed(store):
    s1 = store.ensure(ROLE_REPLICA, 0, header_cap=4096, payload_cap=128, extras_cap=64)
    assert store.ensure(ROLE_REPLICA, 0, header_cap=4096, payload_cap=128, extras_cap=64) is s1
    s2 = store.ensure(ROLE_REPLICA, 0, header_cap=4096, payload_cap=4096, extras_cap=64)
    assert s2.capacities == (4096, 4096, 64)
    assert store.path(ROLE_REPLICA, 0).stat().st_size == slot_file_size(4096, 4096, 64)


def test_destroy_removes_the_rank_directory_and_the_empty_job_directory(store):
    write(store, 1)
    store.destroy()
    assert not store.dir.exists() and not store.job_dir.exists()
    assert store.root.exists()


# -- preflight ----------------------------------------------------------------------------------------------------


def test_preflight_rejects_more_bytes_than_the_filesystem_has_free_with_the_numbers(store):
    with pytest.raises(HostMemoryError) as ei:
        store.preflight(2**62)
    msg = str(ei.value)
    assert f"{2**62 / 2**20:.1f} MiB" in msg
    st = os.statvfs(store.dir)
    assert "MiB are free" in msg and str(store.dir) in msg and "NEIGHBOR_CKPT_STORE_DIR" in msg
    assert "rank 3" in msg
    assert st.f_bavail * st.f_frsize < 2**62


def test_preflight_accepts_a_small_request(store):
    store.preflight(4096)


def test_ensure_fails_with_host_memory_error_before_creating_a_huge_slot(store):
    with pytest.raises(HostMemoryError):
        store.ensure(ROLE_OWN, 0, header_cap=4096, payload_cap=2**62, extras_cap=64)
    assert not store.path(ROLE_OWN, 0).exists()


# -- the engine writing into the store ----------------------------------------------------------------------


def test_snapshot_engine_commits_a_state_holding_a_zero_element_tensor(store):
    from neighbor_ckpt.snapshot.engine import SnapshotEngine

    named = empty_state()
    plan = plan_shards([m for m, _ in named], dp_size=1, distributed_optimizer=False)
    engine = SnapshotEngine(store=store, plan=plan, sources=[t for _, t in named], layout="L", meta={},
                            transport=None)
    try:
        engine.snapshot(1, {"step": 1})
        engine.wait()
    finally:
        engine.close()
    assert engine.stats.failures == 0
    assert [r.header.iteration for r in store.committed(ROLE_OWN, verify=True)] == [1]


def test_the_engine_and_write_image_commit_the_same_header(tmp_path):
    from neighbor_ckpt.snapshot.engine import SnapshotEngine

    named = state(5)
    plan = plan_shards([m for m, _ in named], dp_size=2, distributed_optimizer=True)
    by_name = {m.name: t for m, t in named}
    sources = [by_name[p.meta.name] for p in plan.unique]
    a = HostStore(tmp_path / "a", job_id=JOB, rank=3)
    engine = SnapshotEngine(store=a, plan=plan, sources=sources, layout="L", meta={"x": 1}, transport=None)
    try:
        engine.snapshot(5, extras(5))
        engine.wait()
    finally:
        engine.close()
    b = HostStore(tmp_path / "b", job_id=JOB, rank=3)
    _, direct = write_image(b, ROLE_OWN, planned=plan.unique, sources=sources, payload_bytes=plan.unique_bytes,
                            iteration=5, layout="L", meta={"x": 1, "plan": plan.signature}, extras=extras(5))
    [ref] = a.committed(ROLE_OWN, verify=True)
    headers = [ref.header.to_json(), direct.to_json()]
    for h in headers:
        h["meta"] = dict(h["meta"])
        assert isinstance(h["meta"].pop("committed_unix"), float)
    assert headers[0] == headers[1]


# -- slots re-created under a live engine -----------------------------------------------------------------------

_GROWTH_SCRIPT = r"""
import sys, tempfile, torch
from pathlib import Path
from neighbor_ckpt.snapshot.engine import SnapshotEngine
from neighbor_ckpt.snapshot.razor import plan_shards, TensorMeta, StateKind
from neighbor_ckpt.snapshot.store import HostStore, ROLE_OWN
from neighbor_ckpt.recovery.flow import read_tensors

store = HostStore(Path(tempfile.mkdtemp()), job_id="j", rank=0)
src = [torch.arange(100, dtype=torch.float32), torch.ones(7, dtype=torch.float64)]
plan = plan_shards([TensorMeta.of(f"t{i}", StateKind.OPTIMIZER, t) for i, t in enumerate(src)], dp_size=1,
                   distributed_optimizer=False)
eng = SnapshotEngine(store=store, plan=plan, sources=src, layout="L", meta={}, transport=None)
for it in range(1, 7):
    src[0].add_(1)
    src[1].mul_(2)
    eng.snapshot(it, {"blob": "x" * (10 if it < 4 else 200_000)})  # small state grows at iteration 4
    eng.wait()
    ref = {r.header.iteration: r for r in store.committed(ROLE_OWN, verify=True)}[it]
    got = read_tensors(store.slot(ROLE_OWN, ref.index), ref.header)
    assert torch.equal(got["t0"], src[0]) and torch.equal(got["t1"], src[1]), it
assert eng.stats.failures == 0
eng.close()
print("OK")
"""


def test_snapshot_engine_survives_small_state_growth_that_recreates_its_slots():
    import subprocess
    import sys
    from pathlib import Path

    import neighbor_ckpt

    root = str(Path(neighbor_ckpt.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # a separate interpreter: the failure mode is a segmentation fault
    def no_core_dump():
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    proc = subprocess.run([sys.executable, "-c", _GROWTH_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                          timeout=120, preexec_fn=no_core_dump)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (proc.returncode, proc.stderr[-2000:])


# -- a slot prepared in advance (a replaced rank's receive slot) ----------------------------------------------------

CAPS = {"header_cap": 4096, "payload_cap": 1 << 20, "extras_cap": 65536}


def _prepared(store) -> SlotFile:
    """Wait until the slot the store prepares is there (it is absent while being made) and return it."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        slot = store.slot(ROLE_OWN, 0)
        if slot is not None:
            return slot
        time.sleep(0.005)
    raise AssertionError("the prepared slot did not appear within 120 s")


def test_a_prepared_slot_is_the_one_the_first_write_of_its_role_lands_in(store):
    assert store.prefault(ROLE_OWN, **CAPS)
    assert not store.prefault(ROLE_OWN, **CAPS), "one at a time"
    assert list(store.committed(ROLE_OWN, verify=True)) == []  # made or being made: it holds nothing
    slot = _prepared(store)
    inode = os.stat(slot.path).st_ino
    assert store.ensure(ROLE_OWN, 0, **CAPS) is slot and os.stat(slot.path).st_ino == inode, "not made again"
    assert store.prepared is not None and store.prepared.used and store.prepared.error is None
    assert os.stat(slot.path).st_blocks * 512 >= slot.size  # its memory is there
    raw = slot.path.read_bytes()  # every page was written once, and nothing changed: preamble intact, rest zero
    assert SlotFile.open(slot.path).capacities == tuple(CAPS.values())
    assert not any(raw[PREAMBLE_BYTES:])
    assert store.slot_for_write(ROLE_OWN) == 0


def test_ensure_waits_for_the_slot_being_prepared(store):
    assert store.prefault(ROLE_OWN, **CAPS)
    slot = store.ensure(ROLE_OWN, 0, **CAPS)  # right away: joins the preparing thread
    assert store.prepared is not None and store.prepared.slot is slot and store.prepared.used
    assert store.prepared.waited >= 0.0, "how long the join took is recorded"


def test_a_slot_is_prepared_only_for_a_role_without_files(store):
    store.ensure(ROLE_OWN, 1, **CAPS)
    assert not store.prefault(ROLE_OWN, **CAPS)
    assert store.prefault(ROLE_REPLICA, **CAPS)


def test_a_prepared_slot_of_other_capacities_is_replaced_by_the_one_the_write_needs(store):
    assert store.prefault(ROLE_OWN, **CAPS)
    slot = store.ensure(ROLE_OWN, 0, **dict(CAPS, payload_cap=4096))
    assert slot.capacities == (4096, 4096, 65536)
    assert store.path(ROLE_OWN, 0).stat().st_size == slot_file_size(4096, 4096, 65536)
    assert store.prepared is not None and not store.prepared.used


def test_a_failed_preparation_is_logged_and_the_slot_is_made_when_needed(store, monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert store.prefault(ROLE_OWN, **CAPS)
    store.close()  # waits for it
    monkeypatch.undo()
    assert "preparing the own slot in advance failed" in caplog.text and "cannot reserve" in caplog.text
    assert not list(store.dir.glob("*.tmp")) and not store.path(ROLE_OWN, 0).exists()
    assert store.ensure(ROLE_OWN, 0, **CAPS).capacities == tuple(CAPS.values())


# -- small tensors staged on the training thread; the hot path -----------------------------------------------------


class _HeldEngine:
    """A SnapshotEngine whose background thread starts a job only when the test releases it: what a slow engine
    thread and a fast next forward look like, made deterministic."""

    def __init__(self, store, plan, sources, **kw):
        import threading

        from neighbor_ckpt.snapshot.engine import SnapshotEngine

        self.go = threading.Event()
        self.engine = SnapshotEngine(store=store, plan=plan, sources=sources, layout="L", meta={}, transport=None,
                                     **kw)
        process = self.engine._process

        def held(job):
            self.go.wait(30)
            process(job)

        self.engine._process = held


def test_staged_buffers_and_extras_tensors_are_copied_by_snapshot_not_by_the_engine_thread(store):
    """The next forward mutates a BatchNorm buffer (and the caller may reuse an extras tensor) right after
    snapshot() returns, while the engine thread has not run yet: the snapshot holds the values at snapshot()."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    named = TorchOptimizerAdapter(model, opt).named_tensors()
    plan = plan_shards([m for m, _ in named], dp_size=1, distributed_optimizer=False)
    live = {m.name: t for m, t in named}
    assert {p.meta.name for p in plan.staged} == {"buffer/1.running_mean", "buffer/1.running_var",
                                                  "buffer/1.num_batches_tracked"}
    held = _HeldEngine(store, plan, [live[p.meta.name] for p in plan.unique])
    engine = held.engine
    want = {k: v.clone() for k, v in live.items()}
    scale = torch.tensor([1024.0])
    try:
        engine.snapshot(1, {"scale": scale})
        with torch.no_grad():
            model(torch.randn(5, 3))  # the next forward: BatchNorm updates its statistics in place
            scale.mul_(2)
        assert not torch.equal(live["buffer/1.running_mean"], want["buffer/1.running_mean"])
        held.go.set()
        engine.wait()
    finally:
        held.go.set()
        engine.close()
    assert engine.stats.failures == 0
    [ref] = store.committed(ROLE_OWN, verify=True)
    slot = store.slot(ROLE_OWN, ref.index)
    got = read_tensors(slot, ref.header)
    for name in want:
        assert_bit_equal(got[name], want[name])
    assert_bit_equal(slot.read_extras(ref.header)["scale"], torch.tensor([1024.0]))


def test_stage_small_copies_a_cpu_tensor_at_once_into_a_given_or_new_host_tensor():
    from neighbor_ckpt.snapshot.engine import _stage_small

    src = torch.arange(6, dtype=torch.float32).view(2, 3).t()  # not contiguous
    new = _stage_small(src)
    assert new.data_ptr() != src.data_ptr() and torch.equal(new, src) and not new.is_pinned()
    dst = torch.empty(3, 2)
    assert _stage_small(src, dst) is dst and torch.equal(dst, src)
    src.zero_()
    assert not torch.equal(dst, src)


def test_the_wait_point_blocks_once_per_snapshot_and_snapshot_does_not_wait_again(store):
    named = state(2)
    plan = plan_shards([m for m, _ in named], dp_size=1, distributed_optimizer=False)
    live = {m.name: t for m, t in named}
    held = _HeldEngine(store, plan, [live[p.meta.name] for p in plan.unique], wait_for_replica=False)
    engine = held.engine
    import threading

    try:
        engine.snapshot(1, {})
        threading.Timer(0.2, held.go.set).start()
        engine.wait()  # the wait point blocks until the engine thread committed
        first = engine.stats.wait_seconds
        assert first >= 0.1
        engine.wait()  # a second hook in the same step: no wait, the figure of the real one is kept
        assert engine.stats.wait_seconds == first
        engine.snapshot(2, {})
        engine.wait()
    finally:
        held.go.set()
        engine.close()
    assert [r.header.iteration for r in sorted(store.committed(ROLE_OWN, verify=True),
                                                key=lambda r: r.header.iteration)] == [1, 2]


def test_the_engine_reads_its_slot_headers_once_and_keeps_alternating_between_them(store, monkeypatch):
    from neighbor_ckpt.snapshot.engine import SnapshotEngine

    named = state(3)
    plan = plan_shards([m for m, _ in named], dp_size=1, distributed_optimizer=False)
    live = {m.name: t for m, t in named}
    write_image(store, ROLE_OWN, planned=plan.unique, sources=[live[p.meta.name] for p in plan.unique],
                payload_bytes=plan.unique_bytes, iteration=7, layout="L", meta={}, extras={})  # slot 0 holds 7
    reads = []
    real = SlotFile.read_header
    monkeypatch.setattr(SlotFile, "read_header", lambda self: reads.append(self.path.name) or real(self))
    engine = SnapshotEngine(store=store, plan=plan, sources=[live[p.meta.name] for p in plan.unique], layout="L",
                            meta={"x": 1}, transport=None)
    try:
        for it in range(8, 14):
            engine.snapshot(it, {"it": it})
            engine.wait()
    finally:
        engine.close()
    assert len(reads) <= store.versions, reads  # once, at the first snapshot
    monkeypatch.setattr(SlotFile, "read_header", real)
    assert sorted(r.header.iteration for r in store.committed(ROLE_OWN, verify=True)) == [12, 13]


def test_a_header_committed_from_pre_encoded_meta_is_the_header_json(store):
    """The engine encodes its tensor table once and only appends the commit time: the header on disk is exactly the
    JSON of the SlotHeader it returns."""
    from neighbor_ckpt.snapshot.store import encode_meta

    for meta in ({}, {"tensors": [{"name": "a", "shape": [2]}], "plan": "p"}):
        slot = store.ensure(ROLE_OWN, 0, header_cap=8192, payload_cap=64, extras_cap=65536)
        slot.invalidate()
        hdr = store.commit_image(slot, ROLE_OWN, iteration=3, layout="L", payload_nbytes=64, extras_text="{}",
                                 extras_tensors=[], meta=meta, meta_text=encode_meta(meta))
        assert header_dict(slot.path) == hdr.to_json() == slot.read_header().to_json()
        assert hdr.meta["committed_unix"] > 0
