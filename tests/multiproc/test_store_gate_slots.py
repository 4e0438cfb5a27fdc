"""Another Unix user cannot starve a store host's gate (issue 53, item 5): it holds 256 connections on a real store host
(``python -m neighbor_ckpt.inprocess.store_host --token-file ...``), each dripping a byte of its answer every 4 s and
reconnecting when dropped, while the job's own client (this user, holding the token, through its tunnel) connects and
completes store operations; and the other user's handshakes are closed at their deadline, however they drip.

The other user is made for this module with ``useradd`` (no home, no login shell: ``/usr/sbin/nologin``), runs the
system's Python (standard library only) with ``runuser``, and is removed afterwards (``userdel``). CI runs as root;
elsewhere this is skipped, saying why. The gate's rule: :mod:`neighbor_ckpt.inprocess.store_auth`.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import pytest

import torch.distributed as dist

from neighbor_ckpt.inprocess.store_auth import new_token_file, read_token, tunnel_address
from tests.conftest import free_port
from tests.other_user_drip import CONNECTIONS, Dripper, nologin_user  # noqa: F401 - the fixture

pytestmark = pytest.mark.multiproc

WITHIN_S = 30.0
"""How long the job's client may take to be served (generous: no performance is measured)."""


@pytest.fixture()
def store_host(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int, bytes, Path]]:
    """A real store host behind its gate (``--token-file``) on 127.0.0.1; its log in ``host.log``."""
    token_file = new_token_file(tmp_path / "store.token")
    ready, log_path = tmp_path / "ready", tmp_path / "host.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "neighbor_ckpt.inprocess.store_host", "--host", "127.0.0.1",
                                 "--port", str(free_port()), "--ready", str(ready), "--token-file", str(token_file)],
                                env={**os.environ, "TORCH_CPP_LOG_LEVEL": "error"}, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        yield proc, int(ready.read_text().split()[1]), read_token(token_file), log_path
    finally:
        proc.kill()
        proc.wait()


def _served(port: int, token: bytes, within_s: float) -> tuple[bool, list[str]]:
    """Whether the job's own client (torch's TCPStore client, through this process's tunnel, as a rank's) completes
    ``set``, ``get`` and ``add`` within ``within_s``, trying again after each failure; and the failures."""
    host, tport = tunnel_address(("127.0.0.1", port), token)
    failures: list[str] = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            store = dist.TCPStore(host, tport, is_master=False, wait_for_workers=False, use_libuv=True,
                                  timeout=timedelta(seconds=max(1.0, min(5.0, deadline - time.monotonic()))))
            key = f"job/{time.monotonic_ns()}"
            store.set(key, "mine")
            if store.get(key) == b"mine" and store.add(key + "/n", 1) == 1:
                return True, failures
            failures.append("the store answered something else")
        except (RuntimeError, OSError) as e:  # torch's DistStoreError is a RuntimeError
            failures.append(str(e).splitlines()[0][:200])
        time.sleep(0.2)
    return False, failures


def test_another_user_dripping_on_256_connections_does_not_starve_the_jobs_client_at_the_gate(
        nologin_user: pwd.struct_passwd, store_host: tuple[subprocess.Popen, int, bytes, Path]) -> None:
    """On the release before, the other user's first 64 connections took every handshake slot and each byte kept them
    there (a timeout per ``recv``): the job's client was refused for as long as the test waited."""
    proc, port, token, log_path = store_host
    dripper = Dripper(nologin_user.pw_name, port)
    try:
        # the other user's connections are all made, some are in a handshake, the rest refused (the slots they may
        # have are taken): the gate is as full as this user can make it
        before = dripper.wait_for("all connections made and the gate full for this user",
                                  lambda s: s["connects"] >= CONNECTIONS and s["challenged"] >= 1 and s["dropped"] >= 1)
        assert before["uid"] == nologin_user.pw_uid
        ok, failures = _served(port, token, WITHIN_S)
        assert ok, f"the job's client was starved by the other user: {failures[-5:]} ({dripper.last})"
        # the other user's handshakes end at their deadline, however they drip (one byte every 4 s each)
        dripper.wait_for("a dripping handshake closed by the gate", lambda s: s["dropped_after_drips"] >= 1,
                         within_s=WITHIN_S)
        assert dripper.proc.poll() is None, "the other user's program goes on"
        ok, failures = _served(port, token, WITHIN_S)
        assert ok, f"the job's client was starved by the other user later on: {failures[-5:]}"
        assert proc.poll() is None, "the store host goes on"
        from neighbor_ckpt.inprocess.store_auth import OTHER_USERS_HANDSHAKES

        text = log_path.read_text()
        assert (f"(uid {nologin_user.pw_uid}): the {OTHER_USERS_HANDSHAKES} handshakes of this node's other users "
                "already under way") in text, text[-3000:]
    finally:
        dripper.stop()
