"""NeighborCheckpointer's construction, step one: the pure checks of configuration and adapter (check_setup), run
without any process group (the collectives come after, in NeighborCheckpointer._setup_collectives)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from neighbor_ckpt.adapters import TorchOptimizerAdapter
from neighbor_ckpt.checkpointer import check_setup
from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.recovery.attempt import AttemptInfo


@pytest.fixture
def adapter() -> TorchOptimizerAdapter:
    model = torch.nn.Linear(4, 2)
    return TorchOptimizerAdapter(model, torch.optim.AdamW(model.parameters()))


def test_checks_need_no_process_group_and_give_the_defaults(adapter: TorchOptimizerAdapter) -> None:
    assert not dist.is_initialized()
    assert check_setup(None, adapter) == NeighborCkptConfig()
    cfg = NeighborCkptConfig(job_id="j")
    assert check_setup(cfg, adapter) is cfg
    assert not dist.is_initialized()


def test_a_config_changed_after_construction_or_of_another_type_is_refused(adapter: TorchOptimizerAdapter) -> None:
    cfg = NeighborCkptConfig()
    cfg.store.versions = 1
    with pytest.raises(ConfigError, match="neighbor_ckpt.store.versions: 1 must be >= 2"):
        check_setup(cfg, adapter)
    with pytest.raises(ConfigError, match="^NeighborCheckpointer expects a NeighborCkptConfig, got dict"):
        check_setup({"job_id": "j"}, adapter)  # type: ignore[arg-type]


def test_elastic_with_an_adapter_that_cannot_reshard_is_refused(adapter: TorchOptimizerAdapter) -> None:
    with pytest.raises(ConfigError, match="^neighbor_ckpt.elastic.enabled: TorchOptimizerAdapter keeps optimizer "
                                          "state that cannot be re-partitioned"):
        check_setup(NeighborCkptConfig(elastic={"enabled": True}), adapter)


def test_inprocess_without_an_attempt_is_warned_about(adapter: TorchOptimizerAdapter,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    cfg = NeighborCkptConfig(inprocess={"enabled": True})
    with caplog.at_level(logging.WARNING, logger="neighbor_ckpt.checkpointer"):
        check_setup(cfg, adapter, attempt=AttemptInfo(inprocess=1))
        assert "no attempt= given" not in caplog.text
        check_setup(cfg, adapter)
    assert "inprocess.enabled but no attempt= given" in caplog.text
