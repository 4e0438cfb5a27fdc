"""MTTR of one lost rank, by recovery mode: restart (every process re-launched) and in-process (survivors stay).

Pure (stdlib only). MTTR here is what the user waits: from the failure to the end of the first completed training
step after it, the same definition as the recovery timeline's. It is a sum of phases, each either computed from
the job's :class:`~neighbor_ckpt.planning.planner.JobPlan` (bytes over bandwidths, one step of compute) or taken
from :class:`MttrAssumptions`, whose every figure says where it comes from. The estimate is an order of magnitude
for planning, not a promise: the assumptions are printed next to it (``neighbor-ckpt plan``).

Phases (a rank is lost; its replacement is a re-launched process in the restart mode, a hot spare in process):

==============  ===========================================  ==============================================
phase           restart                                      in-process
==============  ===========================================  ==============================================
detect          heartbeat timeout + one interval             the launcher's exit report, pushed by the store
relaunch        every process re-executed: imports, CUDA     none (the spare is idle with its imports done)
                context, rendezvous, process groups, model
regroup         (inside relaunch)                            abort + re-form every process group, rebuild
                                                             the model/optimizer objects of the attempt
reconcile       version agreement (a few collectives)        same
transfer        the replacement pulls the lost rank's        same (the spare pulls it)
                unique bytes from its ring successor
restore         host-to-device copy of the unique bytes,     same
                weights regenerated (all-gather over DP)
first step      the interrupted step again                   same
==============  ===========================================  ==============================================

A third row, ``store-node`` (in process), is the loss of the node that hosts the job's store: its rank is lost and
the store with it. Its detection is longer (:attr:`MttrAssumptions.store_failover_detect_s`: the store's operations
go unanswered, the next standby is promoted and written again, then the lost node's rank is found silent there);
the rest is the in-process row's.

A fourth row, ``node-lost`` (in process), is a whole node lost at once: its launcher, its store host and its
``ranks per node`` processes (a hot spare node takes them all). Nobody reports an exit; the next node's monitor finds
the node's last process and the node's launcher silent and declares every process of the node dead in one decision,
so its detection is one detector period (:attr:`MttrAssumptions.detector_timeout_s` +
:attr:`MttrAssumptions.detector_interval_s`) whatever the ranks per node (found one process after another, a node of
``k`` ranks cost ``k`` periods). Each lost rank pulls its own unique bytes from its ring successor on another node
over its own NIC (the presets' bandwidth is per GPU), so the rest is the in-process row's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from neighbor_ckpt.validation import Problems, validate

__all__ = ["MttrAssumptions", "MttrEstimate", "ASSUMPTIONS", "MODES", "assumptions_for", "estimate_mttr", "estimate_both",
           "format_mttr"]

Mode = Literal["restart", "in-process", "store-node", "node-lost"]
MODES: tuple[str, ...] = ("restart", "in-process", "store-node", "node-lost")
PHASES = ("detect", "relaunch", "regroup", "reconcile", "transfer", "restore", "first_step")


@dataclass(frozen=True, kw_only=True, slots=True)
class MttrAssumptions:
    """The figures of the MTTR model that are not computed from the plan (seconds unless named otherwise)."""

    restart_detect_s: float = 6.0
    """Restart mode: our heartbeat detector's defaults (``detector.timeout_s`` 5 s + ``interval_s`` 1 s). A hang
    found by ``hang_timeout_s`` takes that long instead."""

    inprocess_detect_s: float = 1.0
    """In-process: a dead process's launcher reports its exit through the store, which wakes every survivor's
    monitor at once (its supervision loop polls every 50 ms; 0.05-0.1 s measured on the CPU test machine). A stopped
    rank: ``detector.timeout_s`` + one interval; a stuck one: ``detector.hang_timeout_s`` instead."""

    relaunch_floor_s: float = 60.0
    """Restart mode, per launch whatever its size: stop the worker group, re-execute every process, import
    torch/megatron/NeMo, create the CUDA context, build the model. FlashRecovery's optimized restart takes 78-116 s
    from 32 to 4,800 devices (Table III); our 4-rank CPU demo measured 22.5 s (no CUDA, a tiny model)."""

    relaunch_per_rank_s: float = 0.02
    """Restart mode, growth with the world size: rendezvous through one TCPStore and communicator set-up of every
    rank. FlashRecovery's vanilla PyTorch restart grows about linearly, 231 s at 1,824 devices to 1,115 s at 5,472
    (Table II, 0.13-0.2 s per device, checkpoint loading included); 0.02 s per rank is the store and NCCL part."""

    regroup_floor_s: float = 5.0
    """In-process: abort the process groups, re-form them (NCCL communicators of every group), rebuild the model,
    DDP and optimizer objects of the wrapped function (allocation, no I/O). HyperPod reports 47 s end to end at
    256 GPUs for its in-process path including detection and state transfer; 0.8 s measured on 5 CPU processes."""

    regroup_per_rank_s: float = 0.002
    """In-process, growth with the world size: communicator initialisation over the store (a tenth of the restart
    path's rendezvous cost: no re-execution, no rendezvous round of the launcher)."""

    reconcile_s: float = 0.05
    """Version agreement: a few small all-gathers (50 ms measured on 4 CPU ranks)."""

    store_failover_detect_s: float = 30.0
    """In process, the node hosting the store lost (``store-node``): a store operation unanswered for its timeout
    (twice ``detector.timeout_s``: 10 s with the defaults) and once more on a new connection, then the move to the
    next standby (promotion, every process writing its part again: well under a second), then the lost node's rank
    silent there for ``detector.timeout_s`` + the same again of grace. With the CPU job files' 2 s timeout: about
    12 s, and 13-15 s from the kill to the next generation was seen in ``tests/e2e/test_store_failover.py``."""

    detector_timeout_s: float = 5.0
    """The job's ``detector.timeout_s`` (``neighbor-ckpt plan`` takes it from the job file; the default's here): a
    lost node (``node-lost``) is declared dead this long after its last heartbeat, at the next look."""

    detector_interval_s: float = 1.0
    """The job's ``detector.interval_s``: how late the look at a silent node comes, at most (one heartbeat period)."""

    def __post_init__(self) -> None:
        validate(self, "MttrAssumptions")

    @property
    def node_lost_detect_s(self) -> float:
        """A whole node lost, in process: one detector period, whatever the ranks per node (one decision)."""
        return self.detector_timeout_s + self.detector_interval_s

    def _check(self, p: Problems) -> None:
        for f in dataclasses.fields(self):
            p.non_negative(f.name, getattr(self, f.name))


@dataclass(frozen=True, kw_only=True, slots=True)
class MttrEstimate:
    """One mode's MTTR, phase by phase (seconds)."""

    mode: Mode
    phases: dict[str, float]
    """Every name of :data:`PHASES`, in that order; 0 where the mode has no such phase."""

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "phases_s": dict(self.phases), "total_s": self.total_s}


ASSUMPTIONS: dict[str, MttrAssumptions] = {
    # The CPU test machines (2 cores, gloo, a tiny GPT): what scripts/demo and the in-process e2e test measure there
    # (restart: 23.8 s MTTR of which 22.5 s re-launch; in process: 0.76-0.97 s in all, detection 0.1-0.3 s).
    "cpu": MttrAssumptions(restart_detect_s=1.5, inprocess_detect_s=0.2, relaunch_floor_s=22.0,
                           relaunch_per_rank_s=0.1, regroup_floor_s=0.4, regroup_per_rank_s=0.02,
                           store_failover_detect_s=12.0),
}
"""Assumptions by hardware preset name (``hardware.gpu`` of a job file); others get :class:`MttrAssumptions`'s."""


def assumptions_for(hardware_name: str, detector: Any = None) -> MttrAssumptions:
    """The MTTR assumptions for a hardware preset; ``detector`` (the job's
    :class:`~neighbor_ckpt.config.DetectorConfig`, None: the defaults) gives the detector period of ``node-lost``."""
    a = ASSUMPTIONS.get(hardware_name, MttrAssumptions())
    if detector is None:
        return a
    return dataclasses.replace(a, detector_timeout_s=float(detector.timeout_s),
                               detector_interval_s=float(detector.interval_s))


def estimate_mttr(plan: Any, mode: Mode, assumptions: MttrAssumptions | None = None) -> MttrEstimate:
    """MTTR of one lost rank of ``plan`` (a :class:`~neighbor_ckpt.planning.planner.JobPlan`) in ``mode``; of one
    lost node (its ranks per node at once) in ``node-lost``.

    The rank class that takes longest (most unique bytes, longest step) bounds the job: every rank waits for it.
    """
    a = assumptions or assumptions_for(plan.hardware.name)
    p = Problems()
    p.one_of("mode", mode, MODES)
    p.raise_if_any()
    hw, world = plan.hardware, plan.world_size
    nic = hw.nic_gbits_per_s * 1e9 / 8
    pcie = hw.pcie_gbytes_per_s * 1e9
    dp = plan.parallel.dp * plan.parallel.cp
    unique = max(c.unique_bytes for c in plan.classes)
    params = max(c.params_per_rank for c in plan.classes)
    # Weights regenerated from the fp32 shards: an all-gather of the bf16 weights over the DP group, in which each
    # rank receives (dp-1)/dp of them. Without the distributed optimizer the weights are local (nothing to gather).
    gather = 2 * params * (dp - 1) / dp / nic if plan.parallel.distributed_optimizer else 0.0
    shared = {"reconcile": a.reconcile_s, "transfer": unique / nic, "restore": unique / pcie + gather,
              "first_step": max(c.compute_seconds for c in plan.classes)}
    if mode == "restart":
        head = {"detect": a.restart_detect_s, "relaunch": a.relaunch_floor_s + a.relaunch_per_rank_s * world,
                "regroup": 0.0}
    else:
        detect = {"in-process": a.inprocess_detect_s, "store-node": a.store_failover_detect_s,
                  "node-lost": a.node_lost_detect_s}[mode]
        head = {"detect": detect, "relaunch": 0.0, "regroup": a.regroup_floor_s + a.regroup_per_rank_s * world}
    phases = {**head, **shared}
    return MttrEstimate(mode=mode, phases={name: phases[name] for name in PHASES})


def estimate_both(plan: Any, assumptions: MttrAssumptions | None = None) -> dict[str, MttrEstimate]:
    """``{"restart": ..., "in-process": ..., "store-node": ..., "node-lost": ...}`` for ``plan``: both recovery
    modes, and in process the loss of the store's node and of a whole node."""
    return {m: estimate_mttr(plan, m, assumptions) for m in MODES}  # type: ignore[arg-type]


def format_mttr(estimates: dict[str, MttrEstimate], assumptions: MttrAssumptions) -> str:
    """The MTTR table of ``neighbor-ckpt plan`` and the assumptions behind it."""
    a = assumptions
    header = ("mode", *PHASES, "MTTR")
    rows = [header] + [(e.mode, *(f"{e.phases[n]:.3g}" for n in PHASES), f"{e.total_s:.3g}")
                       for e in estimates.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["MTTR of one lost rank (node-lost: a whole node), failure to first completed step (seconds):"]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(2, "  ".join("-" * w for w in widths))
    lines.append("assumptions (planning/mttr.py says where each comes from): "
                 f"detect {a.restart_detect_s:g} s by restart, {a.inprocess_detect_s:g} s in process, "
                 f"{a.store_failover_detect_s:g} s when the store's node is lost (store-node), "
                 f"{a.node_lost_detect_s:g} s when a node is lost (node-lost: detector timeout_s "
                 f"{a.detector_timeout_s:g} + interval_s {a.detector_interval_s:g}, one decision whatever the ranks "
                 "per node); relaunch "
                 f"{a.relaunch_floor_s:g} s + {a.relaunch_per_rank_s:g} s/rank; regroup {a.regroup_floor_s:g} s + "
                 f"{a.regroup_per_rank_s:g} s/rank; reconcile {a.reconcile_s:g} s; transfer = unique bytes / NIC; "
                 "restore = unique bytes / PCIe + weight all-gather over DP; first step = one iteration's compute")
    return "\n".join(lines)
