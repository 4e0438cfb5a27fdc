"""End to end: Lightning DDP on 4 gloo ranks under torchrun, a real SIGKILL in the middle of step 7, a real
restart. Every per-step loss, the final parameters and the optimizer state must equal the failure-free run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Baselines, RunResult, assert_same_training, recomputed_steps, run_torchrun

pytestmark = pytest.mark.e2e

KILL = {"KILL_RANK": 2, "KILL_STEP": 7, "KILL_PHASE": "forward"}




def _restarted(res: RunResult) -> None:
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"


@pytest.mark.quick
def test_kill_with_replaced_store_resumes_bit_exact(baseline: Baselines, tmp_path: Path) -> None:
    res = run_torchrun("train_lightning.py", tmp_path, max_restarts=1, WIPE_RANKS=2, **KILL)
    _restarted(res)
    assert_same_training(baseline("train_lightning.py"), res)
    assert recomputed_steps(res) <= {7}, "more than the in-flight iteration was recomputed"
    rep = res.report(2, 1)
    assert rep["outcome"] == "restored" and rep["iteration"] == 7
    assert rep["source"] == "replica" and rep["pulled_bytes"] > 0
    assert rep["lazy_from"] is not None and rep["lazy_from"] != 2


def test_kill_with_store_kept_restores_from_local_slot(baseline: Baselines, tmp_path: Path) -> None:
    res = run_torchrun("train_lightning.py", tmp_path, max_restarts=1, **KILL)
    _restarted(res)
    assert_same_training(baseline("train_lightning.py"), res)
    for rank in range(4):
        rep = res.report(rank, 1)
        assert rep["outcome"] == "restored" and rep["iteration"] == 7
        assert rep["source"] == "own" and rep["pulled_bytes"] == 0, f"rank {rank} pulled its unique state"
    # The redundant weights/optimizer state died with rank 2's process: only it pulls a lazy backup.
    assert [res.report(r, 1)["lazy_bytes"] > 0 for r in range(4)] == [False, False, True, False]


def test_zero_optimizer_kill_restores_everything_from_local_slots(baseline: Baselines, tmp_path: Path) -> None:
    """With a sharded optimizer all state is unique: a process crash needs no network transfer at all."""
    res = run_torchrun("train_lightning.py", tmp_path, max_restarts=1, OPTIM="zero", **KILL)
    _restarted(res)
    assert_same_training(baseline("train_lightning.py", OPTIM="zero"), res)
    for rank in range(4):
        rep = res.report(rank, 1)
        assert rep["source"] == "own" and rep["pulled_bytes"] == 0 and rep["lazy_bytes"] == 0


def test_version_skew_reconciles_to_earliest_common_iteration(baseline: Baselines, tmp_path: Path) -> None:
    """Rank 2 dies after its optimizer step 8 but before that step's snapshot; the others commit step 8.
    Latest snapshots differ by one iteration; all ranks go back to 7 and the run stays bit-exact."""
    res = run_torchrun("train_lightning.py", tmp_path, max_restarts=1, OPTIM="zero", WIPE_RANKS=2,
                       KILL_RANK=2, KILL_STEP=7, KILL_PHASE="after_step")
    _restarted(res)
    assert_same_training(baseline("train_lightning.py", OPTIM="zero"), res)
    assert all(res.report(r, 1)["iteration"] == 7 for r in range(4))


def test_flipped_byte_is_caught_and_the_replica_is_used(baseline: Baselines, tmp_path: Path) -> None:
    res = run_torchrun("train_lightning.py", tmp_path, max_restarts=1, FLIP_RANK=2, **KILL)
    _restarted(res)
    assert_same_training(baseline("train_lightning.py"), res)
    rep = res.report(2, 1)
    assert rep["source"] == "replica"
    assert any("checksum mismatch" in n for n in rep["notes"]), rep["notes"]
    assert "checksum mismatch" in res.log


def test_killed_rank_and_successor_losing_stores_fall_back_to_insurance(baseline: Baselines, tmp_path: Path) -> None:
    # Every rank is its own "node" here, so the ring keeps DP order and rank 3 holds rank 2's replica.
    res = run_torchrun("train_lightning.py", tmp_path, max_restarts=1, WIPE_RANKS="2,3", INSURANCE_EVERY=3, **KILL)
    _restarted(res)
    assert "falling back to the insurance checkpoint of iteration 6 because" in res.log
    assert_same_training(baseline("train_lightning.py"), res)
    assert res.report(2, 1)["outcome"] == "insurance"


def test_an_insurance_checkpoint_in_the_first_releases_format_still_resumes(baseline: Baselines,
                                                                          tmp_path: Path) -> None:
    """The insurance fallback above, with every insurance checkpoint rewritten before the restart as release 0.1
    wrote it (``callbacks["NeighborCheckpoint"] == {"training_state": {...}}``, read back by hand then; now through
    Lightning's ``load_state_dict``): the same bit-exact resume."""
    res = run_torchrun("train_lightning.py", tmp_path, max_restarts=1, WIPE_RANKS="2,3", INSURANCE_EVERY=3,
                       INSURANCE_AS="release-0.1", **KILL)
    _restarted(res)
    assert "rewrote neighbor-insurance-step6.ckpt in release 0.1's format" in res.log
    assert "loaded insurance checkpoint" in res.log and "(global step 6)" in res.log
    assert_same_training(baseline("train_lightning.py"), res)
    assert res.report(2, 1)["outcome"] == "insurance"


def test_without_insurance_losing_both_copies_is_a_typed_error(tmp_path: Path) -> None:
    res = run_torchrun("train_lightning.py", tmp_path, max_restarts=1, WIPE_RANKS="2,3", **KILL)
    assert res.returncode != 0
    errors = [res.error(r) for r in range(4)]
    assert all(e is not None and e["type"] == "NoRecoverableStateError" for e in errors), errors
    assert "no insurance checkpoint is configured" in errors[0]["message"]
    assert not any(a == 1 for steps in res.losses().values() for recs in steps.values() for a, _ in recs), \
        "a rank trained after an unrecoverable failure"


def test_pytorch_lightning_package_trainer_recovers_bit_exact(baseline: Baselines, tmp_path: Path) -> None:
    res = run_torchrun("train_lightning.py", tmp_path / "fault", max_restarts=1, PL_PACKAGE="pytorch_lightning",
                       WIPE_RANKS=2, **KILL)
    _restarted(res)
    assert_same_training(baseline("train_lightning.py", PL_PACKAGE="pytorch_lightning"), res)


def test_disk_resume_of_an_older_checkpoint_does_not_roll_back_the_in_memory_version(baseline: Baselines,
                                                                                         tmp_path: Path) -> None:
    """fit(ckpt_path="last") on the restart (what AutoResume does): the disk checkpoint of step 6 is older than the
    in-memory version of step 7, so it is not loaded over it; training continues bit-for-bit. Writing disk
    checkpoints changes no training state (as the insurance checkpoints above), so the reference is the
    failure-free run without them, the one the other tests compare with."""
    res = run_torchrun("train_lightning.py", tmp_path / "fault", max_restarts=1, DISK_EVERY=3, WIPE_RANKS=2, **KILL)
    _restarted(res)
    assert_same_training(baseline("train_lightning.py"), res)
    assert recomputed_steps(res) <= {7}
    assert "skipping the disk restore of" in res.log
