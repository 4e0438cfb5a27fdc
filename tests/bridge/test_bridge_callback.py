"""``neighbor_ckpt.bridge.NeighborCheckpoint`` under Megatron-Bridge 0.6's own ``pretrain`` (megatron-core 0.19).

The kill test: ``tests/workers/train_bridge_nckpt.py`` is ``train_bridge.py``'s job (tiny GPT, distributed
optimizer, mock data, dropout on) with only ``enable_cpu(nemo=False)`` and the callback added; 4 gloo ranks at TP 2
(at TP 1: the recipe's kill, test_bridge_recipe.py), rank 1 SIGKILLed inside optimizer step 5 and restarted with an
empty host store (a replaced node), plain ``torchrun --max-restarts 1``. Compared with the failure-free run of
``train_bridge.py`` *without* the callback: every loss (==), every final parameter and optimizer shard tensor
(sha256), and the step, consumed samples, skipped samples and FLOPs counter Bridge ends with. So the restore lands
before Bridge builds its data iterators (they start at the restored sample), and the callback itself changes nothing
in the training.

The refusals, the pretrain-time configuration check's install / remove and its version check run in one subprocess
(Bridge is imported after ``enable_cpu``, which must not leak into this process). A restarted attempt that reads
other data is stopped by the data check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, Baselines, RunResult, assert_same_training, recomputed_steps, run_torchrun

STEPS, NPROC, KILL_STEP = 8, 4, 5
LAYOUTS = {"tp1-dp4": {"TP": 1, "BRIDGE_CKPT_EVERY": 2}, "tp2-dp2": {"TP": 2}}
"""At TP 1 Bridge's own checkpoint is on (every 2 steps; loaded on the restart, older than the in-memory version);
the TP 2 baseline is test_bridge_pretrain.py's first TP 2 run."""


# TP 1 (DP 4, Bridge's checkpoint older than the in-memory version): the recipe's kill, test_bridge_recipe.py, which
# checks the same under the same callback
@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["tp2-dp2"])
def test_bridge_callback_kill_inside_optimizer_step_is_bit_exact(layout: str, baseline: Baselines,
                                                                 tmp_path: Path) -> None:
    env = LAYOUTS[layout]
    base = baseline("train_bridge.py", nproc=NPROC, warm=True, STEPS=STEPS, **env)
    assert base.returncode == 0, base.log[-6000:]
    res = run_torchrun("train_bridge_nckpt.py", tmp_path, nproc=NPROC, max_restarts=1, STEPS=STEPS, **env,
                       KILL_RANK=1, KILL_STEP=KILL_STEP, WIPE_RANKS=1)
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    assert json.loads((res.out / "fault.json").read_text())["step"] == KILL_STEP
    assert_same_training(base, res, nranks=NPROC)
    assert recomputed_steps(res) <= {KILL_STEP}
    final = res.final(0)
    assert (final["step"], final["consumed_samples"]) == (STEPS, STEPS * base.final(0)["consumed_samples"] // STEPS)
    for rank in range(NPROC):
        rep = res.report(rank, 1)
        assert (rep["outcome"], rep["iteration"], rep["winner"]) == ("restored", KILL_STEP - 1, "in-memory"), rep
        # Bridge's loop and data iterators start at the restored step and sample (set before they were built)
        assert rep["train_state_step"] == KILL_STEP, rep
        assert rep["consumed_train_samples"] == KILL_STEP * final["consumed_samples"] // STEPS, rep
    victim = res.report(1, 1)
    assert victim["source"] == "replica" and victim["pulled_bytes"] > 0 and victim["lazy_bytes"] == 0, victim
    assert res.report(0, 1)["source"] == "own"
    if env.get("BRIDGE_CKPT_EVERY"):
        assert "the in-memory version (iteration 4) is newer than Megatron-Bridge's checkpoint" in res.log


def _replayed_from_bridges_checkpoint(baseline: Baselines, tmp_path: Path, *, outcome: tuple[str, int],
                                      **env: Any) -> RunResult:
    """Rank 1 killed in step 5 of the TP 1 job (Bridge's checkpoint every 2 steps: iteration 3), restarted with
    ``env``; every rank's recovery ends in ``outcome`` (outcome, iteration) with Bridge's checkpoint winning, and
    steps 4.. are replayed from it bit for bit against the failure-free run."""
    layout = LAYOUTS["tp1-dp4"]
    base = baseline("train_bridge.py", nproc=NPROC, warm=True, STEPS=STEPS, **layout)
    res = run_torchrun("train_bridge_nckpt.py", tmp_path, nproc=NPROC, max_restarts=1, STEPS=STEPS, **layout,
                       KILL_RANK=1, KILL_STEP=KILL_STEP, **env)
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    assert_same_training(base, res, nranks=NPROC)
    assert recomputed_steps(res) == {KILL_STEP - 1}
    for rank in range(NPROC):
        rep = res.report(rank, 1)
        assert (rep["outcome"], rep["iteration"], rep["winner"]) == (*outcome, "bridge-checkpoint"), rep
        assert rep["train_state_step"] == 4, rep
    return res


@pytest.mark.e2e
def test_adjacent_pair_lost_falls_back_to_bridges_checkpoint_bit_exactly(baseline: Baselines, tmp_path: Path) -> None:
    """Rank 1 killed in step 5 and both copies of its state lost (its store and its ring successor's, rank 2's,
    emptied on the restart): no in-memory version is complete, so Bridge's own checkpoint (4 steps: iteration 3),
    which Bridge loaded, is the insurance, announced; steps 4.. are replayed from it bit for bit (the torch RNG Bridge
    restored is set again after the data iterators drew from it)."""
    res = _replayed_from_bridges_checkpoint(baseline, tmp_path, outcome=("insurance", 3), WIPE_RANKS="1,2")
    assert "no complete in-memory version: Megatron-Bridge's checkpoint" in res.log


@pytest.mark.e2e
def test_a_newer_bridge_checkpoint_is_loaded_over_the_in_memory_version_and_the_figures_reach_tensorboard(
        baseline: Baselines, tmp_path: Path) -> None:
    """The first attempt takes no snapshot from step 3 on (an in-memory version that lags: iteration 2), Bridge's own
    checkpoint is written every 2 steps (iteration 3 when rank 1 is killed in step 5). Bridge loads its checkpoint,
    the recovery restores iteration 2 in memory, and the newer Bridge checkpoint is loaded again over it, announced;
    steps 4.. are replayed bit for bit against the failure-free run. With Bridge's ``logger.tensorboard_dir`` set,
    rank 0's status figures and the recovery's MTTR phases are in that directory (Bridge writes its own TensorBoard
    from the last rank only)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tensorboard"
    res = _replayed_from_bridges_checkpoint(baseline, tmp_path, outcome=("restored", 2), WIPE_RANKS=1,
                                            SNAPSHOTS_UNTIL=3, TB_DIR=str(tb))
    assert "Megatron-Bridge's checkpoint" in res.log and \
        "(iteration 3) is newer than the in-memory version (iteration 2): loaded again over it" in res.log
    ours = list(tb.glob("*.neighbor_ckpt"))
    assert len(ours) == 2, sorted(p.name for p in tb.iterdir())  # one per attempt (rank 0 of each)
    tags = set()
    for p in ours:
        acc = EventAccumulator(str(p))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"neighbor_ckpt/snapshot_ms", "neighbor_ckpt/unique_bytes", "neighbor_ckpt/recovery/total_s"} <= tags, tags


_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, "tests/workers")
os.environ.setdefault("OUT_DIR", sys.argv[1])
from megatron_patches import enable_cpu
enable_cpu(nemo=False)
import megatron.bridge.training.pretrain as pretrain_module
from megatron.bridge.training.gpt_step import forward_step
from megatron_patches import bridge as mb
from neighbor_ckpt.bridge import NeighborCheckpoint
from neighbor_ckpt.bridge.checks import check_bridge_config
from neighbor_ckpt.errors import ConfigError
from train_bridge import build

out = {}
def refused(mutate):
    cfg, _ = build()
    mutate(cfg)
    try:
        check_bridge_config(cfg)
    except ConfigError as e:
        try:
            NeighborCheckpoint(bridge_config=cfg)
        except ConfigError:
            return str(e)
        return "NOT REFUSED AT CONSTRUCTION"
    return None

cfg, _ = build()
check_bridge_config(cfg)
out["plain"] = None
from megatron.bridge.training.config import InProcessRestartConfig
inprocess = lambda c: setattr(c, "inprocess_restart", InProcessRestartConfig(enabled=True))
local = lambda c: setattr(c.checkpoint, "non_persistent_ckpt_type", "local")
out["inprocess"] = refused(inprocess)
out["local"] = refused(local)
def graphs(c):
    c.model.cuda_graph_impl = "local"; c.model.cuda_graph_scope = ["full_iteration"]
out["full_cuda_graph"] = refused(graphs)
out["per_layer_graphs"] = refused(lambda c: (setattr(c.model, "cuda_graph_impl", "local"),
                                             setattr(c.model, "cuda_graph_scope", ["attn"])))
out["megatron_fsdp"] = refused(lambda c: setattr(c.dist, "use_megatron_fsdp", True))
out["sgd"] = refused(lambda c: setattr(c.optimizer, "optimizer", "sgd"))

# The user's script: NeighborCheckpoint() alone (no bridge_config), pretrain refuses at its start, before Bridge wraps
# _pretrain in its in-process restart or builds anything
original = pretrain_module.runtime_config_update
cb = NeighborCheckpoint()
out["wrapped"] = pretrain_module.runtime_config_update is not original and mb.config_check_installed()
for name, mutate in (("pretrain_inprocess", inprocess), ("pretrain_local", local)):
    cfg, _ = build()
    mutate(cfg)
    try:
        pretrain_module.pretrain(cfg, forward_step, callbacks=[cb])
        out[name] = None
    except ConfigError as e:
        out[name] = f"{type(e).__name__}: {e}"
out["no_process_group"] = not __import__("torch").distributed.is_initialized()
cb.close()
out["restored"] = pretrain_module.runtime_config_update is original and not mb.config_check_installed()
import importlib.metadata
real = importlib.metadata.version
importlib.metadata.version = lambda name: "0.5.0" if name == "megatron-bridge" else real(name)
try:
    mb.on_pretrain_config(lambda cfg: None)
    out["version"] = None
except Exception as e:
    out["version"] = f"{type(e).__name__}: {e}"
importlib.metadata.version = real
print("RESULT " + json.dumps(out))
"""


def test_refusals_and_the_pretrain_config_check(tmp_path: Path) -> None:
    """Each refused option by name (ConfigError, from check_bridge_config and from the constructor given the
    ConfigContainer); per-layer CUDA graphs pass. A user's script with only ``NeighborCheckpoint()`` added: Bridge's
    ``InProcessRestartConfig`` or its local checkpointing is refused with one line when ``pretrain`` starts, before
    anything is built (no process group); the check wraps ``pretrain``'s ``runtime_config_update`` while the callback
    lives and restores it by identity; another Bridge release is refused."""
    res = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=900, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-6000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["plain"] is None and out["per_layer_graphs"] is None, out
    assert "inprocess_restart.enabled" in out["inprocess"], out
    assert "checkpoint.non_persistent_ckpt_type: 'local'" in out["local"], out
    assert "cuda_graph_scope full_iteration" in out["full_cuda_graph"], out
    assert "dist.use_megatron_fsdp" in out["megatron_fsdp"], out
    assert "optimizer.optimizer: 'sgd'" in out["sgd"] and "supported: adam" in out["sgd"], out
    for key, option in (("pretrain_inprocess", "inprocess_restart.enabled"),
                        ("pretrain_local", "checkpoint.non_persistent_ckpt_type")):
        assert out[key] is not None and out[key].startswith("ConfigError: ") and option in out[key], out
        assert "\n" not in out[key], f"one line: {out[key]!r}"
    assert out["no_process_group"], out
    assert out["wrapped"] and out["restored"], out
    assert out["version"].startswith("UnsupportedVersionError") and "0.5.0" in out["version"], out


@pytest.mark.e2e
def test_a_restarted_attempt_that_reads_other_data_is_stopped_by_the_data_check(tmp_path: Path) -> None:
    """Rank 1 killed in step 5 (every host store kept); the restarted attempt's mock data has another seed: the
    in-memory version restores iteration 4, and the replayed step 5 reads other input than before the failure, so
    the data check stops the job loudly (DataPositionError) before training that step on it."""
    res = run_torchrun("train_bridge_nckpt.py", tmp_path, nproc=NPROC, max_restarts=1, STEPS=STEPS,
                       **LAYOUTS["tp1-dp4"], KILL_RANK=1, KILL_STEP=KILL_STEP, OTHER_DATA_AFTER_RESTART=1)
    assert res.killed(), "the kill did not happen"
    assert res.returncode != 0, "the job must stop, not train on other data"
    stopped = {r: e for r in range(NPROC) if (e := res.error(r)) is not None and e["attempt"] == 1}
    assert stopped, res.log[-6000:]
    for rank, err in stopped.items():
        assert err["type"] == "DataPositionError", err
        assert err["message"].startswith(f"rank {rank}: the data position was not restored: step {KILL_STEP}"), err
    for rank, steps in res.losses().items():
        assert all(a == 0 for a, _ in steps.get(KILL_STEP, [])), f"rank {rank} trained the replayed step on other data"
