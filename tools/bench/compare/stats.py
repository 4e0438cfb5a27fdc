"""Statistics of a run's gathered step times: medians, bootstrap intervals, overheads and the 10x verdict."""

from __future__ import annotations

import math
import random
import statistics
from typing import Any, Callable, Sequence

from tools.bench.compare.systems import ALTERNATIVES


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _boot_ci(a: Sequence[float], b: Sequence[float], fn: Callable[[float, float], float], n: int = 2000,
             seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of ``fn(median(a), median(b))`` (steps resampled independently)."""
    if not a or not b:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    vals = []
    for _ in range(n):
        ma = statistics.median(rng.choices(a, k=len(a)))
        mb = statistics.median(rng.choices(b, k=len(b)))
        vals.append(fn(ma, mb))
    vals.sort()
    return vals[int(0.025 * n)], vals[int(0.975 * n) - 1]


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios, overheads and the 10x verdict of one run's JSON."""
    main = res["main"]
    vs = main["variants"]
    base = vs.get("base", {}).get("step_s", [])
    mb = _median(base)
    rows = {}
    for name, v in vs.items():
        s = v["step_s"]
        m = _median(s)
        lo, hi = _boot_ci(s, base, lambda x, y: x - y) if name != "base" else (0.0, 0.0)
        # Paired by round: median over rounds of (median of the variant's block - median of base's block).
        by_round: dict[int, list[float]] = {}
        for t, r in zip(s, v["round"]):
            by_round.setdefault(r, []).append(t)
        base_round: dict[int, list[float]] = {}
        for t, r in zip(base, vs.get("base", {}).get("round", [])):
            base_round.setdefault(r, []).append(t)
        paired = [_median(by_round[r]) - _median(base_round[r]) for r in by_round if r in base_round]
        rows[name] = {"label": v["label"], "note": v.get("note", ""), "median_s": m, "n": len(s),
                      "ratio": m / mb if mb else float("nan"), "overhead_s": m - mb, "overhead_ci": (lo, hi),
                      "paired_overhead_s": _median(paired), "bytes_per_save_job": v.get("bytes_per_save_job"),
                      "min_s": min(s) if s else float("nan"), "max_s": max(s) if s else float("nan"),
                      "extra": v.get("extra_median", {}), "extra_max": v.get("extra_max_rank_median", {}),
                      "cpu": v.get("cpu_ms_per_step", {})}
    alts = {k: r for k, r in rows.items() if k in ALTERNATIVES}
    best = min(alts, key=lambda k: alts[k]["overhead_s"]) if alts else None
    verdict: dict[str, Any] = {"best": best}
    if best and "neighbor" in rows:
        on, ob = rows["neighbor"]["overhead_s"], alts[best]["overhead_s"]
        verdict["neighbor_overhead_s"] = on
        verdict["best_overhead_s"] = ob
        # ob <= 0: the best alternative costs nothing measurable; no ratio can be claimed (nan).
        verdict["ratio"] = float("nan") if ob <= 0 else ob / on if on > 0 else math.inf
        nb_steps, best_steps = vs["neighbor"]["step_s"], vs[best]["step_s"]
        verdict["ratio_ci"] = _boot_ci(best_steps, nb_steps,
                                       lambda x, y: (x - mb) / (y - mb) if y - mb > 0 else math.inf, seed=1)
        verdict["met"] = verdict["ratio"] >= 10
        pn, pb = rows["neighbor"]["paired_overhead_s"], alts[best]["paired_overhead_s"]
        verdict["paired_ratio"] = float("nan") if pb <= 0 else pb / pn if pn > 0 else math.inf
    return {"rows": rows, "base_s": mb, "verdict": verdict}


def best_alternative(main: dict[str, Any]) -> str | None:
    """The alternative with the lowest median step time (from gathered data: the same on every rank)."""
    cands = {k: statistics.median(v["step_s"]) for k, v in main["variants"].items()
             if k in ALTERNATIVES and v["step_s"]}
    return min(cands, key=lambda k: cands[k]) if cands else None
