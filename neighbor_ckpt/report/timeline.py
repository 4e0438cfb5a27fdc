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

Where each time comes from:

* last completed snapshot: the ``committed_unix`` stamp in the header of the newest committed own or replica
  slot, newest over all ranks (headers survive a restart in the host store);
* failure noticed: a survivor's :func:`~neighbor_ckpt.recovery.journal.record_failure_event` (its SIGTERM handler
  / exception handler wrote ``events.json`` in its store directory), earliest over all ranks. When no survivor
  recorded anything (every process killed at once) *detect* is unknown and folded into *restart*; the JSON says so;
* process start: the kernel's start time of each worker (``/proc/self/stat``), latest over all ranks;
* process group ready: the first framework hook after ``init_process_group`` (a marker inside *rendezvous*);
* recovery phases: :class:`~neighbor_ckpt.recovery.flow.RecoveryReport` timings (inventory + exchange ->
  reconcile, transfer -> transfer, verify + load + adapter restore -> restore), latest over all ranks;
* first step: rank 0's end of its first training step (every rank finishes it within one gradient
  all-reduce of the others).

The per-rank events are exchanged with one all-gather of a small float64 tensor at the end of the recovery
flow (all ranks take part in it anyway); rank 0 computes and writes the timeline.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from neighbor_ckpt.runtime.procs import process_start
from neighbor_ckpt.snapshot.store import COMMIT_TIME_KEY, ROLE_OWN, ROLE_REPLICA, HostStore, SlotFile

logger = logging.getLogger(__name__)

__all__ = [
    "PHASES",
    "EVENTS",
    "RankEvents",
    "RecoveryTimeline",
    "compute_timeline",
    "gather_rank_events",
    "newest_commit_unix",
    "process_start_unix",
    "write_timeline",
    "COMMIT_TIME_KEY",
]

PHASES: tuple[str, ...] = ("detect", "restart", "rendezvous", "reconcile", "transfer", "restore", "first_step")
"""The MTTR breakdown, in order; phase ``i`` spans ``EVENTS[i]`` .. ``EVENTS[i + 1]``."""

EVENTS: tuple[str, ...] = ("last_snapshot", "failure_noticed", "process_start", "recovery_start", "reconcile_end",
                           "transfer_end", "restore_end", "first_step_end")
"""Job-wide events (unix seconds) that bound the phases."""

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

    attempt: int
    outcome: str
    iteration: int | None
    events: Mapping[str, float | None]
    phases: Mapping[str, float | None]
    notes: tuple[str, ...] = ()
    process_group_ready: float | None = None
    per_rank: tuple[RankEvents, ...] = ()
    recovery_phases: Mapping[str, float] = field(default_factory=dict)
    """Rank 0's :attr:`RecoveryReport.phases` (seconds)."""
    path_png: Path | None = None
    path_json: Path | None = None

    @property
    def origin(self) -> float | None:
        """Time zero of the timeline: the first known event."""
        return next((self.events[e] for e in EVENTS if self.events.get(e) is not None), None)

    @property
    def total_s(self) -> float:
        """Sum of the known phases: from the first to the last known event (the MTTR when all are known)."""
        return sum(v for v in self.phases.values() if v is not None)

    def summary(self) -> str:
        """One line: ``MTTR 8.42 s = detect 0.51 s + restart 2.10 s + ...``."""
        parts = " + ".join(f"{p.replace('_', ' ')} {_fmt_s(self.phases.get(p))}" for p in PHASES)
        what = f"iteration {self.iteration}" if self.iteration is not None else "nothing"
        return f"MTTR {self.total_s:.2f} s = {parts} ({self.outcome}: {what}; attempt {self.attempt})"

    def to_json(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "outcome": self.outcome,
            "iteration": self.iteration,
            "mttr_s": self.total_s,
            "phases_s": {p: self.phases.get(p) for p in PHASES},
            "events_unix": {e: self.events.get(e) for e in EVENTS},
            "process_group_ready_unix": self.process_group_ready,
            "notes": list(self.notes),
            "recovery_phases_rank0_s": dict(self.recovery_phases),
            "per_rank_events_unix": [r.to_json() for r in self.per_rank],
            "definitions": _DEFINITIONS,
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


def _fmt_s(v: float | None) -> str:
    return "?" if v is None else f"{v:.2f} s"


def compute_timeline(per_rank: Sequence[RankEvents], *, first_step_end: float | None, attempt: int, outcome: str,
                     iteration: int | None, recovery_phases: Mapping[str, float] | None = None) -> RecoveryTimeline:
    """Job-wide events from every rank's events, and the phases between them (pure).

    The earliest survivor's notice counts as the failure; for every other event the latest rank counts (the
    job waits for it). A missing event folds its phase into the next one; events out of order (clock skew
    between nodes) are clamped so no phase is negative.
    """
    events: dict[str, float | None] = {
        "last_snapshot": _agg([r.last_snapshot for r in per_rank], "max"),
        "failure_noticed": _agg([r.failure_noticed for r in per_rank], "min"),
        "process_start": _agg([r.process_start for r in per_rank], "max"),
        "recovery_start": _agg([r.recovery_start for r in per_rank], "max"),
        "reconcile_end": _agg([r.reconcile_end for r in per_rank], "max"),
        "transfer_end": _agg([r.transfer_end for r in per_rank], "max"),
        "restore_end": _agg([r.restore_end for r in per_rank], "max"),
        "first_step_end": first_step_end,
    }
    notes: list[str] = []
    if events["last_snapshot"] is None:
        notes.append("no committed snapshot carries a commit time: detect unknown, the timeline starts at the "
                     "first known event")
    if events["failure_noticed"] is None:
        notes.append("no surviving rank recorded the failure (every process died at once, or none was "
                     "signalled): detect is folded into restart")
    if first_step_end is None:
        notes.append("no training step ran after the restore: first_step unknown")
    phases: dict[str, float | None] = {}
    known: float | None = events[EVENTS[0]]
    for name, end_event in zip(PHASES, EVENTS[1:]):
        end = events[end_event]
        if end is None:
            phases[name] = None  # folded into the next phase
            continue
        if known is None:
            phases[name] = None  # start unknown
            known = end
            continue
        if end < known - _SKEW_NOTE_S:
            notes.append(f"{end_event} is {known - end:.3f} s before the previous event (clock skew between "
                         f"nodes?): {name} clamped to 0")
        phases[name] = max(0.0, end - known)
        known = max(known, end)
    pg_ready = _agg([r.process_group_ready for r in per_rank], "max")
    return RecoveryTimeline(attempt=attempt, outcome=outcome, iteration=iteration, events=events, phases=phases,
                            notes=tuple(notes), process_group_ready=pg_ready, per_rank=tuple(per_rank),
                            recovery_phases=dict(recovery_phases or {}))


# -- files ---------------------------------------------------------------------------------------------------


def write_timeline(timeline: RecoveryTimeline, directory: Path, *, png: bool = True) -> RecoveryTimeline:
    """Write ``recovery_timeline.attempt<N>.json`` (and ``.png``) to ``directory``; returns the timeline with
    its paths. Without matplotlib only the JSON is written (one warning line says so and how to get the PNG)."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"recovery_timeline.attempt{timeline.attempt}"
    path_json = directory / f"{stem}.json"
    path_png: Path | None = None
    if png:
        try:
            _render_png(timeline, directory / f"{stem}.png")
            path_png = directory / f"{stem}.png"
        except ImportError:
            logger.warning("neighbor_ckpt: recovery timeline written as JSON only (%s): the PNG needs matplotlib "
                           "(pip install matplotlib, or install neighbor-ckpt with the [lightning] or [nemo] extra)",
                           path_json)
    result = dataclasses.replace(timeline, path_png=path_png, path_json=path_json)
    tmp = path_json.with_name(path_json.name + ".tmp")
    tmp.write_text(json.dumps(dict(result.to_json(), png=str(path_png) if path_png else None), indent=1))
    os.replace(tmp, path_json)
    return result


_COLORS = {"detect": "#d62728", "restart": "#ff7f0e", "rendezvous": "#bcbd22", "reconcile": "#17becf",
           "transfer": "#1f77b4", "restore": "#2ca02c", "first_step": "#9467bd"}


def _segments(timeline: RecoveryTimeline) -> list[tuple[str, str, float, float]]:
    """(phase, label, start, duration) of every known phase, start in unix seconds."""
    out: list[tuple[str, str, float, float]] = []
    known = timeline.origin or 0.0
    for name, end_event in zip(PHASES, EVENTS[1:]):
        dur = timeline.phases.get(name)
        end = timeline.events.get(end_event)
        if end is None:
            continue  # folded into the next phase
        if dur is None:
            known = end  # start unknown: the bars start at the first known event
            continue
        label = name.replace("_", " ")
        if name == "restart" and timeline.phases.get("detect") is None and timeline.events.get("last_snapshot"):
            label = "restart (incl. detect)"
        out.append((name, label, known, dur))
        known += dur
    return out


def _draw_bars(ax: Any, segments: list[tuple[str, str, float, float]], origin: float, span: float,
               *, legend: bool) -> None:
    for name, label, start, dur in segments:
        ax.barh(0, dur, left=start - origin, height=0.5, color=_COLORS[name], edgecolor="white",
                label=f"{label}: {dur:.2f} s" if legend else None)
        if dur > 0.08 * span:
            ax.text(start - origin + dur / 2, 0, f"{label}\n{dur:.2f} s", ha="center", va="center", fontsize=8,
                    color="white")
    ax.set_yticks([])
    ax.set_ylim(-0.5, 0.6)
    ax.set_xlim(0, span * 1.02)


def _render_png(timeline: RecoveryTimeline, path: Path) -> None:
    """Gantt bars of the phases: the whole recovery, and a zoom on the phases once the new processes are up
    (object API and Agg canvas: pyplot's global backend is left alone)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    origin = timeline.origin or 0.0
    total = max(timeline.total_s, 1e-6)
    segments = _segments(timeline)
    tail = [seg for seg in segments if seg[0] in ("reconcile", "transfer", "restore", "first_step")]
    zoom = bool(tail) and sum(d for *_, d in tail) < 0.2 * total
    fig = Figure(figsize=(11, 4.6 if zoom else 3.4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2 if zoom else 1, 1, 1)
    _draw_bars(ax, segments, origin, total, legend=True)
    for label, t in (("failure noticed", timeline.events.get("failure_noticed")),
                     ("process group ready", timeline.process_group_ready)):
        if t is not None:
            x = t - origin
            ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
            ax.text(x, 0.33, f" {label} ", fontsize=7, va="bottom", ha="right" if x > 0.7 * total else "left")
    start_label = "last snapshot" if timeline.events.get("last_snapshot") is not None else "first known event"
    ax.set_xlabel(f"seconds since the {start_label}", fontsize=8)
    what = f"iteration {timeline.iteration}" if timeline.iteration is not None else "-"
    ax.set_title(f"neighbor_ckpt recovery, attempt {timeline.attempt}: {timeline.outcome} {what}, "
                 f"MTTR {timeline.total_s:.2f} s", fontsize=10)
    if zoom:
        zx = fig.add_subplot(2, 1, 2)
        z0 = tail[0][2]
        _draw_bars(zx, tail, z0, max(sum(d for *_, d in tail), 1e-6), legend=False)
        zx.set_xlabel("zoom: seconds since recovery began on every rank", fontsize=8)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    if timeline.notes:
        fig.text(0.01, 0.995, "; ".join(timeline.notes)[:220], fontsize=6, color="dimgray", va="top")
    fig.tight_layout(rect=(0, 0.12 if zoom else 0.18, 1, 0.97))
    fig.savefig(path, format="png")
