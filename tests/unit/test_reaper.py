"""Leftover processes of a rank's previous process are stopped on the restart, and nothing else ever is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neighbor_ckpt.runtime import procs, reaper

# A "worker" that leads its own session (as torchrun starts them) and leaves a helper in its process group.
WORKER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); " \
         "time.sleep(120)"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def worker():
    proc = subprocess.Popen([sys.executable, "-c", WORKER], start_new_session=True)
    deadline = time.monotonic() + 30
    while len(procs.group_members(proc.pid)) < 2:
        assert time.monotonic() < deadline, "the helper did not start"
        time.sleep(0.05)
    yield proc
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _record_of(proc: subprocess.Popen, tmp_path: Path, **changes) -> Path:
    rec = {"pid": proc.pid, "pgid": proc.pid, "start": procs.process_start(proc.pid), "boot_id": procs.boot_id(),
           **changes}
    (tmp_path / reaper.PROCESS_FILE).write_text(json.dumps(rec))
    return tmp_path


def test_the_orphaned_group_of_a_dead_previous_process_is_stopped(worker, tmp_path: Path) -> None:
    d = _record_of(worker, tmp_path)
    helper = [p for p in procs.group_members(worker.pid) if p != worker.pid][0]
    worker.kill()
    worker.wait()
    assert _alive(helper)
    assert reaper.reap_previous(d, rank=3) == 1
    deadline = time.monotonic() + 120
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(helper)


def test_a_previous_process_that_still_runs_is_left_alone(worker, tmp_path: Path) -> None:
    assert reaper.reap_previous(_record_of(worker, tmp_path), rank=0) == 0
    assert _alive(worker.pid)


def test_a_reused_pid_is_never_taken_for_the_previous_process(worker, tmp_path: Path) -> None:
    # The record names a process that died long ago; its pid now belongs to a live group leader (the worker, with
    # another start time): that group is someone else's, e.g. another rank's new worker.
    earlier = procs.process_start(worker.pid) - 0.01
    assert reaper.reap_previous(_record_of(worker, tmp_path, start=earlier), rank=0) == 0
    assert len(procs.group_members(worker.pid)) == 2


@pytest.mark.parametrize("change", [{"boot_id": "another-boot"}, {"pgid": 1}, {"pid": 999999}])
def test_a_record_of_another_boot_or_a_process_that_did_not_lead_its_group_is_left_alone(
        worker, tmp_path: Path, change: dict) -> None:
    d = _record_of(worker, tmp_path, **change)
    worker.kill()
    worker.wait()
    assert reaper.reap_previous(d, rank=0) == 0
    assert len(procs.group_members(worker.pid)) == 1  # the helper is still there


def test_no_or_an_unreadable_record_is_nothing_to_do_and_record_writes_this_process(tmp_path: Path) -> None:
    assert reaper.reap_previous(tmp_path, rank=0) == 0
    (tmp_path / reaper.PROCESS_FILE).write_text("{not json")
    assert reaper.reap_previous(tmp_path, rank=0) == 0
    reaper.record(tmp_path)
    path = tmp_path / reaper.PROCESS_FILE
    assert json.loads(path.read_text()) == reaper.this_process()
    assert path.stat().st_mode & 0o777 == 0o600
    assert reaper.reap_previous(tmp_path, rank=0) == 0  # this very process


def test_a_process_start_is_the_same_number_wherever_it_is_read_and_none_once_the_process_is_gone() -> None:
    # The child records itself (as a rank does); this process checks it (as the next process of the rank does).
    root = str(Path(reaper.__file__).resolve().parents[2])
    child = "from neighbor_ckpt.runtime.procs import process_start; import time; print(json.dumps(process_start()), " \
            "flush=True); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", "import json; " + child], stdout=subprocess.PIPE, text=True,
                            cwd=root, env=dict(os.environ, PYTHONPATH=root))
    try:
        recorded = json.loads(proc.stdout.readline())
        assert recorded is not None and procs.process_start(proc.pid) == recorded
    finally:
        proc.kill()
        proc.wait()
    assert procs.process_start(proc.pid) is None
