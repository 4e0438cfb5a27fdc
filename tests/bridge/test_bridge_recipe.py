"""The Megatron-Bridge recipe through ``neighbor-ckpt launch`` (issue 30 item 4): a job file with ``framework: bridge``
(``configs/gpt_tiny_bridge_cpu.yaml``) runs ``recipes/bridge_pretrain.py`` -- Bridge's own ``pretrain`` with
``NeighborCheckpoint`` -- under torchrun with restarts; a job file without the key keeps the NeMo recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neighbor_ckpt.cli.launch import BRIDGE_RECIPE, RECIPE, plan_launch
from tests.conftest import Baselines, assert_same_training, recomputed_steps, run_launch

CONFIG = "gpt_tiny_bridge_cpu.yaml"
STEPS = "trainer.max_steps=8"
BRIDGE_CKPT = "checkpoint.every_n_train_steps=2"  # Bridge's own checkpoint every 2 steps: the insurance


def test_framework_picks_the_recipe(tmp_path: Path) -> None:
    bridge = plan_launch(CONFIG, run_dir=tmp_path / "b")
    assert bridge.job.framework == "bridge" and bridge.recipe.name == BRIDGE_RECIPE.name
    nemo = plan_launch("gpt_tiny_cpu.yaml", run_dir=tmp_path / "n")  # no framework key: NeMo, as before
    assert nemo.job.framework == "nemo" and nemo.recipe.name == RECIPE.name
    inproc = plan_launch(CONFIG, ["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=1"],
                         run_dir=tmp_path / "i")  # in process too (test_bridge_inprocess.py)
    assert inproc.recipe.name == BRIDGE_RECIPE.name and inproc.processes == 5


@pytest.mark.e2e
def test_bridge_recipe_launch_kill_inside_optimizer_step_is_bit_exact(baseline: Baselines, tmp_path: Path) -> None:
    """4 CPU ranks, distributed optimizer, Bridge's own checkpoint every 2 steps; rank 1 SIGKILLed inside optimizer
    step 5, its host store emptied on the restart (``fault_injection``), torchrun's restart: Bridge loads its
    checkpoint of 4 steps (iteration 3), the in-memory version of iteration 4 is newer and is applied over it,
    announced; every loss, final weight, optimizer shard, step, consumed samples and FLOPs counter equal to the
    failure-free launch, bit for bit (the scheduler is not advanced twice)."""
    base = baseline.launch(CONFIG, STEPS, BRIDGE_CKPT, warm=True)
    res = run_launch(CONFIG, tmp_path / "fault", STEPS, BRIDGE_CKPT, "neighbor_ckpt.fault_injection.enabled=true",
                     NEIGHBOR_CKPT_STORE_DIR=tmp_path / "store")
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    assert json.loads((res.out / "fault.json").read_text())["phase"] == "optimizer"
    assert "restarts on a 'replaced node'" in res.log
    assert_same_training(base, res)
    assert recomputed_steps(res) <= {5}
    assert res.final(0)["step"] == 8
    rep = res.report(1, 1)
    assert (rep["outcome"], rep["iteration"], rep["source"], rep["winner"]) == ("restored", 4, "replica", "in-memory")
    assert rep["train_state_step"] == 5 and rep["consumed_train_samples"] == 5 * 8, rep
    assert "the in-memory version (iteration 4) is newer than Megatron-Bridge's checkpoint" in res.log
