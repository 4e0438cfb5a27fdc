"""What a campaign draws: the fault kinds, one case (pure description) and its outcome, and the seeded draw."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["WORLD", "NODES", "SPARES", "GLOBAL_BATCH", "DEVICES", "LOST_NODE", "PARTITIONS", "CUTTING_RANK", "Kind",
           "KIND_SPECS", "KINDS", "Case", "Outcome", "dp_ring", "draw_cases"]

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
    whole_node: bool = False
    """In process on 2 simulated nodes of 2 ranks (:data:`DEVICES` processes per node, as ``neighbor-ckpt launch``
    runs ``trainer.num_nodes: 2``, ``trainer.devices: 2``): node :data:`LOST_NODE` is lost whole at the case's step
    (``fault_injection.target: node``: its ranks SIGKILL its launcher; its store host and both processes die with it
    and it never comes back). The hot spares fill a spare node of their own (2 per fault); with ``shrink`` there is
    none and the job goes on at DP 2. Judged also on how the loss was found: one decision declaring both of the node's
    processes dead, one failed generation, a recovery timeline with its detection."""
    partition: str = ""
    """In process, each simulated node in a network namespace of its own (``launch.simulate_network``; root, workers
    started cold): the network cut as :data:`PARTITIONS` says for this name (``fault_injection.target: partition``,
    run by :data:`CUTTING_RANK`), nothing killed. ``primary``: node 0 (the primary store, rank 0) cut off for good;
    ``minority-with-spare``: node 0 and the first spare node; ``heal``: the same cut healed after 10 s; ``ranks``:
    node 1's rank traffic only (its stores reachable). Empty: no partition."""
    other_user: bool = False
    """In process, as ``inproc-kill``, and during the whole launch a second Unix user (``nckpt_other``: root,
    ``useradd``; refused in one line where it cannot be made) tries every 0.5 s to read a key of, write ``complete``
    to and write a ``dead`` entry to every store address of the launch (:mod:`tools.campaign.other_user`): every
    attempt must be refused, its process must live on, and the job must see nothing of it."""
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
    "inproc-node-lost": Kind(phase="optimizer", tp=1, inprocess=True, whole_node=True),
    "inproc-node-lost-elastic": Kind(phase="optimizer", tp=1, inprocess=True, whole_node=True, shrink=True),
    "inproc-node-hung": Kind(signal="SIGSTOP", phase="optimizer", tp=1, inprocess=True, whole_node=True),
    "node-lost-for-good": Kind(phase="optimizer", tp=1, whole_node=True, shrink=True),
    "inproc-partition-primary": Kind(phase="optimizer", tp=1, inprocess=True, partition="primary"),
    "inproc-partition-minority-with-spare": Kind(phase="optimizer", tp=1, inprocess=True,
                                                 partition="minority-with-spare"),
    "inproc-partition-heal": Kind(phase="optimizer", tp=1, inprocess=True, partition="heal"),
    "inproc-partition-ranks": Kind(phase="optimizer", tp=1, inprocess=True, partition="ranks"),
    "inproc-other-user": Kind(phase="optimizer", tp=1, inprocess=True, other_user=True),
}
KINDS = tuple(KIND_SPECS)
"""Fault kinds, in the order cases are drawn. ``lose-adjacent-pair`` and ``lose-dp-group`` leave no complete
in-memory version (a rank and its ring successor, or a whole DP group, restart with empty stores): the expected
outcome is the announced fallback to the insurance checkpoint. A lost node is covered by the replicas its ranks
streamed to the other node. New kinds are added last, so every earlier draw of a seed stays as it was."""

SPARES = 1
"""Hot spares of an in-process case (on top of the ``WORLD`` active ranks)."""
DEVICES = 2
"""Processes per simulated node of the whole-node kinds (``inproc-node-lost*``); every other in-process case runs one
process per node."""
LOST_NODE = 1
"""The node a whole-node kind loses (``node1``: ranks 2 and 3; node 0 also hosts the primary store, whose loss is
``inproc-store-node``'s)."""
PARTITIONS: dict[str, dict[str, Any]] = {
    "primary": {"spares": 1, "nodes": [0], "traffic": "all", "heal_after_s": None},
    "minority-with-spare": {"spares": 2, "nodes": [0, WORLD], "traffic": "all", "heal_after_s": None},
    "heal": {"spares": 2, "nodes": [0, WORLD], "traffic": "all", "heal_after_s": 10.0},
    "ranks": {"spares": 1, "nodes": [1], "traffic": "ranks", "heal_after_s": None},
}
"""The partition kinds' layouts (``WORLD`` ranks, one process per node ``node<i>``, the spares on nodes ``WORLD`` and
on): hot spares, the nodes cut off (node ``WORLD`` is the first spare node: a minority holding the primary store and
a spare, 2 of ``WORLD + 2`` nodes), which traffic, and when the cut heals (None: never). The scenarios of
tests/e2e/test_partitions.py on the campaign's 4 ranks (so that they share its failure-free run)."""
CUTTING_RANK = 1
"""The rank that cuts the network in a partition case (it is not harmed by the cut; as in test_partitions.py)."""
GLOBAL_BATCH = 16
"""Samples per step of every case: the recipe's default at DP 4 (2 micro-batches of 2 per rank); given to the recipe
only where it must stay fixed across a shrink (``inproc-shrink`` and its failure-free run)."""


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
        if self.spec.partition:  # the processes of the nodes cut off (one per node)
            return tuple(PARTITIONS[self.spec.partition]["nodes"])
        if self.spec.whole_node:
            return tuple(range(LOST_NODE * DEVICES, (LOST_NODE + 1) * DEVICES))
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
    def simulate_network(self) -> bool:
        """Each simulated node in a network namespace of its own (a partition kind): root only, workers start cold."""
        return bool(self.spec.partition)

    @property
    def devices(self) -> int:
        """Processes (ranks) per simulated node: :data:`DEVICES` for a whole-node kind (in process, our launchers; on
        the restart path, torchrun agents), else 1."""
        return DEVICES if self.spec.whole_node else 1

    @property
    def spares(self) -> int:
        """Hot spares of an in-process case: one per fault (a whole spare node per lost node), none for a shrink but
        a whole node's (one spare on a third node: two nodes alone have no majority once one is lost, and stop)."""
        if self.spec.shrink:
            return SPARES if self.spec.whole_node and self.inprocess else 0
        if self.spec.partition:
            return int(PARTITIONS[self.spec.partition]["spares"])
        return SPARES if self.spec.grow_back else self.spec.faults * SPARES * self.devices

    @property
    def planned_faults(self) -> list[dict[str, Any]] | None:
        """The ``fault_injection.faults`` entries of the case's config (the kinds with several faults or a lost node),
        or None: the recipe's ``--kill`` flags inject it."""
        if not (self.spec.faults > 1 or self.spec.shrink or self.spec.store_node or self.spec.whole_node
                or self.spec.partition):
            return None
        if self.spec.partition:
            cut = PARTITIONS[self.spec.partition]
            return [{"target": "partition", "rank": CUTTING_RANK, "step": self.step, "phase": self.phase,
                     "nodes": list(cut["nodes"]), "traffic": cut["traffic"], "heal_after_s": cut["heal_after_s"]}]
        if self.spec.whole_node:
            return [{"target": "node", "node": LOST_NODE, "step": self.step, "phase": self.phase,
                     "signal": self.signal}]
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
    """What one case came to (the runner judges it; :mod:`tools.campaign.report` tables it)."""

    case: Case
    result: str
    """``exact``, ``resized``, ``fallback``, ``stopped`` or ``FAILED`` (the package's docstring says when)."""
    detail: str = ""
    detection_s: float | None = None
    """The hang's detection time (the first recovery's; None: not a hang, or unknown)."""
    mttr_s: float | None = None
    """The first recovery's MTTR (every recovery's: :attr:`recoveries`)."""
    wall_s: float = 0.0
    recoveries: tuple[dict[str, Any], ...] = ()
    """Every recovery of the case, in order: ``attempt``, ``mode``, ``mttr_s`` and ``detection_s`` (the ``detect``
    phase of its timeline; None where unknown), and where they come from (``file``: a recovery timeline, or ``log``:
    the MTTR line of a run whose timelines are elsewhere). Empty in outcomes recorded before it existed."""


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
        dist_opt = dist_opt or spec.inprocess or spec.misplaced_data or spec.shrink
        damage_seed = rng.randrange(2**31) if spec.store == "bitflip" else None
        case = Case(index=i, kind=kind, rank=rank, step=step, dist_opt=dist_opt, phase=phase, tp=tp,
                    recovery_rank=recovery_rank, damage_seed=damage_seed)
        if case.needs_insurance or spec.recovery_kill or spec.store != "kept":
            case = dataclasses.replace(case, step=max(step, 2))
        if spec.store_node:  # node 0 hosts the primary store: its rank is the one lost with it (SIGKILL)
            case = dataclasses.replace(case, rank=0)
        if spec.whole_node:  # the lost node's first rank (for the record: the fault names the node)
            case = dataclasses.replace(case, rank=LOST_NODE * DEVICES)
        if spec.partition:  # the first node cut off (for the record: the fault names the nodes)
            case = dataclasses.replace(case, rank=PARTITIONS[spec.partition]["nodes"][0])
        if spec.partition and PARTITIONS[spec.partition]["heal_after_s"] is not None:  # the most steps after the cut,
            case = dataclasses.replace(case, step=1)  # so that the job still runs when it heals
        if spec.faults > 1:  # the second fault after the recovered generation completed a step
            first = min(step, steps - 3)
            case = dataclasses.replace(case, step=first, second_rank=rng.randrange(world),
                                       second_step=rng.randrange(first + 1, steps - 1))
        cases.append(case)
    return cases
