"""The job id of a torchrun launch without a run id: the pure decision, the agent-store exchange (a real TCPStore),
the fallback without an agent store, and the report of an earlier launch's leftover host store."""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from neighbor_ckpt.config import JOB_ID_ENV, LAUNCH_ID_ENV, JobIdChoice, NeighborCkptConfig, decide_job_id
from neighbor_ckpt.errors import CallOrderError, ConfigError
from neighbor_ckpt.runtime import launch_identity as li

_ENV = (JOB_ID_ENV, LAUNCH_ID_ENV, "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
        "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)


# -- the decision (pure) ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env,configured,expected", [
    ({}, None, JobIdChoice("default", "default")),
    ({"SLURM_JOB_ID": "77"}, None, JobIdChoice("77", "SLURM_JOB_ID")),
    ({"TORCHELASTIC_RUN_ID": "rdzv-1", "SLURM_JOB_ID": "77"}, None, JobIdChoice("rdzv-1", "TORCHELASTIC_RUN_ID")),
    ({"TORCHELASTIC_RUN_ID": "none"}, None, JobIdChoice(None, "launch")),
    ({"TORCHELASTIC_RUN_ID": "None "}, None, JobIdChoice(None, "launch")),
    ({"TORCHELASTIC_RUN_ID": ""}, None, JobIdChoice(None, "launch")),
    ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}, None, JobIdChoice(None, "launch")),
    ({"TORCHELASTIC_RUN_ID": "none", LAUNCH_ID_ENV: "launch-x"}, None, JobIdChoice("launch-x", "launch")),
    ({"TORCHELASTIC_RUN_ID": "none"}, "mine", JobIdChoice("mine", "config")),
    ({"TORCHELASTIC_RUN_ID": "none", JOB_ID_ENV: "env/id"}, "mine", JobIdChoice("env_id", JOB_ID_ENV)),
], ids=["default", "slurm", "run-id", "none", "None-spaced", "empty", "none-beats-slurm", "launch-made",
        "explicit-config", "explicit-env"])
def test_decide_job_id(env, configured, expected):
    assert decide_job_id(env, configured) == expected


def test_resolved_job_id_before_the_launch_id_exists_says_what_to_call_first(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(CallOrderError, match=r"torchrun gave it no run id .*prepare_torchrun_restart\(\) runs or "
                                             r"the NeighborCheckpointer is built.*neighbor_ckpt.job_id"):
        NeighborCkptConfig().resolved_job_id()
    monkeypatch.setenv(LAUNCH_ID_ENV, "launch-1")
    assert NeighborCkptConfig().resolved_job_id() == "launch-1"
    assert NeighborCkptConfig(job_id="explicit").resolved_job_id() == "explicit"


def test_new_launch_ids_differ_and_carry_the_prefix():
    a, b = li.new_launch_id(), li.new_launch_id()
    assert a != b and a.startswith(li.LAUNCH_PREFIX) and b.startswith(li.LAUNCH_PREFIX)


# -- the exchange through the agent's store --------------------------------------------------------------------------


def _agent_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                         timeout=timedelta(seconds=30))


def test_exchange_keeps_the_first_proposal_for_every_caller():
    store = _agent_store()
    assert li.exchange_launch_id(store, "launch-a") == "launch-a"
    assert li.exchange_launch_id(store, "launch-b") == "launch-a"
    assert li.exchange_launch_id(_agent_store(), "launch-c") == "launch-c"  # another launch, another store


def _as_torchrun_worker(monkeypatch, store: dist.TCPStore, restart: int) -> None:
    monkeypatch.delenv(LAUNCH_ID_ENV, raising=False)  # a new worker process (restart) starts without it
    for k, v in {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": str(restart),
                 "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                 "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)


def test_restarts_of_one_launch_share_its_id_and_a_new_launch_gets_another(monkeypatch):
    first_launch = _agent_store()
    _as_torchrun_worker(monkeypatch, first_launch, restart=0)
    made = li.establish_launch_id()
    assert made is not None and made.startswith(li.LAUNCH_PREFIX)
    assert li.resolve_job_id(NeighborCkptConfig()) == JobIdChoice(made, "launch")
    _as_torchrun_worker(monkeypatch, first_launch, restart=1)
    assert li.resolve_job_id(NeighborCkptConfig()) == JobIdChoice(made, "launch")
    second_launch = _agent_store()
    _as_torchrun_worker(monkeypatch, second_launch, restart=0)
    assert li.resolve_job_id(NeighborCkptConfig()).job_id not in (made, None)


def test_an_explicit_job_id_needs_no_launch_id(monkeypatch):
    store = _agent_store()
    _as_torchrun_worker(monkeypatch, store, restart=0)
    assert li.resolve_job_id(NeighborCkptConfig(job_id="mine")) == JobIdChoice("mine", "config")
    monkeypatch.setenv(JOB_ID_ENV, "from-env")
    assert li.establish_launch_id() is None
    assert not store.check([li.LAUNCH_KEY])


def test_outside_torchrun_nothing_is_made():
    assert li.establish_launch_id() is None
    assert li.resolve_job_id(NeighborCkptConfig()) == JobIdChoice("default", "default")


def test_without_an_agent_store_one_node_derives_the_id_from_the_agent_process(monkeypatch):
    store = _agent_store()
    _as_torchrun_worker(monkeypatch, store, restart=0)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    a = li.establish_launch_id()
    monkeypatch.delenv(LAUNCH_ID_ENV)
    assert li.establish_launch_id() == a and a.startswith(li.LAUNCH_PREFIX + "agent-")


def test_without_an_agent_store_across_nodes_asks_for_a_run_id(monkeypatch):
    store = _agent_store()
    _as_torchrun_worker(monkeypatch, store, restart=0)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"no run id .*--rdzv-id=.*neighbor_ckpt.job_id"):
        li.establish_launch_id()


# -- an earlier launch's leftover host store -------------------------------------------------------------------------


def _slot(d: Path, n: int) -> None:
    d.mkdir(parents=True)
    (d / "own.0.slot").write_bytes(b"x" * n)


def test_leftovers_of_earlier_launches_are_reported_in_one_line(tmp_path, caplog):
    user = tmp_path / "user"
    _slot(user / "none" / "rank1", 1500)
    _slot(user / "launch-20260101-000000-aa" / "rank1", 20)
    _slot(user / "launch-20260101-000000-aa" / "rank0", 20)  # another rank's: not this rank's to report
    _slot(user / "explicit-job" / "rank1", 20)  # another job, named on purpose: not an earlier launch of this one
    _slot(user / "launch-now" / "rank1", 20)  # this launch
    with caplog.at_level(logging.WARNING, logger=li.__name__):
        found = li.report_leftovers(user, "launch-now", 1)
    assert found == [(user / "launch-20260101-000000-aa" / "rank1", 20), (user / "none" / "rank1", 1500)]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("rank 1: ignored the snapshots of an earlier launch: ")
    assert f"{user / 'none' / 'rank1'} (1.5 KB)" in line and "(20 B)" in line
    assert f"rm -rf {user / 'launch-20260101-000000-aa' / 'rank1'} {user / 'none' / 'rank1'}" in line
    assert "never loads them" in line


def test_no_leftovers_no_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=li.__name__):
        assert li.report_leftovers(tmp_path / "missing", "launch-now", 0) == []
    assert not caplog.records
