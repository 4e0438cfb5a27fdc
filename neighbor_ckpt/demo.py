"""``scripts/demo``: 4 CPU ranks train with NeighborCheckpoint, one is SIGKILLed mid-step and its host store is
replaced by an empty one (a node loss), torchrun restarts the job, and the run continues bit-for-bit.

Runs the recipe twice (failure-free, then with the fault) and prints the recovery report and the per-step
loss comparison. Usage: ``python -m neighbor_ckpt.demo [--steps 12] [--kill-rank 2] [--kill-step 7]``.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "lightning_ddp_demo.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, extra: list[str], restarts: int, nproc: int) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_port()}", "--monitor-interval=0.5", str(RECIPE),
           "--out", str(out), *extra]
    t0 = time.time()
    with open(out.with_suffix(".log"), "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"demo: torchrun failed (exit {rc}); see {out.with_suffix('.log')}")
    return time.time() - t0


def _losses(out: Path) -> dict[int, dict[int, list[tuple[int, str, float]]]]:
    res: dict[int, dict[int, list[tuple[int, str, float]]]] = {}
    for p in out.glob("losses.rank*.jsonl"):
        rank = int(p.name.split(".")[1][4:])
        for line in p.read_text().splitlines():
            r = json.loads(line)
            res.setdefault(rank, {}).setdefault(r["step"], []).append((r["attempt"], r["loss"], r["time"]))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-rank", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=7)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    args = ap.parse_args(argv)
    base, fault = args.out / "baseline", args.out / "faulted"
    for d in (base, fault):
        d.mkdir(parents=True, exist_ok=True)
    print(f"demo: failure-free run on {args.nproc} CPU ranks ({args.steps} steps) ...", flush=True)
    t_base = _torchrun(base, ["--steps", str(args.steps)], 0, args.nproc)
    print(f"demo: same run, rank {args.kill_rank} SIGKILLed in step {args.kill_step}, its store replaced "
          "(node loss); torchrun restarts the job ...", flush=True)
    t_fault = _torchrun(fault, ["--steps", str(args.steps), "--kill", f"{args.kill_rank}:{args.kill_step}",
                                "--replace-store", str(args.kill_rank)], 1, args.nproc)

    lb, lf = _losses(base), _losses(fault)
    print("\nrecovery report (attempt 1):")
    for rank in range(args.nproc):
        rep = json.loads((fault / f"recovery.rank{rank}.attempt1.json").read_text())
        print(f"  rank {rank}: {rep['summary']}")
    print(f"\n{'step':>4} | {'failure-free loss':>20} | {'with kill + recovery':>20} | equal")
    same = True
    for step in sorted(lb[0]):
        a = lb[0][step][-1][1]
        recs = lf[0][step]
        b = recs[-1][1]
        eq = all(r[1] == a for r in recs) and all(lf[r][step][-1][1] == lb[r][step][-1][1] for r in lb)
        same &= eq
        tag = "  (recomputed after restart)" if len(recs) > 1 or recs[-1][0] > 0 and step == args.kill_step else ""
        print(f"{step:>4} | {float.fromhex(a):>20.10f} | {float.fromhex(b):>20.10f} | {'yes' if eq else 'NO'}{tag}")
    finals = [json.loads((d / f"final.rank{r}.json").read_text()) for d in (base, fault) for r in range(args.nproc)]
    same_params = finals[:args.nproc] == finals[args.nproc:]
    kill_t = max(r[2] for r in lf[args.kill_rank][args.kill_step] if r[0] == 0) if any(
        r[0] == 0 for r in lf[args.kill_rank].get(args.kill_step, [])) else None
    resume_t = min(r[2] for s in lf[0].values() for r in s if r[0] == 1)
    print(f"\nevery per-step loss identical on all ranks: {same}; final parameters identical: {same_params}")
    if kill_t is not None:
        print(f"kill -> first step after recovery: {resume_t - kill_t:.1f} s (process restart and imports dominate on CPU)")
    print(f"wall time: failure-free {t_base:.0f} s, with failure {t_fault:.0f} s; logs and results in {args.out}")
    return 0 if same and same_params else 1


if __name__ == "__main__":
    raise SystemExit(main())
