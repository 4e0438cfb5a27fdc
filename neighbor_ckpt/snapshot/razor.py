"""The checkpoint razor: split a rank's state into unique, regenerable and lazily backed-up parts.

A pure function from tensor metadata + the data-parallel layout to a frozen :class:`ShardPlan`. The rules
(FFTrainer §4.2) are in one place, :func:`disposition`; the planner applies the same function to byte counts:

* with DP = 1 nothing is redundant: every tensor is snapshotted (weights become regenerable only when
  a distributed optimizer holds their master copy);
* model weights are redundant when DP > 1: *regenerable* under a distributed optimizer (rebuilt from the
  fp32 main-param shards), otherwise *lazy* (written once, at failure time, by one live rank per DP group);
* optimizer state and main params are unique when sharded by a distributed optimizer (the shard of this
  DP rank: 12 bytes/param/DP for Adam), redundant (*lazy*) under plain DDP;
* module buffers: a *constant* one (recomputed when the model is built: RoPE ``inv_freq``, a non-persistent
  buffer) is *regenerable* (never saved); one that *changes* during training (BatchNorm running statistics,
  megatron-core's MoE router ``expert_bias``) is *staged*: every rank copies its own every iteration, on the
  training thread (the next forward may update it, so no background thread may read it), into the unique payload.
  Whether such a buffer is identical across DP (DDP broadcasts rank 0's before each forward, then each rank
  updates its own) or per rank, each rank's own copy is what it restores: it costs a few KB and is right in both
  cases. How adapters tell the two apart: :func:`neighbor_ckpt.adapters.base.classify_buffers`.

Small per-rank state (RNG states, counters, scheduler, data position) is not planned here; it is always
unique and travels in every snapshot's extras region.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["StateKind", "Disposition", "TensorMeta", "PlannedTensor", "ShardPlan", "disposition", "plan_shards",
           "ALIGN"]

ALIGN = 64
"""Byte alignment of every tensor inside a slot payload."""


class StateKind(str, enum.Enum):
    """What a tensor is, as reported by an adapter."""

    WEIGHT = "weight"
    """A model parameter or buffer as the forward pass uses it."""
    MAIN_PARAM = "main_param"
    """An optimizer-owned master copy of parameters (fp32 main params, or the params a ZeRO rank owns)."""
    OPTIMIZER = "optimizer"
    """Optimizer state (Adam exp_avg / exp_avg_sq / step, momentum buffers)."""
    BUFFER = "buffer"
    """A module buffer that changes during training (BatchNorm running statistics, a MoE router's expert bias)."""
    CONSTANT_BUFFER = "constant_buffer"
    """A module buffer that never changes after the model is built (RoPE ``inv_freq``, a non-persistent buffer)."""


class Disposition(str, enum.Enum):
    """What the razor does with a tensor."""

    UNIQUE = "unique"
    """Snapshotted every iteration into the local slot and streamed to the ring successor."""
    REGENERABLE = "regenerable"
    """Never saved: rebuilt from unique state at restore time."""
    LAZY = "lazy"
    """Redundant across DP ranks: written only at failure time by one live holder per DP group."""
    STAGED = "staged"
    """Unique, and mutated by the next forward: copied on the training thread at every snapshot (it is small) into
    host memory the engine owns, then into the unique payload with the other unique tensors."""


@dataclass(frozen=True)
class TensorMeta:
    """Name, kind, dtype and shape of one tensor of a rank's state."""

    name: str
    kind: StateKind
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, name: str, kind: StateKind, t: torch.Tensor) -> TensorMeta:
        return cls(name, kind, t.dtype, tuple(t.shape))

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "kind": self.kind.value, "dtype": str(self.dtype).removeprefix("torch."),
                "shape": list(self.shape)}


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor placed at ``offset`` bytes into its region (unique payload or lazy payload)."""

    meta: TensorMeta
    disposition: Disposition
    offset: int


@dataclass(frozen=True)
class ShardPlan:
    """The razor's decision for one rank. Build with :func:`plan_shards`."""

    dp_size: int
    distributed_optimizer: bool
    unique: tuple[PlannedTensor, ...]
    """Everything the snapshot payload holds, in payload order: the unique tensors, then the staged ones."""
    regenerable: tuple[TensorMeta, ...]
    lazy: tuple[PlannedTensor, ...]
    unique_bytes: int
    """Bytes of the unique payload (with alignment padding)."""
    lazy_bytes: int
    """Bytes of the lazy-backup payload (with alignment padding)."""
    signature: str
    """Hash of the plan's layout; a snapshot is only loaded into a rank whose plan has the same one."""

    def disposition_of(self, name: str) -> Disposition:
        for p in self.unique + self.lazy:
            if p.meta.name == name:
                return p.disposition
        for m in self.regenerable:
            if m.name == name:
                return Disposition.REGENERABLE
        raise KeyError(name)

    @property
    def has_lazy(self) -> bool:
        return bool(self.lazy)

    @property
    def staged(self) -> tuple[PlannedTensor, ...]:
        """The payload entries copied on the training thread (changing module buffers)."""
        return tuple(p for p in self.unique if p.disposition is Disposition.STAGED)


def disposition(kind: StateKind, *, dp_size: int, distributed_optimizer: bool) -> Disposition:
    """What the razor does with state of ``kind`` on a rank whose DP group (the ring) has ``dp_size`` members.

    * weights: regenerable under a distributed optimizer (rebuilt from its fp32 main params), otherwise unique at
      DP = 1 and lazy when DP > 1 (every DP rank holds the same copy);
    * main params and optimizer state: unique at DP = 1 or when a distributed optimizer shards them, lazy otherwise;
    * module buffers: constant ones regenerable (the model's constructor rebuilds them), changing ones staged
      (each rank's own copy, every iteration, taken on the training thread), whatever the DP size or optimizer.
    """
    if kind is StateKind.CONSTANT_BUFFER:
        return Disposition.REGENERABLE
    if kind is StateKind.BUFFER:
        return Disposition.STAGED
    if kind is StateKind.WEIGHT:
        if distributed_optimizer:
            return Disposition.REGENERABLE
        return Disposition.UNIQUE if dp_size == 1 else Disposition.LAZY
    # MAIN_PARAM and OPTIMIZER
    if dp_size == 1 or distributed_optimizer:
        return Disposition.UNIQUE
    return Disposition.LAZY


def _layout(metas: Sequence[TensorMeta], disposition: Disposition) -> tuple[tuple[PlannedTensor, ...], int]:
    placed: list[PlannedTensor] = []
    offset = 0
    for m in metas:
        placed.append(PlannedTensor(m, disposition, offset))
        offset += -(-m.nbytes // ALIGN) * ALIGN
    return tuple(placed), offset


def plan_shards(tensors: Sequence[TensorMeta], *, dp_size: int, distributed_optimizer: bool) -> ShardPlan:
    """Apply the razor rules to one rank's tensors. Pure; the order of ``tensors`` is kept."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names in state: {dup[:5]}")
    buckets: dict[Disposition, list[TensorMeta]] = {d: [] for d in Disposition}
    for t in tensors:
        buckets[disposition(t.kind, dp_size=dp_size, distributed_optimizer=distributed_optimizer)].append(t)
    unique, unique_bytes = _layout(buckets[Disposition.UNIQUE], Disposition.UNIQUE)
    staged, staged_bytes = _layout(buckets[Disposition.STAGED], Disposition.STAGED)
    unique += tuple(PlannedTensor(p.meta, p.disposition, p.offset + unique_bytes) for p in staged)
    unique_bytes += staged_bytes
    lazy, lazy_bytes = _layout(buckets[Disposition.LAZY], Disposition.LAZY)
    sig_src = json.dumps(
        {
            "dp_size": dp_size,
            "distributed_optimizer": distributed_optimizer,
            "tensors": [dict(t.to_json(), disposition=disposition(t.kind, dp_size=dp_size,
                                                                  distributed_optimizer=distributed_optimizer).value)
                        for t in tensors],
        },
        sort_keys=True,
    )
    return ShardPlan(
        dp_size=dp_size,
        distributed_optimizer=distributed_optimizer,
        unique=unique,
        regenerable=tuple(buckets[Disposition.REGENERABLE]),
        lazy=lazy,
        unique_bytes=unique_bytes,
        lazy_bytes=lazy_bytes,
        signature=hashlib.sha256(sig_src.encode()).hexdigest()[:32],
    )
