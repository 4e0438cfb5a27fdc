"""What ``test_slot.py`` and ``test_store.py`` share: a rank's state with awkward dtypes and values, one image of it
written through ``engine.write_image``, and ways to open and damage a slot file on disk (not a test module: nothing
here is collected)."""

from __future__ import annotations

import json
import random
import struct
from contextlib import closing
from pathlib import Path

import numpy as np
import torch

from neighbor_ckpt.snapshot.engine import write_image
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
from neighbor_ckpt.snapshot.slot import MARKER, PREAMBLE_BYTES, SlotFile, checksum
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore

JOB = "job-unit"


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


def empty_state() -> list[tuple[TensorMeta, torch.Tensor]]:
    """A state holding a zero-element tensor with a non-flat shape."""
    named = [(TensorMeta.of("optim/exp_avg", StateKind.OPTIMIZER, t), t) for t in [torch.arange(6.0)]]
    e = torch.empty(0, 3)
    named.append((TensorMeta.of("optim/empty", StateKind.OPTIMIZER, e), e))
    return named


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert bits(a) == bits(b)


def new_store(root: Path) -> HostStore:
    return HostStore(root / "store", job_id=JOB, rank=3, versions=2)


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


def written(store: HostStore, iteration: int = 7):
    """Write one image and close the store's mappings (so the file can be mangled safely)."""
    slot, hdr, plan, sources = write(store, iteration)
    path = slot.path
    store.close()
    return path, hdr, plan, sources


def opened(path: Path) -> closing[SlotFile]:
    """``with opened(path) as s:`` a fresh mapping of the slot file, closed at the end of the block."""
    return closing(SlotFile.open(path))


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
    with opened(path) as s:
        marker_off = s.marker_off
    patch(path, PREAMBLE_BYTES, struct.pack("<I", len(raw)) + raw)
    it = d.get("iteration", 0) if marker_iteration is None else marker_iteration
    patch(path, marker_off, MARKER.pack(b"NCKPTCMT", it, checksum(raw)))


def header_dict(path) -> dict:
    with open(path, "rb") as f:
        f.seek(PREAMBLE_BYTES)
        (n,) = struct.unpack("<I", f.read(4))
        return json.loads(f.read(n))
