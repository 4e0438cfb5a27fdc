"""``--projection``: the planner tables of the full-size job files and the goodput of per-iteration neighbor
checkpoints against a disk checkpoint on H100s (pure arithmetic, optionally with a run's measured ratios)."""

from __future__ import annotations

from typing import Any

from tools.bench.compare.stats import summarize
from tools.bench.compare.tables import md_table


def projection(measured: dict[str, Any] | None = None, *, gpus: int = 1024, gpu_mtbf_hours: float = 80_000.0,
               gpus_per_node: int = 8) -> str:
    """Planner tables of the full-size job files and goodput of per-iteration neighbor checkpoints vs a 30-minute
    disk checkpoint on ``gpus`` H100s (``measured``: a run's JSON, for the measured overhead ratios)."""
    from neighbor_ckpt.planning.jobspec import load_job
    from neighbor_ckpt.planning.goodput import (goodput_loss, loss_breakdown, optimal_interval, p_recovery,
                                                p_unrecoverable, ring_nodes_for)

    out: list[str] = []
    from neighbor_ckpt.recipes import CONFIGS_DIR

    for name in ("llama3_8b", "llama3_70b", "gpt3_175b"):
        job = load_job(CONFIGS_DIR / f"{name}.yaml")
        out.append(f"$ neighbor-ckpt plan configs/{name}.yaml")
        out.append(job.plan().format_table())
        out.append("")

    nodes = gpus // gpus_per_node
    node_mtbf_s = gpu_mtbf_hours / gpus_per_node * 3600
    job = load_job(CONFIGS_DIR / "llama3_70b.yaml", [f"trainer.num_nodes={nodes}"])
    plan = job.plan()
    t_it = max(c.compute_seconds for c in plan.classes)
    p = job.parallelism
    ring = ring_nodes_for(tp=p.tensor, cp=p.context, dp=job.data_parallel, gpus_per_node=gpus_per_node)
    members = job.data_parallel * p.context
    # Measured ratios (this machine): the best alternative's step-time ratio, neighbor_ckpt's, at the largest model
    # of the run (the one least dominated by per-save fixed costs).
    best_ratio = nb_ratio = nb_thread_s = None
    best_name, where = "-", ""
    if measured is not None:
        sections = [measured["main"], *measured.get("scaling", [])]
        sec = max(sections, key=lambda x: x.get("params", 0))
        s = summarize({"main": sec})
        where = f"hidden {sec.get('hidden')}, {sec.get('params', 0):,} params"
        b = s["verdict"].get("best")
        if b:
            best_ratio, best_name = s["rows"][b]["ratio"], s["rows"][b]["label"]
        if "neighbor" in s["rows"]:
            nb_ratio = s["rows"]["neighbor"]["ratio"]
            ex = s["rows"]["neighbor"]["extra"]
            nb_thread_s = ex.get("snapshot_call_s", 0.0) + ex.get("wait_s", 0.0)
    out.append(f"Goodput on {gpus} H100s ({nodes} nodes x {gpus_per_node}), per-GPU MTBF {gpu_mtbf_hours:,.0f} h -> "
               f"node MTBF {gpu_mtbf_hours / gpus_per_node:,.0f} h, job MTBF {gpu_mtbf_hours / gpus:.1f} h; iteration "
               f"time {t_it:.1f} s = the planner's compute time of configs/llama3_70b.yaml at "
               f"trainer.num_nodes={nodes} (tp {p.tensor} x pp {p.pipeline} x cp {p.context} x dp "
               f"{job.data_parallel}).")
    rows = []

    def add(label: str, interval: float, overhead: float, mttr: float) -> None:
        lb = loss_breakdown(interval_s=interval, overhead_s=overhead, mttr_s=mttr, node_mtbf_s=node_mtbf_s,
                            nodes=nodes)
        tot = goodput_loss(interval_s=interval, overhead_s=overhead, mttr_s=mttr, node_mtbf_s=node_mtbf_s,
                           nodes=nodes)
        rows.append([label, f"{interval:,.1f}", f"{overhead:.3g}", f"{mttr:.0f}", f"{100 * lb.checkpoint:.3f}%",
                     f"{100 * lb.rollback:.3f}%", f"{100 * lb.restart:.3f}%", f"{100 * tot:.2f}%",
                     f"{100 * (1 - tot):.2f}%"])

    for frac in (0.001, 0.01):
        add(f"neighbor_ckpt every iteration, overhead {100 * frac:g}% of a step (assumed)", t_it, frac * t_it, 60)
    if nb_thread_s is not None:
        add(f"neighbor_ckpt every iteration, training-thread cost only ({1e3 * nb_thread_s:.1f} ms: snapshot() + "
            f"wait point, measured here)", t_it, nb_thread_s, 60)
    if nb_ratio is not None:
        add(f"neighbor_ckpt every iteration, overhead {100 * (nb_ratio - 1):.1f}% (measured here, {where})", t_it,
            max(0.0, nb_ratio - 1) * t_it, 60)
    if best_ratio is not None:
        k0 = max(0.0, best_ratio - 1) * t_it
        add(f"disk every 30 min, blocking {100 * (best_ratio - 1):.0f}% of a step ({best_name}, measured here)", 1800,
            k0, 900)
        t_star = optimal_interval(overhead_s=k0, node_mtbf_s=node_mtbf_s, nodes=nodes)
        if t_star > 0:
            add(f"disk at Young's optimum t*={t_star / 60:.1f} min, same blocking", t_star, k0, 900)
    for k0 in (10.0, 60.0):
        add(f"disk every 30 min, blocking {k0:.0f} s per save", 1800, k0, 900)
        t_star = optimal_interval(overhead_s=k0, node_mtbf_s=node_mtbf_s, nodes=nodes)
        add(f"disk at Young's optimum t*={t_star / 60:.1f} min, blocking {k0:.0f} s", t_star, k0, 900)
    out.append(md_table(["scenario", "interval s", "overhead s/ckpt", "MTTR s", "ckpt loss", "rollback loss",
                       "restart loss", "total loss", "goodput"], rows))
    # Break-even: the per-iteration overhead fraction at which neighbor_ckpt loses as much as the disk checkpoint.
    nb_fixed = loss_breakdown(interval_s=t_it, overhead_s=0.0, mttr_s=60, node_mtbf_s=node_mtbf_s, nodes=nodes)
    for k0 in ([max(0.0, best_ratio - 1) * t_it] if best_ratio is not None else []) + [10.0, 60.0]:
        t_star = optimal_interval(overhead_s=k0, node_mtbf_s=node_mtbf_s, nodes=nodes)
        disk = goodput_loss(interval_s=max(t_star, t_it), overhead_s=k0, mttr_s=900, node_mtbf_s=node_mtbf_s,
                            nodes=nodes)
        out.append(f"* against a disk checkpoint blocking {k0:.3g} s at its optimal interval (loss {100 * disk:.2f}%), "
                   f"per-iteration neighbor checkpointing wins while its overhead stays below "
                   f"{100 * (disk - nb_fixed.rollback - nb_fixed.restart):.2f}% of a step")
    out.append("")
    out.append(f"In-memory state lost (falls back to the disk checkpoint) when k of the {nodes} nodes fail at once; "
               f"DP rings of {members} members (dp x cp) over {ring} nodes each "
               f"(ring_nodes_for(tp={p.tensor}, cp={p.context}, dp={job.data_parallel}, "
               f"gpus_per_node={gpus_per_node})):")
    prow = [[str(k), f"{p_unrecoverable(nodes, members, k, ring_nodes=ring):.3g}"] for k in (1, 2, 3, 4)]
    out.append(md_table(["k simultaneous node failures", "p_unrecoverable"], prow))
    for hours in (3.0, 12.0):
        pr = p_recovery(nodes, members, hours=hours, gpu_mtbf_hours=gpu_mtbf_hours, ring_nodes=ring,
                        gpus_per_node=gpus_per_node)
        out.append(f"p_recovery({hours:g} h) = {pr:.6f}: probability that the node failures of a {hours:g} h window, "
                   f"taken as simultaneous (FFTrainer eq. 5, the windows of its Table 6), are all recoverable from "
                   f"host memory")
    return "\n".join(out)
