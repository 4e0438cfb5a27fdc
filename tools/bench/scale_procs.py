"""The OS processes of a scale run and what the coordinator reads of them: the store hosts, the worker processes
(JSON lines over pipes), the machine's CPU use and a process's threads and descriptors (``/proc``)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from tools.bench import scale_adapter as cp

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


def proc_threads(pid: int) -> Optional[int]:
    """The threads of process ``pid`` (``Threads:`` of ``/proc/<pid>/status``), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def proc_fds(pid: int) -> Optional[int]:
    """The open descriptors of process ``pid``, None when it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def proc_memory_mb(pid: int, field: str = "VmRSS") -> Optional[float]:
    """``field`` of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``: the peak) in MiB, None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def available_mb() -> Optional[float]:
    """``MemAvailable`` of ``/proc/meminfo`` in MiB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def proc_cpu_s(pid: int) -> Optional[float]:
    """CPU seconds (user + system) process ``pid`` has used, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class CpuClock:
    """The machine's CPU use since it was made (``/proc/stat``: every state but idle and iowait counts as busy, irq
    and softirq included: loopback TCP is processed there)."""

    def __init__(self) -> None:
        self._t0 = self._read()

    @staticmethod
    def _read() -> tuple[int, int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields[:8]), idle, sum(fields[5:7])

    def busy(self) -> tuple[float, float, float]:
        """(busy fraction of every CPU, busy CPU seconds, of which irq and softirq) since the clock was made."""
        total, idle, irq = self._read()
        dt, di, dq = total - self._t0[0], idle - self._t0[1], irq - self._t0[2]
        hz = os.sysconf("SC_CLK_TCK")
        return (round(1.0 - di / dt, 3) if dt > 0 else 0.0), (dt - di) / hz, dq / hz


class Sampler:
    """Every half second: the primary store host's threads and descriptors (their peaks), the CPU seconds and peak
    memory of the harness's own processes (the last value seen of each, so that one killed meanwhile still counts),
    and the machine's available memory (``on_low`` below ``floor_mb``)."""

    def __init__(self, primary: int, *, floor_mb: float = 0.0,
                 on_low: Optional[Callable[[float], None]] = None) -> None:
        self.primary, self.peak_threads, self.peak_fds = primary, 0, 0
        self.floor_mb, self.on_low = floor_mb, on_low
        self._cpu: dict[int, float] = {}
        self._rss_peak: dict[int, float] = {}
        self._pids: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="scale-sampler", daemon=True).start()

    def watch(self, pid: int) -> None:
        with self._lock:
            self._pids.add(pid)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.sample()

    def sample(self) -> None:
        available = available_mb()
        if self.on_low is not None and available is not None and available < self.floor_mb:
            self.on_low(available)
        t, f = proc_threads(self.primary), proc_fds(self.primary)
        if t is not None:
            self.peak_threads, self.peak_fds = max(self.peak_threads, t), max(self.peak_fds, f or 0)
        with self._lock:
            pids = list(self._pids)
        for pid in pids:
            c, m = proc_cpu_s(pid), proc_memory_mb(pid, "VmHWM")
            if c is not None:
                self._cpu[pid] = c
            if m is not None:
                self._rss_peak[pid] = m

    def rss_peak_mb(self) -> float:
        """The sum of the watched processes' peak resident memory (MiB)."""
        return sum(self._rss_peak.values())

    def harness_cpu_s(self) -> float:
        """CPU seconds of the watched processes and of this one."""
        t = os.times()
        return sum(self._cpu.values()) + t.user + t.system

    def close(self) -> None:
        self._stop.set()


class StoreHosts:
    """The launch's store hosts (the primary, then the standbys), each a real ``store_host`` process."""

    def __init__(self, directory: Path, token_file: Path, count: int) -> None:
        from neighbor_ckpt.cli.launch import free_ports

        self.ports = free_ports(count)
        self.procs: list[subprocess.Popen] = []
        self.logs = [directory / f"store{i}.log" for i in range(count)]
        env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "error"}
        readies = [directory / f"store{i}.ready" for i in range(count)]
        for port, ready, log in zip(self.ports, readies, self.logs):
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen(cp.store_host_command(port, ready, token_file), env=env,
                                                   stdout=f, stderr=subprocess.STDOUT, cwd=REPO))
        deadline = time.monotonic() + 120
        for p, ready in zip(self.procs, readies):
            while not ready.exists():
                if p.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"a store host did not start (see {directory})")
                time.sleep(0.05)

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        return tuple(("127.0.0.1", p) for p in self.ports)

    @property
    def primary_pid(self) -> int:
        return self.procs[0].pid

    def kill_primary(self) -> float:
        """SIGKILL the primary's host; when (unix)."""
        self.procs[0].kill()
        at = time.time()
        self.procs[0].wait()
        return at

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class WorkerError(RuntimeError):
    """A worker did not answer in time, or answered with an error."""


class Worker:
    """One worker OS process (:mod:`tools.bench.scale_worker`) and its command pipe."""

    _ids = itertools.count(1)

    def __init__(self, name: str, plan: dict[str, Any], directory: Path) -> None:
        self.name = name
        plan_path = directory / f"worker-{name}.json"
        plan_path.write_text(json.dumps({**plan, "name": name}))
        self.log = directory / f"worker-{name}.log"
        env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "error", "PYTHONPATH": str(REPO)}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tools.bench.scale_worker", str(plan_path)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=REPO,
                                         env=env, text=True, bufsize=1)
        self._replies: "queue.Queue[dict[str, Any]]" = queue.Queue()
        threading.Thread(target=self._read, name=f"scale-worker-{name}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._replies.put(json.loads(line))
            except ValueError:
                logger.warning("worker %s: not a reply: %r", self.name, line[:200])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self, timeout_s: float) -> None:
        """Wait for the worker's first line (its imports and objects are done)."""
        self._next(None, timeout_s)

    def _next(self, want: Optional[int], timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and self._replies.empty():
                raise WorkerError(f"worker {self.name}: no answer within {timeout_s:.0f} s (log: {self.log})")
            try:
                reply = self._replies.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if want is None or reply.get("id") == want:
                return reply

    def call(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send ``cmd`` and wait for its reply; :class:`WorkerError` on an error or no reply in time."""
        ident = next(self._ids)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({**cmd, "id": ident}) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise WorkerError(f"worker {self.name}: {e}") from None
        reply = self._next(ident, timeout_s)
        if not reply.get("ok"):
            raise WorkerError(f"worker {self.name}: {cmd.get('cmd')}: {reply.get('error')}")
        return reply

    def signal(self, sig: int) -> float:
        """Send ``sig`` to the worker; when (unix)."""
        os.kill(self.pid, sig)
        return time.time()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"cmd": "exit"}, 10.0)
            except WorkerError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def call_all(workers: Sequence[Worker], cmd: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """``cmd`` to every worker at once; their replies in order. :class:`WorkerError` if any fails."""
    out: list[Optional[dict[str, Any]]] = [None] * len(workers)
    errors: list[str] = []

    def one(i: int, w: Worker) -> None:
        try:
            out[i] = w.call(cmd, timeout_s)
        except WorkerError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=one, args=(i, w), daemon=True) for i, w in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise WorkerError("; ".join(errors))
    return [o for o in out if o is not None]


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (``T`` in ``/proc/<pid>/stat``)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def sigstop(worker: Worker) -> float:
    """SIGSTOP ``worker`` and wait until the kernel shows it stopped (every thread of it); when the stop was sent
    (unix)."""
    at = worker.signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not _stopped(worker.pid) and time.monotonic() < deadline:
        time.sleep(0.005)
    return at
