"""What the framework callbacks share through neighbor_ckpt.glue besides the resume policy: the set-up at
construction, the single-process check, the reporter's attachment, the evaluation pause and the RNG applied once."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from neighbor_ckpt.config import NeighborCkptConfig, ReportConfig
from neighbor_ckpt.errors import ConfigError, NeighborCkptError
from neighbor_ckpt.glue import rng, setup
from neighbor_ckpt.glue.session import Session


def test_set_up_callback_checks_the_config_runs_the_refusals_first_then_prepares(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(setup, "prepare_torchrun_restart", lambda: calls.append("torchrun"))
    monkeypatch.setattr(setup, "prepare_replacement_slot", lambda cfg: calls.append("slot"))
    with pytest.raises(ConfigError, match="^NeighborCheckpoint expects a NeighborCkptConfig, got dict"):
        setup.set_up_callback({"enabled": True})  # type: ignore[arg-type]

    def refuse(cfg: NeighborCkptConfig) -> None:
        calls.append("refuse")
        raise ConfigError("refused")

    with pytest.raises(ConfigError, match="refused"):
        setup.set_up_callback(None, refuse=refuse)
    assert calls == ["refuse"]  # nothing prepared for a refused configuration
    calls.clear()
    cfg = setup.set_up_callback(None, refuse=lambda c: calls.append("refuse"))
    assert isinstance(cfg, NeighborCkptConfig) and calls == ["refuse", "torchrun", "slot"]
    calls.clear()
    off = NeighborCkptConfig(enabled=False)
    assert setup.set_up_callback(off) is off and calls == []


def test_a_single_process_run_turns_the_callback_off_with_a_warning(caplog) -> None:
    cfg = NeighborCkptConfig()
    with caplog.at_level(logging.WARNING):
        assert not Session(cfg, name="NeighborCheckpoint").distributed()
    assert not cfg.enabled and "single-process run" in caplog.text


class _Reporter:
    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    def attach(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


def _session(report: ReportConfig) -> tuple[Session, _Reporter, list[str]]:
    session, reporter, marks = Session(NeighborCkptConfig(report=report)), _Reporter(), []
    session.checkpointer = SimpleNamespace(reporter=reporter, mark=marks.append)  # type: ignore[assignment]
    return session, reporter, marks


def test_reporting_takes_the_frameworks_interval_loggers_and_default_directory(tmp_path: Path) -> None:
    with pytest.raises(NeighborCkptError, match="before start"):
        Session(NeighborCkptConfig()).attach_reporting(log_interval=5, default_report_dir=lambda: None)
    asked: list[int] = []

    def default() -> Path:
        asked.append(1)
        return tmp_path / "reports"

    session, reporter, _ = _session(ReportConfig(timeline=True, log_metrics=True))
    session.attach_reporting(log_interval=5, default_report_dir=default, loggers=("tb",), process_group_ready=1.5)
    assert reporter.kwargs == {"every_n_steps": 5, "loggers": ["tb"], "report_dir": tmp_path / "reports",
                               "process_group_ready": 1.5}
    session, reporter, _ = _session(ReportConfig(dir=str(tmp_path / "mine"), status_every_n_steps=2,
                                                 log_metrics=False))
    session.attach_reporting(log_interval=5, default_report_dir=default, loggers=("tb",))
    assert reporter.kwargs == {"every_n_steps": 2, "loggers": [], "report_dir": tmp_path / "mine",
                               "process_group_ready": None}
    session, reporter, _ = _session(ReportConfig(timeline=False))
    session.attach_reporting(log_interval=None, default_report_dir=default)
    assert reporter.kwargs["report_dir"] is None and reporter.kwargs["loggers"] is None
    assert asked == [1]  # the default directory (a collective in Lightning) only when it is used


def test_evaluation_pauses_the_hang_clock_and_resumes_it() -> None:
    session, _, marks = _session(ReportConfig())
    session.evaluation_started()
    session.evaluation_ended()
    assert marks == ["paused", "validated"]
    Session(NeighborCkptConfig()).evaluation_started()  # before start: nothing to mark


def test_the_rng_states_kept_are_applied_once() -> None:
    pending = rng.PendingRng()
    pending.apply()  # nothing kept: nothing happens
    pending.keep(rng.capture())
    first = (random.random(), torch.rand(2))
    pending.apply()
    again = (random.random(), torch.rand(2))
    assert first[0] == again[0] and torch.equal(first[1], again[1])
    pending.apply()  # once only
    assert random.random() != first[0]
    pending.keep_current()
    now = random.random()
    pending.apply()
    assert random.random() == now
