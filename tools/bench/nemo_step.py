"""Step overhead under NeMo: the median step time of a NeMo 2 ``llm.pretrain`` run with neighbor checkpointing every
iteration, over the same run without it, and over the machine's floor.

The job is the NeMo recipe (``recipes/nemo_pretrain.py``, ``configs/gpt_tiny_cpu.yaml``) resized to the tiny GPT of
issue 16: 4 layers, hidden 256, sequence 128, micro-batch 4, gradient accumulation 2 (global batch 32 on 4 ranks),
distributed optimizer, 4 CPU ranks under torchrun. Each *launch* runs one variant:

``off``
    ``neighbor_ckpt.enabled: false``: plain NeMo;
``on``
    the recipe as a user runs it: the ``NeighborCheckpoint`` callback, a snapshot after every optimizer step, the
    ring to the next DP rank, the detector, the status line;
``floor``
    plain NeMo plus the data work no per-iteration neighbor checkpoint can avoid, and nothing else: after every
    step a background thread copies this rank's unique bytes (12 bytes per local parameter / DP: the fp32 main
    param shard and two Adam moments), hashes the copy with xxh3-64 and sends it to the next rank of the ring while
    receiving the previous rank's (one gloo group of its own); the next step's end waits for it (later than the
    neighbor engine's wait point, before the next gradient sync: the floor is the more lenient).

**Blocks in one launch** (``--mode blocks``, the default): one launch with the callback installed runs the variants
in blocks of ``--block-steps`` consecutive steps, interleaved round by round (``off on floor``, then rotated), so
drift in the machine's load hits all of them alike; in ``off`` and ``floor`` blocks ``snapshot()`` does nothing (the
callback's other per-step calls, a few microseconds, stay: they count as ``off``). The first step of every block is
not timed (the previous block's background work drains in it), nor are the first ``--warmup`` steps.
**Separate launches** (``--mode launches``): each variant is a launch of its own (``off``: ``neighbor_ckpt.enabled:
false``), alternating; on this 2-core machine two launches of the same variant differ by up to ~7% (a ``floor``
launch ran faster than an ``off`` one), so blocks are what the verdict should be read from.

A step's time is the interval between consecutive ends of ``on_train_batch_end`` (after NeighborCheckpoint's
snapshot), taken on the slowest rank. The verdict: median over the rounds of ``median(on) / median(off)`` (target
``<= 1.05``), beside ``median(floor) / median(off)``: when the floor alone is over the target on this machine
(four ranks on two shared cores: every byte copied, hashed or sent in the background takes CPU from a training
step), the row says how much of the floor's overhead ours is.

Run ``python -m tools.bench.nemo_step [--mode launches] [--json out.json]`` (``python -m tools.bench --nemo-step``)
from a source checkout (tools/ is not part of the installed package); with the defaults (8 rounds of 8-step blocks,
200 steps of ~1.5 s) about 6 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from neighbor_ckpt.recipes import CONFIGS_DIR

logger = logging.getLogger(__name__)

__all__ = ["VARIANTS", "SHAPE", "TARGET", "step_times", "block_variant", "block_rounds", "verdict", "main"]

VARIANTS = ("off", "on", "floor")
SHAPE = ("model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.num_attention_heads=4",
         "model.seq_length=128", "trainer.micro_batch_size=4", "trainer.global_batch_size=32",
         "parallelism.distributed_optimizer=true", "trainer.devices=4", "trainer.log_every_n_steps=10")
"""Overrides of ``configs/gpt_tiny_cpu.yaml``: issue 16's tiny GPT (4 ranks: gradient accumulation 32 / (4 x 4) =
2)."""
TARGET = 1.05
"""Median step time with neighbor checkpointing over without."""
UNIQUE_BYTES_PER_PARAM = 12
"""Distributed optimizer: fp32 main param + Adam's two moments, per parameter, sharded over DP."""


# -- pure: from per-rank step stamps to step times and the verdict -----------------------------------------------

def step_times(stamps: Sequence[Sequence[float]], warmup: int) -> list[float]:
    """Per-rank lists of step-end times (the same steps on every rank) -> the timed steps' durations, each the
    interval between consecutive step ends of the slowest rank; the first ``warmup`` steps are not timed."""
    if not stamps or any(len(s) != len(stamps[0]) for s in stamps):
        raise ValueError("every rank must report the same number of steps")
    ends = [max(s[i] for s in stamps) for i in range(len(stamps[0]))]
    return [b - a for a, b in zip(ends[max(0, warmup - 1):], ends[max(1, warmup):])]


def block_variant(step: int, *, warmup: int, block_steps: int, variants: Sequence[str]) -> tuple[str | None, int, bool]:
    """Pure: (variant, round, timed) of 0-based ``step`` in blocks mode; variant None during the warm-up. Round ``r``
    runs one block of each variant, in the order rotated by ``r``; a block's first step is not timed."""
    if step < warmup:
        return None, -1, False
    block, pos = divmod(step - warmup, block_steps)
    rnd, k = divmod(block, len(variants))
    return variants[(k + rnd) % len(variants)], rnd, pos > 0


@dataclass(frozen=True)
class Verdict:
    rounds: tuple[dict[str, float], ...]
    """Per round, each variant's median step time (s)."""
    on_ratio: float
    """Median over rounds of on / off."""
    floor_ratio: float | None
    """Median over rounds of floor / off (None without the floor variant)."""
    passed: bool

    @property
    def share_of_floor(self) -> float | None:
        """Our overhead over the floor's (1.0: ours costs exactly the unavoidable data work)."""
        if self.floor_ratio is None or self.floor_ratio <= 1.0:
            return None
        return (self.on_ratio - 1.0) / (self.floor_ratio - 1.0)

    def lines(self) -> list[str]:
        out = [f"round {i}: " + "  ".join(f"{v} {1e3 * t:.1f} ms" for v, t in r.items())
               for i, r in enumerate(self.rounds)]
        out.append(f"with neighbor_ckpt / without (median of rounds): {self.on_ratio:.3f}x  target <= {TARGET}: "
                   f"{'PASS' if self.passed else 'MISS'}")
        if self.floor_ratio is not None:
            out.append(f"floor (copy + xxh3 + ring transfer of the same bytes) / without: {self.floor_ratio:.3f}x")
            share = self.share_of_floor
            if share is not None:
                out.append(f"neighbor_ckpt's overhead = {share:.2f} x the floor's")
        return out


def verdict(rounds: Sequence[dict[str, Sequence[float]]]) -> Verdict:
    """Pure: per round, each variant's step times -> medians and the ratios."""
    meds = tuple({v: statistics.median(ts) for v, ts in r.items()} for r in rounds)
    on = statistics.median(m["on"] / m["off"] for m in meds)
    floor = statistics.median(m["floor"] / m["off"] for m in meds) if all("floor" in m for m in meds) else None
    return Verdict(meds, on, floor, on <= TARGET)


# -- the rank side: one launch of the recipe with a step clock (and the floor's work) ----------------------------

def _recipe_module() -> Any:
    import importlib.util

    from neighbor_ckpt.cli.launch import RECIPE

    spec = importlib.util.spec_from_file_location("nemo_pretrain_recipe", RECIPE)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


class _FloorWork:
    """Per step on a background thread: copy the rank's unique bytes, xxh3 them, send to the next rank while
    receiving the previous one's (a gloo group of its own)."""

    def __init__(self, nbytes: int) -> None:
        import torch
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        self.stage = torch.empty_like(self.src).fill_(0)
        self.recv = torch.empty_like(self.src).fill_(0)
        self.jobs: queue.Queue[bool] = queue.Queue()
        self.done = threading.Event()
        self.done.set()
        self.thread = threading.Thread(target=self._run, name="floor-work", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import torch.distributed as dist
        import xxhash

        while self.jobs.get():
            self.stage.copy_(self.src)
            xxhash.xxh3_64_intdigest(self.stage.numpy())
            ops = [dist.P2POp(dist.isend, self.stage, (self.rank + 1) % self.world, self.group),
                   dist.P2POp(dist.irecv, self.recv, (self.rank - 1) % self.world, self.group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            self.done.set()

    def step(self) -> None:
        self.done.wait()
        self.done.clear()
        self.jobs.put(True)

    def close(self) -> None:
        self.done.wait()
        self.jobs.put(False)
        self.thread.join()


def _callbacks(variant_of: Any, stamps: list[tuple[int, float]]) -> list[Any]:
    """``variant_of(step)``: the variant step ``step`` (0-based) runs. Returns the gate (first: it decides before
    NeighborCheckpoint's hooks run), the floor's work and the step clock (last: after the snapshot)."""
    import lightning.pytorch as pl

    from neighbor_ckpt import NeighborCheckpoint

    class Gate(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            cb = next((c for c in trainer.callbacks if isinstance(c, NeighborCheckpoint)), None)
            if cb is None or cb.checkpointer is None:
                return
            if variant_of(trainer.global_step) == "on":
                cb.checkpointer.__dict__.pop("snapshot", None)  # the method again
            else:
                cb.checkpointer.snapshot = lambda *a, **k: None

    class Floor(pl.Callback):
        work: _FloorWork | None = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            from megatron.core import parallel_state

            n = sum(p.numel() for p in pl_module.parameters())
            dp = parallel_state.get_data_parallel_world_size()
            self.work = _FloorWork(UNIQUE_BYTES_PER_PARAM * -(-n // dp))

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            if variant_of(trainer.global_step - 1) == "floor":
                self.work.step()  # type: ignore[union-attr]

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.work.close()  # type: ignore[union-attr]

    class StepClock(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            stamps.append((trainer.global_step - 1, time.time()))

    return [Gate(), Floor(), StepClock()]


def _worker(args: argparse.Namespace) -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(name)s %(levelname)s %(message)s")
    from neighbor_ckpt.planning.jobspec import load_job

    job = load_job(args.config)
    from megatron_patches import enable_cpu

    enable_cpu()
    import fiddle as fdl
    import torch

    torch.manual_seed(job.trainer.seed)
    fn = fdl.build(_recipe_module().build_recipe(job, args.run_dir, inject_faults=False))
    stamps: list[tuple[int, float]] = []
    if args.variant == "blocks":
        variants = args.variants.split(",")

        def variant_of(step: int) -> str | None:
            return block_variant(step, warmup=args.warmup, block_steps=args.block_steps, variants=variants)[0]
    else:
        def variant_of(step: int) -> str | None:
            return args.variant
    runs = set(variants) if args.variant == "blocks" else {args.variant}
    cbs = fn.keywords["trainer"].callbacks
    gate, floor, clock = _callbacks(variant_of, stamps)
    cbs.insert(0, gate)
    # the floor's thread, buffers and gloo group exist only where a floor step runs: an off launch is plain NeMo
    cbs.extend([floor, clock] if "floor" in runs else [clock])
    fn()
    (args.run_dir / f"steps.rank{rank}.json").write_text(json.dumps(stamps))


# -- the driver ------------------------------------------------------------------------------------------------

def _launch(variant: str, run_dir: Path, args: argparse.Namespace, steps: int) -> list[list[tuple[int, float]]]:
    """One torchrun launch of the recipe (``variant``: one of :data:`VARIANTS`, or ``blocks``); per rank, the
    (step, end time) stamps."""
    from neighbor_ckpt.cli.launch import plan_launch, torchrun_command, write_run_dir

    overrides = [*SHAPE, f"trainer.max_steps={steps}",
                 f"neighbor_ckpt.enabled={'false' if variant in ('off', 'floor') else 'true'}", "launch.max_restarts=0"]
    plan = plan_launch(args.config, overrides, run_dir=run_dir)
    write_run_dir(plan)
    cmd = torchrun_command(plan)
    i = cmd.index(str(plan.recipe))
    cmd[i:] = [str(Path(__file__).resolve()), "--worker", variant, "--config", str(run_dir / "config.yaml"),
               "--run-dir", str(run_dir), "--warmup", str(args.warmup), "--block-steps", str(args.block_steps),
               "--variants", args.variants]
    with open(run_dir / "torchrun.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"the {variant} launch failed (exit {rc}): see {run_dir / 'torchrun.log'}")
    return [[(int(s), float(t)) for s, t in json.loads((run_dir / f"steps.rank{r}.json").read_text())]
            for r in range(plan.job.world_size)]


def block_rounds(stamps: Sequence[Sequence[tuple[int, float]]], *, warmup: int, block_steps: int,
                 variants: Sequence[str]) -> list[dict[str, list[float]]]:
    """Pure: blocks mode's per-rank (step, end time) stamps -> per round, each variant's timed step durations
    (slowest rank's step ends; rounds missing a variant are dropped)."""
    ends: dict[int, float] = {}
    for rank in stamps:
        for step, t in rank:
            ends[step] = max(ends.get(step, t), t)
    rounds: dict[int, dict[str, list[float]]] = {}
    for step in sorted(ends):
        variant, rnd, timed = block_variant(step, warmup=warmup, block_steps=block_steps, variants=variants)
        if variant is None or not timed or step - 1 not in ends:
            continue
        rounds.setdefault(rnd, {}).setdefault(variant, []).append(ends[step] - ends[step - 1])
    return [r for _, r in sorted(rounds.items()) if set(r) == set(variants)]


def main(argv: Sequence[str] | None = None) -> int:
    from tools.bench.machine import cpu_sample, foreign_load, wait_until_quiet

    ap = argparse.ArgumentParser(prog="python -m tools.bench.nemo_step", description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIGS_DIR / "gpt_tiny_cpu.yaml",
                    help="the job file the shape overrides apply to")
    ap.add_argument("--mode", choices=("blocks", "launches"), default="blocks",
                    help="blocks: the variants interleaved in one launch (default); launches: one launch each")
    ap.add_argument("--rounds", type=int, default=8, help="rounds (one block, or one launch, of every variant each)")
    ap.add_argument("--block-steps", type=int, default=8, help="blocks mode: steps per block (the first untimed)")
    ap.add_argument("--steps", type=int, default=40, help="launches mode: timed steps per launch")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps at the start of a launch")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--work-dir", type=Path, default=Path("runs") / "bench-nemo-step")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="first wait up to S seconds until other processes use under 10%% of the CPUs")
    ap.add_argument("--json", type=Path, default=None, help="write the step times and the verdict here")
    ap.add_argument("--worker", choices=(*VARIANTS, "blocks"), default=None, dest="variant", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.variant is not None:
        _worker(args)
        return 0
    variants = [v for v in args.variants.split(",") if v]
    if "off" not in variants or "on" not in variants or not set(variants) <= set(VARIANTS):
        ap.error(f"--variants must name off and on (and may name floor), got {args.variants!r}")
    if args.block_steps < 2:
        ap.error("--block-steps must be at least 2 (a block's first step is not timed)")
    if args.wait_quiet:
        wait_until_quiet(args.wait_quiet, os.cpu_count() or 1)
    a = cpu_sample()
    if args.mode == "blocks":
        steps = args.warmup + args.rounds * len(variants) * args.block_steps
        stamps = _launch("blocks", args.work_dir / "blocks", args, steps)
        rounds = block_rounds(stamps, warmup=args.warmup, block_steps=args.block_steps, variants=variants)
    else:
        rounds = []
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            times: dict[str, list[float]] = {}
            for v in order:
                st = _launch(v, args.work_dir / f"round{r}-{v}", args, args.warmup + args.steps)
                times[v] = step_times([[t for _, t in rank] for rank in st], args.warmup)
                print(f"round {r} {v}: median step {1e3 * statistics.median(times[v]):.1f} ms "
                      f"({len(times[v])} steps)", flush=True)
            rounds.append({v: times[v] for v in variants})
    load = foreign_load(a, cpu_sample(), os.cpu_count() or 1)
    result = verdict(rounds)
    for line in result.lines():
        print(line)
    print(f"other processes used {100 * load['other_cpu_frac']:.0f}% of the CPUs during the run")
    if args.json is not None:
        args.json.write_text(json.dumps({"mode": args.mode, "shape": SHAPE, "warmup": args.warmup,
                                         "block_steps": args.block_steps, "steps": args.steps,
                                         "rounds": rounds, "medians": result.rounds, "on_ratio": result.on_ratio,
                                         "floor_ratio": result.floor_ratio, "share_of_floor": result.share_of_floor,
                                         "target": TARGET, "passed": result.passed, "foreign_load": load},
                                        indent=1))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
