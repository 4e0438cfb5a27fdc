"""End to end through the user's command: ``neighbor-ckpt launch configs/gpt_tiny_cpu.yaml trainer.max_steps=10
neighbor_ckpt.inprocess.enabled=true neighbor_ckpt.inprocess.spares=1`` (NeMo 2 ``llm.pretrain``, MegatronStrategy,
DistributedOptimizer, 4 CPU ranks + 1 hot spare, one NVRx ``ft_launcher`` agent per simulated node) with rank 1
SIGKILLed in the optimizer step of step 5: the surviving ranks keep their processes, the spare takes rank 1's place
and pulls its state from the ring successor, every loss and the final weights and optimizer state equal the
failure-free run (the restart path's, shared through the ``baseline`` fixture). The MTTR (kill to the first
completed step, slowest rank) and its phases are printed, not asserted (timings on a shared 2-core machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from neighbor_ckpt.cli.demo import format_phases, inprocess_phases, measured_mttr, survivors
from tests.conftest import Baselines, assert_same_training, run_launch

pytestmark = pytest.mark.e2e
pytest.importorskip("nemo.collections.llm")
pytest.importorskip("nvidia_resiliency_ext.inprocess")

STEPS = "trainer.max_steps=10"
INPROCESS = ["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=1"]
FAULT = ["neighbor_ckpt.fault_injection.enabled=true", "neighbor_ckpt.fault_injection.rank=1",
         "neighbor_ckpt.fault_injection.step=5", "neighbor_ckpt.fault_injection.phase=optimizer"]


def test_launch_inprocess_kill_in_optimizer_step_spare_replaces_rank_and_training_is_bit_exact(
        baseline: Baselines, tmp_path: Path) -> None:
    base = baseline.launch("gpt_tiny_cpu.yaml", STEPS)
    res = run_launch("gpt_tiny_cpu.yaml", tmp_path / "fault", STEPS, *INPROCESS, *FAULT, timeout=1500,
                     NEIGHBOR_CKPT_STORE_DIR=tmp_path / "store")
    assert res.returncode == 0, res.log[-8000:]
    assert "4 ranks + 1 hot spare(s) = 5 processes" in res.log
    assert "fault injection: SIGKILL of rank 1 in the optimizer phase of step 5" in res.log
    assert "in-process recovery gives up" not in res.log, "fell back to the launcher's restart path"
    assert not list(res.out.glob("*.launch*")), "a launcher-level restart happened"
    assert_same_training(base, res)

    by = survivors(res.out)
    for initial in (0, 2, 3):  # the survivors: the same process and the same rank in both attempts
        atts = by[initial]
        assert [a["iteration"] for a in atts] == [0, 1], atts
        assert len({a["pid"] for a in atts}) == 1, f"initial rank {initial} changed process: {atts}"
        assert {a["rank"] for a in atts} == {initial}, f"initial rank {initial} changed rank: {atts}"
    assert [a["iteration"] for a in by[1]] == [0]  # the killed process
    assert [(a["iteration"], a["rank"]) for a in by[4]] == [(1, 1)]  # the spare, idle until then, became rank 1
    rep = res.report(1, 1)  # the spare's store is empty (another simulated node): rank 1's state from a replica
    assert (rep["outcome"], rep["source"], rep["iteration"]) == ("restored", "replica", 5), rep
    for r in (0, 2, 3):
        assert res.report(r, 1)["outcome"] == "restored" and res.report(r, 1)["iteration"] == 5

    mttr, phases = measured_mttr(res.out), inprocess_phases(res.out)
    assert mttr is not None and mttr > 0
    print(f"\n[launch in-process] MTTR {mttr:.2f}s (kill -> first completed step, slowest rank): "
          f"{format_phases(phases)}")
