"""End to end on NeMo 2: ``llm.GPTModel`` + ``nl.Trainer`` + ``MegatronStrategy`` with the unchanged
``NeighborCheckpoint()`` callback beside NeMo's own insurance (``ModelCheckpoint`` every 3 steps + ``AutoResume``), 4
gloo ranks under torchrun, rank 1 SIGKILLed inside the optimizer step of step 5 (weights torn) and its host store
replaced by an empty one: the in-memory version wins over the older disk checkpoint, bit for bit; with the successor's
store lost too, NeMo's disk checkpoint is the fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Baselines, RunResult, assert_same_training, recomputed_steps, run_torchrun

pytestmark = pytest.mark.e2e
pytest.importorskip("nemo.collections.llm")

STEPS = 8
DISTOPT_DP4 = {"TP": 1, "PP": 1, "DIST_OPT": 1, "KILL_PHASE": "optimizer"}


# Layouts under NeMo: DP4 runs through the user's commands in tests/e2e/test_recipes.py (the demo), TP2 x DP2 too
# (the tiny Llama recipe through llm.pretrain, killed in its backward pass; test_elastic.py shrinks a NeMo TP 2 job),
# EP 2 in test_moe.py; PP 2 x DP2 and the replicated optimizer's lazy backup are the same adapter and megatron-core
# optimizer as in the plain loop (test_mcore_recovery.py). Here: what only NeMo has, its own disk checkpoint with
# AutoResume beside the callback (each NeMo job costs about 4 minutes of CI here, mostly imports).


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
    env = dict(DISTOPT_DP4, STEPS=STEPS, DISK_EVERY=3)
    base = baseline("train_nemo.py", **env)
    res = run_torchrun("train_nemo.py", tmp_path / "fault", max_restarts=1, KILL_RANK=1, KILL_STEP=5, WIPE_RANKS=1,
                       **env)
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    _assert_recovered(base, res)
    assert "skipping the disk restore of" in res.log


def test_nemo_losing_a_rank_and_its_successor_falls_back_to_nemos_disk_checkpoint(tmp_path: Path) -> None:
    """Rank 1 and its ring successor (rank 2) both come back with empty host stores: no complete in-memory version
    exists. The callback says so in one line and lets NeMo's AutoResume load its distributed checkpoint of step 3;
    the run re-trains steps 3..7 and finishes. Nothing from the host store is loaded.

    NeMo's resume from its own checkpoint does not give the replayed step the input it had before the failure (its
    loss differs from the first attempt's; so it did before the data check ran under NeMo, silently): the data check,
    which now sees NeMo's micro-batches, says so on the ranks that kept their input record. Under the default
    ``data_check: error`` that stops the job at the replayed step (the announced stop); this run sets ``warn`` to show
    the fallback itself going on, and the divergence announced."""
    env = dict(DISTOPT_DP4, STEPS=STEPS, DISK_EVERY=3)
    res = run_torchrun("train_nemo.py", tmp_path / "fault", max_restarts=1, KILL_RANK=1, KILL_STEP=5,
                       WIPE_RANKS="1,2", DATA_CHECK="warn", **env)
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    assert "falling back to the insurance checkpoint of iteration 3 because" in res.log, res.log[-6000:]
    assert "NeMo loads its distributed checkpoint" in res.log
    assert "the data position was not restored: step 4, replayed" in res.log, res.log[-6000:]
    for rank in range(4):
        rep = res.report(rank, 1)
        assert (rep["outcome"], rep["iteration"]) == ("insurance", 3), rep
        assert rep["pulled_bytes"] == 0 and rep["lazy_bytes"] == 0
    # The steps after the disk checkpoint that the first attempt had trained (step 5 on the ranks that logged it).
    assert {3, 4} <= recomputed_steps(res) <= {3, 4, 5}
    assert res.final(0)["global_step"] == STEPS
