"""Recovery timeline: wall-clock events that survive a restart, the MTTR breakdown, its PNG and JSON.

A recovery is cut into seven consecutive phases (:data:`PHASES`), each the span between two job-wide events:

=============  =====================================  ======================================================
phase          from                                   to
=============  =====================================  ======================================================
detect         last completed snapshot                a surviving rank noticed the failure
restart        failure noticed                        the (last) new worker process started
rendezvous     new process start                      recovery began on every rank (imports, process-group
                                                      rendezvous, strategy / model set-up, snapshot group)
reconcile      recovery began                         inventory + exchange done (every rank knows the target)
transfer       reconcile done                         replicas / lazy backups received
restore        transfer done                          verified, loaded, weights regenerated, RNG restored
first_step     restore done                           end of the first training step after the restore
=============  =====================================  ======================================================

An in-process recovery (:mod:`neighbor_ckpt.inprocess`: the surviving processes stay, a hot spare may take a lost
rank's place) has no new processes; its *detect* starts at the fault, and its *restart* and *rendezvous* are replaced
by (:data:`PHASES_INPROCESS`; the JSON's ``detect_from`` names the event *detect* starts at):

=============  =====================================  ======================================================
detect         the fault, as its earliest witness     the engine began its abort on the earliest survivor
               saw it (a launcher the exit of its
               process, a monitor a silent peer's
               last heartbeat or a stuck rank's last
               progress, a process its own
               exception: ``gen/<g>/faults``); the
               newest snapshot when none recorded it
abort          failure noticed (the engine began      every survivor's process groups aborted (blocked
               its abort on the earliest survivor)    collectives freed; latest survivor)
reform         abort done                             recovery began on every rank (clean-ups, rank
                                                      re-assignment, new process group, megatron-core parallel
                                                      state, model / optimizer rebuilt, snapshot group)
=============  =====================================  ======================================================

The JSON says which (``mode``: ``"in-process"`` or ``"restart"``), which ranks run in a process started after the
failure (``restarted_ranks``: every rank under a restart, none under an in-process recovery; a hot spare started with
the job does not count) and which ranks a hot spare took over (``spare_ranks``, ``spare_used``).

Where each time comes from:

* last completed snapshot: the ``committed_unix`` stamp in the header of the newest committed own or replica
  slot, newest over all ranks (headers survive a restart in the host store);
* failure noticed: a survivor's :func:`~neighbor_ckpt.recovery.journal.record_failure_event` (its SIGTERM handler
  / exception handler wrote ``events.json`` in its store directory), earliest over all ranks. When no survivor
  recorded anything (every process killed at once) *detect* is unknown and folded into *restart*; the JSON says so;
* process start: the kernel's start time of each worker (``/proc/self/stat``), latest over all ranks; a rank
  whose process started after the newest committed snapshot (or, without one, after the failure was noticed) is
  a restarted rank;
* in process: the abort's start and end on every survivor (the engine's monitor thread), given to the checkpointer
  with :class:`~neighbor_ckpt.recovery.attempt.AttemptInfo`, as is whether this process is a hot spare activated now;
* process group ready: the first framework hook after ``init_process_group`` (a marker inside *rendezvous*);
* recovery phases: :class:`~neighbor_ckpt.recovery.flow.RecoveryReport` timings (inventory + exchange ->
  reconcile, transfer -> transfer, verify + load + adapter restore -> restore), latest over all ranks;
* first step: rank 0's end of its first training step (every rank finishes it within one gradient
  all-reduce of the others).

The per-rank events are exchanged with one all-gather of a small float64 tensor at the end of the recovery
flow (all ranks take part in it anyway); rank 0 computes and writes the timeline. The PNG is drawn in a process of
its own (matplotlib takes ~1.6 s on a slow core: not on the training thread, inside the first step after a
recovery); :func:`wait_for_renders` waits for it (the checkpointer's ``close(success=True)`` does, and so does a
normal interpreter exit, at most :data:`RENDER_WAIT_S`: the drawing process dies with the one that started it).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import math
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from neighbor_ckpt.recovery.attempt import AttemptInfo
from neighbor_ckpt.runtime.procs import process_start, python_module_command
from neighbor_ckpt.snapshot.slot import SlotFile
from neighbor_ckpt.snapshot.store import COMMIT_TIME_KEY, ROLE_OWN, ROLE_REPLICA, HostStore

logger = logging.getLogger(__name__)

__all__ = [
    "PHASES",
    "EVENTS",
    "PHASES_INPROCESS",
    "EVENTS_INPROCESS",
    "MODE_RESTART",
    "MODE_INPROCESS",
    "RankEvents",
    "RecoveryTimeline",
    "compute_timeline",
    "gather_rank_events",
    "newest_commit_unix",
    "process_start_unix",
    "write_timeline",
    "wait_for_renders",
    "RENDER_WAIT_S",
]

PHASES: tuple[str, ...] = ("detect", "restart", "rendezvous", "reconcile", "transfer", "restore", "first_step")
"""The MTTR breakdown, in order; phase ``i`` spans ``EVENTS[i]`` .. ``EVENTS[i + 1]``."""

EVENTS: tuple[str, ...] = ("last_snapshot", "failure_noticed", "process_start", "recovery_start", "reconcile_end",
                           "transfer_end", "restore_end", "first_step_end")
"""Job-wide events (unix seconds) that bound the phases."""

PHASES_INPROCESS: tuple[str, ...] = ("detect", "abort", "reform", "reconcile", "transfer", "restore", "first_step")
"""The MTTR breakdown of an in-process recovery (no new process: abort and re-form instead of restart + rendezvous)."""

EVENTS_INPROCESS: tuple[str, ...] = ("fault", "failure_noticed", "abort_end", "recovery_start",
                                     "reconcile_end", "transfer_end", "restore_end", "first_step_end")
"""Job-wide events that bound :data:`PHASES_INPROCESS`. ``fault``: when the fault happened, as its earliest witness
saw it (the engine knows it: a launcher saw the exit, a monitor the last heartbeat); the newest committed snapshot
when no witness recorded it (:attr:`RecoveryTimeline.detect_from` says which)."""

MODE_RESTART = "restart"
MODE_INPROCESS = "in-process"

_SKEW_NOTE_S = 1e-3
_IMPORTED_AT = time.time()


# -- events that survive the restart ------------------------------------------------------------------------


def process_start_unix() -> float:
    """Wall-clock start time of this process, to a clock tick (10 ms).

    Its start since boot (:func:`~neighbor_ckpt.runtime.procs.process_start`) placed on the wall clock through
    ``CLOCK_BOOTTIME`` (psutil's ``create_time`` adds it to the whole-second boot time instead, up to a second off);
    the import time of this module where either is missing."""
    since_boot = process_start()
    if since_boot is None or not hasattr(time, "CLOCK_BOOTTIME"):
        return _IMPORTED_AT
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)



def newest_commit_unix(store: HostStore) -> float | None:
    """Commit time of the newest committed own or replica slot of ``store`` (None: none, or no stamp).

    Reads headers only, from fresh mappings (nothing is cached, nothing is logged: the recovery inventory
    reports unusable slots)."""
    newest: float | None = None
    for role in (ROLE_OWN, ROLE_REPLICA):
        for i in range(store.versions):
            path = store.path(role, i)
            if not path.exists():
                continue
            try:
                slot = SlotFile.open(path)
            except Exception:  # noqa: BLE001 - best effort: the inventory reports unusable slots
                continue
            try:
                hdr = slot.read_header()
                stamp = hdr.meta.get(COMMIT_TIME_KEY)
                if hdr.job_id == store.job_id and isinstance(stamp, (int, float)) and math.isfinite(stamp):
                    newest = float(stamp) if newest is None else max(newest, float(stamp))
            except Exception:  # noqa: BLE001 - same
                pass
            finally:
                slot.close()
    return newest


# -- per-rank events and their exchange ----------------------------------------------------------------------


@dataclass(frozen=True)
class RankEvents:
    """Wall-clock events (unix seconds) of one rank around a recovery; None where the rank has none."""

    last_snapshot: float | None
    failure_noticed: float | None
    process_start: float | None
    process_group_ready: float | None
    recovery_start: float | None
    reconcile_end: float | None
    transfer_end: float | None
    restore_end: float | None
    abort_end: float | None = None
    """In-process recovery: when this survivor's abort of the failed attempt ended (None: not a survivor, or a
    restart)."""
    activated_spare: float | None = None
    """1.0: this rank's process was an idle hot spare until this recovery; 0.0: it was not; None: unknown."""
    prepared_slot_wait: float | None = None
    """Seconds (not a time) this rank's recovery waited for the receive slot it prepared in advance to be ready (None:
    no prepared slot received its pull)."""
    fault: float | None = None
    """In-process recovery: when the fault happened, as the engine's earliest witness saw it (None: unknown)."""

    def to_tensor(self) -> torch.Tensor:
        """float64 tensor, NaN for None (the all-gather payload)."""
        return torch.tensor([math.nan if v is None else float(v) for v in dataclasses.astuple(self)],
                            dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> RankEvents:
        values = [float(v) for v in t.tolist()]
        return cls(*(None if math.isnan(v) else v for v in values))

    def to_json(self) -> dict[str, float | None]:
        return dataclasses.asdict(self)


def gather_rank_events(mine: RankEvents, group: dist.ProcessGroup | None) -> list[RankEvents]:
    """Collective over ``group``: every rank's events, by group rank."""
    t = mine.to_tensor()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [RankEvents.from_tensor(x) for x in out]


def _agg(values: Sequence[float | None], how: str) -> float | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return min(known) if how == "min" else max(known)


# -- the timeline -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryTimeline:
    """The MTTR breakdown of one recovery (rank 0).

    ``phases`` maps every name of :data:`PHASES` to seconds, or None when unknown (its start or end event is
    missing; see ``notes``). ``events`` are the job-wide event times (unix seconds) that bound them.
    """

    attempt: int | str
    """The launcher's restart count, or ``"<launch>.<in-process restart>"`` (:attr:`AttemptInfo.record`)."""
    outcome: str
    iteration: int | None
    events: Mapping[str, float | None]
    phases: Mapping[str, float | None]
    notes: tuple[str, ...] = ()
    mode: str = MODE_RESTART
    """:data:`MODE_RESTART` or :data:`MODE_INPROCESS`; names the phases (:attr:`phase_names`)."""
    restarted_ranks: tuple[int, ...] | None = None
    """Ranks whose process started after the failure (None: unknown, no reference event)."""
    spare_ranks: tuple[int, ...] = ()
    """Ranks a hot spare took over in this recovery."""
    process_group_ready: float | None = None
    per_rank: tuple[RankEvents, ...] = ()
    recovery_phases: Mapping[str, float] = field(default_factory=dict)
    """Rank 0's :attr:`RecoveryReport.phases` (seconds)."""
    data_parallel_before: int | None = None
    """Data-parallel size of the restored snapshots (None: unknown, nothing restored)."""
    data_parallel_after: int | None = None
    """Data-parallel size the job continues with (differs after an elastic reshard)."""
    detect_from: str = "the newest committed snapshot"
    """The event *detect* starts at: the fault as its witness saw it (``exit of process 1 seen by its launcher``),
    or the newest committed snapshot when the fault's time is unknown."""
    last_snapshot: float | None = None
    """The newest committed snapshot on any rank (unix seconds)."""
    path_png: Path | None = None
    path_json: Path | None = None

    @property
    def phase_names(self) -> tuple[str, ...]:
        return PHASES_INPROCESS if self.mode == MODE_INPROCESS else PHASES

    @property
    def event_names(self) -> tuple[str, ...]:
        return EVENTS_INPROCESS if self.mode == MODE_INPROCESS else EVENTS

    @property
    def spare_used(self) -> bool:
        return bool(self.spare_ranks)

    @property
    def resized(self) -> bool:
        """The data-parallel size changed in this recovery (an elastic reshard)."""
        return (self.data_parallel_before is not None and self.data_parallel_after is not None
                and self.data_parallel_before != self.data_parallel_after)

    def resize_note(self) -> str:
        """What an elastic reshard changed for training, in words (empty when nothing did)."""
        if not self.resized:
            return ""
        before, after = self.data_parallel_before, self.data_parallel_after
        assert before is not None and after is not None  # noqa: S101 - resized
        return (f"data-parallel size {before} -> {after}: the global batch is unchanged, so each rank trains "
                f"{before}/{after} = {before / after:.2f}x the micro-batches per step, and a step takes about "
                f"{before / after:.2f}x as long (throughput x {after / before:.2f})")

    @property
    def prepared_slot_wait_s(self) -> float | None:
        """The longest a rank's pull waited for its receive slot prepared in advance (None: no rank pulled into one):
        what of the preparation's cost still lay on the recovery's path."""
        return _agg([r.prepared_slot_wait for r in self.per_rank], "max")

    @property
    def origin(self) -> float | None:
        """Time zero of the timeline: the first known event."""
        return next((self.events[e] for e in self.event_names if self.events.get(e) is not None), None)

    @property
    def total_s(self) -> float:
        """Sum of the known phases: from the first to the last known event (the MTTR when all are known)."""
        return sum(v for v in self.phases.values() if v is not None)

    def summary(self) -> str:
        """One line: ``MTTR 8.42 s = detect 0.51 s + restart 2.10 s + ...``."""
        parts = " + ".join(f"{p.replace('_', ' ')} {_fmt_s(self.phases.get(p))}" for p in self.phase_names)
        what = f"iteration {self.iteration}" if self.iteration is not None else "nothing"
        spare = f", hot spare for rank(s) {list(self.spare_ranks)}" if self.spare_ranks else ""
        resized = f", data-parallel {self.data_parallel_before} -> {self.data_parallel_after}" if self.resized else ""
        return (f"MTTR {self.total_s:.2f} s = {parts} ({self.mode}{spare}{resized}; {self.outcome}: {what}; "
                f"attempt {self.attempt})")

    def to_json(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "mode": self.mode,
            "restarted_ranks": None if self.restarted_ranks is None else list(self.restarted_ranks),
            "spare_used": self.spare_used,
            "spare_ranks": list(self.spare_ranks),
            "data_parallel_before": self.data_parallel_before,
            "data_parallel_after": self.data_parallel_after,
            "outcome": self.outcome,
            "iteration": self.iteration,
            "mttr_s": self.total_s,
            "phases_s": {p: self.phases.get(p) for p in self.phase_names},
            "events_unix": {e: self.events.get(e) for e in self.event_names},
            "detect_from": self.detect_from,
            "last_snapshot_unix": self.last_snapshot,
            "process_group_ready_unix": self.process_group_ready,
            "prepared_slot_wait_s": self.prepared_slot_wait_s,
            "notes": list(self.notes),
            "recovery_phases_rank0_s": dict(self.recovery_phases),
            "per_rank_events_unix": [r.to_json() for r in self.per_rank],
            "definitions": {p: (_DEFINITIONS_INPROCESS.get(p) or _DEFINITIONS[p]) if self.mode == MODE_INPROCESS
                            else _DEFINITIONS[p] for p in self.phase_names},
        }


_DEFINITIONS = {
    "detect": "failure noticed by the earliest survivor - newest committed snapshot on any rank",
    "restart": "latest new worker process start - failure noticed",
    "rendezvous": "latest recovery start - latest process start (imports, process group, framework set-up)",
    "reconcile": "inventory + exchange of every rank's versions (latest rank)",
    "transfer": "replicas and lazy backups received (latest rank)",
    "restore": "verify, load, weight regeneration, RNG (latest rank)",
    "first_step": "end of rank 0's first training step after the restore - restore done",
}

_DEFINITIONS_INPROCESS = {
    "detect": "the in-process engine's abort began on the earliest survivor (or its failure event) - the fault as its "
              "earliest witness saw it (a launcher the exit, a monitor the last heartbeat; detect_from says which; the "
              "newest committed snapshot when unknown)",
    "abort": "every survivor's process groups aborted (latest survivor) - failure noticed",
    "reform": "latest recovery start - abort done (clean-ups, rank re-assignment, process group, parallel state, "
              "model and optimizer rebuilt in the same processes)",
}


def _fmt_s(v: float | None) -> str:
    return "?" if v is None else f"{v:.2f} s"


def restarted_ranks(per_rank: Sequence[RankEvents], *, failure: float | None) -> tuple[int, ...] | None:
    """Ranks whose process started after ``failure`` (None: ``failure`` unknown). A rank without a process start
    counts as restarted only if it is not a survivor (it has no abort)."""
    if failure is None:
        return None
    return tuple(i for i, r in enumerate(per_rank)
                 if (r.process_start is not None and r.process_start > failure)
                 or (r.process_start is None and r.abort_end is None))


def compute_timeline(per_rank: Sequence[RankEvents], *, first_step_end: float | None, attempt: int | str | AttemptInfo,
                     outcome: str, iteration: int | None, recovery_phases: Mapping[str, float] | None = None,
                     mode: str | None = None, data_parallel: tuple[int | None, int | None] = (None, None)
                     ) -> RecoveryTimeline:
    """Job-wide events from every rank's events, and the phases between them (pure).

    The earliest survivor's notice counts as the failure; for every other event the latest rank counts (the
    job waits for it). A missing event folds its phase into the next one; events out of order (clock skew
    between nodes) are clamped so no phase is negative.

    ``mode``: :data:`MODE_INPROCESS` or :data:`MODE_RESTART`; None: from ``attempt`` when it is an
    :class:`AttemptInfo` (an in-process restart iteration > 0), else from the data (in process when some rank's
    process predates the failure).
    """
    last_snapshot = _agg([r.last_snapshot for r in per_rank], "max")
    noticed = _agg([r.failure_noticed for r in per_rank], "min")
    # The failure happened after the newest commit; a process that started after it is a new one.
    restarted = restarted_ranks(per_rank, failure=last_snapshot if last_snapshot is not None else noticed)
    if mode is None:
        if isinstance(attempt, AttemptInfo):
            mode = MODE_INPROCESS if attempt.inprocess > 0 else MODE_RESTART
        else:
            mode = MODE_INPROCESS if restarted is not None and len(restarted) < len(per_rank) else MODE_RESTART
    if mode not in (MODE_RESTART, MODE_INPROCESS):
        raise ValueError(f"timeline mode {mode!r}: expected {MODE_RESTART!r} or {MODE_INPROCESS!r}")
    record = attempt.record if isinstance(attempt, AttemptInfo) else attempt
    spares = tuple(i for i, r in enumerate(per_rank) if r.activated_spare == 1.0)
    fault = _agg([r.fault for r in per_rank], "min")
    detect_from = "the newest committed snapshot"
    known = attempt.fault() if isinstance(attempt, AttemptInfo) and mode == MODE_INPROCESS else None
    if known is not None and (fault is None or known[0] <= fault):
        fault = known[0]  # rank 0 asked again, later: a witness whose record came after the others gathered theirs
    if mode == MODE_INPROCESS and fault is not None:
        what = known[1] if known is not None and known[0] == fault else None
        detect_from = f"the fault: {what}" if what else "the fault"
    events: dict[str, float | None] = {
        "fault": fault if fault is not None else last_snapshot,
        "last_snapshot": last_snapshot,
        "failure_noticed": noticed,
        "process_start": _agg([r.process_start for r in per_rank], "max"),
        "abort_end": _agg([r.abort_end for r in per_rank], "max"),
        "recovery_start": _agg([r.recovery_start for r in per_rank], "max"),
        "reconcile_end": _agg([r.reconcile_end for r in per_rank], "max"),
        "transfer_end": _agg([r.transfer_end for r in per_rank], "max"),
        "restore_end": _agg([r.restore_end for r in per_rank], "max"),
        "first_step_end": first_step_end,
    }
    notes: list[str] = []
    if events["last_snapshot"] is None and not detect_from.startswith("the fault"):
        notes.append("no committed snapshot carries a commit time: detect unknown, the timeline starts at the "
                     "first known event")
    names = PHASES_INPROCESS if mode == MODE_INPROCESS else PHASES
    event_names = EVENTS_INPROCESS if mode == MODE_INPROCESS else EVENTS
    if events["failure_noticed"] is None:
        notes.append("no surviving rank recorded the failure (every process died at once, or none was "
                     f"signalled): detect is folded into {names[1]}")
    if first_step_end is None:
        notes.append("no training step ran after the restore: first_step unknown")
    phases: dict[str, float | None] = {}
    known: float | None = events[event_names[0]]
    for name, end_event in zip(names, event_names[1:]):
        end = events[end_event]
        if end is None:
            phases[name] = None  # folded into the next phase
            continue
        if known is None:
            phases[name] = None  # start unknown
            known = end
            continue
        if end < known - _SKEW_NOTE_S and name == "detect" and detect_from.startswith("the fault"):
            # a survivor's collective can lose the dead peer before its launcher sees the exit: nothing to detect
            notes.append(f"a survivor noticed the failure {known - end:.3f} s before {detect_from[11:]}: detect 0")
        elif end < known - _SKEW_NOTE_S:
            notes.append(f"{end_event} is {known - end:.3f} s before the previous event (clock skew between "
                         f"nodes?): {name} clamped to 0")
        phases[name] = max(0.0, end - known)
        known = max(known, end)
    pg_ready = _agg([r.process_group_ready for r in per_rank], "max")
    return RecoveryTimeline(attempt=record, outcome=outcome, iteration=iteration,
                            events={e: events[e] for e in event_names}, phases=phases, notes=tuple(notes),
                            mode=mode, restarted_ranks=restarted, spare_ranks=spares, process_group_ready=pg_ready,
                            per_rank=tuple(per_rank), recovery_phases=dict(recovery_phases or {}),
                            data_parallel_before=data_parallel[0], data_parallel_after=data_parallel[1],
                            detect_from=detect_from, last_snapshot=last_snapshot)


# -- files ---------------------------------------------------------------------------------------------------


RENDER_WAIT_S = 30.0
"""How long :func:`wait_for_renders` waits by default, and a normal interpreter exit waits, for the pictures still
being drawn (about 1-2 s after the first step of a recovery; longer on a loaded machine)."""

_renders: list[tuple[subprocess.Popen, Path]] = []
_renders_lock = threading.Lock()
_exit_hook_pid: int | None = None


def _have_matplotlib() -> bool:
    """Whether matplotlib is installed, without importing it here (0.1-0.5 s on the training thread: the drawing
    process imports it)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def wait_for_renders(timeout: float | None = RENDER_WAIT_S) -> bool:
    """Wait for the PNGs being drawn in the background (:func:`write_timeline`), at most ``timeout`` seconds in all
    (None: until they are drawn). True when every picture is drawn (or its drawing ended with its one error line);
    False when the wait gave up (one warning line per picture: its drawing process dies with this one)."""
    with _renders_lock:
        pending, _renders[:] = list(_renders), []
    deadline = None if timeout is None else time.monotonic() + timeout
    done = True
    for proc, path_png in pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            proc.wait(left)
        except subprocess.TimeoutExpired:
            done = False
            logger.warning("neighbor_ckpt: gave up waiting %.0f s for the recovery timeline's picture %s (pid %d, "
                           "still drawing); its JSON is written", timeout, path_png, proc.pid)
    return done


def _wait_at_exit() -> None:
    """At a normal interpreter exit: the pictures still being drawn are finished first (bounded), since their
    processes die with this one (a short program that ends right after a recovery still gets its PNG)."""
    if os.getpid() == _exit_hook_pid:  # not in a forked child: its parent's drawings are not its own
        wait_for_renders(RENDER_WAIT_S)


def _render_in_background(path_json: Path, path_png: Path) -> None:
    """Draw ``path_png`` from ``path_json`` in a process of its own (:mod:`neighbor_ckpt.report.timeline_png`):
    matplotlib then shares no GIL with the training thread; it dies with this process (a killed rank leaves nothing
    behind), so :func:`wait_for_renders` and a normal interpreter exit wait for it. Its one error line goes to this
    process's stderr."""
    global _exit_hook_pid
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (package_root, env.get("PYTHONPATH"))))
    try:
        proc = subprocess.Popen(python_module_command("neighbor_ckpt.report.timeline_png", "--parent",
                                                      str(os.getpid()), str(path_json), str(path_png)),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env, close_fds=True)
    except OSError as e:  # reporting never stops training
        logger.warning("neighbor_ckpt: could not start drawing the recovery timeline %s: %s", path_png, e)
        return
    with _renders_lock:
        _renders[:] = [(p, png) for p, png in _renders if p.poll() is None] + [(proc, path_png)]
        if _exit_hook_pid != os.getpid():
            _exit_hook_pid = os.getpid()
            atexit.register(_wait_at_exit)


def write_timeline(timeline: RecoveryTimeline, directory: Path, *, png: bool = True,
                   background: bool = True) -> RecoveryTimeline:
    """Write ``recovery_timeline.attempt<N>.json`` (and ``.png``) to ``directory``; returns the timeline with
    its paths. Without matplotlib only the JSON is written (one warning line says so and how to get the PNG).

    ``background``: draw the PNG in a process of its own (:mod:`neighbor_ckpt.report.timeline_png`;
    :func:`wait_for_renders` waits for it), from the JSON, which is written before this returns either way."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"recovery_timeline.attempt{timeline.attempt}"
    path_json = directory / f"{stem}.json"
    path_png: Path | None = None
    if png:
        if not _have_matplotlib():
            logger.warning("neighbor_ckpt: recovery timeline written as JSON only (%s): the PNG needs matplotlib "
                           "(pip install matplotlib, or install neighbor-ckpt with the [lightning] or [nemo] extra)",
                           path_json)
        else:
            path_png = directory / f"{stem}.png"
    result = dataclasses.replace(timeline, path_png=path_png, path_json=path_json)
    data = dict(result.to_json(), png=str(path_png) if path_png else None)
    tmp = path_json.with_name(path_json.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path_json)
    if path_png is not None:
        if background:
            _render_in_background(path_json, path_png)
        else:
            from neighbor_ckpt.report.timeline_png import render_png

            try:
                render_png(data, path_png)
            except Exception as e:  # noqa: BLE001 - reporting never stops training
                logger.warning("neighbor_ckpt: could not draw the recovery timeline %s: %s", path_png, e)
    return result
