"""End to end on real megatron-core (GPTModel, mcore DDP, DistributedOptimizer) in a hand-written loop:
``recipes/mcore_gpt_plain_loop.py`` under torchrun, 4 gloo ranks, a real SIGKILL and restart, the killed
rank's host store replaced by an empty one (a replaced node)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import (Baselines, RunResult, assert_replaced_rank_restored_from_its_replica, assert_same_training,
                            recomputed_steps, run_torchrun)

pytestmark = pytest.mark.e2e
pytest.importorskip("megatron.core")

STEPS = 8
LAYOUTS = {"dp4": {"TP": 1, "PP": 1}, "tp2-dp2": {"TP": 2, "PP": 1}, "pp2-dp2": {"TP": 1, "PP": 2}}


def _base(baseline: Baselines, key: str) -> RunResult:
    """The failure-free run of ``distopt/<layout>`` or ``replicated/<layout>`` (once per session, see conftest)."""
    dist_opt, layout = key.split("/")
    return baseline("train_mcore.py", STEPS=STEPS, DIST_OPT=int(dist_opt == "distopt"), **LAYOUTS[layout])


@pytest.mark.parametrize("layout", [pytest.param(layout, marks=[pytest.mark.quick, pytest.mark.cold]
                                                  if layout == "dp4" else []) for layout in LAYOUTS])
def test_distributed_optimizer_kill_inside_optimizer_step_with_replaced_store_is_bit_exact(
        layout: str, baseline: Baselines, tmp_path: Path) -> None:
    """Rank 1 dies inside optimizer step 5 (weights torn) and loses its host memory: it pulls its shard of
    iteration 4 from its successor, every rank regenerates its weights from the fp32 shards, and training
    continues bit-for-bit; only step 5 is computed twice. ``dp4`` is the headline test and starts its workers cold
    (fresh interpreters, as a user's torchrun does); its failure-free run is forked warm (tests/warm), so it also
    shows cold and warm workers computing the same bits."""
    base = baseline("train_mcore.py", STEPS=STEPS, DIST_OPT=1, warm=True, **LAYOUTS[layout])
    res = run_torchrun("train_mcore.py", tmp_path, max_restarts=1, STEPS=STEPS, DIST_OPT=1, KILL_RANK=1,
                       KILL_STEP=5, KILL_PHASE="optimizer", WIPE_RANKS=1, **LAYOUTS[layout])
    rep = assert_replaced_rank_restored_from_its_replica(base, res)
    assert any("prepared in advance" in n and "before this process built its model" in n for n in rep["notes"]), \
        f"the replaced rank prepares its receive slot from the layout in the torchrun agent's store: {rep}"
    # the timeline says how long the pull waited for that slot (the part of its preparation on the recovery's path)
    (tl_path,) = tmp_path.rglob("recovery_timeline.attempt1.json")  # rank 0's, in its store's reports
    tl = json.loads(tl_path.read_text())
    waits = [r["prepared_slot_wait"] for r in tl["per_rank_events_unix"]]
    assert waits[1] is not None and waits[1] >= 0 and tl["prepared_slot_wait_s"] == max(
        w for w in waits if w is not None), tl


# The replicated optimizer's lazy backup after a replaced store is test_hung_rank_...'s replicated case below (the
# detector threads write it while the main threads sit in gloo) and the fault campaign's truncated-snapshot case.


@pytest.mark.parametrize("layout", [pytest.param("dp4", marks=pytest.mark.quick), "tp2-dp2"])
def test_distributed_optimizer_snapshot_is_12_bytes_per_local_param_over_dp(
        layout: str, baseline: Baselines) -> None:
    """Per rank: the snapshotted tensors are its fp32 shard + exp_avg + exp_avg_sq, 12 bytes per local param
    / DP (the DP shards of a model-parallel slice partition it exactly); the rest of a snapshot (alignment,
    hyper-parameters, RNG, counters) is a small constant; no weight tensor is in the plan."""
    base = _base(baseline, f"distopt/{layout}")
    finals = [json.loads((base.out / f"plan.rank{r}.json").read_text()) for r in range(4)]
    by_coord: dict[tuple[int, ...], list[dict]] = {}
    for f in finals:
        by_coord.setdefault(tuple(f["coord"]), []).append(f)
        plan = f["plan"]
        kinds = {kind for _, kind, _ in plan["unique"]}
        assert kinds == {"main_param", "optimizer"}, kinds
        assert not [n for n, _, _ in plan["unique"] if n.startswith("model/")]
        assert len(plan["regenerable"]) > 0 and all(n.startswith("model/") for n in plan["regenerable"])
        exact = 12 * f["local_params"] / f["dp_size"]
        # mcore pads its buffers so every DP rank's shard has the same size: a shard differs from local / DP
        # by at most that padding.
        assert abs(plan["unique_tensor_bytes"] - exact) <= 12 * 128, (plan["unique_tensor_bytes"], exact)
        snapshotted = plan["unique_bytes"] + plan["extras_bytes"]
        assert 0 <= snapshotted - plan["unique_tensor_bytes"] <= 64 * 1024, "the rest must be a small constant"
    for coord, ranks in by_coord.items():
        # The DP shards of one model-parallel slice partition it exactly: 12 bytes per param, no overlap.
        assert sum(f["plan"]["unique_tensor_bytes"] for f in ranks) == 12 * ranks[0]["local_params"], coord


HANGS = {"replicated-rank0-replaced-store": {"victim": 0, "DIST_OPT": 0, "wipe": True}}
"""A distributed-optimizer rank hung in its backward pass is the fault campaign's CI case (test_campaign.py)."""


@pytest.mark.parametrize("case", list(HANGS))
def test_hung_rank_is_detected_by_heartbeat_killed_and_the_job_resumes_bit_exact(
        case: str, baseline: Baselines, tmp_path: Path) -> None:
    """A SIGSTOPped rank never fails a collective: its peers wait in the gradient collective of step 5 with their
    main threads inside gloo. Their detector threads notice its silent heartbeat within the configured bound,
    SIGKILL it (same machine) and leave; torchrun restarts the job at once instead of after the collective
    timeout. Under the replicated optimizer the redundant state is backed up by the detector threads (the main
    threads are blocked), and the hung rank, restarted with an empty store, loads it: bit-for-bit."""
    c = HANGS[case]
    victim = c["victim"]
    cfg = tmp_path / "nckpt.yaml"
    cfg.write_text("neighbor_ckpt:\n  detector:\n    interval_s: 0.5\n    timeout_s: 3\n")
    base = _base(baseline, f"{'distopt' if c['DIST_OPT'] else 'replicated'}/dp4")
    wipe = {"WIPE_RANKS": victim} if c["wipe"] else {}
    res = run_torchrun("train_mcore.py", tmp_path, max_restarts=1, STEPS=STEPS, DIST_OPT=c["DIST_OPT"],
                       KILL_RANK=victim, KILL_STEP=5, KILL_PHASE="forward", KILL_SIGNAL="SIGSTOP", NCKPT_CONFIG=cfg,
                       timeout=300, **wipe)
    assert res.returncode == 0, res.log[-6000:]
    fault = json.loads((res.out / "fault.json").read_text())
    assert fault["signal"] == "SIGSTOP" and fault["rank"] == victim
    assert "neighbor_ckpt detected a failure (silent)" in res.log, res.log[-6000:]
    assert f"SIGKILLed rank {victim}" in res.log
    assert_same_training(base, res)
    assert recomputed_steps(res) <= {5}
    rep = res.report(victim, 1)
    assert (rep["outcome"], rep["iteration"]) == ("restored", 4), rep
    if not c["DIST_OPT"]:
        assert "wrote lazy backup of iteration 4" in res.log
        assert rep["lazy_bytes"] > 0 and rep["lazy_from"] not in (None, victim), rep


def test_a_fault_planned_in_the_config_file_is_injected_by_the_recipe_and_recovered_bit_exact(
        baseline: Baselines, tmp_path: Path) -> None:
    """The recipe reads ``neighbor_ckpt.fault_injection`` from its ``--config`` file (the section the NeMo and Bridge
    recipes read; no ``--kill``): rank 1 SIGKILLed inside optimizer step 5 and restarted on a "replaced node" (its
    host store emptied by the recipe itself, ``replace_store``); the job resumes bit for bit."""
    cfg = tmp_path / "nckpt.yaml"
    cfg.write_text("neighbor_ckpt:\n  fault_injection:\n    enabled: true\n    faults: [{rank: 1, step: 5, "
                   "phase: optimizer, replace_store: true}]\n")
    base = _base(baseline, "distopt/dp4")
    res = run_torchrun("train_mcore.py", tmp_path, max_restarts=1, STEPS=STEPS, DIST_OPT=1, NCKPT_CONFIG=cfg)
    assert res.returncode == 0, res.log[-6000:]
    fault = json.loads((res.out / "fault.json").read_text())
    assert (fault["rank"], fault["step"], fault["phase"], fault["signal"]) == (1, 5, "optimizer", "SIGKILL"), fault
    assert len((res.out / "faults.jsonl").read_text().splitlines()) == 1
    assert "fault injection: SIGKILL of rank 1 in the optimizer phase of step 5" in res.log
    assert_same_training(base, res)
    assert recomputed_steps(res) <= {5}
    rep = res.report(1, 1)
    assert (rep["outcome"], rep["iteration"], rep["source"]) == ("restored", 4, "replica"), rep
    assert rep["pulled_bytes"] > 0, "its store was emptied: it pulled its state from its ring successor"
