"""End to end, plain ``torchrun`` without a run id (no ``--rdzv-id``, no ``--standalone``: TORCHELASTIC_RUN_ID is
``none`` for every launch) and no configured job id: a new launch into the same host store never resumes an old,
crashed one, and the restarts of one launch still share its id and resume bit-exactly."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from neighbor_ckpt.cli.launch import worker_program
from tests.conftest import (WORKERS, Baselines, RunResult, assert_same_training, free_port, job_env,
                            recomputed_steps, run_logged)

pytestmark = pytest.mark.e2e

STEPS = 10


def plain_torchrun(tmp: Path, store: Path, *, max_restarts: int, **env: object) -> RunResult:
    """``torchrun --nproc-per-node=4 --max-restarts=N --master-port=P train_plain.py``, the static rendezvous a user
    gets without rendezvous arguments, with no job id configured and ``store`` as every rank's store base."""
    out = tmp / "out"
    tmp.mkdir(parents=True, exist_ok=True)
    full = job_env(tmp, out, {"OPTIM": "adam", "STEPS": STEPS, "JOB_ID": "", **env})
    full["TEST_STORE_BASE"] = str(store)
    for var in ("NEIGHBOR_CKPT_JOB_ID", "NEIGHBOR_CKPT_LAUNCH_ID", "TORCHELASTIC_RUN_ID"):
        full.pop(var, None)
    options, program = worker_program([str(WORKERS / "train_plain.py")], env=full)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", f"--max-restarts={max_restarts}",
           f"--master-port={free_port()}", "--monitor-interval=0.5", *options, *program]
    return run_logged(cmd, tmp, out, timeout=420, env=full)


def launch_ids(res: RunResult) -> set[str]:
    """The job ids the workers of a run report having made or read for their launch."""
    return set(re.findall(r"job id of this launch: (launch-[\w.-]+)", res.log))


def test_a_new_launch_without_a_run_id_never_resumes_a_crashed_one(baseline: Baselines, tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = plain_torchrun(tmp_path / "first", store, max_restarts=0, KILL_RANK=2, KILL_STEP=5, KILL_PHASE="forward")
    assert first.returncode != 0 and first.killed(restarted=False), first.log[-4000:]
    (first_id,) = launch_ids(first)
    left = sorted(store.glob(f"node*/*/{first_id}/rank*"))
    assert len(left) == 4 and all(any(d.glob("own.*.slot")) for d in left), "the first launch left snapshots"

    second = plain_torchrun(tmp_path / "second", store, max_restarts=0)
    assert second.returncode == 0, second.log[-6000:]
    (second_id,) = launch_ids(second)
    assert second_id != first_id
    for rank in range(4):
        rep = second.report(rank, 0)
        assert rep["outcome"] != "restored" and rep["iteration"] is None, rep
        ignored = [x for x in second.log.splitlines() if f"rank {rank}: ignored the snapshots of an earlier launch" in x]
        assert len(ignored) == 1, second.log[-6000:]
        assert f"/{first_id}/rank{rank} (" in ignored[0] and f"job id {second_id}" in ignored[0]
        assert "rm -rf " in ignored[0]
    # It trained every step from step 0, exactly as a failure-free run with a named job does.
    assert_same_training(baseline("train_plain.py", OPTIM="adam", STEPS=STEPS), second)
    assert all(any(d.glob("own.*.slot")) for d in left), "an earlier launch's files are reported, never touched"


def test_restarts_of_a_launch_without_a_run_id_share_its_id_and_resume_bit_exact(baseline: Baselines,
                                                                                tmp_path: Path) -> None:
    res = plain_torchrun(tmp_path, tmp_path / "store", max_restarts=1, KILL_RANK=2, KILL_STEP=5, KILL_PHASE="forward",
                         WIPE_RANKS=2)
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    (launch_id,) = launch_ids(res)  # attempts 0 and 1, every rank: one id
    assert re.search(rf"job id of this launch: {launch_id} \(from agent store [^;]*; restart 1\)", res.log)
    assert_same_training(baseline("train_plain.py", OPTIM="adam", STEPS=STEPS), res)
    assert recomputed_steps(res) <= {5}
    rep = res.report(2, 1)
    assert rep["outcome"] == "restored" and rep["iteration"] == 4 and rep["source"] == "replica"
    assert "ignored the snapshots of an earlier launch" not in res.log
