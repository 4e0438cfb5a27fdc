"""The recovery timeline's picture, drawn from its JSON in a process of its own.

``python -m neighbor_ckpt.report.timeline_png [--parent PID] TIMELINE.json OUT.png``. :func:`~neighbor_ckpt.report.
timeline.write_timeline` starts it after writing the JSON: matplotlib's import and drawing (~0.6 s of Python) then
share no GIL with rank 0's training thread, whose first step after a recovery is the one the MTTR ends with (drawn on
a thread, the picture made that step up to 0.3 s longer here). With ``--parent`` it dies with that process (Linux:
``PR_SET_PDEATHSIG``), so that a killed rank leaves no process behind; its JSON is there.

Imports nothing heavy (no torch): the JSON's fields are all it reads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

__all__ = ["render_png", "main"]

_COLORS = {"detect": "#d62728", "restart": "#ff7f0e", "rendezvous": "#bcbd22", "reconcile": "#17becf",
           "transfer": "#1f77b4", "restore": "#2ca02c", "first_step": "#9467bd", "abort": "#e377c2",
           "reform": "#8c564b"}
_LABELS = {"reform": "re-form groups"}


def _segments(phases: Mapping[str, Optional[float]], events: Mapping[str, Optional[float]],
              origin: float) -> list[tuple[str, str, float, float]]:
    """(phase, label, start, duration) of every known phase, start in unix seconds. ``phases`` and ``events`` in
    their timeline order (the JSON keeps it): phase ``i`` ends at event ``i + 1``."""
    out: list[tuple[str, str, float, float]] = []
    known = origin
    for name, end_event in zip(phases, list(events)[1:]):
        dur, end = phases.get(name), events.get(end_event)
        if end is None:
            continue  # folded into the next phase
        if dur is None:
            known = end  # start unknown: the bars start at the first known event
            continue
        label = _LABELS.get(name, name.replace("_", " "))
        if name == "restart" and phases.get("detect") is None and events.get("last_snapshot"):
            label = "restart (incl. detect)"
        out.append((name, label, known, dur))
        known += dur
    return out


def _draw_bars(ax: Any, segments: Sequence[tuple[str, str, float, float]], origin: float, span: float,
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


def render_png(timeline: Mapping[str, Any], path: Path) -> None:
    """Gantt bars of the phases of ``timeline`` (:meth:`RecoveryTimeline.to_json`): the whole recovery, and a zoom
    on the phases once the new processes are up (object API and Agg canvas: pyplot's global backend is left
    alone)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    phases: dict[str, Optional[float]] = dict(timeline["phases_s"])
    events: dict[str, Optional[float]] = dict(timeline["events_unix"])
    origin = next((t for t in events.values() if t is not None), 0.0)
    total = max(float(timeline["mttr_s"]), 1e-6)
    segments = _segments(phases, events, origin)
    tail = [seg for seg in segments if seg[0] in ("reconcile", "transfer", "restore", "first_step")]
    zoom = bool(tail) and sum(d for *_, d in tail) < 0.2 * total
    fig = Figure(figsize=(11, 4.6 if zoom else 3.4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2 if zoom else 1, 1, 1)
    _draw_bars(ax, segments, origin, total, legend=True)
    for label, t in (("failure noticed", events.get("failure_noticed")),
                     ("process group ready", timeline.get("process_group_ready_unix"))):
        if t is not None:
            x = t - origin
            ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
            ax.text(x, 0.33, f" {label} ", fontsize=7, va="bottom", ha="right" if x > 0.7 * total else "left")
    start_label = timeline.get("detect_from") or (
        "the last snapshot" if events.get("last_snapshot") is not None else "the first known event")
    ax.set_xlabel(f"seconds since {start_label}", fontsize=8)
    iteration, spares = timeline.get("iteration"), timeline.get("spare_ranks") or []
    what = f"iteration {iteration}" if iteration is not None else "-"
    spare = f", hot spare for rank(s) {list(spares)}" if spares else ""
    ax.set_title(f"neighbor_ckpt recovery ({timeline['mode']}{spare}), attempt {timeline['attempt']}: "
                 f"{timeline['outcome']} {what}, MTTR {total:.2f} s", fontsize=10)
    if zoom:
        zx = fig.add_subplot(2, 1, 2)
        z0 = tail[0][2]
        _draw_bars(zx, tail, z0, max(sum(d for *_, d in tail), 1e-6), legend=False)
        zx.set_xlabel("zoom: seconds since recovery began on every rank", fontsize=8)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    notes = timeline.get("notes") or []
    if notes:
        fig.text(0.01, 0.995, "; ".join(notes)[:220], fontsize=6, color="dimgray", va="top")
    fig.tight_layout(rect=(0, 0.12 if zoom else 0.18, 1, 0.97))
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(path)  # a reader never sees half a picture


def _die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` ends (Linux; elsewhere nothing); exit now if it has ended already."""
    import ctypes
    import os
    import signal

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        raise SystemExit(0)  # the parent died before the prctl: nobody waits for the picture


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 4 and args[0] == "--parent" and args[1].isdigit():
        _die_with(int(args[1]))
        args = args[2:]
    if len(args) != 2:
        print("usage: python -m neighbor_ckpt.report.timeline_png [--parent PID] TIMELINE.json OUT.png",
              file=sys.stderr)
        return 2
    try:
        render_png(json.loads(Path(args[0]).read_text()), Path(args[1]))
    except Exception as e:  # noqa: BLE001 - one line, not a traceback, in the training job's log
        print(f"neighbor_ckpt: could not draw the recovery timeline {args[1]}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
