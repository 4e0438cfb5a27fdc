"""End to end on one GPU: the Lightning DDP worker (``tests/workers/train_lightning.py`` with ACCELERATOR=gpu,
DEVICES=1, NCCL) under torchrun, SIGKILLed in the forward of step 7 and restarted: it restores its own slot (world
1: model, AdamW state, LR scheduler, CUDA RNG and data position are all unique) and every loss and the final state
equal the failure-free run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import RunResult, assert_same_training, recomputed_steps, run_torchrun
from tests.gpu.conftest import CUDA_ONLY, on_tmpfs

pytestmark = [pytest.mark.gpu, pytest.mark.e2e, CUDA_ONLY]

GPU = {"ACCELERATOR": "gpu", "DEVICES": 1, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
KILL = {"KILL_RANK": 0, "KILL_STEP": 7, "KILL_PHASE": "forward"}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, shm_module_dir: Path) -> RunResult:
    res = run_torchrun("train_lightning.py", tmp_path_factory.mktemp("baseline"), nproc=1, timeout=300,
                       TEST_STORE_BASE=shm_module_dir / "baseline", **GPU)
    assert res.returncode == 0, res.log[-6000:]
    return res


def test_lightning_on_one_gpu_sigkill_restores_from_the_own_slot_bit_exactly(
        baseline: RunResult, tmp_path: Path, shm_dir: Path) -> None:
    res = run_torchrun("train_lightning.py", tmp_path, nproc=1, max_restarts=1, timeout=300, TEST_STORE_BASE=shm_dir,
                       **GPU, **KILL)
    assert res.returncode == 0, res.log[-6000:]
    assert "exitcode: -9" in res.log, "the kill did not happen"
    assert_same_training(baseline, res, nranks=1)
    rep = res.report(0, 1)
    assert (rep["outcome"], rep["source"]) == ("restored", "own"), rep
    # The kill in the forward comes before the wait point: the newest snapshot (7) may still be in flight, and then
    # the one before it (6, committed at the previous wait point) is restored and one more step recomputed.
    assert rep["iteration"] in (6, 7), rep
    assert recomputed_steps(res) <= set(range(rep["iteration"], 8)), "too many steps recomputed"
    assert rep["pulled_bytes"] == 0 and rep["lazy_bytes"] == 0, rep
    if on_tmpfs(shm_dir):
        assert "cudaHostRegister" not in res.log, "a slot could not be page-locked"
        assert "cudaHostUnregister" not in res.log, "a slot could not be unregistered"
