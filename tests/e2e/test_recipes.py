"""End to end through the user's commands: ``neighbor-ckpt demo`` (the tiny GPT recipe: a failure-free run, then
rank 1 SIGKILLed inside optimizer step 5 and recovered in process with a hot spare (the default), i.e.
``neighbor-ckpt launch configs/gpt_tiny_cpu.yaml neighbor_ckpt.inprocess.enabled=true
neighbor_ckpt.inprocess.spares=1``: the survivors keep their processes and ranks, the spare takes rank 1's place and
pulls its state from the ring successor, no launcher restart; then the same kill restarted by the launcher on an
empty host store; both MTTRs side by side) and ``neighbor-ckpt launch`` of the tiny Llama recipe (RMSNorm, SwiGLU,
RoPE, GQA; TP2 x DP2; rank 1 SIGKILLed in the backward pass of step 5). Every per-step loss, the final weights and
the optimizer state must equal the failure-free run exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import Baselines, RunResult, job_env, assert_same_training, recomputed_steps, run_launch, \
    run_logged

pytestmark = pytest.mark.e2e
pytest.importorskip("nemo.collections.llm")

STEPS = "trainer.max_steps=8"
FAULT = ["neighbor_ckpt.fault_injection.enabled=true", "neighbor_ckpt.fault_injection.rank=1",
         "neighbor_ckpt.fault_injection.step=5"]


def _assert_rank1_restored_from_its_successor(res: RunResult, *, iterations: tuple[int, ...] = (5,)) -> None:
    """Restored from the successor's replica, recomputing nothing before the newest iteration it could hold."""
    rep = res.report(1, 1)
    assert (rep["outcome"], rep["source"]) == ("restored", "replica") and rep["iteration"] in iterations, rep
    assert recomputed_steps(res) <= set(range(rep["iteration"], 6))
    assert rep["lazy_bytes"] == 0, "weights are regenerated from the fp32 shards, never backed up"


# The demo command runs its own failure-free run of the tiny GPT recipe and compares with it; no other test trains
# that recipe (the NeMo tests run tests/workers/train_nemo.py), so there is no baseline to share with it.
def test_demo_kills_a_rank_of_the_tiny_gpt_recipe_and_recovers_bit_exactly_by_restart_and_in_process(
        tmp_path: Path) -> None:
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "neighbor_ckpt.cli", "demo", "--out", str(out), STEPS]  # in process by default
    res = run_logged(cmd, tmp_path, out, timeout=1800, env=job_env(tmp_path, out, {
        "NEIGHBOR_CKPT_STORE_DIR": tmp_path / "store"}))
    assert res.returncode == 0, res.log[-6000:]
    assert "bit-identical to the failure-free run" in res.log
    assert "recovery report (attempt 1):" in res.log and "rank 1: restored iteration 5 from the replica" in res.log
    # what a user sees: the timeline PNG, the status line, the metrics in the trainer's logger (CSV here)
    pngs = [Path(line.split("recovery timeline: ", 1)[1].strip()) for line in res.log.splitlines()
            if line.startswith("recovery timeline: ")]
    by_run = {p.relative_to(out).parts[0]: p for p in pngs if p.is_relative_to(out)}
    assert sorted(by_run) == ["faulted", "inprocess"], res.log[-3000:]  # the in-process run is printed first
    for p in by_run.values():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p
    timeline = json.loads(by_run["faulted"].with_suffix(".json").read_text())
    assert set(timeline["phases_s"]) >= {"detect", "restart", "rendezvous", "reconcile", "transfer", "restore"}
    timeline = json.loads(by_run["inprocess"].with_suffix(".json").read_text())
    assert set(timeline["phases_s"]) >= {"detect", "abort", "reform", "reconcile", "transfer", "restore"}, timeline
    assert "neighbor_ckpt: step 2 | snapshot" in (out / "faulted" / "torchrun.log").read_text()
    csvs = list((out / "faulted").rglob("metrics.csv"))
    assert any("neighbor_ckpt/snapshot_ms" in c.read_text().splitlines()[0] for c in csvs), csvs
    base = RunResult(0, out / "baseline" / "record", "")
    fault = RunResult(0, out / "faulted" / "record", (out / "faulted" / "torchrun.log").read_text())
    assert fault.killed(), "the kill did not happen"
    assert_same_training(base, fault)
    _assert_rank1_restored_from_its_successor(fault)
    # in process: the same kill, 4 ranks + 1 hot spare; both MTTRs side by side, both runs bit-identical
    assert "4 ranks + 1 hot spare(s) = 5 processes" in res.log
    assert "the spare started as rank 4 became rank 1" in res.log and "ranks [0, 2, 3] kept their processes" in res.log
    row = next(line for line in res.log.splitlines() if line.startswith("bit-identical to the failure-free run"))
    assert [c.strip() for c in row.split("|")[1:]] == ["yes", "yes"], row
    lines = res.log.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("MTTR (kill -> first completed step)"))
    assert lines[head + 1].count(" s") == 2, lines[head + 1]  # both measured
    inproc = RunResult(0, out / "inprocess" / "record", (out / "inprocess" / "torchrun.log").read_text())
    assert "in-process recovery gives up" not in inproc.log, "fell back to the launcher's restart path"
    assert not list(inproc.out.glob("*.launch*")), "a launcher-level restart happened"
    assert_same_training(base, inproc)
    rep = inproc.report(1, 1)  # the spare's store is empty (another simulated node): rank 1's state from a replica
    assert (rep["outcome"], rep["source"], rep["iteration"]) == ("restored", "replica", 5), rep
    for r in (0, 2, 3):
        assert (inproc.report(r, 1)["outcome"], inproc.report(r, 1)["iteration"]) == ("restored", 5)
    tls = [json.loads(p.read_text()) for p in (out / "inprocess").rglob("recovery_timeline.*.json")]
    assert [(t["mode"], t["restarted_ranks"], t["spare_used"], t["spare_ranks"]) for t in tls] == \
        [("in-process", [], True, [1])], tls


def test_tiny_llama_recipe_tp2_killed_in_backward_recovers_bit_exactly(baseline: Baselines, tmp_path: Path) -> None:
    store = {"NEIGHBOR_CKPT_STORE_DIR": tmp_path / "store"}
    base = baseline.launch("llama_tiny_cpu.yaml", STEPS, "parallelism.tensor=2")
    res = run_launch("llama_tiny_cpu.yaml", tmp_path / "fault", STEPS, "parallelism.tensor=2", *FAULT,
                     "neighbor_ckpt.fault_injection.phase=backward", **store)
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed() and "in the backward phase of step 5" in res.log
    assert_same_training(base, res)
    # Killed at its first gradient, before the wait point of step 5: its snapshot of iteration 5 (steps 0..4 done)
    # may not have reached its successor yet, and then iteration 4 is the newest one every rank can restore.
    _assert_rank1_restored_from_its_successor(res, iterations=(4, 5))
    resolved = (tmp_path / "fault" / "run" / "config.yaml").read_text()
    assert "preset: llama_tiny" in resolved
