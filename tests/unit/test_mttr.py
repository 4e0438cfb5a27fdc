"""The MTTR model of ``neighbor-ckpt plan``: both recovery modes, phase by phase, against a hand computation."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.planning.jobspec import load_job
from neighbor_ckpt.planning.mttr import (PHASES, MttrAssumptions, assumptions_for, estimate_both, estimate_mttr,
                                         format_mttr)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan_8b():
    return load_job(REPO / "configs" / "llama3_8b.yaml").plan()


def test_each_phase_of_both_modes_equals_a_hand_computation(plan_8b) -> None:
    a = MttrAssumptions()
    c = plan_8b.classes[0]
    hw = plan_8b.hardware
    nic, pcie = hw.nic_gbits_per_s * 1e9 / 8, hw.pcie_gbytes_per_s * 1e9
    dp = plan_8b.parallel.dp * plan_8b.parallel.cp
    restore = c.unique_bytes / pcie + 2 * c.params_per_rank * (dp - 1) / dp / nic
    restart = estimate_mttr(plan_8b, "restart", a)
    inproc = estimate_mttr(plan_8b, "in-process", a)
    assert list(restart.phases) == list(PHASES) == list(inproc.phases)
    assert restart.phases == {"detect": 6.0, "relaunch": 60.0 + 0.02 * plan_8b.world_size, "regroup": 0.0,
                              "reconcile": 0.05, "transfer": c.unique_bytes / nic, "restore": restore,
                              "first_step": c.compute_seconds}
    assert inproc.phases == {**restart.phases, "detect": 1.0, "relaunch": 0.0,
                             "regroup": 5.0 + 0.002 * plan_8b.world_size}
    assert inproc.total_s < restart.total_s
    assert restart.to_dict()["total_s"] == pytest.approx(sum(restart.phases.values()))
    store = estimate_mttr(plan_8b, "store-node", a)
    assert store.phases == {**inproc.phases, "detect": 30.0}, "the store's node lost: a longer detection only"


def test_the_cpu_preset_uses_the_figures_measured_on_the_cpu_machines() -> None:
    plan = load_job(REPO / "configs" / "gpt_tiny_cpu.yaml").plan()
    assert assumptions_for(plan.hardware.name).relaunch_floor_s == 22.0
    both = estimate_both(plan)
    assert both["in-process"].total_s < 1.0 < 20.0 < both["restart"].total_s


def test_bad_mode_and_negative_assumptions_are_config_errors(plan_8b) -> None:
    with pytest.raises(ConfigError, match="mode"):
        estimate_mttr(plan_8b, "reboot")  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as e:
        MttrAssumptions(reconcile_s=-1.0, regroup_floor_s=-2.0)
    assert "reconcile_s" in str(e.value) and "regroup_floor_s" in str(e.value)


def test_format_prints_both_modes_and_the_assumptions(plan_8b) -> None:
    a = MttrAssumptions()
    text = format_mttr(estimate_both(plan_8b, a), a)
    assert "restart" in text and "in-process" in text and "assumptions" in text and "relaunch 60 s" in text
    assert "store-node" in text and "30 s when the store's node is lost" in text
    assert "node-lost" in text and "6 s when a node is lost" in text


@pytest.mark.parametrize("per_node", [1, 2, 4, 8])
def test_a_lost_node_is_detected_in_one_detector_period_whatever_its_ranks_per_node(per_node: int) -> None:
    """A whole node lost in process is one decision: its detection is the job's ``timeout_s`` + ``interval_s`` at 1,
    2, 4 or 8 ranks per node (16 ranks in all), and the rest of its MTTR is the in-process row's."""
    job = load_job(REPO / "configs" / "llama3_8b.yaml", [f"trainer.devices={per_node}",
                                                         f"trainer.num_nodes={16 // per_node}",
                                                         "neighbor_ckpt.detector.timeout_s=3.0",
                                                         "neighbor_ckpt.detector.interval_s=0.5"])
    plan = job.plan()
    assert plan.ranks_per_node == per_node and plan.world_size == 16
    a = assumptions_for(plan.hardware.name, job.neighbor_ckpt.detector)
    node = estimate_mttr(plan, "node-lost", a)
    assert node.phases["detect"] == 3.5
    assert node.phases == {**estimate_mttr(plan, "in-process", a).phases, "detect": 3.5}


def test_without_a_job_detector_a_lost_node_takes_the_default_detector_period(plan_8b) -> None:
    a = MttrAssumptions()
    assert estimate_mttr(plan_8b, "node-lost", a).phases["detect"] == 5.0 + 1.0
    assert assumptions_for("h100").node_lost_detect_s == 6.0


@pytest.mark.parametrize("config", ["llama3_8b", "llama3_70b", "gpt3_175b"])
def test_plan_json_has_the_mttr_of_both_modes(config: str) -> None:
    out = subprocess.run([sys.executable, "-m", "neighbor_ckpt.cli", "plan", str(REPO / "configs" / f"{config}.yaml"),
                          "--json"], capture_output=True, text=True, check=True, cwd=REPO).stdout
    doc = json.loads(out)
    assert set(doc["mttr"]) == {"restart", "in-process", "store-node", "node-lost"}
    assert doc["mttr"]["in-process"]["total_s"] < doc["mttr"]["store-node"]["total_s"]
    assert doc["mttr"]["in-process"]["total_s"] < doc["mttr"]["restart"]["total_s"]
    assert doc["mttr_assumptions"]["relaunch_floor_s"] == 60.0
