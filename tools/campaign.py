"""``python -m tools.campaign`` (``scripts/campaign``): randomized faults against the tiny mcore GPT recipe on 4 CPU ranks, and a table.

Every case is one real ``torchrun`` job (``--max-restarts 1``, 2 for a kill during recovery) of
``recipes/mcore_gpt_plain_loop.py`` (megatron-core ``GPTModel``, distributed or replicated optimizer, TP 1 or 2, 4
ranks laid out as 2 "nodes") with one fault (see :data:`KIND_SPECS`): a SIGKILL or SIGSTOP (hang) of a random rank
in the forward pass, the backward pass, the optimizer step, the middle of its snapshot copy or the middle of
streaming it to the ring successor; a second SIGKILL while the restarted job loads the restored state; one rank, the
two ranks of a node, a rank and its ring successor, a whole DP group or every rank restarting with an empty host store;
a random bit flip, a truncation or a malformed header in the victim's newest snapshot. Its per-step losses and final
parameters / optimizer state are compared (``==``) with a failure-free run of the same configuration.

The in-process kinds (``inproc-kill``: SIGKILL of a rank in its optimizer step; ``inproc-hang``: SIGSTOP there, our
detector finds it silent and its launcher kills it) run the recipe in its in-process mode instead: 4 active ranks + 1
hot spare, the store host and one of our launchers (:mod:`neighbor_ckpt.inprocess.launcher`) per simulated node (the
commands of ``neighbor-ckpt launch``, :func:`neighbor_ckpt.cli.launch.inprocess_commands`); the spare takes the
victim's place, no process restarts. ``inproc-two-faults``: two SIGKILLs in one launch, the second on a rank of the
generation that recovered from the first, after it completed a step (two spares; the faults planned in the case's
``fault_injection.faults``). ``inproc-shrink``: no spare, the victim's node lost for good, ``elastic.enabled``: the job
goes on at a smaller data-parallel size on the same global batch. ``data-misplaced`` (restart path): the restarted
attempt reads other samples than before the failure; the data check must stop it at the replayed step, announced.
``inproc-stuck``: one rank's training thread blocked in a C call while its heartbeat goes on (only the progress tags
show it). ``inproc-store-node``: node 0 (its launcher, the primary store host it runs and rank 0) SIGKILLed;
``inproc-store-stop``: the primary store host SIGSTOPped for good: the job fails over to node 1's standby store
(``fault_injection.target: store_node``). ``inproc-spare-lost``: the hot spare SIGKILLed while idle (reported, the
job goes on). ``inproc-grow-back``: two faults with one spare and ``inprocess.grow_back``: the replacement the first
victim's launcher starts takes the second lost rank.
Distributed optimizer, TP 1: compared with the same failure-free run as the restart-path cases of that configuration
(in-process recovery changes no arithmetic; a shrink's failure-free run has dropout off and the global batch fixed).

Outcomes: ``exact`` (the job finished and every loss, recomputed ones included, and the final state equal the
failure-free run), ``fallback`` (the job said it fell back to the insurance checkpoint, a megatron-core distributed
checkpoint every ``--insurance-every`` steps, and trained bit for bit what it should: the first launch attempt's
losses those of the failure-free run, every step after the insurance iteration and the final state those of the
failure-free run resumed from the same insurance checkpoint, :func:`resume_baseline`), ``resized`` (a shrink: the
steps before the fault exact, the later ones within 1e-4 and on the same samples, :func:`compare_resized`),
``stopped`` (the data check stopped a restart on misplaced data at the replayed step: the expected loud stop),
``FAILED``
(anything else: divergence, a crash, a hang past the deadline). For hangs the table also gives the detection
time: from the moment the victim stopped (``fault.json``) to the first rank's detection log line. An in-process case
whose recovery gave up (announced) and that the restart path then recovered exactly is a ``fallback`` too; its MTTR
is the recovery timeline's (fault to the first completed step).

Cases are drawn from ``random.Random(seed)``: the seed reproduces the campaign. Usage::

    python -m tools.campaign --faults 200 --seed 7 --out runs/campaign
    python -m tools.campaign --faults 200 --seed 7 --out runs/campaign --resume   # after a stop: the cases left

``<out>/campaign.json`` records the options and the commit (``git describe --dirty``); ``--resume`` refuses to mix
outcomes of another commit or other options into one table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from neighbor_ckpt.cli.launch import worker_program
from neighbor_ckpt.recipes import RECIPES_DIR
from neighbor_ckpt.runtime.procs import RUN_TAG_ENV, kill_tagged, new_run_tag
from neighbor_ckpt.snapshot.store import rank_dir

__all__ = ["Case", "Outcome", "KINDS", "draw_cases", "load_outcomes", "resume_point", "run_case", "summarize", "main"]

RECIPE = RECIPES_DIR / "mcore_gpt_plain_loop.py"
"""The recipe every case runs (the package's, ``recipes/`` in the checkout)."""
CHECKOUT = Path(__file__).resolve().parents[1]
"""The source checkout this tool runs from (its commit is recorded)."""

WORLD, NODES = 4, 2
"""Every case: 4 ranks laid out as 2 "nodes" of 2 consecutive ranks (``--nodes 2``), so the ring of a DP group puts
every replica on the other node, as on a real cluster."""


@dataclass(frozen=True)
class Kind:
    """What a fault kind does: the signal, where in the step it strikes (None: drawn per case), who is hit, and what
    the victims find in their host stores on the restart."""

    signal: str = "SIGKILL"
    """``SIGKILL``, ``SIGSTOP`` (the whole process hangs), or ``block`` (the training thread blocked in a C call, its
    heartbeat alive: only the progress tags show it; in process, ``detector.hang_timeout_s`` 3 s and
    ``inprocess.abort_timeout_s`` 10 s, the CPU job files' values)."""
    phase: str | None = None
    """``forward``, ``backward``, ``optimizer``, ``copy`` (mid-snapshot copy), ``stream`` (mid-stream to the ring
    successor); None: drawn from the first three."""
    victims: str = "one"
    """``one`` rank, its ``node`` (both ranks of it), an ``adjacent-pair`` (a rank and its ring successor), or its
    whole ``dp-group`` (with TP 1 that is every rank: the job finds no snapshot anywhere)."""
    store: str = "kept"
    """``kept``, ``replaced`` (emptied: a new node), or damaged: ``bitflip``, ``truncate``, ``header``."""
    recovery_kill: bool = False
    """A second fault: on the restart, a random rank is SIGKILLed while it loads the restored state."""
    tp: int | None = None
    """Tensor parallelism (None: drawn, 1 or 2)."""
    faults: int = 1
    """In process: 2 plans a second SIGKILL in a later step, on a rank of the generation that recovered from the
    first (one hot spare per fault)."""
    shrink: bool = False
    """In process, no spare: the victim's node is lost for good (``permanent``) and ``elastic.enabled`` lets the job go
    on at a smaller data-parallel size; dropout off and the global batch fixed, in the failure-free run too, so what
    follows the shrink is compared within 1e-4 (another reduction order) and on the samples each step consumed."""
    misplaced_data: bool = False
    """The restart path (distributed optimizer), and the restarted attempt reads other samples than before the
    failure (a loader that does not resume its position): the data check must stop the job at the replayed step,
    announced."""
    idle_spare: bool = False
    """In process, no rank fault: the hot spare SIGKILLs itself while idle, once rank 0 logged the case's step; its
    launcher reports it, no generation fails (``--kill-idle-spare-after``)."""
    grow_back: bool = False
    """In process with ``inprocess.grow_back`` and one hot spare for two faults: the first victim's launcher starts a
    replacement once the recovered generation completed a step; the second fault waits for it and the replacement
    takes the second lost rank."""
    store_node: bool = False
    """In process: the fault hits the node hosting the store in use (``fault_injection.target: store_node``): with
    SIGKILL its launcher, the primary store host and rank 0 die; with SIGSTOP only the store host stops (for good:
    its launcher stops it once the job moved on). The job fails over to node 1's standby."""
    inprocess: bool = False
    """In-process recovery with a hot spare (the recipe's in-process mode under our per-node launchers); always the
    distributed optimizer. No insurance checkpoint: a give-up falls back to the restart path (the launchers restart
    the job), which restores from the host stores. The hang's detection time is the recovery timeline's ``detect``
    phase (our detector's, in process); the MTTR (fault to the first completed step) includes it."""


KIND_SPECS: dict[str, Kind] = {
    "kill-forward": Kind(phase="forward"),
    "kill-backward": Kind(phase="backward"),
    "kill-optimizer": Kind(phase="optimizer"),
    "kill-mid-copy": Kind(phase="copy"),
    "kill-mid-stream": Kind(phase="stream"),
    "kill-in-recovery": Kind(phase="forward", recovery_kill=True),
    "hang": Kind(signal="SIGSTOP"),
    "kill-replaced-store": Kind(store="replaced"),
    "kill-bitflip": Kind(store="bitflip"),
    "kill-truncate": Kind(store="truncate"),
    "kill-bad-header": Kind(store="header"),
    "lose-node": Kind(victims="node", store="replaced"),
    "lose-adjacent-pair": Kind(victims="adjacent-pair", store="replaced"),
    "lose-dp-group": Kind(victims="dp-group", store="replaced"),
    "inproc-kill": Kind(phase="optimizer", tp=1, inprocess=True),
    "inproc-hang": Kind(signal="SIGSTOP", phase="optimizer", tp=1, inprocess=True),
    "inproc-two-faults": Kind(phase="optimizer", tp=1, inprocess=True, faults=2),
    "inproc-shrink": Kind(phase="optimizer", tp=1, inprocess=True, shrink=True),
    "data-misplaced": Kind(phase="optimizer", store="kept", misplaced_data=True),
    "inproc-stuck": Kind(signal="block", phase="optimizer", tp=1, inprocess=True),
    "inproc-store-node": Kind(phase="optimizer", tp=1, inprocess=True, store_node=True),
    "inproc-store-stop": Kind(signal="SIGSTOP", phase="optimizer", tp=1, inprocess=True, store_node=True),
    "inproc-spare-lost": Kind(phase="optimizer", tp=1, inprocess=True, idle_spare=True),
    "inproc-grow-back": Kind(phase="optimizer", tp=1, inprocess=True, faults=2, grow_back=True),
}
KINDS = tuple(KIND_SPECS)
"""Fault kinds, in the order cases are drawn. ``lose-adjacent-pair`` and ``lose-dp-group`` leave no complete
in-memory version (a rank and its ring successor, or a whole DP group, restart with empty stores): the expected
outcome is the announced fallback to the insurance checkpoint. A lost node is covered by the replicas its ranks
streamed to the other node. New kinds are added last, so every earlier draw of a seed stays as it was."""

SPARES = 1
GLOBAL_BATCH = 16
"""Samples per step of every case: the recipe's default at DP 4 (2 micro-batches of 2 per rank); given to the recipe
only where it must stay fixed across a shrink (``inproc-shrink`` and its failure-free run)."""
"""Hot spares of an in-process case (on top of the ``WORLD`` active ranks)."""

_DETECTED_RE = re.compile(r"detected a failure \((\w+)\) at unix ([0-9.]+)")
_MTTR_RE = re.compile(r"recovery MTTR ([0-9.]+) s")


def dp_ring(rank: int, *, tp: int, world: int = WORLD, nodes: int = NODES) -> tuple[int, ...]:
    """The DP ring ``rank`` belongs to, as the library builds it (mcore's DP groups: ranks with the same TP
    coordinate; ``--nodes``: consecutive ranks per node; ``ring.policy: cross_node``)."""
    from neighbor_ckpt.snapshot.topology import ring_order

    members = [r for r in range(world) if r % tp == rank % tp]
    return ring_order(members, [f"node{r * nodes // world}" for r in range(world)], "cross_node")


@dataclass(frozen=True)
class Case:
    """One fault (pure description; :func:`run_case` executes it)."""

    index: int
    kind: str
    rank: int
    step: int
    dist_opt: bool
    phase: str = "optimizer"
    tp: int = 1
    recovery_rank: int | None = None
    """The rank killed during the recovery (``kill-in-recovery``)."""
    damage_seed: int | None = None
    second_rank: int | None = None
    """``inproc-two-faults``: the rank (of the generation that recovered from the first fault) killed second."""
    second_step: int | None = None
    """``inproc-two-faults``: the step of the second fault (after the first generation's recovery completed a step)."""

    @property
    def spec(self) -> Kind:
        return KIND_SPECS[self.kind]

    @property
    def signal(self) -> str:
        return self.spec.signal

    @property
    def damage(self) -> str | None:
        return self.spec.store if self.spec.store in ("bitflip", "truncate", "header") else None

    @property
    def victims(self) -> tuple[int, ...]:
        how = self.spec.victims
        if how == "node":
            per = WORLD // NODES
            return tuple(range(self.rank // per * per, self.rank // per * per + per))
        if how == "adjacent-pair":
            ring = dp_ring(self.rank, tp=self.tp)
            return tuple(sorted({self.rank, ring[(ring.index(self.rank) + 1) % len(ring)]}))
        if how == "dp-group":
            return tuple(sorted(dp_ring(self.rank, tp=self.tp)))
        return (self.rank,)

    @property
    def needs_insurance(self) -> bool:
        """Only the insurance checkpoint can cover it: both ends of a ring edge (or more) lost their stores; or the
        replicated optimizer was hit after the victim's optimizer step began and before its snapshot committed
        (the survivors finish the step the victim never snapshotted); or the replicated optimizer's restore was
        killed (the restart may not choose that iteration again, and the survivors' lazy backup, written at failure
        time, exists for that iteration only)."""
        if self.spec.victims in ("adjacent-pair", "dp-group"):
            return True
        if not self.dist_opt and self.recovery_rank is not None:
            return True
        return not self.dist_opt and self.phase in ("optimizer", "copy")

    @property
    def may_fall_back(self) -> bool:
        """The insurance checkpoint may be needed, by timing: :attr:`needs_insurance`, or a kill during the recovery
        after a first kill before the wait point (forward, backward). The victim may die before the engine thread
        committed its snapshot of the previous step, leaving one complete version (``step - 2``); the restart restores
        it, the second kill forbids it for good, and nothing in memory is left. When the snapshot had committed, the
        older version is there and the case resumes exactly."""
        return self.needs_insurance or (self.recovery_rank is not None and self.phase in ("forward", "backward"))

    @property
    def max_restarts(self) -> int:
        """torchrun's (in process: each launcher's ``--max-restarts``, the restart path a give-up falls back to)."""
        return 2 if self.recovery_rank is not None else 1

    @property
    def inprocess(self) -> bool:
        return self.spec.inprocess

    @property
    def spares(self) -> int:
        """Hot spares of an in-process case: one per fault, none for a shrink."""
        return 0 if self.spec.shrink else SPARES if self.spec.grow_back else self.spec.faults * SPARES

    @property
    def planned_faults(self) -> list[dict[str, Any]] | None:
        """The ``fault_injection.faults`` entries of the case's config (the kinds with several faults or a lost node),
        or None: the recipe's ``--kill`` flags inject it."""
        if not (self.spec.faults > 1 or self.spec.shrink or self.spec.store_node):
            return None
        if self.spec.store_node:
            return [{"target": "store_node", "step": self.step, "phase": self.phase, "signal": self.signal}]
        first = {"rank": self.rank, "step": self.step, "phase": self.phase, "signal": self.signal,
                 "permanent": self.spec.shrink}
        if self.second_rank is None:
            return [first]
        return [first, {"rank": self.second_rank, "step": self.second_step, "phase": self.phase,
                        "signal": self.signal}]

    @property
    def expected(self) -> str:
        """The outcome this case must have: ``fallback`` (no in-memory version can cover it), ``resized`` (a shrink),
        ``stopped`` (the data check's announced stop) or ``exact``."""
        return ("fallback" if self.needs_insurance else "resized" if self.spec.shrink
                else "stopped" if self.spec.misplaced_data else "exact")

    @property
    def acceptable(self) -> tuple[str, ...]:
        """Every outcome that is right for this case: :attr:`expected`, and ``fallback`` too where timing decides
        (:attr:`may_fall_back`)."""
        return (self.expected, "fallback") if self.may_fall_back and self.expected != "fallback" else (self.expected,)

    def recipe_args(self) -> list[str]:
        if self.planned_faults is not None:
            return list(self.flavour_args)
        if self.spec.idle_spare:
            return ["--kill-idle-spare-after", str(self.step)]
        args = ["--kill", f"{','.join(map(str, self.victims))}:{self.step}", "--kill-phase", self.phase,
                "--kill-signal", self.signal]
        if self.spec.misplaced_data:
            args.append("--misplace-data-on-restart")
        if not self.inprocess:  # in process, every launcher is a simulated node of its own (NEIGHBOR_CKPT_NODE_ID)
            args += ["--nodes", str(NODES)]
        if self.tp != 1:
            args += ["--tp", str(self.tp)]
        if self.spec.store == "replaced":
            args.append("--replace-store")
        if self.damage:
            args += ["--damage", self.damage]
        if self.damage_seed is not None:
            args += ["--damage-seed", str(self.damage_seed)]
        if self.recovery_rank is not None:
            args += ["--kill-recovery", str(self.recovery_rank)]
        return args if self.dist_opt else [*args, "--no-dist-opt"]

    @property
    def flavour(self) -> tuple[bool, int, bool]:
        """The failure-free run this case is compared with: (distributed optimizer, TP, dropout off and the global
        batch fixed: a shrink's)."""
        return self.dist_opt, self.tp, self.spec.shrink

    @property
    def flavour_args(self) -> list[str]:
        """The recipe flags of :attr:`flavour` beyond TP and the optimizer."""
        return ["--dropout", "0", "--global-batch", str(GLOBAL_BATCH)] if self.spec.shrink else []


@dataclass(frozen=True)
class Outcome:
    case: Case
    result: str
    """``exact``, ``fallback`` or ``FAILED``."""
    detail: str = ""
    detection_s: float | None = None
    mttr_s: float | None = None
    wall_s: float = 0.0


def draw_cases(n: int, seed: int, *, steps: int, world: int = WORLD, kinds: Sequence[str] = KINDS) -> list[Case]:
    """``n`` cases from ``seed``: every kind in turn (so any prefix covers the kinds evenly), random rank, step
    (1 .. steps-2: a snapshot exists before and a step remains after), phase where the kind leaves it open, TP (1 or
    2), optimizer flavour, and for damage and recovery kills the bit and the second victim.

    The step is at least 2 when the case is a double fault: a lost or damaged store, or a second kill during the
    recovery. A kill before the wait point of step ``i`` can leave the newest snapshot (``i - 1``) half streamed to
    the successor; with the victim's own copy gone too, only version ``i - 2`` or the insurance checkpoint (written
    after step 1) is left, and at step 1 neither exists yet."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        spec = KIND_SPECS[kind]
        rank, step, dist_opt = rng.randrange(world), rng.randrange(1, steps - 1), rng.random() < 0.75
        phase = spec.phase or rng.choice(("forward", "backward", "optimizer"))
        tp = spec.tp or rng.choice((1, 1, 2))
        recovery_rank = rng.randrange(world) if spec.recovery_kill else None
        # drawn all the same: the draws of the cases after it stay as they were
        dist_opt = dist_opt or spec.inprocess or spec.misplaced_data
        damage_seed = rng.randrange(2**31) if spec.store == "bitflip" else None
        case = Case(index=i, kind=kind, rank=rank, step=step, dist_opt=dist_opt, phase=phase, tp=tp,
                    recovery_rank=recovery_rank, damage_seed=damage_seed)
        if case.needs_insurance or spec.recovery_kill or spec.store != "kept":
            case = dataclasses.replace(case, step=max(step, 2))
        if spec.store_node:  # node 0 hosts the primary store: its rank is the one lost with it (SIGKILL)
            case = dataclasses.replace(case, rank=0)
        if spec.faults > 1:  # the second fault after the recovered generation completed a step
            first = min(step, steps - 3)
            case = dataclasses.replace(case, step=first, second_rank=rng.randrange(world),
                                       second_step=rng.randrange(first + 1, steps - 1))
        cases.append(case)
    return cases


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, args: list[str], *, job_id: str, store: Path, config: Path, steps: int, timeout: float,
              max_restarts: int, insurance_every: int = 0) -> tuple[int, str]:
    out.mkdir(parents=True, exist_ok=True)
    options, worker = worker_program([str(RECIPE), "--steps", str(steps), "--out", str(out), "--job-id", job_id,
                                      "--config", str(config), "--insurance-every", str(insurance_every), *args])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", f"--max-restarts={max_restarts}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--monitor-interval=0.5", *options,
           *worker]
    tag = new_run_tag()
    env = dict(os.environ, NEIGHBOR_CKPT_STORE_DIR=str(store), PYTHONUNBUFFERED="1", **{RUN_TAG_ENV: tag})
    log = out / "torchrun.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -999
    # A SIGSTOPped victim that nobody killed, or the helpers of a killed worker, would outlive torchrun.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    kill_tagged(tag)
    return rc, log.read_text(errors="replace")


def inprocess_job(out: Path, args: list[str], *, job_id: str, store: Path, config: Path, steps: int,
                  store_port: "int | list[int]", max_restarts: int, insurance_every: int = 0,
                  spares: int = SPARES, grow_back: bool = False):  # noqa: ANN201
    """The per-node launcher commands (each hosting one of the stores) of an in-process case (nothing runs):
    ``WORLD`` active ranks + ``SPARES``, the recipe in its in-process mode (``config`` enables it), one host store
    root per simulated node under ``store``; built by :func:`neighbor_ckpt.cli.launch.inprocess_commands`, as
    ``neighbor-ckpt launch`` builds its own."""
    from neighbor_ckpt.cli.launch import inprocess_commands

    program = [str(RECIPE), "--steps", str(steps), "--out", str(out), "--job-id", job_id, "--config", str(config),
               "--insurance-every", str(insurance_every), *args]
    return inprocess_commands(program, active=WORLD, spares=spares, max_restarts=max_restarts, run_id=job_id,
                              store_port=store_port, store_root=store, grow_back=grow_back)


def _run_inprocess(out: Path, args: list[str], *, job_id: str, store: Path, config: Path, steps: int,
                   timeout: float, max_restarts: int, spares: int = SPARES, grow_back: bool = False) -> tuple[int, str]:
    """Run an in-process case (:func:`inprocess_job`); the launchers', their processes' and the store host's output
    in ``launch.log``. Returns (:func:`~neighbor_ckpt.cli.launch.launch_status` of the launchers' exit statuses,
    -999 past ``timeout``; the log)."""
    from neighbor_ckpt.cli.launch import free_ports, run_inprocess
    from neighbor_ckpt.errors import ConfigError

    out.mkdir(parents=True, exist_ok=True)
    procs = inprocess_job(out, args, job_id=job_id, store=store, config=config, steps=steps,
                          store_port=free_ports(WORLD + spares), max_restarts=max_restarts, spares=spares,
                          grow_back=grow_back)
    tag = new_run_tag()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{RUN_TAG_ENV: tag})
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun gives the baseline's workers: the same CPU arithmetic
    log = out / "launch.log"
    with open(log, "w") as f:
        try:
            rc = run_inprocess(procs, env=env, timeout=timeout, stdout=f,
                               stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            rc = -999
        except ConfigError as e:  # the store host never listened: this case failed, the campaign goes on
            f.write(f"\ncampaign: {e}\n")
            rc = -998
    kill_tagged(tag)  # a stopped victim nobody killed, or a process its launcher left behind
    return rc, log.read_text(errors="replace")


def _timeline_mttr(out: Path) -> float | None:
    """The MTTR of the recovery timeline rank 0 wrote (in process: fault to the first completed step)."""
    for path in sorted((out / "reports").glob("recovery_timeline.*.json")):
        value = json.loads(path.read_text()).get("mttr_s")
        if value is not None:
            return float(value)
    return None


def _timeline_detect(out: Path) -> float | None:
    """The ``detect`` phase of the recovery timeline rank 0 wrote (in process: fault to the failure's record)."""
    for path in sorted((out / "reports").glob("recovery_timeline.*.json")):
        value = (json.loads(path.read_text()).get("phases_s") or {}).get("detect")
        if value is not None:
            return float(value)
    return None


def _losses_by_attempt(out: Path) -> dict[int, dict[int, list[tuple[int, str]]]]:
    """rank -> step -> [(launcher restart count, loss), ...] in the order trained."""
    per_rank: dict[int, dict[int, list[tuple[int, str]]]] = {}
    for path in out.glob("losses.rank*.jsonl"):
        rank = int(path.name.split(".")[1][4:])
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            per_rank.setdefault(rank, {}).setdefault(rec["step"], []).append((int(rec.get("attempt", 0)), rec["loss"]))
    return per_rank


def _losses(out: Path) -> dict[int, dict[int, list[str]]]:
    """rank -> step -> [loss, ...] in the order trained."""
    return {rank: {step: [loss for _, loss in recs] for step, recs in steps.items()}
            for rank, steps in _losses_by_attempt(out).items()}


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


def _samples(out: Path) -> dict[int, list[int]]:
    """step -> the sorted samples the ranks trained in it, in the last (launch attempt, in-process generation) that
    trained it (a shrink's ranks are other processes than before it)."""
    per_step: dict[int, dict[tuple[int, int], list[int]]] = {}
    for path in out.glob("losses.rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            when = (int(rec.get("attempt", 0)), int(rec.get("generation", 0)))
            per_step.setdefault(rec["step"], {}).setdefault(when, []).extend(rec.get("samples") or [])
    return {step: sorted(by[max(by)]) for step, by in per_step.items()}


def compare_resized(base: Path, run: Path, *, fault_step: int, rel: float = 1e-4) -> str:
    """'' when a shrink trained what it should: every step; before ``fault_step`` every rank's loss equal to the
    failure-free run (the same layout); from it on, rank 0's losses within ``rel`` (another data-parallel size
    reduces in another order); every step's samples, over all ranks, those of the failure-free run (the global batch
    kept)."""
    b, r = _losses(base), _losses(run)
    if not r or sorted(r[0]) != sorted(b[0]):
        return f"rank 0 trained steps {sorted(r.get(0, {}))}, expected {sorted(b[0])}"
    for rank, steps in r.items():
        for step, losses in steps.items():
            if step < fault_step and rank in b and any(x != b[rank][step][-1] for x in losses):
                return f"rank {rank} step {step} (before the shrink): loss {losses} != {b[rank][step][-1]}"
    for step, losses in r[0].items():
        want, got = float.fromhex(b[0][step][-1]), float.fromhex(losses[-1])
        if abs(got - want) > rel * abs(want):
            return f"step {step}: loss {got!r} not within {rel:g} of {want!r}"
    sb, sr = _samples(base), _samples(run)
    for step in sb:
        if sr.get(step) != sb[step]:
            return f"step {step} trained samples {sr.get(step)}, expected {sb[step]} (the global batch)"
    return ""


def insurance_iteration(run: Path) -> int | None:
    """The insurance iteration a fallback restored: the one iteration the recovery reports with outcome
    ``insurance`` name (None: no such report, or reports that disagree)."""
    its = set()
    for path in run.glob("report.rank*.attempt*.json"):
        rep = json.loads(path.read_text())
        if rep.get("outcome") == "insurance" and rep.get("iteration") is not None:
            its.add(int(rep["iteration"]))
    return its.pop() if len(its) == 1 else None


def compare_fallback(base: Path, resumed: Path, run: Path, *, insurance_step: int) -> str:
    """'' when a fallback case trained what it should, bit for bit: what the first launch attempt trained equals the
    failure-free run ``base``; every step from ``insurance_step + 1`` on trained after the fallback (a later launcher
    attempt) equals ``resumed``, the failure-free run resumed from the same insurance checkpoint (a fresh process
    replays those steps from that checkpoint, not from the uninterrupted run's RNG and state); every rank trained
    every step; the final parameters and optimizer state equal ``resumed``'s."""
    missing = compare(base, run, steps_only=True)
    if missing:
        return f"fell back to insurance but did not finish training: {missing}"
    b, rs, r = _losses(base), _losses(resumed), _losses_by_attempt(run)
    for rank, steps in r.items():
        for step, recs in steps.items():
            for attempt, loss in recs:
                if attempt == 0:
                    expected, what = b[rank][step][-1], "the failure-free run"
                elif step > insurance_step and step in rs.get(rank, {}):
                    expected, what = rs[rank][step][-1], f"the failure-free run resumed from insurance {insurance_step}"
                else:
                    return f"rank {rank} step {step} trained in launch attempt {attempt}, before insurance {insurance_step}"
                if loss != expected:
                    return f"rank {rank} step {step} attempt {attempt}: loss {loss} != {expected} ({what})"
    if _finals(resumed) != _finals(run):
        return f"final parameters or optimizer state differ from the run resumed from insurance {insurance_step}"
    return ""


_FAILURE_RE = re.compile(r"failed \(exitcode: -?\d+\) local_rank|detected a failure \((?!sigterm)|Traceback|"
                         r"^\[rank\d+\]:?\s*[\w.]*(Error|Exception)\b|rank \d+: .*(refused|failed|cannot)|attempt \d+")


def failure_lines(log: str, *, limit: int = 12) -> str:
    """The lines of a torchrun log that say which worker failed how, in every attempt (what a FAILED case reports;
    torchrun's own exit code is 1 whatever happened)."""
    hits = [line.strip()[:240] for line in log.splitlines() if _FAILURE_RE.search(line)]
    return " | ".join(hits[-limit:]) or " | ".join(log.strip().splitlines()[-3:])[-300:]


def run_case(case: Case, *, base: Path, work: Path, steps: int, config: Path, timeout: float = 420,
             insurance_every: int = 0) -> Outcome:
    out = work / f"case{case.index:04d}-{case.kind}-r{case.rank}-s{case.step}"
    job_id = f"campaign-{case.index}"
    # What an interrupted earlier run of this case left (a resumed campaign) must not be found by this one.
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(rank_dir(work / "store", job_id, 0).parent, ignore_errors=True)
    inproc_store = work / "store" / f"inproc-{case.index}"  # one root per simulated node under it
    shutil.rmtree(inproc_store, ignore_errors=True)
    t0 = time.time()
    if case.inprocess:
        own = write_config(out / "nckpt.yaml", base=config, inprocess_spares=case.spares, report_dir=out / "reports",
                           faults=case.planned_faults, elastic=case.spec.shrink, stuck=case.signal == "block",
                           grow_back=case.spec.grow_back)
        rc, log = _run_inprocess(out, case.recipe_args(), job_id=job_id, store=inproc_store, config=own,
                                 steps=steps, timeout=timeout, max_restarts=case.max_restarts, spares=case.spares,
                                 grow_back=case.spec.grow_back)
    else:
        rc, log = _torchrun(out, case.recipe_args(), job_id=job_id, store=work / "store",
                            config=config, steps=steps, timeout=timeout, max_restarts=case.max_restarts,
                            insurance_every=insurance_every)
    wall = time.time() - t0
    detected = [float(m.group(2)) for m in _DETECTED_RE.finditer(log) if m.group(1) != "sigterm"]
    detection = None
    if case.signal == "SIGSTOP" and detected and (out / "fault.json").exists():
        detection = min(detected) - json.loads((out / "fault.json").read_text())["unix"]
    elif case.signal in ("SIGSTOP", "block") and case.inprocess:
        detection = _timeline_detect(out)
    mttr = [float(m.group(1)) for m in _MTTR_RE.finditer(log)] or [x for x in [_timeline_mttr(out)] if x is not None]
    common = dict(detection_s=detection, mttr_s=mttr[0] if mttr else None, wall_s=wall)
    if not (out / "fault.json").exists():
        return Outcome(case, "FAILED", "the fault never fired", **common)
    if case.recovery_rank is not None and not (out / "fault.recovery.json").exists():
        return Outcome(case, "FAILED", "the kill during recovery never fired", **common)
    fired = len((out / "faults.jsonl").read_text().splitlines()) if (out / "faults.jsonl").exists() else 1
    if case.planned_faults is not None and fired != len(case.planned_faults):
        return Outcome(case, "FAILED", f"{fired} of {len(case.planned_faults)} planned faults fired", **common)
    if case.spec.misplaced_data:
        stop = f"the data position was not restored: step {case.step}"
        if rc != 0 and "DataPositionError" in log and stop in log:
            return Outcome(case, "stopped", f"stopped by the data check at the replayed step {case.step}, announced",
                           **common)
        return Outcome(case, "FAILED", f"exit {rc}, a restart on other data was not stopped at step {case.step}: "
                                       f"{failure_lines(log)}", **common)
    if rc != 0:
        return Outcome(case, "FAILED", f"exit {rc}: {failure_lines(log)}", **common)
    if "falling back to the insurance checkpoint" in log:
        k = insurance_iteration(out)
        if k is None:
            return Outcome(case, "FAILED", "fell back to insurance, but the recovery reports do not name one "
                                           "insurance iteration", **common)
        resumed = resume_baseline(case, run=out, work=work, steps=steps, config=config, insurance_step=k)
        if resumed is None:
            return Outcome(case, "FAILED", f"the failure-free run resumed from insurance {k} failed", **common)
        diff = compare_fallback(base, resumed, out, insurance_step=k)
        return Outcome(case, "FAILED" if diff else "fallback",
                       diff or f"announced fallback to insurance {k}, bit-exact with the failure-free run resumed "
                               "from it", **common)
    if case.spec.shrink:
        diff = compare_resized(base, out, fault_step=case.step)
        if not diff and "in-process recovery gives up" in log:
            diff = "in-process recovery gave up instead of shrinking"
        return Outcome(case, "FAILED" if diff else "resized",
                       diff or "shrank in process: the global batch's samples kept, losses within 1e-4", **common)
    diff = compare(base, out)
    if case.inprocess and not diff and "in-process recovery gives up" in log:
        return Outcome(case, "fallback", "in-process recovery gave up (announced); the restart path recovered "
                                         "exactly", **common)
    return Outcome(case, "FAILED" if diff else "exact", diff, **common)


def resume_baseline(case: Case, *, run: Path, work: Path, steps: int, config: Path, insurance_step: int,
                    timeout: float = 420) -> Path | None:
    """The failure-free run of ``case``'s configuration resumed from insurance checkpoint ``insurance_step`` (its
    output directory; None if it failed): a job given a copy of that one checkpoint from ``run``'s insurance
    directory (written before the fault, by training identical to the failure-free run's), whose every rank is killed
    in step 0's forward pass, before any snapshot exists: its restart finds nothing in memory and loads the insurance,
    in fresh processes of launcher attempt 1, as the fallback did. One per configuration and step, reused by later
    cases."""
    flavour = f"{'distopt' if case.dist_opt else 'replicated'}-tp{case.tp}"
    out = work / f"resumed-{flavour}-from{insurance_step}"
    if len(list(out.glob("final.rank*.json"))) == WORLD:
        return out
    shutil.rmtree(out, ignore_errors=True)
    name = f"iter_{insurance_step:07d}"
    insurance = out / "insurance"
    shutil.copytree(run / "insurance" / name, insurance / name)
    flags = ["--nodes", str(NODES), "--tp", str(case.tp), *case.flavour_args, "--insurance-dir", str(insurance),
             "--kill", ",".join(map(str, range(WORLD))) + ":0", "--kill-phase", "forward"] + \
        ([] if case.dist_opt else ["--no-dist-opt"])
    rc, _ = _torchrun(out, flags, job_id=f"campaign-resumed-{flavour}-{insurance_step}", store=work / "store-resumed",
                      config=config, steps=steps, timeout=timeout, max_restarts=1, insurance_every=10**6)
    return out if rc == 0 and len(list(out.glob("final.rank*.json"))) == WORLD else None


def summarize(outcomes: Sequence[Outcome]) -> str:
    """The campaign table (markdown): per kind, counts of each outcome, how many fallbacks happened where an
    in-memory version should have existed (``unexpected``: not a failure, nothing wrong was loaded, but a rollback
    further than needed), and the detection times of hangs."""
    lines = ["| fault | cases | exact | resized | fallback | (unexpected) | stopped | FAILED | detection s (median / max) "
             "| MTTR s (median) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in [k for k in KINDS if any(o.case.kind == k for o in outcomes)] + ["all"]:
        rows = [o for o in outcomes if kind in ("all", o.case.kind)]
        det = [o.detection_s for o in rows if o.detection_s is not None]
        mttr = [o.mttr_s for o in rows if o.mttr_s is not None]
        count = {r: sum(o.result == r for o in rows) for r in ("exact", "resized", "fallback", "stopped", "FAILED")}
        unexpected = sum(o.result == "fallback" and not o.case.may_fall_back for o in rows)
        lines.append(f"| {kind} | {len(rows)} | {count['exact']} | {count['resized']} | {count['fallback']} | "
                     f"{unexpected} | {count['stopped']} | {count['FAILED']} | "
                     + (f"{statistics.median(det):.2f} / {max(det):.2f}" if det else "-") + " | "
                     + (f"{statistics.median(mttr):.1f}" if mttr else "-") + " |")
    return "\n".join(lines)


def write_config(path: Path, *, interval_s: float = 0.5, timeout_s: float = 3.0, base: Path | None = None,
                 inprocess_spares: int | None = None, report_dir: Path | None = None,
                 faults: list[dict[str, Any]] | None = None, elastic: bool = False, stuck: bool = False,
                 grow_back: bool = False) -> Path:
    """The campaign's ``neighbor_ckpt:`` section: the detector's bound, and 64 KiB chunks so that a kill in the
    middle of streaming leaves a replica really half written. ``base``: that section as written before (the
    campaign's), extended by ``inprocess_spares`` (in-process recovery on, with that many hot spares),
    ``report_dir`` (where the recovery timeline goes), ``faults`` (``fault_injection.faults``: the faults the recipe
    injects itself), ``elastic`` (``elastic.enabled``) and ``stuck`` (the hang and abort bounds of the CPU job files,
    ``detector.hang_timeout_s`` 3 s and ``inprocess.abort_timeout_s`` 10 s, for a stuck training thread) and
    ``grow_back`` (``inprocess.grow_back``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = base.read_text() if base is not None else (
        f"neighbor_ckpt:\n  detector:\n    interval_s: {interval_s}\n    timeout_s: {timeout_s}\n"
        "  store:\n    cleanup_on_success: true\n  transport:\n    chunk_mb: 0.0625\n")
    if stuck:
        if "  detector:\n" not in text:
            raise ValueError("write_config: stuck=True needs the campaign's detector section in base")
        text = text.replace("  detector:\n", "  detector:\n    hang_timeout_s: 3.0\n", 1)
    if inprocess_spares is not None:
        text += f"  inprocess:\n    enabled: true\n    spares: {inprocess_spares}\n"
        if stuck:
            text += "    abort_timeout_s: 10.0\n"
        if grow_back:
            text += "    grow_back: true\n"
    if report_dir is not None:
        text += f"  report:\n    dir: {json.dumps(str(report_dir))}\n"
    if faults:
        text += f"  fault_injection:\n    enabled: true\n    faults: {json.dumps(faults)}\n"
    if elastic:
        text += "  elastic:\n    enabled: true\n"
    path.write_text(text)
    return path


def source_version() -> str:
    """The commit the campaign runs (``git describe --always --dirty`` of the checkout), or ``unknown``."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=CHECKOUT, capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def _outcome_from_json(record: dict[str, Any]) -> Outcome:
    return Outcome(**{**record, "case": Case(**record["case"])})


def load_outcomes(path: Path) -> list[Outcome]:
    """The outcomes a campaign appended to ``path`` (one JSON object per line), in order."""
    if not path.exists():
        return []
    return [_outcome_from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _settings(args: argparse.Namespace, kinds: Sequence[str]) -> dict[str, Any]:
    return {"seed": args.seed, "faults": args.faults, "steps": args.steps, "kinds": list(kinds),
            "detector_timeout_s": args.detector_timeout, "detector_interval_s": args.detector_interval,
            "insurance_every": args.insurance_every, "insurance_where_needed": args.insurance_where_needed,
            "source": source_version()}


def resume_point(work: Path, settings: dict[str, Any], cases: Sequence[Case]) -> list[Outcome]:
    """The outcomes of the campaign in ``work`` that a ``--resume`` keeps. Refuses (ValueError, with what differs)
    when that campaign ran other settings or another commit, or recorded a case that is not the one drawn now:
    the table of a resumed campaign must be the table of one campaign."""
    meta = work / "campaign.json"
    if not meta.exists():
        raise ValueError(f"--resume: {meta} does not exist; start the campaign without --resume")
    before = json.loads(meta.read_text())
    differ = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
    if differ:
        raise ValueError("--resume: the campaign in " + str(work) + " ran with other settings or source: "
                         + ", ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in differ.items())
                         + "; check out that commit and pass the same options, or start a new campaign")
    done = load_outcomes(work / "outcomes.jsonl")
    for position, o in enumerate(done):
        if position >= len(cases) or o.case != cases[position]:
            raise ValueError(f"--resume: recorded case {o.case} is not case {position} of this campaign")
    return done


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.campaign", description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=24, help="number of randomized faults")
    ap.add_argument("--seed", type=int, default=7, help="reproduces the campaign")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {', '.join(KINDS)}")
    ap.add_argument("--detector-timeout", type=float, default=3.0, help="detector.timeout_s (the bound)")
    ap.add_argument("--detector-interval", type=float, default=0.5, help="detector.interval_s")
    ap.add_argument("--insurance-every", type=int, default=2,
                    help="megatron-core distributed checkpoint every N steps in every run (the insurance)")
    ap.add_argument("--insurance-where-needed", action="store_true",
                    help="write the insurance only in the cases no in-memory version can cover, or may not by timing "
                         "(the failure-free runs and every other case run without it, and then fail where they would "
                         "fall back): a "
                         "dist_checkpointing save costs ~3 s here, a third of a case")
    ap.add_argument("--only", default="",
                    help="comma-separated case numbers (from 1) of the draw to run, the others skipped: reproduces "
                         "cases of a long campaign with the same ranks, steps and damage")
    ap.add_argument("--out", type=Path, default=Path("runs/campaign"))
    ap.add_argument("--resume", action="store_true",
                    help="continue the stopped campaign in --out (same options and commit): keep its recorded "
                         "outcomes and run the cases it has not")
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    try:
        only = sorted({int(n) for n in args.only.split(",") if n.strip()})
    except ValueError:
        ap.error(f"--only takes case numbers separated by commas, not {args.only!r}")
    if only and not 1 <= only[0] <= only[-1] <= args.faults:
        ap.error(f"--only: case numbers run from 1 to --faults ({args.faults}), not {only}")
    work = args.out
    cases = draw_cases(args.faults, args.seed, steps=args.steps, kinds=kinds)
    if only:
        cases = [c for c in cases if c.index + 1 in only]
    settings = _settings(args, kinds)
    if only:
        settings["only"] = only  # absent otherwise: a campaign recorded before --only existed still resumes
    results = work / "outcomes.jsonl"
    if args.resume:
        try:
            outcomes = resume_point(work, settings, cases)
        except ValueError as e:
            ap.error(str(e))
        print(f"campaign: resuming at case {len(outcomes)} of {len(cases)} (source {settings['source']})", flush=True)
    else:
        outcomes = []
        results.unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "campaign.json").write_text(json.dumps(settings, indent=1) + "\n")
    config = write_config(work / "nckpt.yaml", interval_s=args.detector_interval, timeout_s=args.detector_timeout)
    todo = cases[len(outcomes):]
    bases: dict[tuple[bool, int, bool], Path] = {}
    for flavour, case in sorted({c.flavour: c for c in todo}.items(), reverse=True):
        dist_opt, tp, fixed = flavour
        name = f"{'distopt' if dist_opt else 'replicated'}-tp{tp}{'-nodropout' if fixed else ''}"
        out = work / f"baseline-{name}"
        bases[flavour] = out
        if args.resume and len(list(out.glob("final.rank*.json"))) == WORLD:
            continue  # the failure-free run of the stopped campaign (deterministic: the same run again)
        shutil.rmtree(out, ignore_errors=True)  # an earlier campaign's run in the same --out: its lines would stay
        flags = ["--nodes", str(NODES), "--tp", str(tp), *case.flavour_args] + ([] if dist_opt else ["--no-dist-opt"])
        rc, log = _torchrun(out, flags, job_id=f"campaign-base-{name}", store=work / "store",
                            config=config, steps=args.steps, timeout=420, max_restarts=0,
                            insurance_every=0 if args.insurance_where_needed else args.insurance_every)
        if rc != 0:
            print(f"campaign: the failure-free run failed (exit {rc}); see {out / 'torchrun.log'}", file=sys.stderr)
            return 1
    for case in todo:
        insure = args.insurance_every if case.may_fall_back or not args.insurance_where_needed else 0
        o = run_case(case, base=bases[case.flavour], work=work, steps=args.steps, config=config,
                     insurance_every=insure)
        outcomes.append(o)
        with open(results, "a") as f:
            f.write(json.dumps(asdict(o)) + "\n")
        print(f"[{case.index + 1}/{args.faults}] {case.kind:20s} rank {case.rank} step {case.step} {case.phase:9s} "
              f"tp{case.tp} {'distopt' if case.dist_opt else 'replicated':10s} -> {o.result} "
              + (f"(detected in {o.detection_s:.2f} s) " if o.detection_s is not None else "")
              + (f"(MTTR {o.mttr_s:.2f} s) " if o.mttr_s is not None else "")
              + f"{o.wall_s:.0f} s {o.detail}", flush=True)
    picked = f" (cases {args.only} of {args.faults})" if only else ""
    print(f"\nseed {args.seed}, {len(cases)} faults{picked}, detector timeout {args.detector_timeout:g} s / interval "
          f"{args.detector_interval:g} s, source {settings['source']}\n")
    print(summarize(outcomes))
    (work / "table.md").write_text(summarize(outcomes) + "\n")
    return 0 if all(o.result != "FAILED" for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
