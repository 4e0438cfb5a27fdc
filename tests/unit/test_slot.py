"""One slot file (``neighbor_ckpt/snapshot/slot.py``): its layout on disk, the header, the checksums and the commit
marker; images written by ``engine.write_image`` read back through every validation step, and every kind of damage
refused with a typed error. The rank's slots and their directories: ``test_store.py``."""

from __future__ import annotations

import json
import os
import random
import struct
from contextlib import closing

import numpy as np
import pytest
import torch
from torch import nn

from neighbor_ckpt.adapters.torch_optim import TorchOptimizerAdapter
from neighbor_ckpt.errors import HostMemoryError, SnapshotCorruptError, SnapshotMismatchError
from neighbor_ckpt.recovery.flow import read_tensors
from neighbor_ckpt.snapshot.engine import header_capacity, write_image
from neighbor_ckpt.snapshot.razor import StateKind, plan_shards
from neighbor_ckpt.snapshot.slot import (FORMAT_VERSION, MARKER_BYTES, PREAMBLE_BYTES, SlotFile, SlotHeader,
                                         slot_file_size)
from neighbor_ckpt.snapshot.store import ROLE_LAZY, ROLE_OWN, HostStore
from tests.unit.slot_images import (JOB, assert_bit_equal, empty_state, extras, flip, forge_header, header_dict,
                                    new_store, opened, patch, state, write, written)


@pytest.fixture
def store(tmp_path):
    s = new_store(tmp_path)
    yield s
    s.close()


def read_header_fails(path, error=SnapshotCorruptError, match=None) -> None:
    """A fresh mapping of ``path`` opens, and its ``read_header`` raises ``error``."""
    with opened(path) as s, pytest.raises(error, match=match):
        s.read_header()


def verify_fails(path, match: str) -> SlotHeader:
    """``read_header`` of ``path`` passes and ``verify`` raises :class:`SnapshotCorruptError`; returns the header."""
    with opened(path) as s:
        hdr = s.read_header()
        with pytest.raises(SnapshotCorruptError, match=match):
            s.verify(hdr)
    return hdr


def offset(path, region: str) -> int:
    """Where ``region`` (``payload``, ``extras``, ``marker``) starts in the slot file at ``path``."""
    with opened(path) as s:
        return getattr(s, f"{region}_off")


# -- layout on disk ------------------------------------------------------------------------------------------


def test_slot_file_size_matches_the_capacities_and_host_bytes(store):
    slot, _, _, _ = write(store, 1)
    assert slot.path.stat().st_size == slot_file_size(*slot.capacities) == slot.size
    assert slot.payload_off % 4096 == 0 and slot.extras_off % 64 == 0 and slot.marker_off % 64 == 0
    assert store.host_bytes() == slot.size


def test_header_capacity_is_page_aligned_and_holds_the_meta():
    meta = {"tensors": [{"name": "x" * 100, "shape": [1, 2, 3]}] * 50}
    cap = header_capacity(meta)
    assert cap % 4096 == 0 and cap >= 2 * len(json.dumps(meta))


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


# -- round trip ----------------------------------------------------------------------------------------------


def test_written_image_reads_back_bit_exactly_through_a_fresh_mapping(store):
    path, hdr, plan, sources = written(store, 7)
    with opened(path) as s:
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


def test_write_image_accepts_a_zero_element_tensor_with_a_non_flat_shape(store):
    named = empty_state()
    plan = plan_shards([m for m, _ in named], dp_size=1, distributed_optimizer=False)
    slot, hdr = write_image(store, ROLE_OWN, planned=plan.unique, sources=[t for _, t in named],
                            payload_bytes=plan.unique_bytes, iteration=1, layout="L", meta={}, extras={})
    got = read_tensors(slot, slot.read_header())
    assert got["optim/empty"].shape == (0, 3)
    assert_bit_equal(got["optim/exp_avg"], named[0][1])


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
    extras_off = offset(path, "extras")
    json.loads(data[extras_off:extras_off + hdr.extras_json_nbytes])


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
    with opened(path) as s:
        h = s.read_header()
        s.verify(h)
        TorchOptimizerAdapter(model2, opt2).load(read_tensors(s, h), s.read_extras(h))
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


def test_image_segments_are_enough_to_rebuild_a_valid_copy(store, tmp_path):
    slot, hdr, plan, sources = write(store, 8)
    segs = slot.image_segments(hdr)
    assert segs[-1] == (slot.marker_off, MARKER_BYTES)  # commit marker travels last
    copy = SlotFile.create(tmp_path / "copy.slot", header_cap=slot.header_cap, payload_cap=slot.payload_cap,
                           extras_cap=slot.extras_cap)
    with closing(copy):
        for off, n in segs:
            copy.segment(off, n).copy_(slot.segment(off, n))
        got = copy.read_header()
        assert got == hdr
        copy.verify(got)
        t = read_tensors(copy, got)
        for p, src in zip(plan.unique, sources):
            assert_bit_equal(t[p.meta.name], src)


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


def test_never_committed_slot_is_corrupt(tmp_path):
    s = SlotFile.create(tmp_path / "fresh.slot", header_cap=4096, payload_cap=128, extras_cap=128)
    with closing(s), pytest.raises(SnapshotCorruptError, match="no commit marker"):
        s.read_header()


def test_invalidated_slot_is_corrupt_and_survives_reopening(store):
    slot, _, _, _ = write(store, 3)
    slot.invalidate()
    with pytest.raises(SnapshotCorruptError, match="no commit marker"):
        slot.read_header()
    path = slot.path
    store.close()
    read_header_fails(path)


def test_flipped_payload_byte_is_caught_by_verify_not_by_read_header(store):
    path, hdr, plan, _ = written(store)
    flip(path, offset(path, "payload") + plan.unique[1].offset + 3)
    assert verify_fails(path, "payload checksum") == hdr


def test_flipped_byte_in_alignment_padding_of_the_payload_is_caught_by_verify(store):
    path, hdr, plan, _ = written(store)
    p = plan.unique[0]
    assert p.meta.nbytes % 64  # the first unique tensor is followed by padding
    flip(path, offset(path, "payload") + p.offset + p.meta.nbytes)
    verify_fails(path, "payload checksum")


def test_flipped_extras_byte_is_caught_by_verify(store):
    path, hdr, _, _ = written(store)
    flip(path, offset(path, "extras") + hdr.extras_nbytes - 1)
    verify_fails(path, "extras checksum")


@pytest.mark.parametrize("where", ["length", "json", "json_end"])
def test_flipped_header_byte_is_caught_by_read_header(store, where):
    path, hdr, _, _ = written(store)
    n = len(json.dumps(hdr.to_json(), separators=(",", ":")).encode())
    off = {"length": PREAMBLE_BYTES, "json": PREAMBLE_BYTES + 4 + 10, "json_end": PREAMBLE_BYTES + 4 + n - 1}[where]
    flip(path, off)
    read_header_fails(path)


@pytest.mark.parametrize("field_off", [8, 9, 16, 20])
def test_flipped_marker_iteration_or_checksum_is_caught_by_read_header(store, field_off):
    path, _, _, _ = written(store)
    flip(path, offset(path, "marker") + field_off)
    read_header_fails(path)


def test_header_length_beyond_capacity_is_corrupt(store):
    path, _, _, _ = written(store)
    patch(path, PREAMBLE_BYTES, struct.pack("<I", 2**32 - 1))
    read_header_fails(path, match="exceeds capacity")


_MISSING = object()

FORGED = [  # a header JSON edited, with a commit marker that matches it: (edit, marker iteration, error, match)
    pytest.param({"format": FORMAT_VERSION + 1}, None, SnapshotMismatchError, "not supported",
                 id="unsupported format version in the header is a mismatch"),
    pytest.param({"payload_nbytes": _MISSING}, None, SnapshotCorruptError, "malformed header", id="missing keys"),
    *(pytest.param(bad, 7, SnapshotCorruptError, None, id=f"wrong value type {bad}")
      for bad in ({"iteration": "seven"}, {"owner_rank": None}, {"extras_tensors": 5}, {"meta": "xy"},
                  {"payload_xxh3": [1]})),
    pytest.param({"owner_rank": float("inf")}, None, SnapshotCorruptError, None, id="an infinite number"),
    pytest.param({}, 8, SnapshotCorruptError, "marker iteration 8",
                 id="marker iteration that disagrees with the header"),
    pytest.param({"payload_nbytes": 10**9}, None, SnapshotCorruptError, "capacities",
                 id="header sizes beyond capacities"),
]


@pytest.mark.parametrize("edit, marker_iteration, error, match", FORGED)
def test_a_consistent_header_that_breaks_the_format_is_refused_by_read_header(store, edit, marker_iteration, error,
                                                                              match):
    path, _, _, _ = written(store)
    d = header_dict(path)
    for key, value in edit.items():
        if value is _MISSING:
            del d[key]
        else:
            d[key] = value
    forge_header(path, d, marker_iteration=marker_iteration)
    read_header_fails(path, error, match)


def test_without_checksums_torn_headers_are_still_caught_but_payload_flips_are_not(tmp_path):
    st = HostStore(tmp_path / "s", job_id=JOB, rank=0, use_checksum=False)
    _, hdr, plan, _ = write(st, 5)
    assert hdr.payload_xxh3 is None and hdr.extras_xxh3 is None
    path = st.path(ROLE_OWN, 0)
    st.close()
    flip(path, offset(path, "payload") + 5)
    with opened(path) as s:
        s.verify(s.read_header())  # documented: bit flips go unnoticed with checksum "none"
    flip(path, PREAMBLE_BYTES + 20)
    read_header_fails(path)


def test_commit_refuses_a_header_larger_than_its_capacity(tmp_path):
    s = SlotFile.create(tmp_path / "small.slot", header_cap=64, payload_cap=0, extras_cap=64)
    with closing(s), pytest.raises(ValueError, match="does not fit"):
        s.commit(SlotHeader(job_id="j" * 200, owner_rank=0, layout="L", iteration=1, role=ROLE_OWN, payload_nbytes=0,
                            payload_xxh3=None, extras_json_nbytes=0, extras_tensors=[], extras_nbytes=0,
                            extras_xxh3=None))


def test_extras_that_do_not_fit_raise_value_error(store):
    named = state(0)
    plan = plan_shards([m for m, _ in named], dp_size=1, distributed_optimizer=False)
    with pytest.raises(ValueError, match="do not fit"):
        write_image(store, ROLE_OWN, planned=plan.unique, sources=[t for _, t in named],
                    payload_bytes=plan.unique_bytes, iteration=1, layout="L", meta={},
                    extras={"big": "x" * 5000}, extras_cap=1024)
