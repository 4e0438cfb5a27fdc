"""Topology: the DP ring, its cross-node placement and input validation."""

from __future__ import annotations

import pytest

from neighbor_ckpt.errors import TopologyError
from neighbor_ckpt.snapshot.topology import NODE_ID_ENV, build_topology, local_node_id, ring_order


def nodes_from_counts(counts: tuple[int, ...]) -> list[str]:
    """Contiguous ranks per node: (2, 1) -> [n0, n0, n1]."""
    out: list[str] = []
    for i, c in enumerate(counts):
        out += [f"n{i}"] * c
    return out


def views(world: int, dp_ranks, nodes=None, policy="cross_node"):
    """Every member's topology, built from its own view."""
    return [build_topology(rank=r, world_size=world, dp_ranks=dp_ranks, nodes=nodes, policy=policy) for r in dp_ranks]


def edges(topo):
    return [(r, topo.successor_of(r)) for r in topo.ring]


# -- ring --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["next", "cross_node"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_ring_is_a_permutation_and_successor_and_predecessor_are_inverse(n, policy):
    nodes = [f"n{r % 2}" for r in range(n)]
    for topo in views(n, list(range(n)), nodes, policy):
        assert sorted(topo.ring) == list(range(n))
        for r in range(n):
            assert topo.predecessor_of(topo.successor_of(r)) == r
            assert topo.successor_of(topo.predecessor_of(r)) == r
        # following successors visits every member once: one single cycle
        seen, r = [], topo.rank
        for _ in range(n):
            seen.append(r)
            r = topo.successor_of(r)
        assert r == topo.rank and sorted(seen) == list(range(n))
        assert topo.successor == topo.successor_of(topo.rank)
        assert topo.predecessor == topo.predecessor_of(topo.rank)


def test_every_member_computes_the_same_ring():
    nodes = nodes_from_counts((3, 3, 2))
    rings = {t.ring for t in views(8, list(range(8)), nodes)}
    assert len(rings) == 1


def test_next_policy_keeps_dp_order_and_wraps_around():
    topo = build_topology(rank=5, world_size=8, dp_ranks=[1, 3, 5, 7], nodes=nodes_from_counts((4, 4)), policy="next")
    assert topo.ring == (1, 3, 5, 7)
    assert topo.successor == 7 and topo.predecessor == 3
    assert topo.successor_of(7) == 1 and topo.predecessor_of(1) == 7


def test_single_member_ring_is_its_own_neighbor():
    topo = build_topology(rank=3, world_size=4, dp_ranks=[3])
    assert topo.ring == (3,)
    assert topo.successor == topo.predecessor == 3
    assert topo.cross_node_fraction() == 0.0


def test_successor_of_a_rank_outside_the_ring_raises():
    topo = build_topology(rank=0, world_size=4, dp_ranks=[0, 2])
    with pytest.raises(ValueError):
        topo.successor_of(1)


# -- cross-node placement ------------------------------------------------------------------------------------


def test_two_nodes_of_two_ranks_put_every_successor_on_the_other_node():
    nodes = ["a", "a", "b", "b"]
    for topo in views(4, [0, 1, 2, 3], nodes):
        assert all(nodes[x] != nodes[y] for x, y in edges(topo))
        assert topo.nodes[topo.successor] != topo.node
        assert topo.nodes[topo.predecessor] != topo.node
        assert topo.cross_node_fraction() == 1.0


def test_next_policy_on_two_nodes_keeps_same_node_edges():
    nodes = ["a", "a", "b", "b"]
    topo = build_topology(rank=0, world_size=4, dp_ranks=[0, 1, 2, 3], nodes=nodes, policy="next")
    assert topo.ring == (0, 1, 2, 3)
    assert topo.cross_node_fraction() == 0.5


def test_cross_node_on_a_single_node_keeps_dp_order():
    assert ring_order([0, 1, 2, 3], ["x"] * 4, "cross_node") == (0, 1, 2, 3)


def test_dp_group_spread_over_nodes_with_other_ranks_in_between_is_all_cross_node():
    # world 8, 2 ranks per node, DP group = odd ranks (TP2): one member per node
    nodes = [f"n{r // 2}" for r in range(8)]
    topo = build_topology(rank=3, world_size=8, dp_ranks=[1, 3, 5, 7], nodes=nodes)
    assert topo.cross_node_fraction() == 1.0


def _possible(counts: tuple[int, ...]) -> bool:
    """A ring with no same-node edge exists iff no node holds more than half of the members."""
    return len(counts) > 1 and max(counts) <= sum(counts) // 2


@pytest.mark.parametrize("counts", [
    (2, 2),
    (4, 4),
    (1, 1, 1),
    (2, 2, 1),
    (3, 3, 2),
    (2, 2, 2),
    (3, 3, 3, 1),
    (2, 1, 1),
    (3, 2, 1),
    (3, 1, 1, 1),
], ids=str)
def test_cross_node_ring_avoids_same_node_edges_whenever_counts_allow(counts):
    assert _possible(counts)
    nodes = nodes_from_counts(counts)
    n = len(nodes)
    topo = build_topology(rank=0, world_size=n, dp_ranks=list(range(n)), nodes=nodes)
    same = [(a, b) for a, b in edges(topo) if nodes[a] == nodes[b]]
    assert same == [], f"ring {topo.ring} has same-node edges {same}"


@pytest.mark.parametrize("counts", [(3, 1), (5, 2), (4, 1, 1)], ids=str)
def test_cross_node_ring_with_a_dominant_node_still_contains_every_member(counts):
    nodes = nodes_from_counts(counts)
    n = len(nodes)
    topo = build_topology(rank=0, world_size=n, dp_ranks=list(range(n)), nodes=nodes)
    assert sorted(topo.ring) == list(range(n))
    # the minority ranks always get a successor on another node
    big = max(set(nodes), key=nodes.count)
    for r in range(n):
        if nodes[r] != big:
            assert nodes[topo.successor_of(r)] != nodes[r]


# -- validation ---------------------------------------------------------------------------------------------


def test_rank_not_in_its_group_raises_topology_error():
    with pytest.raises(TopologyError, match="rank 1 is not in its own data-parallel group"):
        build_topology(rank=1, world_size=4, dp_ranks=[0, 2])


@pytest.mark.parametrize("dp_ranks", [[0, 0, 1], [0, 4], [-1, 0], [0, 1, 2, 3, 4]])
def test_invalid_dp_ranks_raise_topology_error(dp_ranks):
    with pytest.raises(TopologyError, match="invalid data-parallel group"):
        build_topology(rank=0, world_size=4, dp_ranks=dp_ranks)


@pytest.mark.parametrize("n_nodes", [3, 5, 0])
def test_wrong_number_of_node_ids_raises_topology_error(n_nodes):
    with pytest.raises(TopologyError, match=f"expected 4 node ids, got {n_nodes}"):
        build_topology(rank=0, world_size=4, dp_ranks=[0, 1], nodes=["n"] * n_nodes)


def test_topology_error_is_a_value_error():
    assert issubclass(TopologyError, ValueError)


# -- identities -------------------------------------------------------------------------------------------------


def test_dp_group_id_is_the_lowest_rank_and_shared_by_the_group():
    members = [6, 2, 4]
    ids = {t.dp_group_id for t in views(8, members)}
    assert ids == {"dp2"}
    other = build_topology(rank=1, world_size=8, dp_ranks=[1, 3, 5, 7])
    assert other.dp_group_id == "dp1"


def test_dp_rank_and_size_follow_the_given_order():
    topo = build_topology(rank=4, world_size=8, dp_ranks=[6, 2, 4], model_parallel_coord=[1, 0, 0])
    assert topo.dp_size == 3
    assert topo.dp_rank == 2
    assert topo.dp_ranks == (6, 2, 4)
    assert topo.model_parallel_coord == (1, 0, 0)
    assert topo.nodes == ("node0",) * 8 and topo.node == "node0"


def test_node_id_env_overrides_the_hostname(monkeypatch):
    monkeypatch.setenv(NODE_ID_ENV, "fake-node-7")
    assert local_node_id() == "fake-node-7"
    monkeypatch.delenv(NODE_ID_ENV)
    assert local_node_id()
