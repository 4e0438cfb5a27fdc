#!/usr/bin/env python3
"""What still holds CUDA memory after a failed in-process generation on NCCL, and what brings it back?

``python3 tools/gpu_probe/cuda_leak.py [--gens N] [--only a,b]``: on the H100, ``python -m tools.bench --generations``
saw every process fail the hygiene check after its first failed generation ("CUDA memory still allocated: 65.0 MiB
above the start"). This probe reproduces that generation in one process *without* our launcher: a TCPStore, an NCCL
group of world size 1 per generation (over ``gen/<g>/pg/`` of the store, as the engine does), the bench's MLP
(1024x4096x1024, AdamW) on cuda:0, an all_reduce of the concatenated grads each step, a RuntimeError at step 2;
then the engine's clean-up, step by step (``InprocessRecovery._abort``: ``abort_gloo`` then the real
``neighbor_ckpt.inprocess.abort.abort_nccl``; ``_finalize``: clean-ups, megatron's parallel-state reset,
``destroy_process_group()`` if still initialised, ``gc.collect()``), printing ``torch.cuda.memory_allocated()`` after
each stage.

Each variant runs in a fresh subprocess (they must not share an allocator, cuBLAS handles or NCCL state), for
``--gens`` generations each; the parent prints each variant's output as it finishes, then a table. The ``engine``
variant also, after generation 0: lists the live CUDA allocations with the Python stack that made them
(``torch.cuda.memory._record_memory_history``), the surviving CUDA tensors found by ``gc.get_objects()`` with the
types of their referrers, torch's c10d ``_world``, and whether ``dist.destroy_process_group()`` raises after
``abort_nccl``.

Seen on the H100 (torch 2.11, NCCL 2.28.9, 2026-11): 65 MiB left after every generation in every variant but
``clear_cublas``, ``hygiene_fixed`` and ``cublas_ws_0``; no CUDA tensor left for ``gc``; the live blocks were two
32 MiB cuBLAS workspaces (one allocated in ``F.linear``'s forward, one with no Python frames: the backward on
autograd's thread) and the 1 MiB cuBLASLt workspace. NCCL, the abort and the c10d registry hold nothing
(``destroy_process_group()`` after ``abort_nccl`` raises "AssertionError: Process group cannot be None"; the engine
skips it). Fixed in :mod:`neighbor_ckpt.inprocess.hygiene`, which clears the workspaces before it measures.

Without CUDA it prints one "needs CUDA" line and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
import types
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 1 << 20
STEPS, FAIL_AT = 6, 2
VARIANT_TIMEOUT_S = 80
DEVICE, BACKEND = "cuda:0", "nccl"  # a CPU dry run of this script's logic sets "cpu", "gloo"

VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "engine": ("the engine's clean-up as it is (raw memory_allocated; diagnostics after generation 0)", {}),
    "clear_cublas": ("engine + torch._C._cuda_clearCublasWorkspaces() after the clean-up", {}),
    "hygiene_fixed": ("engine + the real hygiene.check() of this tree (its verdict per generation)", {}),
    "sleep_2s": ("engine + 2 s sleep + gc.collect() (anything NCCL's watchdog releases late?)", {}),
    "destroy_no_abort": ("dist.destroy_process_group() in place of abort_nccl", {}),
    "no_allreduce": ("engine; the generation makes its NCCL group but runs no all_reduce", {}),
    "no_pg": ("no process group at all: model, AdamW, steps, raise; gc.collect()", {}),
    "avoid_rs_0": ("engine with TORCH_NCCL_AVOID_RECORD_STREAMS=0", {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}),
    "cublas_ws_0": ("engine with CUBLAS_WORKSPACE_CONFIG=:0:0 and TORCH_CUBLASLT_WORKSPACE_SIZE=0",
                    {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "TORCH_CUBLASLT_WORKSPACE_SIZE": "0"}),
}


def _mib(n: int | None) -> str:
    return "None" if n is None else f"{n / MiB:+.2f} MiB" if n < 0 else f"{n / MiB:.2f} MiB"


# -- one variant, in its own process ------------------------------------------------------------------------


def _generation(g: int, store: Any, variant: str) -> None:
    """The bench's training function (tools/bench/generations.py), failing at step FAIL_AT."""
    import torch
    import torch.distributed as dist

    device = torch.device(DEVICE)
    if variant != "no_pg":
        dist.init_process_group(BACKEND, store=dist.PrefixStore(f"gen/{g}/pg/", store), rank=0, world_size=1,
                                timeout=timedelta(seconds=120))
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device=device)
    for step in range(STEPS):
        loss = model(x).square().mean()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        if variant not in ("no_allreduce", "no_pg"):
            dist.all_reduce(grads)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        if step == FAIL_AT:
            raise RuntimeError(f"injected failure in generation {g}")


def _attempt(g: int, store: Any, variant: str) -> str | None:
    """As InprocessRecovery._attempt: only the exception's text survives the except clause."""
    error = None
    try:
        _generation(g, store, variant)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    return error


def _describe(obj: Any) -> str:
    t = type(obj)
    name = f"{t.__module__}.{t.__qualname__}"
    try:
        if isinstance(obj, types.FrameType):
            return f"{name} {obj.f_code.co_name} ({obj.f_code.co_filename}:{obj.f_lineno})"
        if isinstance(obj, dict):
            keys = [repr(k)[:40] for k in list(obj)[:6]]
            return f"{name} len={len(obj)} keys={keys}"
        if isinstance(obj, (list, tuple, set)):
            return f"{name} len={len(obj)}"
        if isinstance(obj, types.CellType):
            return f"{name}"
        if isinstance(obj, types.MethodType):
            return f"{name} {obj.__func__.__qualname__}"
    except Exception:  # noqa: BLE001
        pass
    return name


def _diagnose(baseline: int) -> None:
    """After generation 0's clean-up (engine variant): who holds what."""
    import warnings

    warnings.simplefilter("ignore", FutureWarning)  # isinstance() on torch's deprecated module attributes
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    torch.cuda.synchronize()
    now = torch.cuda.memory_allocated()
    print(f"[diag] memory_allocated {_mib(now)}; baseline {_mib(baseline)}; left over {_mib(now - baseline)}")
    st = torch.cuda.memory_stats()
    print(f"[diag] allocator: active blocks {st.get('active.all.current')}, segments {st.get('segment.all.current')},"
          f" reserved {_mib(torch.cuda.memory_reserved())}")

    # 1. live allocations and the Python stacks that made them
    try:
        snap = torch.cuda.memory._snapshot()
        live = []
        for seg in snap.get("segments", []):
            for blk in seg.get("blocks", []):
                if blk.get("state") == "active_allocated":
                    live.append((seg, blk))
        print(f"[diag] live CUDA blocks (memory snapshot): {len(live)}, "
              f"{_mib(sum(b.get('size', 0) for _, b in live))} in all")
        for seg, blk in sorted(live, key=lambda sb: -sb[1].get("size", 0))[:12]:
            frames = blk.get("frames") or []
            where = " <- ".join(f"{Path(f.get('filename', '?')).name}:{f.get('line')} {f.get('name')}"
                                for f in frames[:7]) or "NO PYTHON FRAMES (allocated in C++ / another thread)"
            print(f"[diag]   block {_mib(blk.get('size'))} (requested {blk.get('requested_size')} B) "
                  f"stream {seg.get('stream')} pool {seg.get('segment_type')}: {where}")
    except Exception as e:  # noqa: BLE001
        print(f"[diag] memory snapshot failed: {type(e).__name__}: {e}")

    # 2. surviving CUDA tensors known to Python, and their referrers
    gc.unfreeze()  # gc.get_objects()/get_referrers() do not see the permanent generation
    gc.collect()
    found = []
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda:
                found.append(o)
        except Exception:  # noqa: BLE001
            pass
    total = sum(t.untyped_storage().nbytes() for t in found)
    print(f"[diag] CUDA tensors found by gc.get_objects(): {len(found)} ({_mib(total)} of storage)")
    me = sys._getframe()
    for t in found[:15]:
        refs = [r for r in gc.get_referrers(t) if r is not found and r is not me]
        print(f"[diag]   {type(t).__name__} {tuple(t.shape)} {t.dtype} {_mib(t.untyped_storage().nbytes())} "
              f"referrers: {[_describe(r) for r in refs[:5]] or 'NONE (held from C++ only)'}")
        for r in refs[:3]:
            if isinstance(r, (dict, list, tuple, types.CellType)):
                up = [x for x in gc.get_referrers(r) if x is not refs and x is not me and x is not found]
                print(f"[diag]       {_describe(r)} <- {[_describe(x) for x in up[:4]]}")
    del found

    # 3. other objects of the generation still alive
    counts: dict[str, int] = {}
    for o in gc.get_objects():
        try:
            tn = type(o).__name__
            if isinstance(o, torch.optim.Optimizer) or isinstance(o, torch.nn.Module) or isinstance(
                    o, types.TracebackType) or (isinstance(o, BaseException) and "injected" in str(o)) or (
                    tn.endswith("Work") or "ProcessGroup" in tn or tn == "Future"):
                counts[f"{type(o).__module__}.{tn}"] = counts.get(f"{type(o).__module__}.{tn}", 0) + 1
        except Exception:  # noqa: BLE001
            pass
    print(f"[diag] other generation objects alive (gc-tracked): {counts or 'none'}")
    print(f"[diag] sys.last_exc={getattr(sys, 'last_exc', None)!r} sys.exc_info()={sys.exc_info()[0]}")

    # 4. torch's c10d registry
    w = c10d._world
    print(f"[diag] c10d: is_initialized={dist.is_initialized()} WORLD={c10d.GroupMember.WORLD!r} "
          f"pg_map={len(w.pg_map)} pg_names={len(w.pg_names)} pg_group_ranks={len(w.pg_group_ranks)} "
          f"pg_backend_config={len(w.pg_backend_config)} tags_to_pg={len(w.tags_to_pg)} "
          f"pg_coalesce_state={len(w.pg_coalesce_state)} group_count={w.group_count} "
          f"comms={len(getattr(w, 'comms', []) or [])}")

    # 5. does destroy_process_group() raise after abort_nccl? (the engine calls it only if still initialised)
    try:
        dist.destroy_process_group()
        print("[diag] dist.destroy_process_group() after abort_nccl: returned without error")
    except BaseException as e:  # noqa: BLE001
        print(f"[diag] dist.destroy_process_group() after abort_nccl RAISES {type(e).__name__}: {e}")

    gc.freeze()  # back as the engine has it (the next generations of this variant keep the engine's behaviour)


def run_variant(variant: str, gens: int) -> int:
    import torch
    import torch.distributed as dist

    from megatron_patches.parallel_reset import reset_parallel_state
    from neighbor_ckpt.inprocess import hygiene
    from neighbor_ckpt.inprocess.abort import SocketBaseline, abort_gloo, abort_nccl

    print(f"variant {variant}: {VARIANTS[variant][0]}")
    print(f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, {torch.cuda.get_device_name(0)}, "
          f"env {VARIANTS[variant][1] or '-'}")
    torch.cuda.init()
    torch.cuda.set_device(0)
    try:
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
        store_port = int(store.port)
    except Exception as e:  # noqa: BLE001
        print(f"TCPStore on port 0 failed ({e}); a FileStore instead")
        store = dist.FileStore(f"/tmp/nckpt-probe-{os.getpid()}.store", 1)
        store_port = -1
    if variant == "engine":
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=200_000)
    gc.collect()
    gc.freeze()  # as InprocessRecovery.run before generation 0
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    hyg_base = hygiene.ProcessState.capture()
    print(f"baseline memory_allocated {_mib(baseline)} (hygiene baseline cuda={hyg_base.cuda_allocated_bytes})")
    result: dict[str, Any] = {"variant": variant, "baseline": baseline, "gens": []}
    for g in range(gens):
        torch.cuda.synchronize()
        rec: dict[str, Any] = {"generation": g, "before_build": torch.cuda.memory_allocated()}
        stages: list[tuple[str, int]] = []

        def mark(name: str) -> None:
            torch.cuda.synchronize()
            stages.append((name, torch.cuda.memory_allocated()))

        sockets = SocketBaseline.capture()
        t0 = time.monotonic()
        error = _attempt(g, store, variant)
        mark(f"exception caught ({error})")
        # InprocessRecovery._abort
        try:
            abort_gloo(sockets, keep_ports={store_port})
            mark("abort_gloo")
            if variant == "destroy_no_abort":
                if dist.is_initialized():
                    dist.destroy_process_group()
                mark("destroy_process_group (no abort)")
            else:
                aborted = abort_nccl(timeout_s=30.0)
                mark(f"abort_nccl -> {aborted}; is_initialized={dist.is_initialized()}")
        except Exception as e:  # noqa: BLE001 - as the engine: logged, the finalisation goes on
            print(f"  abort raised {type(e).__name__}: {e}")
            mark("abort raised")
        # InprocessRecovery._finalize
        try:
            reset_parallel_state()
        except Exception as e:  # noqa: BLE001
            print(f"  reset_parallel_state: {e}")
        mark("reset_parallel_state")
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
                mark("destroy_process_group")
            except Exception as e:  # noqa: BLE001
                print(f"  destroy_process_group raised {type(e).__name__}: {e}")
                mark("destroy_process_group raised")
        else:
            mark("destroy_process_group skipped (not initialised)")
        gc.collect()
        mark("gc.collect  <- what the engine's hygiene check measured")
        if variant == "clear_cublas":
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is None:
                print("  torch._C._cuda_clearCublasWorkspaces is missing in this torch")
            else:
                clear()
            mark("torch._C._cuda_clearCublasWorkspaces()")
        elif variant == "sleep_2s":
            time.sleep(2.0)
            gc.collect()
            mark("sleep 2 s + gc.collect")
        elif variant == "hygiene_fixed":
            # resident memory is not what this probe is about: only the CUDA verdict counts here
            res = hygiene.check(hyg_base, g + 1, allowed_prefixes=("neighbor_ckpt-", "pt_", "Thread-"),
                                rss_limit_bytes=1 << 40)
            print(f"  hygiene.check (this tree): ok={res.ok} cuda_growth={_mib(res.cuda_growth_bytes)}: "
                  f"{res.summary()}")
            rec["hygiene_ok"] = res.ok
            rec["hygiene_cuda_growth"] = res.cuda_growth_bytes
            mark("after hygiene.check")
        rec["cleanup_s"] = time.monotonic() - t0
        print(f"generation {g}: before build {_mib(rec['before_build'])}")
        for name, val in stages:
            print(f"  {name:70s} {_mib(val):>12s}  (over baseline {_mib(val - baseline)})")
        rec["after_cleanup"] = stages[-1][1]
        rec["left_over"] = stages[-1][1] - baseline
        result["gens"].append(rec)
        if variant == "engine" and g == 0:
            _diagnose(baseline)
    if variant == "engine":
        torch.cuda.memory._record_memory_history(enabled=None)
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()
    return 0


# -- the parent ------------------------------------------------------------------------------------------------


def _run_child(variant: str, gens: int) -> tuple[str, int | None, str, float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **VARIANTS[variant][1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--variant", variant, "--gens", str(gens)],
                           env=env, capture_output=True, text=True, timeout=VARIANT_TIMEOUT_S)
        return variant, p.returncode, p.stdout + p.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return variant, None, out + err + f"\n[timed out after {VARIANT_TIMEOUT_S} s]", time.monotonic() - t0


def _noise(line: str) -> bool:
    return "FutureWarning" in line or "import pynvml" in line or "warnings.warn(" in line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--gens", type=int, default=3, help="generations per variant (default 3)")
    ap.add_argument("--only", default="", help="comma-separated variants (default: all)")
    args = ap.parse_args(argv)
    from tools.gpu_probe import cuda_here

    if not cuda_here("cuda_leak"):
        return 0
    if args.variant:
        return run_variant(args.variant, args.gens)
    names = [v for v in args.only.split(",") if v] or list(VARIANTS)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    print(f"cuda_leak: {len(names)} variants x {args.gens} generations, each in a fresh process")
    results: dict[str, Any] = {}
    rcs: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        futs = [pool.submit(_run_child, v, args.gens) for v in names]
        for f in as_completed(futs):
            v, rc, out, wall = f.result()
            rcs[v] = rc
            print(f"\n===== {v} (exit {rc}, {wall:.1f} s) " + "=" * 40)
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    results[v] = json.loads(line[len("RESULT "):])
                elif not _noise(line):
                    print(line)
            sys.stdout.flush()
    print("\n===== summary: CUDA memory left over the pre-generation-0 baseline after each generation's clean-up")
    for v in names:
        r = results.get(v)
        if r is None:
            print(f"  {v:18s} no result (exit {rcs.get(v)})")
            continue
        left = [g["left_over"] for g in r["gens"]]
        extra = ""
        if v == "hygiene_fixed":
            extra = "  hygiene ok: " + str([g.get("hygiene_ok") for g in r["gens"]])
        verdict = "BACK TO BASELINE" if all(x == 0 for x in left) else "LEAK"
        print(f"  {v:18s} {verdict:17s} left over per generation: {[_mib(x) for x in left]}{extra}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
