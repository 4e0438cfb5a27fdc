"""Version reconciliation tables: which iteration every rank restores, and from where."""

from __future__ import annotations

import pytest
import torch

from neighbor_ckpt.recovery.reconcile import SOURCE_OWN, SOURCE_REPLICA, RankVersions, decode_row, encode_row, reconcile
from neighbor_ckpt.snapshot.topology import build_topology


def table(dp_groups: list[list[int]], own: dict[int, set[int]], *, lost: set[int] = frozenset(),
          lazy: dict[int, set[int]] | None = None, needs_lazy: bool | None = False, policy: str = "next"):
    """Rows of a job whose ranks snapshotted ``own[r]`` and streamed each version to their successor.

    ``lost`` ranks restarted with an empty host store (no own slots, no replicas, no lazy backups)."""
    world = sum(len(g) for g in dp_groups)
    lazy = lazy or {}
    rows = []
    for g in dp_groups:
        for r in g:
            topo = build_topology(rank=r, world_size=world, dp_ranks=g, policy=policy)
            pred = topo.predecessor
            alive = r not in lost
            rows.append(RankVersions(
                rank=r, successor=topo.successor, dp_group=min(g),
                own=frozenset(own.get(r, set())) if alive else frozenset(),
                replica=frozenset(own.get(pred, set())) if alive and pred != r else frozenset(),
                lazy=frozenset(lazy.get(r, set())) if alive else frozenset(),
                needs_lazy=needs_lazy if alive and own.get(r) else None))
    return rows


ONE_GROUP = [[0, 1, 2, 3]]


def test_all_ranks_holding_6_and_7_restore_7_from_their_own_slots():
    d = reconcile(table(ONE_GROUP, {r: {6, 7} for r in range(4)}))
    assert d.recoverable and d.iteration == 7
    assert d.sources == {r: SOURCE_OWN for r in range(4)}
    assert d.lazy_holders == {}
    assert "7" in d.reason


def test_a_rank_that_lost_its_store_restores_from_the_replica_on_its_successor():
    rows = table(ONE_GROUP, {r: {6, 7} for r in range(4)}, lost={2})
    d = reconcile(rows)
    assert d.iteration == 7
    assert d.sources == {0: SOURCE_OWN, 1: SOURCE_OWN, 2: SOURCE_REPLICA, 3: SOURCE_OWN}


def test_lost_rank_in_two_dp_groups_uses_the_successor_of_its_own_group():
    groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
    rows = table(groups, {r: {10, 11} for r in range(8)}, lost={3})
    d = reconcile(rows)
    assert d.iteration == 11
    assert d.sources[3] == SOURCE_REPLICA
    assert {r: s for r, s in d.sources.items() if r != 3} == {r: SOURCE_OWN for r in range(8) if r != 3}


def test_version_skew_of_one_iteration_restores_the_common_older_version():
    own = {0: {6, 7}, 1: {6, 7}, 2: {5, 6}, 3: {5, 6}}
    d = reconcile(table(ONE_GROUP, own))
    assert d.iteration == 6
    assert d.sources == {r: SOURCE_OWN for r in range(4)}


def test_version_skew_with_a_lost_rank_combines_own_and_replica():
    own = {0: {6, 7}, 1: {6, 7}, 2: {5, 6}, 3: {5, 6}}
    d = reconcile(table(ONE_GROUP, own, lost={0}))
    assert d.iteration == 6
    assert d.sources[0] == SOURCE_REPLICA and d.sources[1] == SOURCE_OWN


def test_a_rank_and_its_successor_both_lost_is_not_recoverable_and_the_reason_names_the_rank():
    rows = table(ONE_GROUP, {r: {6, 7} for r in range(4)}, lost={1, 2})
    d = reconcile(rows)
    assert not d.recoverable and d.iteration is None
    assert d.sources == {} and d.lazy_holders == {}
    assert "rank 1 " in d.reason and "rank 2" in d.reason and "iteration 7" in d.reason


def test_two_lost_ranks_that_are_not_ring_neighbors_are_recoverable():
    rows = table(ONE_GROUP, {r: {6, 7} for r in range(4)}, lost={0, 2})
    d = reconcile(rows)
    assert d.iteration == 7
    assert d.sources == {0: SOURCE_REPLICA, 1: SOURCE_OWN, 2: SOURCE_REPLICA, 3: SOURCE_OWN}


def test_cross_node_ring_survives_a_whole_node_loss():
    # 2 nodes x 2 ranks, one DP group: the cross_node ring puts every replica on the other node
    nodes = ["a", "a", "b", "b"]
    rows = []
    for r in range(4):
        topo = build_topology(rank=r, world_size=4, dp_ranks=[0, 1, 2, 3], nodes=nodes)
        alive = nodes[r] != "a"
        rows.append(RankVersions(rank=r, successor=topo.successor, dp_group=0,
                                 own=frozenset({6, 7}) if alive else frozenset(),
                                 replica=frozenset({6, 7}) if alive else frozenset()))
    d = reconcile(rows)
    assert d.iteration == 7
    assert d.sources == {0: SOURCE_REPLICA, 1: SOURCE_REPLICA, 2: SOURCE_OWN, 3: SOURCE_OWN}


def test_nothing_held_anywhere_is_not_recoverable():
    d = reconcile(table(ONE_GROUP, {}))
    assert not d.recoverable
    assert "no rank holds any in-memory snapshot" in d.reason


def test_empty_table_is_not_recoverable():
    assert not reconcile([]).recoverable


def test_dp1_ranks_restore_only_from_their_own_slots():
    groups = [[0], [1]]
    d = reconcile(table(groups, {0: {3, 4}, 1: {3, 4}}))
    assert d.iteration == 4 and d.sources == {0: SOURCE_OWN, 1: SOURCE_OWN}
    d = reconcile(table(groups, {0: {3, 4}, 1: {3, 4}}, lost={1}))
    assert not d.recoverable and "rank 1" in d.reason


# -- lazy backups ------------------------------------------------------------------------------------------------


def test_lazy_state_needed_and_held_names_the_holder():
    rows = table(ONE_GROUP, {r: {6, 7} for r in range(4)}, lazy={2: {7}, 3: {7}}, needs_lazy=True)
    d = reconcile(rows)
    assert d.iteration == 7
    assert d.lazy_holders == {0: 2}  # the lowest rank holding it


def test_lazy_state_needed_but_held_by_nobody_is_not_recoverable():
    rows = table(ONE_GROUP, {r: {6, 7} for r in range(4)}, needs_lazy=True)
    d = reconcile(rows)
    assert not d.recoverable
    assert "lazy backup" in d.reason and "DP group 0" in d.reason


def test_lazy_backup_of_an_older_iteration_only_moves_the_target_back():
    rows = table(ONE_GROUP, {r: {6, 7} for r in range(4)}, lazy={1: {6}}, needs_lazy=True)
    d = reconcile(rows)
    assert d.iteration == 6 and d.lazy_holders == {0: 1}


def test_lazy_backups_are_not_needed_when_no_snapshot_says_so():
    rows = table(ONE_GROUP, {r: {6, 7} for r in range(4)}, needs_lazy=False)
    d = reconcile(rows)
    assert d.iteration == 7 and d.lazy_holders == {}


def test_lazy_holders_are_chosen_per_dp_group():
    groups = [[0, 2], [1, 3]]
    rows = table(groups, {r: {6, 7} for r in range(4)}, lazy={2: {7}, 1: {7}, 3: {7}}, needs_lazy=True)
    d = reconcile(rows)
    assert d.iteration == 7 and d.lazy_holders == {0: 2, 1: 1}


def test_a_lost_rank_still_inherits_the_need_for_lazy_state_from_its_group():
    rows = table(ONE_GROUP, {r: {6, 7} for r in range(4)}, lost={0}, lazy={3: {7}}, needs_lazy=True)
    assert next(r for r in rows if r.rank == 0).needs_lazy is None
    d = reconcile(rows)
    assert d.iteration == 7 and d.lazy_holders == {0: 3} and d.sources[0] == SOURCE_REPLICA


# -- exclusion of copies that failed verification ------------------------------------------------------------------


def test_excluding_a_corrupt_own_copy_falls_back_to_the_replica():
    rows = table(ONE_GROUP, {r: {6, 7} for r in range(4)})
    d = reconcile(rows, exclude=frozenset({(1, 7, SOURCE_OWN)}))
    assert d.iteration == 7
    assert d.sources[1] == SOURCE_REPLICA
    assert all(d.sources[r] == SOURCE_OWN for r in (0, 2, 3))


def test_excluding_both_copies_of_a_rank_falls_back_to_the_previous_iteration():
    rows = table(ONE_GROUP, {r: {6, 7} for r in range(4)})
    d = reconcile(rows, exclude=frozenset({(1, 7, SOURCE_OWN), (1, 7, SOURCE_REPLICA)}))
    assert d.iteration == 6 and d.sources == {r: SOURCE_OWN for r in range(4)}


def test_excluding_every_copy_is_not_recoverable():
    rows = table(ONE_GROUP, {r: {7} for r in range(4)})
    d = reconcile(rows, exclude=frozenset({(2, 7, SOURCE_OWN), (2, 7, SOURCE_REPLICA)}))
    assert not d.recoverable and "rank 2" in d.reason


def test_excluding_a_corrupt_lazy_backup_uses_another_holder():
    rows = table(ONE_GROUP, {r: {6, 7} for r in range(4)}, lazy={1: {7}, 3: {7}}, needs_lazy=True)
    d = reconcile(rows, exclude=frozenset({(1, 7, "lazy")}))
    assert d.iteration == 7 and d.lazy_holders == {0: 3}


def test_decision_is_the_same_whatever_the_row_order():
    rows = table([[0, 2, 4], [1, 3, 5]], {0: {6, 7}, 1: {6, 7}, 2: {5, 6}, 3: {6, 7}, 4: {6, 7}, 5: {6, 7}},
                 lost={4}, lazy={0: {6}, 3: {6}}, needs_lazy=True)
    a = reconcile(rows)
    b = reconcile(list(reversed(rows)))
    assert a == b and a.iteration == 6


# -- all-gather rows ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row", [
    RankVersions(rank=3, successor=0, dp_group=0, own=frozenset({6, 7}), replica=frozenset({7}),
                 lazy=frozenset(), needs_lazy=True, layout_mismatch=False),
    RankVersions(rank=0, successor=1, dp_group=0),
    RankVersions(rank=5, successor=1, dp_group=1, own=frozenset({0}), replica=frozenset({0, 1}),
                 lazy=frozenset({1}), needs_lazy=False, layout_mismatch=True),
    RankVersions(rank=1023, successor=1, dp_group=1, own=frozenset({2**40}), needs_lazy=None),
    RankVersions(rank=2, successor=0, dp_group=0, replica=frozenset({4}), replica_of=1),
], ids=["typical", "empty", "mismatch", "large", "replica-of"])
def test_encode_then_decode_row_round_trips(row):
    t = encode_row(row, versions=2)
    assert t.dtype == torch.int64 and t.shape == (6 + 3 * 2,)
    assert decode_row(t, versions=2) == row


def test_encode_row_keeps_the_newest_versions_when_there_are_too_many():
    row = RankVersions(rank=0, successor=1, dp_group=0, own=frozenset({3, 9, 5, 7}))
    back = decode_row(encode_row(row, versions=2), versions=2)
    assert back.own == frozenset({9, 7})


def test_rows_of_every_rank_have_the_same_size_for_all_gather():
    rows = table(ONE_GROUP, {0: {1}, 1: {1, 2}, 2: set(), 3: {2}}, lazy={0: {1}})
    assert len({encode_row(r, versions=3).shape for r in rows}) == 1
    assert [decode_row(encode_row(r, 3), 3) for r in rows] == rows


def test_an_iteration_whose_restore_failed_on_the_previous_attempt_is_never_chosen_again():
    """Restart-loop guard: 7 was restored and the attempt died before completing a step; 6 is chosen instead, and
    with 6 gone too the decision is the insurance, with the reason, instead of 7 a second time."""
    rows = table(ONE_GROUP, {r: {6, 7} for r in range(4)})
    d = reconcile(rows, failed_iterations=frozenset({7}))
    assert d.iteration == 6 and d.sources == {r: SOURCE_OWN for r in range(4)}
    d = reconcile(table(ONE_GROUP, {r: {7} for r in range(4)}), failed_iterations=frozenset({7}))
    assert not d.recoverable and "not chosen again" in d.reason


def test_a_replica_is_found_with_the_rank_that_holds_it_after_the_ring_changed() -> None:
    """4 ranks on 2 nodes of 2, ring [0, 2, 1, 3]; rank 2 is lost and a spare on a third node takes it: the
    cross-node ring becomes [0, 3, 1, 2] (rank 2's successor is now 0), but rank 2's replica is on rank 1, its
    successor when the snapshots were taken: the decision pulls it from there and rank 1 sends it."""
    rows = [RankVersions(rank=0, successor=3, dp_group=0, own=frozenset({3, 4}), replica=frozenset({3, 4}),
                         replica_of=3),
            RankVersions(rank=1, successor=2, dp_group=0, own=frozenset({3, 4}), replica=frozenset({3, 4}),
                         replica_of=2),
            RankVersions(rank=2, successor=0, dp_group=0),  # the spare: an empty store
            RankVersions(rank=3, successor=1, dp_group=0, own=frozenset({3, 4}), replica=frozenset({3, 4}),
                         replica_of=1)]
    d = reconcile(rows)
    assert d.iteration == 4 and d.sources[2] == "replica" and d.replica_holders == {2: 1}, d
    rows[1] = RankVersions(rank=1, successor=2, dp_group=0, own=frozenset({3, 4}))  # the replica lost too
    d = reconcile(rows)
    assert d.iteration is None and "no rank holds its replica" in d.reason, d
