"""The launch's stores and the failover between them (:mod:`neighbor_ckpt.inprocess.stores`), against real store
host processes (``python -m neighbor_ckpt.inprocess.store_host``): SIGKILL, SIGSTOP, the promotion, the fencing
look, every store lost; and the store list as text."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import pytest

import torch.distributed as dist

from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.inprocess.store_auth import new_token_file, read_token
from neighbor_ckpt.inprocess.stores import (CLIENT_THREAD, BoundedClient, StoreAddresses, StoreSet, StoresLost,
                                           StoreUnreachable, epoch_key, quiesce)
from tests.conftest import free_port

pytestmark = pytest.mark.multiproc


def test_the_store_list_parses_and_prints_as_the_launchers_pass_it() -> None:
    stores = StoreAddresses.parse("10.0.0.1:29651,[::1]:29652", "--store")
    assert stores.addresses == (("10.0.0.1", 29651), ("::1", 29652)) and len(stores) == 2
    assert stores.format() == "10.0.0.1:29651,::1:29652" and stores.describe(1) == "store 1 (::1:29652)"
    with pytest.raises(ConfigError, match="not HOST:PORT"):
        StoreAddresses.parse("10.0.0.1:29651,nohost", "--store")
    with pytest.raises(ConfigError, match="store epoch 2 is not an index of the 2 store"):
        StoreSet(stores, run_id="r", epoch=2)


@pytest.fixture()
def hosts(tmp_path: Path) -> Iterator[list[subprocess.Popen]]:
    procs = []
    for i in range(3):
        ready = tmp_path / f"ready{i}"
        procs.append(subprocess.Popen([sys.executable, "-m", "neighbor_ckpt.inprocess.store_host", "--host",
                                       "127.0.0.1", "--port", str(free_port()), "--ready", str(ready)],
                                      env={**os.environ, "TORCH_CPP_LOG_LEVEL": "error"}))
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert procs[-1].poll() is None and time.monotonic() < deadline, "the store host did not listen"
            time.sleep(0.05)
        procs[-1].port = int(ready.read_text().split()[1])  # type: ignore[attr-defined]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _set(procs: list[subprocess.Popen], **kw) -> StoreSet:  # noqa: ANN003
    """A client of the stores; ``voter=...`` for a launcher of a one-node launch (its own vote promotes a store),
    else a process (it never promotes)."""
    return StoreSet(StoreAddresses(tuple(("127.0.0.1", p.port) for p in procs)), run_id="r",  # type: ignore[attr-defined]
                    timeout_s=1.0, connect_timeout_s=5.0, **kw)


def test_a_killed_store_is_replaced_by_the_next_one_which_is_promoted_and_the_others_follow(
        hosts: list[subprocess.Popen]) -> None:
    a, b = _set(hosts, name="a", voter="node0"), _set(hosts, name="b")
    moves: list[tuple[int, int]] = []
    a.on_failover(lambda old, new, why: moves.append((old, new)))
    view = a.view("main", "job/0")
    view.set("k", "v")
    assert b.view("main", "job/0").get("k") == b"v"
    hosts[0].kill()
    hosts[0].wait()
    # (a `set` right after the host died can still land in the kernel's buffer: torch's client does not wait for
    # an answer to it; an operation that needs one notices)
    assert not view.check(["k"]), "fails over, then runs on store 1 (only what is written again is there)"
    view.set("k", "after")
    assert (a.epoch, moves) == (1, [(0, 1)])
    assert a.view("x", "").get(epoch_key("r")) == b"1", "store 1 is promoted with its own index"
    assert b.follow_newer() == 1 and b.epoch == 1, "a client that was elsewhere follows the promoted store"
    assert b.view("main", "job/0").get("k") == b"after"
    assert b.follow_newer() is None, "store 2 was not promoted: nothing to follow"


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (``T`` in /proc/<pid>/stat): the signal is queued by ``kill``, and
    a store thread running then can still answer one operation (seen once under a CPU burner)."""
    from neighbor_ckpt.cli.launch import _stopped

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while not _stopped(pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_stopped_store_is_left_within_the_timeout_and_never_used_again(hosts: list[subprocess.Popen]) -> None:
    a = _set(hosts, name="a", voter="node0")
    view = a.view("main", "job/0")
    view.set("k", "v")
    _stop(hosts[0].pid)
    try:
        t0 = time.monotonic()
        assert not view.check(["k"]), "the new store has only what is written again"
        took = time.monotonic() - t0
        assert a.epoch == 1 and took < 30, took  # bounded: torch's own client would wait for the host forever
    finally:
        os.kill(hosts[0].pid, signal.SIGCONT)
    assert a.follow_newer() is None and a.epoch == 1, "the resumed store 0 is never chosen again"


def test_no_store_answering_is_said_once(hosts: list[subprocess.Popen]) -> None:
    a = _set(hosts, name="a")
    a.view("main", "").set("k", "v")
    for p in hosts:
        p.kill()
        p.wait()
    with pytest.raises(StoresLost, match="no store of the 3 answers"):
        a.view("main", "").check(["k"])


def test_a_client_left_inside_a_stopped_store_is_retired_and_waited_for_until_its_host_goes(
        hosts: list[subprocess.Popen]) -> None:
    c = BoundedClient(("127.0.0.1", hosts[0].port), timeout_s=0.5, name="left")  # type: ignore[attr-defined]
    c.call("set", "k", "v")
    _stop(hosts[0].pid)
    try:
        with pytest.raises(StoreUnreachable, match="no answer to check"):
            c.call("check", ["k"])
        assert quiesce(0.3, [c]) == [f"{CLIENT_THREAD}-left (check)"], "still inside torch's client: said"
    finally:
        hosts[0].kill()  # the connection is reset: the operation comes back (an error) and the retired worker ends
        hosts[0].wait()
    assert quiesce(30, [c]) == []
    c._thread.join(timeout=30)  # noqa: SLF001
    assert not c.alive(), "a retired client's worker ends after the operation it was in"


def test_a_process_whose_client_is_inside_a_stopped_store_leaves_with_its_status_not_an_abort(
        hosts: list[subprocess.Popen], tmp_path: Path) -> None:
    """What the launcher's ``main`` does at its end (:func:`leave`): a worker still inside torch's client when the
    interpreter finalizes can abort the process (SIGABRT) the moment it comes back; ``leave`` exits with the
    launcher's own status instead, and says why."""
    port = hosts[0].port  # type: ignore[attr-defined]
    script = tmp_path / "leave.py"
    script.write_text(
        "import sys\n"
        "from neighbor_ckpt.inprocess.stores import BoundedClient, StoreUnreachable, leave\n"
        f"c = BoundedClient(('127.0.0.1', {port}), timeout_s=0.5, name='left')\n"
        "c.call('set', 'k', 'v')\n"
        # torch's own wait well past the caller's 0.5 s: the worker is surely still inside its client at leave()
        # (with both at 0.5 s, a loaded machine let it come back first: no race, whatever the load)
        "from datetime import timedelta\n"
        "c._store.set_timeout(timedelta(seconds=60))\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "try:\n"
        "    c.call('check', ['k'])\n"
        "except StoreUnreachable:\n"
        "    pass\n"
        "sys.exit(leave(7))\n")
    child = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "error"})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        os.kill(hosts[0].pid, signal.SIGSTOP)
        _, err = child.communicate("go\n", timeout=60)
    finally:
        os.kill(hosts[0].pid, signal.SIGCONT)
        child.kill()
    assert child.returncode == 7, err
    assert "exiting 7 without finalizing the interpreter" in err and "(check)" in err


@pytest.fixture()
def gated(tmp_path: Path) -> Iterator[tuple[list[subprocess.Popen], bytes, Path]]:
    """Two store hosts behind their gates (``--token-file``), their log in ``gate<i>.log``."""
    token_file = new_token_file(tmp_path / "store.token")
    procs = []
    for i in range(2):
        ready = tmp_path / f"ready{i}"
        log = open(tmp_path / f"gate{i}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "neighbor_ckpt.inprocess.store_host", "--host",
                                       "127.0.0.1", "--port", str(free_port()), "--ready", str(ready),
                                       "--token-file", str(token_file)],
                                      env={**os.environ, "TORCH_CPP_LOG_LEVEL": "error"}, stdout=log,
                                      stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert procs[-1].poll() is None and time.monotonic() < deadline, "the store host did not listen"
            time.sleep(0.05)
        procs[-1].port = int(ready.read_text().split()[1])  # type: ignore[attr-defined]
    yield procs, read_token(token_file), tmp_path
    for p in procs:
        p.kill()
        p.wait()


def test_the_holders_of_the_token_use_the_gated_stores_and_fail_over_between_them(
        gated: tuple[list[subprocess.Popen], bytes, Path]) -> None:
    procs, token, _ = gated
    a, b = _set(procs, name="a", token=token, voter="node0"), _set(procs, name="b", token=token)
    a.view("main", "job").set("k", "v")
    assert b.view("main", "job").get("k") == b"v"
    procs[0].kill()
    procs[0].wait()
    assert not a.view("main", "job").check(["k"]) and a.epoch == 1, "failed over to store 1, through its gate"
    assert b.follow_newer() == 1


def test_a_client_without_the_token_or_with_another_jobs_is_refused_and_logged(
        gated: tuple[list[subprocess.Popen], bytes, Path]) -> None:
    procs, token, tmp_path = gated
    port = procs[0].port  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError):  # torch's own client: no token to show
        dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, use_libuv=True,
                      timeout=timedelta(seconds=3)).get("k")
    stranger = StoreSet(StoreAddresses((("127.0.0.1", port),)), run_id="r", timeout_s=1.0, connect_timeout_s=3.0,
                        name="stranger", token=os.urandom(32))
    with pytest.raises(StoresLost):
        stranger.view("main", "").check(["k"])
    stranger.close()
    deadline = time.monotonic() + 30
    # one line per address per minute (the gate's refusal log): the first refusal is said, the next one counted
    while (tmp_path / "gate0.log").read_text().count("refused a client from 127.0.0.1") < 1:
        assert time.monotonic() < deadline, (tmp_path / "gate0.log").read_text()
        time.sleep(0.2)
    assert procs[0].poll() is None, "the store host goes on"
    assert _set(procs[:1], name="holder", token=token).view("main", "").check(["k"]) is False
