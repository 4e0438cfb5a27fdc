"""The command line of ``python -m tools.bench.compare`` (``python -m tools.bench --compare``): options and their per-device defaults, the machine facts,
the spawned ranks, the output."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import tools.bench.compare as _package
from neighbor_ckpt.recipes.mcore_gpt_plain_loop import HEADS, HIDDEN, LAYERS, SEQ, VOCAB
from tools.bench.compare.gpt import CPU_SHAPE, GPU_SHAPE, SHAPE_KEYS
from tools.bench.compare.projection import projection
from tools.bench.compare.runner import one_line
from tools.bench.compare.systems import ALTERNATIVES, VARIANTS, runnable
from tools.bench.compare.tables import render
from tools.bench.compare.worker import profile_worker, train_worker

CPU_PROTOCOL = {"steps": 20, "quick_steps": 8, "warmup": 3, "block": 5, "scales": "2,4", "quick_scales": "2"}
CUDA_PROTOCOL = {"steps": 8, "quick_steps": 4, "warmup": 2, "block": 4, "scales": "", "quick_scales": ""}
"""--device cuda: short enough for a 10-minute call with model building (11 steps per variant: on one H100 the default
variants took about 7.5 min at 13 steps each, lightning_save's 19 s per step half of it); scaling runs only with
--scales."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gpu_info() -> dict[str, Any]:
    """Which card(s), driver, CUDA and NCCL a --device cuda run used (best effort: a missing field is left out)."""
    import subprocess

    import torch

    out: dict[str, Any] = {"torch_cuda": torch.version.cuda, "gpu_count": torch.cuda.device_count()}
    try:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu_name=props.name, gpu_memory_bytes=int(props.total_memory),
                   gpu_capability=f"{props.major}.{props.minor}")
    except Exception as e:  # noqa: BLE001
        out["gpu_error"] = one_line(e)
    try:
        out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001
        pass
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=False)
        lines = [line.strip() for line in q.stdout.splitlines() if line.strip()]
        out["nvidia_smi"] = lines
        fields = [f.strip() for f in lines[0].split(",")] if lines else []
        if len(fields) == 4:
            out.update(gpu_driver=fields[1], gpu_pcie=f"PCIe Gen{fields[2]} x{fields[3]}")
    except Exception:  # noqa: BLE001
        pass
    return out


def _machine(store_root: Path, device: str = "cpu") -> dict[str, Any]:
    import torch

    from tools.bench.machine import machine_info

    info = machine_info(store_root)
    info["python"] = platform.python_version()
    info["torch"] = torch.__version__
    if device == "cuda":
        info["device"] = "cuda"
        info.update(_gpu_info())
    return info


def plan_line(variants: list[str], skipped: dict[str, str]) -> str:
    """What a run will compare, in one line per skipped variant and one for the run: ``skipped nvrx_local: needs
    nvidia_resiliency_ext, not installed`` ... ``comparing base, neighbor, dcp_async (alternatives: dcp_async)``."""
    alternatives = [v for v in variants if v in ALTERNATIVES]
    lines = [f"tools.bench.compare: skipped {name}: {why}" for name, why in skipped.items()]
    lines.append(f"tools.bench.compare: comparing {', '.join(variants)} (alternatives: "
                 f"{', '.join(alternatives) if alternatives else 'none'})")
    return "\n".join(lines)


def resolve_args(args: argparse.Namespace, gpu_count: int = 0) -> None:
    """Fill the defaults that depend on ``--device`` (shape, protocol, world) into ``args`` in place; raise
    ``ValueError`` with the reason when the combination is invalid. ``gpu_count``: GPUs visible (cuda mode)."""
    cuda = args.device == "cuda"
    shape, proto = (GPU_SHAPE, CUDA_PROTOCOL) if cuda else (CPU_SHAPE, CPU_PROTOCOL)
    for key in SHAPE_KEYS:
        if getattr(args, key) is None:
            setattr(args, key, shape[key])
    if args.steps is None:
        args.steps = proto["quick_steps"] if args.quick else proto["steps"]
    if args.warmup is None:
        args.warmup = proto["warmup"]
    if args.block is None:
        args.block = proto["block"]
    if args.scale_steps is None:
        args.scale_steps = args.steps
    if args.scales is None:
        args.scales = proto["quick_scales"] if args.quick else proto["scales"]
    if args.world is None:
        args.world = gpu_count if cuda else 4
    if cuda:
        if gpu_count < 1:
            raise ValueError("--device cuda: no CUDA device is visible")
        if not 1 <= args.world <= gpu_count:
            raise ValueError(f"--device cuda: --world must be 1..{gpu_count} (one rank per visible GPU)")
        if args.steps < 1 or args.block < 1 or args.warmup < 1:
            raise ValueError("--steps >= 1, --block >= 1, --warmup >= 1")
    elif args.world < 2 or args.steps < 1 or args.block < 1 or args.warmup < 1:
        raise ValueError("--world >= 2, --steps >= 1, --block >= 1, --warmup >= 1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.compare", description=_package.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: gloo ranks on CPU tensors (default); cuda: one NCCL rank per GPU, bf16 model of "
                         "GPU_SHAPE, the CUDA_PROTOCOL defaults below")
    ap.add_argument("--quick", action="store_true", help="8 timed steps per variant, no 16x model")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks (default 4; cuda: every visible GPU, 1 allowed; DP = world)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per variant (default 20, --quick 8; cuda 8, --quick 4)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps in each variant's first block (default 3; cuda 2)")
    ap.add_argument("--block", type=int, default=None, help="timed steps per block (default 5; cuda 4)")
    ap.add_argument("--scale-steps", type=int, default=None, help="timed steps per variant in the scaling runs "
                                                                  "(default: --steps)")
    ap.add_argument("--scales", default=None, help="hidden-size multipliers of the scaling runs, comma-separated "
                                                   "(default '2,4' = about 4x and 16x the parameters; --quick '2'; "
                                                   "cuda: none)")
    ap.add_argument("--no-scale-best", dest="scale_with_best", action="store_false",
                    help="scaling runs: base and neighbor only")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--hidden", type=int, default=None, help=f"default {HIDDEN}; cuda {GPU_SHAPE['hidden']}")
    ap.add_argument("--layers", type=int, default=None, help=f"default {LAYERS}; cuda {GPU_SHAPE['layers']}")
    ap.add_argument("--heads", type=int, default=None, help=f"default {HEADS}; cuda {GPU_SHAPE['heads']}")
    ap.add_argument("--seq", type=int, default=None, help=f"default {SEQ}; cuda {GPU_SHAPE['seq']}")
    ap.add_argument("--vocab", type=int, default=None, help=f"default {VOCAB}; cuda {GPU_SHAPE['vocab']}")
    ap.add_argument("--micro-batches", type=int, default=None,
                    help=f"per rank per step (default 2; cuda {GPU_SHAPE['micro_batches']})")
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help=f"sequences per micro-batch (default 2; cuda {GPU_SHAPE['micro_batch_size']})")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    ap.add_argument("--store-dir", default="/dev/shm", help="where every checkpoint goes (default /dev/shm)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before the whole run is abandoned")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the raw results to PATH")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="first wait up to S seconds for other processes to use < 10%% of the CPUs")
    ap.add_argument("--verbose", action="store_true", help="progress lines, library logs and tracebacks")
    ap.add_argument("--profile-snapshot", action="store_true",
                    help="cProfile the training thread's snapshot() call (one rank, DP=1, CPU only) and exit")
    ap.add_argument("--projection", action="store_true", help="print the GPU projection (planner + goodput) only")
    ap.add_argument("--from-json", metavar="PATH", default=None,
                    help="with --projection: take the measured ratios from an earlier --json; without: re-render it")
    args = ap.parse_args(argv)

    if args.projection:
        measured = json.loads(Path(args.from_json).read_text()) if args.from_json else None
        print(projection(measured))
        return 0
    gpu_count = 0
    if args.device == "cuda":
        import torch

        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if args.profile_snapshot:
            ap.error("--profile-snapshot runs on CPU only")
    try:
        resolve_args(args, gpu_count)
    except ValueError as e:
        ap.error(str(e))
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or "base" not in variants:
        ap.error(f"--variants: unknown {bad}" if bad else "--variants must include base")
    variants, skipped = runnable(variants)
    if not (args.from_json or args.profile_snapshot):
        print(plan_line(variants, skipped), flush=True)
    scales = [int(x) for x in args.scales.split(",") if x.strip()]

    base_dir = Path(args.store_dir)
    base_dir.mkdir(parents=True, exist_ok=True)
    if args.profile_snapshot:
        import torch.multiprocessing as mp

        root = Path(tempfile.mkdtemp(prefix="neighbor_ckpt_compare-", dir=base_dir))
        try:
            cfg = {"root": str(root), "init_file": str(root / "pg_init"), "port": _free_port(), "threads": args.threads,
                   "hidden": args.hidden, "layers": args.layers, "heads": args.heads, "seq": args.seq,
                   "vocab": args.vocab, "micro_batches": args.micro_batches,
                   "micro_batch_size": args.micro_batch_size, "steps": max(args.steps, 20)}
            mp.start_processes(profile_worker, args=(cfg,), nprocs=1, join=True, start_method="spawn")
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    info = _machine(base_dir, args.device)
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        # The run's own shape and protocol (and device), not this command line's defaults.
        for key in (*SHAPE_KEYS, "device", "steps", "block", "warmup", "threads"):
            if key in res.get("args", {}):
                setattr(args, key, res["args"][key])
        print(render(res, res.get("machine", info), args))
        return 0

    from tools.bench.machine import cpu_sample, foreign_load, wait_until_quiet

    if args.wait_quiet > 0:
        wait_until_quiet(args.wait_quiet, info["nproc"] or 1, poll_s=2.0)
    root = Path(tempfile.mkdtemp(prefix="neighbor_ckpt_compare-", dir=base_dir))
    t0 = time.perf_counter()
    cpu0 = cpu_sample()
    rc = 0
    try:
        cfg = {
            "root": str(root), "init_file": str(root / "pg_init"), "out": str(root / "result.json"),
            "port": _free_port(), "timeout_s": args.timeout, "pg_timeout_s": 300, "verbose": args.verbose,
            "threads": args.threads, "variants": variants, "steps": args.steps, "warmup": args.warmup,
            "block": args.block, "scale_steps": args.scale_steps, "scale_hidden": scales,
            "scale_with_best": args.scale_with_best, "hidden": args.hidden, "layers": args.layers,
            "heads": args.heads, "seq": args.seq, "vocab": args.vocab, "micro_batches": args.micro_batches,
            "micro_batch_size": args.micro_batch_size, "device": args.device,
        }
        import torch.multiprocessing as mp

        ctx = mp.start_processes(train_worker, args=(args.world, cfg), nprocs=args.world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + args.timeout + 30
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"benchmark did not finish within {args.timeout:.0f} s")
        res = json.loads(Path(cfg["out"]).read_text())
        res["main"]["skipped"] = skipped
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"tools.bench.compare: failed: {one_line(e)}", file=sys.stderr)
        rc = 2
        res = None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if res is None:
        return rc
    fl = foreign_load(cpu0, cpu_sample(), info["nproc"] or 1)
    info.update(other_cpu_frac=fl["other_cpu_frac"], steal_frac=fl["steal_frac"])
    res["wall_s"] = time.perf_counter() - t0
    res["machine"] = info
    res["args"] = vars(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    print(render(res, info, args))
    return 0
