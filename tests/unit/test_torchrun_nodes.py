"""The restart path of a job of several nodes on one machine (neighbor_ckpt/cli/torchrun_nodes.py): one torchrun agent
per simulated node, one c10d rendezvous, each node its own id, host store and node index; elastic agents take
``--nnodes 1:N`` and a keep-alive that follows the detector; the launch's status from its agents'; what is still
refused (a one-node elastic launch, the fixed-count Slurm script, GPU nodes from one shell)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from neighbor_ckpt.cli import launch
from neighbor_ckpt.cli.torchrun_nodes import (LAST_CALL_MIN_S, NODE_TAG_ENV, NodeAgents, node_agents,
                                              nodes_status, rdzv_conf, run_node_agents)
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.inprocess.protocol import ENV_NODE_INDEX
from neighbor_ckpt.runtime.procs import python_module_command

TORCHRUN_HEAD = python_module_command("torch.distributed.run")

REPO = Path(__file__).resolve().parents[2]
NODES = ("trainer.num_nodes=2", "trainer.devices=2")


def _opt(cmd: tuple[str, ...], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in cmd if a.startswith(f"{name}=")]
    return value


def test_a_job_of_two_nodes_runs_one_agent_per_node_in_one_rendezvous_each_with_its_node_id_store_and_index(
        tmp_path: Path) -> None:
    plan = launch.plan_launch(REPO / "configs/gpt_tiny_cpu.yaml", [*NODES, "neighbor_ckpt.job_id=j"],
                              run_dir=tmp_path / "run")
    agents = launch.torchrun_nodes(plan, endpoint="127.0.0.1:23456", store_root=tmp_path / "store")
    assert len(agents.agents) == 2 and not agents.elastic
    for i, (cmd, extra) in enumerate(agents.agents):
        assert list(cmd[:len(TORCHRUN_HEAD)]) == TORCHRUN_HEAD, "torchrun runs without the cwd on sys.path"
        assert (_opt(cmd, "--nnodes"), _opt(cmd, "--nproc-per-node"), _opt(cmd, "--max-restarts")) == ("2", "2", "2")
        assert (_opt(cmd, "--rdzv-backend"), _opt(cmd, "--rdzv-endpoint"), _opt(cmd, "--rdzv-id")) == \
            ("c10d", "127.0.0.1:23456", "j")
        assert _opt(cmd, "--rdzv-conf") == f"is_host={'true' if i == 0 else 'false'}"  # node 0 hosts the rendezvous
        assert str(plan.recipe) in cmd and str(plan.run_dir / "config.yaml") in cmd
        env = dict(extra)
        assert env["NEIGHBOR_CKPT_NODE_ID"] == f"node{i}" and env[ENV_NODE_INDEX] == str(i)
        assert env["NEIGHBOR_CKPT_STORE_DIR"] == str(tmp_path / "store" / f"node{i}")
        assert env[NODE_TAG_ENV] == f"j/node{i}"
    assert "as 2 simulated nodes of 2 (one torchrun agent each" in launch.describe(plan)


def test_elastic_agents_take_one_to_n_nodes_and_a_keep_alive_that_follows_the_detector(tmp_path: Path) -> None:
    plan = launch.plan_launch(REPO / "configs/gpt_tiny_cpu.yaml", [*NODES, "neighbor_ckpt.elastic.enabled=true"],
                              run_dir=tmp_path / "run")
    agents = launch.torchrun_nodes(plan, endpoint="127.0.0.1:1", store_root=tmp_path)
    assert agents.elastic and agents.detector_timeout_s == 2.0
    assert [_opt(cmd, "--nnodes") for cmd, _ in agents.agents] == ["1:2", "1:2"]
    assert _opt(agents.agents[1][0], "--rdzv-conf") == \
        f"is_host=false,keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout={LAST_CALL_MIN_S}"
    assert "others go on without a lost node" in launch.describe(plan)


def test_the_rendezvous_keep_alive_drops_a_lost_node_about_one_detector_timeout_later() -> None:
    def conf(timeout: float) -> dict[str, str]:
        return dict(kv.split("=") for kv in rdzv_conf(timeout, host=True, elastic=True).split(","))

    for timeout in (0.5, 2.0, 5.0, 30.0, 100.0):
        c = conf(timeout)
        interval, attempts = int(c["keep_alive_interval"]), int(c["keep_alive_max_attempt"])
        assert interval >= 1 and attempts >= 3 and c["is_host"] == "true"
        assert timeout <= interval * attempts <= max(3, timeout + interval), (timeout, c)
        assert int(c["last_call_timeout"]) >= max(LAST_CALL_MIN_S, 2 * timeout)
    assert rdzv_conf(5.0, host=False, elastic=False) == "is_host=false"


def test_the_launch_status_counts_a_lost_node_as_success_only_under_elastic() -> None:
    kill = -signal.SIGKILL
    assert nodes_status([0, 0], elastic=False) == 0
    assert nodes_status([0, kill], elastic=True) == 0
    assert nodes_status([0, kill], elastic=False) == kill
    assert nodes_status([kill, kill], elastic=True) == kill  # nobody finished the job
    assert nodes_status([0, 1], elastic=True) == 1
    assert nodes_status([None, kill], elastic=False) == kill  # an agent the launch stopped counts 1


def test_what_is_still_refused_says_what_to_set(tmp_path: Path) -> None:
    plan = launch.plan_launch(REPO / "configs/gpt_tiny_cpu.yaml", [*NODES, "neighbor_ckpt.elastic.enabled=true"],
                              run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=r"fixed number of nodes \(--nnodes=2\).*set neighbor_ckpt.inprocess.enabled"):
        launch.slurm_script(plan)
    from neighbor_ckpt.cli.main import main

    assert main(["launch", str(REPO / "configs/gpt_tiny_cpu.yaml"), *NODES, "neighbor_ckpt.elastic.enabled=true",
                 "--run-dir", str(tmp_path / "run2"), "--slurm", str(tmp_path / "job.sbatch")]) == 2
    assert not (tmp_path / "run2").exists() and not (tmp_path / "job.sbatch").exists()
    with pytest.raises(ValueError):
        node_agents(["x"], nodes=0, devices=2, max_restarts=0, run_id="r", endpoint="h:1", store_root=tmp_path,
                    elastic=False, detector_timeout_s=1.0)


def _left(prefix: str) -> list[int]:
    """The processes whose node tag starts with ``prefix``."""
    import psutil

    left = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(NODE_TAG_ENV, "").startswith(prefix):
                left.append(proc.pid)
        except psutil.Error:
            continue
    return left


def _agents(tmp_path: Path, scripts: list[str], *, elastic: bool) -> NodeAgents:
    """Agents that are plain Python scripts instead of torchrun (the supervisor's part only)."""
    base = node_agents(["w.py"], nodes=len(scripts), devices=1, max_restarts=0, run_id=f"t{tmp_path.name}",
                       endpoint="127.0.0.1:1", store_root=tmp_path, elastic=elastic, detector_timeout_s=1.0)
    return NodeAgents(agents=tuple(((sys.executable, "-c", s), extra) for s, (_, extra)
                                          in zip(scripts, base.agents)), elastic=elastic, detector_timeout_s=1.0)


LOST_WITH_A_WORKER = ("import os, signal, subprocess, sys, time\n"
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
                      "                 start_new_session=True)\n"
                      "time.sleep(1); os.kill(os.getpid(), signal.SIGKILL)")
"""An agent that starts a worker in a session of its own (as torchrun does), then dies by SIGKILL."""


def test_a_node_lost_without_elastic_is_one_line_naming_it_and_the_setting_and_the_others_are_stopped(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    agents = _agents(tmp_path, ["import time; time.sleep(600)", LOST_WITH_A_WORKER], elastic=False)
    assert run_node_agents(agents) == 1
    err = capfd.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "lost for good" in ln]
    assert "node node1 is lost for good" in line and "set neighbor_ckpt.elastic.enabled: true" in line, line
    assert _left(f"t{tmp_path.name}/") == []  # nothing of either node is left


def test_a_node_lost_under_elastic_leaves_the_others_running_and_its_worker_is_killed(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    agents = _agents(tmp_path, ["import time; time.sleep(3)", LOST_WITH_A_WORKER], elastic=True)
    assert run_node_agents(agents) == 0
    err = capfd.readouterr().err
    assert "node node1 is lost for good (its torchrun agent was killed by SIGKILL; 1 process(es) of it stopped)" in err, err
    assert "the other node(s) go on without it" in err, err
    assert _left(f"t{tmp_path.name}/") == []


def test_the_supervisor_is_quiet_when_every_node_finishes(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert run_node_agents(_agents(tmp_path, ["pass", "pass"], elastic=False)) == 0
    assert "neighbor-ckpt launch:" not in capfd.readouterr().err
    assert run_node_agents(_agents(tmp_path, ["pass", "raise SystemExit(3)"], elastic=True)) == 3
    assert "node node1: its torchrun agent exited 3" in capfd.readouterr().err


def test_launch_dry_run_prints_one_torchrun_agent_per_simulated_node(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from neighbor_ckpt.cli.main import main

    assert main(["launch", str(REPO / "configs/gpt_tiny_cpu.yaml"), *NODES, "--run-dir", str(tmp_path),
                 "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all("-m torch.distributed.run --nnodes=2 --nproc-per-node=2" in ln for ln in lines)
    assert [ln.split("NEIGHBOR_CKPT_NODE_ID=")[1].split()[0] for ln in lines] == ["node0", "node1"]
