"""The figures of docs/benchmarks.md, drawn from the benchmarks' raw JSON (and, for goodput, from the planner)::

    python -m tools.bench.plots --compare benchmarks/results/compare_h100_2026-11-24.json \\
        --micro benchmarks/results/micro_cpu_2026-11-24.json --out benchmarks

writes ``step_overhead_h100.png`` (every variant's per-step overhead, one run), ``restore_breakdown.png`` (where a
restore's time goes, against the raw transfer of the same bytes) and ``goodput_1024_h100.png`` (lost goodput of
per-iteration neighbor checkpoints against a disk checkpoint at its optimal interval). Nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Sequence

__all__ = ["step_overhead", "restore_breakdown", "goodput_curve", "main"]

_NEIGHBOR = "#1f77b4"
_OTHER = "#9a9a9a"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def overheads_ms(compare: dict[str, Any]) -> dict[str, float]:
    """Median step minus the base median, ms, per variant of a ``bench --compare --json`` run (main section)."""
    variants = compare["main"]["variants"]
    base = statistics.median(variants["base"]["step_s"])
    return {name: 1e3 * (statistics.median(v["step_s"]) - base) for name, v in variants.items() if name != "base"}


def step_overhead(compare: dict[str, Any], out: Path) -> Path:
    """Horizontal bars, log scale: per-step overhead of every variant, neighbor_ckpt highlighted."""
    plt = _pyplot()
    ovh = {k: v for k, v in overheads_ms(compare).items() if not k.startswith("neighbor_")}
    names = sorted(ovh, key=ovh.get)
    machine = compare.get("machine", {})
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(names) + 1.6))
    vals = [max(ovh[n], 0.1) for n in names]
    ax.barh(names, vals, color=[_NEIGHBOR if n == "neighbor" else _OTHER for n in names])
    for y, (n, v) in enumerate(zip(names, vals)):
        ax.text(v * 1.1, y, f"{ovh[n]:,.1f} ms", va="center", fontsize=9)
    ax.set_xscale("log")
    ax.set_xlim(0.5, max(vals) * 8)
    ax.set_xlabel("added to every training step (ms, median step minus the no-checkpoint median; log scale)")
    base = 1e3 * statistics.median(compare["main"]["variants"]["base"]["step_s"])
    gpu = machine.get("gpu_name") or f"{machine.get('nproc', '?')}-core CPU"
    ax.set_title(f"Checkpoint after every optimizer step: {compare['main'].get('params', 0) / 1e6:.0f} M-param "
                 f"mcore GPT, {gpu}\n(base step {base:.0f} ms; one run, interleaved blocks)", fontsize=10)
    fig.tight_layout()
    path = out / "step_overhead_h100.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def restore_breakdown(micro: dict[str, Any], out: Path) -> Path:
    """Stacked bars per ring size: the lost-store restore's phases against the raw transfer + copy."""
    plt = _pyplot()
    rows = {r["metric"]: r for r in micro["rows"] if r["section"] == "restore" and "lost store" in r["metric"]
            and "raw_gloo_seconds" in (r.get("detail") or {})}  # the target row of each ring size
    fig, ax = plt.subplots(figsize=(8, 3.2))
    labels, y = [], 0
    colors = {"reconcile": "#c7c7c7", "transfer": _NEIGHBOR, "verify": "#ff7f0e", "copy": "#2ca02c",
              "raw gloo": "#17becf", "raw copy": "#98df8a"}
    drawn: set[str] = set()
    for metric in sorted(rows):
        r = rows[metric]
        world = metric.split("W=")[1].split(",")[0]
        ph = r["detail"]["phases"]
        ours = [("reconcile", ph["inventory"] + ph["exchange"] + ph["load"]), ("transfer", ph["transfer"]),
                ("verify", ph["verify"]), ("copy", ph["copy"])]
        raw_gloo = r["detail"]["raw_gloo_seconds"]
        raw = [("raw gloo", raw_gloo), ("raw copy", max(r["baseline"] - raw_gloo, 0.0))]
        for parts, label in ((raw, f"W={world} raw transfer"), (ours, f"W={world} restore ({r['ratio']:.2f}x)")):
            left = 0.0
            for name, sec in parts:
                ax.barh(y, 1e3 * sec, left=1e3 * left, color=colors[name],
                        label=name if name not in drawn else None)
                drawn.add(name)
                left += sec
            labels.append(label)
            y += 1
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("ms (medians); 256 MiB of unique state, the rank that lost its store")
    ax.set_title("Restore of a replaced node vs moving the same bytes (target <= 1.5x)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = out / "restore_breakdown.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def goodput_curve(out: Path, *, iteration_s: float = 4.5, gpus: int = 1024, gpus_per_node: int = 8,
                  gpu_mtbf_hours: float = 80_000.0, disk_blocking_s: Sequence[float] = (2.6, 10.0, 60.0),
                  measured_pct: Sequence[float] = ()) -> Path:
    """Lost goodput vs the per-iteration overhead of neighbor checkpoints (MTTR 60 s), against disk checkpoints at
    Young's optimal interval (MTTR 15 min), with the planner's formulas (FlashRecovery eq. 1-4)."""
    from neighbor_ckpt.planning.goodput import goodput_loss, min_goodput_loss

    plt = _pyplot()
    nodes = gpus // gpus_per_node
    node_mtbf_s = gpu_mtbf_hours / gpus_per_node * 3600
    xs = [10 ** (-2 + 4 * i / 200) for i in range(201)]  # 0.01% .. 100% of a step
    ys = [100 * goodput_loss(interval_s=iteration_s, overhead_s=x / 100 * iteration_s, mttr_s=60,
                             node_mtbf_s=node_mtbf_s, nodes=nodes) for x in xs]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(xs, ys, color=_NEIGHBOR, label="neighbor_ckpt every iteration (MTTR 60 s)")
    for k0 in disk_blocking_s:
        loss = 100 * min_goodput_loss(overhead_s=k0, mttr_s=900, node_mtbf_s=node_mtbf_s, nodes=nodes)
        ax.axhline(loss, color=_OTHER, ls="--", lw=1)
        ax.text(0.011, loss * 1.06, f"disk, optimal interval, {k0:g} s/save", fontsize=8, color="#555555")
    for pct in measured_pct:
        loss = 100 * goodput_loss(interval_s=iteration_s, overhead_s=pct / 100 * iteration_s, mttr_s=60,
                                  node_mtbf_s=node_mtbf_s, nodes=nodes)
        ax.plot([pct], [loss], "o", color=_NEIGHBOR)
        ax.annotate(f"{pct:g}%: measured, one H100, DP = 1\n(3 GiB snapshotted and hashed per step)", (pct, loss),
                    textcoords="offset points", xytext=(30, -40), fontsize=8,
                    arrowprops={"arrowstyle": "->", "color": _NEIGHBOR})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("neighbor_ckpt overhead per iteration (% of a step)")
    ax.set_ylabel("lost goodput (%)")
    ax.set_title(f"Lost goodput on {gpus} H100s (GPU MTBF {gpu_mtbf_hours:,.0f} h, {iteration_s:g} s iterations; "
                 f"planner)\ndisk checkpoints: MTTR 15 min", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0.02, 200)
    fig.tight_layout()
    path = out / "goodput_1024_h100.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.plots", description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", type=Path, required=True, help="a `bench --compare --json` file")
    ap.add_argument("--micro", type=Path, required=True, help="a `scripts/bench --json` file")
    ap.add_argument("--out", type=Path, default=Path("benchmarks"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    compare = json.loads(args.compare.read_text())
    micro = json.loads(args.micro.read_text())
    ovh = overheads_ms(compare)
    base = 1e3 * statistics.median(compare["main"]["variants"]["base"]["step_s"])
    for path in (step_overhead(compare, args.out), restore_breakdown(micro, args.out),
                 goodput_curve(args.out, measured_pct=[round(100 * ovh["neighbor"] / base, 2)])):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
