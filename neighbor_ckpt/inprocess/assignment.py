"""Rank assignment per generation: a pure function of the previous assignment and the processes that joined.

Every process of a generation computes the same :class:`Assignment` from the same canonical member list (the
barrier's outcome, :mod:`neighbor_ckpt.inprocess.generation`), so no rank decides for the others and nothing is
sent. The rules:

* **Survivors keep their rank numbers**, so each finds its own host slots (``rank<r>/``) and its ring neighbours
  where they were; only a process new to a rank (a spare) pulls that rank's state from the ring successor.
* **Spares fill lost ranks**, the lowest process index first, the lowest lost rank first. A spare is any member
  without a rank: a hot spare started with the job, a survivor left idle by an earlier shrink, a replacement process
  a launcher started.
* **Elastic shrink** (an :class:`~neighbor_ckpt.recovery.reshard.ElasticPolicy`): when spares run out, the world
  shrinks to the largest size the policy allows; the ranks below it keep their numbers, holes below it are filled by
  the survivors numbered highest first (backfill), and survivors beyond it become idle spares. An idle survivor's
  host store takes no part in the reshard, so when the survivors' nodes say what they hold (``holdings``), the
  survivors kept are ones whose nodes hold every old rank's snapshot of one iteration, the newest such: a survivor
  whose node holds the only copy of a lost rank's replica stays, one whose snapshot its successor also holds may go
  idle. Without holdings, or when no choice covers an iteration, the order above decides.
* Otherwise the generation cannot go on in process: :class:`GiveUp` says why, and every process falls back to the
  launcher's restart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import AbstractSet, Mapping, Optional, Sequence

from neighbor_ckpt.recovery.reshard import ElasticPolicy

__all__ = ["Assignment", "GiveUp", "Holdings", "covering", "initial_assignment", "next_assignment"]


@dataclass(frozen=True)
class Assignment:
    """Who is which rank in one generation."""

    world_size: int
    """Active ranks of the generation."""
    ranks: Mapping[int, int]
    """Process index -> rank, for the active processes."""
    spares: tuple[int, ...]
    """Idle members (hot spares), in process order."""
    filled: Mapping[int, int]
    """Rank -> process index, for the ranks taken over by a spare in this generation (a process new to the rank)."""
    shrunk_from: Optional[int] = None
    """The previous world size, when this generation shrank (elastic)."""

    def rank_of(self, process: int) -> Optional[int]:
        """This process's rank, None for an idle spare."""
        return self.ranks.get(process)

    def to_json(self) -> str:
        return json.dumps({"world_size": self.world_size, "ranks": {str(p): r for p, r in sorted(self.ranks.items())},
                           "spares": list(self.spares), "filled": {str(r): p for r, p in sorted(self.filled.items())},
                           "shrunk_from": self.shrunk_from})

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Assignment":
        d = json.loads(raw)
        return cls(world_size=int(d["world_size"]), ranks={int(p): int(r) for p, r in d["ranks"].items()},
                   spares=tuple(int(p) for p in d["spares"]), filled={int(r): int(p) for r, p in d["filled"].items()},
                   shrunk_from=None if d.get("shrunk_from") is None else int(d["shrunk_from"]))

    def describe(self) -> str:
        """One line for the log."""
        parts = [f"{self.world_size} ranks"]
        if self.filled:
            parts.append("spares " + ", ".join(f"{p} -> rank {r}" for r, p in sorted(self.filled.items())))
        if self.shrunk_from is not None:
            parts.append(f"shrunk from {self.shrunk_from}")
        if self.spares:
            parts.append(f"idle {list(self.spares)}")
        return "; ".join(parts)


@dataclass(frozen=True)
class GiveUp:
    """No assignment lets the job go on in process."""

    reason: str


def initial_assignment(processes: int, spares: int) -> Assignment:
    """Generation 0: processes ``0..active-1`` are ranks ``0..active-1``, the last ``spares`` are idle."""
    if not 0 <= spares < processes:
        raise ValueError(f"{spares} spare(s) for {processes} process(es): needs 0 <= spares < processes")
    active = processes - spares
    return Assignment(world_size=active, ranks={p: p for p in range(active)},
                      spares=tuple(range(active, processes)), filled={})


Holdings = Mapping[int, AbstractSet[tuple[int, int]]]
"""Process index -> the (old rank, iteration) snapshots its node's host store holds of the previous layout (own and
replica copies, committed)."""


def next_assignment(prev: Assignment, members: frozenset[int] | set[int], *,
                    elastic: Optional[ElasticPolicy] = None, holdings: Optional[Holdings] = None) -> Assignment | GiveUp:
    """The assignment of the generation after ``prev`` whose barrier admitted ``members`` (process indices);
    ``holdings`` (a shrink: which survivors stay active) as in the module docstring."""
    members = frozenset(members)
    survivors = {p: r for p, r in prev.ranks.items() if p in members}
    lost = sorted(r for p, r in prev.ranks.items() if p not in members)
    idle = sorted(p for p in members if p not in prev.ranks)
    ranks = dict(survivors)
    filled: dict[int, int] = {}
    for r, p in zip(lost, idle):
        ranks[p] = r
        filled[r] = p
    spares = tuple(idle[len(filled):])
    unfilled = lost[len(filled):]
    if not unfilled:
        return Assignment(world_size=prev.world_size, ranks=ranks, spares=spares, filled=filled)
    active = len(ranks)
    if elastic is None:
        return GiveUp(f"no hot spare left to replace the lost rank(s) {unfilled} ({active} of {prev.world_size} "
                      f"active ranks remain)")
    world = elastic.world_size(active)
    if world is None:
        return GiveUp(f"no hot spare left and no smaller world to continue with: {elastic.why_not(active)}")
    order = sorted((p for p, r in ranks.items() if r < world), key=lambda p: ranks[p]) + \
        sorted((p for p, r in ranks.items() if r >= world), key=lambda p: -ranks[p])
    chosen = covering(order, world, holdings or {}, owners=prev.world_size) or order[:world]
    keep = {p: ranks[p] for p in chosen if ranks[p] < world}
    holes = sorted(set(range(world)) - set(keep.values()))
    for r, p in zip(holes, [p for p in order if p in chosen and p not in keep]):
        keep[p] = r
    left_idle = tuple(sorted(set(spares) | (set(order) - set(chosen))))
    filled = {r: p for r, p in filled.items() if keep.get(p) == r}
    return Assignment(world_size=world, ranks=keep, spares=left_idle, filled=filled, shrunk_from=prev.world_size)


def covering(order: Sequence[int], world: int, holdings: Holdings, *, owners: int) -> Optional[list[int]]:
    """``world`` processes of ``order`` (the preferred first) whose nodes together hold a snapshot of every old rank
    ``0..owners-1`` at one iteration, the newest iteration such a choice covers; the first ``world`` of ``order`` when
    they do. None: no choice found (or nothing is known). A greedy cover, linear in the copies held: the only holder
    of an old rank first, then for each old rank not yet held the holder that holds the most of those left."""
    by_iteration: dict[int, dict[int, list[int]]] = {}  # iteration -> process -> old ranks its node holds
    for p in order:
        for o, it in holdings.get(p, ()):
            if 0 <= o < owners:
                by_iteration.setdefault(it, {}).setdefault(p, []).append(o)
    usual = set(order[:world])
    for it in sorted(by_iteration, reverse=True):
        covers = by_iteration[it]
        holders: dict[int, list[int]] = {}
        for p in order:  # each old rank's holders, in the order preferred
            for o in covers.get(p, ()):
                holders.setdefault(o, []).append(p)
        if len(holders) < owners:
            continue
        if all(any(p in usual for p in h) for h in holders.values()):
            return list(order[:world])
        chosen: set[int] = set()
        held: set[int] = set()
        for o in [o for o in range(owners) if len(holders[o]) == 1] + list(range(owners)):
            if o not in held:
                p = max(holders[o], key=lambda q: sum(x not in held for x in covers[q]))  # first of equals
                chosen.add(p)
                held.update(covers[p])
        if len(chosen) <= world:
            rest = set([p for p in order if p not in chosen][:world - len(chosen)])
            return [p for p in order if p in chosen or p in rest]
    return None
