"""Pickle-free codec of small nested state: exact round trips, and loud failure on anything else."""

from __future__ import annotations

import json
import math
import random
import struct
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neighbor_ckpt.snapshot import codec as _codec


def roundtrip(obj):
    """encode -> tensors to raw bytes -> back (what a slot's extras region does) -> decode."""
    text, tensors = _codec.encode(obj)
    json.loads(text)  # plain JSON
    metas, blob = _codec.tensors_to_bytes(tensors)
    return _codec.decode(text, _codec.bytes_to_tensors(metas, bytes(blob)))


def same(a, b) -> bool:
    """Exact equality: types, float bits, tensor/array dtype+shape+bytes, container kinds."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a.hex() == b.hex() if not math.isnan(a) else math.isnan(b)
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and _raw(a) == _raw(b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return (len(a) == len(b) and all(same(k1, k2) and same(a[k1], b[k2])
                                          for (k1, k2) in zip(a, b)))
    return a == b


def _raw(t: torch.Tensor) -> bytes:
    c = t.detach().contiguous()
    return c.view(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""


# -- RNG states ------------------------------------------------------------------------------------------------


def test_python_random_state_round_trips_and_continues_the_stream():
    r = random.Random(42)
    for _ in range(17):
        r.random()
    state = r.getstate()
    back = roundtrip(state)
    assert back == state and type(back) is tuple and type(back[1]) is tuple
    r2 = random.Random()
    r2.setstate(back)
    assert [r2.random() for _ in range(5)] == [r.random() for _ in range(5)]


def test_python_random_state_with_a_cached_gauss_round_trips():
    r = random.Random(3)
    r.gauss(0, 1)  # leaves gauss_next set
    state = r.getstate()
    assert state[2] is not None
    back = roundtrip(state)
    assert same(back, state)
    r2 = random.Random()
    r2.setstate(back)
    assert r2.gauss(0, 1) == r.gauss(0, 1)


def test_numpy_random_state_round_trips_and_continues_the_stream():
    rs = np.random.RandomState(7)
    rs.standard_normal(3)  # sets has_gauss/cached_gaussian
    state = rs.get_state()
    back = roundtrip(state)
    assert same(back, state)
    assert back[1].dtype == np.uint32
    rs2 = np.random.RandomState()
    rs2.set_state(back)
    assert np.array_equal(rs2.standard_normal(4), rs.standard_normal(4))


def test_numpy_generator_bit_generator_state_round_trips():
    g = np.random.default_rng(5)
    g.random(3)
    state = g.bit_generator.state
    back = roundtrip(state)
    assert back == state
    g2 = np.random.default_rng()
    g2.bit_generator.state = back
    assert np.array_equal(g2.random(4), g.random(4))


def test_torch_rng_states_round_trip_and_continue_the_stream():
    torch.manual_seed(11)
    torch.rand(3)
    state = {"cpu": torch.get_rng_state(), "gen": torch.Generator().manual_seed(9).get_state()}
    back = roundtrip(state)
    assert same(back, state)
    assert back["cpu"].dtype == torch.uint8
    expected = torch.rand(5)
    torch.set_rng_state(back["cpu"])
    assert torch.equal(torch.rand(5), expected)


# -- floats ----------------------------------------------------------------------------------------------------


SPECIAL_FLOATS = [0.0, -0.0, 1.0, -1.5, float("inf"), float("-inf"), 5e-324, -5e-324, 2.2250738585072014e-308,
                  2.225073858507201e-308, sys.float_info.max, sys.float_info.min, 0.1, 1 / 3, 1e300, 123456789.125]


@pytest.mark.parametrize("x", SPECIAL_FLOATS, ids=lambda x: x.hex())
def test_special_floats_round_trip_bit_exactly(x):
    back = roundtrip(x)
    assert type(back) is float and back.hex() == x.hex()
    assert struct.pack("<d", back) == struct.pack("<d", x)


def test_nan_round_trips_as_nan():
    back = roundtrip({"nan": float("nan"), "list": [float("nan")]})
    assert math.isnan(back["nan"]) and math.isnan(back["list"][0])


def test_encoded_text_contains_no_non_standard_json_tokens():
    text, _ = _codec.encode([float("nan"), float("inf"), -0.0])
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


@settings(max_examples=200, deadline=None, database=None)
@given(st.floats(allow_nan=False) | st.floats(allow_subnormal=True, width=64))
def test_any_float_round_trips_bit_exactly(x):
    assert roundtrip(x).hex() == x.hex()


# -- containers, keys and leaves -----------------------------------------------------------------------------------


def test_int_dict_keys_stay_ints_and_mixed_keys_are_kept():
    obj = {0: "a", 1: "b", -5: "c", 2**70: "big", "0": "string zero", 1.5: "float", (1, 2): "tuple",
           None: "none", b"k": "bytes"}
    back = roundtrip(obj)
    assert same(back, obj)
    assert list(back) == list(obj)  # order kept


def test_tuples_and_lists_are_not_confused():
    obj = [(1, 2), [1, 2], ((),), [[]], ([1], (2,)), ()]
    back = roundtrip(obj)
    assert same(back, obj)
    assert type(back[0]) is tuple and type(back[1]) is list and type(back[5]) is tuple


def test_bools_stay_bools_and_ints_stay_ints():
    back = roundtrip([True, False, 1, 0, None])
    assert [type(x) for x in back] == [bool, bool, int, int, type(None)]


def test_bytes_and_strings_round_trip():
    obj = {"bytes": bytes(range(256)), "empty": b"", "text": "héllo ☃ \x00 \ud7ff", "empty_str": ""}
    assert same(roundtrip(obj), obj)


def test_big_and_negative_ints_round_trip():
    obj = [2**64, -2**63, 10**40, -(10**40)]
    assert roundtrip(obj) == obj


def test_a_user_dict_that_looks_like_a_codec_tag_is_not_misread():
    obj = {"__t": "tensor", "i": 0, "v": [1]}
    back = roundtrip(obj)
    assert back == obj


def test_deeply_nested_state_round_trips():
    obj = {"sched": {"last_epoch": 3, "base_lrs": [0.1, 0.01], "_step_count": 4, "verbose": False},
           "loop": {"epoch": 2, "batch": (5, 7), "progress": {0: {"done": True}}},
           "dtype": torch.bfloat16}
    assert same(roundtrip(obj), obj)


# -- tensors and arrays -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                                   torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
                                   torch.uint32])
def test_tensors_of_every_dtype_round_trip_bit_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 4, generator=g) * 100).to(dtype) if dtype not in (torch.bool, torch.complex64) else (
        torch.rand(3, 4, generator=g) > 0.5 if dtype is torch.bool else torch.randn(3, 4, dtype=dtype, generator=g))
    back = roundtrip({"t": t})["t"]
    assert same(back, t)


def test_special_tensors_round_trip():
    obj = [torch.tensor(3.5), torch.empty(0, 4), torch.arange(12.0).reshape(3, 4).t(),  # 0-d, empty, non-contiguous
           torch.tensor([float("nan"), -0.0, float("inf"), 5e-45]), torch.ones(2, requires_grad=True)]
    back = roundtrip(obj)
    for a, b in zip(obj, back):
        assert same(b, a.detach())
    assert not back[4].requires_grad


@pytest.mark.parametrize("arr", [np.arange(10, dtype=np.int64), np.zeros((2, 3), dtype=np.float32),
                                 np.array(7, dtype=np.int16), np.array([], dtype=np.float64),
                                 np.arange(12, dtype=np.uint32).reshape(3, 4)[:, ::2],
                                 np.array([True, False]), np.array([1 + 2j], dtype=np.complex128)],
                         ids=["int64", "f32-2d", "0d", "empty", "non-contiguous", "bool", "complex"])
def test_numpy_arrays_round_trip_with_dtype_and_shape(arr):
    back = roundtrip(arr)
    assert isinstance(back, np.ndarray)
    assert same(back, np.ascontiguousarray(arr))


@pytest.mark.parametrize("x", [np.int64(-3), np.float32(1.25), np.bool_(True), np.uint8(200), np.int32(7),
                               np.float16(0.5)], ids=lambda x: type(x).__name__)
def test_numpy_scalars_keep_their_type(x):
    back = roundtrip(x)
    assert type(back) is type(x) and back == x


def test_float64_numpy_scalar_keeps_its_value():
    # np.float64 subclasses float: it comes back as an equal float
    back = roundtrip(np.float64(0.1))
    assert back == 0.1 and isinstance(back, float)


def test_encode_returns_detached_tensors_and_decode_returns_the_given_ones():
    t = torch.ones(3, requires_grad=True)
    text, tensors = _codec.encode({"t": t})
    assert len(tensors) == 1 and not tensors[0].requires_grad
    out = _codec.decode(text, tensors)
    assert out["t"] is tensors[0]


def test_bytes_to_tensors_returns_copies_not_views_of_the_blob():
    metas, blob = _codec.tensors_to_bytes([torch.arange(4, dtype=torch.int32)])
    buf = bytearray(blob)
    (t,) = _codec.bytes_to_tensors(metas, memoryview(buf))
    buf[:] = bytes(len(buf))
    assert t.tolist() == [0, 1, 2, 3]


# -- unsupported values ------------------------------------------------------------------------------------------------


class Custom:
    pass


@pytest.mark.parametrize("obj", [{1, 2}, frozenset({1}), 1 + 2j, Custom(), object(), lambda: 0, range(3),
                                 {"nested": [1, {2: {3}}]}, bytearray(b"x"), np.array([1], dtype=object),
                                 np.array(["a"]), np.datetime64("2020-01-01")],
                         ids=["set", "frozenset", "complex", "custom", "object", "lambda", "range", "nested-set",
                              "bytearray", "np-object", "np-str", "np-datetime"])
def test_unsupported_values_raise_type_error(obj):
    with pytest.raises(TypeError):
        _codec.encode(obj)


def test_type_error_names_the_offending_type():
    with pytest.raises(TypeError, match="Custom"):
        _codec.encode({"a": [Custom()]})


def test_unknown_tag_is_rejected_at_decode():
    with pytest.raises(ValueError, match="unknown codec tag"):
        _codec.decode('{"__t":"pickle","v":"x"}', [])


def test_every_dtype_a_snapshot_can_hold_round_trips_by_name():
    for name, dtype in _codec.DTYPES.items():
        assert _codec.dtype_named(name) is dtype
        if dtype.is_floating_point and dtype.itemsize < 2:
            continue  # float8: no arithmetic to fill it with
        t = torch.arange(4).to(dtype)
        (back,) = _codec.bytes_to_tensors(*_codec.tensors_to_bytes([t]))  # (metas, blob)
        assert back.dtype is dtype and torch.equal(back, t)


@pytest.mark.parametrize("name", ["load", "save", "nn", "Tensor", "dtype", "float", "_C", "", None, 3])
def test_a_dtype_name_read_back_is_looked_up_in_the_allow_list_only(name):
    """On 2c061fd a name read from a snapshot went to ``getattr(torch, name)``: ``torch.load`` for ``"load"``."""
    from neighbor_ckpt.errors import SnapshotCorruptError

    with pytest.raises(SnapshotCorruptError, match="dtype"):
        _codec.dtype_named(name)
    with pytest.raises(SnapshotCorruptError):
        _codec.decode(json.dumps({"__t": "dtype", "v": name}), [])
    metas, blob = _codec.tensors_to_bytes([torch.zeros(2)])
    metas[0]["dtype"] = name
    with pytest.raises(SnapshotCorruptError):
        _codec.bytes_to_tensors(metas, blob)


def test_a_numpy_scalar_of_no_numeric_type_is_refused():
    from neighbor_ckpt.errors import SnapshotCorruptError

    text, tensors = _codec.encode({"x": np.float32(1.5)})
    assert _codec.decode(text, tensors)["x"] == np.float32(1.5)
    for bad in ("O", "V8", "U3", "M8[s]"):
        with pytest.raises(SnapshotCorruptError):
            _codec.decode(text.replace('"<f4"', json.dumps(bad)), tensors)
