"""The elastic reshard plan, built for every rank in one process: the pieces it moves give every new rank exactly the
slices a reference resharding (assemble every parameter from the old shards, cut it at the new spans) gives."""

from __future__ import annotations

import random

import pytest
import torch

from neighbor_ckpt.errors import SnapshotMismatchError
from neighbor_ckpt.recovery.reshard import (Copy, RankLayout, ShardSpan, TensorEntry, choose_version, plan_reshard)

PARAMS = {"0.embedding.weight": 37, "0.layers.0.fc.weight": 64, "0.layers.0.fc.bias": 8, "0.head.weight": 29}
KEYS = ("main/{}", "optim/{}/exp_avg", "optim/{}/exp_avg_sq")


def _layouts(world: int, tp: int, *, model: str = "m", params: dict[str, int] = PARAMS,
             buffers: bool = True) -> dict[int, RankLayout]:
    """megatron-core's cut: per model-parallel rank, the parameters laid end to end in one buffer, padded to a
    multiple of DP, each DP rank owning one contiguous range; a parameter's shard on a rank is its overlap with it."""
    dp = world // tp
    out = {}
    for rank in range(world):
        coord, dp_index = (rank % tp,), rank // tp
        total = sum(params.values())
        size = -(-total // dp)
        lo, hi = dp_index * size, (dp_index + 1) * size
        tensors, offset = [], 0
        for name, numel in params.items():
            s, e = max(lo, offset), min(hi, offset + numel)
            if s < e:
                span = ShardSpan(numel, s - offset, e - offset)
                tensors += [TensorEntry(k.format(name), "float32", (e - s,), span) for k in KEYS]
            offset += numel
        if buffers:
            tensors.append(TensorEntry("buffer/0.router.expert_bias", "float32", (4,)))
        out[rank] = RankLayout(rank=rank, world_size=world, coord=coord, dp_index=dp_index, dp_size=dp,
                               model=f"{model}/{coord}", tensors=tuple(tensors))
    return out


def _data(old: dict[int, RankLayout], seed: int) -> tuple[dict[tuple, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """Full tensors per (coord, name) and each old rank's snapshot cut from them (buffers differ per rank)."""
    g = torch.Generator().manual_seed(seed)
    full: dict[tuple, torch.Tensor] = {}
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    for lay in old.values():
        snap = {}
        for t in lay.tensors:
            if t.span is None:
                snap[t.name] = torch.randn(t.shape, generator=g)
                continue
            key = (lay.coord, t.name)
            if key not in full:
                full[key] = torch.randn(t.span.numel, generator=g)
            snap[t.name] = full[key][t.span.start:t.span.end].clone()
        snaps[lay.rank] = snap
    return full, snaps


def _apply(plan, new: dict[int, RankLayout], snaps: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict]:
    out = {r: {t.name: torch.full(t.shape, float("nan")) for t in lay.tensors} for r, lay in new.items()}
    for p in plan.pieces:
        src = snaps[p.owner][p.tensor].reshape(-1)[p.src_offset:p.src_offset + p.count]
        out[p.dst][p.tensor].reshape(-1)[p.dst_offset:p.dst_offset + p.count] = src
    return out


def _all_copies(world: int, iteration: int = 5, lost: tuple[int, ...] = ()) -> list[Copy]:
    """Own slots of the survivors, and every rank's replica on its ring successor (DP order) unless that died too."""
    copies = []
    for o in range(world):
        if o not in lost:
            copies.append(Copy(o, iteration, holder=o, role="own"))
        succ = (o + 1) % world
        if succ not in lost:
            copies.append(Copy(o, iteration, holder=succ, role="replica"))
    return copies


@pytest.mark.parametrize("old_world,new_world,tp", [(4, 3, 1), (3, 4, 1), (4, 2, 2), (8, 6, 2), (4, 1, 1),
                                                     (1, 4, 1), (6, 4, 2)])
def test_plan_gives_every_new_rank_the_reference_resharding_bit_exact(old_world: int, new_world: int, tp: int) -> None:
    old, new = _layouts(old_world, tp), _layouts(new_world, tp)
    full, snaps = _data(old, seed=old_world * 10 + new_world)
    choice = choose_version(_all_copies(old_world), old_world=old_world)
    plan = plan_reshard(old, new, choice)
    got = _apply(plan, new, snaps)
    for r, lay in new.items():
        eo = plan.extras_from(r)
        assert old[eo].coord == lay.coord and old[eo].dp_index == lay.dp_index % old[eo].dp_size
        for t in lay.tensors:
            if t.span is None:
                expected = snaps[eo][t.name]
            else:
                expected = full[(lay.coord, t.name)][t.span.start:t.span.end]
            assert torch.equal(got[r][t.name], expected), (r, t.name)
    assert (plan.dp_before, plan.dp_after) == (old_world // tp, new_world // tp)


def test_a_lost_rank_is_served_by_its_replica_and_every_move_names_a_surviving_process() -> None:
    copies = _all_copies(4, lost=(1,))
    choice = choose_version(copies, old_world=4)
    assert choice.iteration == 5
    assert choice.source_of(1) == Copy(1, 5, holder=2, role="replica")
    assert choice.source_of(2) == Copy(2, 5, holder=2, role="own")  # own preferred over the replica on rank 3
    old = _layouts(4, 1)
    plan = plan_reshard(old, _layouts(3, 1), choice)
    assert {p.src for p in plan.pieces} <= {0, 2, 3}
    assert {p.owner for p in plan.pieces if p.src == 2} >= {1, 2}
    # every process receives only what it lacks; a piece it holds itself is a local copy
    for r in range(3):
        assert plan.moved_bytes(r) == sum(p.nbytes for p in plan.pieces if p.dst == r and p.src != r)
        assert all(p.dst == r for ps in plan.incoming(r).values() for p in ps)


def test_newest_complete_iteration_wins_and_excluded_or_failed_copies_are_not_used() -> None:
    copies = _all_copies(4, 5, lost=(1,)) + _all_copies(4, 6, lost=(1,))
    copies = [c for c in copies if not (c.iteration == 6 and c.owner == 1)]  # rank 1 died before its replica of 6
    assert choose_version(copies, old_world=4).iteration == 5
    assert choose_version(copies + [Copy(1, 6, 2, "replica")], old_world=4).iteration == 6
    assert choose_version(copies + [Copy(1, 6, 2, "replica")], old_world=4, failed_iterations=[6]).iteration == 5
    bad = Copy(1, 5, 2, "replica").key
    none = choose_version(copies, old_world=4, exclude=[bad])
    assert none.iteration is None and "old rank(s) [1]" in none.reason


def test_a_rank_and_its_successor_lost_leave_no_complete_iteration() -> None:
    choice = choose_version(_all_copies(4, lost=(1, 2)), old_world=4)
    assert choice.iteration is None
    assert "[1]" in choice.reason and "ring successor" in choice.reason
    assert "no usable snapshot" in choose_version([], old_world=4).reason


def test_another_model_or_a_new_model_parallel_coordinate_is_refused() -> None:
    choice = choose_version(_all_copies(4), old_world=4)
    with pytest.raises(SnapshotMismatchError, match="another model"):
        plan_reshard(_layouts(4, 1), _layouts(3, 1, model="other"), choice)
    with pytest.raises(SnapshotMismatchError, match="coordinate"):
        plan_reshard(_layouts(4, 1), _layouts(4, 2), choice)
    bigger = dict(PARAMS, **{"0.head.weight": 30})
    with pytest.raises(SnapshotMismatchError):
        plan_reshard(_layouts(4, 1), _layouts(3, 1, params=bigger), choice)


def test_layout_json_round_trips() -> None:
    for lay in _layouts(4, 2).values():
        assert RankLayout.from_json(lay.to_json()) == lay
    with pytest.raises(ValueError):
        ShardSpan.from_json([4, 3, 5])


def test_random_layouts_and_losses() -> None:
    rnd = random.Random(7)
    for _ in range(40):
        tp = rnd.choice([1, 2])
        old_world, new_world = tp * rnd.randint(1, 6), tp * rnd.randint(1, 6)
        params = {f"p{i}": rnd.randint(1, 50) for i in range(rnd.randint(1, 6))}
        old, new = _layouts(old_world, tp, params=params), _layouts(new_world, tp, params=params)
        full, snaps = _data(old, rnd.randint(0, 10**6))
        lost = (rnd.randrange(old_world),) if old_world > 1 else ()
        plan = plan_reshard(old, new, choose_version(_all_copies(old_world, lost=lost), old_world=old_world))
        got = _apply(plan, new, snaps)
        for r, lay in new.items():
            for t in lay.tensors:
                if t.span is not None:
                    assert torch.equal(got[r][t.name], full[(lay.coord, t.name)][t.span.start:t.span.end])


def test_elastic_policy_picks_the_largest_world_that_keeps_the_global_batch() -> None:
    from neighbor_ckpt.recovery.reshard import ElasticPolicy

    gb12 = ElasticPolicy(model_parallel=1, batch_micro_batches=12)  # global batch 24, micro-batch 2
    assert [gb12.world_size(n) for n in (4, 3, 2, 1)] == [4, 3, 2, 1]
    assert ElasticPolicy(model_parallel=1, batch_micro_batches=8).world_size(3) == 2  # DP 3 does not divide 8
    tp2 = ElasticPolicy(model_parallel=2, batch_micro_batches=4)
    assert tp2.world_size(3) == 2 and tp2.world_size(1) is None  # an even world; none left below TP
    floor = ElasticPolicy(model_parallel=1, min_data_parallel=3, batch_micro_batches=12)
    assert floor.world_size(2) is None
    assert "elastic.min_data_parallel 3" in floor.why_not(2) and "12 micro-batches" in floor.why_not(2)
    with pytest.raises(ValueError):
        ElasticPolicy(model_parallel=0)


def test_micro_batches_per_rank_keep_the_global_batch_and_a_dp_size_that_does_not_divide_it_is_refused() -> None:
    from neighbor_ckpt.errors import ConfigError
    from neighbor_ckpt.recovery.reshard import micro_batches_per_rank

    assert [micro_batches_per_rank(24, 2, dp) for dp in (1, 2, 3, 4, 6, 12)] == [12, 6, 4, 3, 2, 1]
    assert micro_batches_per_rank(16, 2, 4) == 2
    with pytest.raises(ConfigError) as e:
        micro_batches_per_rank(16, 2, 3)
    msg = str(e.value)
    assert msg.startswith("the global batch of 16 samples cannot be kept at data-parallel size 3: 16 is not a multiple "
                          "of micro-batch size 2 x data-parallel size 3 = 6"), msg
    assert "data-parallel sizes that do: [1, 2, 4, 8]" in msg
    with pytest.raises(ConfigError, match="must all be >= 1"):
        micro_batches_per_rank(16, 0, 2)


def test_a_newest_generation_without_a_complete_version_falls_back_to_the_older_layout_not_yet_released() -> None:
    """Issue 31 item 2: DP 4 (generation 0, iterations 3 and 4 of every old rank) resharded to DP 3 (generation 1);
    a second failure before generation 1's first snapshot was committed everywhere (old rank 2's never was, and its
    replica did not arrive): generation 0, still in memory, is resharded into generation 2 instead of insurance."""
    from neighbor_ckpt.recovery.elastic import LocalGeneration, decide_generation

    g0 = [LocalGeneration(0, 4, 4, ((o, 3),)) for o in range(4)]
    # holder h of the survivors keeps old rank h's own slots and its predecessor's replicas (iterations 3 and 4)
    g0_both = [LocalGeneration(0, 4, 4, tuple((o, i) for o in sorted({h, (h - 1) % 4}) for i in (3, 4)))
               for h in range(4)]
    g1_partial = [LocalGeneration(1, 3, 3, ((0, 5),)), LocalGeneration(1, 3, 3, ((1, 5), (0, 5))),
                  LocalGeneration(1, 3, 3, ())]
    nodes = [[g1_partial[h], g0_both[h]] for h in range(3)]
    info = decide_generation(nodes, world_size=3, dp_size=3, elastic=True)
    assert (info.generation, info.reshard_from, info.world_before, info.dp_before, info.skipped) == (2, 0, 4, 4, 1)
    # the same at a restart on 4 ranks again (grow back): still the older layout, into a new generation
    info = decide_generation(nodes + [[g0[3]]], world_size=4, dp_size=4, elastic=True)
    assert (info.generation, info.reshard_from, info.skipped) == (2, 0, 1)
    # elastic off: as before, the newest generation (the restore flow then decides: insurance)
    assert decide_generation(nodes, world_size=3, dp_size=3, elastic=False).generation == 1
    # generation 1 complete (every old rank's iteration 5, own slots or replicas): an ordinary restore in it
    g1_done = [LocalGeneration(1, 3, 3, ((h, 5),)) for h in range(3)]
    info = decide_generation([[g1_done[h], g0_both[h]] for h in range(3)], world_size=3, dp_size=3, elastic=True)
    assert (info.generation, info.reshard_from, info.skipped) == (1, None, None)
    # nothing older is complete either: the newest, as before (its restore flow reports why)
    g0_broken = [LocalGeneration(0, 4, 4, ((o, 3),)) for o in range(3)]  # old rank 3 lost with its successor
    info = decide_generation([[g1_partial[h], g0_broken[h]] for h in range(3)], world_size=3, dp_size=3, elastic=True)
    assert (info.generation, info.reshard_from, info.skipped) == (1, None, None)
    # each process's newest generation alone (no copies reported): the rule of before, unchanged
    info = decide_generation([LocalGeneration(0, 4, 4)] * 3, world_size=3, dp_size=3, elastic=True)
    assert (info.generation, info.reshard_from, info.dp_before) == (1, 0, 4)
    assert decide_generation([LocalGeneration()] * 3, world_size=3, dp_size=3, elastic=True).generation == 0
