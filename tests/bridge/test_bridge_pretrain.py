"""Megatron-Bridge 0.6's own ``pretrain(cfg, forward_step, callbacks=[...])`` on megatron-core 0.19.2, CPU/gloo, with
nothing but ``enable_cpu(nemo=False)`` before Bridge is imported (``tests/workers/train_bridge.py``): a tiny GPT,
the distributed optimizer, mock data, 2 ranks (and 4 at TP 2). The ground the Bridge callback stands on: a run is a function of its
seed, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Baselines, RunResult, assert_same_training, run_torchrun

pytestmark = pytest.mark.e2e

STEPS, NPROC = 5, 2
GLOBAL_BATCH = 8  # train_bridge.py: micro-batch 2, two micro-batches per data-parallel rank, DP 2
LAYOUTS = {"dp2": {"nproc": 2, "TP": 1, "STEPS": STEPS}, "tp2-dp2": {"nproc": 4, "TP": 2, "STEPS": 8}}
"""TP 2 runs 8 steps: its first run is the failure-free baseline test_bridge_callback.py's TP 2 kill test compares
with (computed once per session)."""


def _check_run(res: RunResult, nproc: int = NPROC, steps: int = STEPS) -> None:
    assert res.returncode == 0, res.log[-6000:]
    losses = res.losses()
    for rank in range(nproc):
        assert sorted(losses[rank]) == list(range(steps)), f"rank {rank} recorded steps {sorted(losses[rank])}"
        assert all(loss is not None for recs in losses[rank].values() for _, loss in recs)
        final = res.final(rank)
        assert (final["step"], final["consumed_samples"]) == (steps, steps * GLOBAL_BATCH), final
        assert final["optimizer"], "the distributed optimizer's fp32 shard state was not found"


@pytest.mark.cold
@pytest.mark.parametrize("layout", ["tp2-dp2"])  # dp2's first run: the other-seed test's reference, below
def test_bridge_pretrain_is_bit_identical_across_runs(layout: str, baseline: Baselines, tmp_path: Path) -> None:
    """Two runs with one seed: every loss (==, as float.hex), every final parameter and every optimizer shard
    tensor (sha256) equal. The first run's workers fork from the warm zygote, the second's start cold (as a user's
    torchrun does): the same bits either way. At TP 2 the tensor-parallel ranks' dropout draws from the RNG
    tracker's model-parallel stream, which only the Bridge patch seeds on CPU."""
    nproc, tp, steps = LAYOUTS[layout]["nproc"], LAYOUTS[layout]["TP"], LAYOUTS[layout]["STEPS"]
    first = baseline("train_bridge.py", nproc=nproc, warm=True, STEPS=steps, TP=tp)
    _check_run(first, nproc, steps)
    second = run_torchrun("train_bridge.py", tmp_path, nproc=nproc, STEPS=steps, TP=tp)
    _check_run(second, nproc, steps)
    assert_same_training(first, second, nranks=nproc)


def test_bridge_pretrain_with_another_seed_differs(baseline: Baselines, tmp_path: Path) -> None:
    """The comparison above can fail: another seed (data and initialization) gives other losses and weights. At DP 2
    (TP 1), whose run is checked as the TP 2 runs are."""
    first = baseline("train_bridge.py", nproc=NPROC, warm=True, STEPS=STEPS, TP=1)
    _check_run(first)
    other = run_torchrun("train_bridge.py", tmp_path, nproc=NPROC, STEPS=STEPS, TP=1, SEED=4321)
    _check_run(other)
    assert first.losses()[0][0] != other.losses()[0][0]
    assert first.final(0)["params"] != other.final(0)["params"]
