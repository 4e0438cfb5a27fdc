"""Section 4: the per-step cost of a snapshot besides copying bytes (issue 16, hot path).

Two states, one rank, no transport: the tiny GPT's (4 layers, hidden 256, distributed optimizer over 4 ranks: the
fp32 main-param shard and two Adam moments per parameter, 159 tensors) and a 1,000-tensor state of 1 KiB tensors
(where the per-tensor work dominates). Per step it times

* ``snapshot()`` on the training thread (encode the small state, stage its tensors), the wait excluded;
* the engine thread's work from ``snapshot()`` to the commit (``snapshot()`` + ``wait()`` back to back, minus the
  ``snapshot()`` call), of which the copy itself is ``stats.stage_seconds``: the rest (slot choice, extras,
  checksums, header JSON, marker) is the hot path's overhead.

Runs on its own (``python -m tools.bench.micro.hotpath [--iters N] [--json]``) and only uses the
engine's public interface, so the same file measures an older tree too (A/B).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from neighbor_ckpt.snapshot.engine import SnapshotEngine
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
from neighbor_ckpt.snapshot.store import HostStore

__all__ = ["STATES", "bench_hotpath", "hotpath_rows", "main"]


def _tiny_gpt_shapes(layers: int = 4, hidden: int = 256, vocab: int = 1024, seq: int = 128) -> list[tuple[str, int]]:
    """(name, elements) of the tiny GPT's parameters (mcore GPTModel, no bias-free layers, untied output)."""
    out = [("embedding.word_embeddings.weight", vocab * hidden), ("embedding.position_embeddings.weight", seq * hidden)]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        out += [(p + "input_layernorm.weight", hidden), (p + "input_layernorm.bias", hidden),
                (p + "self_attention.linear_qkv.weight", 3 * hidden * hidden),
                (p + "self_attention.linear_qkv.bias", 3 * hidden),
                (p + "self_attention.linear_proj.weight", hidden * hidden), (p + "self_attention.linear_proj.bias", hidden),
                (p + "pre_mlp_layernorm.weight", hidden), (p + "pre_mlp_layernorm.bias", hidden),
                (p + "mlp.linear_fc1.weight", 4 * hidden * hidden), (p + "mlp.linear_fc1.bias", 4 * hidden),
                (p + "mlp.linear_fc2.weight", 4 * hidden * hidden), (p + "mlp.linear_fc2.bias", hidden)]
    out += [("decoder.final_layernorm.weight", hidden), ("decoder.final_layernorm.bias", hidden),
            ("output_layer.weight", vocab * hidden)]
    return out


def _tiny_gpt_state(dp: int = 4) -> list[TensorMeta]:
    metas = []
    for name, n in _tiny_gpt_shapes():
        shard = (max(1, n // dp),)
        metas += [TensorMeta(f"main/{name}", StateKind.MAIN_PARAM, torch.float32, shard),
                  TensorMeta(f"optim/{name}/exp_avg", StateKind.OPTIMIZER, torch.float32, shard),
                  TensorMeta(f"optim/{name}/exp_avg_sq", StateKind.OPTIMIZER, torch.float32, shard)]
    return metas


def _many_state(n: int = 1000, elements: int = 256) -> list[TensorMeta]:
    return [TensorMeta(f"optim/layers.{i}.weight/exp_avg", StateKind.OPTIMIZER, torch.float32, (elements,))
            for i in range(n)]


STATES = {"tiny GPT (159 tensors)": _tiny_gpt_state, "1,000 tensors of 1 KiB": _many_state}


def _extras(step: int, groups: int) -> dict[str, Any]:
    """What the checkpointer hands the engine: the optimizer's param_groups, the RNG state, loop counters."""
    return {"adapter": {"param_groups": [[{"lr": 1e-3 * (1 + step % 7), "betas": (0.9, 0.95), "eps": 1e-8,
                                           "weight_decay": 0.01, "step": step} for _ in range(groups)]]},
            "rng": {"torch": torch.get_rng_state()}, "user": {"global_step": step, "consumed": step * 32}}


def bench_hotpath(root: Path, iters: int = 200, warmup: int = 10) -> dict[str, dict[str, float]]:
    """Median milliseconds per step of each state: ``snapshot_ms`` (training thread), ``engine_ms`` (engine thread
    until the commit), ``copy_ms`` (its copy) and ``overhead_ms`` (``engine_ms - copy_ms``)."""
    out: dict[str, dict[str, float]] = {}
    for label, make in STATES.items():
        metas = make()
        plan = plan_shards(metas, dp_size=4, distributed_optimizer=True)
        g = torch.Generator().manual_seed(0)
        sources = [torch.randn(p.meta.shape, generator=g) for p in plan.unique]
        store = HostStore(root, job_id=f"bench-hotpath-{os.getpid()}-{len(out)}", rank=0, versions=2)
        engine = SnapshotEngine(store=store, plan=plan, sources=sources, layout="bench", meta={"bench": "hotpath"},
                                transport=None, wait_for_replica=True)
        snap, eng, copy = [], [], []
        try:
            for step in range(warmup + iters):
                extras = _extras(step, 2)
                t0 = time.perf_counter()
                engine.snapshot(step, extras)
                t1 = time.perf_counter()
                engine.wait()
                t2 = time.perf_counter()
                if step >= warmup:
                    snap.append(t1 - t0)
                    eng.append(t2 - t1)
                    copy.append(engine.stats.stage_seconds)
            if engine.stats.failures:
                raise RuntimeError(f"{engine.stats.failures} snapshot(s) failed")
        finally:
            engine.close()
            store.destroy()
        ms = {k: 1e3 * statistics.median(v) for k, v in (("snapshot_ms", snap), ("engine_ms", eng), ("copy_ms", copy))}
        ms["overhead_ms"] = 1e3 * statistics.median(e - c for e, c in zip(eng, copy))
        ms["tensors"] = len(plan.unique)
        ms["unique_mib"] = plan.unique_bytes / 2**20
        out[label] = ms
    return out


def hotpath_rows(root: Path, iters: int, warmup: int = 10) -> tuple[list[Any], dict[str, Any]]:
    """Section 6 of the micro-benchmark: one row per state and figure (microseconds per step, informational)."""
    from tools.bench.micro.common import Row

    res = bench_hotpath(root, iters=iters, warmup=warmup)
    rows = []
    for label, r in res.items():
        rows.append(Row("hotpath", f"{label}: snapshot() on the training thread", 1e3 * r["snapshot_ms"], "us",
                        None, "per step", None).judge())
        rows.append(Row("hotpath", f"{label}: engine thread besides the copy", 1e3 * r["overhead_ms"], "us",
                        None, "per step", None).judge())
    return rows, res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.micro.hotpath", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200, help="timed steps per state (default 200)")
    ap.add_argument("--store-dir", default="/dev/shm", help="where the slots live (default /dev/shm)")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="neighbor_ckpt_hotpath-", dir=args.store_dir))
    try:
        res = bench_hotpath(root, iters=args.iters)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{'state':<26} {'snapshot() ms':>14} {'engine ms':>10} {'copy ms':>8} {'overhead ms':>12}")
    for label, r in res.items():
        print(f"{label:<26} {r['snapshot_ms']:>14.3f} {r['engine_ms']:>10.3f} {r['copy_ms']:>8.3f} "
              f"{r['overhead_ms']:>12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
