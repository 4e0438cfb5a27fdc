"""Facts about the processes and the memory of this machine, read through psutil; process hygiene for harnesses.

The one place that reads them: the reaper and the failure detector identify a process by its pid and
:func:`process_start` (pids are reused, quickly where ``pid_max`` is 32768), the timeline places
:func:`process_start` on the wall clock, the preflight compares the store with :func:`mem_available_bytes`.
What psutil does not give (the boot id) is read here too.

Harnesses that launch whole jobs (the fault campaign, the end-to-end tests): torchrun starts every worker in a session
of its own, so killing the launcher's process group at the end of a run does not reach what the workers started
(megatron-core's ``multiprocessing`` Manager servers, NeMo's checkpoint writers), and a worker that was killed leaves
those running, ~200 MB each. A harness marks a run with an environment variable every descendant inherits
(:func:`new_run_tag`), and stops whatever still carries it afterwards (:func:`kill_tagged`).

The same variable is the job's *run tag* (:data:`RUN_TAG_ENV`): every launch gives every process of the job one
(:func:`with_run_tag`, :func:`launch_run_tag`), and a process named by someone else's word (a pid read from a store,
which another user may reach) is signalled only when its environment carries this launch's tag
(:func:`signal_job_process`, :func:`tag_refusal`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import psutil

__all__ = ["flush_logs", "stall_report", "boot_id", "process_start", "process_uid", "group_members", "mem_available_bytes",
           "dir_bytes", "RUN_TAG_ENV", "new_run_tag", "kill_tagged", "stop_processes", "run_tag", "launch_run_tag",
           "with_run_tag", "process_environ", "tag_refusal", "signal_job_process",
           "python_module_command", "python_code_command"]

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
"""The kernel's unit of process start times (psutil divides by the same)."""


def flush_logs() -> None:
    """Flush every root logging handler and stdout/stderr, before a process leaves with ``os._exit`` (which flushes
    nothing): its last line is the one that says why."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001, S110 - a broken handler must not stop the exit
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110
            pass


@contextlib.contextmanager
def stall_report(what: str, after_s: float, log: logging.Logger,
                 then: Callable[[], None] | None = None) -> Iterator[None]:
    """If the block takes longer than ``after_s``, log every thread's Python stack once (WARNING), then go on waiting:
    a clean-up that blocks (a store read whose key never comes, a join of a thread stuck in a socket) names where.
    ``then`` runs after the report, on the watching thread (the caller's way out: declare the process dead)."""
    import threading
    import traceback

    done = threading.Event()

    def report() -> None:
        if done.wait(after_s):
            return
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = [f"{what} has taken more than {after_s:g} s; the stacks of this process's threads:"]
        for tid, frame in sys._current_frames().items():  # noqa: SLF001 - the documented way to read other threads
            parts.append(f"--- thread {names.get(tid, tid)}:\n" + "".join(traceback.format_stack(frame)))
        log.warning("\n".join(parts))
        if then is not None:
            then()

    watcher = threading.Thread(target=report, name="neighbor_ckpt-stall-report", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def boot_id() -> str:
    """This boot of this machine ("" where the kernel does not say): a pid and a process group mean something only
    within one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid: int | None = None) -> float | None:
    """When ``pid`` (default: this process) started, in seconds since boot, to a clock tick; None: no such process.

    With the pid, the identity of a process: record it and compare it with this function only (the same process gives
    the same float, read from any process). psutil's ``create_time`` is the start plus the boot time on the wall
    clock, which moves when the wall clock is stepped; that boot time is taken off again and the result rounded to the
    tick it came from, so a clock step between recording and checking cannot make a process look like another."""
    try:
        since_boot = psutil.Process(pid).create_time() - psutil.boot_time()
    except (psutil.Error, OSError):
        return None
    return round(since_boot * _TICKS_PER_S) / _TICKS_PER_S


def process_uid(pid: int) -> int | None:
    """The real user id ``pid`` runs as; None: no such process (or it cannot be read)."""
    try:
        return int(psutil.Process(pid).uids().real)
    except (psutil.Error, OSError):
        return None


def stop_processes(procs: Sequence[subprocess.Popen], grace_s: float = 30.0) -> None:
    """SIGTERM every process of ``procs`` still running, SIGKILL one still running ``grace_s`` later, reap them."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def group_members(pgid: int) -> list[int]:
    """The pids in process group ``pgid`` (zombies included)."""
    members = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid:  # psutil has no process group; the kernel answers for any pid
                members.append(pid)
        except OSError:
            continue
    return members


def mem_available_bytes() -> int | None:
    """Memory available to new allocations without swapping (``MemAvailable``; None where it cannot be read)."""
    try:
        return int(psutil.virtual_memory().available)
    except (psutil.Error, OSError, RuntimeError):
        return None


RUN_TAG_ENV = "NEIGHBOR_CKPT_HARNESS_RUN"
"""The run tag: an environment variable every process of one launch carries, the same random value in all of them,
and no other process of the user's. The harnesses (the test suite, the fault campaign, the benchmarks) set a fresh
one per run and stop what still carries it afterwards (:func:`kill_tagged`); ``neighbor-ckpt launch`` sets one where
its environment has none (:func:`with_run_tag`: for torchrun, which hands its environment to every worker, and for
the in-process launchers), and an in-process launcher started without one draws its own for its children
(:func:`launch_run_tag`). A restart-path job started by hand with torchrun has one only if the user sets it
(``NEIGHBOR_CKPT_HARNESS_RUN=$(python -c 'import uuid; print(uuid.uuid4().hex)') torchrun ...``).

**What it is for.** The failure detector (:meth:`~neighbor_ckpt.runtime.detector.FailureDetector._kill_if_local`)
and the in-process launcher (:func:`~neighbor_ckpt.inprocess.launcher_children.recorded_pid_to_kill`) SIGKILL a pid
that a job process wrote into a store, and a store is no authority: torchrun's listens on every interface, without
authentication, so anyone who reaches it (another user of the node, another host) can write a pid of the job's user
there, with its node and start time (both public: ``/proc/<pid>/stat`` and the boot id are world-readable). So a
pid read from a store is signalled only when ``/proc/<pid>/environ`` carries this launch's tag
(:func:`signal_job_process`): a process of the user that is not part of the job (a shell, an editor, another job)
has none or another one, and is left alone.

**Why a random tag per launch and not the run id.** The check needs no secret: knowing the tag grants nothing.
Only the job's user (and root) can start a process that runs as that user, or change one
(``/proc/<pid>/environ`` is that process's own memory, which only its user and root can read or write), so only
they can make a process of that user carry the tag. Another user who learns it can therefore make no process of the
job's user eligible; and the job's user could kill that process anyway. What the tag needs is to be
*unique*: it must tell this launch's processes from every other process of the same user. The run id
(``neighbor_ckpt.job_id``, torchrun's ``--rdzv-id``, the in-process launchers' ``--run-id``,
:data:`neighbor_ckpt.inprocess.protocol.ENV_RUN_ID`) is not: a job file may fix it, so a relaunch, a second launch of
the same file, or what an earlier launch of it left running carries the same value, and a forged record could then
get one launch's process killed by another launch's detector; the campaign and the benchmarks choose theirs
too. A fresh :func:`new_run_tag` (128 random bits) per launch is unique, so the run id is not used, and the tag is
drawn fresh where no outer launch (a harness, a Slurm script) drew one for this launch already."""

_LAUNCH_TAG: str | None = None
"""The tag :func:`launch_run_tag` drew for this process's children (when its own environment had none)."""


SAFE_PATH_FLAG = sys.version_info >= (3, 11)
"""Whether this interpreter has ``-P`` (Python 3.11 and later): see :func:`python_module_command`."""

_DROP_PATH0 = "import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "
"""What a ``-c`` program runs first where there is no ``-P`` (Python 3.10), on one line (it may land in a shell
script): drop the working directory (``''``), which ``-c`` put first on ``sys.path``, before anything is imported
through it (``sys`` is built in)."""


def python_module_command(module: str, *args: str) -> list[str]:
    """The command line that runs ``module`` (``python -m MODULE ARGS``) on this interpreter, without the working
    directory on its ``sys.path``. Every Python child the library starts by module goes through it (a unit test,
    tests/unit/test_safe_path.py, holds the library to it).

    Why: ``python -m`` puts the working directory first on ``sys.path``. A child started as root (or as the job's
    user) in a directory others can write (a shared scratch directory, a Slurm submit directory) would import a file
    planted there under the name of a standard module or of ours (``json.py``, ``neighbor_ckpt/``) instead of the real
    one, as that user. ``-P`` (Python 3.11 and later, the same as ``PYTHONSAFEPATH``) leaves it out and changes
    nothing else. ``-I`` is not used: it also drops ``PYTHONPATH`` and the user's site-packages, which users rely on
    to find their own code and which the library passes on itself (the timeline's drawing process). The flag is not
    inherited: what the child starts in turn (the workers, ``python SCRIPT``) has the script's own directory first, as
    always.

    Python 3.10 (the oldest supported, ``python_requires``) has neither ``-P`` nor ``PYTHONSAFEPATH``: there the
    command is ``python -c PROGRAM ARGS`` with a program that drops the working directory from ``sys.path`` and then
    runs the module as ``-m`` does (``runpy._run_module_as_main``: ``__main__``, ``sys.argv[0]`` the module's file,
    ``ARGS`` after it). Only the command line differs (``ps`` shows that program rather than ``-m MODULE``)."""
    if SAFE_PATH_FLAG:
        return [sys.executable, "-P", "-m", module, *args]
    return [sys.executable, "-c", f"{_DROP_PATH0}import runpy; runpy._run_module_as_main({module!r})", *args]


def python_code_command(code: str, *args: str) -> list[str]:
    """``python -c CODE ARGS`` on this interpreter without the working directory on ``sys.path`` (``-P``; on Python
    3.10, ``CODE`` after a line that removes it): see :func:`python_module_command`."""
    if SAFE_PATH_FLAG:
        return [sys.executable, "-P", "-c", code, *args]
    return [sys.executable, "-c", _DROP_PATH0 + code, *args]


def dir_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a directory (files that vanish meanwhile count 0)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def new_run_tag() -> str:
    return uuid.uuid4().hex


def run_tag(env: Mapping[str, str] | None = None) -> str | None:
    """The run tag (:data:`RUN_TAG_ENV`) of ``env`` (default: this process's environment); None without one."""
    return (os.environ if env is None else env).get(RUN_TAG_ENV) or None


def launch_run_tag() -> str:
    """The run tag of the processes this process starts (an in-process launcher's children): its own, else one drawn
    here once (:func:`new_run_tag`) and the same on every call; this process's environment is left as it is."""
    global _LAUNCH_TAG
    own = run_tag()
    if own is not None:
        return own
    if _LAUNCH_TAG is None:
        _LAUNCH_TAG = new_run_tag()
    return _LAUNCH_TAG


def with_run_tag(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with a run tag: the one it has (an outer launch, a harness, drew it for this launch), else a fresh one
    (:func:`new_run_tag`). What a launch hands to the launcher of its workers (torchrun, the in-process launchers)."""
    out = dict(env)
    if not out.get(RUN_TAG_ENV):
        out[RUN_TAG_ENV] = new_run_tag()
    return out


def process_environ(pid: int) -> dict[str, str] | None:
    """The environment process ``pid`` was started with (``/proc/<pid>/environ``: readable for this user's processes,
    and for everyone's as root); None when it is gone or may not be read."""
    try:
        with open(f"/proc/{int(pid)}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and name:
            env.setdefault(name.decode(errors="surrogateescape"), value.decode(errors="surrogateescape"))
    return env


def tag_refusal(pid: int, tag: str | None) -> str | None:
    """None when process ``pid`` carries the run tag ``tag`` (:data:`RUN_TAG_ENV`); else why it may not be signalled
    as a process of this launch (one phrase): no tag to compare with, its environment unreadable, no tag, another."""
    if not tag:
        return f"this process has no run tag ({RUN_TAG_ENV}) to compare with, so it cannot tell the job's processes"
    env = process_environ(pid)
    if env is None:
        return "its environment cannot be read (gone, or another user's)"
    theirs = env.get(RUN_TAG_ENV)
    if not theirs:
        return f"it carries no run tag ({RUN_TAG_ENV}): not a process of this launch"
    if theirs != tag:
        return f"it carries another run tag ({RUN_TAG_ENV}): a process of another launch"
    return None


def signal_job_process(pid: int, sig: int, *, start: float | None, tag: str | None) -> str | None:
    """Send ``sig`` to ``pid`` only if it is the process of this launch that started at ``start``
    (:func:`process_start`) and carries the run tag ``tag`` (:func:`tag_refusal`); None once sent, else why not (one
    phrase). The process is held by a pidfd from before the checks to the signal where the kernel has them
    (``pidfd_open``, Linux 5.3), so a pid reused between the checks and the signal is not signalled.

    Raises:
        PermissionError: the kernel refused the signal."""
    fd: int | None = None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return "it is gone"
    except (AttributeError, OSError):  # no pidfds here: the checks, then the pid
        fd = None
    try:
        if start is None or process_start(pid) != start:
            return "it is gone or its pid was reused (another start time)"
        why = tag_refusal(pid, tag)
        if why is not None:
            return why
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return "it is gone"
        return None
    finally:
        if fd is not None:
            os.close(fd)


def kill_tagged(tag: str, *, var: str = RUN_TAG_ENV) -> int:
    """SIGKILL every process (of this user) whose environment has ``var=tag`` (default :data:`RUN_TAG_ENV`); returns
    how many."""
    me, killed = os.getpid(), 0
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(var) == tag:
                proc.kill()
                killed += 1
        except psutil.Error:  # gone, a zombie, or another user's
            continue
    return killed
