"""``python -m tools.bench --generations [--failures 5] [--backend auto|nccl|gloo] [--out FILE]``: the engine's cost
per generation on one process (issue 28, item 7).

With one process (world size 1) there is no peer to block a collective; what this measures is everything else a
contained failure costs a process: the exception raised into the training function, the abort of the generation's
groups (NCCL's under the watchdog where there is a device), the clean-ups, the hygiene check, the barrier, a new
process group and the first step after it. One launch of our launcher (``neighbor_ckpt.inprocess.launcher``, the
store host beside it) runs a small MLP on the GPU (NCCL) when there is one, else on the CPU (gloo); the training
function raises at step 2 of each of the first ``--failures`` generations. Per generation it records the seconds from
the exception to the end of the next generation's first step, and torch's CUDA memory allocated before the model is
built (it must come back to its baseline: the hygiene check refuses a process whose CUDA memory does not).

A process that fails the hygiene check exits (status 77) and its launcher starts a new one, which carries on with the
next generation. So each process appends its records to one JSON-lines file as they happen (with its pid; a record
is written before its generation's failure is raised, since a process may never get past that generation's
clean-up), and the summary covers every generation of the launch, whichever process ran it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

STEPS = 6
FAIL_AT = 2


WORKER_DETECTOR_TIMEOUT_S = 2.0
"""The worker's ``detector.timeout_s`` (its launcher's store timeout follows it)."""


def _append(out: Path, obj: dict[str, Any]) -> None:
    """One JSON line, appended and closed at once (a process may end with ``os._exit`` right after)."""
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj) + "\n")


def _worker(out: Path, failures: int, backend: str) -> int:
    import torch
    import torch.distributed as dist

    from neighbor_ckpt.config import NeighborCkptConfig
    from neighbor_ckpt.inprocess import InprocessRecovery

    cfg = NeighborCkptConfig()
    cfg.inprocess.enabled = True
    cfg.inprocess.max_restarts = failures + 1
    cfg.detector.interval_s, cfg.detector.timeout_s, cfg.detector.hang_timeout_s = 0.2, WORKER_DETECTOR_TIMEOUT_S, 30.0
    inproc = InprocessRecovery.from_config(cfg)
    cuda = backend == "nccl"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    pid = os.getpid()
    _append(out, {"kind": "process", "pid": pid, "backend": backend, "device": str(device), "start": time.time()})

    def train(att: Any) -> None:
        rec: dict[str, Any] = {"kind": "generation", "pid": pid, "generation": att.iteration, "enter": time.time()}
        if cuda:
            torch.cuda.synchronize()
            rec["cuda_allocated_before_build"] = torch.cuda.memory_allocated()
        inproc.init_process_group(backend=backend)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(64, 1024, device=device)
        progress = [0]
        inproc.watch_progress(lambda: (progress[0], progress[0], "step"))
        for step in range(STEPS):
            loss = model(x).square().mean()
            loss.backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            dist.all_reduce(grads)  # the generation's group at work (NCCL on a device)
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            progress[0] += 1
            if step == 0:
                inproc.mark_progress()
                rec["first_step_end"] = time.time()
            if step == FAIL_AT and att.iteration < failures:
                rec["raised"] = time.time()
                _append(out, rec)
                raise RuntimeError(f"injected failure {att.iteration + 1} of {failures}")
        rec["end"] = time.time()
        _append(out, rec)
        dist.destroy_process_group()

    inproc.run(train)
    _append(out, {"kind": "final", "pid": pid, "events": list(inproc.events), "end": time.time()})
    return 0


def _read(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def _summary(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Every generation of the launch, whichever process ran it: outage of generation g = the end of its first step
    minus the time generation g-1 raised (possibly in another process: the replacement's start is then part of
    it)."""
    procs = [r for r in lines if r.get("kind") == "process"]
    recs = sorted((r for r in lines if r.get("kind") == "generation"), key=lambda r: (r["generation"], r["enter"]))
    raised = {r["generation"]: r["raised"] for r in recs if "raised" in r}
    outages, by_gen = [], []
    for r in recs:
        prev = raised.get(r["generation"] - 1)
        out = r["first_step_end"] - prev if prev is not None and "first_step_end" in r else None
        if out is not None:
            outages.append(out)
        by_gen.append({"generation": r["generation"], "pid": r["pid"], "outage_s": out,
                       "cuda_allocated_before_build": r.get("cuda_allocated_before_build"),
                       "failed": "raised" in r})
    pids = list(dict.fromkeys([p["pid"] for p in procs] + [r["pid"] for r in recs]))
    finals = [r["pid"] for r in lines if r.get("kind") == "final"]
    # per process: its CUDA memory before each build must equal the value before its first one
    first_cuda: dict[int, Any] = {}
    back = []
    for r in recs:
        c = r.get("cuda_allocated_before_build")
        if c is None:
            continue
        base = first_cuda.setdefault(r["pid"], c)
        back.append(c == base)
    head = procs[0] if procs else {}
    return {"backend": head.get("backend"), "device": head.get("device"), "generations": len(recs),
            "failed_generations": sum(1 for r in recs if "raised" in r),
            "processes": len(pids), "replaced_processes": max(0, len(pids) - 1), "pids": pids,
            "finished_pids": finals,
            "outage_s": outages, "outage_median_s": statistics.median(outages) if outages else None,
            "cuda_allocated_before_build": [r.get("cuda_allocated_before_build") for r in recs],
            "cuda_back_to_baseline": all(back) if back else None, "per_generation": by_gen}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench --generations", description=__doc__.split("\n\n")[0])
    ap.add_argument("--failures", type=int, default=5)
    ap.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    ap.add_argument("--out", type=Path, default=None, help="JSON result (default: printed only)")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        return _worker(args.worker, args.failures, args.backend)
    backend = args.backend
    if backend == "auto":
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    from neighbor_ckpt.cli.launch import free_ports, inprocess_commands, run_inprocess

    tmp = Path(tempfile.mkdtemp(prefix="nckpt-generations-"))
    result = tmp / "result.jsonl"  # appended by every process of the launch
    program = [str(Path(__file__).resolve()), "--worker", str(result), "--failures", str(args.failures),
               "--backend", backend]
    procs = inprocess_commands(program, active=1, spares=0, max_restarts=0, run_id=f"gen-{os.getpid()}",
                               store_port=free_ports(1), store_root=tmp / "store",
                               detector_timeout_s=WORKER_DETECTOR_TIMEOUT_S)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    t0 = time.time()
    rc = run_inprocess(procs, env=env, timeout=600)
    lines = _read(result)
    if rc != 0 or not any(r.get("kind") == "generation" for r in lines):
        print(f"the launch failed (status {rc}); logs above, files in {tmp}", file=sys.stderr)
        if lines and args.out is not None:  # what the processes recorded before the failure
            args.out.write_text(json.dumps(dict(_summary(lines), launch_status=rc), indent=1))
        return 1
    summary = _summary(lines)
    summary["wall_s"] = time.time() - t0
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
