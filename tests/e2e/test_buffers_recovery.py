"""End to end: module buffers that every forward updates (BatchNorm running statistics, a running-mean layer the
loss depends on) are restored bit for bit after a real SIGKILL (issue 16).

* torch ZeRO on 4 gloo ranks: the weights are regenerable, the buffers are not (ZeRO's parameter sync does not carry
  them). Rank 0 is killed and comes back with an empty store: under DDP its buffers are the ones broadcast to every
  rank before each forward, so a fresh copy would change every later loss.
* DP = 1 (one rank, plain AdamW): everything is unique; the buffers are copied on the training thread at each
  snapshot, never by the engine thread while the next forward updates them.

Every per-step loss, the final parameters, buffers and optimizer state equal the failure-free run. Against the code
before issue 16 (ZeRO tagged buffers as regenerable weights and never restored them) the first test fails at rank 0's
first recomputed loss."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Baselines, assert_same_training, recomputed_steps, run_torchrun

pytestmark = pytest.mark.e2e

WORKER = "train_lightning_buffers.py"


def test_zero_optimizer_with_batchnorm_kill_with_empty_store_restores_buffers_bit_exact(baseline: Baselines,
                                                                                         tmp_path: Path) -> None:
    res = run_torchrun(WORKER, tmp_path, max_restarts=1, OPTIM="zero", WIPE_RANKS=0, KILL_RANK=0, KILL_STEP=7,
                       KILL_PHASE="forward")
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    base = baseline(WORKER, OPTIM="zero")
    assert base.final(0)["buffers"], "the model has no buffers to compare"
    assert_same_training(base, res)
    rep = res.report(0, 1)
    # Rank 0 dies in the forward of step 7, before its wait point: the replica of its snapshot 7 may still be in
    # flight, and then every rank goes back to 6 (the version-skew rule). Either way nothing older is recomputed.
    assert rep["outcome"] == "restored" and rep["iteration"] in (6, 7)
    assert recomputed_steps(res) <= set(range(rep["iteration"], 8))
    assert rep["source"] == "replica" and rep["pulled_bytes"] > 0


def test_dp1_with_a_buffer_mutating_forward_kill_restores_buffers_bit_exact(baseline: Baselines,
                                                                             tmp_path: Path) -> None:
    res = run_torchrun(WORKER, tmp_path, nproc=1, max_restarts=1, DEVICES=1, KILL_RANK=0, KILL_STEP=7,
                       KILL_PHASE="forward")
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    assert_same_training(baseline(WORKER, nproc=1, DEVICES=1), res, nranks=1)
    assert recomputed_steps(res) <= {7}
    rep = res.report(0, 1)
    assert rep["outcome"] == "restored" and rep["iteration"] == 7 and rep["source"] == "own"
