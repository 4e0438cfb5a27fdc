"""End to end, per ``transport.kind`` other than the default (the default, ``gloo``, is every other e2e test): the
headline recovery of ``test_mcore_recovery.py`` (real megatron-core, 4 gloo ranks, DP 4, a SIGKILL inside optimizer
step 5 and the killed rank's host store replaced) with the kind set in the ``neighbor_ckpt:`` YAML, so the
checkpointer builds it with :func:`~neighbor_ckpt.snapshot.transport_kinds.make_transport`, streams through it and recovers
through it. The wire contract itself is ``tests/multiproc/test_transport_contract.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from neighbor_ckpt.config import TRANSPORT_KINDS
from tests.conftest import Baselines, assert_replaced_rank_restored_from_its_replica, run_torchrun

pytestmark = pytest.mark.e2e
pytest.importorskip("megatron.core")

STEPS = 8


@pytest.mark.parametrize("kind", [k for k in TRANSPORT_KINDS if k != "gloo"])
def test_a_replaced_rank_recovers_bit_exact_through_every_transport_kind(kind: str, baseline: Baselines,
                                                                         tmp_path: Path) -> None:
    cfg = tmp_path / "nckpt.yaml"
    cfg.write_text(f"neighbor_ckpt:\n  transport:\n    kind: {kind}\n")
    base = baseline("train_mcore.py", STEPS=STEPS, DIST_OPT=1, warm=True, TP=1, PP=1)
    res = run_torchrun("train_mcore.py", tmp_path, max_restarts=1, STEPS=STEPS, DIST_OPT=1, KILL_RANK=1,
                       KILL_STEP=5, KILL_PHASE="optimizer", WIPE_RANKS=1, TP=1, PP=1, NCKPT_CONFIG=str(cfg))
    assert_replaced_rank_restored_from_its_replica(base, res)
