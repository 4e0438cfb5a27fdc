"""``scripts/bench`` / ``python -m tools.bench.micro``: the options, the sections in order, the notes."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import tools.bench.micro as _package
from tools.bench.machine import parse_size, cpu_sample, foreign_load, machine_info, wait_until_quiet
from tools.bench.micro import common
from tools.bench.micro.common import GB, MiB, Row, stat_summary
from tools.bench.micro.fingerprint import bench_fingerprint
from tools.bench.micro.hotpath import hotpath_rows
from tools.bench.micro.report import render
from tools.bench.micro.staging import bench_staging
from tools.bench.micro.streaming import bench_stream
from neighbor_ckpt.config import STORE_DIR_ENV, TransportConfig


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench", description=_package.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=256.0, help="unique state per rank in MiB (default 256)")
    ap.add_argument("--iters", type=int, default=8, help="timed iterations per measurement (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    ap.add_argument("--tensors", type=int, default=4, help="fp32 tensors the state is split into (default 4)")
    ap.add_argument("--world", default="4,2", help="ring sizes to stream with, comma-separated (default 4,2; "
                                                   "'' to skip streaming)")
    ap.add_argument("--chunk-mib", type=float, default=TransportConfig().chunk_mb,
                    help="transport chunk in MiB (default: TransportConfig.chunk_mb)")
    ap.add_argument("--store-dir", default=None, help=f"store root (default ${STORE_DIR_ENV} or /dev/shm)")
    ap.add_argument("--timeout", type=float, default=120.0, help="process-group / receive timeout in s")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write all results to PATH")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="summary of the timed iterations (default median; min = best-of, for noisy machines)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="first wait up to S seconds for other processes to use < 10%% of the CPUs")
    ap.add_argument("--no-restore", action="store_true",
                    help="skip the restore figures (run after the streaming run of every --world size)")
    ap.add_argument("--no-fingerprint", action="store_true",
                    help="skip the data-position check's cost per step (section 5)")
    ap.add_argument("--hotpath-iters", type=int, default=100, metavar="N",
                    help="steps per state of the hot-path section (section 6; default 100, 0 skips it)")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any target is missed (2 on errors always)")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.tensors < 1 or args.mib <= 0:
        ap.error("--iters, --tensors and --mib must be positive")
    worlds = [int(w) for w in args.world.split(",") if w.strip()]
    if any(w < 2 for w in worlds):
        ap.error("--world sizes must be >= 2")

    common.STAT = args.stat
    if args.wait_quiet > 0:
        ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        wait_until_quiet(args.wait_quiet, ncpu)
    base = Path(args.store_dir or os.environ.get(STORE_DIR_ENV) or "/dev/shm")
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="neighbor_ckpt_bench-", dir=base))
    info = machine_info(base)
    t_start = time.perf_counter()
    cpu0 = cpu_sample()
    rows: list[Row] = []
    notes: list[str] = []
    results: dict[str, Any] = {"machine": info, "args": vars(args)}
    try:
        try:
            r, extra = bench_staging(args, root)
            rows += r
            results["staging"] = extra
            g = extra["gbps"]
            cands = ", ".join(f"{k} {g[k]:.2f}" for k in ("torch.copy_ -> anon", "numpy.copyto -> anon",
                                                         "torch.copy_ -> /dev/shm map",
                                                         "numpy.copyto -> /dev/shm map"))
            notes.append(f"memcpy candidates (GB/s): {cands}; baseline = fastest ({extra['baseline']}).")
            l3 = parse_size(info.get("l3_cache"))
            if l3 and extra["payload_bytes"] < 4 * l3:
                notes.append(f"payload is less than 4x the L3 cache ({info['l3_cache']}): part of every copy may "
                             f"run from cache; use a larger --mib to measure memory bandwidth alone.")
            pr = extra["paired_ratio_median"]
            notes.append(f"median of per-iteration ratios (engine and baseline timed back to back, robust to load "
                         f"drift): copy {pr['engine.stage']:.3f}x, local commit {pr['engine.commit']:.3f}x.")
            notes.append(f"copy then xxh3 back to back at those speeds would commit at "
                         f"{extra['ideal_serial_copy_then_hash_gbps']:.2f} GB/s (the commit row's ceiling "
                         f"while the hash runs after the copy on one thread).")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append(Row("staging", "staging benchmark", float("nan"), "", None, f"failed: {e!r}", None,
                            0.9).judge())
        if not args.no_fingerprint:
            try:
                r, extra = bench_fingerprint(args, root)
                rows += r
                results["fingerprint"] = extra
                paired = ", ".join(f"{row.metric.rpartition('(')[2].rstrip(')')} {row.detail['paired_ratio_median']:.4f}x"
                                   for row in r)
                wall = ", ".join(f"{row.detail.get('wall_ratio', float('nan')):.4f}x" for row in r)
                notes.append("input fingerprint: NeighborCheckpointer.observe_input (xxh3-64 of the first "
                             "micro-batch's token ids, sampled beyond 16 KiB, + one store into the memory-mapped "
                             "input record) against snapshot(), the training thread's CPU time per step, one process "
                             "(docs/data-position.md); median of per-step ratios (both calls of one "
                             f"step): {paired}; on the wall clock (with the GIL waits): {wall}.")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append(Row("datacheck", "input fingerprint", float("nan"), "", None, f"failed: {e!r}", None,
                                0.01).judge())
        if args.hotpath_iters > 0:
            try:
                r, extra = hotpath_rows(root, args.hotpath_iters)
                rows += r
                results["hotpath"] = extra
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append(Row("hotpath", "hot path", float("nan"), "", None, f"failed: {e!r}", None).judge())
        for w in worlds:
            try:
                r, extra = bench_stream(args, root, w)
                rows += r
                results[f"stream_w{w}"] = extra
                tn = extra["seconds"]["neighbor"]
                tr = extra["seconds"]["raw"]
                eng = extra["engine_last_snapshot_max_seconds"]
                notes.append(
                    f"W={w}: median of per-iteration ratios {r[0].detail['paired_ratio_median']:.3f}x; image {extra['image_bytes'] / MiB:.2f} MiB/rank; slowest-rank seconds neighbor "
                    f"min/med/max {min(tn):.3f}/{statistics.median(tn):.3f}/{max(tn):.3f}, raw {min(tr):.3f}/"
                    f"{statistics.median(tr):.3f}/{max(tr):.3f}; aggregate "
                    f"{w * extra['image_bytes'] / stat_summary(tn) / GB:.2f} GB/s; engine end-to-end (last warm-up "
                    f"snapshot, slowest rank) wall {eng['wall']:.3f}s = stage {eng['stage']:.3f} + commit "
                    f"{eng['commit']:.3f} + stream {eng['stream']:.3f}.")
                notes += extra.get("restore_notes", [])
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append(Row("stream", f"ring W={w}", float("nan"), "", None, f"failed: {e!r}", None,
                                0.9).judge())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    fl = foreign_load(cpu0, cpu_sample(), info["nproc"] or 1)
    results["foreign_load"] = fl
    warn = "  WARNING: other processes were busy, figures are skewed" if fl["other_cpu_frac"] > 0.05 else ""
    notes.append(f"total benchmark time {elapsed:.1f}s; other processes used {fl['other_cpu_s']:.1f} CPU-s "
                 f"({100 * fl['other_cpu_frac']:.0f}% of the {info['nproc']} cores), hypervisor steal "
                 f"{100 * fl['steal_frac']:.0f}%; /proc/loadavg at start {info['loadavg_start']}.{warn}")
    results["rows"] = [asdict(r) for r in rows]
    results["elapsed_seconds"] = elapsed
    render(info, args, rows, notes)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    if any(r.status == "ERROR" for r in rows):
        return 2
    return 1 if args.strict and any(r.status == "MISS" for r in rows) else 0
