"""Version reconciliation: which iteration every rank restores, and from where. Pure functions.

Every rank reports the versions it can serve: its own slots, the replicas it holds for its ring
predecessor, and the lazy backups of its DP group. The target is the latest iteration that *every* rank
can restore (with two versions kept and the engine's wait point, that is at worst the second newest):
a rank restores from its own slot if it has the version, else from the replica another rank holds of it (the one
whose replica slots name it as their owner: its ring successor when the snapshots were taken, which need not be its
successor now: a spare that took one rank of a node changes a cross-node ring). DP
groups whose plan has lazy (redundant) tensors also need one member holding a lazy backup of that
iteration. No such iteration: fall back to insurance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["RankVersions", "RecoveryDecision", "reconcile", "encode_row", "decode_row", "SOURCE_OWN",
           "SOURCE_REPLICA"]

SOURCE_OWN = "own"
SOURCE_REPLICA = "replica"


@dataclass(frozen=True)
class RankVersions:
    """What one rank can serve after a restart."""

    rank: int
    successor: int
    dp_group: int
    """Lowest global rank of the DP group (its id)."""
    own: frozenset[int] = frozenset()
    replica: frozenset[int] = frozenset()
    """Versions of rank :attr:`replica_of`'s state held by this rank (its ring predecessor's when they were taken)."""
    lazy: frozenset[int] = frozenset()
    needs_lazy: bool | None = None
    """Whether this rank's snapshots say its DP group has lazy state (None: no snapshot to tell)."""
    layout_mismatch: bool = False
    replica_of: int = -1
    """The rank whose state :attr:`replica` holds, as its slots name their owner (-1: not said: its current ring
    predecessor's, the rank whose :attr:`successor` it is)."""


@dataclass(frozen=True)
class RecoveryDecision:
    """The outcome of :func:`reconcile`, identical on every rank."""

    iteration: int | None
    sources: dict[int, str] = field(default_factory=dict)
    """Per rank: ``own`` or ``replica`` (pulled from :attr:`replica_holders`)."""
    lazy_holders: dict[int, int] = field(default_factory=dict)
    """Per DP group id that needs lazy state: the rank whose lazy backup is used."""
    reason: str = ""
    replica_holders: dict[int, int] = field(default_factory=dict)
    """Per rank restoring from a replica: the rank that holds it (sends it)."""

    @property
    def recoverable(self) -> bool:
        return self.iteration is not None


def reconcile(table: Sequence[RankVersions], exclude: frozenset[tuple[int, int, str]] = frozenset(),
              failed_iterations: frozenset[int] = frozenset()) -> RecoveryDecision:
    """Pick the target iteration. ``exclude`` holds (rank, iteration, source) that failed verification;
    ``failed_iterations`` the iterations a previous attempt restored and then died before completing a step
    (never chosen again: no restart loop)."""
    by_rank = {r.rank: r for r in table}
    groups: dict[int, list[RankVersions]] = {}
    for r in table:
        groups.setdefault(r.dp_group, []).append(r)
    needs_lazy = {g: any(m.needs_lazy for m in ms) for g, ms in groups.items()}

    candidates: set[int] = set()
    for r in table:
        candidates |= r.own | r.replica | r.lazy
    if not candidates:
        return RecoveryDecision(None, reason="no rank holds any in-memory snapshot")

    why_not: dict[int, str] = {}
    for it in sorted(candidates, reverse=True):
        if it in failed_iterations:
            why_not[it] = (f"iteration {it} was restored by a previous attempt that died before completing a step "
                           f"after it; a state that failed once is not chosen again")
            continue
        sources: dict[int, str] = {}
        replica_holders: dict[int, int] = {}
        missing = None
        for r in table:
            holder = next((h.rank for h in table if h.replica_of == r.rank and it in h.replica), None)
            succ = by_rank.get(r.successor)
            if holder is None and succ is not None and succ.replica_of == -1 and it in succ.replica:
                holder = succ.rank
            if it in r.own and (r.rank, it, SOURCE_OWN) not in exclude:
                sources[r.rank] = SOURCE_OWN
            elif holder is not None and (r.rank, it, SOURCE_REPLICA) not in exclude:
                sources[r.rank], replica_holders[r.rank] = SOURCE_REPLICA, holder
            else:
                missing = f"rank {r.rank} has no copy of iteration {it} (own slot lost, no rank holds its replica: " \
                          f"rank {r.successor}, its successor, lost)"
                break
        if missing is None:
            holders: dict[int, int] = {}
            for g, ms in groups.items():
                if not needs_lazy[g]:
                    continue
                have = sorted(m.rank for m in ms if it in m.lazy and (m.rank, it, "lazy") not in exclude)
                if not have:
                    missing = f"no rank of DP group {g} holds a lazy backup of iteration {it}"
                    break
                holders[g] = have[0]
            if missing is None:
                return RecoveryDecision(it, sources, holders, reason=f"iteration {it} restorable by all ranks",
                                        replica_holders=replica_holders)
        why_not[it] = missing
    latest = max(why_not)
    return RecoveryDecision(None,
                            reason=f"no iteration is restorable by every rank; newest candidate: {why_not[latest]}")


def encode_row(r: RankVersions, versions: int) -> torch.Tensor:
    """Fixed-size int64 row for an all-gather (-1 marks an empty entry)."""
    def pad(s: frozenset[int]) -> list[int]:
        v = sorted(s, reverse=True)[:versions]
        return v + [-1] * (versions - len(v))
    nl = -1 if r.needs_lazy is None else int(r.needs_lazy)
    row = [r.rank, r.successor, r.dp_group, nl, int(r.layout_mismatch), r.replica_of] + pad(r.own) + pad(r.replica) \
        + pad(r.lazy)
    return torch.tensor(row, dtype=torch.int64)


def decode_row(t: torch.Tensor, versions: int) -> RankVersions:
    v = [int(x) for x in t.tolist()]
    def s(a: list[int]) -> frozenset[int]:
        return frozenset(x for x in a if x >= 0)
    o = 6
    return RankVersions(rank=v[0], successor=v[1], dp_group=v[2], needs_lazy=None if v[3] < 0 else bool(v[3]),
                        layout_mismatch=bool(v[4]), replica_of=v[5], own=s(v[o:o + versions]),
                        replica=s(v[o + versions:o + 2 * versions]), lazy=s(v[o + 2 * versions:o + 3 * versions]))
