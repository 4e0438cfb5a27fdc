"""Fuzzing the slot reader: whatever bytes lie in a slot file, validation either returns the untouched
image or raises SnapshotCorruptError / SnapshotMismatchError, never anything else, never corrupted data."""

from __future__ import annotations

import itertools
import json
import os
import random
import struct
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from neighbor_ckpt.snapshot.engine import write_image
from neighbor_ckpt.errors import SnapshotCorruptError, SnapshotMismatchError
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
from neighbor_ckpt.recovery.flow import read_tensors
from neighbor_ckpt.snapshot.slot import (FORMAT_VERSION, MAGIC, MARKER, MARKER_MAGIC, PREAMBLE, PREAMBLE_BYTES,
                                         SlotFile, checksum, slot_file_size)
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore

TYPED = (SnapshotCorruptError, SnapshotMismatchError)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
_counter = itertools.count()


@dataclass(frozen=True)
class Image:
    data: bytes
    header: object
    tensors: dict[str, bytes]
    extras: object
    must_detect: frozenset[int]
    """Byte positions whose change must be detected."""
    maybe: frozenset[int]
    """Preamble capacity fields: a change may keep the layout intact (then the image reads back unchanged)."""


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def image(workdir) -> Image:
    store = HostStore(workdir / "store", job_id="fuzz", rank=0)
    g = torch.Generator().manual_seed(0)
    named = [("main", StateKind.MAIN_PARAM, torch.randn(50, generator=g)),
             ("exp_avg", StateKind.OPTIMIZER, torch.randn(3, 5, generator=g).to(torch.bfloat16)),
             ("step", StateKind.OPTIMIZER, torch.tensor(7.0)),
             ("w", StateKind.WEIGHT, torch.randn(10, generator=g))]
    plan = plan_shards([TensorMeta.of(n, k, t) for n, k, t in named], dp_size=2, distributed_optimizer=True)
    srcs = {n: t for n, _, t in named}
    extras = {"rng": torch.Generator().manual_seed(1).get_state(), "step": 7, "lr": 0.1, "t": (1, "x")}
    slot, hdr = write_image(store, ROLE_OWN, planned=plan.unique, sources=[srcs[p.meta.name] for p in plan.unique],
                            payload_bytes=plan.unique_bytes, iteration=7, layout="L", meta={"k": "v"},
                            extras=extras, extras_cap=8192)
    n_hdr = len(json.dumps(hdr.to_json(), separators=(",", ":")).encode())
    must = set(range(0, 12))                                               # magic + format
    must |= set(range(PREAMBLE_BYTES, PREAMBLE_BYTES + 4 + n_hdr))         # header length + JSON
    must |= set(range(slot.payload_off, slot.payload_off + hdr.payload_nbytes))
    must |= set(range(slot.extras_off, slot.extras_off + hdr.extras_nbytes))
    must |= set(range(slot.marker_off, slot.marker_off + MARKER.size))
    maybe = set(range(12, PREAMBLE.size))
    data = slot.path.read_bytes()
    store.close()
    return Image(data, hdr, {p.meta.name: _bits(srcs[p.meta.name]) for p in plan.unique}, extras,
                 frozenset(must), frozenset(maybe))


def _put(workdir, data: bytes):
    """A fresh file (new inode) holding ``data``."""
    path = workdir / f"f{next(_counter)}.slot"
    path.write_bytes(data)
    return path


def _validate(path):
    """SlotFile.open + read_header + verify; on success also the payload and extras as plain values."""
    s = SlotFile.open(path)
    try:
        hdr = s.read_header()
        s.verify(hdr)
        tensors = {k: _bits(v) for k, v in read_tensors(s, hdr).items()}
        extras = s.read_extras(hdr)
        extras = {k: (_bits(v) if isinstance(v, torch.Tensor) else v) for k, v in extras.items()}
        return hdr, tensors, extras
    finally:
        s.close()
        os.unlink(path)


def _expect_intact(image: Image, got) -> None:
    hdr, tensors, extras = got
    assert hdr == image.header
    assert tensors == image.tensors
    want = {k: (_bits(v) if isinstance(v, torch.Tensor) else v) for k, v in image.extras.items()}
    assert extras == want


def test_the_untouched_image_validates(image, workdir):
    _expect_intact(image, _validate(_put(workdir, image.data)))


# -- mutations of a valid image -------------------------------------------------------------------------------


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)),
                      min_size=1, max_size=8),
       focus=st.sampled_from(["anywhere", "covered"]))
def test_byte_flips_in_a_valid_image_are_caught_or_harmless(image, workdir, flips, focus):
    buf = bytearray(image.data)
    covered = sorted(image.must_detect | image.maybe)
    for pos, x in flips:
        pos = covered[pos % len(covered)] if focus == "covered" else pos % len(buf)
        buf[pos] ^= x
    changed = {i for i in range(len(buf)) if buf[i] != image.data[i]} if buf != image.data else set()
    try:
        got = _validate(_put(workdir, bytes(buf)))
    except TYPED:
        assert changed, "the untouched image was rejected"
        assert changed & (image.must_detect | image.maybe), f"a change in padding only was rejected: {changed}"
        return
    assert not changed & image.must_detect, f"corruption at {sorted(changed & image.must_detect)} went unnoticed"
    _expect_intact(image, got)


@FUZZ
@given(length=st.integers(min_value=0, max_value=200_000), fill=st.binary(max_size=64))
@example(length=0, fill=b"")
@example(length=PREAMBLE_BYTES - 1, fill=b"")
@example(length=PREAMBLE_BYTES, fill=b"")
def test_truncated_or_extended_images_are_corrupt(image, workdir, length, fill):
    if length == len(image.data):
        length += 1
    if length <= len(image.data):
        data = image.data[:length]
    else:
        extra = length - len(image.data)
        unit = fill or b"\0"
        data = image.data + (unit * (extra // len(unit) + 1))[:extra]
    assert len(data) == length
    with pytest.raises(SnapshotCorruptError):
        _validate(_put(workdir, data))


@FUZZ
@given(cut=st.integers(min_value=0), flips=st.lists(st.integers(min_value=0), max_size=3))
def test_truncation_plus_flips_is_corrupt_or_mismatched(image, workdir, cut, flips):
    data = bytearray(image.data[:cut % len(image.data)])
    for f in flips:
        if data:
            data[f % len(data)] ^= 0xA5
    with pytest.raises(TYPED):
        _validate(_put(workdir, bytes(data)))


# -- arbitrary bytes -------------------------------------------------------------------------------------------


@FUZZ
@given(data=st.one_of(st.binary(max_size=10_000),
                      st.binary(max_size=2_000).map(lambda b: MAGIC + b),
                      st.binary(max_size=200).map(lambda b: MAGIC + struct.pack("<I", FORMAT_VERSION) + b)))
@example(data=b"")
@example(data=MAGIC)
@example(data=b"\x80\x05" + bytes(200))  # a pickle is not a slot
def test_arbitrary_bytes_are_rejected_with_a_typed_error(workdir, data):
    with pytest.raises(TYPED):
        _validate(_put(workdir, data))


def _random_body(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


@FUZZ
@given(hcap=st.integers(0, 300), pcap=st.integers(0, 300), ecap=st.integers(0, 300), seed=st.integers(0, 2**32),
       fmt=st.sampled_from([FORMAT_VERSION, FORMAT_VERSION, 0, 2, 2**32 - 1]),
       marker_magic=st.booleans())
def test_random_content_behind_a_valid_preamble_is_rejected_with_a_typed_error(workdir, hcap, pcap, ecap, seed, fmt,
                                                                                 marker_magic):
    size = slot_file_size(hcap, pcap, ecap)
    buf = bytearray(_random_body(seed, size))
    buf[:PREAMBLE.size] = PREAMBLE.pack(MAGIC, fmt, hcap, pcap, ecap)
    if marker_magic:
        buf[size - 64:size - 56] = MARKER_MAGIC
    with pytest.raises(TYPED):
        _validate(_put(workdir, bytes(buf)))


HEADER_KEYS = ["format", "job_id", "owner_rank", "layout", "iteration", "role", "payload_nbytes", "payload_xxh3",
               "extras_json_nbytes", "extras_tensors", "extras_nbytes", "extras_xxh3", "meta"]
# JSON values without non-finite floats (those are covered in test_store.py)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
small_ints = st.integers(-5, 400)


@st.composite
def forged_slots(draw):
    """(header bytes, marker iteration, payload cap, extras cap): a header committed consistently (its marker
    checksum matches), so only its content is odd."""
    iteration = draw(st.integers(-5, 400))
    pcap, ecap = draw(st.integers(0, 300)), draw(st.integers(0, 300))
    kind = draw(st.sampled_from(["raw", "any_json", "plausible", "plausible"]))
    if kind == "raw":
        return draw(st.binary(max_size=300)), iteration, pcap, ecap
    if kind == "any_json":
        return json.dumps(draw(json_values)).encode(), iteration, pcap, ecap
    en = draw(st.integers(0, ecap))
    d = {"format": FORMAT_VERSION, "job_id": draw(st.text(max_size=5)), "owner_rank": draw(small_ints),
         "layout": draw(st.text(max_size=5)), "iteration": iteration, "role": "own",
         "payload_nbytes": draw(st.integers(0, pcap)), "payload_xxh3": draw(st.none() | st.integers(0, 2**64 - 1)),
         "extras_json_nbytes": draw(st.integers(0, en)), "extras_tensors": [], "extras_nbytes": en,
         "extras_xxh3": draw(st.none() | st.integers(0, 2**64 - 1)), "meta": {}}
    for k in draw(st.sets(st.sampled_from(HEADER_KEYS), max_size=3)):
        if draw(st.booleans()):
            del d[k]
        else:
            d[k] = draw(st.one_of(small_ints, json_values, st.sampled_from([FORMAT_VERSION, "1", None, 2**64])))
    return json.dumps(d).encode(), iteration, pcap, ecap


@FUZZ
@given(forged=forged_slots(), seed=st.integers(0, 2**32), extra_cap=st.integers(0, 64))
def test_consistently_committed_odd_headers_give_a_header_or_a_typed_error(workdir, forged, seed, extra_cap):
    raw, marker_iteration, pcap, ecap = forged
    hcap = 4 + len(raw) + extra_cap
    size = slot_file_size(hcap, pcap, ecap)
    buf = bytearray(_random_body(seed, size))
    buf[:PREAMBLE.size] = PREAMBLE.pack(MAGIC, FORMAT_VERSION, hcap, pcap, ecap)
    buf[PREAMBLE_BYTES:PREAMBLE_BYTES + 4 + len(raw)] = struct.pack("<I", len(raw)) + raw
    buf[size - 64:size - 64 + MARKER.size] = MARKER.pack(MARKER_MAGIC, marker_iteration, checksum(raw))
    path = _put(workdir, bytes(buf))
    s = SlotFile.open(path)
    try:
        try:
            hdr = s.read_header()
        except TYPED:
            return
        # a returned header is consistent with its marker and the slot's capacities
        assert hdr.iteration == marker_iteration
        assert hdr.payload_nbytes <= pcap and hdr.extras_nbytes <= ecap
        assert hdr.extras_json_nbytes <= hdr.extras_nbytes
        try:
            s.verify(hdr)
        except TYPED:
            pass
    finally:
        s.close()
        os.unlink(path)
