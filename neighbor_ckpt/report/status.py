"""What a user sees: the status line, metrics for the trainer's loggers, recovery progress and the timeline.

Everything here runs on global rank 0, at the status interval or once after a recovery; the training thread
of the other ranks never enters it. Per iteration the checkpointer pays one integer modulo
(:meth:`Reporter.status_due`) and one attribute test (:attr:`Reporter.timeline_pending`).

The status line (``logging.getLogger("neighbor_ckpt.report.status")``, INFO), every ``report.status_every_n_steps``
steps: by default the trainer's ``log_every_n_steps`` under Lightning / NeMo, and every :data:`PLAIN_LOOP_LOG_EVERY`
(10) steps in a plain loop, which has no log interval neighbor_ckpt could read::

    neighbor_ckpt: step 120 | snapshot 3.1 ms wait 0.2 ms | 12.4 MB unique/rank | replica lag 0 it | stream 1.3 GB/s | host store 52 MB

* snapshot: copy + checksum + commit of the last snapshot on the background thread;
* wait: what the training thread spent at the last wait point;
* unique/rank: bytes snapshotted per iteration by rank 0 (unique tensors + small state);
* replica lag: last snapshotted iteration minus the last one the ring successor acknowledged;
* stream: bytes streamed to the successor / time spent streaming, since the previous status line;
* host store: bytes of rank 0's slot files.

A program that configured no logging at all (no handler on the way to the root logger and no level set, what a
plain training script often is) would never show an INFO line: the status line and the recovery summary then go to
stderr anyway, the way Python's last-resort handler shows warnings. Once logging is configured they follow it
(``logging.getLogger("neighbor_ckpt.report.status").setLevel(logging.WARNING)`` silences them, as does
``status_every_n_steps: 0``).

Metrics (``logger.log_metrics(metrics, step=global_step)`` on every trainer logger, when
``report.log_metrics``): ``neighbor_ckpt/snapshot_ms``, ``wait_ms``, ``unique_bytes``, ``replica_lag``,
``stream_gbps``, and after a recovery ``neighbor_ckpt/recovery/<phase>_s`` for every phase of
:data:`~neighbor_ckpt.report.timeline.PHASES` plus ``neighbor_ckpt/recovery/total_s``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Sequence

from neighbor_ckpt.config import ReportConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.report.timeline import PHASES, RankEvents, RecoveryTimeline, compute_timeline, write_timeline

logger = logging.getLogger(__name__)

__all__ = [
    "SnapshotStats",
    "Reporter",
    "resize_line",
    "PhaseProgress",
    "PLAIN_LOOP_LOG_EVERY",
    "METRIC_PREFIX",
    "resolve_status_interval",
    "logging_configured",
    "resolve_progress_mode",
    "replica_lag",
    "stream_gbps_between",
    "format_status",
    "status_metrics",
    "recovery_metrics",
    "log_to_loggers",
    "recovery_progress",
]

PLAIN_LOOP_LOG_EVERY = 10
"""Status interval of a plain loop when ``report.status_every_n_steps`` is None: there is no trainer log interval to
follow, and a line every 10 steps shows a short example run working (the first line comes at step 10, once a snapshot
has completed) while costing a long run one line where Megatron-LM logs one per ``--log-interval``."""

METRIC_PREFIX = "neighbor_ckpt"

RECOVERY_STEPS: tuple[str, ...] = ("inventory", "exchange", "transfer", "verify", "load", "restore")
"""Phases the recovery flow announces to :class:`PhaseProgress` (``insurance`` replaces the last ones)."""


# -- snapshot statistics -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotStats:
    """Figures of this rank's snapshots at one moment (:meth:`NeighborCheckpointer.stats`)."""

    iteration: int
    """Last committed snapshot (-1: none yet)."""
    snapshot_s: float
    """Copy + checksum + commit of the last snapshot (background thread)."""
    wait_s: float
    """Time the training thread spent blocked at the last wait point."""
    unique_bytes: int
    """Unique tensor bytes per snapshot (this rank's shard of the optimizer state, or nothing under DDP)."""
    extras_bytes: int
    """Small state per snapshot (RNG, counters, scheduler, data position)."""
    replicated_iteration: int | None
    """Last iteration the ring successor acknowledged (None: not streaming, or none yet)."""
    replica_lag: int | None
    """Iterations snapshotted but not yet acknowledged by the successor (None: not streaming)."""
    streaming: bool
    """A transport exists and is healthy."""
    stream_bytes: int
    """Bytes streamed to the successor since start."""
    stream_seconds: float
    """Time spent streaming (sends until acknowledged) since start."""
    host_store_bytes: int
    """Bytes of this rank's slot files."""
    failures: int = 0
    """Snapshots that failed on the background thread."""

    @property
    def snapshot_bytes(self) -> int:
        """Bytes written per iteration: unique tensors + small state."""
        return self.unique_bytes + self.extras_bytes

    @property
    def stream_gbps(self) -> float | None:
        """Average streaming throughput since start (GB/s, 1e9), None when nothing was streamed."""
        return stream_gbps_between(None, self)


def replica_lag(last_snapshot: int, last_acknowledged: int | None, first_snapshot: int | None) -> int | None:
    """Iterations not yet acknowledged by the successor.

    Args:
        last_snapshot: last committed iteration (< 0: none).
        last_acknowledged: last iteration the successor acknowledged (None or < 0: none yet).
        first_snapshot: first iteration snapshotted by this process (a restored run starts mid-way).
    """
    if last_snapshot < 0:
        return None
    floor = -1 if first_snapshot is None else first_snapshot - 1
    acked = floor if last_acknowledged is None else max(last_acknowledged, floor)
    return max(0, last_snapshot - acked)


def stream_gbps_between(before: SnapshotStats | None, after: SnapshotStats) -> float | None:
    """Streaming throughput between two stats (GB/s); ``before`` None: since start. None: nothing streamed."""
    b0, s0 = (0, 0.0) if before is None else (before.stream_bytes, before.stream_seconds)
    db, ds = after.stream_bytes - b0, after.stream_seconds - s0
    if db <= 0 or ds <= 0:
        return None
    return db / ds / 1e9


# -- formatting --------------------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _fmt_rate(gbps: float) -> str:
    return f"{gbps:.1f} GB/s" if gbps >= 1 else f"{gbps * 1e3:.0f} MB/s"


def format_status(step: int, stats: SnapshotStats, stream_gbps: float | None) -> str:
    """The one-line status (see the module docstring)."""
    if stats.replica_lag is None:
        replica = "replica off"
    else:
        replica = f"replica lag {stats.replica_lag} it" + ("" if stats.streaming else " (streaming stopped)")
    if stats.replica_lag is None:
        stream = "stream off"
    else:
        stream = "stream -" if stream_gbps is None else f"stream {_fmt_rate(stream_gbps)}"
    parts = [f"neighbor_ckpt: step {step}",
             f"snapshot {stats.snapshot_s * 1e3:.1f} ms wait {stats.wait_s * 1e3:.1f} ms",
             f"{_fmt_bytes(stats.snapshot_bytes)} unique/rank", replica, stream,
             f"host store {_fmt_bytes(stats.host_store_bytes)}"]
    if stats.failures:
        parts.append(f"{stats.failures} snapshot(s) failed")
    return " | ".join(parts)


def status_metrics(stats: SnapshotStats, stream_gbps: float | None) -> dict[str, float]:
    """Metrics of one status (keys ``neighbor_ckpt/...``); lag and throughput only when streaming."""
    m = {f"{METRIC_PREFIX}/snapshot_ms": stats.snapshot_s * 1e3, f"{METRIC_PREFIX}/wait_ms": stats.wait_s * 1e3,
         f"{METRIC_PREFIX}/unique_bytes": float(stats.snapshot_bytes)}
    if stats.replica_lag is not None:
        m[f"{METRIC_PREFIX}/replica_lag"] = float(stats.replica_lag)
    if stream_gbps is not None:
        m[f"{METRIC_PREFIX}/stream_gbps"] = stream_gbps
    return m


def recovery_metrics(timeline: RecoveryTimeline) -> dict[str, float]:
    """``neighbor_ckpt/recovery/<phase>_s`` for every known phase, and ``.../total_s``."""
    m = {f"{METRIC_PREFIX}/recovery/{p}_s": float(v) for p in PHASES if (v := timeline.phases.get(p)) is not None}
    m[f"{METRIC_PREFIX}/recovery/total_s"] = timeline.total_s
    return m


def log_to_loggers(loggers: Sequence[Any], metrics: Mapping[str, float], step: int) -> None:
    """``logger.log_metrics(metrics, step=step)`` then ``logger.save()`` on every Lightning logger."""
    for lg in loggers:
        lg.log_metrics(dict(metrics), step=step)
        save = getattr(lg, "save", None)
        if callable(save):
            save()


# -- output ----------------------------------------------------------------------------------------------------

class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is at each write (what logging's last-resort handler does)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr


_fallback_handler = _StderrHandler()


def logging_configured(lg: logging.Logger | None = None) -> bool:
    """Whether the program configured logging anywhere on ``lg``'s way to the root: a handler, or a level other than
    the defaults (NOTSET below the root, WARNING at the root)."""
    cur: logging.Logger | None = lg or logger
    while cur is not None:
        if cur.handlers:
            return True
        if cur.level != (logging.WARNING if cur is logging.root else logging.NOTSET):
            return True
        if not cur.propagate:
            return False
        cur = cur.parent  # type: ignore[assignment]
    return False


def _say(msg: str, *args: Any) -> None:
    """One INFO line of this module's logger (the status line, the recovery summary); to stderr when the program
    configured no logging at all (see the module docstring)."""
    if logging_configured():
        logger.info(msg, *args)
        return
    _fallback_handler.handle(logger.makeRecord(logger.name, logging.INFO, __file__, 0, msg, args, None))


# -- intervals and modes -------------------------------------------------------------------------------------


def resolve_status_interval(configured: int | None, log_every_n_steps: int | None) -> int:
    """Status interval in steps: the configured value, else the trainer's log interval (else
    :data:`PLAIN_LOOP_LOG_EVERY`); 0 = never.

    Raises:
        ConfigError: a negative value.
    """
    every = configured if configured is not None else (
        log_every_n_steps if log_every_n_steps is not None else PLAIN_LOOP_LOG_EVERY)
    if every < 0:
        raise ConfigError(f"neighbor_ckpt.report.status_every_n_steps: {every!r} must be >= 0")
    return int(every)


def resolve_progress_mode(mode: str, *, isatty: bool) -> Literal["rich", "log", "none"]:
    """``rich`` bars, plain ``log`` lines per phase, or ``none``, for ``report.progress``."""
    if mode == "none":
        return "none"
    if mode == "rich" or (mode == "auto" and isatty):
        return "rich"
    return "log"


# -- recovery progress ---------------------------------------------------------------------------------------


class PhaseProgress:
    """Receives the start of every recovery phase; this base ignores them."""

    def phase(self, name: str) -> None:
        """Phase ``name`` starts (the previous one ends)."""

    def close(self, ok: bool) -> None:
        """The last phase ends (``ok`` False: the recovery raised)."""


class _LogProgress(PhaseProgress):
    """One log line per finished phase."""

    def __init__(self) -> None:
        self._current: tuple[str, float] | None = None
        self._t0 = time.perf_counter()

    def phase(self, name: str) -> None:
        self._end()
        self._current = (name, time.perf_counter())

    def _end(self) -> None:
        if self._current is not None:
            name, t = self._current
            logger.info("neighbor_ckpt recovery: %s done in %.0f ms", name, (time.perf_counter() - t) * 1e3)
            self._current = None

    def close(self, ok: bool) -> None:
        if ok:
            self._end()
            logger.info("neighbor_ckpt recovery: finished in %.0f ms", (time.perf_counter() - self._t0) * 1e3)


class _RichProgress(PhaseProgress):
    """A rich progress bar over :data:`RECOVERY_STEPS` on stderr."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(SpinnerColumn(), TextColumn("neighbor_ckpt recovery: {task.description}"),
                                  BarColumn(), TimeElapsedColumn(), console=Console(stderr=True))
        self._task = self._progress.add_task("starting", total=len(RECOVERY_STEPS))
        self._started = 0
        self._progress.start()

    def phase(self, name: str) -> None:
        self._started += 1
        done = min(self._started - 1, len(RECOVERY_STEPS) - 1)  # transfer/verify repeat when a copy fails
        try:
            self._progress.update(self._task, description=name, completed=done)
        except Exception as e:  # noqa: BLE001 - a display problem never fails the recovery
            logger.debug("neighbor_ckpt: progress display failed: %s", e)

    def close(self, ok: bool) -> None:
        if ok:
            self._progress.update(self._task, description="done", completed=len(RECOVERY_STEPS))
        self._progress.stop()


@contextlib.contextmanager
def recovery_progress(mode: str, *, enabled: bool) -> Iterator[PhaseProgress]:
    """Progress of the recovery phases on this rank: rich bars, log lines, or nothing (``enabled`` False or
    mode ``none``). The progress display never fails the recovery."""
    kind = resolve_progress_mode(mode, isatty=_stderr_isatty()) if enabled else "none"
    prog: PhaseProgress = PhaseProgress()
    if kind == "rich":
        try:
            prog = _RichProgress()
        except Exception as e:  # noqa: BLE001 - rich missing or no usable console: plain lines instead
            logger.info("neighbor_ckpt: no rich progress bars (%s); logging phases instead", e)
            kind = "log"
    if kind == "log":
        prog = _LogProgress()
    ok = False
    try:
        yield prog
        ok = True
    finally:
        try:
            prog.close(ok)
        except Exception as e:  # noqa: BLE001
            logger.debug("neighbor_ckpt: progress display failed: %s", e)


def _stderr_isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


# -- the reporter of one checkpointer ------------------------------------------------------------------------


class Reporter:
    """Rank-0 reporting of one :class:`~neighbor_ckpt.checkpointer.NeighborCheckpointer`.

    The checkpointer builds one with plain-loop defaults; the Lightning callback :meth:`attach` es the
    trainer's log interval, loggers and log directory before recovery.

    Args:
        config: the ``report`` section.
        rank_zero: this is global rank 0 (every other rank reports nothing).
        every_n_steps: status interval (0: never); see :func:`resolve_status_interval`.
        report_dir: where the recovery timeline goes.
        attempt: restart count of this process (names the timeline files).
        process_group_ready: wall-clock time the process group was ready (a marker on the timeline).
        loggers: Lightning loggers for the metrics (empty: none).
    """

    def __init__(self, config: ReportConfig, *, rank_zero: bool, every_n_steps: int, report_dir: Path,
                 attempt: int = 0, process_group_ready: float | None = None, loggers: Sequence[Any] = ()) -> None:
        self.config = config
        self.rank_zero = rank_zero
        self.report_dir = Path(report_dir)
        self.attempt = attempt
        self.process_group_ready = process_group_ready
        self.loggers: tuple[Any, ...] = tuple(loggers)
        self._every = every_n_steps if rank_zero else 0
        self._prev: SnapshotStats | None = None
        self._pending: tuple[list[RankEvents], str, int | None, dict[str, float],
                             tuple[int | None, int | None]] | None = None
        self.timeline_pending = False
        """A recovery happened and its timeline waits for the end of the first step (rank 0 only)."""
        self.batch: tuple[int, int] | None = None
        """(global batch, micro-batch size) the job keeps in every layout, when the checkpointer was given them: what
        the line after an elastic reshard states (:func:`resize_line`)."""

    def attach(self, *, every_n_steps: int | None = None, loggers: Sequence[Any] | None = None,
               report_dir: Path | None = None, process_group_ready: float | None = None) -> None:
        """Replace the plain-loop defaults (the Lightning callback does, from the trainer)."""
        if every_n_steps is not None:
            self._every = every_n_steps if self.rank_zero else 0
        if loggers is not None:
            self.loggers = tuple(loggers)
        if report_dir is not None:
            self.report_dir = Path(report_dir)
        if process_group_ready is not None:
            self.process_group_ready = process_group_ready

    @property
    def every_n_steps(self) -> int:
        """The status interval on this rank (0 on every rank but 0)."""
        return self._every

    @property
    def wants_recovery_events(self) -> bool:
        """Whether recovery gathers events (a collective; the config is the same on every rank)."""
        return self.config.timeline or self.config.log_metrics

    # -- status ----------------------------------------------------------------------------------------

    def status_due(self, step: int) -> bool:
        """Cheap per-iteration test: a status line is due at ``step`` on this rank."""
        return self._every > 0 and step % self._every == 0

    def emit_status(self, step: int, stats: SnapshotStats) -> str | None:
        """Log the status line and send the metrics; returns the line (None: no snapshot yet). Never raises."""
        if stats.iteration < 0:
            return None
        try:
            gbps = stream_gbps_between(self._prev, stats)
            self._prev = stats
            line = format_status(step, stats, gbps)
            _say("%s", line)
            if self.config.log_metrics and self.loggers:
                log_to_loggers(self.loggers, status_metrics(stats, gbps), step)
            return line
        except Exception as e:  # noqa: BLE001 - reporting never stops training
            logger.warning("neighbor_ckpt: status report failed: %s", e)
            return None

    # -- recovery --------------------------------------------------------------------------------------

    def progress(self) -> contextlib.AbstractContextManager[PhaseProgress]:
        """Progress display of the recovery phases (rank 0; see ``report.progress``)."""
        return recovery_progress(self.config.progress, enabled=self.rank_zero)

    def begin_timeline(self, per_rank: Sequence[RankEvents], *, outcome: str, iteration: int | None,
                       recovery_phases: Mapping[str, float],
                       data_parallel: tuple[int | None, int | None] = (None, None)) -> None:
        """Keep the gathered events until the first step after the restore ends (rank 0)."""
        if not self.rank_zero:
            return
        self._pending = (list(per_rank), outcome, iteration, dict(recovery_phases), data_parallel)
        self.timeline_pending = True

    def finish_timeline(self, first_step_end: float | None, *, step: int | None) -> RecoveryTimeline | None:
        """Compute the timeline, write its PNG + JSON (``report.timeline``), log the MTTR line and send the
        recovery metrics at ``step``. Never raises (returns None on failure)."""
        pending, self._pending, self.timeline_pending = self._pending, None, False
        if pending is None:
            return None
        per_rank, outcome, iteration, phases, data_parallel = pending
        try:
            tl = compute_timeline(per_rank, first_step_end=first_step_end, attempt=self.attempt, outcome=outcome,
                                  iteration=iteration, recovery_phases=phases, data_parallel=data_parallel)
            if self.config.timeline:
                tl = write_timeline(tl, self.report_dir)
            where = f"; timeline {tl.path_png or tl.path_json}" if tl.path_json else ""
            _say("neighbor_ckpt: recovery %s%s", tl.summary(), where)
            if tl.resized:
                _say("neighbor_ckpt: %s", resize_line(tl.data_parallel_before, tl.data_parallel_after, self.batch))
            for note in tl.notes:
                _say("neighbor_ckpt: recovery timeline: %s", note)
            if self.config.log_metrics and self.loggers and step is not None:
                log_to_loggers(self.loggers, recovery_metrics(tl), step)
            return tl
        except Exception as e:  # noqa: BLE001 - reporting never stops training
            logger.warning("neighbor_ckpt: could not write the recovery timeline: %s", e)
            return None


def resize_line(before: int | None, after: int | None, batch: tuple[int, int] | None) -> str:
    """What an elastic reshard from data-parallel size ``before`` to ``after`` changed for training, in words: with
    ``batch`` (global batch, micro-batch size, as given to the checkpointer) the global batch actually used and the
    micro-batches per rank on each side; without it, that the checkpointer does not know the global batch (nothing is
    claimed that was not checked)."""
    if before is None or after is None or before == after:
        return ""
    cost = f"a step takes about {before / after:.2f}x as long (throughput x {after / before:.2f})"
    if batch is None:
        return (f"data-parallel size {before} -> {after}: the global batch is the training loop's (not given to the "
                f"checkpointer: pass global_batch= and micro_batch_size= to have it checked); if it keeps it, each "
                f"rank trains {before}/{after} = {before / after:.2f}x the micro-batches per step and {cost}")
    gb, mbs = batch
    per = gb // mbs  # micro-batches per step over all ranks; the checkpointer refused a DP size that does not divide it

    def each(dp: int) -> str:
        return str(per // dp) if per % dp == 0 else f"{per / dp:.2f}"

    return (f"data-parallel size {before} -> {after}: the global batch is {gb} samples, {each(after)} micro-batch(es) "
            f"of {mbs} per rank (was {each(before)}), so {cost}")
