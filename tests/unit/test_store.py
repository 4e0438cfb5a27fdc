"""Host store: slot files written by ``engine.write_image`` and read back through every validation step."""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import struct
import time

import numpy as np
import pytest
import torch
from torch import nn

from neighbor_ckpt.adapters.torch_optim import TorchOptimizerAdapter
from neighbor_ckpt.snapshot.engine import header_capacity, write_image
from neighbor_ckpt.errors import HostMemoryError, SnapshotCorruptError, SnapshotMismatchError
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
from neighbor_ckpt.recovery.flow import read_tensors
from neighbor_ckpt.snapshot.store import (FORMAT_VERSION, MARKER, MARKER_BYTES, PREAMBLE_BYTES, ROLE_LAZY, ROLE_OWN,
                                 ROLE_REPLICA, HostStore, SlotFile, checksum, slot_file_size)

JOB = "job-unit"


# -- helpers -------------------------------------------------------------------------------------------------


def state(seed: int = 0) -> list[tuple[TensorMeta, torch.Tensor]]:
    """A rank's state with awkward dtypes/shapes and non-finite values."""
    g = torch.Generator().manual_seed(seed)
    main = torch.randn(37, generator=g)
    main[0], main[1], main[2] = float("nan"), float("-inf"), -0.0
    tensors = {
        "model/w": (StateKind.WEIGHT, torch.randn(6, 4, generator=g).to(torch.bfloat16)),
        "main/shard": (StateKind.MAIN_PARAM, main),
        "optim/exp_avg": (StateKind.OPTIMIZER, torch.randn(5, 7, generator=g).to(torch.bfloat16)),
        "optim/exp_avg_sq": (StateKind.OPTIMIZER, torch.rand(5, 7, generator=g, dtype=torch.float64)),
        "optim/step": (StateKind.OPTIMIZER, torch.tensor(float(seed + 3))),
        "optim/mask": (StateKind.OPTIMIZER, torch.tensor([True, False, True])),
        "optim/ids": (StateKind.OPTIMIZER, torch.arange(11, dtype=torch.int64) * (seed + 1)),
    }
    return [(TensorMeta.of(n, k, t), t) for n, (k, t) in tensors.items()]


def extras(seed: int = 0) -> dict:
    rng = random.Random(seed)
    nprng = np.random.RandomState(seed)
    return {"iteration": seed, "python": rng.getstate(), "numpy": nprng.get_state(),
            "torch": torch.Generator().manual_seed(seed).get_state(), "lr": 1e-3 * (seed + 1),
            "loop": {0: "epoch", "batches": (3, 4), "tag": b"\x00\xff"}}


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert bits(a) == bits(b)


def write(store: HostStore, iteration: int, *, seed: int | None = None, role: str = ROLE_OWN, job_extras=None):
    """Write one image of ``state(seed)`` (DP 2 + distributed optimizer); returns (slot, hdr, plan, sources)."""
    named = state(iteration if seed is None else seed)
    plan = plan_shards([m for m, _ in named], dp_size=2, distributed_optimizer=True)
    by_name = {m.name: t for m, t in named}
    sources = [by_name[p.meta.name] for p in plan.unique]
    slot, hdr = write_image(store, role, planned=plan.unique, sources=sources, payload_bytes=plan.unique_bytes,
                            iteration=iteration, layout="layout-A", meta={"plan": plan.signature},
                            extras=extras(iteration) if job_extras is None else job_extras)
    return slot, hdr, plan, sources


@pytest.fixture
def store(tmp_path):
    s = HostStore(tmp_path / "store", job_id=JOB, rank=3, versions=2)
    yield s
    s.close()


def written(store: HostStore, iteration: int = 7):
    """Write one image and close the store's mappings (so the file can be mangled safely)."""
    slot, hdr, plan, sources = write(store, iteration)
    path = slot.path
    store.close()
    return path, hdr, plan, sources


def patch(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def forge_header(path, d: dict, *, marker_iteration: int | None = None) -> None:
    """Write a header and a *matching* commit marker (a consistent image with chosen header content)."""
    raw = json.dumps(d).encode()
    s = SlotFile.open(path)
    marker_off = s.marker_off
    s.close()
    patch(path, PREAMBLE_BYTES, struct.pack("<I", len(raw)) + raw)
    it = d.get("iteration", 0) if marker_iteration is None else marker_iteration
    patch(path, marker_off, MARKER.pack(b"NCKPTCMT", it, checksum(raw)))


def header_dict(path) -> dict:
    with open(path, "rb") as f:
        f.seek(PREAMBLE_BYTES)
        (n,) = struct.unpack("<I", f.read(4))
        return json.loads(f.read(n))


# -- layout on disk ------------------------------------------------------------------------------------------


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


def test_slot_file_size_matches_the_capacities_and_host_bytes(store):
    slot, _, _, _ = write(store, 1)
    assert slot.path.stat().st_size == slot_file_size(*slot.capacities) == slot.size
    assert slot.payload_off % 4096 == 0 and slot.extras_off % 64 == 0 and slot.marker_off % 64 == 0
    assert store.host_bytes() == slot.size


# -- round trip ----------------------------------------------------------------------------------------------


def test_written_image_reads_back_bit_exactly_through_a_fresh_mapping(store):
    path, hdr, plan, sources = written(store, 7)
    s = SlotFile.open(path)
    try:
        got = s.read_header()
        assert got == hdr
        assert got.iteration == 7 and got.job_id == JOB and got.owner_rank == 3 and got.role == ROLE_OWN
        assert got.layout == "layout-A" and got.meta["plan"] == plan.signature
        assert got.payload_nbytes == plan.unique_bytes
        s.verify(got)
        tensors = read_tensors(s, got)
        assert list(tensors) == [p.meta.name for p in plan.unique]
        assert "model/w" not in tensors  # regenerable: never written
        for p, src in zip(plan.unique, sources):
            assert_bit_equal(tensors[p.meta.name], src)
        ex = s.read_extras(got)
        want = extras(7)
        assert ex["python"] == want["python"]
        np_state, np_want = ex["numpy"], want["numpy"]
        assert np_state[0] == np_want[0] and np.array_equal(np_state[1], np_want[1])
        assert np_state[1].dtype == np_want[1].dtype and np_state[2:] == np_want[2:]
        assert_bit_equal(ex["torch"], want["torch"])
        assert ex["lr"].hex() == want["lr"].hex()
        assert ex["loop"] == want["loop"]
        assert isinstance(ex["loop"]["batches"], tuple)
        r = random.Random()
        r.setstate(ex["python"])
        assert r.random() == random.Random(7).random()
    finally:
        s.close()


def test_read_tensors_views_live_in_the_slot_payload(store):
    slot, hdr, plan, _ = write(store, 1)
    tensors = read_tensors(slot, hdr)
    base = slot.payload.data_ptr()
    for p in plan.unique:
        if p.meta.nbytes:
            assert tensors[p.meta.name].data_ptr() == base + p.offset


def test_image_with_no_unique_tensors_round_trips_its_extras(store):
    named = state(0)
    plan = plan_shards([m for m, _ in named], dp_size=2, distributed_optimizer=False)
    assert plan.unique_bytes == 0
    slot, hdr = write_image(store, ROLE_OWN, planned=plan.unique, sources=[], payload_bytes=0, iteration=4,
                            layout="L", meta={}, extras={"k": 1.5})
    hdr2 = slot.read_header()
    slot.verify(hdr2)
    assert read_tensors(slot, hdr2) == {}
    assert slot.read_extras(hdr2) == {"k": 1.5}


def test_lazy_backup_of_ddp_state_round_trips(store):
    named = state(5)
    plan = plan_shards([m for m, _ in named], dp_size=4, distributed_optimizer=False)
    srcs = [t for _, t in named]
    slot, hdr = write_image(store, ROLE_LAZY, planned=plan.lazy, sources=srcs, payload_bytes=plan.lazy_bytes,
                            iteration=9, layout="L", meta={"dp_group": 0}, extras={})
    got = read_tensors(slot, slot.read_header())
    for (m, t) in named:
        assert_bit_equal(got[m.name], t)
    assert hdr.role == ROLE_LAZY and hdr.meta["dp_group"] == 0


def test_header_region_is_json_not_pickle(store):
    path, hdr, _, _ = written(store)
    data = path.read_bytes()
    assert data[:8] == b"NCKPTSLT"
    for marker in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"):
        assert not data[:2].startswith(marker) and not data[PREAMBLE_BYTES + 4:].startswith(marker)
    d = header_dict(path)
    assert d["format"] == FORMAT_VERSION and d["iteration"] == hdr.iteration
    assert d == hdr.to_json()
    # extras region starts with JSON text as well
    s = SlotFile.open(path)
    try:
        json.loads(data[s.extras_off:s.extras_off + hdr.extras_json_nbytes])
    finally:
        s.close()


def test_torch_optimizer_adapter_state_survives_a_slot_round_trip(store):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
    adapter = TorchOptimizerAdapter(model, opt)
    named = adapter.named_tensors()
    plan = plan_shards([m for m, _ in named], dp_size=1, distributed_optimizer=False)
    # BatchNorm's running statistics and batch counter are changing buffers: staged, in the payload too
    assert len(plan.unique) == len(named)
    assert {m.kind for m, _ in named} == {StateKind.WEIGHT, StateKind.BUFFER, StateKind.OPTIMIZER}
    assert [p.meta.name for p in plan.staged] == ["buffer/1.running_mean", "buffer/1.running_var",
                                                  "buffer/1.num_batches_tracked"]
    live = {m.name: t for m, t in named}
    slot, hdr = write_image(store, ROLE_OWN, planned=plan.unique, sources=[live[p.meta.name] for p in plan.unique],
                            payload_bytes=plan.unique_bytes, iteration=2, layout="L", meta={},
                            extras=adapter.capture_extras())
    path = slot.path
    store.close()

    torch.manual_seed(123)
    model2 = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    s = SlotFile.open(path)
    h = s.read_header()
    s.verify(h)
    TorchOptimizerAdapter(model2, opt2).load(read_tensors(s, h), s.read_extras(h))
    s.close()
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert_bit_equal(a, b)
    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd1["param_groups"] == sd2["param_groups"]
    for pid in sd1["state"]:
        for k, v in sd1["state"][pid].items():
            assert_bit_equal(v, sd2["state"][pid][k])
    # and training continues identically
    x = torch.randn(8, 4)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert_bit_equal(a.detach(), b.detach())


# -- validation: typed errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 10, PREAMBLE_BYTES - 1, PREAMBLE_BYTES, 5000, -1])
def test_truncated_slot_file_is_corrupt_at_open(store, keep):
    path, _, _, _ = written(store)
    size = path.stat().st_size
    os.truncate(path, size - 1 if keep == -1 else keep)
    with pytest.raises(SnapshotCorruptError, match="truncated"):
        SlotFile.open(path)


def test_padded_slot_file_is_corrupt_at_open(store):
    path, _, _, _ = written(store)
    with open(path, "ab") as f:
        f.write(b"\0" * 64)
    with pytest.raises(SnapshotCorruptError, match="padded"):
        SlotFile.open(path)


def test_wrong_magic_is_corrupt(store):
    path, _, _, _ = written(store)
    patch(path, 0, b"PK\x03\x04xxxx")
    with pytest.raises(SnapshotCorruptError, match="bad magic"):
        SlotFile.open(path)


def test_unsupported_format_version_in_the_preamble_is_a_mismatch(store):
    path, _, _, _ = written(store)
    patch(path, 8, struct.pack("<I", FORMAT_VERSION + 1))
    with pytest.raises(SnapshotMismatchError, match=f"format {FORMAT_VERSION + 1}"):
        SlotFile.open(path)


def test_unsupported_format_version_in_the_header_is_a_mismatch(store):
    path, _, _, _ = written(store)
    d = header_dict(path)
    d["format"] = FORMAT_VERSION + 1
    forge_header(path, d)
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotMismatchError, match="not supported"):
            s.read_header()
    finally:
        s.close()


def test_never_committed_slot_is_corrupt(tmp_path):
    s = SlotFile.create(tmp_path / "fresh.slot", header_cap=4096, payload_cap=128, extras_cap=128)
    try:
        with pytest.raises(SnapshotCorruptError, match="no commit marker"):
            s.read_header()
    finally:
        s.close()


def test_invalidated_slot_is_corrupt_and_survives_reopening(store):
    slot, _, _, _ = write(store, 3)
    slot.invalidate()
    with pytest.raises(SnapshotCorruptError, match="no commit marker"):
        slot.read_header()
    path = slot.path
    store.close()
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotCorruptError):
            s.read_header()
    finally:
        s.close()


def test_flipped_payload_byte_is_caught_by_verify_not_by_read_header(store):
    path, hdr, plan, _ = written(store)
    s = SlotFile.open(path)
    off = s.payload_off + plan.unique[1].offset + 3
    s.close()
    flip(path, off)
    s = SlotFile.open(path)
    try:
        got = s.read_header()
        assert got == hdr
        with pytest.raises(SnapshotCorruptError, match="payload checksum"):
            s.verify(got)
    finally:
        s.close()


def test_flipped_byte_in_alignment_padding_of_the_payload_is_caught_by_verify(store):
    path, hdr, plan, _ = written(store)
    p = plan.unique[0]
    assert p.meta.nbytes % 64  # the first unique tensor is followed by padding
    s = SlotFile.open(path)
    off = s.payload_off + p.offset + p.meta.nbytes
    s.close()
    flip(path, off)
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotCorruptError, match="payload checksum"):
            s.verify(s.read_header())
    finally:
        s.close()


def test_flipped_extras_byte_is_caught_by_verify(store):
    path, hdr, _, _ = written(store)
    s = SlotFile.open(path)
    off = s.extras_off + hdr.extras_nbytes - 1
    s.close()
    flip(path, off)
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotCorruptError, match="extras checksum"):
            s.verify(s.read_header())
    finally:
        s.close()


@pytest.mark.parametrize("where", ["length", "json", "json_end"])
def test_flipped_header_byte_is_caught_by_read_header(store, where):
    path, hdr, _, _ = written(store)
    n = len(json.dumps(hdr.to_json(), separators=(",", ":")).encode())
    off = {"length": PREAMBLE_BYTES, "json": PREAMBLE_BYTES + 4 + 10, "json_end": PREAMBLE_BYTES + 4 + n - 1}[where]
    flip(path, off)
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotCorruptError):
            s.read_header()
    finally:
        s.close()


@pytest.mark.parametrize("field_off", [8, 9, 16, 20])
def test_flipped_marker_iteration_or_checksum_is_caught_by_read_header(store, field_off):
    path, _, _, _ = written(store)
    s = SlotFile.open(path)
    off = s.marker_off + field_off
    s.close()
    flip(path, off)
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotCorruptError):
            s.read_header()
    finally:
        s.close()


def test_header_length_beyond_capacity_is_corrupt(store):
    path, _, _, _ = written(store)
    patch(path, PREAMBLE_BYTES, struct.pack("<I", 2**32 - 1))
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotCorruptError, match="exceeds capacity"):
            s.read_header()
    finally:
        s.close()


def test_consistent_header_with_missing_keys_is_corrupt(store):
    path, _, _, _ = written(store)
    d = header_dict(path)
    del d["payload_nbytes"]
    forge_header(path, d)
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotCorruptError, match="malformed header"):
            s.read_header()
    finally:
        s.close()


@pytest.mark.parametrize("bad", [{"iteration": "seven"}, {"owner_rank": None}, {"extras_tensors": 5},
                                 {"meta": "xy"}, {"payload_xxh3": [1]}])
def test_consistent_header_with_wrong_value_types_is_corrupt(store, bad):
    path, _, _, _ = written(store)
    d = header_dict(path)
    d.update(bad)
    forge_header(path, d, marker_iteration=7)
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotCorruptError):
            s.read_header()
    finally:
        s.close()


def test_consistent_header_with_an_infinite_number_is_corrupt(store):
    path, _, _, _ = written(store)
    d = header_dict(path)
    d["owner_rank"] = float("inf")
    forge_header(path, d)
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotCorruptError):
            s.read_header()
    finally:
        s.close()


def test_marker_iteration_that_disagrees_with_the_header_is_corrupt(store):
    path, _, _, _ = written(store)
    forge_header(path, header_dict(path), marker_iteration=8)
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotCorruptError, match="marker iteration 8"):
            s.read_header()
    finally:
        s.close()


def test_header_sizes_beyond_capacities_are_corrupt(store):
    path, _, _, _ = written(store)
    d = header_dict(path)
    d["payload_nbytes"] = 10**9
    forge_header(path, d)
    s = SlotFile.open(path)
    try:
        with pytest.raises(SnapshotCorruptError, match="capacities"):
            s.read_header()
    finally:
        s.close()


def test_without_checksums_torn_headers_are_still_caught_but_payload_flips_are_not(tmp_path):
    st = HostStore(tmp_path / "s", job_id=JOB, rank=0, use_checksum=False)
    _, hdr, plan, _ = write(st, 5)
    assert hdr.payload_xxh3 is None and hdr.extras_xxh3 is None
    path = st.path(ROLE_OWN, 0)
    st.close()
    s = SlotFile.open(path)
    off = s.payload_off + 5
    s.close()
    flip(path, off)
    s = SlotFile.open(path)
    s.verify(s.read_header())  # documented: bit flips go unnoticed with checksum "none"
    s.close()
    flip(path, PREAMBLE_BYTES + 20)
    s = SlotFile.open(path)
    with pytest.raises(SnapshotCorruptError):
        s.read_header()
    s.close()


def test_commit_refuses_a_header_larger_than_its_capacity(tmp_path):
    s = SlotFile.create(tmp_path / "small.slot", header_cap=64, payload_cap=0, extras_cap=64)
    try:
        with pytest.raises(ValueError, match="does not fit"):
            write_image_into(s)
    finally:
        s.close()


def write_image_into(slot: SlotFile) -> None:
    from neighbor_ckpt.snapshot.store import SlotHeader

    slot.commit(SlotHeader(job_id="j" * 200, owner_rank=0, layout="L", iteration=1, role=ROLE_OWN, payload_nbytes=0,
                           payload_xxh3=None, extras_json_nbytes=0, extras_tensors=[], extras_nbytes=0,
                           extras_xxh3=None))


def test_extras_that_do_not_fit_raise_value_error(store):
    named = state(0)
    plan = plan_shards([m for m, _ in named], dp_size=1, distributed_optimizer=False)
    with pytest.raises(ValueError, match="do not fit"):
        write_image(store, ROLE_OWN, planned=plan.unique, sources=[t for _, t in named],
                    payload_bytes=plan.unique_bytes, iteration=1, layout="L", meta={},
                    extras={"big": "x" * 5000}, extras_cap=1024)


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


def test_image_segments_are_enough_to_rebuild_a_valid_copy(store, tmp_path):
    slot, hdr, plan, sources = write(store, 8)
    segs = slot.image_segments(hdr)
    assert segs[-1] == (slot.marker_off, MARKER_BYTES)  # commit marker travels last
    copy = SlotFile.create(tmp_path / "copy.slot", header_cap=slot.header_cap, payload_cap=slot.payload_cap,
                           extras_cap=slot.extras_cap)
    try:
        for off, n in segs:
            copy.segment(off, n).copy_(slot.segment(off, n))
        got = copy.read_header()
        assert got == hdr
        copy.verify(got)
        t = read_tensors(copy, got)
        for p, src in zip(plan.unique, sources):
            assert_bit_equal(t[p.meta.name], src)
    finally:
        copy.close()


def test_header_capacity_is_page_aligned_and_holds_the_meta():
    meta = {"tensors": [{"name": "x" * 100, "shape": [1, 2, 3]}] * 50}
    cap = header_capacity(meta)
    assert cap % 4096 == 0 and cap >= 2 * len(json.dumps(meta))


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


# -- zero-element tensors ----------------------------------------------------------------------------------------



def _empty_state():
    named = [(TensorMeta.of("optim/exp_avg", StateKind.OPTIMIZER, t), t) for t in [torch.arange(6.0)]]
    e = torch.empty(0, 3)
    named.append((TensorMeta.of("optim/empty", StateKind.OPTIMIZER, e), e))
    return named


def test_write_image_accepts_a_zero_element_tensor_with_a_non_flat_shape(store):
    named = _empty_state()
    plan = plan_shards([m for m, _ in named], dp_size=1, distributed_optimizer=False)
    slot, hdr = write_image(store, ROLE_OWN, planned=plan.unique, sources=[t for _, t in named],
                            payload_bytes=plan.unique_bytes, iteration=1, layout="L", meta={}, extras={})
    got = read_tensors(slot, slot.read_header())
    assert got["optim/empty"].shape == (0, 3)
    assert_bit_equal(got["optim/exp_avg"], named[0][1])


def test_snapshot_engine_commits_a_state_holding_a_zero_element_tensor(store):
    from neighbor_ckpt.snapshot.engine import SnapshotEngine

    named = _empty_state()
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


def test_slot_memory_is_reserved_at_creation_and_a_full_filesystem_is_a_host_memory_error(store, monkeypatch):
    """A sparse slot on a full /dev/shm would SIGBUS the first copy into it; reserving its blocks up front turns that
    into a typed error with advice, and leaves no half-created file."""
    slot = store.ensure(ROLE_OWN, 0, header_cap=4096, payload_cap=1 << 20, extras_cap=65536)
    assert os.stat(slot.path).st_blocks * 512 >= slot.size  # allocated, not sparse

    def full(fd, offset, length):
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(HostMemoryError, match="cannot reserve .* enlarge /dev/shm"):
        store.ensure(ROLE_OWN, 1, header_cap=4096, payload_cap=1 << 20, extras_cap=65536)
    assert not list(store.dir.glob("*.tmp")) and not (store.dir / "own.1.slot").exists()


# -- a slot prepared in advance (a replaced rank's receive slot) ----------------------------------------------------

CAPS = {"header_cap": 4096, "payload_cap": 1 << 20, "extras_cap": 65536}


def _prepared(store) -> SlotFile:
    """Wait until the slot the store prepares is there (it is absent while being made) and return it."""
    for _ in range(2000):
        slot = store.slot(ROLE_OWN, 0)
        if slot is not None:
            return slot
        time.sleep(0.005)
    raise AssertionError("the prepared slot never appeared")


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
