"""Judging recorded runs again, with this checkout's judge (``python -m tools.campaign --out DIR --rejudge 162``).

A judge can be wrong where the code it judges is right (it may ask for more than the design promises); a run is the
evidence, and an hour of a campaign is not run again to correct a check. :func:`rejudge` judges the recorded run of
each case named again, from its run directory and log, nothing run again, and replaces its outcome in
``outcomes.jsonl``; the new outcome's detail ends with what was recorded, and ``rejudged.json`` keeps, per case, the
judge's source and both outcomes (the results document carries it: :func:`~tools.campaign.report.results_document`).

The exit status of a run is not recorded. A run the judge got past the exit-status check had exit status 0, so only
such runs are judged again: an outcome recorded ``exact``, ``resized`` or ``fallback``, or ``FAILED`` by a later check;
a ``stopped`` one (its launch exited non-zero) or one ``FAILED`` before that check (no fault fired, an exit status)
is refused.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Sequence

from .cases import Outcome
from .report import load_outcomes
from .runner import baseline_dir, case_dir, inprocess_store, judge_run

__all__ = ["REJUDGED", "rejudge", "rejudged", "why_not_rejudged"]

REJUDGED = "rejudged.json"
"""Under the campaign's ``--out``: the cases judged again (``case``, ``judge``, ``was`` and ``now``)."""

_BEFORE_EXIT_CHECK = re.compile(r"exit -?\d+|the fault never fired|the kill during recovery never fired|"
                                r"\d+ of \d+ planned faults fired")


def why_not_rejudged(outcome: Outcome) -> str:
    """'' when ``outcome``'s run got past the exit-status check (exit status 0: it can be judged again), else why."""
    if outcome.result == "stopped":
        return "its launch exited non-zero (stopped), and exit statuses are not recorded"
    if outcome.result == "FAILED" and _BEFORE_EXIT_CHECK.match(outcome.detail):
        return f"it failed before the exit-status check ({outcome.detail[:80]})"
    return ""


def rejudged(work: Path) -> list[dict[str, Any]]:
    """What :func:`rejudge` recorded for the campaign in ``work`` (empty when nothing was judged again)."""
    path = work / REJUDGED
    return json.loads(path.read_text()) if path.exists() else []


def rejudge(work: Path, numbers: Sequence[int], *, steps: int, source: str) -> list[Outcome]:
    """Judge the recorded runs of cases ``numbers`` (from 1) of the campaign in ``work`` again, with this checkout's
    judge (``source``: its commit), and record the new outcomes; the campaign's outcomes, in order. Raises
    ValueError, before changing anything, for a case not recorded or not judged past the exit-status check
    (:func:`why_not_rejudged`)."""
    outcomes = load_outcomes(work / "outcomes.jsonl")
    at = {o.case.index + 1: i for i, o in enumerate(outcomes)}
    missing = [n for n in numbers if n not in at]
    if missing:
        raise ValueError(f"--rejudge: case(s) {missing} not recorded in {work / 'outcomes.jsonl'}")
    refused = {n: why for n in numbers if (why := why_not_rejudged(outcomes[at[n]]))}
    if refused:
        raise ValueError("--rejudge: " + "; ".join(f"case {n}: {why}" for n, why in refused.items()))
    records = rejudged(work)
    for n in numbers:
        was = outcomes[at[n]]
        case, out = was.case, case_dir(work, was.case)
        log = (out / ("launch.log" if case.inprocess else "torchrun.log")).read_text(errors="replace")
        now = judge_run(case, out=out, rc=0, log=log, wall=was.wall_s, base=baseline_dir(work, case.flavour),
                        work=work, steps=steps, config=work / "nckpt.yaml", store=inprocess_store(work, case))
        note = f"judged again by {source}: recorded {was.result}" + (f" ({was.detail})" if was.detail else "")
        now = dataclasses.replace(now, detail="; ".join(filter(None, (now.detail, note))))
        outcomes[at[n]] = now
        records.append({"case": n, "judge": source, "was": {"result": was.result, "detail": was.detail},
                        "now": {"result": now.result, "detail": now.detail}})
    lines = "".join(json.dumps(dataclasses.asdict(o)) + "\n" for o in outcomes)
    for path, text in ((work / "outcomes.jsonl", lines), (work / REJUDGED, json.dumps(records, indent=1) + "\n")):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return outcomes
