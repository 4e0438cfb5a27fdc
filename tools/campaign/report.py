"""What a campaign reports: per kind, its outcomes, the detection times and the MTTR of each recovery mode (a
markdown table), and the whole campaign as one JSON document (settings, commit, machine, verdict, every outcome)."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from .cases import KINDS, Case, Outcome

__all__ = ["MODES", "RESULTS", "detection", "load_outcomes", "mttrs", "recovery_mode", "results_document", "summarize",
           "summary"]

RESULTS = ("exact", "resized", "fallback", "stopped", "FAILED")
"""The outcomes a case can have, in table order (:class:`~tools.campaign.cases.Outcome`)."""

MODES = ("in-process", "restart", "insurance")
"""How a recovered case came back, for its MTTR: ``in-process`` (a hot spare took the lost rank's place, or the job
shrank: no process restarted), ``restart`` (the restart path restored from the host stores: a restart-path case, or an
in-process case whose recovery gave up, announced), ``insurance`` (the announced fallback to the insurance
checkpoint)."""


def recovery_mode(outcome: Outcome) -> str | None:
    """The :data:`MODES` entry ``outcome`` recovered by; None when it did not recover (``stopped``, ``FAILED``). A
    ``restart`` of an in-process case is one whose restart attempt ran (:func:`~tools.campaign.runner.judge_run`)."""
    if outcome.result == "fallback":
        return "restart" if "gave up" in outcome.detail else "insurance"
    if outcome.result in ("exact", "resized"):
        return "in-process" if outcome.case.inprocess else "restart"
    return None


def mttrs(outcome: Outcome) -> list[float]:
    """The MTTR of every recovery of ``outcome`` (:attr:`Outcome.recoveries`; an outcome recorded before they were
    kept: its one ``mttr_s``)."""
    every = [float(r["mttr_s"]) for r in outcome.recoveries if r.get("mttr_s") is not None]
    return every or ([outcome.mttr_s] if outcome.mttr_s is not None else [])


def detection(outcome: Outcome) -> float | None:
    """How long ``outcome``'s fault took to be detected: its own :attr:`Outcome.detection_s` (a hang, a whole node, a
    partition: from the fault the campaign injected), else its first recovery's ``detect`` phase (a kill: from the
    exit as its launcher saw it, which is the fault); None when neither is known."""
    if outcome.detection_s is not None:
        return outcome.detection_s
    return next((float(r["detection_s"]) for r in outcome.recoveries if r.get("detection_s") is not None), None)


def _spread(values: Sequence[float]) -> dict[str, float | int] | None:
    return {"n": len(values), "median": statistics.median(values), "max": max(values)} if values else None


def summary(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per kind drawn (in :data:`~tools.campaign.cases.KINDS` order) and a last one for ``all``: the number of
    cases, the count of each of :data:`RESULTS`, ``unexpected`` (fallbacks where an in-memory version should have
    existed: not a failure, nothing wrong was loaded, but a rollback further than needed), the detection times
    (:func:`detection`) and, per :data:`MODES` entry, the MTTRs of every recovery of its cases (a two-fault case
    counts twice; each ``{"n", "median", "max"}`` in seconds, or None)."""
    rows = []
    for kind in [k for k in KINDS if any(o.case.kind == k for o in outcomes)] + ["all"]:
        mine = [o for o in outcomes if kind in ("all", o.case.kind)]
        row: dict[str, Any] = {"kind": kind, "cases": len(mine)}
        row.update({r: sum(o.result == r for o in mine) for r in RESULTS})
        row["unexpected"] = sum(o.result == "fallback" and not o.case.may_fall_back for o in mine)
        row["detection_s"] = _spread([d for o in mine if (d := detection(o)) is not None])
        row["mttr_s"] = {mode: _spread([m for o in mine if recovery_mode(o) == mode for m in mttrs(o)])
                         for mode in MODES}
        rows.append(row)
    return rows


def _cell(spread: dict[str, float | int] | None, digits: int) -> str:
    return f"{spread['median']:.{digits}f} / {spread['max']:.{digits}f}" if spread else "-"


def summarize(outcomes: Sequence[Outcome]) -> str:
    """The campaign table (markdown) of :func:`summary`: outcome counts per kind, detection times (median / max) and
    the MTTR (median / max, over every recovery) of each recovery mode."""
    lines = ["| fault | cases | exact | resized | fallback | (unexpected) | stopped | FAILED | detection s (median / max) "
             "| MTTR s in process (median / max) | MTTR s restart (median / max) | MTTR s insurance (median / max) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summary(outcomes):
        cells = [row["kind"], row["cases"], row["exact"], row["resized"], row["fallback"], row["unexpected"],
                 row["stopped"], row["FAILED"], _cell(row["detection_s"], 2),
                 *(_cell(row["mttr_s"][mode], 2) for mode in MODES)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def results_document(settings: dict[str, Any], outcomes: Sequence[Outcome], *,
                     machine: dict[str, Any] | None = None,
                     rejudged: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The campaign as one JSON-able document: its ``settings`` (seed, options, the commit as ``source``), the
    machine, a verdict (faults run, whether that is every case drawn, kinds drawn and not drawn, the numbers of the
    FAILED cases; ``passed``: complete and none FAILED), the :func:`summary` rows, every outcome and, when recorded
    runs were judged again (:mod:`tools.campaign.rejudge`), each of those with the judge's commit and both
    outcomes."""
    failed = [o.case.index + 1 for o in outcomes if o.result == "FAILED"]
    drawn = sorted({o.case.kind for o in outcomes}, key=KINDS.index)
    planned = len(settings["only"]) if settings.get("only") else settings.get("faults")
    return {
        "campaign": dict(settings),
        "machine": machine,
        "verdict": {"faults": len(outcomes), "complete": len(outcomes) == planned, "kinds_drawn": drawn,
                    "kinds_not_drawn": [k for k in settings.get("kinds", KINDS) if k not in drawn],
                    "failed_cases": failed, "passed": len(outcomes) == planned and not failed},
        "summary": summary(outcomes),
        "outcomes": [asdict(o) for o in outcomes],
        **({"rejudged": list(rejudged)} if rejudged else {}),
    }


def _outcome_from_json(record: dict[str, Any]) -> Outcome:
    return Outcome(**{**record, "case": Case(**record["case"]),
                      "recoveries": tuple(record.get("recoveries") or ())})


def load_outcomes(path: Path) -> list[Outcome]:
    """The outcomes a campaign appended to ``path`` (one JSON object per line), in order."""
    if not path.exists():
        return []
    return [_outcome_from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
