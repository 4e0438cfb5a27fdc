"""``scripts/demo`` / ``neighbor-ckpt demo``: the tiny GPT recipe (NeMo 2, megatron-core distributed optimizer) on 4
CPU ranks, once without faults, then with rank 1 SIGKILLed inside an optimizer step twice: recovered in process
(``neighbor_ckpt.inprocess``, one hot spare: the survivors keep their processes, the spare takes the killed rank's
place and pulls its state from the ring successor), and by the restart path (torchrun restarts the job on a
"replaced node", an empty host store). Both continue bit-for-bit.

Prints the recovery reports, the per-step loss comparison and both MTTRs side by side, each measured the same way:
from the kill to the end of the first training step completed after it (the slowest rank), read from the
``--record`` files. ``--restart-only`` runs the restart path alone (the short form).
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
from neighbor_ckpt.recipes import CONFIGS_DIR

CONFIG = CONFIGS_DIR / "gpt_tiny_cpu.yaml"


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
        raise SystemExit(f"demo: the launch failed (exit {rc}); see {plan.run_dir / 'torchrun.log'}")
    print(f"demo: done in {time.time() - t0:.0f} s", flush=True)


def measured_mttr(record: Path) -> float | None:
    """Kill (``fault.json``) to the end of the first step completed after it on the slowest rank (the loss records
    of the attempts after the first); None when either is missing."""
    fault = record / "fault.json"
    if not fault.exists():
        return None
    t0 = json.loads(fault.read_text())["unix"]
    firsts = []
    for p in record.glob("losses.rank*.jsonl"):
        after = [r["unix"] for r in map(json.loads, p.read_text().splitlines()) if r.get("attempt", 0) >= 1
                 and r.get("unix", 0) > t0]
        if after:
            firsts.append(min(after))
    return max(firsts) - t0 if firsts else None


INPROCESS_PHASES = ("abort_end", "finalize_end", "initialize", "enter", "built", "pg_ready", "recovered",
                    "first_step_end")
"""In-process recovery events, in order (``events.initial<i>.json`` of the recipe's ``--record``): the survivors'
abort and clean-up of the failed attempt, the engine's barrier and rank assignment (``initialize``), then the new attempt's
entry, trainer built, process group, neighbor_ckpt restore, first completed step."""


def inprocess_phases(record: Path) -> dict[str, float]:
    """For each event of :data:`INPROCESS_PHASES`: seconds from the kill to the latest process reaching it (the
    failed attempt's abort and clean-up; the first in-process restart's other events)."""
    t0 = json.loads((record / "fault.json").read_text())["unix"]
    events = [e for p in record.glob("events.initial*.json") if ".launch" not in p.name
              for e in json.loads(p.read_text())["events"]]
    marks: dict[str, float] = {}
    for name in INPROCESS_PHASES:
        it = 0 if name in ("abort_end", "finalize_end") else 1
        ts = [e["unix"] for e in events if e["name"] == name and e["iteration"] == it and e["unix"] >= t0]
        if ts:
            marks[name] = max(ts) - t0
    return marks


def format_phases(marks: dict[str, float]) -> str:
    """``abort_end +0.11s, finalize_end +0.05s, ...``: each phase's duration after the previous known one."""
    prev, parts = 0.0, []
    for name in INPROCESS_PHASES:
        if name in marks:
            parts.append(f"{name} +{marks[name] - prev:.2f}s")
            prev = marks[name]
    return ", ".join(parts)


def survivors(record: Path) -> dict[int, list[dict]]:
    """Initial rank -> its attempts (``attempt.initial<i>.iter<k>.json``: pid, rank, iteration), first launch."""
    by: dict[int, list[dict]] = {}
    for p in sorted(record.glob("attempt.initial*.iter*.json")):
        if ".launch" not in p.name:
            a = json.loads(p.read_text())
            by.setdefault(a["initial_rank"], []).append(a)
    return {k: sorted(v, key=lambda a: a["iteration"]) for k, v in by.items()}


def _losses(record: Path) -> dict[int, dict[int, list[tuple[int, str]]]]:
    res: dict[int, dict[int, list[tuple[int, str]]]] = {}
    for p in record.glob("losses.rank*.jsonl"):
        rank = int(p.name.split(".")[1][4:])
        for line in p.read_text().splitlines():
            r = json.loads(line)
            res.setdefault(rank, {}).setdefault(r["step"], []).append((r["attempt"], r["loss"]))
    return res


def _compare(base: launch.LaunchPlan, fault: launch.LaunchPlan, n: int) -> bool:
    """Print the recovery reports and the per-step comparison of ``fault`` with ``base``; True when identical."""
    rb, rf = base.run_dir / "record", fault.run_dir / "record"
    print(f"\nrecovery report (attempt 1): {fault.run_dir.name} run")
    for rank in range(n):
        p = rf / f"report.rank{rank}.attempt1.json"
        print(f"  rank {rank}: {json.loads(p.read_text())['summary'] if p.exists() else 'no recovery report'}")
    lb, lf = _losses(rb), _losses(rf)
    print(f"\n{'step':>4} | {'failure-free loss':>20} | {'with kill + recovery':>20} | equal")
    same = True
    for step in sorted(lb.get(0, {})):
        a = lb[0][step][-1][1]
        recs = lf.get(0, {}).get(step, [])
        eq = bool(recs) and all(lf.get(r, {}).get(step, [(0, None)])[-1][1] == lb[r][step][-1][1] for r in lb) \
            and all(loss == a for _, loss in recs)
        same &= eq
        again = "  (recomputed after the restart)" if len({att for att, _ in recs}) > 1 else ""
        b = recs[-1][1] if recs else None
        print(f"{step:>4} | {float.fromhex(a):>20.10f} | "
              f"{float.fromhex(b) if b else float('nan'):>20.10f} | {'yes' if eq else 'NO'}{again}")
    finals = all((rf / f"final.rank{r}.json").exists() and json.loads((rb / f"final.rank{r}.json").read_text())
                 == json.loads((rf / f"final.rank{r}.json").read_text()) for r in range(n))
    print(f"\nfinal weights and optimizer state identical on every rank: {'yes' if finals else 'NO'}")
    timelines = sorted(fault.run_dir.rglob("recovery_timeline*.png"))
    if timelines:
        for t in timelines:
            print(f"recovery timeline: {t}")
    else:
        print("recovery timeline: none written (see the log)")
    return same and finals


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="neighbor-ckpt demo", description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--kill-step", type=int, default=5)
    ap.add_argument("--phase", default="optimizer", choices=["forward", "backward", "optimizer"])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--restart-only", action="store_true",
                      help="the restart path alone (no in-process run)")
    mode.add_argument("--inprocess", action="store_true",
                      help="(the default) the in-process run with a hot spare beside the restart path")
    ap.add_argument("--spares", type=int, default=1, help="hot spares of the in-process run (default 1)")
    ap.add_argument("--out", type=Path, default=Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    ap.add_argument("overrides", nargs="*", help="key.path=value applied to every run")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plans = demo_plans(args)
    base, fault = plans["baseline"], plans["faulted"]
    n, steps = base.job.world_size, base.job.trainer.max_steps
    kill = f"rank {args.kill_rank} SIGKILLed in the {args.phase} phase of step {args.kill_step}"
    _run(base, f"failure-free run: {base.job.name}, {n} CPU ranks, {steps} steps")
    inproc = plans.get("inprocess")
    ok_ip = True
    if inproc is not None:
        _run(inproc, f"same run, {kill}, recovered in process: {launch.describe(inproc)}")
        ok_ip = _compare(base, inproc, n)
        rec = inproc.run_dir / "record"
        by = survivors(rec)
        kept = [i for i, atts in by.items() if len(atts) > 1 and len({a["pid"] for a in atts}) == 1]
        spare = [(i, a["rank"]) for i, atts in by.items() if i >= n for a in atts]
        print(f"\nin process: ranks {sorted(kept)} kept their processes (same PIDs); "
              + (", ".join(f"the spare started as rank {i} became rank {r}" for i, r in spare) or "no spare used"))
        if (rec / "fault.json").exists():
            print(f"in-process phases after the kill: {format_phases(inprocess_phases(rec))}")
    _run(fault, f"same run, {kill} and restarted with an empty host store (a replaced node); torchrun restarts the "
                "job")
    ok = _compare(base, fault, n)
    if inproc is not None:
        m_restart, m_ip = measured_mttr(fault.run_dir / "record"), measured_mttr(inproc.run_dir / "record")
        print(f"\n{'MTTR (kill -> first completed step)':<38} | {'in-process':>12} | {'restart path':>12}")
        print(f"{'':<38} | {_fmt(m_ip):>12} | {_fmt(m_restart):>12}")
        print(f"{'bit-identical to the failure-free run':<38} | {'yes' if ok_ip else 'NO':>12} | "
              f"{'yes' if ok else 'NO':>12}")
        ok = ok and ok_ip
    print("\ndemo: the run with a kill and a recovery is bit-identical to the failure-free run" if ok else
          "\ndemo: MISMATCH between the runs")
    return 0 if ok else 1


def demo_plans(args: argparse.Namespace) -> dict[str, launch.LaunchPlan]:
    """The launches of the demo (nothing runs): ``baseline``, ``faulted`` and, unless ``--restart-only``,
    ``inprocess``."""
    fault_overrides = [*args.overrides, "neighbor_ckpt.fault_injection.enabled=true",
                       f"neighbor_ckpt.fault_injection.rank={args.kill_rank}",
                       f"neighbor_ckpt.fault_injection.step={args.kill_step}",
                       f"neighbor_ckpt.fault_injection.phase={args.phase}",
                       "neighbor_ckpt.fault_injection.replace_store=true"]
    plans = {"baseline": launch.plan_launch(args.config, args.overrides, run_dir=args.out / "baseline", record=True),
             "faulted": launch.plan_launch(args.config, fault_overrides, run_dir=args.out / "faulted", record=True)}
    if not args.restart_only:
        plans["inprocess"] = launch.plan_launch(
            args.config, [*fault_overrides, "neighbor_ckpt.inprocess.enabled=true",
                          f"neighbor_ckpt.inprocess.spares={args.spares}"], run_dir=args.out / "inprocess", record=True)
    return plans


if __name__ == "__main__":
    raise SystemExit(main())
