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
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator, Sequence

import psutil

__all__ = ["flush_logs", "stall_report", "boot_id", "process_start", "process_uid", "group_members", "mem_available_bytes",
           "dir_bytes", "RUN_TAG_ENV", "new_run_tag", "kill_tagged", "stop_processes"]

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
