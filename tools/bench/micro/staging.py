"""Section 1: staging vs memcpy. The engine's copy into its slot and its local commit, against the fastest of four
plain copies of the same tensors into pre-allocated, pre-faulted memory."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tools.bench.micro.common import (GB, STAGE_ITERS_FACTOR, Row, ShmBuffer, stat_summary, views_like,
                                                  make_metas, make_plan, make_sources, small_extras)
from neighbor_ckpt.snapshot.engine import SnapshotEngine
from neighbor_ckpt.snapshot.slot import checksum
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore


def bench_staging(args: argparse.Namespace, root: Path) -> tuple[list[Row], dict[str, Any]]:
    metas = make_metas(args.mib, args.tensors)
    plan = make_plan(metas, dp=1)
    nbytes = sum(p.meta.nbytes for p in plan.unique)
    sources = make_sources(plan, seed=0)
    store = HostStore(root, job_id=f"bench-stage-{os.getpid()}", rank=0, versions=2, use_checksum=True)
    # wait_for_replica=True: with no transport "done" follows the commit at once, and the stats are written
    # before "done" (with False, wait() returns on "committed", before the stats are updated).
    engine = SnapshotEngine(store=store, plan=plan, sources=sources, layout="bench", meta={"bench": "micro"},
                            transport=None, wait_for_replica=True)

    # Every candidate gets its own destination, so no copy lands on lines the previous one left in cache.
    anons = [torch.empty(plan.unique_bytes, dtype=torch.uint8) for _ in range(2)]
    for a in anons:
        a.fill_(1)
    shms = [ShmBuffer(store.dir, plan.unique_bytes, tag=str(i)) for i in range(2)]
    anon_views = views_like(anons[0], plan)
    shm_views = views_like(shms[0].tensor, plan)
    src_np = [s.numpy() for s in sources]
    anon_np = [v.numpy() for v in views_like(anons[1], plan)]
    shm_np = [v.numpy() for v in views_like(shms[1].tensor, plan)]

    def torch_copy(dsts: list[torch.Tensor]) -> Callable[[], None]:
        def f() -> None:
            for d, s in zip(dsts, sources):
                d.copy_(s)
        return f

    def numpy_copy(dsts: list[np.ndarray]) -> Callable[[], None]:
        def f() -> None:
            for d, s in zip(dsts, src_np):
                np.copyto(d, s)
        return f

    baselines: dict[str, Callable[[], None]] = {
        "torch.copy_ -> anon": torch_copy(anon_views),
        "numpy.copyto -> anon": numpy_copy(anon_np),
        "torch.copy_ -> /dev/shm map": torch_copy(shm_views),
        "numpy.copyto -> /dev/shm map": numpy_copy(shm_np),
    }
    names = list(baselines)
    samples: dict[str, list[float]] = {k: [] for k in names}
    samples.update({"engine.stage": [], "engine.commit": [], "engine.wall": [], "xxh3": []})

    try:
        # Warm-up: both own slots created and first-touched, every baseline run twice.
        step = 0
        for _ in range(max(2, args.warmup) + 2):
            engine.snapshot(step, small_extras(step))
            engine.wait()
            step += 1
        for f in baselines.values():
            f()
            f()
        for it in range(args.iters * STAGE_ITERS_FACTOR):
            t0 = time.perf_counter()
            engine.snapshot(step, small_extras(step))
            engine.wait()
            wall = time.perf_counter() - t0
            if engine.stats.failures:
                raise RuntimeError(f"engine reported {engine.stats.failures} failed snapshot(s)")
            samples["engine.wall"].append(wall)
            samples["engine.stage"].append(engine.stats.stage_seconds)
            samples["engine.commit"].append(engine.stats.stage_seconds + engine.stats.commit_seconds)
            step += 1
            # the committed slot's payload, read-only
            ref = max(store.committed(ROLE_OWN, verify=False), key=lambda r: r.header.iteration)
            slot = store.slot(ROLE_OWN, ref.index)
            assert slot is not None  # noqa: S101
            payload = slot.segment(slot.payload_off, plan.unique_bytes).numpy()
            t0 = time.perf_counter()
            checksum(payload)
            samples["xxh3"].append(time.perf_counter() - t0)
            del payload
            order = list(baselines.items())
            if it % 2:
                order.reverse()
            for name, f in order:
                t0 = time.perf_counter()
                f()
                samples[name].append(time.perf_counter() - t0)
    finally:
        engine.close()
        baselines.clear()  # the closures hold views of the mapping
        del shm_views, shm_np
        for b in shms:
            b.close()
        store.destroy()

    med = {k: stat_summary(v) for k, v in samples.items()}
    gbps = {k: nbytes / v / GB for k, v in med.items()}
    best = min(names, key=lambda k: med[k])
    base = med[best]
    desc = f"{best}"
    rows = [
        Row("staging", "engine copy into slot (stats.stage_seconds)", gbps["engine.stage"], "GB/s",
            gbps[best], desc, base / med["engine.stage"], 0.9, ">=").judge(),
        Row("staging", "engine local commit (copy+extras+xxh3+header)", gbps["engine.commit"], "GB/s",
            gbps[best], desc, base / med["engine.commit"]).judge(),
        Row("staging", "snapshot() -> committed, wall", gbps["engine.wall"], "GB/s",
            gbps[best], desc, base / med["engine.wall"]).judge(),
        Row("staging", "xxh3-64 of the slot payload", gbps["xxh3"], "GB/s",
            gbps[best], desc, base / med["xxh3"]).judge(),
    ]
    # Ideal commit throughput if copy and hash ran back to back at their measured speeds.
    serial = 1 / (1 / gbps[best] + 1 / gbps["xxh3"])
    paired = {k: statistics.median(b / e for b, e in zip(samples[best], samples[k]))
              for k in ("engine.stage", "engine.commit")}
    rows[0].detail["paired_ratio_median"] = paired["engine.stage"]
    rows[1].detail["paired_ratio_median"] = paired["engine.commit"]
    extra = {
        "paired_ratio_median": paired,
        "payload_bytes": nbytes, "slot_payload_bytes": plan.unique_bytes,
        "median_seconds": med, "gbps": gbps, "baseline": best, "samples_seconds": samples,
        "ideal_serial_copy_then_hash_gbps": serial,
    }
    return rows, extra
