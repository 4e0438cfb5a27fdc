"""End to end under a real Slurm: the script ``neighbor-ckpt launch --slurm`` writes is submitted with ``sbatch``
to a single-node Slurm on this machine (munged, slurmctld and slurmd started by the ``slurm_cluster`` fixture,
tests/e2e/slurm_cluster.py). The tiny GPT recipe (``configs/gpt_tiny_cpu.yaml``, 4 CPU ranks, 10 steps) has rank 1
SIGKILLed inside the optimizer step of step 5 (its host store wiped); torchrun, started by ``srun`` inside the
allocation, restarts the worker group in the same Slurm job, and every per-step loss, the final weights and the
optimizer state equal the failure-free ``neighbor-ckpt launch`` run bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, Baselines, RunResult, assert_same_training, free_port, job_env, recomputed_steps, \
    run_logged
from tests.e2e.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.e2e
pytest.importorskip("nemo.collections.llm")

CONFIG = "gpt_tiny_cpu.yaml"
STEPS = "trainer.max_steps=10"
FAULT = ["neighbor_ckpt.fault_injection.enabled=true", "neighbor_ckpt.fault_injection.rank=1",
         "neighbor_ckpt.fault_injection.step=5", "neighbor_ckpt.fault_injection.phase=optimizer"]


def sbatch_launch(cluster: SlurmCluster, tmp: Path, *overrides: str, timeout: float = 900,
                  **env: Any) -> tuple[RunResult, str, str]:
    """``neighbor-ckpt launch configs/<CONFIG> OVERRIDES --record --slurm job.sbatch``, then ``sbatch --wait``;
    returns the job's result (log: the job's ``slurm-<id>.out``), the Slurm job id and the script."""
    tmp.mkdir(parents=True, exist_ok=True)
    run_dir, script, out = tmp / "run", tmp / "job.sbatch", tmp / "run" / "record"
    # rdzv_port: the script's fixed c10d port would collide with other tests' jobs on this machine
    write = subprocess.run([sys.executable, "-m", "neighbor_ckpt.cli", "launch", str(REPO / "configs" / CONFIG),
                            *overrides, f"launch.rdzv_port={free_port()}", "--run-dir", str(run_dir), "--record",
                            "--slurm", str(script)], capture_output=True, text=True, cwd=tmp, timeout=300)
    assert write.returncode == 0, write.stdout + write.stderr
    try:
        sub = run_logged(["sbatch", "--wait", "--parsable", str(script)], tmp, out, timeout=timeout,
                         env=cluster.env(job_env(tmp, out, env)))
    finally:
        cluster.cancel_all()
    job_id = sub.log.strip().splitlines()[0].split(";")[0] if sub.log.strip() else ""
    assert job_id.isdigit(), f"sbatch did not submit: {sub.log}\n{cluster.logs()}"
    slurm_out = run_dir / f"slurm-{job_id}.out"
    log = slurm_out.read_text() if slurm_out.exists() else f"(no {slurm_out})\n{cluster.logs()}"
    return RunResult(sub.returncode, out, log), job_id, script.read_text()


def test_slurm_script_restarts_a_killed_rank_inside_its_allocation_bit_exactly(
        slurm_cluster: SlurmCluster, baseline: Baselines, tmp_path: Path) -> None:
    base = baseline.launch(CONFIG, STEPS)
    res, job_id, script = sbatch_launch(slurm_cluster, tmp_path, STEPS, *FAULT,
                                        NEIGHBOR_CKPT_STORE_DIR=tmp_path / "store")
    assert res.returncode == 0, f"Slurm job {job_id} failed (sbatch --wait exit {res.returncode}):\n{res.log[-6000:]}"
    # what ran: one torchrun per node under srun, restarted by torchrun, not by Slurm (one job, one step)
    assert "srun --kill-on-bad-exit=0" in script and "-m torch.distributed.run" in script
    assert "--gpus-per-node" not in script, "a CPU job must not ask Slurm for GPUs"
    assert "exitcode: -9" in res.log, f"the kill did not happen:\n{res.log[-6000:]}"
    assert "in the optimizer phase of step 5" in res.log
    rep = res.report(1, 1)  # attempt 1 = torchrun's first restart (TORCHELASTIC_RESTART_COUNT)
    assert (rep["outcome"], rep["source"], rep["iteration"]) == ("restored", "replica", 5), rep
    assert recomputed_steps(res) <= {5}
    assert_same_training(base, res)
