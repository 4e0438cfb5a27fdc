"""The ``inproc-other-user`` kind's second Unix user: made (``useradd``), run (``runuser``, the system's Python,
tools/store_probe.py probing every store address of the launch every :data:`PROBE_EVERY_S` from its start to its
end), and what it came to (:func:`summarize`, judged by :func:`~tools.campaign.judge.other_user`).

The user is ``nckpt_other``, the one tests/unit/test_shared_node.py makes, with no home and no login shell
(``/usr/sbin/nologin``: ``runuser`` needs none). The campaign holds it for its run (:func:`second_user`): made if
missing, and then removed at the campaign's end however it ends (its cases done, a failure, ^C, SIGTERM); one that was
there before is left as it was. The addresses: the
launch's store list (each store host's gate), and once a store host says where its store listens (``a gate before the
store on H:P`` in the launch log) that sealed store and the door on ``127.0.0.2`` at its port
(:class:`neighbor_ckpt.inprocess.store_auth.Door`, closed once torch's own client is in; docs/shared-nodes.md)."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from neighbor_ckpt.inprocess.protocol import launch_prefix
from neighbor_ckpt.inprocess.store_auth import DOOR_HOST
from neighbor_ckpt.inprocess.store_handshake import MAGIC, NONCE_BYTES

from .cases import WORLD

__all__ = ["OTHER_USER", "PROBE", "SYSTEM_PYTHON", "PROBE_EVERY_S", "RESULT", "Made", "refuse_impossible",
           "make_user", "remove_user", "second_user", "Prober", "summarize", "store_addresses"]

OTHER_USER = "nckpt_other"
PROBE = Path(__file__).resolve().parents[1] / "store_probe.py"
SYSTEM_PYTHON = "/usr/bin/python3"
"""The other user runs the probe with the system's Python (standard library only), outside the job's environment."""
PROBE_EVERY_S = 0.5
"""How often each attempt is made again on each address (or as soon as the last one ended, when it took longer: a
gate waits for the answer to its challenge, a sealed store never completes the connection)."""
PROBE_TIMEOUT_S = 1.0
"""Per connection: a sealed store never completes it (its attempts end here)."""
RESULT = "other_user.json"
"""The probe's summary in the case's directory (what :func:`~tools.campaign.judge.other_user` reads); every attempt's
line is in ``other_user.jsonl`` beside it."""
_STORE_LINE_RE = re.compile(r"a gate before the store on ([0-9.]+):(\d+)")


Run = Callable[..., "subprocess.CompletedProcess[str]"]
"""How the user's commands run (``subprocess.run``'s signature): the unit tests pass their own."""


def _exists(lookup: Callable[[str], Any], name: str) -> bool:
    try:
        lookup(name)
    except KeyError:
        return False
    return True


@dataclass(frozen=True)
class Made:
    """What :func:`make_user` made: the user (``useradd`` made it now, not another run meanwhile), and whether its
    group (``nckpt_other``) was there before (a group ``useradd`` made goes with the user)."""

    user: bool
    group_before: bool = False


def refuse_impossible() -> None:
    """Raise ValueError (one line) unless the second user can be made and run here: root, ``useradd``, ``userdel``,
    ``runuser`` and the system's Python."""
    if os.geteuid() != 0:
        raise ValueError(f"making a second Unix user (useradd) and running as it (runuser) needs root; this runs as "
                         f"uid {os.geteuid()}: run the campaign as root, or leave inproc-other-user out of --kinds")
    missing = [t for t in ("useradd", "userdel", "runuser") if shutil.which(t) is None]
    if missing or not os.access(SYSTEM_PYTHON, os.X_OK):
        raise ValueError(f"{', '.join(missing + ([] if os.access(SYSTEM_PYTHON, os.X_OK) else [SYSTEM_PYTHON]))} not "
                         "found (shadow-utils/passwd, util-linux, the system's python3); install them, or leave "
                         "inproc-other-user out of --kinds")


def make_user(*, run: Run = subprocess.run, user_exists: Callable[[str], bool] = lambda n: _exists(pwd.getpwnam, n),
              group_exists: Callable[[str], bool] = lambda n: _exists(grp.getgrnam, n)) -> Made:
    """Make :data:`OTHER_USER` (no home, no login shell) unless it exists. ``Made.user``: this call made it, so it is
    this campaign's to remove (:func:`remove_user`); not when it was there, nor when another run (a test run beside
    this one) made it meanwhile (``useradd`` exit 9).

    Raises:
        ValueError: ``useradd`` failed otherwise (one line)."""
    if user_exists(OTHER_USER):
        return Made(user=False)
    group_before = group_exists(OTHER_USER)
    made = run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER], capture_output=True,
               text=True, timeout=60)
    if made.returncode == 9:  # made meanwhile by a test run beside this one: that run's to remove
        return Made(user=False)
    if made.returncode != 0:
        raise ValueError(f"useradd {OTHER_USER} failed ({(made.stderr or '').strip() or made.returncode}); make the "
                         "user by hand, or leave inproc-other-user out of --kinds")
    return Made(user=True, group_before=group_before)


def remove_user(made: Made, *, run: Run = subprocess.run,
                group_exists: Callable[[str], bool] = lambda n: _exists(grp.getgrnam, n)) -> list[str]:
    """Remove :data:`OTHER_USER` if ``made`` says this campaign made it (``userdel``; and ``groupdel`` of its group
    where ``userdel`` kept one that was not there before). Never raises: what could not be removed, one line each
    (``userdel`` refuses while a process of the user runs: someone else's, which is not killed here)."""
    if not made.user:
        return []
    gone = run(["userdel", OTHER_USER], capture_output=True, text=True, timeout=60)
    if gone.returncode != 0:
        return [f"campaign: userdel {OTHER_USER} failed ({(gone.stderr or '').strip() or gone.returncode}): the user "
                f"this campaign made is still there; remove it by hand (userdel {OTHER_USER})"]
    if made.group_before or not group_exists(OTHER_USER):
        return []
    gone = run(["groupdel", OTHER_USER], capture_output=True, text=True, timeout=60)
    if gone.returncode != 0:
        return [f"campaign: groupdel {OTHER_USER} failed ({(gone.stderr or '').strip() or gone.returncode}); remove "
                f"it by hand (groupdel {OTHER_USER})"]
    return []


def _check_runs(run: Run) -> None:
    ran = run(["runuser", "-u", OTHER_USER, "--", SYSTEM_PYTHON, "-c", "import os; print(os.getuid())"],
              capture_output=True, text=True, timeout=60)
    if ran.returncode != 0 or ran.stdout.strip() != str(pwd.getpwnam(OTHER_USER).pw_uid):
        raise ValueError(f"runuser -u {OTHER_USER} {SYSTEM_PYTHON} did not run as that user "
                         f"({(ran.stderr or ran.stdout).strip() or ran.returncode}); leave inproc-other-user out of "
                         "--kinds")


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM, in the block, ends this process through ``SystemExit`` (status 143), so that the ``finally`` blocks
    around it run (Python's own default for SIGTERM runs none); SIGINT (^C) does already (``KeyboardInterrupt``)."""
    def _exit(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        before = signal.signal(signal.SIGTERM, _exit)
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def second_user(*, run: Run = subprocess.run, check: Callable[[], None] = refuse_impossible,
                make: Callable[..., Made] = make_user, remove: Callable[..., list[str]] = remove_user,
                runs: Callable[[Run], None] = _check_runs) -> Iterator[Made]:
    """:data:`OTHER_USER` for the block (the campaign's run): checked (:func:`refuse_impossible`), made if missing
    (:func:`make_user`), checked to run as itself (``runuser``), and removed at the block's end when it was made here
    (:func:`remove_user`), however the block ends: normally, by an exception, ^C, or SIGTERM (which exits through
    ``SystemExit`` in the block). What could not be removed is said on stderr.

    Raises:
        ValueError: the user cannot be made or run here (one line; one made here is removed first)."""
    check()
    made = make(run=run)
    try:
        with _sigterm_exits():
            runs(run)
            yield made
    finally:
        for line in remove(made, run=run):
            print(line, file=sys.stderr, flush=True)


def store_addresses(stores: str) -> list[list[Any]]:
    """The gates of a launch's store list (``host:port,...``)."""
    out = []
    for entry in stores.split(","):
        host, _, port = entry.strip().rpartition(":")
        out.append([host.strip("[]"), int(port)])
    return out


def stores_behind_gates(log: str) -> list[list[Any]]:
    """Each sealed store a store host named in ``log`` and the door at its port on ``127.0.0.2``."""
    found = []
    for host, port in _STORE_LINE_RE.findall(log):
        found += [[host, int(port)], [DOOR_HOST, int(port)]]
    return found


class Prober:
    """The other user probing one launch: :meth:`start` before the launchers start, :meth:`stop` once they ended
    (writes :data:`RESULT`)."""

    def __init__(self, out: Path, *, run_id: str, stores: str, log: Path) -> None:
        self.out, self.run_id, self.stores, self.log = out, run_id, stores, log
        self._proc: subprocess.Popen | None = None
        self._known: set[tuple[str, int]] = set()
        self._done = threading.Event()
        self._watch: threading.Thread | None = None

    def start(self) -> None:
        gates = store_addresses(self.stores)
        self._known = {(h, p) for h, p in gates}
        spec = {"prefix": f"/{launch_prefix(self.run_id, 0)}/", "secret_key": "proc/0", "tcp": gates, "unix": [],
                "records": {"1": {"pid": "self", "node": "node1"}, str(WORLD): {"pid": "self", "node": f"node{WORLD}"}},
                "timeout_s": PROBE_TIMEOUT_S, "every_s": PROBE_EVERY_S}
        with open(self.out / "other_user.jsonl", "w") as lines, open(self.out / "other_user.stderr", "w") as err:
            self._proc = subprocess.Popen([shutil.which("runuser") or "runuser", "-u", OTHER_USER, "--", SYSTEM_PYTHON,
                                           "-c", PROBE.read_text()], stdin=subprocess.PIPE, stdout=lines, stderr=err,
                                          text=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        self._send(spec)
        self._watch = threading.Thread(target=self._watch_log, daemon=True)
        self._watch.start()

    def _send(self, obj: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(obj) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # it died: stop() finds it so
            pass

    def _watch_log(self) -> None:
        """Every store a store host names in the launch log (and its door) goes to the probe as soon as it is there."""
        while not self._done.wait(0.25):
            try:
                text = self.log.read_text(errors="replace")
            except OSError:
                continue
            new = [a for a in stores_behind_gates(text) if tuple(a) not in self._known]
            if new:
                self._known |= {tuple(a) for a in new}
                self._send({"tcp": new})

    def stop(self) -> dict[str, Any]:
        """End the probe (its stdin closed); the summary (:func:`summarize`, with ``alive_at_end``: the other user's
        probe process still ran when the launch ended), also written to :data:`RESULT`."""
        assert self._proc is not None and self._proc.stdin is not None
        self._done.set()
        if self._watch is not None:
            self._watch.join()
        started = _started(self.out / "other_user.jsonl")
        alive = self._proc.poll() is None and started is not None and _uid_of(started["pid"]) == started["uid"]
        try:
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        text = (self.out / "other_user.jsonl").read_text(errors="replace").splitlines()
        summary = summarize(text, uid=pwd.getpwnam(OTHER_USER).pw_uid)
        summary.update(alive_at_end=alive, exit=self._proc.returncode, gates=store_addresses(self.stores),
                       stderr=(self.out / "other_user.stderr").read_text(errors="replace")[-2000:])
        (self.out / RESULT).write_text(json.dumps(summary, indent=1) + "\n")
        return summary


def _started(path: Path) -> dict[str, Any] | None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("probe") == "started":
                return rec
        time.sleep(0.1)
    return None


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def refusal(attempt: dict[str, Any]) -> str | None:
    """How a socket refused ``attempt`` (a probe line): ``never connected``, ``asked for the token`` (a gate's
    challenge, then closed) or ``unanswered`` (connected, and closed or silent until the probe's timeout); None:
    something answered it."""
    got = bytes.fromhex(attempt.get("received", ""))
    if not attempt.get("connected"):
        return None if got else "never connected"
    if not got:
        return "unanswered"
    if got.startswith(MAGIC) and len(got) == len(MAGIC) + NONCE_BYTES:
        return "asked for the token"
    return None


def summarize(lines: Iterable[str], *, uid: int | None = None) -> dict[str, Any]:
    """What the probe's output says (pure): ``attempts``, ``refused``, ``by`` (refusals per way), ``served`` (the
    first attempts something answered, at most 5), ``addresses`` (tried), ``span_s`` (from the first attempt's end
    to the last's), ``started`` / ``stopped`` (its own lines), ``uid`` (it ran as) and ``other_uid`` (``uid``, the
    other user's)."""
    attempts, refused, by, served, addresses, times = 0, 0, {}, [], set(), []
    started = stopped = False
    ran_as = None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("probe") == "started":
            started, ran_as = True, rec.get("uid")
            continue
        if rec.get("probe") == "stopped":
            stopped = True
            continue
        attempts += 1
        if isinstance(rec.get("unix"), (int, float)):
            times.append(float(rec["unix"]))
        addresses.add(json.dumps(rec.get("target")))
        how = refusal(rec)
        if how is None:
            if len(served) < 5:
                served.append(rec)
            continue
        refused += 1
        by[how] = by.get(how, 0) + 1
    return {"attempts": attempts, "refused": refused, "by": by, "served": served,
            "addresses": sorted(json.loads(a) for a in addresses),
            "span_s": round(max(times) - min(times), 1) if times else 0.0, "started": started, "stopped": stopped,
            "uid": ran_as, "other_uid": uid}
