"""The checkpoint razor, with every rank's plan built in one process from its computed topology."""

from __future__ import annotations

import math

import pytest
import torch

from neighbor_ckpt.snapshot.razor import ALIGN, Disposition, StateKind, TensorMeta, disposition, plan_shards
from neighbor_ckpt.snapshot.topology import build_topology

H = 48  # hidden size of the toy model: weights are (H / tp, H) per layer
LAYERS_PER_STAGE = 2

# (world, tp, pp): dp = world / (tp * pp)
LAYOUTS = [
    pytest.param(1, 1, 1, id="world1-dp1"),
    pytest.param(2, 2, 1, id="world2-tp2-dp1"),
    pytest.param(4, 2, 2, id="world4-tp2-pp2-dp1"),
    pytest.param(2, 1, 1, id="world2-dp2"),
    pytest.param(8, 2, 2, id="world8-tp2-pp2-dp2"),
    pytest.param(4, 1, 1, id="world4-dp4"),
    pytest.param(8, 2, 1, id="world8-tp2-dp4"),
    pytest.param(16, 2, 2, id="world16-tp2-pp2-dp4"),
]


def megatron_coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp, dp, pp) coordinate of a global rank, Megatron order: tp fastest, then dp, then pp."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def dp_group_of(rank: int, world: int, tp: int, pp: int) -> list[int]:
    dp = world // (tp * pp)
    t, _, p = megatron_coords(rank, tp, dp)
    return [t + tp * (d + dp * p) for d in range(dp)]


def rank_tensors(rank: int, world: int, tp: int, pp: int, *, distributed_optimizer: bool) -> list[TensorMeta]:
    """The state one rank reports: bf16 weights of its stage / TP shard, plus Adam-like optimizer state."""
    dp = world // (tp * pp)
    t, _, p = megatron_coords(rank, tp, dp)
    weights = [TensorMeta(f"layers.{p * LAYERS_PER_STAGE + j}.weight", StateKind.WEIGHT, torch.bfloat16, (H // tp, H))
               for j in range(LAYERS_PER_STAGE)]
    weights.append(TensorMeta(f"layers.{p}.norm", StateKind.WEIGHT, torch.float32, (H,)))
    if distributed_optimizer:
        n = sum(math.prod(w.shape) for w in weights)
        assert n % dp == 0
        shard = (n // dp,)
        opt = [TensorMeta("main_param.shard", StateKind.MAIN_PARAM, torch.float32, shard),
               TensorMeta("optim.exp_avg", StateKind.OPTIMIZER, torch.float32, shard),
               TensorMeta("optim.exp_avg_sq", StateKind.OPTIMIZER, torch.float32, shard)]
    else:
        opt = []
        for w in weights:
            opt += [TensorMeta(f"optim/{w.name}/exp_avg", StateKind.OPTIMIZER, torch.float32, w.shape),
                    TensorMeta(f"optim/{w.name}/exp_avg_sq", StateKind.OPTIMIZER, torch.float32, w.shape)]
        opt.append(TensorMeta("optim/step", StateKind.OPTIMIZER, torch.float32, ()))
    return weights + opt


def all_plans(world: int, tp: int, pp: int, distributed_optimizer: bool):
    """Every rank's (topology, tensors, plan), each built from the rank's own view."""
    out = []
    for rank in range(world):
        topo = build_topology(rank=rank, world_size=world, dp_ranks=dp_group_of(rank, world, tp, pp),
                              nodes=[f"node{r // 4}" for r in range(world)])
        metas = rank_tensors(rank, world, tp, pp, distributed_optimizer=distributed_optimizer)
        out.append((topo, metas, plan_shards(metas, dp_size=topo.dp_size, distributed_optimizer=distributed_optimizer)))
    return out


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# -- layout helpers are right (guards the tests below) -----------------------------------------------------


@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
def test_computed_dp_groups_partition_the_world(world, tp, pp):
    groups = {tuple(dp_group_of(r, world, tp, pp)) for r in range(world)}
    members = sorted(r for g in groups for r in g)
    assert members == list(range(world))
    assert all(len(g) == world // (tp * pp) for g in groups)
    for r in range(world):
        assert r in dp_group_of(r, world, tp, pp)


# -- the rules, as a table (FFTrainer §4.2) ------------------------------------------------------------------

U, R, L = Disposition.UNIQUE, Disposition.REGENERABLE, Disposition.LAZY
RULES = {  # (dp_size, distributed_optimizer): dispositions of (weight, main param, optimizer state)
    (1, False): (U, U, U),  # nothing redundant
    (1, True): (R, U, U),  # the weights regenerate from the fp32 main params
    (4, False): (L, L, L),  # every DP rank holds the same copy: written at failure time
    (4, True): (R, U, U),  # each DP rank owns a shard of the main params and the state
}


@pytest.mark.parametrize("dp_size,distributed_optimizer", list(RULES))
def test_disposition_is_the_fftrainer_rule_table(dp_size, distributed_optimizer):
    got = tuple(disposition(k, dp_size=dp_size, distributed_optimizer=distributed_optimizer)
                for k in (StateKind.WEIGHT, StateKind.MAIN_PARAM, StateKind.OPTIMIZER))
    assert got == RULES[dp_size, distributed_optimizer]


# -- the razor rules on every rank ---------------------------------------------------------------------------


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distopt"])
@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
def test_every_rank_gets_the_dispositions_of_its_dp_size(world, tp, pp, distributed_optimizer):
    for topo, metas, plan in all_plans(world, tp, pp, distributed_optimizer):
        assert plan.dp_size == topo.dp_size == world // (tp * pp)
        assert plan.distributed_optimizer is distributed_optimizer
        for m in metas:
            got = plan.disposition_of(m.name)
            if topo.dp_size == 1:
                if m.kind is StateKind.WEIGHT and distributed_optimizer:
                    assert got is Disposition.REGENERABLE, m.name
                else:
                    assert got is Disposition.UNIQUE, m.name
            elif not distributed_optimizer:
                assert got is Disposition.LAZY, m.name
            elif m.kind is StateKind.WEIGHT:
                assert got is Disposition.REGENERABLE, m.name
            else:
                assert got is Disposition.UNIQUE, m.name
        # every tensor appears in exactly one bucket
        names = ([p.meta.name for p in plan.unique] + [m.name for m in plan.regenerable]
                 + [p.meta.name for p in plan.lazy])
        assert sorted(names) == sorted(m.name for m in metas)


@pytest.mark.parametrize("world,tp,pp", [p for p in LAYOUTS if p.values[0] // (p.values[1] * p.values[2]) == 1])
def test_dp1_makes_everything_unique(world, tp, pp):
    for _, metas, plan in all_plans(world, tp, pp, distributed_optimizer=False):
        assert [p.meta for p in plan.unique] == metas
        assert plan.lazy == () and plan.regenerable == ()
        assert not plan.has_lazy
        assert plan.lazy_bytes == 0


@pytest.mark.parametrize("world,tp,pp", [p for p in LAYOUTS if p.values[0] // (p.values[1] * p.values[2]) == 1])
def test_dp1_with_distributed_optimizer_makes_weights_regenerable_and_the_rest_unique(world, tp, pp):
    for _, metas, plan in all_plans(world, tp, pp, distributed_optimizer=True):
        assert [m.name for m in plan.regenerable] == [m.name for m in metas if m.kind is StateKind.WEIGHT]
        assert [p.meta for p in plan.unique] == [m for m in metas if m.kind is not StateKind.WEIGHT]
        assert plan.lazy == ()


@pytest.mark.parametrize("world,tp,pp", [p for p in LAYOUTS if p.values[0] // (p.values[1] * p.values[2]) > 1])
def test_dp_gt1_without_distributed_optimizer_makes_weights_and_optimizer_lazy_and_nothing_unique(world, tp, pp):
    for _, metas, plan in all_plans(world, tp, pp, distributed_optimizer=False):
        assert plan.unique == ()
        assert plan.unique_bytes == 0
        assert plan.regenerable == ()
        assert [p.meta for p in plan.lazy] == metas
        assert plan.has_lazy
        assert plan.lazy_bytes == sum(aligned(m.nbytes) for m in metas)


@pytest.mark.parametrize("world,tp,pp", [p for p in LAYOUTS if p.values[0] // (p.values[1] * p.values[2]) > 1])
def test_dp_gt1_with_distributed_optimizer_keeps_shards_unique_and_no_weight_in_unique(world, tp, pp):
    for _, metas, plan in all_plans(world, tp, pp, distributed_optimizer=True):
        assert all(p.meta.kind is not StateKind.WEIGHT for p in plan.unique)
        assert {p.meta.kind for p in plan.unique} == {StateKind.MAIN_PARAM, StateKind.OPTIMIZER}
        assert all(p.disposition is Disposition.UNIQUE for p in plan.unique)
        assert [m.name for m in plan.regenerable] == [m.name for m in metas if m.kind is StateKind.WEIGHT]
        assert plan.lazy == () and not plan.has_lazy


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distopt"])
@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
def test_members_of_one_dp_group_share_a_signature_and_stages_differ(world, tp, pp, distributed_optimizer):
    plans = all_plans(world, tp, pp, distributed_optimizer)
    by_group: dict[str, set[str]] = {}
    for topo, _, plan in plans:
        by_group.setdefault(topo.dp_group_id, set()).add(plan.signature)
    assert all(len(sigs) == 1 for sigs in by_group.values())
    if pp > 1:
        # different pipeline stages hold different layers, hence different plans
        assert len({sig for sigs in by_group.values() for sig in sigs}) > 1


# -- placement -----------------------------------------------------------------------------------------------


def _check_placement(planned, total):
    end = 0
    for p in planned:
        assert p.offset % ALIGN == 0, p
        assert p.offset >= end, f"{p.meta.name} overlaps the previous tensor"
        end = p.offset + p.meta.nbytes
    assert end <= total
    assert total % ALIGN == 0


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distopt"])
@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
def test_offsets_are_64_byte_aligned_and_do_not_overlap(world, tp, pp, distributed_optimizer):
    for _, _, plan in all_plans(world, tp, pp, distributed_optimizer):
        _check_placement(plan.unique, plan.unique_bytes)
        _check_placement(plan.lazy, plan.lazy_bytes)
        assert plan.unique_bytes == sum(aligned(p.meta.nbytes) for p in plan.unique)
        assert plan.lazy_bytes == sum(aligned(p.meta.nbytes) for p in plan.lazy)


def test_odd_sizes_are_padded_to_the_alignment():
    metas = [TensorMeta("a", StateKind.OPTIMIZER, torch.float32, (3,)),      # 12 bytes
             TensorMeta("b", StateKind.OPTIMIZER, torch.uint8, (65,)),       # 65 bytes
             TensorMeta("c", StateKind.OPTIMIZER, torch.float64, ()),        # 8 bytes, 0-d
             TensorMeta("empty", StateKind.OPTIMIZER, torch.float32, (0, 4)),  # 0 bytes
             TensorMeta("d", StateKind.OPTIMIZER, torch.int16, (32,))]       # 64 bytes
    plan = plan_shards(metas, dp_size=1, distributed_optimizer=False)
    assert [p.offset for p in plan.unique] == [0, 64, 192, 256, 256]
    assert plan.unique_bytes == 320
    _check_placement(plan.unique, plan.unique_bytes)


def test_nbytes_uses_the_dtype_element_size():
    assert TensorMeta("x", StateKind.WEIGHT, torch.bfloat16, (3, 5)).nbytes == 30
    assert TensorMeta("x", StateKind.WEIGHT, torch.float64, ()).nbytes == 8
    assert TensorMeta.of("y", StateKind.OPTIMIZER, torch.zeros(2, 3, dtype=torch.int8)) == \
        TensorMeta("y", StateKind.OPTIMIZER, torch.int8, (2, 3))


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [4096, 1000, 24])
def test_adam_under_distributed_optimizer_costs_12_bytes_per_param_over_dp(n, dp):
    assert n % dp == 0
    shard = (n // dp,)
    metas = [TensorMeta("w", StateKind.WEIGHT, torch.bfloat16, (n,)),
             TensorMeta("main", StateKind.MAIN_PARAM, torch.float32, shard),
             TensorMeta("exp_avg", StateKind.OPTIMIZER, torch.float32, shard),
             TensorMeta("exp_avg_sq", StateKind.OPTIMIZER, torch.float32, shard)]
    plan = plan_shards(metas, dp_size=dp, distributed_optimizer=True)
    exact = 12 * n // dp
    assert plan.unique_bytes == 3 * aligned(4 * n // dp)
    assert exact <= plan.unique_bytes < exact + 3 * ALIGN
    if (4 * n // dp) % ALIGN == 0:
        assert plan.unique_bytes == exact


# -- signature -----------------------------------------------------------------------------------------------


def _base():
    return [TensorMeta("w", StateKind.WEIGHT, torch.bfloat16, (8, 4)),
            TensorMeta("m", StateKind.MAIN_PARAM, torch.float32, (16,)),
            TensorMeta("s", StateKind.OPTIMIZER, torch.float32, (16,))]


def test_signature_is_stable_across_calls():
    a = plan_shards(_base(), dp_size=2, distributed_optimizer=True)
    b = plan_shards(_base(), dp_size=2, distributed_optimizer=True)
    assert a.signature == b.signature
    assert a == b
    assert len(a.signature) == 32 and int(a.signature, 16) >= 0


@pytest.mark.parametrize("change", ["dp_size", "flag", "dtype", "shape", "name", "kind", "order", "extra_tensor"])
def test_signature_changes_with_the_layout(change):
    ref = plan_shards(_base(), dp_size=2, distributed_optimizer=True).signature
    metas, dp, flag = _base(), 2, True
    if change == "dp_size":
        dp = 4
    elif change == "flag":
        flag = False
    elif change == "dtype":
        metas[1] = TensorMeta("m", StateKind.MAIN_PARAM, torch.float64, (16,))
    elif change == "shape":
        metas[1] = TensorMeta("m", StateKind.MAIN_PARAM, torch.float32, (4, 4))
    elif change == "name":
        metas[1] = TensorMeta("m2", StateKind.MAIN_PARAM, torch.float32, (16,))
    elif change == "kind":
        metas[1] = TensorMeta("m", StateKind.OPTIMIZER, torch.float32, (16,))
    elif change == "order":
        metas = metas[::-1]
    elif change == "extra_tensor":
        metas.append(TensorMeta("t", StateKind.OPTIMIZER, torch.float32, ()))
    assert plan_shards(metas, dp_size=dp, distributed_optimizer=flag).signature != ref


def test_tensor_order_is_kept():
    metas = [TensorMeta(f"t{i}", StateKind.OPTIMIZER, torch.float32, (i + 1,)) for i in range(10)][::-1]
    plan = plan_shards(metas, dp_size=1, distributed_optimizer=False)
    assert [p.meta.name for p in plan.unique] == [m.name for m in metas]


# -- invalid input ---------------------------------------------------------------------------------------------


def test_duplicate_names_raise_value_error():
    metas = [TensorMeta("dup", StateKind.WEIGHT, torch.float32, (2,)),
             TensorMeta("other", StateKind.OPTIMIZER, torch.float32, (2,)),
             TensorMeta("dup", StateKind.OPTIMIZER, torch.float32, (2,))]
    with pytest.raises(ValueError, match="dup"):
        plan_shards(metas, dp_size=2, distributed_optimizer=False)


@pytest.mark.parametrize("dp", [0, -1])
def test_dp_size_below_one_raises_value_error(dp):
    with pytest.raises(ValueError, match="dp_size"):
        plan_shards(_base(), dp_size=dp, distributed_optimizer=False)


def test_disposition_of_an_unknown_name_raises_key_error():
    plan = plan_shards(_base(), dp_size=1, distributed_optimizer=False)
    with pytest.raises(KeyError):
        plan.disposition_of("nope")


def test_empty_state_gives_an_empty_plan():
    plan = plan_shards([], dp_size=4, distributed_optimizer=True)
    assert plan.unique == plan.lazy == plan.regenerable == ()
    assert plan.unique_bytes == plan.lazy_bytes == 0


# -- module buffers ------------------------------------------------------------------------------------------------

S = Disposition.STAGED


@pytest.mark.parametrize("dp_size,distributed_optimizer", list(RULES))
def test_changing_buffers_are_staged_and_constant_ones_regenerable_under_every_layout(dp_size, distributed_optimizer):
    assert disposition(StateKind.BUFFER, dp_size=dp_size, distributed_optimizer=distributed_optimizer) is S
    assert disposition(StateKind.CONSTANT_BUFFER, dp_size=dp_size,
                       distributed_optimizer=distributed_optimizer) is Disposition.REGENERABLE


@pytest.mark.parametrize("dp_size,distributed_optimizer", list(RULES))
def test_staged_buffers_follow_the_unique_tensors_in_the_payload(dp_size, distributed_optimizer):
    metas = [TensorMeta("bn.running_mean", StateKind.BUFFER, torch.float32, (5,)),
             TensorMeta("rope.inv_freq", StateKind.CONSTANT_BUFFER, torch.float32, (8,)),
             *_base(),
             TensorMeta("bn.num_batches_tracked", StateKind.BUFFER, torch.int64, ())]
    plan = plan_shards(metas, dp_size=dp_size, distributed_optimizer=distributed_optimizer)
    assert [p.meta.name for p in plan.staged] == ["bn.running_mean", "bn.num_batches_tracked"]
    assert all(p.disposition is S for p in plan.staged)
    assert [p.meta.name for p in plan.unique[-2:]] == ["bn.running_mean", "bn.num_batches_tracked"]
    assert all(p.disposition is Disposition.UNIQUE for p in plan.unique[:-2])
    assert "rope.inv_freq" in [m.name for m in plan.regenerable]
    assert plan.disposition_of("bn.running_mean") is S
    assert plan.disposition_of("rope.inv_freq") is Disposition.REGENERABLE
    _check_placement(plan.unique, plan.unique_bytes)
    assert plan.unique_bytes == sum(aligned(p.meta.nbytes) for p in plan.unique)


class _Rope(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


class _Counter(torch.nn.Module):
    """A persistent lookup table that never changes and a non-persistent counter that does."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.ones(3))
        self.register_buffer("seen", torch.zeros(()), persistent=False)


def _kinds(model, prefix=""):
    from neighbor_ckpt.adapters import classify_buffers

    return {name: kind for name, _, kind in classify_buffers(model, prefix)}


def test_buffer_rule_persistent_in_training_changes_non_persistent_and_eval_mode_are_constant():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3), _Rope(), torch.nn.BatchNorm1d(3))
    model[3].eval()  # a frozen BatchNorm
    assert _kinds(model) == {
        "1.running_mean": StateKind.BUFFER, "1.running_var": StateKind.BUFFER,
        "1.num_batches_tracked": StateKind.BUFFER,
        "2.inv_freq": StateKind.CONSTANT_BUFFER,
        "3.running_mean": StateKind.CONSTANT_BUFFER, "3.running_var": StateKind.CONSTANT_BUFFER,
        "3.num_batches_tracked": StateKind.CONSTANT_BUFFER,
    }
    assert set(_kinds(model, "0.")) == {"0." + k for k in _kinds(model)}


def test_declare_buffers_is_the_escape_hatch_both_ways_and_survives_train_eval():
    from neighbor_ckpt.adapters import declare_buffers

    m = torch.nn.Sequential(_Counter())
    assert _kinds(m) == {"0.table": StateKind.BUFFER, "0.seen": StateKind.CONSTANT_BUFFER}
    declare_buffers(m[0], constant=["table"], changing=["seen"])
    m.eval()
    m.train()
    assert _kinds(m) == {"0.table": StateKind.CONSTANT_BUFFER, "0.seen": StateKind.BUFFER}
    with pytest.raises(KeyError, match="no buffer 'nope'"):
        declare_buffers(m[0], constant=["nope"])


def test_a_buffer_shared_by_two_modules_is_reported_once():
    a, b = _Counter(), _Counter()
    b.table = a.table
    assert list(_kinds(torch.nn.ModuleList([a, b]))) == ["0.table", "0.seen", "1.seen"]


def test_adapters_report_changing_buffers_as_staged_and_never_as_weights():
    """Under torch's ZeRO the weights are regenerable, the BatchNorm statistics are not: they are staged."""
    from neighbor_ckpt.adapters import TorchOptimizerAdapter

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3), _Rope())
    adapter = TorchOptimizerAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1))
    kinds = {m.name: m.kind for m, _ in adapter.named_tensors()}
    assert kinds == {"model/0.weight": StateKind.WEIGHT, "model/0.bias": StateKind.WEIGHT,
                     "model/1.weight": StateKind.WEIGHT, "model/1.bias": StateKind.WEIGHT,
                     "buffer/1.running_mean": StateKind.BUFFER, "buffer/1.running_var": StateKind.BUFFER,
                     "buffer/1.num_batches_tracked": StateKind.BUFFER, "buffer/2.inv_freq": StateKind.CONSTANT_BUFFER}
    for dp, dist_opt in RULES:
        plan = plan_shards([m for m, _ in adapter.named_tensors()], dp_size=dp, distributed_optimizer=dist_opt)
        assert {p.meta.name for p in plan.staged} == {"buffer/1.running_mean", "buffer/1.running_var",
                                                      "buffer/1.num_batches_tracked"}
