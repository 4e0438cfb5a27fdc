"""Failure detection in seconds: heartbeats and step/phase tags through the job's c10d store.

Without it a hung rank (SIGSTOP, a stuck kernel, a dead NIC) holds the whole job for the collective timeout,
10-30 minutes, and a dead rank on another node is noticed only when a collective with it fails. Here every
rank runs one daemon thread that, every ``interval_s``:

* publishes its heartbeat and progress tag (``<beat> <iteration> <phase>``) under
  ``neighbor_ckpt/<job>/<attempt>/hb/<rank>`` in the c10d store (its own TCP connection, so it works while the
  main thread is blocked inside a gloo or NCCL collective);
* reads the heartbeats it watches (its predecessor in the global rank ring and the ranks of its own node) and
  the job's failure count: one ``multi_get`` and one ``add``;
* watches its own progress tag: no new tag for ``hang_timeout_s`` during training means this rank, or the
  collective it waits in, is stuck;
* wakes up at once when the launcher's SIGTERM arrives (``signal.set_wakeup_fd``) and writes the lazy backup, even
  if the main thread sits in C++ and its Python handler cannot run before the launcher's grace period ends.

On a failure it announces it in the store (every other rank learns it within one interval), writes the lazy
backup of the redundant state from this thread (the checkpointer refuses weights from inside an optimizer step
and discards a backup the training thread moved on under), SIGKILLs a failed rank of its own node (a stopped
process ignores SIGTERM; the launcher notices a killed one at once) and leaves with :data:`EXIT_FAILURE_DETECTED`
so the launcher restarts the job.

**Whose word a kill takes.** The failed rank's process is the one its ``info/<rank>`` record in the store names, and
the store is torchrun's: it listens on every interface and authenticates nobody, so anyone who reaches it can write
that record. The named process is SIGKILLed only if it runs on this operating-system instance, started at the
recorded time (both public: a forger can copy them from ``/proc``), *and* carries this launch's run tag in its
environment (:data:`neighbor_ckpt.runtime.procs.RUN_TAG_ENV`, compared with this process's own;
:func:`~neighbor_ckpt.runtime.procs.signal_job_process`), which only the job's user can give a process of that
user. Anything else (a process of the user that is not part of the job, another launch's) is left alone, with one
line in the log; so is every process when this one has no tag (torchrun started by hand without one): torchrun then
stops the failed worker with the rest of the group, a grace period later.

:class:`Watch` and :class:`ProgressClock` are the decisions, pure and clock-injected (tested in one process);
:class:`FailureDetector` is the thread.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Literal

from neighbor_ckpt.runtime.procs import boot_id, flush_logs, process_start, run_tag, signal_job_process

logger = logging.getLogger(__name__)

__all__ = ["EXIT_FAILURE_DETECTED", "Failure", "Watch", "ProgressClock", "FailureDetector", "watched_ranks",
           "store_host_rank"]

EXIT_FAILURE_DETECTED = 75
"""Exit status of a rank that left because a failure was detected (EX_TEMPFAIL: restart me)."""

PAUSED = "paused"
"""Progress phase during which the hang clock stops (validation, a synchronous persistent checkpoint)."""

FailureKind = Literal["silent", "hung", "store", "reported", "sigterm"]


@dataclass(frozen=True)
class Failure:
    """What the detector concluded."""

    kind: FailureKind
    """``silent``: a watched rank stopped beating; ``hung``: this rank's progress stopped; ``store``: the c10d
    store stopped answering; ``reported``: another rank announced a failure; ``sigterm``: the launcher is
    stopping this process."""
    ranks: tuple[int, ...]
    """The failed ranks (empty when unknown, e.g. a job-wide hang seen from inside)."""
    reason: str
    """One line for the log and the recovery timeline."""
    after_s: float = 0.0
    """How long the symptom lasted when it was declared."""


class Watch:
    """When each watched rank's heartbeat last changed, by this process's monotonic clock.

    A rank that published ``done`` (it closed its checkpointer after a successful run) is no longer watched."""

    def __init__(self, ranks: tuple[int, ...], *, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self._last: dict[int, tuple[str | None, float]] = {r: (None, now) for r in ranks}
        self._done: set[int] = set()

    def observe(self, rank: int, value: str | None, now: float) -> None:
        if value == "done":
            self._done.add(rank)
            return
        beat = None if value is None else value.split(" ", 1)[0]
        last, _ = self._last[rank]
        if beat != last:
            self._last[rank] = (beat, now)

    def quiet(self, rank: int, now: float) -> float:
        """How long ``rank``'s heartbeat has not changed (0 for one that published ``done``)."""
        return 0.0 if rank in self._done else now - self._last[rank][1]

    def silent(self, now: float) -> list[tuple[int, float]]:
        """Watched ranks whose heartbeat has not changed for more than the timeout, with the silence length."""
        return [(r, now - since) for r, (_, since) in sorted(self._last.items())
                if r not in self._done and now - since > self.timeout_s]

    @property
    def done(self) -> frozenset[int]:
        return frozenset(self._done)


class ProgressClock:
    """How long this rank's progress tag has stood still. Armed by the first completed iteration (startup, model
    build and recovery are not steps); stopped while the phase is :data:`PAUSED`."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._tag: tuple[Any, ...] | None = None
        self._since = 0.0

    def observe(self, tag: tuple[int, int | None, str], now: float) -> None:
        if tag != self._tag:
            self._tag, self._since = tag, now

    def stalled(self, now: float) -> float | None:
        """Seconds without progress if over the timeout, else None."""
        tag = self._tag
        if self.timeout_s is None or tag is None or tag[1] is None or tag[2] == PAUSED:
            return None
        stalled = now - self._since
        return stalled if stalled > self.timeout_s else None


def watched_ranks(rank: int, world_size: int, local_ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The predecessor in the global rank ring (every rank is watched by someone) and the other ranks of this
    node (a failed process can only be killed from its own node)."""
    if world_size <= 1:
        return ()
    return tuple(sorted(({(rank - 1) % world_size} | set(local_ranks)) - {rank}))


def local_ranks_from_env(rank: int, world_size: int) -> tuple[int, ...]:
    """This node's global ranks under torchrun (contiguous per agent: LOCAL_RANK, LOCAL_WORLD_SIZE)."""
    try:
        local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return (rank,)
    first = rank - local_rank
    return tuple(r for r in range(first, first + local_world) if 0 <= r < world_size)


def store_host_rank() -> int | None:
    """The rank whose process hosts the c10d store, if any: rank 0 unless the torchelastic agent hosts it."""
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


def os_instance() -> str:
    """This operating-system instance (hostname + boot id): a process can be signalled only from its own. Not the
    topology's node id, which tests and launchers may override to lay out "nodes" on one machine."""
    return f"{socket.gethostname()}/{boot_id()}"


class FailureDetector:
    """The heartbeat thread of one rank (see the module docstring).

    Args:
        store: a c10d store client for this thread alone (a ``TCPStore`` connection), already prefixed per job
            and attempt by the caller or not; keys are prefixed here with ``prefix``.
        rank, world_size: this process in the job.
        local_ranks: global ranks on this node (this rank included).
        node: this operating-system instance (:func:`os_instance`; a failed rank is killed only if it runs here).
        progress: returns the training thread's progress tag ``(counter, iteration or None, phase)``.
        on_failure: writes the lazy backup and the failure event; called from this thread, must not raise.
        interval_s, timeout_s, hang_timeout_s, kill_local: see :class:`neighbor_ckpt.config.DetectorConfig`.
        exit: how to leave (``os._exit`` by default; tests pass a recorder).
        tag: this launch's run tag (default: this process's, :func:`~neighbor_ckpt.runtime.procs.run_tag`); a failed
            rank's process is killed only if it carries the same (see the module docstring).
    """

    def __init__(self, store: Any, *, prefix: str, rank: int, world_size: int, local_ranks: tuple[int, ...],
                 node: str, progress: Callable[[], tuple[int, int | None, str]],
                 on_failure: Callable[[Failure], None], interval_s: float = 1.0, timeout_s: float = 5.0,
                 hang_timeout_s: float | None = None, kill_local: bool = True,
                 exit: Callable[[int], None] = os._exit, tag: str | None = None) -> None:  # noqa: A002
        self.store, self.prefix, self.rank, self.world_size = store, prefix.rstrip("/"), rank, world_size
        self.tag = tag or run_tag()
        self.node, self.progress, self.on_failure = node, progress, on_failure
        self.interval_s, self.timeout_s, self.kill_local, self._exit = interval_s, timeout_s, kill_local, exit
        self.local_ranks = local_ranks
        self.watched = watched_ranks(rank, world_size, local_ranks)
        self.clock = ProgressClock(hang_timeout_s)
        self.failure: Failure | None = None
        """The failure this detector acted on (None while all is well)."""
        self.detected_unix: float | None = None
        self._beat = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._prev_wakeup_fd: int | None = None
        self._store_down_since: float | None = None
        self._peers: dict[int, dict[str, Any]] = {}
        # Announce this rank before any collective that follows, so watchers always find the key.
        self._publish_info()
        self._publish_beat()

    # -- keys --------------------------------------------------------------------------------------------------------

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _publish_info(self) -> None:
        self.store.set(self._key("info", self.rank), json.dumps(
            {"pid": os.getpid(), "node": self.node, "start": process_start(os.getpid())}))

    def _publish_beat(self) -> None:
        counter, iteration, phase = self.progress()
        self._beat += 1
        self.store.set(self._key("hb", self.rank), f"{self._beat} {counter} {iteration} {phase}")

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread; on the main thread also route SIGTERM's wake-up byte to it (if nobody else does)."""
        if self._thread is not None:
            return
        if threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            try:
                prev = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            except (ValueError, OSError):
                prev = -1
                os.close(r)
                os.close(w)
            else:
                if prev != -1:  # someone else (asyncio, ...) owns it: give it back, poll instead
                    signal.set_wakeup_fd(prev)
                    os.close(r)
                    os.close(w)
                else:
                    self._wake_r, self._wake_w = r, w
        self._thread = threading.Thread(target=self._run, name=f"neighbor_ckpt-detector-r{self.rank}", daemon=True)
        self._thread.start()

    def stop(self, *, done: bool) -> None:
        """Stop beating; ``done``: tell the watchers this rank finished (it will go silent on purpose)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + self.timeout_s + 1)
        if done:
            try:
                self.store.set(self._key("hb", self.rank), "done")
            except Exception as e:  # noqa: BLE001 - the run succeeded; the store may already be going away
                logger.debug("rank %d: could not publish done: %s", self.rank, e)
        if self._wake_w is not None and threading.current_thread() is threading.main_thread():
            try:
                if signal.set_wakeup_fd(-1) != self._wake_w:
                    logger.debug("rank %d: the SIGTERM wake-up fd was replaced meanwhile", self.rank)
            except ValueError:
                pass
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)  # type: ignore[arg-type]
            self._wake_r = self._wake_w = None

    # -- the loop ----------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        watch = Watch(self.watched, timeout_s=self.timeout_s, now=time.monotonic())
        while not self._stop.is_set():
            if self._sleep():
                self._act(Failure("sigterm", (), "SIGTERM from the launcher"), kill=False, announce=False)
                return
            if self._stop.is_set():
                return
            failure = self._check(watch)
            if failure is not None and not self._stop.is_set():
                self._act(failure, kill=True, announce=failure.kind != "reported")
                return

    def _sleep(self) -> bool:
        """Wait one interval; True if SIGTERM arrived."""
        if self._wake_r is None:
            self._stop.wait(self.interval_s)
            return False
        ready, _, _ = select.select([self._wake_r], [], [], self.interval_s)
        if not ready:
            return False
        try:
            data = os.read(self._wake_r, 64)
        except OSError:
            return False
        return signal.SIGTERM in data

    def _check(self, watch: Watch) -> Failure | None:
        now = time.monotonic()
        counter, iteration, phase = self.progress()
        self.clock.observe((counter, iteration, phase), now)
        try:
            self._publish_beat()
            values = self.store.multi_get([self._key("hb", r) for r in self.watched]) if self.watched else []
            reported = int(self.store.add(self._key("failed_n"), 0))
        except Exception as e:  # noqa: BLE001 - a dead store host looks like any error here
            if self._store_down_since is None:
                self._store_down_since = now
                logger.warning("rank %d: c10d store did not answer: %s", self.rank, e)
            down = time.monotonic() - self._store_down_since
            if down >= self.timeout_s:
                host = store_host_rank()
                return Failure("store", () if host is None else (host,),
                               f"the c10d store (hosted by {'the launcher' if host is None else f'rank {host}'}) "
                               f"did not answer for {down:.1f} s", down)
            return None
        self._store_down_since = None
        now = time.monotonic()
        for r, v in zip(self.watched, values):
            watch.observe(r, v.decode(errors="replace") if isinstance(v, bytes) else v, now)
        if reported:
            return self._reported(reported)
        silent = watch.silent(now)
        if silent:
            ranks = tuple(r for r, _ in silent)
            longest = max(s for _, s in silent)
            return Failure("silent", ranks, f"rank(s) {list(ranks)} sent no heartbeat for {longest:.1f} s "
                                            f"(timeout {self.timeout_s:g} s)", longest)
        stalled = self.clock.stalled(now)
        if stalled is not None:
            return Failure("hung", (), f"no progress for {stalled:.1f} s at iteration {iteration} ({phase}); "
                                       f"this rank or a collective it waits in is stuck", stalled)
        return None

    def _reported(self, n: int) -> Failure:
        ranks: set[int] = set()
        reasons = []
        for i in range(1, n + 1):
            try:
                rec = json.loads(self.store.get(self._key("failed", i)))
                ranks.update(rec["ranks"])
                reasons.append(f"rank {rec['by']}: {rec['reason']}")
            except Exception as e:  # noqa: BLE001 - announced but not readable: still a failure
                reasons.append(f"announcement {i} unreadable ({e})")
        return Failure("reported", tuple(sorted(ranks)), "; ".join(reasons)[:400])

    def _announce(self, failure: Failure) -> None:
        try:
            n = int(self.store.add(self._key("failed_n"), 1))
            self.store.set(self._key("failed", n), json.dumps(
                {"by": self.rank, "kind": failure.kind, "ranks": list(failure.ranks), "reason": failure.reason}))
        except Exception as e:  # noqa: BLE001 - the others will see the symptom themselves
            logger.debug("rank %d: could not announce the failure: %s", self.rank, e)

    def _act(self, failure: Failure, *, kill: bool, announce: bool) -> None:
        self.failure, self.detected_unix = failure, time.time()
        logger.error("rank %d: neighbor_ckpt detected a failure (%s) at unix %.3f: %s", self.rank, failure.kind,
                     self.detected_unix, failure.reason)
        if announce:
            self._announce(failure)
        self.on_failure(failure)
        if kill and self.kill_local:
            for r in failure.ranks:
                self._kill_if_local(r)
        if failure.kind == "sigterm":
            # The backup is written; stopping the process is the launcher's business (its handler on the main thread
            # runs as soon as that thread is back in Python, or the launcher's SIGKILL ends the grace period).
            return
        code = EXIT_FAILURE_DETECTED
        logger.error("rank %d: leaving with exit status %d so the launcher restarts the job", self.rank, code)
        flush_logs()
        self._exit(code)

    def _kill_if_local(self, rank: int) -> None:
        """SIGKILL failed ``rank``'s process if it is one of this node's ranks, and the process its ``info`` record
        names runs here, started when recorded and carries this launch's run tag; else leave it alone (one line in
        the log when the record names a process of this node that fails the checks)."""
        if rank == self.rank or rank not in self.local_ranks:
            return
        try:
            info = json.loads(self.store.get(self._key("info", rank))) if rank not in self._peers else self._peers[rank]
        except Exception as e:  # noqa: BLE001 - store gone: use what was cached
            logger.warning("rank %d: cannot look up rank %d's process: %s", self.rank, rank, e)
            return
        self._peers[rank] = info
        try:
            pid, start = int(info["pid"]), info.get("start")
        except (KeyError, TypeError, ValueError):
            logger.warning("rank %d: rank %d's process record is unreadable (%.200r): not signalled", self.rank, rank,
                           info)
            return
        if info.get("node") != self.node or start is None or process_start(pid) != start:
            return  # another node's process with the same rank number, or the process is gone / pid reused
        try:
            why = signal_job_process(pid, signal.SIGKILL, start=start, tag=self.tag)
        except PermissionError as e:
            logger.warning("rank %d: may not kill rank %d (pid %d): %s", self.rank, rank, pid, e)
            return
        if why is None:
            logger.error("rank %d: SIGKILLed rank %d (pid %d) so the launcher restarts the job now", self.rank, rank,
                         pid)
        else:
            logger.warning("rank %d: rank %d's record names pid %d, not signalled: %s", self.rank, rank, pid, why)

    def cache_local_peers(self) -> None:
        """Read the process info of this node's other ranks now, while the store answers (it may be the failed
        rank that hosts it)."""
        for r in self.local_ranks:
            if r != self.rank:
                try:
                    self._peers[r] = json.loads(self.store.get(self._key("info", r)))
                except Exception as e:  # noqa: BLE001 - looked up again at kill time
                    logger.debug("rank %d: info of rank %d not readable yet: %s", self.rank, r, e)


def connect_store(timeout_s: float) -> Any:
    """A TCPStore connection for the detector thread alone, to the job's rendezvous store (MASTER_ADDR/PORT,
    as ``init_process_group(init_method="env://")`` used it); None if those are not set."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    import torch.distributed as dist

    return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)
