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


def _worker(out: Path, failures: int, backend: str) -> int:
    import torch
    import torch.distributed as dist

    from neighbor_ckpt.config import NeighborCkptConfig
    from neighbor_ckpt.inprocess import InprocessRecovery

    cfg = NeighborCkptConfig()
    cfg.inprocess.enabled = True
    cfg.inprocess.max_restarts = failures + 1
    cfg.detector.interval_s, cfg.detector.timeout_s, cfg.detector.hang_timeout_s = 0.2, 2.0, 30.0
    inproc = InprocessRecovery.from_config(cfg)
    cuda = backend == "nccl"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    records: list[dict[str, Any]] = []
    raised: dict[int, float] = {}

    def train(att: Any) -> None:
        rec: dict[str, Any] = {"generation": att.iteration, "enter": time.time()}
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
                if att.iteration - 1 in raised:
                    rec["outage_s"] = rec["first_step_end"] - raised[att.iteration - 1]
            if step == FAIL_AT and att.iteration < failures:
                raised[att.iteration] = time.time()
                records.append(rec)
                raise RuntimeError(f"injected failure {att.iteration + 1} of {failures}")
        records.append(rec)
        dist.destroy_process_group()

    inproc.run(train)
    events = [e for e in inproc.events]
    out.write_text(json.dumps({"backend": backend, "device": str(device), "records": records, "events": events},
                              indent=1))
    return 0


def _summary(data: dict[str, Any]) -> dict[str, Any]:
    outages = [r["outage_s"] for r in data["records"] if "outage_s" in r]
    cuda = [r.get("cuda_allocated_before_build") for r in data["records"]]
    return {"backend": data["backend"], "device": data["device"], "generations": len(data["records"]),
            "outage_s": outages, "outage_median_s": statistics.median(outages) if outages else None,
            "cuda_allocated_before_build": cuda,
            "cuda_back_to_baseline": None if cuda[0] is None else all(c == cuda[0] for c in cuda)}


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
    from neighbor_ckpt.cli.launch import _free_port, inprocess_commands, run_inprocess

    tmp = Path(tempfile.mkdtemp(prefix="nckpt-generations-"))
    result = tmp / "result.json"
    program = [str(Path(__file__).resolve()), "--worker", str(result), "--failures", str(args.failures),
               "--backend", backend]
    port = _free_port()
    procs = inprocess_commands(program, active=1, spares=0, max_restarts=0, run_id=f"gen-{os.getpid()}",
                               store_port=port, store_root=tmp / "store", store_ready=tmp / "store.ready",
                               parent=os.getpid())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    t0 = time.time()
    rc = run_inprocess(procs, ready=tmp / "store.ready", env=env, timeout=600)
    if rc != 0 or not result.exists():
        print(f"the launch failed (status {rc}); logs above, files in {tmp}", file=sys.stderr)
        return 1
    summary = _summary(json.loads(result.read_text()))
    summary["wall_s"] = time.time() - t0
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
