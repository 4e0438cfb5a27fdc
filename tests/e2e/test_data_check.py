"""End to end: the data-position check on a megatron-core loop fed by a real DataLoader (``train_mcore_data.py``),
4 gloo ranks under ``torchrun --max-restarts 1``, rank 1 SIGKILLed inside optimizer step 5, every host store kept.

* A loader that reshuffles from the global RNG after the restart (``DataLoader(shuffle=True)``, its iterator created
  after ``recover()``): the job stops with ``DataPositionError`` at the replayed step 5, before training it; nothing
  diverges silently.
* The same loop with its position resumed (torchdata ``StatefulDataLoader`` state in the snapshot): bit-exact against
  the failure-free run, and every rank verified step 5's input.
* ``data_check: warn``: the mismatch is logged and the job trains to the end (on other data: step 5's loss differs
  from the one computed before the failure).

The kill falls mid-epoch (6 steps per epoch). At an epoch boundary the reshuffling loader would, here, draw the same
seed again (on CPU nothing after its first draw uses the global RNG, so the restored RNG is the one the next epoch's
iterator saw): the same batches, rightly not flagged; found when the kill was at step 5 of a 5-step epoch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Baselines, assert_same_training, recomputed_steps, run_torchrun

pytestmark = pytest.mark.e2e
pytest.importorskip("megatron.core")

STEPS, KILL = 8, 5
FAULT = {"STEPS": STEPS, "KILL_RANK": 1, "KILL_STEP": KILL}


def test_a_loader_that_reshuffles_after_the_restart_stops_the_job_at_the_replayed_step(tmp_path: Path) -> None:
    res = run_torchrun("train_mcore_data.py", tmp_path, max_restarts=1, LOADER="reshuffle", **FAULT)
    assert res.killed(), "the kill did not happen"
    assert res.returncode != 0, "the job must stop, not train on other data"
    errors = {r: res.error(r) for r in range(4)}
    stopped = {r: e for r, e in errors.items() if e is not None and e["attempt"] == 1}
    assert stopped, res.log[-6000:]
    for rank, err in stopped.items():
        assert err["type"] == "DataPositionError", err
        assert err["message"].startswith(f"rank {rank}: the data position was not restored: step {KILL}"), err
        assert "restore of iteration 4" in err["message"] and "StatefulDataLoader" in err["message"]
    assert 1 in stopped, "the killed rank kept its store: its in-flight record of step 5 is checked too"
    for rank, steps in res.losses().items():
        assert all(a == 0 for a, _ in steps.get(KILL, [])), f"rank {rank} trained the replayed step on other data"
        assert max(steps) == KILL, f"rank {rank} went past step {KILL}"


def test_a_loader_resumed_from_the_snapshot_is_bit_exact_and_verified(baseline: Baselines, tmp_path: Path) -> None:
    base = baseline("train_mcore_data.py", STEPS=STEPS, LOADER="stateful")
    res = run_torchrun("train_mcore_data.py", tmp_path, max_restarts=1, LOADER="stateful", **FAULT)
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    assert_same_training(base, res)
    assert recomputed_steps(res) == {KILL}
    for rank in range(4):
        assert (f"[rank{rank}] neighbor_ckpt.recovery.datacheck INFO rank {rank}: neighbor_ckpt data check: step "
                f"{KILL} replays the input it had before the failure") in res.log, rank


def test_warn_logs_the_mismatch_and_trains_on(tmp_path: Path) -> None:
    cfg = tmp_path / "nckpt.yaml"
    cfg.write_text("neighbor_ckpt:\n  data_check: warn\n")
    res = run_torchrun("train_mcore_data.py", tmp_path, max_restarts=1, LOADER="reshuffle", NCKPT_CONFIG=cfg, **FAULT)
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    assert "neighbor_ckpt data check (data_check: warn, training goes on)" in res.log
    assert f"the data position was not restored: step {KILL}" in res.log
    assert "DataPositionError" not in res.log
    losses = res.losses()
    for rank in range(4):
        assert sorted(losses[rank]) == list(range(STEPS))
        before, after = [loss for _, loss in losses[rank][KILL]]
        assert before != after, f"rank {rank}: step {KILL} was replayed on other data; the loss should show it"


# -- without any wiring: install_hooks alone (plain loop, TP 2 / PP 2) and NeMo's MegatronStrategy (issue 31) ----------


def assert_stopped_at_the_replayed_step(res, *, ranks: int = 4, restored: int = KILL - 1,  # noqa: ANN001
                                        checked: int = KILL) -> dict[int, dict]:
    """The job stopped with DataPositionError at the replayed step (loss index KILL; the checkpointer's iteration
    ``checked``, ``restored`` + 1) of the restarted attempt, before any rank trained it. A rank whose peer stopped
    first (a pipeline neighbour waiting on it, a gradient collective) may fail on the closed connection instead."""
    assert res.killed(), "the kill did not happen"
    assert res.returncode != 0, "the job must stop, not train on other data"
    errors = {r: res.error(r) for r in range(ranks)}
    failed = {r: e for r, e in errors.items() if e is not None and e["attempt"] == 1}
    stopped = {r: e for r, e in failed.items() if e["type"] == "DataPositionError"}
    assert stopped, res.log[-6000:]
    for rank, err in failed.items():
        assert rank in stopped or "Connection closed by" in err["message"], err
    for rank, err in stopped.items():
        assert err["message"].startswith(f"rank {rank}: the data position was not restored: step {checked}"), err
        assert f"restore of iteration {restored}" in err["message"], err
    for rank, steps in res.losses().items():
        assert all(a == 0 for a, _ in steps.get(KILL, [])), f"rank {rank} trained the replayed step on other data"
    return stopped


@pytest.mark.quick
def test_install_hooks_alone_checks_every_micro_batch_at_tp2(tmp_path: Path) -> None:
    """No hooks.observe(): the forward-backward function's data iterator feeds the check (TP 2 x DP 2)."""
    res = run_torchrun("train_mcore_data.py", tmp_path, max_restarts=1, LOADER="reshuffle", OBSERVE=0, TP=2, **FAULT)
    stopped = assert_stopped_at_the_replayed_step(res)
    assert "of its first 2 micro-batch(es)" in next(iter(stopped.values()))["message"], "both micro-batches"


def test_install_hooks_alone_checks_every_micro_batch_at_pp2(tmp_path: Path) -> None:
    """The same at PP 2 x DP 2: both pipeline stages draw the micro-batches through the pipelined schedule."""
    res = run_torchrun("train_mcore_data.py", tmp_path, max_restarts=1, LOADER="reshuffle", OBSERVE=0, PP=2, **FAULT)
    assert_stopped_at_the_replayed_step(res)


NEMO_FAULT = {"STEPS": STEPS, "KILL_RANK": 1, "KILL_STEP": KILL}


def test_nemo_reading_other_data_after_the_restart_stops_at_the_replayed_step(tmp_path: Path) -> None:
    """NeMo 2 (MegatronStrategy, the NeighborCheckpoint callback, nothing else): the restarted attempt's mock dataset
    has another seed; the job stops with DataPositionError at step KILL instead of diverging silently."""
    pytest.importorskip("nemo")
    res = run_torchrun("train_nemo_data.py", tmp_path, max_restarts=1, **NEMO_FAULT)
    # NeMo's snapshot after its 5th optimizer step is iteration 5 (trainer.global_step); the replayed step, 6, is the
    # one whose loss is recorded as step index KILL
    assert_stopped_at_the_replayed_step(res, restored=KILL, checked=KILL + 1)


def test_the_data_check_runs_across_an_elastic_reshard(tmp_path: Path) -> None:
    """The plain-loop recipe (``install_hooks``, no observe()) at DP 3 dies in step 5 on every rank; it comes back on
    4 nodes (one new, empty) with elastic on: the DP-3 snapshots are resharded to DP 4, and the replayed step's
    global batch, dealt to 4 ranks in other micro-batches, is checked against the previous layout's input records
    by its order-independent sample sum, on every rank, instead of being skipped."""
    cfg = tmp_path / "elastic.yaml"
    cfg.write_text("neighbor_ckpt:\n  elastic:\n    enabled: true\n")
    common = dict(STEPS=7, NCKPT_CONFIG=cfg, EXTRA_ARGS="--global-batch 24 --dropout 0",
                  TEST_STORE_BASE=tmp_path / "store", NEIGHBOR_CKPT_JOB_ID="datacheck-reshard")
    first = run_torchrun("train_mcore.py", tmp_path / "dp3", nproc=3, KILL_RANK="0,1,2", KILL_STEP=5, **common)
    assert first.returncode != 0, "the kill did not happen"
    res = run_torchrun("train_mcore.py", tmp_path / "dp4", nproc=4, **common)
    assert res.returncode == 0, res.log[-6000:]
    for rank in range(4):
        rep = res.report(rank, 0)
        assert (rep["source"], rep["data_parallel_before"], rep["data_parallel_after"]) == ("reshard", 3, 4), rep
        assert (f"[rank{rank}] neighbor_ckpt.recovery.datacheck INFO rank {rank}: neighbor_ckpt data check: step 5's "
                "global batch after the elastic reshard is the one drawn before the failure") in res.log, rank
    assert "not checked" not in res.log
