"""What the in-process engine refuses when it is built, before it touches any store (one process)."""

from __future__ import annotations

import pytest

from neighbor_ckpt.config import DetectorConfig, InprocessConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.inprocess import InprocessRecovery, protocol
from neighbor_ckpt.inprocess.engine import parse_store_address

LAUNCHED = {protocol.ENV_LAUNCHER: "1234", protocol.ENV_STORE: "127.0.0.1:29650", protocol.ENV_PROCESSES: "5",
            protocol.ENV_SPARES: "1", protocol.ENV_PROCESS: "0"}


@pytest.fixture()
def launched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEIGHBOR_CKPT_INPROCESS_TIMERS", raising=False)
    for k, v in LAUNCHED.items():
        monkeypatch.setenv(k, v)


def test_plain_torchrun_is_refused_naming_our_launcher(launched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(protocol.ENV_LAUNCHER)
    with pytest.raises(ConfigError, match=r"neighbor-ckpt launch.*not plain torchrun"):
        InprocessRecovery()


def test_under_our_launcher_the_engine_takes_the_launch_from_the_environment(launched: None) -> None:
    inproc = InprocessRecovery()
    assert (inproc.store_host, inproc.store_port, inproc.world_size, inproc.spares) == ("127.0.0.1", 29650, 5, 1)
    assert inproc.active_world_size == 4


def test_the_detector_switched_off_is_refused(launched: None) -> None:
    with pytest.raises(ConfigError, match="detector.enabled: false"):
        InprocessRecovery(detector=DetectorConfig(enabled=False))


def test_a_spare_count_other_than_the_launchers_is_refused(launched: None) -> None:
    with pytest.raises(ConfigError, match="spares is 2 but the launcher started 1"):
        InprocessRecovery(spares=2, inprocess=InprocessConfig(enabled=True, spares=2))


def test_the_old_timer_variable_is_refused(launched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEIGHBOR_CKPT_INPROCESS_TIMERS", "soft_timeout=10")
    with pytest.raises(ConfigError, match="hang_timeout_s"):
        InprocessRecovery()


@pytest.mark.parametrize("text", ["", "host", "host:", ":29650", "host:port"])
def test_a_store_address_that_is_not_host_port_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="not HOST:PORT"):
        parse_store_address(text, "--inprocess-store")
    assert parse_store_address("[::1]:29650", "x") == ("::1", 29650)
