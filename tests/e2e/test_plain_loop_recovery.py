"""End to end, plain training loop (no Lightning): the NeighborCheckpointer API under torchrun with a real
SIGKILL and restart, for plain DDP (lazy backup path) and torch's ZeRO (all state unique)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Baselines, assert_same_training, recomputed_steps, run_torchrun

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("optim", "phase"), [("adam", "forward"), ("zero", "backward")])
def test_plain_loop_kill_with_replaced_store_is_bit_exact(optim: str, phase: str, baseline: Baselines,
                                                          tmp_path: Path) -> None:
    """Plain DDP replicates its few-KB snapshot before moving on, so even a kill in the forward pass loses
    nothing; ZeRO replicates asynchronously until the wait point, so it is killed after it (in backward)."""
    base = baseline("train_plain.py", OPTIM=optim, STEPS=10)
    res = run_torchrun("train_plain.py", tmp_path / "fault", max_restarts=1, OPTIM=optim, STEPS=10,
                       KILL_RANK=2, KILL_STEP=5, KILL_PHASE=phase, WIPE_RANKS=2)
    assert res.returncode == 0, res.log[-6000:]
    assert res.killed(), "the kill did not happen"
    assert_same_training(base, res)
    assert recomputed_steps(res) <= {5}
    rep = res.report(2, 1)
    assert rep["outcome"] == "restored" and rep["iteration"] == 4 and rep["source"] == "replica"
    if optim == "zero":
        assert rep["lazy_bytes"] == 0, "ZeRO state is all unique: nothing to back up lazily"
    else:
        assert rep["lazy_bytes"] > 0


