"""Tier 2: the failure detector runs on every rank or on none (a collective decision at construction)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.multiproc.test_gloo_ring import _spawn

pytestmark = pytest.mark.multiproc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_rank_without_a_store(rank: int, world: int, tmp: Path) -> None:
    from torch import nn

    from neighbor_ckpt import NeighborCheckpointer, NeighborCkptConfig
    from neighbor_ckpt.adapters import TorchOptimizerAdapter

    host = None
    if rank == 0:  # only rank 0 can reach a rendezvous store; rank 1's connection "fails" (no address)
        port = int((tmp / "port").read_text())
        host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    else:
        os.environ.pop("MASTER_ADDR", None)
        os.environ.pop("MASTER_PORT", None)
    groups = [dist.new_group([r]) for r in range(world)]
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    cfg = NeighborCkptConfig.from_dict({"job_id": "detector-agreement", "store": {"dir": str(tmp / "store")},
                                        "detector": {"interval_s": 0.1, "timeout_s": 0.5}})
    ckpt = NeighborCheckpointer(cfg, adapter=TorchOptimizerAdapter(model, opt), dp_group=groups[rank],
                                handle_sigterm=False)
    assert ckpt.detector is None, "a detector on one rank only would take the other rank's silence for a failure"
    ckpt.recover()
    for it in range(3):
        ckpt.snapshot(it)
    time.sleep(2.0)  # 4 detector timeouts: a lone detector on rank 0 would have stopped the job by now
    ckpt.close(success=True)  # the same barrier decision on both ranks
    del host


def test_a_rank_that_cannot_reach_the_store_turns_the_detector_off_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "port").write_text(str(_free_port()))
    _spawn(_one_rank_without_a_store, tmp_path)
    assert not list(tmp_path.glob("err*")), [p.read_text() for p in tmp_path.glob("err*")]
    assert sorted(p.name for p in tmp_path.glob("ok*")) == ["ok0", "ok1"]
