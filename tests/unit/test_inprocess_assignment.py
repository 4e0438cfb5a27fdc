"""The rank assignment of a generation: a pure function every process computes alike (one process, no store)."""

from __future__ import annotations

import pytest

from neighbor_ckpt.inprocess.assignment import Assignment, GiveUp, covering, initial_assignment, next_assignment
from neighbor_ckpt.recovery.reshard import ElasticPolicy


def test_generation_zero_makes_the_first_processes_ranks_and_the_last_ones_spares() -> None:
    a = initial_assignment(5, 1)
    assert a.world_size == 4 and dict(a.ranks) == {0: 0, 1: 1, 2: 2, 3: 3} and a.spares == (4,)
    with pytest.raises(ValueError):
        initial_assignment(2, 2)


def test_a_spare_takes_the_lost_ranks_number_and_survivors_keep_theirs() -> None:
    a = next_assignment(initial_assignment(5, 1), {0, 2, 3, 4})
    assert isinstance(a, Assignment)
    assert dict(a.ranks) == {0: 0, 2: 2, 3: 3, 4: 1} and a.spares == () and dict(a.filled) == {1: 4}
    assert a.world_size == 4 and a.shrunk_from is None


def test_spares_fill_the_lowest_lost_ranks_with_the_lowest_processes_first() -> None:
    a = next_assignment(initial_assignment(7, 3), {0, 3, 4, 5, 6})
    assert isinstance(a, Assignment)
    assert dict(a.filled) == {1: 4, 2: 5} and a.spares == (6,)


def test_every_process_computes_the_same_assignment_whatever_the_member_order() -> None:
    prev = initial_assignment(6, 2)
    outcomes = {next_assignment(prev, frozenset(m)).to_json() for m in ([0, 1, 3, 4, 5], [5, 4, 3, 1, 0])}
    assert len(outcomes) == 1


def test_an_exception_without_a_lost_process_keeps_every_rank_and_the_spare_idle() -> None:
    prev = initial_assignment(5, 1)
    a = next_assignment(prev, {0, 1, 2, 3, 4})
    assert isinstance(a, Assignment) and dict(a.ranks) == dict(prev.ranks) and a.spares == (4,) and not a.filled


def test_a_replacement_process_joins_as_a_spare() -> None:
    a = next_assignment(initial_assignment(5, 1), {0, 1, 2, 3, 4, 5})
    assert isinstance(a, Assignment) and a.spares == (4, 5)


def test_without_spares_and_without_elastic_the_generation_gives_up_and_says_why() -> None:
    out = next_assignment(initial_assignment(4, 0), {0, 2, 3})
    assert isinstance(out, GiveUp) and "no hot spare left" in out.reason and "[1]" in out.reason


def test_two_lost_with_one_spare_gives_up() -> None:
    out = next_assignment(initial_assignment(5, 1), {0, 3, 4})
    assert isinstance(out, GiveUp) and "3 of 4" in out.reason


def test_elastic_shrink_backfills_the_hole_with_the_highest_rank() -> None:
    policy = ElasticPolicy(model_parallel=1, min_data_parallel=1, batch_micro_batches=12)
    a = next_assignment(initial_assignment(4, 0), {0, 2, 3}, elastic=policy)
    assert isinstance(a, Assignment)
    assert a.world_size == 3 and dict(a.ranks) == {0: 0, 2: 2, 3: 1} and a.shrunk_from == 4 and a.spares == ()


def test_elastic_shrink_leaves_survivors_beyond_the_allowed_size_idle() -> None:
    # 8 micro-batches: DP 3 does not divide them, DP 2 does: ranks 0 and 1 go on, process 3 waits as a spare
    policy = ElasticPolicy(model_parallel=1, min_data_parallel=1, batch_micro_batches=8)
    a = next_assignment(initial_assignment(4, 0), {0, 1, 3}, elastic=policy)
    assert isinstance(a, Assignment) and a.world_size == 2 and dict(a.ranks) == {0: 0, 1: 1} and a.spares == (3,)


def _ring_holdings(world: int, alive: set[int], iterations: tuple[int, ...] = (3, 4)) -> dict[int, frozenset]:
    """What each live process's node holds with one process per node and the ring r -> r + 1: its own snapshots and
    its predecessor's replicas, of each iteration."""
    return {p: frozenset((o, it) for o in (p, (p - 1) % world) for it in iterations) for p in alive}


@pytest.mark.parametrize("lost", [0, 1, 2, 3])
def test_a_shrink_keeps_the_survivors_whose_nodes_hold_every_old_ranks_newest_snapshot(lost: int) -> None:
    """4 ranks, one per node, ring 0 -> 1 -> 2 -> 3 -> 0, DP 2 after the loss: an idle survivor's store takes no
    part in the reshard, so the two kept must hold every old rank's snapshot between them, whichever rank was lost
    (the lost rank's replica is on its successor only; the successor's own copy is on it and its successor)."""
    policy = ElasticPolicy(model_parallel=1, min_data_parallel=1, batch_micro_batches=8)
    alive = {0, 1, 2, 3} - {lost}
    holdings = _ring_holdings(4, alive)
    a = next_assignment(initial_assignment(4, 0), alive, elastic=policy, holdings=holdings)
    assert isinstance(a, Assignment) and a.world_size == 2 and sorted(a.ranks.values()) == [0, 1]
    held = set().union(*(holdings[p] for p in a.ranks))
    assert {(o, 4) for o in range(4)} <= held, (lost, dict(a.ranks))
    assert set(a.spares) == alive - set(a.ranks)
    assert all(r == p for p, r in a.ranks.items() if p < 2), "a survivor below the new size keeps its number"


def test_a_shrink_keeps_the_usual_survivors_when_they_hold_everything_and_the_newest_coverable_iteration_wins(
        ) -> None:
    policy = ElasticPolicy(model_parallel=1, min_data_parallel=1, batch_micro_batches=8)
    # lost 0: the usual choice (1 -> rank 1, 3 -> rank 0) holds 0 (its replica on 1), 1, 2 (replica on 3) and 3
    a = next_assignment(initial_assignment(4, 0), {1, 2, 3}, elastic=policy, holdings=_ring_holdings(4, {1, 2, 3}))
    assert isinstance(a, Assignment) and dict(a.ranks) == {1: 1, 3: 0} and a.spares == (2,)
    # iteration 4 of old rank 2 is nowhere: the newest the survivors can cover together is 3
    holdings = _ring_holdings(4, {0, 1, 2}, iterations=(3,))
    holdings[2] = holdings[2] | {(1, 4), (2, 4)}
    holdings[0] = holdings[0] | {(0, 4)}
    a = next_assignment(initial_assignment(4, 0), {0, 1, 2}, elastic=policy, holdings=holdings)
    assert isinstance(a, Assignment)
    assert {(o, 3) for o in range(4)} <= set().union(*(holdings[p] for p in a.ranks))


def test_the_cover_of_a_large_ring_that_must_halve_takes_every_other_survivor() -> None:
    """1024 ranks, rank 0 lost, half of them must go on: only every other survivor (1, 3, 5, ...) holds every old
    rank between them, and the greedy cover finds it (each holder chosen for the most old ranks not yet held)."""
    world = 1024
    holdings = _ring_holdings(world, set(range(1, world)))
    chosen = covering(list(range(1, world)), world // 2, holdings, owners=world)
    assert chosen == list(range(1, world, 2))


def test_a_shrink_without_holdings_or_without_a_covering_choice_keeps_the_usual_order() -> None:
    policy = ElasticPolicy(model_parallel=1, min_data_parallel=1, batch_micro_batches=8)
    usual = next_assignment(initial_assignment(4, 0), {0, 1, 2}, elastic=policy)
    assert isinstance(usual, Assignment) and dict(usual.ranks) == {0: 0, 1: 1} and usual.spares == (2,)
    nothing_of_3 = {p: frozenset((p, 4) for _ in range(1)) for p in (0, 1, 2)}  # old rank 3's snapshot is nowhere
    assert next_assignment(initial_assignment(4, 0), {0, 1, 2}, elastic=policy, holdings=nothing_of_3) == usual
    assert covering([0, 1, 2], 2, nothing_of_3, owners=4) is None


def test_elastic_gives_up_when_no_smaller_world_fits() -> None:
    policy = ElasticPolicy(model_parallel=2, min_data_parallel=2)
    out = next_assignment(initial_assignment(4, 0), {0, 1, 2}, elastic=policy)
    assert isinstance(out, GiveUp) and "no smaller world" in out.reason


def test_the_assignment_travels_as_json_unchanged() -> None:
    a = next_assignment(initial_assignment(5, 1), {0, 2, 3, 4})
    assert isinstance(a, Assignment) and Assignment.from_json(a.to_json()) == a
