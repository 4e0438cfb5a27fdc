"""Pickle-free encoding of small nested state (RNG states, loop counters, scheduler state).

``encode(obj)`` returns a JSON string plus a list of tensors; ``decode`` inverts it exactly.
Supported leaves: ``None``, ``bool``, ``int``, ``float`` (bit-exact via ``float.hex``), ``str``,
``bytes``, :class:`torch.Tensor` and :class:`numpy.ndarray`; containers: ``dict`` (any keys of the
leaf types), ``list`` and ``tuple``. Anything else raises :class:`TypeError`, so state that cannot be
carried faithfully is noticed when the first snapshot is taken, not at recovery time.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import torch

from neighbor_ckpt.errors import SnapshotCorruptError

__all__ = ["encode", "decode", "tensors_to_bytes", "bytes_to_tensors", "DTYPES", "dtype_named"]

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in (
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16", "int8",
        "uint64", "uint32", "uint16", "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
        "float8_e5m2fnuz")
    if isinstance(getattr(torch, name, None), torch.dtype)}
"""The dtypes a snapshot may name (``str(dtype)`` without ``torch.``), by name: what a snapshot, a header or a peer's
message says is looked up here, never as an attribute of ``torch`` (which would hand back any function or module a
corrupted or foreign name happens to spell)."""

_NUMPY_KINDS = "biufc"
"""numpy scalar kinds a snapshot may carry: bool, signed and unsigned integers, floats, complex (no objects)."""


def dtype_named(name: object) -> torch.dtype:
    """The torch dtype ``name`` (as :data:`DTYPES` spells it); :class:`~neighbor_ckpt.errors.SnapshotCorruptError`
    for any other name."""
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise SnapshotCorruptError(f"a snapshot names the dtype {name!r}, which is none of the tensor dtypes a "
                                   "snapshot holds: the data is corrupted or not a snapshot of this library")
    return dtype


def _numpy_dtype(name: object) -> np.dtype:
    try:
        dtype = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in _NUMPY_KINDS:
        raise SnapshotCorruptError(f"a snapshot names the numpy scalar type {name!r}, which is no numeric type: the "
                                   "data is corrupted or not a snapshot of this library")
    return dtype

_T = "__t"  # type tag key


def _enc(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return {_T: "f", "v": obj.hex()}
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {_T: "tensor", "i": len(tensors) - 1}
    if isinstance(obj, np.ndarray):
        tensors.append(torch.from_numpy(np.ascontiguousarray(obj)))
        return {_T: "ndarray", "i": len(tensors) - 1}
    if isinstance(obj, np.generic):
        return {_T: "npscalar", "dtype": obj.dtype.str, "v": _enc(obj.item(), tensors)}
    if isinstance(obj, bytes):
        return {_T: "bytes", "v": base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, tuple):
        return {_T: "tuple", "v": [_enc(x, tensors) for x in obj]}
    if isinstance(obj, list):
        return [_enc(x, tensors) for x in obj]
    if isinstance(obj, dict):
        return {_T: "dict", "v": [[_enc(k, tensors), _enc(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, torch.dtype):
        return {_T: "dtype", "v": str(obj).removeprefix("torch.")}
    raise TypeError(
        f"neighbor_ckpt cannot carry a value of type {type(obj).__qualname__} in a snapshot "
        "(supported: None, bool, int, float, str, bytes, list, tuple, dict, torch.Tensor, numpy arrays)"
    )


def _dec(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_dec(x, tensors) for x in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj[_T]
    if tag == "f":
        return float.fromhex(obj["v"])
    if tag == "tensor":
        return tensors[obj["i"]]
    if tag == "ndarray":
        return tensors[obj["i"]].numpy()
    if tag == "npscalar":
        return _numpy_dtype(obj["dtype"]).type(_dec(obj["v"], tensors))
    if tag == "bytes":
        return base64.b64decode(obj["v"])
    if tag == "tuple":
        return tuple(_dec(x, tensors) for x in obj["v"])
    if tag == "dict":
        return {_dec(k, tensors): _dec(v, tensors) for k, v in obj["v"]}
    if tag == "dtype":
        return dtype_named(obj["v"])
    raise ValueError(f"unknown codec tag {tag!r}")


def encode(obj: Any) -> tuple[str, list[torch.Tensor]]:
    """Encode ``obj`` as (JSON text, tensors). Tensors are returned detached, on their device."""
    tensors: list[torch.Tensor] = []
    text = json.dumps(_enc(obj, tensors), separators=(",", ":"), allow_nan=False)
    return text, tensors


def decode(text: str, tensors: list[torch.Tensor]) -> Any:
    """Invert :func:`encode`."""
    return _dec(json.loads(text), tensors)


def tensors_to_bytes(tensors: list[torch.Tensor]) -> tuple[list[dict[str, Any]], bytes]:
    """Serialize tensors to (metadata list, concatenated raw bytes). CPU copies are made as needed."""
    metas: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    offset = 0
    for t in tensors:
        c = t.detach().to("cpu").contiguous()
        raw = c.view(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
        metas.append({"dtype": str(c.dtype).removeprefix("torch."), "shape": list(c.shape),
                      "offset": offset, "nbytes": len(raw)})
        chunks.append(raw)
        offset += len(raw)
    return metas, b"".join(chunks)


def bytes_to_tensors(metas: list[dict[str, Any]], blob: bytes | memoryview) -> list[torch.Tensor]:
    """Invert :func:`tensors_to_bytes`; returns fresh CPU tensors (copies, not views of ``blob``)."""
    out: list[torch.Tensor] = []
    for m in metas:
        dtype = dtype_named(m["dtype"])
        raw = bytes(blob[m["offset"]: m["offset"] + m["nbytes"]])
        if m["nbytes"] == 0:
            out.append(torch.empty(m["shape"], dtype=dtype))
            continue
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(m["shape"])
        out.append(t)
    return out
