"""In-process recovery under Megatron-Bridge (issue 30 item 6) through ``neighbor-ckpt launch`` of the Bridge recipe
with ``neighbor_ckpt.inprocess.enabled``: the survivors keep their processes, a hot spare takes the killed rank's
place, and Bridge's ``pretrain`` is called again in every process with the same ``NeighborCheckpoint`` instance
(:mod:`neighbor_ckpt.bridge.inprocess`), on Megatron-Bridge 0.6. Two faults in one launch (issue 29 item 3:
``fault_injection.faults``) show that the callback built once serves a third ``pretrain`` call too. Every loss, final
weight, optimizer shard, step, consumed samples and FLOPs counter equal to the failure-free launch, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from neighbor_ckpt.cli.launch import BRIDGE_RECIPE, plan_launch
from tests.conftest import REPO, Baselines, RunResult, assert_same_training, run_launch

CONFIG = "gpt_tiny_bridge_cpu.yaml"
STEPS = "trainer.max_steps=10"
INPROC = "neighbor_ckpt.inprocess.enabled=true"
TWO_FAULTS = "neighbor_ckpt.fault_injection.faults=[{rank: 1, step: 3}, {rank: 2, step: 7}]"


def test_launch_plans_the_bridge_recipe_in_process(tmp_path: Path) -> None:
    plan = plan_launch(CONFIG, [INPROC, "neighbor_ckpt.inprocess.spares=2",
                                "neighbor_ckpt.fault_injection.enabled=true", TWO_FAULTS], run_dir=tmp_path)
    assert plan.recipe.name == BRIDGE_RECIPE.name and plan.inprocess and plan.processes == 6
    faults = plan.job.neighbor_ckpt.fault_injection.planned()
    assert [(f.rank, f.step, f.phase) for f in faults] == [(1, 3, "optimizer"), (2, 7, "optimizer")]


def _timelines(tmp: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(tmp.rglob("recovery_timeline.*.json"))]


def _assert_in_process(res: RunResult) -> None:
    assert res.returncode == 0, res.log[-6000:]
    assert "in-process recovery gives up" not in res.log, "fell back to the launchers' restart path"
    assert not list(res.out.glob("*.launch*")), "a launcher-level restart happened"
    assert "not clean after generation" not in res.log, "a process failed the hygiene check"


@pytest.mark.e2e
def test_bridge_inprocess_two_faults_two_spares_is_bit_exact(baseline: Baselines, tmp_path: Path) -> None:
    """4 ranks + 2 hot spares, ``fault_injection.faults``: rank 1 SIGKILLed inside optimizer step 3 (generation 0),
    rank 2 inside optimizer step 7 (generation 1, after the first was recovered: not fired again when generation 1
    replays step 3). Each spare takes one lost rank and pulls its unique state from the ring successor's replica (its
    store is empty: another simulated node); the survivors restore from their own host slots, and their processes
    run three ``pretrain`` calls with the one NeighborCheckpoint they built, which resets itself and takes each
    generation's attempt. (One kill with one spare is this test's first fault.)"""
    base = baseline.launch(CONFIG, STEPS, warm=True)
    res = run_launch(CONFIG, tmp_path / "fault", STEPS, INPROC, "neighbor_ckpt.inprocess.spares=2",
                     "neighbor_ckpt.fault_injection.enabled=true", TWO_FAULTS,
                     NEIGHBOR_CKPT_STORE_DIR=tmp_path / "store")
    _assert_in_process(res)
    fired = [json.loads(line) for line in (res.out / "faults.jsonl").read_text().splitlines()]
    assert [(f["fault"], f["rank"], f["step"], f["generation"]) for f in fired] == [(0, 1, 3, 0), (1, 2, 7, 1)], \
        "each fault fires once, the second in generation 1"
    assert res.log.count("fault injection: SIGKILL") == 2
    assert "takes rank 1's place in generation 1" in res.log and "takes rank 2's place in generation 2" in res.log
    assert_same_training(base, res)
    first, second = res.report(1, 1), res.report(2, 2)
    assert (first["source"], first["iteration"], first["train_state_step"]) == ("replica", 2, 3), first
    assert (second["source"], second["iteration"], second["train_state_step"]) == ("replica", 6, 7), second
    for r in (0, 3):  # kept their processes through both failures: one instance, three pretrain calls
        enters = [e for e in json.loads((res.out / f"events.initial{r}.json").read_text())["events"]
                  if e["name"] == "enter"]
        assert [e["iteration"] for e in enters] == [0, 1, 2], enters
        assert [(res.report(r, g)["outcome"], res.report(r, g)["iteration"], res.report(r, g)["source"])
                for g in (1, 2)] == [("restored", 2, "own"), ("restored", 6, "own")]
    tls = _timelines(tmp_path)
    assert sorted((t["mode"], t["restarted_ranks"], t["spare_ranks"]) for t in tls) == \
        [("in-process", [], [1]), ("in-process", [], [2])], tls
    assert res.final(0)["step"] == 10 and res.final(0)["consumed_samples"] == 10 * 8


_SCRIPT = r"""
import json, os, sys
from megatron_patches import enable_cpu
enable_cpu(nemo=False)
import importlib.metadata
from megatron.core import num_microbatches_calculator as nmc, rerun_state_machine as rsm
from megatron_patches import bridge as mb
from neighbor_ckpt import NeighborCkptConfig
from neighbor_ckpt.bridge import NeighborCheckpoint
from neighbor_ckpt.recovery.attempt import AttemptInfo

out = {"not_imported": mb.reset_global_state()}
import megatron.bridge.training.initialize as initialize  # what pretrain imports
nmc.init_num_microbatches_calculator(0, None, 8, 2, 2)
rsm.initialize_rerun_state_machine()
try:
    nmc.init_num_microbatches_calculator(0, None, 8, 2, 2)
    out["second_refused"] = False
except AssertionError:
    out["second_refused"] = True
out["reset"] = mb.reset_global_state()
out["calculator_gone"] = nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None
out["rerun_gone"] = rsm._GLOBAL_RERUN_STATE_MACHINE is None
nmc.init_num_microbatches_calculator(0, None, 8, 2, 2)  # as the next generation's pretrain does
out["again"] = nmc.get_num_microbatches()
real = importlib.metadata.version
importlib.metadata.version = lambda name: "0.5.0" if name == "megatron-bridge" else real(name)
try:
    mb.reset_global_state()
    out["version"] = None
except Exception as e:
    out["version"] = f"{type(e).__name__}: {e}"
importlib.metadata.version = real

class Ckpt:  # what begin_attempt closes: the previous attempt's checkpointer
    closed = None
    def close(self, *, success=True):
        Ckpt.closed = success

cb = NeighborCheckpoint(NeighborCkptConfig())
first = cb.session
cb.session.checkpointer, cb.winner = Ckpt(), "in-memory"
cb._pending_rng.keep({"torch": 1})
cb.begin_attempt(AttemptInfo(launch=0, inprocess=1, activated_spare=True))
out["closed_with"] = Ckpt.closed
out["new_session"] = cb.session is not first and cb.session.checkpointer is None
out["cleared"] = cb.winner is None and cb._pending_rng.state is None
out["attempt"] = [cb.attempt.inprocess, cb.attempt.activated_spare]
out["listener_kept"] = mb.config_check_installed()
cb.close()
print("RESULT " + json.dumps(out))
"""


def test_reset_global_state_and_the_callback_between_generations(tmp_path: Path) -> None:
    """``megatron_patches.bridge.reset_global_state``: nothing to do before Bridge's training code is imported; then
    the num-microbatches calculator (which refuses a second one) and the rerun state machine a failed ``pretrain``
    left are dropped, so the next ``pretrain`` initialises them again; another Bridge release is refused. The
    callback built once: ``begin_attempt`` closes the previous attempt's checkpointer (host slots kept: not a
    success), starts a new session, clears the previous recovery's winner and pending RNG, takes the generation's
    attempt, and keeps its pretrain-time configuration check (one per process)."""
    res = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-6000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["not_imported"] is False and out["second_refused"] and out["reset"], out
    assert out["calculator_gone"] and out["rerun_gone"] and out["again"] == 2, out
    assert out["version"].startswith("UnsupportedVersionError") and "0.5.0" in out["version"], out
    assert out["closed_with"] is False and out["new_session"] and out["cleared"], out
    assert out["attempt"] == [1, True] and out["listener_kept"], out
