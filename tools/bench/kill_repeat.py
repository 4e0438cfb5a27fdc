"""``python -m tools.bench --kill-repeat [--runs 20] [--config gpt_tiny_cpu] [--out DIR] [--results FILE]``: the
in-process kill of ``neighbor-ckpt demo`` (the tiny GPT recipe under NeMo, one hot spare, rank 1 SIGKILLed in step 5's
optimizer step, its store replaced) launched ``--runs`` times in a row after one failure-free launch, each compared
bit for bit with it (every rank's per-step losses and final weights and optimizer state).

A launch that does not finish, or that differs, counts as a failure; the tool goes on and says which. For each launch:
its MTTR measured from the kill (``fault.json``) to the end of the first step completed after it on the slowest rank,
and rank 0's recovery timeline (MTTR and detection from the fault as its witness saw it, ``detect_from``). A
benchmark, not a test: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from neighbor_ckpt.cli import launch
from neighbor_ckpt.cli.demo import demo_plans, measured_mttr, parse_args as demo_args


def identical(base: Path, run: Path, ranks: int) -> tuple[bool, str]:
    """Whether ``run``'s record (``<run-dir>/record``) trained exactly as ``base``'s: the last loss recorded at each
    step on every rank (``==`` of the hex floats), and the final fingerprints of weights and optimizer state."""
    for r in range(ranks):
        losses = []
        for rec in (base, run):
            p = rec / f"losses.rank{r}.jsonl"
            if not p.exists():
                return False, f"rank {r}: no losses recorded in {rec}"
            last: dict[int, str] = {}
            for line in p.read_text().splitlines():
                row = json.loads(line)
                last[row["step"]] = row["loss"]
            losses.append(last)
        if losses[0] != losses[1]:
            diff = sorted(s for s in losses[0].keys() | losses[1].keys() if losses[0].get(s) != losses[1].get(s))
            return False, f"rank {r}: losses differ at step(s) {diff}"
        finals = [rec / f"final.rank{r}.json" for rec in (base, run)]
        if not all(f.exists() for f in finals) or \
                json.loads(finals[0].read_text()) != json.loads(finals[1].read_text()):
            return False, f"rank {r}: final weights or optimizer state differ (or are missing)"
    return True, "bit-exact"


def timeline_of(run_dir: Path) -> dict[str, Any] | None:
    """Rank 0's first in-process recovery timeline of a launch (None when none was written)."""
    found = sorted(run_dir.rglob("recovery_timeline.attempt0.1.json"))
    return json.loads(found[0].read_text()) if found else None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench --kill-repeat", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--config", default=None, help="job file (default: the demo's, configs/gpt_tiny_cpu.yaml)")
    ap.add_argument("--out", type=Path, default=Path("runs") / time.strftime("kill-repeat-%Y%m%d-%H%M%S"))
    ap.add_argument("--results", type=Path, default=None, help="write every launch's figures here (JSON)")
    args = ap.parse_args(argv)
    demo = demo_args([*([] if args.config is None else ["--config", args.config]), "--out", str(args.out)])
    base = demo_plans(demo)["baseline"]
    ranks = base.job.world_size
    print(f"kill-repeat: failure-free launch ({base.run_dir})", flush=True)
    if launch.run_local(base, log=base.run_dir / "launch.log") != 0:
        raise SystemExit(f"kill-repeat: the failure-free launch failed: {base.run_dir / 'launch.log'}")
    rows: list[dict[str, Any]] = []
    for i in range(args.runs):
        demo.out = args.out / f"run{i:02d}"
        plan = demo_plans(demo)["inprocess"]
        t0 = time.time()
        rc = launch.run_local(plan, log=plan.run_dir / "launch.log")
        ok, why = (False, f"launch exit {rc}") if rc != 0 else identical(base.run_dir / "record",
                                                                         plan.run_dir / "record", ranks)
        tl = timeline_of(plan.run_dir)
        row = {"run": i, "exit": rc, "exact": ok, "why": why, "wall_s": round(time.time() - t0, 1),
               "mttr_from_kill_s": measured_mttr(plan.run_dir / "record"),
               "timeline_mttr_s": None if tl is None else tl["mttr_s"],
               "timeline_detect_s": None if tl is None else tl["phases_s"].get("detect"),
               "detect_from": None if tl is None else tl.get("detect_from"), "run_dir": str(plan.run_dir)}
        rows.append(row)
        print(f"run {i:2d}: {'bit-exact' if ok else 'FAILED: ' + why}; MTTR from the kill "
              f"{_fmt(row['mttr_from_kill_s'])}, timeline MTTR {_fmt(row['timeline_mttr_s'])} (detect "
              f"{_fmt(row['timeline_detect_s'])} from {row['detect_from']}); {row['wall_s']:.0f} s", flush=True)
    exact = sum(r["exact"] for r in rows)
    mttrs = [r["mttr_from_kill_s"] for r in rows if r["mttr_from_kill_s"] is not None]
    print(f"kill-repeat: {exact} of {len(rows)} launches finished bit-exact; MTTR from the kill: median "
          f"{_fmt(statistics.median(mttrs) if mttrs else None)}, max {_fmt(max(mttrs) if mttrs else None)}")
    if args.results is not None:
        args.results.write_text(json.dumps({"config": str(base.job.name), "runs": rows, "exact": exact}, indent=1))
    return 0 if exact == len(rows) else 1


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


if __name__ == "__main__":
    sys.exit(main())
