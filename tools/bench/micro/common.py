"""What every section of the micro-benchmark shares: the synthetic state, the timing summary, a result row."""

from __future__ import annotations

import mmap
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from neighbor_ckpt.snapshot.razor import ShardPlan, StateKind, TensorMeta, plan_shards

MiB = 2**20
GB = 1e9
STAGE_ITERS_FACTOR = 3
"""A staging iteration is ~10x cheaper than a streaming one: section 1 runs this many times ``--iters``."""

STAT = "median"
"""``--stat``: how :func:`stat_summary` sums up timings (``median`` or ``min``); the CLI sets it once per run."""


def stat_summary(xs: Sequence[float]) -> float:
    """The summary statistic of a list of timings: the median (default) or, with ``--stat min``, the best."""
    if not xs:
        return float("nan")
    return min(xs) if STAT == "min" else statistics.median(xs)


def make_metas(mib: float, ntensors: int) -> list[TensorMeta]:
    """``mib`` MiB of fp32 state in ``ntensors`` 1-D tensors: weights 3:3:...:1 (Adam-shard-like)."""
    total = int(mib * MiB) // 4
    weights = [3] * (ntensors - 1) + [1] if ntensors > 1 else [1]
    counts = [total * w // sum(weights) for w in weights]
    counts[0] += total - sum(counts)
    names = ["main/shard", "opt/exp_avg", "opt/exp_avg_sq"] + [f"opt/aux{i}" for i in range(max(0, ntensors - 3))]
    kinds = [StateKind.MAIN_PARAM] + [StateKind.OPTIMIZER] * (ntensors - 1)
    return [TensorMeta(names[i], kinds[i], torch.float32, (counts[i],)) for i in range(ntensors)]


def make_plan(metas: list[TensorMeta], dp: int) -> ShardPlan:
    plan = plan_shards(metas, dp_size=dp, distributed_optimizer=True)
    assert len(plan.unique) == len(metas), "benchmark state must be all unique"  # noqa: S101
    return plan


def make_sources(plan: ShardPlan, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.meta.shape, generator=g, dtype=p.meta.dtype) for p in plan.unique]


def small_extras(i: int) -> dict[str, Any]:
    return {"step": i, "consumed": i * 1024, "rng": torch.get_rng_state()}


class ShmBuffer:
    """A pre-faulted file mapping in the store root (same memory kind as a slot)."""

    def __init__(self, root: Path, nbytes: int, tag: str = "") -> None:
        self.path = root / f"memcpy-baseline-{os.getpid()}{tag}.bin"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes)
        self.tensor.fill_(1)

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self.mm.close()
        except BufferError:
            pass
        self.path.unlink(missing_ok=True)


def views_like(buf: torch.Tensor, plan: ShardPlan) -> list[torch.Tensor]:
    return [buf[p.offset:p.offset + p.meta.nbytes].view(p.meta.dtype).view(p.meta.shape) for p in plan.unique]


@dataclass
class Row:
    section: str
    metric: str
    value: float
    unit: str
    baseline: float | None
    baseline_desc: str
    ratio: float | None
    target: float | None = None
    op: str = ">="
    status: str = "INFO"
    detail: dict[str, Any] = field(default_factory=dict)

    def judge(self) -> Row:
        if self.target is None or self.ratio is None or self.ratio != self.ratio:
            self.status = "INFO" if self.target is None else "ERROR"
        elif self.op == ">=":
            self.status = "PASS" if self.ratio >= self.target else "MISS"
        else:
            self.status = "PASS" if self.ratio <= self.target else "MISS"
        return self

