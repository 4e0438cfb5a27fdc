"""Another user of the node gets nothing from a running in-process launch's sockets, shown with a real second Unix
user (``useradd``, as in tests/unit/test_shared_node.py; CI runs as root, elsewhere this is skipped).

The launch (real store hosts, launchers, megatron-core ranks, a hot spare: tests/e2e/inprocess_launch.py) holds its
ranks before a step; meanwhile the test finds every listening socket of every process of the launch (its TCP
listeners from ``/proc/<pid>/net/tcp{,6}`` and its Unix listeners from ``/proc/<pid>/net/unix``, matched with the
process's descriptors), leaving out only the ranks' gloo listeners (torch's, out of scope; the ranks publish them in
the store, where the test reads them with the job's token). The other user connects to each one (the system's
Python, tools/store_probe.py speaking torch's store protocol) and tries to read a key the test wrote, to write
``complete``, and to write ``dead`` plus ``proc/<i>`` naming a process of its own and one of the job's. Every attempt
is refused: the store behind each gate never completes the connection (sealed), a tunnel closes it unanswered, a gate
asks for the token. Then the ranks go on: the job finishes bit for bit the failure-free run, no failure, no process
killed, the other user's process still alive.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunResult, assert_same_training
from tests.e2e.inprocess_launch import assert_no_orphans, failures, launch_inprocess, launcher_exits
from tests.unit.test_shared_node import OTHER, other_user  # noqa: F401 - the fixture

pytestmark = pytest.mark.e2e

ACTIVE = 4
STEPS = 10  # the session's failure-free in-process launch (tests/e2e/conftest.py) is what it is compared with
HOLD_AT_STEP = 3
ENV = {"STEPS": STEPS, "FAULT": "none", "HANG_TIMEOUT": 600}
PROBE = Path(__file__).resolve().parents[2] / "tools" / "store_probe.py"
TCP_LISTEN = "0A"
SO_ACCEPTCON = 0x10000


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)


def launch_processes(out: Path) -> dict[int, str]:
    """pid -> command line of every process of the launch (they all carry its ``OUT_DIR``; the test starts them
    cold, so each has the launch's environment)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _environ(int(entry.name)).get("OUT_DIR") == str(out):
            try:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
            except OSError:
                continue
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def _address(hexaddr: str) -> tuple[str, int]:
    import socket
    import struct

    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntoa(struct.pack("=I", int(host, 16))), int(port, 16)
    words = struct.pack("=4I", *(int(host[i:i + 8], 16) for i in range(0, 32, 8)))
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listeners(pid: int) -> tuple[set[tuple[str, int]], set[str]]:
    """The TCP listeners (address, port) and the named Unix listeners (path, ``@name`` when abstract) of ``pid``."""
    inodes = _socket_inodes(pid)
    tcp = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == TCP_LISTEN and int(parts[9]) in inodes:
                tcp.add(_address(parts[1]))
    unix = set()
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and int(parts[6]) in inodes and int(parts[3], 16) & SO_ACCEPTCON:
            unix.add(parts[7])
    return tcp, unix


def _reachable(address: tuple[str, int]) -> list[Any]:
    host, port = address
    return ["127.0.0.1" if host == "0.0.0.0" else "::1" if host == "::" else host, port]


class JobClient:
    """The test's own client of the launch's primary store, with the job's token (as root: the launch's user)."""

    def __init__(self, env: dict[str, str], run_id: str) -> None:
        import torch.distributed as dist

        from neighbor_ckpt.inprocess.protocol import ENV_STORE, ENV_STORE_TOKEN, launch_prefix
        from neighbor_ckpt.inprocess.store_auth import read_token, tunnel_address

        host, _, port = env[ENV_STORE].split(",")[0].rpartition(":")
        local = tunnel_address((host, int(port)), read_token(Path(env[ENV_STORE_TOKEN])))
        base = dist.TCPStore(local[0], local[1], is_master=False, wait_for_workers=False, use_libuv=True,
                             timeout=timedelta(seconds=60))
        self.prefix = launch_prefix(run_id, 0)
        self.store = dist.PrefixStore(self.prefix, base)

    def get(self, key: str) -> bytes | None:
        return self.store.get(key) if self.store.check([key]) else None


def _other_users_process(uid: int) -> tuple[subprocess.Popen, int]:
    """A process of the other user (``sleep``, via runuser) and its pid (runuser's child)."""
    import psutil

    runner = subprocess.Popen(["runuser", "-u", OTHER, "--", "sleep", "900"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = [k for k in psutil.Process(runner.pid).children() if k.uids().real == uid]
        if kids:
            return runner, kids[0].pid
        time.sleep(0.05)
    runner.kill()
    pytest.fail("the other user's process did not start")


@pytest.mark.cold  # every process of the launch a descendant with its environment (a warm fork is the zygote's)
def test_another_user_gets_nothing_from_any_socket_of_a_running_launch(  # noqa: PLR0915 - one scenario
        other_user: Any, inprocess_baseline: RunResult, tmp_path: Path) -> None:  # noqa: F811 - the fixture
    from neighbor_ckpt.runtime.procs import process_start

    release = tmp_path / "release"
    out = tmp_path / "out"
    result: dict[str, RunResult] = {}
    launch = threading.Thread(target=lambda: result.setdefault("res", launch_inprocess(
        tmp_path, HOLD_AT_STEP=HOLD_AT_STEP, HOLD_FILE=release, **ENV)))
    launch.start()
    runner, theirs = _other_users_process(other_user.pw_uid)
    try:
        held = [out / f"held.rank{r}.json" for r in range(ACTIVE)]
        while not all(p.exists() for p in held) and launch.is_alive():  # the ranks hold (the wait is bounded there)
            time.sleep(0.1)
        assert launch.is_alive(), "the launch ended before its ranks held"
        pids = launch_processes(out)
        rank_pid = {r: json.loads(p.read_text())["pid"] for r, p in enumerate(held)}
        assert set(rank_pid.values()) <= set(pids), (rank_pid, pids)
        env = _environ(rank_pid[0])
        job = JobClient(env, f"inproc-{tmp_path.name}")
        secret = f"secret-{os.urandom(8).hex()}"
        job.store.set("probe/secret", secret)
        generation = int(job.get("gen") or b"0")
        gloo = set()
        for p in range(ACTIVE):
            text = (job.get(f"gen/{generation}/listen/{p}") or b"").decode()
            gloo |= {int(e.rpartition(":")[2]) for e in text.split(",") if e}
        assert gloo, "the ranks published their gloo listeners"
        tcp: dict[tuple[str, int], set[int]] = {}
        unix: dict[str, set[int]] = {}
        for pid in pids:
            try:
                t, u = listeners(pid)
            except OSError:
                continue  # gone meanwhile (a helper process)
            for a in t:
                tcp.setdefault(a, set()).add(pid)
            for a in u:
                unix.setdefault(a, set()).add(pid)
        probed = {a: owners for a, owners in tcp.items() if a[1] not in gloo}
        # what must be among them: every store host's gate and sealed store, every process's tunnels
        hosts = [pid for pid, cmd in pids.items() if "neighbor_ckpt.inprocess.store_host" in cmd]
        assert len(hosts) == ACTIVE + 1, pids  # one store host per node, the spare's node too
        for pid in hosts:  # its gate and its sealed store
            assert sum(pid in owners for owners in probed.values()) >= 2, (pid, pids[pid], probed)
        for pid in rank_pid.values():  # its tunnel(s)
            assert any(pid in owners for owners in probed.values()), (pid, pids[pid], probed)
        records = {"1": {"pid": rank_pid[1], "node": "node1", "start": process_start(rank_pid[1])},
                   str(ACTIVE): {"pid": theirs, "node": f"node{ACTIVE}", "start": process_start(theirs)}}
        spec = {"prefix": f"/{job.prefix}/", "secret_key": "probe/secret", "records": records, "timeout_s": 3.0,
                "tcp": [_reachable(a) for a in sorted(probed)], "unix": sorted(unix)}
        probe = subprocess.run(["runuser", "-u", OTHER, "--", "/usr/bin/python3", "-c", PROBE.read_text()],
                               input=json.dumps(spec), capture_output=True, text=True, timeout=600)
        assert probe.returncode == 0, probe.stderr
        attempts = [json.loads(line) for line in probe.stdout.splitlines()]
        assert len(attempts) == 4 * (len(probed) + len(unix)), (len(attempts), probed, unix)
        served = []
        for a in attempts:
            got = bytes.fromhex(a["received"])
            gate_asks = got.startswith(b"NCKPT-STORE-") and len(got) == 30  # the gate's challenge, then closed
            if got and not gate_asks:
                served.append(a)
            assert secret.encode() not in got
        assert served == [], f"attempts that a socket of the launch answered: {served}"
        assert job.get("complete") is None and job.get("dead") is None, "nothing the other user wrote arrived"
        kinds: dict[str, set[str]] = {}
        for a in attempts:
            kind = "never connected" if not a["connected"] else "asked for the token" if a["received"] else "closed"
            kinds.setdefault(kind, set()).add(json.dumps(a["target"]))
        print(f"\n[shared node] {len(probed)} TCP listeners and {len(unix)} Unix listeners of {len(pids)} processes "
              f"probed ({len(gloo)} gloo listeners left out), {len(attempts)} attempts, all refused: "
              + ", ".join(f"{kind} ({len(targets)} listeners)" for kind, targets in sorted(kinds.items())))
    finally:
        release.touch()
        launch.join()
        alive = runner.poll() is None and Path(f"/proc/{theirs}").exists()
        runner.kill()
        runner.wait()
    res = result["res"]
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert failures(res) == [], failures(res)
    assert set(launcher_exits(res).values()) == {0}, launcher_exits(res)
    assert "declared dead" not in res.log and "killed by signal" not in res.log
    assert alive, "the other user's process was not signalled"
    events = {int(p.name[len("events.initial"):-len(".json")]): json.loads(p.read_text())
              for p in out.glob("events.initial*.json")}
    assert sorted(events) == list(range(ACTIVE + 1)), sorted(events)  # no process replaced
    assert {e["code"] for e in events.values()} == {0}, {r: e["code"] for r, e in events.items()}
    assert {r: events[r]["pid"] for r in range(ACTIVE)} == rank_pid, "the ranks that held are the ones that finished"
    assert "store tunnel" in res.log and "refused a connection" in res.log, "the tunnels logged the refusals"
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
