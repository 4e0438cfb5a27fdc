"""Fault injection's configuration (``neighbor_ckpt.fault_injection``, a section of
:class:`~neighbor_ckpt.config.NeighborCkptConfig`): the faults a demo or a campaign plans, and which injector can
inject which (:meth:`FaultInjectionConfig.refuse_unsupported`). Never on in production."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.validation import Problems, check_tree, check_types, checked, deferred

__all__ = ["FAULT_TARGETS", "FaultSpec", "FaultInjectionConfig"]

FAULT_TARGETS = ("rank", "store_node", "node", "partition")
"""What a planned fault kills (``fault_injection.target``; :attr:`FaultSpec.target`)."""


@checked("neighbor_ckpt.fault_injection.faults[]")
@dataclass(frozen=True, kw_only=True, slots=True)
class FaultSpec:
    """One planned fault, as every injector reads it (:meth:`FaultInjectionConfig.planned`): the one-fault keys of
    ``neighbor_ckpt.fault_injection`` with their defaults, also the keys of each ``faults`` entry. It fires once, in
    the first launch attempt, in whichever in-process generation runs its step first (:meth:`fires`); ``rank`` is a
    rank of that generation (after a spare took a lost rank's place, the spare)."""

    target: Literal["rank", "store_node", "node", "partition"] = "rank"
    """``rank``: the process of rank ``rank``. ``store_node`` (in process, the plain megatron-core recipe only): the
    node hosting the store in use; SIGKILL: its launcher, store host and rank; SIGSTOP: its store host, for good.
    ``node`` (in process, or simulated torchrun nodes): node ``node`` whole, its ranks SIGKILL its launcher (agent)
    and its processes and store host die with it, never to come back; SIGSTOP (in process): its launcher and ranks
    hang, and the launch ends them once the job completed. ``rank`` is not read by those two. ``partition`` (with
    ``launch.simulate_network``): the network between ``nodes`` and the other nodes is cut; rank ``rank`` runs the cut
    and is not harmed by it (docs/nodes.md, network partitions)."""

    rank: int = 1
    """The rank that is killed: a rank number of the generation that runs ``step``."""

    node: int = 1
    """``target: node``: the index of the node lost (``node<N>`` on one machine; the one hosting store ``N``)."""

    step: int = 5
    """Global step (0-based) in which it is killed."""

    phase: Literal["forward", "backward", "optimizer"] = "optimizer"
    """Where in the step: start of the forward pass, before the backward pass, or inside the optimizer step
    (weights torn)."""

    signal: Literal["SIGKILL", "SIGSTOP"] = "SIGKILL"
    """SIGKILL: the process dies. SIGSTOP: it hangs (the detector notices within ``detector.timeout_s``)."""

    replace_store: bool = True
    """The killed rank restarts with an empty host store, as a replaced node would (the restart path; in process
    a spare takes its place, and a spare's store is empty anyway)."""

    permanent: bool = False
    """The victim never comes back: its node is gone. The launcher agent that started it is killed with it, so no
    restart brings that rank back (in-process recovery: no spare is started for it either); with
    ``elastic.enabled`` the job goes on with a smaller data-parallel size."""

    nodes: list[int] | None = None
    """``target: partition``: the node indices of the side cut off (they stay connected to each other)."""

    heal_after_s: float | None = None
    """``target: partition``: the cut heals this many seconds later (null: never)."""

    traffic: Literal["all", "ranks"] = "all"
    """``target: partition``: ``all`` cuts every path (stores, gates, gloo), ``ranks`` only the ranks' connections."""

    def _check(self, p: Problems) -> None:
        p.at_least("rank", self.rank, 0)
        p.at_least("step", self.step, 0)
        p.at_least("node", self.node, 0)
        p.above("heal_after_s", self.heal_after_s, 0, " (or null: never)", optional=True)
        p.check(self.target != "partition" or bool(self.nodes), "nodes",
                "target: partition needs the nodes cut off (a list of node indices)")
        p.check(all(not isinstance(n, int) or n >= 0 for n in self.nodes or ()), "nodes",
                f"{self.nodes}: node indices are >= 0")

    def fires(self, *, rank: int, step: int, phase: str, launch: int, generation: int, start_step: int,
              hosts_store: bool = False, node: int | None = None) -> bool:
        """Whether this fault fires now (pure): rank ``rank`` of in-process generation ``generation`` of launch
        attempt ``launch`` is in ``phase`` of ``step``, and that generation started (resumed) at ``start_step``;
        ``hosts_store``: its node hosts the store in use; ``node``: its node's index (None: unknown, never fires).

        Once per launch: only in the first launch attempt, and, after generation 0, only at a step beyond the one its
        generation resumed at (the steps up to it ran in an earlier generation, which is where this fault fired or
        was passed). So a fault that killed a rank in step 3 does not fire again when the next generation replays
        step 3, and one at step 7 fires in that next generation. A partition fires in generation 0 only: the rank
        that cuts survives it, and a cut early in training can be replayed from an iteration before its step (the
        campaign saw one cut twice, 14 s apart)."""
        victim = {"rank": rank == self.rank, "store_node": hosts_store, "partition": rank == self.rank,
                  "node": node is not None and node == self.node}[self.target]
        later = generation == 0 or (step > start_step and self.target != "partition")
        return launch == 0 and victim and step == self.step and phase == self.phase and later

    def describe(self) -> str:
        """``SIGKILL of rank 1 in the optimizer phase of step 5``."""
        if self.target == "partition":
            heal = "never healed" if self.heal_after_s is None else f"healed after {self.heal_after_s:g} s"
            return (f"partition of node(s) {self.nodes} ({self.traffic} traffic, {heal}) in the {self.phase} phase of "
                    f"step {self.step}")
        who = {"rank": f"rank {self.rank}", "store_node": "the store's node",
               "node": f"node {self.node} (its launcher, store host and every process)"}[self.target]
        return f"{self.signal} of {who} in the {self.phase} phase of step {self.step}"


_ONE_FAULT_KEYS = ("target", "rank", "node", "step", "phase", "signal", "replace_store", "permanent", "nodes",
                   "heal_after_s", "traffic")
"""The keys of the one-fault form: every one of them is also a key of each ``faults`` entry."""


@checked("neighbor_ckpt.fault_injection")
@dataclass(kw_only=True, slots=True)
class FaultInjectionConfig:
    """For demos and fault campaigns only: kill ranks at chosen steps of the first launch attempt.

    Two forms, not both at once: the one-fault keys (a key left out takes :class:`FaultSpec`'s default), or
    ``faults``, a list of entries that each take those keys (several faults in one launch)::

        fault_injection: {enabled: true, rank: 1, step: 5}
        fault_injection:
          enabled: true
          faults: [{rank: 1, step: 3}, {rank: 2, step: 7}]   # in process: the second in the next generation

    Read them through :meth:`planned` (one :class:`FaultSpec` per fault); each fires once (:meth:`FaultSpec.fires`)."""

    enabled: bool = False
    """Inject the planned faults. Never on in production."""

    target: Literal["rank", "store_node", "node", "partition"] | None = None
    """One-fault form: what fails, ``rank`` (the default), ``store_node``, ``node`` or ``partition``
    (:attr:`FaultSpec.target`)."""

    rank: int | None = None
    """One-fault form: the rank that is killed (default 1)."""

    node: int | None = None
    """One-fault form, ``target: node``: the index of the node lost (default 1)."""
    step: int | None = None
    """One-fault form: the global step (0-based) in which it is killed (default 5)."""

    phase: Literal["forward", "backward", "optimizer"] | None = None
    """One-fault form: where in the step (default ``optimizer``; :attr:`FaultSpec.phase`)."""

    signal: Literal["SIGKILL", "SIGSTOP"] | None = None
    """One-fault form: SIGKILL (the default: the process dies) or SIGSTOP (it hangs; :attr:`FaultSpec.signal`)."""

    replace_store: bool | None = None
    """One-fault form: the killed rank restarts with an empty host store (default true)."""

    permanent: bool | None = None
    """One-fault form: the victim's node is gone for good (default false; :attr:`FaultSpec.permanent`)."""

    nodes: list[int] | None = None
    """One-fault form, ``target: partition``: the nodes cut off (:attr:`FaultSpec.nodes`)."""

    heal_after_s: float | None = None
    """One-fault form, ``target: partition``: when the cut heals (default never; :attr:`FaultSpec.heal_after_s`)."""

    traffic: Literal["all", "ranks"] | None = None
    """One-fault form, ``target: partition``: what is cut (default ``all``; :attr:`FaultSpec.traffic`)."""

    faults: list[Any] | None = None
    """Several faults in one launch: a list of entries, each taking the one-fault keys (not together with them)."""

    def _check(self, p: Problems) -> None:
        p.at_least("rank", self.rank, 0, optional=True)
        p.at_least("step", self.step, 0, optional=True)
        if self.faults is None:
            p.above("heal_after_s", self.heal_after_s, 0, " (or null: never)", optional=True)
            p.check(self.target != "partition" or bool(self.nodes), "nodes",
                    "target: partition needs the nodes cut off (a list of node indices)")
            return
        given = [k for k in _ONE_FAULT_KEYS if getattr(self, k) is not None]
        if given:
            p.add("faults", f"given together with the one-fault key(s) {', '.join(given)}: use one form, either the "
                            "one-fault keys (one fault) or faults: [{rank: ..., step: ...}, ...] (each entry takes "
                            "every one-fault key), not both")
        if self.enabled and not self.faults:
            p.add("faults", "an empty list plans no fault: list at least one, or set fault_injection.enabled: false")
        for i, entry in enumerate(self.faults):
            _check_fault_entry(entry, p.at(f"faults[{i}]"))

    def planned(self) -> tuple[FaultSpec, ...]:
        """The faults to inject, in one form (pure): ``()`` when not enabled; the ``faults`` entries; or the one
        fault of the one-fault keys (a key left out: :class:`FaultSpec`'s default)."""
        if not self.enabled:
            return ()
        if self.faults is not None:
            return tuple(FaultSpec(**entry) for entry in self.faults)
        return (FaultSpec(**{k: getattr(self, k) for k in _ONE_FAULT_KEYS if getattr(self, k) is not None}),)

    def refuse_unsupported(self, *, phases: tuple[str, ...] = ("forward", "backward", "optimizer"),
                           where: str = "", store_node: bool = False, node: bool = False,
                           hung_node: bool = False, partition: bool = False) -> tuple[FaultSpec, ...]:
        """:meth:`planned`, for an injector: raise :class:`ConfigError` for a fault it cannot inject (a phase
        outside ``phases``; ``target: store_node`` unless ``store_node``: an in-process launch whose injector
        implements it; ``target: node`` unless ``node``: a launcher or agent per node; with SIGSTOP unless
        ``hung_node``: in process; ``target: partition`` unless ``partition``: a launch with
        ``launch.simulate_network``), naming the key of each."""
        planned = self.planned()
        lines = []
        for i, f in enumerate(planned):
            key = f"neighbor_ckpt.fault_injection.{f'faults[{i}].' if self.faults is not None else ''}"
            not_here = where and ", not" + where
            if f.target == "store_node" and not store_node:
                lines.append(f"{key}target: store_node (the node hosting the store in use) is injected only in process "
                             f"(neighbor_ckpt.inprocess.enabled: true) by recipes/mcore_gpt_plain_loop.py{not_here}; "
                             "use target: rank")
            if f.target == "node" and not node:
                lines.append(f"{key}target: node (a whole node) is injected only where each node has a launcher of its "
                             "own: in process (neighbor_ckpt.inprocess.enabled: true) or on the simulated nodes of "
                             f"`neighbor-ckpt launch` (trainer.num_nodes > 1){not_here}; use target: rank, permanent")
            if f.target == "partition" and not partition:
                lines.append(f"{key}target: partition (a cut between simulated nodes) needs launch.simulate_network: "
                             f"true, in process (neighbor_ckpt.inprocess.enabled: true){not_here}; use target: node")
            if f.target == "node" and f.signal == "SIGSTOP" and node and not hung_node:
                lines.append(f"{key}signal: SIGSTOP of a whole node is injected only in process; use SIGKILL here")
            if f.phase not in phases:
                lines.append(f"{key}phase: {f.phase!r} is not injected{where} (phases: {', '.join(phases)})")
        if lines:
            raise ConfigError("\n".join(lines))
        return planned

    def replaced_ranks(self) -> frozenset[int]:
        """The ranks whose host store a launcher restart empties (``replace_store``; pure): the targets of the
        faults at the earliest planned step (the restart path restarts the whole job after the first failure, so the
        later faults of the first launch attempt never fire)."""
        planned = [f for f in self.planned() if f.target == "rank"]
        if not planned:
            return frozenset()
        first = min(f.step for f in planned)
        return frozenset(f.rank for f in planned if f.step == first and f.replace_store)


def _check_fault_entry(entry: Any, p: Problems) -> None:
    """One ``faults`` entry: a mapping of the one-fault keys, each of its type and within its rules."""
    if not isinstance(entry, dict):
        p.add("", f"expected a mapping of the one-fault keys ({', '.join(_ONE_FAULT_KEYS)}), got {entry!r}")
        return
    for key in entry:
        if key not in _ONE_FAULT_KEYS:
            p.add(key, f"unknown key (allowed keys of {p.path}: {', '.join(sorted(_ONE_FAULT_KEYS))})")
    with deferred():
        spec = FaultSpec(**{k: v for k, v in entry.items() if k in _ONE_FAULT_KEYS})
    check_types(spec, p)
    check_tree(spec, p)
