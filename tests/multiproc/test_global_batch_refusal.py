"""Tier 2: a data-parallel size that does not divide the global batch given to the checkpointer is refused at
construction, on every rank alike, before recover() (before any elastic reshard could change anything); one that
divides it gives each rank its micro-batches (issue 31 item 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiproc.test_gloo_ring import _spawn

pytestmark = pytest.mark.multiproc


def _build(rank: int, world: int, tmp: Path) -> None:
    from neighbor_ckpt import NeighborCheckpointer, NeighborCkptConfig
    from neighbor_ckpt.adapters import TorchOptimizerAdapter
    from neighbor_ckpt.errors import ConfigError

    model = torch.nn.Linear(4, 4)
    cfg = NeighborCkptConfig.from_dict({"job_id": "batch", "store": {"dir": str(tmp / f"store{rank}")},
                                        "detector": {"enabled": False}})
    adapter = TorchOptimizerAdapter(model, torch.optim.Adam(model.parameters()))
    try:
        NeighborCheckpointer(cfg, adapter=adapter, handle_sigterm=False, global_batch=16, micro_batch_size=2)
    except ConfigError as e:
        (tmp / f"refused{rank}").write_text(str(e))
    else:
        raise AssertionError("DP 3 does not divide a global batch of 16 in micro-batches of 2, and was accepted")
    ckpt = NeighborCheckpointer(cfg, adapter=adapter, handle_sigterm=False, global_batch=24, micro_batch_size=2)
    assert ckpt.micro_batches == 4, ckpt.micro_batches
    ckpt.close(success=True)


def test_a_dp_size_that_does_not_divide_the_global_batch_is_refused_on_every_rank(tmp_path: Path) -> None:
    _spawn(_build, tmp_path, world=3)
    assert not list(tmp_path.glob("err*")), [p.read_text() for p in tmp_path.glob("err*")]
    assert sorted(p.name for p in tmp_path.glob("ok*")) == ["ok0", "ok1", "ok2"]
    msgs = {p.read_text() for p in tmp_path.glob("refused*")}
    assert len(msgs) == 1 and len(list(tmp_path.glob("refused*"))) == 3, msgs
    assert msgs.pop().startswith("the global batch of 16 samples cannot be kept at data-parallel size 3: 16 is not a "
                                 "multiple of micro-batch size 2 x data-parallel size 3 = 6")
