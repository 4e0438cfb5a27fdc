"""End to end on NeMo 2: ``llm.GPTModel`` + ``nl.Trainer`` + ``MegatronStrategy`` with the unchanged
``NeighborCheckpoint()`` callback, 4 gloo ranks under torchrun, rank 1 SIGKILLed at step 5 and its host store
replaced by an empty one. ``reduced_train_loss`` of every step, final weights and optimizer state must equal
the failure-free run exactly.

Under the distributed optimizer the kill lands inside the optimizer step (weights torn)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Baselines, RunResult, assert_same_training, recomputed_steps, run_torchrun

pytestmark = pytest.mark.e2e
pytest.importorskip("nemo.collections.llm")

STEPS = 8
CASES = {
    "distopt-dp4": {"TP": 1, "PP": 1, "DIST_OPT": 1, "KILL_PHASE": "optimizer"},
    "distopt-pp2-dp2": {"TP": 1, "PP": 2, "DIST_OPT": 1, "KILL_PHASE": "optimizer"},
}


# DP4 with the distributed optimizer runs through the user's commands in tests/e2e/test_recipes.py (the demo), and
# so does TP2 x DP2 (the tiny Llama recipe through llm.pretrain, killed in its backward pass; test_elastic.py shrinks
# a NeMo TP 2 job too); the replicated optimizer's lazy backup is the adapter's, the same as in the plain megatron-core
# loop (test_mcore_recovery.py) and behind the same callback as Lightning's (test_lightning_recovery.py). Here, the
# layout no other NeMo test trains (CI time: each NeMo job costs about 4 minutes here, mostly imports).
@pytest.mark.parametrize("case", [c for c in CASES if c != "distopt-dp4"])
def test_nemo_kill_at_step_5_with_replaced_store_is_bit_exact(case: str, baseline: Baselines, tmp_path: Path) -> None:
    env = dict(CASES[case], STEPS=STEPS)
    base = baseline("train_nemo.py", **env)
    res = run_torchrun("train_nemo.py", tmp_path / "fault", max_restarts=1, KILL_RANK=1, KILL_STEP=5, WIPE_RANKS=1,
                       **env)
    assert res.returncode == 0, res.log[-6000:]
    assert "exitcode: -9" in res.log, "the kill did not happen"
    _assert_recovered(base, res)


def _assert_recovered(base: RunResult, res: RunResult) -> None:
    assert_same_training(base, res)
    assert recomputed_steps(res) <= {5}
    rep = res.report(1, 1)
    # Snapshots are numbered by trainer.global_step after the step: iteration 5 = steps 0..4 done.
    assert (rep["outcome"], rep["iteration"], rep["source"]) == ("restored", 5, "replica"), rep
    assert rep["lazy_bytes"] == 0, "weights are regenerated from the fp32 shards, never backed up"


def test_nemo_autoresume_of_an_older_disk_checkpoint_does_not_roll_back_the_in_memory_version(
        baseline: Baselines, tmp_path: Path) -> None:
    """NeMo's ModelCheckpoint (every 3 steps) + AutoResume stay the insurance: on the restart AutoResume points the
    trainer at the step-3 checkpoint, the in-memory version of step 5 is newer and wins, bit-for-bit."""
    env = dict(CASES["distopt-dp4"], STEPS=STEPS, DISK_EVERY=3)
    base = baseline("train_nemo.py", **env)
    res = run_torchrun("train_nemo.py", tmp_path / "fault", max_restarts=1, KILL_RANK=1, KILL_STEP=5, WIPE_RANKS=1,
                       **env)
    assert res.returncode == 0, res.log[-6000:]
    assert "exitcode: -9" in res.log, "the kill did not happen"
    _assert_recovered(base, res)
    assert "skipping the disk restore of" in res.log


def test_nemo_losing_a_rank_and_its_successor_falls_back_to_nemos_disk_checkpoint(tmp_path: Path) -> None:
    """Rank 1 and its ring successor (rank 2) both come back with empty host stores: no complete in-memory version
    exists. The callback says so in one line and lets NeMo's AutoResume load its distributed checkpoint of step 3;
    the run re-trains steps 3..7 and finishes. Nothing from the host store is loaded."""
    env = dict(CASES["distopt-dp4"], STEPS=STEPS, DISK_EVERY=3)
    res = run_torchrun("train_nemo.py", tmp_path / "fault", max_restarts=1, KILL_RANK=1, KILL_STEP=5,
                       WIPE_RANKS="1,2", **env)
    assert res.returncode == 0, res.log[-6000:]
    assert "exitcode: -9" in res.log, "the kill did not happen"
    assert "falling back to the insurance checkpoint of iteration 3 because" in res.log, res.log[-6000:]
    assert "NeMo loads its distributed checkpoint" in res.log
    for rank in range(4):
        rep = res.report(rank, 1)
        assert (rep["outcome"], rep["iteration"]) == ("insurance", 3), rep
        assert rep["pulled_bytes"] == 0 and rep["lazy_bytes"] == 0
    # The steps after the disk checkpoint that the first attempt had trained (step 5 on the ranks that logged it).
    assert {3, 4} <= recomputed_steps(res) <= {3, 4, 5}
    assert res.final(0)["global_step"] == STEPS
