"""Tier 2: on the restart path, another Unix user who writes into torchrun's store gets no process killed
(issue 53, item 6).

torchrun's store listens on every interface and authenticates nobody; the failure detector of a rank reads the
``info/<rank>`` record of a failed rank of its node there and SIGKILLs the process it names. Here a second Unix user
(made with ``useradd -s /usr/sbin/nologin``, removed afterwards; CI runs as root, elsewhere this is skipped), with
the system's Python and the standard library only, writes the records of ranks 2 and 3 into a c10d TCPStore, naming
two processes of the job's user that are not part of the job: a ``sleep`` without the run tag (a shell, an editor)
and one with another launch's tag. Each record carries the process's true node and start time (the forger reads
them from ``/proc``), so the node and start-time checks pass. Rank 0 is a process of the launch (a ``sleep`` with
this launch's tag, its record written by the job). Rank 1's detector, a real :class:`FailureDetector` thread in a
process of its own carrying the launch's tag, finds ranks 0, 2 and 3 silent and kills what it may: rank 0's process
dies (SIGKILL), the two the forger named live, and the detector says why in one line each.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from typing import Iterator

import pytest
import torch.distributed as dist

from neighbor_ckpt.runtime.detector import EXIT_FAILURE_DETECTED, os_instance
from neighbor_ckpt.runtime.procs import RUN_TAG_ENV, new_run_tag, process_start
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.multiproc

SYSTEM_PYTHON = "/usr/bin/python3"
PREFIX = "neighbor_ckpt/job/0"

FORGER = r"""
import json, os, socket, struct, sys

host, port = sys.argv[1], int(sys.argv[2])
boot = open("/proc/sys/kernel/random/boot_id").read().strip()
tick = os.sysconf("SC_CLK_TCK")


def s(b):
    return struct.pack("=Q", len(b)) + b


for arg in sys.argv[3:]:
    key, pid = arg.rsplit("=", 1)
    with open(f"/proc/{pid}/stat") as f:  # world-readable: the start time of anyone's process
        start = int(f.read().rpartition(")")[2].split()[19]) / tick
    record = json.dumps({"pid": int(pid), "node": f"{socket.gethostname()}/{boot}", "start": start}).encode()
    with socket.create_connection((host, port), timeout=10) as c:  # torch's TCPStore protocol: VALIDATE, SET, CHECK
        c.sendall(bytes([0]) + struct.pack("=I", 0x3C85F7CE) + bytes([1]) + s(key.encode()) + s(record)
                  + bytes([5]) + struct.pack("=Q", 1) + s(key.encode()))
        c.recv(64)
print(json.dumps({"uid": os.getuid()}))
"""

DETECTOR = r"""
import logging, os, sys, time
from datetime import timedelta

import torch.distributed as dist

from neighbor_ckpt.runtime.detector import FailureDetector, os_instance

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
det = FailureDetector(store, prefix=sys.argv[2], rank=1, world_size=4, local_ranks=(0, 1, 2, 3), node=os_instance(),
                      progress=lambda: (0, None, "startup"), on_failure=lambda f: None, interval_s=0.1, timeout_s=1.0)
det.start()
time.sleep(120)  # the detector leaves with os._exit(75) long before
sys.exit(3)
"""


@pytest.fixture
def other_user() -> Iterator[pwd.struct_passwd]:
    """A fresh Unix user without a shell (``useradd -s /usr/sbin/nologin``), removed afterwards with its group."""
    if os.geteuid() != 0:
        pytest.skip("making a second Unix user (useradd) and running a process as it needs root; CI runs as root")
    nologin = shutil.which("nologin") or "/usr/sbin/nologin"
    missing = [t for t in ("useradd", "userdel") if shutil.which(t) is None]
    missing += [p for p in (nologin, SYSTEM_PYTHON) if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    name = f"nckpt_t{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", nologin, name],
                          capture_output=True, text=True, timeout=60)
    if made.returncode != 0:
        pytest.fail(f"useradd {name}: {made.stderr.strip() or made.returncode}")
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)
        subprocess.run(["groupdel", name], capture_output=True, timeout=60)  # where userdel kept it


def _sleeper(tag: str | None) -> subprocess.Popen[bytes]:
    """A process of the job's user (``sleep``), with run tag ``tag`` (None: none), once its ``exec`` is through."""
    env = {k: v for k, v in os.environ.items() if k != RUN_TAG_ENV}
    if tag is not None:
        env[RUN_TAG_ENV] = tag
    p = subprocess.Popen(["sleep", "300"], env=env)
    for _ in range(3000):  # Popen may return before the kernel set the new environment up (it reads empty)
        with open(f"/proc/{p.pid}/environ", "rb") as f:
            if f.read():
                return p
        time.sleep(0.01)
    raise AssertionError(f"process {p.pid} did not get through exec")


def test_another_user_writing_into_torchruns_store_gets_no_process_of_the_job_user_killed(
        other_user: pwd.struct_passwd) -> None:
    tag = new_run_tag()
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    rank0, untagged, other_launch = _sleeper(tag), _sleeper(None), _sleeper(new_run_tag())
    try:
        node = os_instance()
        server.set(f"{PREFIX}/info/0", json.dumps({"pid": rank0.pid, "node": node, "start": process_start(rank0.pid)}))
        for r in (0, 2, 3):
            server.set(f"{PREFIX}/hb/{r}", "1 0 3 forward")  # one beat, then silence

        forged = subprocess.run(
            [SYSTEM_PYTHON, "-I", "-c", FORGER, "127.0.0.1", str(server.port),
             f"/{PREFIX}/info/2={untagged.pid}", f"/{PREFIX}/info/3={other_launch.pid}"],  # torch's clients add "/"
            user=other_user.pw_uid, group=other_user.pw_gid, extra_groups=[], cwd="/",
            env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
        assert forged.returncode == 0, forged.stderr
        assert json.loads(forged.stdout.splitlines()[-1])["uid"] == other_user.pw_uid
        for rank, victim in ((2, untagged), (3, other_launch)):  # what the old checks (node, start time) accepted
            assert json.loads(server.get(f"{PREFIX}/info/{rank}")) == {
                "pid": victim.pid, "node": node, "start": process_start(victim.pid)}, "the forged record landed"

        detector = subprocess.run([sys.executable, "-c", DETECTOR, str(server.port), PREFIX],
                                  env={**os.environ, RUN_TAG_ENV: tag, "PYTHONPATH": str(REPO)},
                                  capture_output=True, text=True, timeout=150)
        log = detector.stderr
        assert detector.returncode == EXIT_FAILURE_DETECTED, log[-3000:]
        assert "rank(s) [0, 2, 3] sent no heartbeat" in log, log[-3000:]
        assert rank0.wait(60) == -signal.SIGKILL, f"the launch's own silent rank is killed\n{log[-3000:]}"
        assert untagged.poll() is None, f"a process of the user without the run tag lives\n{log[-3000:]}"
        assert other_launch.poll() is None, f"another launch's process lives\n{log[-3000:]}"
        for victim, why in ((untagged, "carries no run tag"), (other_launch, "another run tag")):
            lines = [ln for ln in log.splitlines() if f"pid {victim.pid}, not signalled" in ln]
            assert len(lines) == 1 and why in lines[0], log[-3000:]
    finally:
        for p in (rank0, untagged, other_launch):
            p.kill()
            p.wait()
