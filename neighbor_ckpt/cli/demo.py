"""``scripts/demo`` / ``neighbor-ckpt demo``: the tiny GPT recipe (NeMo 2, megatron-core distributed optimizer) on 4
CPU ranks, once without faults and once with rank 1 SIGKILLed inside an optimizer step and restarted on a
"replaced node" (empty host store); torchrun restarts the job and it continues bit-for-bit.

Prints the recovery report of every rank, the per-step loss comparison, and where the recovery timeline is.
Usage: ``neighbor-ckpt demo [--config configs/gpt_tiny_cpu.yaml] [--kill-rank 1] [--kill-step 5] [overrides]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from neighbor_ckpt.cli import launch

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpt_tiny_cpu.yaml"


def _run(plan: launch.LaunchPlan, what: str) -> None:
    print(f"demo: {what} (log: {plan.run_dir / 'torchrun.log'}) ...", flush=True)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    status = contextlib.nullcontext()
    if sys.stdout.isatty():
        try:
            from rich.console import Console

            status = Console().status(f"training on {plan.job.world_size} CPU ranks (about a minute per attempt)")
        except ImportError:
            pass
    with status:
        rc = launch.run_local(plan, log=plan.run_dir / "torchrun.log")
    if rc != 0:
        raise SystemExit(f"demo: torchrun failed (exit {rc}); see {plan.run_dir / 'torchrun.log'}")
    print(f"demo: done in {time.time() - t0:.0f} s", flush=True)


def _losses(record: Path) -> dict[int, dict[int, list[tuple[int, str]]]]:
    res: dict[int, dict[int, list[tuple[int, str]]]] = {}
    for p in record.glob("losses.rank*.jsonl"):
        rank = int(p.name.split(".")[1][4:])
        for line in p.read_text().splitlines():
            r = json.loads(line)
            res.setdefault(rank, {}).setdefault(r["step"], []).append((r["attempt"], r["loss"]))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--kill-step", type=int, default=5)
    ap.add_argument("--phase", default="optimizer", choices=["forward", "backward", "optimizer"])
    ap.add_argument("--out", type=Path, default=Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    ap.add_argument("overrides", nargs="*", help="key.path=value applied to both runs")
    args = ap.parse_args(argv)

    base = launch.plan_launch(args.config, args.overrides, run_dir=args.out / "baseline", record=True)
    fault_overrides = [*args.overrides, "neighbor_ckpt.fault_injection.enabled=true",
                       f"neighbor_ckpt.fault_injection.rank={args.kill_rank}",
                       f"neighbor_ckpt.fault_injection.step={args.kill_step}",
                       f"neighbor_ckpt.fault_injection.phase={args.phase}",
                       "neighbor_ckpt.fault_injection.replace_store=true"]
    fault = launch.plan_launch(args.config, fault_overrides, run_dir=args.out / "faulted", record=True)
    n, steps = base.job.world_size, base.job.trainer.max_steps
    _run(base, f"failure-free run: {base.job.name}, {n} CPU ranks, {steps} steps")
    _run(fault, f"same run, rank {args.kill_rank} SIGKILLed in the {args.phase} phase of step {args.kill_step} and "
                "restarted with an empty host store (a replaced node); torchrun restarts the job")

    rb, rf = base.run_dir / "record", fault.run_dir / "record"
    print("\nrecovery report (attempt 1):")
    for rank in range(n):
        p = rf / f"report.rank{rank}.attempt1.json"
        print(f"  rank {rank}: {json.loads(p.read_text())['summary'] if p.exists() else 'no recovery report'}")
    lb, lf = _losses(rb), _losses(rf)
    print(f"\n{'step':>4} | {'failure-free loss':>20} | {'with kill + recovery':>20} | equal")
    same = True
    for step in sorted(lb.get(0, {})):
        a = lb[0][step][-1][1]
        recs = lf.get(0, {}).get(step, [])
        eq = bool(recs) and all(lf[r].get(step, [(0, None)])[-1][1] == lb[r][step][-1][1] for r in lb) \
            and all(loss == a for _, loss in recs)
        same &= eq
        again = "  (recomputed after the restart)" if len({att for att, _ in recs}) > 1 else ""
        b = recs[-1][1] if recs else None
        print(f"{step:>4} | {float.fromhex(a):>20.10f} | "
              f"{float.fromhex(b) if b else float('nan'):>20.10f} | {'yes' if eq else 'NO'}{again}")
    finals = all(json.loads((rb / f"final.rank{r}.json").read_text())
                 == json.loads((rf / f"final.rank{r}.json").read_text()) for r in range(n))
    print(f"\nfinal weights and optimizer state identical on every rank: {'yes' if finals else 'NO'}")
    timelines = sorted((fault.run_dir).rglob("recovery_timeline*.png"))
    if timelines:
        for t in timelines:
            print(f"recovery timeline: {t}")
    else:
        print("recovery timeline: none written (see the log)")
    ok = same and finals
    print("\ndemo: the run with a kill and a recovery is bit-identical to the failure-free run" if ok else
          "\ndemo: MISMATCH between the runs")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
