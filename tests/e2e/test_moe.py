"""End to end on a real megatron-core mixture-of-experts GPT on CPU (``megatron_patches.enable_cpu()`` with the MoE
patches of ``megatron_patches/moe.py``): 4 gloo ranks, EP = 2, 4 experts top-2, SequentialMLP, the distributed
optimizer, the aux-loss-free sigmoid router with its ``expert_bias`` (``tests/workers/train_mcore_moe.py``), and the
same layers under NeMo 2's ``MegatronStrategy`` with the ``NeighborCheckpoint`` callback (``train_nemo.py``, EP=2, and
EP=2 x TP=2 with sequence parallelism)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import Baselines, assert_same_training, recomputed_steps, run_torchrun

pytestmark = pytest.mark.e2e
pytest.importorskip("megatron.core")

STEPS = 6


# Run-to-run determinism is the kill tests': their restarted jobs must reproduce the failure-free run's losses and
# final state bit for bit (the alltoall dispatcher below, under megatron-core and under NeMo), so the allgather
# dispatcher trains once here (one job fewer in CI).
@pytest.mark.parametrize("dispatcher", ["allgather"])
def test_tiny_moe_gpt_with_expert_bias_trains_on_cpu_with_finite_losses(dispatcher: str, baseline: Baselines) -> None:
    first = baseline("train_mcore_moe.py", STEPS=STEPS, EP=2, DISPATCHER=dispatcher, ROUTER="bias")
    assert first.returncode == 0, first.log[-6000:]
    losses = first.losses()
    assert sorted(losses) == [0, 1, 2, 3]
    for rank, steps in losses.items():
        assert sorted(steps) == list(range(STEPS)), f"rank {rank} trained other steps"
    _assert_moe_state(first)


def _assert_moe_state(run) -> None:  # noqa: ANN001 - a RunResult of tests.conftest
    """Every loss finite; two chained optimizers (dense, expert); every router's expert_bias present and updated."""
    for rank, steps in run.losses().items():
        values = [float.fromhex(recs[-1][1]) for _, recs in sorted(steps.items())]
        assert all(math.isfinite(v) for v in values), (rank, values)
    for rank in range(4):
        final = run.final(rank)
        assert final["chained"] == 2, "the distributed optimizer keeps the dense and the expert parameters apart"
        biases = final["expert_bias"]
        assert sorted(biases) == [f"decoder.layers.{i}.mlp.router.expert_bias" for i in range(2)]
        assert any(float.fromhex(x) != 0.0 for b in biases.values() for x in b), "expert_bias never updated"


def test_moe_kill_at_step_5_with_an_empty_store_is_bit_exact_including_every_expert_bias(
        baseline: Baselines, tmp_path: Path) -> None:
    """Rank 1 (EP rank 1: experts 2 and 3 of every layer) is SIGKILLed at the start of step 5 and restarts with an
    empty host store: it pulls its snapshot (its shards of the dense and of the expert distributed optimizer, and its
    routers' expert_bias buffers) from its ring successor; every loss, every rank's final weights, optimizer state
    and expert_bias equal the failure-free run's bit for bit."""
    base = baseline("train_mcore_moe.py", STEPS=8, EP=2, DISPATCHER="alltoall", ROUTER="bias")
    res = run_torchrun("train_mcore_moe.py", tmp_path, max_restarts=1, STEPS=8, EP=2, DISPATCHER="alltoall",
                       ROUTER="bias", KILL_RANK=1, KILL_STEP=5, WIPE_RANKS=1)
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    _assert_moe_state(base)
    assert_same_training(base, res)  # losses (each recomputation too), final params, optimizer state, expert_bias
    assert recomputed_steps(res) <= {4, 5}
    rep = res.report(1, 1)
    assert rep["outcome"] == "restored" and rep["source"] == "replica" and rep["pulled_bytes"] > 0, rep
    assert rep["lazy_bytes"] == 0, "under the distributed optimizer expert weights regenerate, never backed up"
    plan = json.loads((base.out / "plan.rank1.json").read_text())
    staged = [name for name, kind, disposition, _ in plan["unique"] if disposition == "staged"]
    assert staged == [f"buffer/0.module.decoder.layers.{i}.mlp.router.expert_bias" for i in range(2)]
    experts = [name for name, *_ in plan["unique"] if ".mlp.experts.local_experts." in name]
    assert experts and all(name.startswith(("main/", "optim/")) for name in experts)
    assert not plan["lazy"] and all(name.startswith(("model/", "buffer/")) for name in plan["regenerable"])
    assert "buffer/0.module.decoder.layers.0.mlp.router.local_tokens_per_expert" in plan["regenerable"]  # scratch
    for rank in range(4):
        assert base.final(rank)["expert_bias"] == res.final(rank)["expert_bias"]
    # the planner's rule, measured: dense state sharded over DP x CP (4 ranks), expert state over expert-DP (2 ranks
    # per EP rank): fp32 main param + exp_avg + exp_avg_sq, 12 bytes per param over the group's shards
    plans = [json.loads((base.out / f"plan.rank{r}.json").read_text()) for r in range(4)]
    assert {(p["ep_size"], p["expert_dp_size"], p["dp_size"]) for p in plans} == {(2, 2, 4)}

    def opt_bytes(plan: dict, expert: bool) -> int:
        return sum(nbytes for name, _, disposition, nbytes in plan["unique"] if disposition == "unique"
                   and (".mlp.experts." in name) == expert)

    assert sum(opt_bytes(p, expert=False) for p in plans) == 12 * plans[0]["dense_params"]
    for ep_rank in (0, 1):
        group = [p for p in plans if p["ep_rank"] == ep_rank]
        assert len(group) == 2
        assert sum(opt_bytes(p, expert=True) for p in group) == 12 * group[0]["expert_params"]


def test_moe_with_a_replicated_optimizer_is_refused_before_training(tmp_path: Path) -> None:
    """Replicated optimizer state is backed up lazily by a data-parallel peer, which under expert parallelism holds
    other experts: the adapter refuses with a TopologyError that names the way out, before any step."""
    res = run_torchrun("train_mcore_moe.py", tmp_path, STEPS=2, EP=2, DIST_OPT=0)
    assert res.returncode != 0
    assert "TopologyError" in res.log and "Use the distributed optimizer" in res.log, res.log[-4000:]
    assert not any(res.losses().values()), "no step may run"


@pytest.mark.parametrize("layout", ["ep2-dp4", "ep2-tp2"])
def test_nemo_moe_kill_in_the_optimizer_step_with_an_empty_store_is_bit_exact_including_every_expert_bias(
        layout: str, baseline: Baselines, tmp_path: Path) -> None:
    """The same MoE layers under NeMo 2 (``llm.GPTModel``, ``MegatronStrategy(expert_model_parallel_size=2)``, the
    unchanged ``NeighborCheckpoint`` callback, ``tests/workers/train_nemo.py`` with EP=2): rank 1 is SIGKILLed inside
    step 5's optimizer step and restarts with an empty host store; every ``reduced_train_loss``, every rank's final
    weights, optimizer state (dense and expert chained optimizers) and every router's ``expert_bias`` equal the
    failure-free run bit for bit. ``ep2-tp2``: EP 2 x TP 2 on the 4 ranks (sequence parallel, as megatron-core requires
    for MoE under TP), the experts not tensor-parallel (expert TP 1), so the expert state is sharded over an
    expert-DP group of 2 and the dense state over DP 2: each has a ring successor to restore from."""
    pytest.importorskip("nemo.collections.llm")
    env = dict(STEPS=8, TP=1, PP=1, EP=2, DIST_OPT=1, KILL_PHASE="optimizer")
    if layout == "ep2-tp2":
        env.update(TP=2, ETP=1)
    base = baseline("train_nemo.py", **env)
    res = run_torchrun("train_nemo.py", tmp_path / "fault", max_restarts=1, KILL_RANK=1, KILL_STEP=5, WIPE_RANKS=1,
                       **env)
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    assert_same_training(base, res)  # losses (each recomputation too), final params, optimizer state, expert_bias
    assert recomputed_steps(res) <= {5}
    rep = res.report(1, 1)
    assert (rep["outcome"], rep["iteration"], rep["source"]) == ("restored", 5, "replica"), rep
    assert rep["lazy_bytes"] == 0, "under the distributed optimizer expert weights regenerate, never backed up"
    for rank in range(4):
        biases = base.final(rank)["expert_bias"]
        assert len(biases) == 2 and all(name.endswith("mlp.router.expert_bias") for name in biases), biases
        assert any(float.fromhex(x) != 0.0 for b in biases.values() for x in b), "expert_bias never updated"
        assert res.final(rank)["expert_bias"] == biases
        optimizers = {key.split(".")[0] for key in base.final(rank)["optim"]}
        assert optimizers == {"0", "1"}, "the dense and the expert distributed optimizers, chained"
        assert any(".mlp.experts.local_experts." in name for name in base.final(rank)["params"])
    if layout == "ep2-tp2":  # sequence parallel: each norm's grads all-reduced over TP (megatron_patches/moe.py 6.)
        for a, b in ((0, 1), (2, 3)):
            norms = {k: v for k, v in base.final(a)["params"].items() if "norm" in k}
            assert norms and norms == {k: base.final(b)["params"][k] for k in norms}, "TP ranks' norms diverged"
