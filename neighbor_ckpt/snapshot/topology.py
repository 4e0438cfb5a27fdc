"""Ranks, data-parallel groups, nodes and the DP ring.

:class:`Topology` is a frozen description of one rank's place in the job. It is built either purely
(:func:`build_topology`, used by tests to build every rank's view in one process) or collectively from
explicit process groups (:func:`discover_topology`). Nothing here reads global process-group state.
"""

from __future__ import annotations

import os
import socket
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import torch.distributed as dist

from neighbor_ckpt.errors import TopologyError

__all__ = ["Topology", "build_topology", "ring_order", "discover_topology", "NODE_ID_ENV"]

NODE_ID_ENV = "NEIGHBOR_CKPT_NODE_ID"
"""Overrides the node identity of a process (default: the hostname). Tests use it to lay out several
"nodes" on one machine."""

_NODE_ID_BYTES = 64


@dataclass(frozen=True)
class Topology:
    """One rank's view of the job layout.

    Attributes:
        rank: global rank.
        world_size: number of ranks in the job.
        dp_ranks: global ranks of this rank's data-parallel group, in DP-rank order.
        ring: the same ranks in ring order; each holds the replica of its predecessor.
        nodes: node id of every global rank.
        model_parallel_coord: (tp, pp, cp) coordinate shared by the DP group; part of the layout hash.
    """

    rank: int
    world_size: int
    dp_ranks: tuple[int, ...]
    ring: tuple[int, ...]
    nodes: tuple[str, ...]
    model_parallel_coord: tuple[int, ...] = ()

    @property
    def dp_size(self) -> int:
        return len(self.dp_ranks)

    @property
    def dp_rank(self) -> int:
        return self.dp_ranks.index(self.rank)

    @property
    def dp_group_id(self) -> str:
        """A stable name of the DP group (its lowest global rank), used to name lazy backups."""
        return f"dp{min(self.dp_ranks)}"

    def successor_of(self, rank: int) -> int:
        """The rank that holds ``rank``'s replica."""
        i = self.ring.index(rank)
        return self.ring[(i + 1) % len(self.ring)]

    def predecessor_of(self, rank: int) -> int:
        """The rank whose replica ``rank`` holds."""
        i = self.ring.index(rank)
        return self.ring[(i - 1) % len(self.ring)]

    @property
    def successor(self) -> int:
        return self.successor_of(self.rank)

    @property
    def predecessor(self) -> int:
        return self.predecessor_of(self.rank)

    @property
    def node(self) -> str:
        return self.nodes[self.rank]

    def cross_node_fraction(self) -> float:
        """Share of ring edges whose two ends are on different nodes (1.0 is ideal)."""
        if len(self.ring) < 2:
            return 0.0
        edges = [(r, self.successor_of(r)) for r in self.ring]
        return sum(self.nodes[a] != self.nodes[b] for a, b in edges) / len(edges)


def ring_order(members: Sequence[int], nodes: Sequence[str], policy: Literal["cross_node", "next"]) -> tuple[int, ...]:
    """Order ``members`` into a ring.

    ``next`` keeps DP order. ``cross_node`` deals members round-robin from their nodes (largest node
    first), so consecutive ring members sit on different nodes whenever the counts allow it.
    """
    if policy == "next":
        return tuple(members)
    by_node: OrderedDict[str, list[int]] = OrderedDict()
    for r in members:
        by_node.setdefault(nodes[r], []).append(r)
    if len(by_node) <= 1:
        return tuple(members)
    n = len(members)
    if all(nodes[members[i]] != nodes[members[(i + 1) % n]] for i in range(n)):
        return tuple(members)  # DP order already alternates nodes
    # Members grouped by node, largest node first, dealt to ring positions 0, 2, 4, ... then 1, 3, 5, ...:
    # no two neighbours share a node unless one node holds more than half of the group.
    flat = [r for group in sorted(by_node.values(), key=len, reverse=True) for r in group]
    n = len(flat)
    order: list[int] = [0] * n
    positions = list(range(0, n, 2)) + list(range(1, n, 2))
    for pos, r in zip(positions, flat):
        order[pos] = r
    return tuple(order)


def build_topology(
    *,
    rank: int,
    world_size: int,
    dp_ranks: Sequence[int],
    nodes: Sequence[str] | None = None,
    policy: Literal["cross_node", "next"] = "cross_node",
    model_parallel_coord: Sequence[int] = (),
) -> Topology:
    """Pure constructor: validates the inputs and computes the ring."""
    dp = tuple(int(r) for r in dp_ranks)
    if rank not in dp:
        raise TopologyError(f"rank {rank} is not in its own data-parallel group {list(dp)}")
    if len(set(dp)) != len(dp) or any(not 0 <= r < world_size for r in dp):
        raise TopologyError(f"invalid data-parallel group {list(dp)} for world size {world_size}")
    node_ids = tuple(nodes) if nodes is not None else tuple("node0" for _ in range(world_size))
    if len(node_ids) != world_size:
        raise TopologyError(f"expected {world_size} node ids, got {len(node_ids)}")
    return Topology(
        rank=rank,
        world_size=world_size,
        dp_ranks=dp,
        ring=ring_order(dp, node_ids, policy),
        nodes=node_ids,
        model_parallel_coord=tuple(model_parallel_coord),
    )


def local_node_id() -> str:
    """This process's node identity (NEIGHBOR_CKPT_NODE_ID or the hostname)."""
    return os.environ.get(NODE_ID_ENV) or socket.gethostname()


def discover_topology(
    *,
    world_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup | None,
    policy: Literal["cross_node", "next"] = "cross_node",
    model_parallel_coord: Sequence[int] = (),
) -> Topology:
    """Collective (all ranks of ``world_group``): gather node ids and build this rank's topology.

    ``world_group`` must be a gloo (CPU) group. ``dp_group`` None means the whole world is one DP group.
    """
    rank = dist.get_rank(world_group)
    world_size = dist.get_world_size(world_group)
    raw = local_node_id().encode()[:_NODE_ID_BYTES].ljust(_NODE_ID_BYTES, b"\0")
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=world_group)
    nodes = [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in gathered]
    dp_ranks = dist.get_process_group_ranks(dp_group) if dp_group is not None else list(range(world_size))
    return build_topology(
        rank=rank, world_size=world_size, dp_ranks=dp_ranks, nodes=nodes, policy=policy,
        model_parallel_coord=model_parallel_coord,
    )
