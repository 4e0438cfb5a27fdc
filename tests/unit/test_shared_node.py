"""What another local user can do to a job's host store, shown with a real second Unix user (``useradd``).

CI runs as root: the ``other_user`` fixture makes the user ``nckpt_other`` (idempotent: reused when it exists) and
runs commands as that user with ``runuser``. Elsewhere these tests are skipped, saying why. What they show
(docs/shared-nodes.md):

* a store root another user made (even shared and sticky, mode 1777) is refused, naming its owner and the setting;
  the default root is per user and the job runs there;
* another user cannot read a slot, a journal or the store token file;
* a link, or another user's file, planted where a slot or a journal is opened is refused: nothing is followed,
  nothing is loaded.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import torch

from neighbor_ckpt.config import DEFAULT_STORE_DIR, NeighborCkptConfig, expand_store_dir
from neighbor_ckpt.errors import StoreDirError
from neighbor_ckpt.inprocess.store_auth import new_token_file
from neighbor_ckpt.recovery.journal import RestoreJournal
from neighbor_ckpt.snapshot.slot import SlotFile
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore
from neighbor_ckpt.snapshot.userdir import private_user_dir

OTHER = "nckpt_other"


@pytest.fixture(scope="module")
def other_user() -> Iterator[pwd.struct_passwd]:
    """The local user ``nckpt_other``: made with ``useradd`` if missing, with no login shell (commands run as it through
    ``runuser``, which needs none), and removed again at the end of the module when this run made it."""
    if os.geteuid() != 0:
        pytest.skip("making a second Unix user (useradd) and running commands as it (runuser) needs root; CI runs "
                    "as root")
    if shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("useradd / runuser are not installed")
    try:
        yield pwd.getpwnam(OTHER)
        return
    except KeyError:
        pass
    proc = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER], capture_output=True,
                          text=True)
    if proc.returncode not in (0, 9):  # 9: made meanwhile by a test run beside this one
        pytest.fail(f"useradd {OTHER} failed: {proc.stderr}")
    try:
        yield pwd.getpwnam(OTHER)
    finally:
        if proc.returncode == 0:  # made here: removed here (its processes are the tests', ended by now)
            subprocess.run(["pkill", "-KILL", "-u", OTHER], capture_output=True)
            subprocess.run(["userdel", OTHER], capture_output=True)


def as_other(*cmd: str) -> subprocess.CompletedProcess[str]:
    """``cmd`` run as ``nckpt_other`` (runuser), its output captured."""
    return subprocess.run(["runuser", "-u", OTHER, "--", *cmd], capture_output=True, text=True, timeout=60)


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A fresh directory in /dev/shm, traversable by everyone (0755), removed afterwards: a store root made there is
    reached by the other user's path lookups, so only the store's own modes keep it out."""
    base = Path("/dev/shm") / f"nckpt-test-{uuid.uuid4().hex[:8]}"
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _commit_slot(store: HostStore, index: int, payload: bytes, iteration: int) -> Path:
    slot = store.ensure(ROLE_OWN, index, header_cap=4096, payload_cap=len(payload), extras_cap=4096)
    slot.invalidate()
    slot.payload[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    store.commit_image(slot, ROLE_OWN, iteration=iteration, layout="L", payload_nbytes=len(payload),
                       extras_text="{}", extras_tensors=[], meta={})
    return store.path(ROLE_OWN, index)


def test_a_store_root_another_user_made_is_refused_naming_owner_and_setting(other_user: pwd.struct_passwd,
                                                                            shm_root: Path) -> None:
    root = Path("/dev/shm") / f"nckpt-shared-{uuid.uuid4().hex[:8]}"  # made by the other user, in /dev/shm itself
    try:
        made = as_other("mkdir", "-m", "1777", str(root))
        assert made.returncode == 0, made.stderr
        assert os.lstat(root).st_uid == other_user.pw_uid and (os.lstat(root).st_mode & 0o7777) == 0o1777
        with pytest.raises(StoreDirError) as err:
            HostStore(root, job_id="job", rank=0)
        assert OTHER in str(err.value) and "neighbor_ckpt.store.dir" in str(err.value), err.value
        assert list(root.iterdir()) == [], "nothing was made in it"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_default_root_is_per_user_and_private_and_a_job_runs_there(other_user: pwd.struct_passwd) -> None:
    root = expand_store_dir(DEFAULT_STORE_DIR)
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert root == Path(f"/dev/shm/neighbor_ckpt-{me}") == NeighborCkptConfig().resolved_store_dir()
    job = f"shared-node-{uuid.uuid4().hex[:8]}"
    store = HostStore(root, job_id=job, rank=0)
    try:
        _commit_slot(store, 0, b"x" * 4096, iteration=3)
        assert [r.header.iteration for r in store.committed(ROLE_OWN, verify=True)] == [3]
        assert os.lstat(root).st_uid == os.geteuid() and (os.lstat(root).st_mode & 0o077) == 0
        assert as_other("ls", str(root)).returncode != 0, "another user cannot even list the default root"
    finally:
        store.destroy()


def test_another_user_cannot_read_a_slot_a_journal_or_the_token_file(other_user: pwd.struct_passwd,
                                                                     shm_root: Path) -> None:
    root = shm_root / "store"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)  # a root everyone may traverse: the user directory and the files keep others out
    store = HostStore(root, job_id="job", rank=0)
    slot = _commit_slot(store, 0, b"secret" * 1000, iteration=7)
    RestoreJournal(store.dir, rank=0).begin(7, attempt=1)
    run_dir = shm_root / "run"
    run_dir.mkdir(mode=0o755)
    os.chmod(run_dir, 0o755)
    token = new_token_file(run_dir / "store.token")
    for path in (slot, store.dir / "restoring.json", token):
        res = as_other("cat", str(path))
        assert res.returncode != 0 and "Permission denied" in res.stderr, (path, res)
        assert "secret" not in res.stdout and res.stdout == ""
    res = as_other("ls", str(store.user_dir))
    assert res.returncode != 0 and "Permission denied" in res.stderr, res
    store.close()


def test_a_link_planted_where_a_slot_is_opened_is_refused_and_not_followed(other_user: pwd.struct_passwd,
                                                                           shm_root: Path) -> None:
    root = shm_root / "store"
    store = HostStore(root, job_id="job", rank=0)
    bait = HostStore(shm_root / "bait", job_id="job", rank=0)
    target = _commit_slot(bait, 0, b"planted" * 100, iteration=99)  # a valid slot of this job, elsewhere
    before = target.read_bytes()
    os.symlink(target, store.path(ROLE_OWN, 0))
    with pytest.raises(StoreDirError, match="symbolic link"):
        list(store.committed(ROLE_OWN, verify=True))
    with pytest.raises(StoreDirError, match="symbolic link"):
        SlotFile.open(store.path(ROLE_OWN, 0))
    with pytest.raises(StoreDirError, match="symbolic link"):  # nor written through
        _commit_slot(store, 0, b"mine" * 100, iteration=1)
    assert target.read_bytes() == before, "the link's target was not touched"
    os.unlink(store.path(ROLE_OWN, 0))  # what the message says to do
    _commit_slot(store, 0, b"mine" * 100, iteration=1)
    assert [r.header.iteration for r in store.committed(ROLE_OWN, verify=True)] == [1]
    bait.close()
    store.close()


def test_another_users_file_planted_where_a_slot_is_opened_is_refused_naming_its_owner(
        other_user: pwd.struct_passwd, shm_root: Path) -> None:
    store = HostStore(shm_root / "store", job_id="job", rank=0)
    bait = HostStore(shm_root / "bait", job_id="job", rank=0)
    src = _commit_slot(bait, 1, b"planted" * 100, iteration=99)
    planted = store.path(ROLE_OWN, 1)
    shutil.copyfile(src, planted)
    os.chown(planted, other_user.pw_uid, other_user.pw_gid)
    with pytest.raises(StoreDirError) as err:
        list(store.committed(ROLE_OWN, verify=True))
    assert OTHER in str(err.value) and "neighbor_ckpt.store.dir" in str(err.value), err.value
    bait.close()
    store.close()


def test_a_link_or_another_users_file_planted_as_the_journal_is_refused(other_user: pwd.struct_passwd,
                                                                        shm_root: Path) -> None:
    store = HostStore(shm_root / "store", job_id="job", rank=0)
    journal = RestoreJournal(store.dir, rank=0)
    victim = shm_root / "victim.json"
    victim.write_text(json.dumps({"iteration": 5, "attempt": 0}))
    os.symlink(victim, journal.path)
    assert journal.read() is None, "a journal reached through a link is not read"
    os.unlink(journal.path)
    shutil.copyfile(victim, journal.path)
    os.chown(journal.path, other_user.pw_uid, other_user.pw_gid)
    assert journal.read() is None, "another user's journal is not read"
    os.unlink(journal.path)
    # writing: a link planted at the temporary name is removed, never written through
    os.symlink(victim, journal.path.with_name(journal.path.name + ".tmp"))
    journal.begin(8, attempt=2)
    assert json.loads(victim.read_text()) == {"iteration": 5, "attempt": 0}
    assert journal.read() == 8 and not journal.path.is_symlink()
    store.close()


def test_a_link_planted_in_place_of_a_rank_directory_is_refused(other_user: pwd.struct_passwd,
                                                                 shm_root: Path) -> None:
    root = shm_root / "store"
    udir = private_user_dir(root, pwd.getpwuid(os.geteuid()).pw_name)
    elsewhere = shm_root / "elsewhere"
    elsewhere.mkdir()
    (udir / "job").mkdir(mode=0o700)
    os.symlink(elsewhere, udir / "job" / "rank0")
    with pytest.raises(StoreDirError, match="symbolic link"):
        HostStore(root, job_id="job", rank=0)
    assert list(elsewhere.iterdir()) == []


def test_a_launcher_never_signals_a_recorded_pid_of_another_user(other_user: pwd.struct_passwd,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``proc/<p>`` record naming a process of another user's (whoever wrote it: the same node, its true start
    time) is not signalled; the same record naming a process of this user's that carries the launch's run tag is."""
    import json
    import time

    from neighbor_ckpt.inprocess.launcher_children import recorded_pid_to_kill
    from neighbor_ckpt.runtime.procs import RUN_TAG_ENV, process_environ, process_start

    monkeypatch.setenv(RUN_TAG_ENV, "this-launch")
    theirs = subprocess.Popen(["runuser", "-u", OTHER, "--", "sleep", "60"])
    mine = subprocess.Popen(["sleep", "60"], env={**os.environ, RUN_TAG_ENV: "this-launch"})
    try:
        deadline = time.monotonic() + 30
        victim = None
        while victim is None and time.monotonic() < deadline:  # runuser's child: the other user's sleep
            import psutil

            kids = psutil.Process(theirs.pid).children()
            victim = next((k.pid for k in kids if k.uids().real == other_user.pw_uid), None)
            time.sleep(0.05)
        assert victim is not None, "the other user's process did not start"
        while not process_environ(mine.pid) and time.monotonic() < deadline:  # Popen may return before exec is through
            time.sleep(0.01)

        def record(pid: int) -> bytes:
            return json.dumps({"pid": pid, "node": "node1", "start": process_start(pid)}).encode()

        assert recorded_pid_to_kill(record(victim), node="node1", child=1) is None
        assert recorded_pid_to_kill(record(mine.pid), node="node1", child=1) == mine.pid
        assert recorded_pid_to_kill(record(mine.pid), node="node0", child=1) is None, "another node's record"
        stale = json.dumps({"pid": mine.pid, "node": "node1", "start": 1.0}).encode()
        assert recorded_pid_to_kill(stale, node="node1", child=1) is None, "a pid reused since it was recorded"
    finally:
        for p in (theirs, mine):
            p.kill()
            p.wait()


def test_another_user_reaches_neither_a_store_nor_a_tunnel_nor_through_a_gate(other_user: pwd.struct_passwd,
                                                                             tmp_path: Path) -> None:
    """A real store host (its gate, the sealed store behind it) and a tunnel of this process: the other user's
    attempts to read a key and to write ``complete``, ``dead`` and ``proc/<i>`` (tools/store_probe.py, torch's
    store protocol) are all refused, and nothing of theirs reaches the store. The same against a whole running launch:
    tests/e2e/test_shared_node_sockets.py."""
    import re
    import socket
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    from neighbor_ckpt.inprocess.store_auth import read_token, tunnel_address

    os.chmod(tmp_path, 0o755)
    token_file = new_token_file(tmp_path / "run" / "store.token")
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    host = subprocess.Popen([sys.executable, "-m", "neighbor_ckpt.inprocess.store_host", "--host", "127.0.0.1",
                             "--port", str(port), "--token-file", str(token_file), "--parent", str(os.getpid())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        while "listening on" not in line:
            line = host.stdout.readline()
            assert line, "the store host did not start"
        assert line.rstrip().endswith("(sealed)"), line
        gate_port, store_port = (int(p) for p in re.search(r"listening on 127\.0\.0\.1:(\d+) .* on 127\.0\.0\.1:(\d+)",
                                                           line).groups())
        tunnel = tunnel_address(("127.0.0.1", gate_port), read_token(token_file))
        job = dist.PrefixStore("job", dist.TCPStore(*tunnel, is_master=False, wait_for_workers=False, use_libuv=True,
                                                    timeout=timedelta(seconds=30)))
        job.set("secret", "the-job-secret")
        probe_src = (Path(__file__).resolve().parents[2] / "tools" / "store_probe.py").read_text()
        spec = {"prefix": "/job/", "secret_key": "secret", "timeout_s": 3.0, "unix": [],
                "tcp": [["127.0.0.1", gate_port], ["127.0.0.1", store_port], list(tunnel)],
                "records": {"1": {"pid": os.getpid(), "node": "node1", "start": 1.0}}}
        probe = subprocess.run(["runuser", "-u", OTHER, "--", "/usr/bin/python3", "-c", probe_src],
                               input=json.dumps(spec), capture_output=True, text=True, timeout=300)
        assert probe.returncode == 0, probe.stderr
        attempts = {(tuple(a["target"]), a["attempt"]): a for a in map(json.loads, probe.stdout.splitlines())}
        assert len(attempts) == 3 * 3
        for (target, what), a in attempts.items():
            got = bytes.fromhex(a["received"])
            if target[1] == store_port:
                assert not a["connected"], (what, a)  # sealed: the connection never completes
            elif target[1] == gate_port:
                assert got.startswith(b"NCKPT-STORE-2\n") and len(got) == 30, (what, a)  # asked, then closed
            else:
                assert a["connected"] and got == b"", (what, a)  # a tunnel: closed unanswered
        for key in ("complete", "dead", "proc/1"):
            assert not job.check([key]), key
        assert job.get("secret") == b"the-job-secret"
    finally:
        host.terminate()
        host.wait(timeout=60)
