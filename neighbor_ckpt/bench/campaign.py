"""``neighbor-ckpt campaign``: randomized faults against the tiny mcore GPT recipe on 4 CPU ranks, and a table.

Every case is one real ``torchrun --max-restarts 1`` job of ``recipes/mcore_gpt_plain_loop.py`` (megatron-core
``GPTModel``, distributed or replicated optimizer) with one fault: a SIGKILL or a SIGSTOP (hang) of a random rank
in the forward pass or inside the optimizer step of a random step, optionally followed on the restart by an
empty host store for that rank (a replaced node) or a damaged newest snapshot (bit flip, truncation, malformed
header). Its per-step losses and final parameters / optimizer state are compared (``==``) with a failure-free
run of the same configuration.

Outcomes: ``exact`` (the job finished and every loss, recomputed ones included, and the final state equal the
failure-free run), ``fallback`` (the job said it fell back to the insurance checkpoint, a megatron-core distributed
checkpoint every ``--insurance-every`` steps, and finished every step), ``FAILED``
(anything else: divergence, a crash, a hang past the deadline). For hangs the table also gives the detection
time: from the moment the victim stopped (``fault.json``) to the first rank's detection log line.

Cases are drawn from ``random.Random(seed)``: the seed reproduces the campaign. Usage::

    neighbor-ckpt campaign --faults 200 --seed 7 --out runs/campaign
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Case", "Outcome", "KINDS", "draw_cases", "run_case", "summarize", "main"]

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "mcore_gpt_plain_loop.py"

KINDS = ("kill-forward", "kill-optimizer", "hang-forward", "hang-optimizer", "kill-replaced-store",
         "kill-bitflip", "kill-truncate", "kill-bad-header", "lose-adjacent-pair", "lose-all-stores")
"""Fault kinds: signal + phase, and what the victims find in their host stores on the restart. The two ``lose-``
kinds leave no complete in-memory version (a rank and its ring successor, or every rank, restart with empty
stores): the expected outcome is the announced fallback to the insurance checkpoint."""

_DETECTED_RE = re.compile(r"detected a failure \((\w+)\) at unix ([0-9.]+)")
_MTTR_RE = re.compile(r"recovery MTTR ([0-9.]+) s")


@dataclass(frozen=True)
class Case:
    """One fault (pure description; :func:`run_case` executes it)."""

    index: int
    kind: str
    rank: int
    step: int
    dist_opt: bool

    @property
    def signal(self) -> str:
        return "SIGSTOP" if self.kind.startswith("hang") else "SIGKILL"

    @property
    def phase(self) -> str:
        return "forward" if self.kind.endswith("forward") else "optimizer"

    @property
    def damage(self) -> str | None:
        return {"kill-bitflip": "bitflip", "kill-truncate": "truncate", "kill-bad-header": "header"}.get(self.kind)

    @property
    def victims(self) -> tuple[int, ...]:
        if self.kind == "lose-adjacent-pair":
            return tuple(sorted({self.rank, (self.rank + 1) % 4}))
        if self.kind == "lose-all-stores":
            return (0, 1, 2, 3)
        return (self.rank,)

    @property
    def needs_insurance(self) -> bool:
        """Only the insurance checkpoint can cover it: stores lost on both ends of a ring edge, or the replicated
        optimizer stopped inside its step (the survivors finish the step the victim never snapshotted)."""
        return self.kind.startswith("lose-") or (not self.dist_opt and self.phase == "optimizer")

    def recipe_args(self) -> list[str]:
        args = ["--kill", f"{','.join(map(str, self.victims))}:{self.step}", "--kill-phase", self.phase,
                "--kill-signal", self.signal]
        if self.kind in ("kill-replaced-store", "lose-adjacent-pair", "lose-all-stores"):
            args.append("--replace-store")
        if self.damage:
            args += ["--damage", self.damage]
        return args if self.dist_opt else [*args, "--no-dist-opt"]


@dataclass(frozen=True)
class Outcome:
    case: Case
    result: str
    """``exact``, ``fallback`` or ``FAILED``."""
    detail: str = ""
    detection_s: float | None = None
    mttr_s: float | None = None
    wall_s: float = 0.0


def draw_cases(n: int, seed: int, *, steps: int, world: int = 4, kinds: Sequence[str] = KINDS) -> list[Case]:
    """``n`` cases from ``seed``: every kind in turn (so any prefix covers the kinds evenly), random rank, step
    (1 .. steps-2: a snapshot exists before and a step remains after; at least 2 for the cases only insurance can
    cover, so the insurance checkpoint of step 1 exists) and optimizer flavour."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        kind, rank, step = kinds[i % len(kinds)], rng.randrange(world), rng.randrange(1, steps - 1)
        case = Case(index=i, kind=kind, rank=rank, step=step, dist_opt=rng.random() < 0.75)
        if case.needs_insurance:
            case = dataclasses.replace(case, step=max(step, 2))
        cases.append(case)
    return cases


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, args: list[str], *, job_id: str, store: Path, config: Path, steps: int, timeout: float,
              max_restarts: int, insurance_every: int = 0) -> tuple[int, str]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", f"--max-restarts={max_restarts}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--monitor-interval=0.5", str(RECIPE),
           "--steps", str(steps), "--out", str(out), "--job-id", job_id, "--config", str(config),
           "--insurance-every", str(insurance_every), *args]
    env = dict(os.environ, NEIGHBOR_CKPT_STORE_DIR=str(store), PYTHONUNBUFFERED="1")
    log = out / "torchrun.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -999
    # A SIGSTOPped victim that nobody killed would outlive torchrun: never leave one behind.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return rc, log.read_text(errors="replace")


def _losses(out: Path) -> dict[int, dict[int, list[str]]]:
    per_rank: dict[int, dict[int, list[str]]] = {}
    for path in out.glob("losses.rank*.jsonl"):
        rank = int(path.name.split(".")[1][4:])
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            per_rank.setdefault(rank, {}).setdefault(rec["step"], []).append(rec["loss"])
    return per_rank


def _finals(out: Path) -> dict[int, Any]:
    return {int(p.name.split(".")[1][4:]): json.loads(p.read_text()) for p in out.glob("final.rank*.json")}


def compare(base: Path, run: Path, *, steps_only: bool = False) -> str:
    """'' when ``run`` trained exactly what ``base`` did (every loss, recomputations included, and finals);
    ``steps_only``: only that every rank trained every step."""
    b, r = _losses(base), _losses(run)
    if sorted(b) != sorted(r):
        return f"ranks {sorted(r)} != {sorted(b)}"
    for rank in b:
        if sorted(b[rank]) != sorted(r[rank]):
            return f"rank {rank} trained steps {sorted(r[rank])}, expected {sorted(b[rank])}"
    if steps_only:
        return ""
    for rank in b:
        for step, losses in r[rank].items():
            if any(x != b[rank][step][-1] for x in losses):
                return f"rank {rank} step {step}: loss {losses} != {b[rank][step][-1]}"
    if _finals(base) != _finals(run):
        return "final parameters or optimizer state differ"
    return ""


def run_case(case: Case, *, base: Path, work: Path, steps: int, config: Path, timeout: float = 420,
             insurance_every: int = 0) -> Outcome:
    out = work / f"case{case.index:04d}-{case.kind}-r{case.rank}-s{case.step}"
    t0 = time.time()
    rc, log = _torchrun(out, case.recipe_args(), job_id=f"campaign-{case.index}", store=work / "store",
                        config=config, steps=steps, timeout=timeout, max_restarts=1, insurance_every=insurance_every)
    wall = time.time() - t0
    detected = [float(m.group(2)) for m in _DETECTED_RE.finditer(log) if m.group(1) != "sigterm"]
    detection = None
    if case.signal == "SIGSTOP" and detected and (out / "fault.json").exists():
        detection = min(detected) - json.loads((out / "fault.json").read_text())["unix"]
    mttr = [float(m.group(1)) for m in _MTTR_RE.finditer(log)]
    common = dict(detection_s=detection, mttr_s=mttr[0] if mttr else None, wall_s=wall)
    if not (out / "fault.json").exists():
        return Outcome(case, "FAILED", "the fault never fired", **common)
    if rc != 0:
        tail = " | ".join(log.strip().splitlines()[-3:])[-300:]
        return Outcome(case, "FAILED", f"exit {rc}: {tail}", **common)
    if "falling back to the insurance checkpoint" in log:
        missing = compare(base, out, steps_only=True)
        if missing:
            return Outcome(case, "FAILED", f"fell back to insurance but did not finish training: {missing}", **common)
        return Outcome(case, "fallback", "announced fallback to insurance", **common)
    diff = compare(base, out)
    return Outcome(case, "FAILED" if diff else "exact", diff, **common)


def summarize(outcomes: Sequence[Outcome]) -> str:
    """The campaign table (markdown): per kind, counts of each outcome and the detection times of hangs."""
    lines = ["| fault | cases | exact | fallback | FAILED | detection s (median / max) | MTTR s (median) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for kind in [k for k in KINDS if any(o.case.kind == k for o in outcomes)] + ["all"]:
        rows = [o for o in outcomes if kind in ("all", o.case.kind)]
        det = [o.detection_s for o in rows if o.detection_s is not None]
        mttr = [o.mttr_s for o in rows if o.mttr_s is not None]
        count = {r: sum(o.result == r for o in rows) for r in ("exact", "fallback", "FAILED")}
        lines.append(f"| {kind} | {len(rows)} | {count['exact']} | {count['fallback']} | {count['FAILED']} | "
                     + (f"{statistics.median(det):.2f} / {max(det):.2f}" if det else "-") + " | "
                     + (f"{statistics.median(mttr):.1f}" if mttr else "-") + " |")
    return "\n".join(lines)


def write_config(path: Path, *, interval_s: float, timeout_s: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"neighbor_ckpt:\n  detector:\n    interval_s: {interval_s}\n    timeout_s: {timeout_s}\n"
                    "  store:\n    cleanup_on_success: true\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="neighbor-ckpt campaign", description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=24, help="number of randomized faults")
    ap.add_argument("--seed", type=int, default=7, help="reproduces the campaign")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {', '.join(KINDS)}")
    ap.add_argument("--detector-timeout", type=float, default=3.0, help="detector.timeout_s (the bound)")
    ap.add_argument("--detector-interval", type=float, default=0.5, help="detector.interval_s")
    ap.add_argument("--insurance-every", type=int, default=2,
                    help="megatron-core distributed checkpoint every N steps in every run (the insurance)")
    ap.add_argument("--out", type=Path, default=Path("runs/campaign"))
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    work = args.out
    config = write_config(work / "nckpt.yaml", interval_s=args.detector_interval, timeout_s=args.detector_timeout)
    cases = draw_cases(args.faults, args.seed, steps=args.steps, kinds=kinds)
    bases: dict[bool, Path] = {}
    for flavour in sorted({c.dist_opt for c in cases}, reverse=True):
        out = work / f"baseline-{'distopt' if flavour else 'replicated'}"
        rc, log = _torchrun(out, [] if flavour else ["--no-dist-opt"], job_id=f"campaign-base-{int(flavour)}",
                            store=work / "store", config=config, steps=args.steps, timeout=420, max_restarts=0,
                            insurance_every=args.insurance_every)
        if rc != 0:
            print(f"campaign: the failure-free run failed (exit {rc}); see {out / 'torchrun.log'}", file=sys.stderr)
            return 1
        bases[flavour] = out
    outcomes: list[Outcome] = []
    results = work / "outcomes.jsonl"
    results.unlink(missing_ok=True)
    for case in cases:
        o = run_case(case, base=bases[case.dist_opt], work=work, steps=args.steps, config=config,
                     insurance_every=args.insurance_every)
        outcomes.append(o)
        with open(results, "a") as f:
            f.write(json.dumps(asdict(o)) + "\n")
        print(f"[{case.index + 1}/{len(cases)}] {case.kind:20s} rank {case.rank} step {case.step} "
              f"{'distopt' if case.dist_opt else 'replicated':10s} -> {o.result} "
              + (f"(detected in {o.detection_s:.2f} s) " if o.detection_s is not None else "")
              + f"{o.wall_s:.0f} s {o.detail}", flush=True)
    print(f"\nseed {args.seed}, {len(cases)} faults, detector timeout {args.detector_timeout:g} s / interval "
          f"{args.detector_interval:g} s\n")
    print(summarize(outcomes))
    (work / "table.md").write_text(summarize(outcomes) + "\n")
    return 0 if all(o.result != "FAILED" for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
