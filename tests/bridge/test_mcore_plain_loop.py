"""The plain megatron-core loop (``recipes/mcore_gpt_plain_loop.py``, run by ``tests/workers/train_mcore.py``) on
megatron-core 0.19.2: the headline kill test of ``tests/e2e/test_mcore_recovery.py`` in the Bridge environment.
4 gloo ranks, the distributed optimizer, rank 1 SIGKILLed inside optimizer step 5 with its host store replaced by
an empty one, plain ``torchrun --max-restarts 1``: bit-exact against the failure-free run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Baselines, assert_replaced_rank_restored_from_its_replica, run_torchrun

pytestmark = pytest.mark.e2e

STEPS = 8


@pytest.mark.cold
def test_distributed_optimizer_kill_inside_optimizer_step_on_mcore_019_is_bit_exact(
        baseline: Baselines, tmp_path: Path) -> None:
    import megatron.core

    assert megatron.core.__version__.startswith("0.19."), megatron.core.__version__
    base = baseline("train_mcore.py", STEPS=STEPS, DIST_OPT=1, warm=True, TP=1, PP=1)
    res = run_torchrun("train_mcore.py", tmp_path, max_restarts=1, STEPS=STEPS, DIST_OPT=1, KILL_RANK=1,
                       KILL_STEP=5, KILL_PHASE="optimizer", WIPE_RANKS=1, TP=1, PP=1)
    rep = assert_replaced_rank_restored_from_its_replica(base, res)
    assert any("prepared in advance" in n for n in rep["notes"]), \
        f"the replaced rank prepares its receive slot from the layout in the torchrun agent's store: {rep}"
