"""A single-machine in-process launch's ports, timeouts and completion marker, in one process: ports are drawn below the
kernel's ephemeral range and bound by the launch before anything starts (a port taken since its choice is replaced in
every launcher's store list), the launcher's store timeout follows ``detector.timeout_s``, and the completion marker
is what a late process reads without a store. The launches themselves: tests/multiproc/test_inprocess_launcher.py,
tests/e2e/test_launch_ports.py."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from neighbor_ckpt.cli import launch
from neighbor_ckpt.inprocess import completion, protocol
from neighbor_ckpt.inprocess.identity import ProcessIdentity
from neighbor_ckpt.inprocess.launcher_plan import child_env, parse_args
from neighbor_ckpt.inprocess.stores import store_timeout_for
from neighbor_ckpt.cli.launch import LAUNCHER
from neighbor_ckpt.runtime.procs import python_module_command

LAUNCHER_HEAD = python_module_command(LAUNCHER)
"""How a launcher's command line starts (this interpreter, ``-P -m`` the launcher): its own arguments follow."""

REPO = Path(__file__).resolve().parents[2]
BASE = ["--store", "10.0.0.1:29650", "--run-id", "job-1", "--node", "node3", "--first", "3", "--count", "2",
        "--processes", "6", "--spares", "1"]


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound() -> None:
    low, high = launch.ephemeral_ports()
    assert 0 < low <= high
    ports = launch.free_ports(8)
    assert len(set(ports)) == 8
    if low - launch.PORTS_FROM >= 16 * 8:  # room below the range: no port the kernel hands out
        assert all(launch.PORTS_FROM <= p < low for p in ports), (ports, low)
    for p in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))
    assert not set(launch.free_ports(4, avoid=ports)) & set(ports)


def test_the_launch_binds_every_store_port_and_replaces_one_taken_since_its_choice(tmp_path: Path) -> None:
    ports = launch.free_ports(3)
    procs = launch.inprocess_commands(["t.py"], active=2, spares=1, max_restarts=0, run_id="r", store_port=ports,
                                      store_root=tmp_path, detector_timeout_s=2.0)
    with socket.socket() as thief:  # another process takes store 1's port between its choice and the launch
        thief.bind(("127.0.0.1", ports[1]))
        thief.listen()
        bound, held = launch.bind_stores(procs)
        try:
            stores = parse_args(bound.agents[0][0][len(LAUNCHER_HEAD):]).stores
            assert stores[0][1] == ports[0] and stores[2][1] == ports[2]
            assert stores[1][1] not in ports, "a taken port is replaced"
            assert bound.stores == ",".join(f"127.0.0.1:{p}" for _, p in stores)
            for i, (cmd, _) in enumerate(bound.agents):
                own = parse_args(cmd[len(LAUNCHER_HEAD):])
                assert own.stores == stores, "every launcher gets the same list"
                assert own.listen_fd == held[i].fileno() and own.host_store == i
                assert held[i].getsockname()[1] == stores[i][1]
                assert own.program == ("t.py",)
                with socket.socket() as other:  # bound and listening from here on: nobody else can take it
                    with pytest.raises(OSError):
                        other.bind(("127.0.0.1", stores[i][1]))
        finally:
            for sock in held.values():
                sock.close()


def test_the_launchers_store_timeout_and_completion_marker_follow_the_job() -> None:
    plan = parse_args([*BASE, "--", "t.py"])
    assert plan.detector_timeout_s == 5.0 and plan.store_timeout_s == store_timeout_for(5.0) == 10.0
    fast = parse_args([*BASE, "--detector-timeout", "1", "--", "t.py"])
    assert fast.store_timeout_s == 3.0  # the floor, as the processes'
    assert protocol.ENV_COMPLETE_FILE not in child_env(plan, index=3, local_rank=0, attempt=0, launcher_pid=1)
    marked = parse_args([*BASE, "--complete-file", "/run/complete.job-1", "--", "t.py"])
    env = child_env(marked, index=3, local_rank=0, attempt=0, launcher_pid=1)
    assert env[protocol.ENV_COMPLETE_FILE] == "/run/complete.job-1"


def test_a_launch_passes_the_jobs_detector_timeout_and_marker_to_every_launcher(tmp_path: Path) -> None:
    plan = launch.plan_launch(REPO / "configs/gpt_tiny_cpu.yaml",
                              ["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=1",
                               "neighbor_ckpt.detector.timeout_s=4"], run_dir=tmp_path / "run")
    procs = launch.inprocess_processes(plan, store_port=29650, store_root=tmp_path / "shm")
    for cmd, _ in procs.agents:
        own = parse_args(cmd[len(LAUNCHER_HEAD):])
        assert own.detector_timeout_s == 4.0 and own.store_timeout_s == 8.0
        assert own.complete_file == str(completion.marker_path(plan.run_dir, plan.run_id))
    script = launch.slurm_script(plan)
    assert "--detector-timeout 4" in script and f"complete.{plan.run_id}" in script


def test_a_process_reads_the_completion_marker_of_its_own_launch_only(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = completion.marker_path(tmp_path, "job-1")
    env = {protocol.ENV_COMPLETE_FILE: str(path), protocol.ENV_RUN_ID: "job-1", protocol.ENV_LAUNCHER: "1",
           protocol.ENV_STORE: "127.0.0.1:1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    identity = ProcessIdentity.from_env()  # where a process learns the marker's path: its identity
    assert identity.complete_file == path
    assert not completion.completed(identity.complete_file, "job-1") and not completion.completed(None, "job-1")
    completion.mark_complete(path, "job-1")
    assert completion.completed(identity.complete_file, identity.run_id)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not completion.completed(path, "job-2"), "another launch's marker ends nothing"


def test_the_completion_marker_is_a_private_file_of_this_user_never_a_link(tmp_path: Path) -> None:
    """On 2c061fd the marker was read by path: a link to another file, or another user's file, holding the run id
    ended a process's launch (a late process then exited 0 without joining)."""
    path = completion.marker_path(tmp_path, "job-1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("job-1\n")
    elsewhere.chmod(0o600)
    path.symlink_to(elsewhere)
    assert not completion.marked(path, "job-1"), "a link is not the marker"
    path.unlink()
    path.write_text("job-1\n")
    path.chmod(0o644)
    assert not completion.marked(path, "job-1"), "readable by others: not written by mark_complete"
    path.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        assert not completion.marked(path, "job-1"), "another user's file"
        os.chown(path, 0, 0)
    assert completion.marked(path, "job-1")
    path.unlink()
    completion.mark_complete(path, "job-1")
    assert completion.marked(path, "job-1") and not completion.marked(path, "job-2")
