"""The majority rules with real processes on a real store host (:mod:`neighbor_ckpt.inprocess.quorum`): three
processes of three nodes, each with the engine's monitor and cut-off lease. A process left alone with the store (the
two others stopped: from where it stands, a cut) declares nobody dead and cuts itself off with one line and its own
status; one silent process of three is declared dead by the two others, who go on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch.distributed as dist
from datetime import timedelta

from neighbor_ckpt.inprocess import protocol
from neighbor_ckpt.inprocess.generation import parse_dead
from neighbor_ckpt.inprocess.quorum import CUT_OFF
from tests.conftest import free_port

pytestmark = pytest.mark.multiproc

MEMBER = """
import json, os, sys, time
from neighbor_ckpt.inprocess.generation import GenerationStore
from neighbor_ckpt.inprocess.monitor import FailureListener, Monitor
from neighbor_ckpt.inprocess.quorum import LeaseGuard, MajorityLease, cut_off_lease_s, guard_times
from neighbor_ckpt.inprocess.stores import StoreAddresses, StoreSet
import logging
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
port, p = int(sys.argv[1]), int(sys.argv[2])
stores = StoreSet(StoreAddresses((("127.0.0.1", port),)), run_id="r", timeout_s=5.0, name=f"process {p}")
gens = GenerationStore(stores.view("monitor", "job/0"), process=p)
gens.store.set(f"proc/{p}", json.dumps({"pid": os.getpid(), "node": f"node{p}", "start": 1}))
members = frozenset({0, 1, 2})
listener = FailureListener(GenerationStore(stores.view("listener", "job/0"), process=p), on_failure=lambda r: None)
listener.start()
lease = MajorityLease(cut_off_lease_s(2.0, 0.2), me=p, now=time.monotonic())
monitor = Monitor(gens, state=lambda: (0, members, None, False), progress=lambda: (0, None, "idle"),
                  listener=listener, interval_s=0.2, timeout_s=2.0, hang_timeout_s=None, stores=stores, lease=lease)
doubt, grace = guard_times(stores, 2.0)
guard = LeaseGuard(lease, answered_at=lambda: monitor.answered_at, epoch=lambda: stores.epoch, name=f"process {p}",
                   doubt_s=doubt, grace_s=grace, lock=monitor.lease_lock,
                   last_look=GenerationStore(stores.view("lease", "job/0"), process=p).complete)
monitor.start()
guard.start()
while not lease.armed:
    time.sleep(0.05)
print("armed", flush=True)
time.sleep(600)
"""


@pytest.fixture()
def members(tmp_path: Path) -> Iterator[tuple[dist.TCPStore, list[subprocess.Popen]]]:
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True,
                           timeout=timedelta(seconds=30))
    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    procs = [subprocess.Popen([sys.executable, str(script), str(port), str(p)], stdout=subprocess.PIPE,
                              stderr=open(tmp_path / f"member{p}.log", "w"), text=True,
                              env={**os.environ, "TORCH_CPP_LOG_LEVEL": "error"}) for p in range(3)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "armed", "a member did not start"
        yield dist.PrefixStore("job/0", master), procs  # the same keys as the members' views
    finally:
        for proc in procs:
            os.kill(proc.pid, signal.SIGCONT) if proc.poll() is None else None
            proc.kill()
            proc.wait()


def _log(tmp_path: Path, p: int) -> str:
    return (tmp_path / f"member{p}.log").read_text()


def test_a_process_left_alone_with_the_store_declares_nobody_and_cuts_itself_off(
        members: tuple[dist.TCPStore, list[subprocess.Popen]], tmp_path: Path) -> None:
    store, procs = members
    assert store.check(["hb/0"]), "the test reads the members' keys"
    for proc in procs[1:]:
        os.kill(proc.pid, signal.SIGSTOP)
    code = procs[0].wait(timeout=120)
    log = _log(tmp_path, 0)
    assert code == protocol.EXIT_CUT_OFF, log
    assert log.count(CUT_OFF) == 1 and "while the store answers" in log, log
    dead = store.get("dead") if store.check(["dead"]) else None
    assert dead is None and not store.check(["gen/0/failed"]), ("nobody declared: nothing written", dead, log)


def test_one_silent_process_of_three_is_declared_by_the_two_others_who_go_on(
        members: tuple[dist.TCPStore, list[subprocess.Popen]], tmp_path: Path) -> None:
    store, procs = members
    os.kill(procs[2].pid, signal.SIGSTOP)
    deadline = time.monotonic() + 120
    while not (store.check(["dead"]) and 2 in parse_dead(store.get("dead"))):
        assert time.monotonic() < deadline, _log(tmp_path, 0)
        time.sleep(0.1)
    assert parse_dead(store.get("dead")).keys() == {2} and store.check(["gen/0/failed"])
    assert procs[0].poll() is None and procs[1].poll() is None, (_log(tmp_path, 0), _log(tmp_path, 1))
    assert CUT_OFF not in _log(tmp_path, 0) + _log(tmp_path, 1)
