"""Rendering: one run's tables (the side-by-side table, its notes, the scaling table) as text."""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Sequence

from tools.bench.compare.stats import summarize
from tools.bench.compare.systems import DESCRIPTIONS, DIAGNOSTICS, VARIANTS


def _fmt_bytes(n: float | None) -> str:
    if n is None or n != n:
        return "-"
    for unit, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= s:
            return f"{n / s:.2f} {unit}"
    return f"{int(n)} B"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = ["| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                       for i, (c, w) in enumerate(zip(r, widths))) + " |")
    return "\n".join(lines)


def _cpu_cell(cpu_ms: float | None, base_ms: float, name: str) -> str:
    if cpu_ms is None or cpu_ms != cpu_ms:
        return "-"
    return f"{cpu_ms:.0f}" if name == "base" else f"{cpu_ms:.0f} ({cpu_ms - base_ms:+.0f})"


def _ms(x: float) -> str:
    return "-" if x != x else f"{1e3 * x:.1f}"


def d2h_line(res: dict[str, Any], hardware: str = "h100") -> str | None:
    """--device cuda: neighbor_ckpt's measured D2H staging bandwidth (unique bytes per rank / median background copy
    time) next to the bandwidth the planner assumes for ``hardware``; None for CPU runs or without the data."""
    from neighbor_ckpt.planning.planner import HARDWARE

    main = res["main"]
    nb = main["variants"].get("neighbor")
    if res.get("device") != "cuda" or not nb:
        return None
    copy_s = nb.get("extra_median", {}).get("bg_copy_s")
    uniq = [u for u in main.get("neighbor_unique_bytes_per_rank", []) if u]
    if not copy_s or copy_s != copy_s or copy_s <= 0 or not uniq:
        return None
    ub = statistics.median(uniq)
    assumed = HARDWARE[hardware].pcie_gbytes_per_s
    return (f"* neighbor_ckpt D2H staging: {_fmt_bytes(ub)} of unique state per rank into its page-locked /dev/shm "
            f"slot in {_ms(copy_s)} ms (median over steps, median over ranks; engine stats.stage_seconds: the "
            f"side-stream copy, including any wait for the step's last kernels) = {ub / copy_s / 1e9:.1f} GB/s per "
            f"GPU; the planner assumes "
            f"{assumed:g} GB/s (neighbor_ckpt.planning.planner.HARDWARE['{hardware}'].pcie_gbytes_per_s)")


def render(res: dict[str, Any], info: dict[str, Any], args: argparse.Namespace) -> str:
    out: list[str] = []
    main = res["main"]
    s = summarize(res)
    rows, verdict = s["rows"], s["verdict"]
    cuda = res.get("device") == "cuda"
    if cuda:
        out.append(f"neighbor_ckpt side-by-side benchmark | {res['world']} x {info.get('gpu_name', 'GPU?')} of "
                   f"{info.get('gpu_count', '?')} (driver {info.get('gpu_driver', '?')}, {info.get('gpu_pcie', '?')}) | "
                   f"torch {info['torch']}, CUDA {info.get('torch_cuda')}, NCCL {info.get('nccl', '?')}, python "
                   f"{info.get('python', '?')} | {info['nproc']} CPU(s) {info['cpu_model']} | {res['world']} NCCL "
                   f"rank(s), one GPU and {args.threads} intra-op thread(s) each | store {info['store_root']}")
        out.append(f"model: mcore GPT, {args.layers} layers, hidden {main['hidden']}, heads {args.heads}, seq "
                   f"{args.seq}, vocab {args.vocab}: {main['params']:,} params, bf16 with fp32 main params; "
                   f"distributed optimizer over DP={res['world']}; {args.micro_batches} micro-batches x "
                   f"{args.micro_batch_size} per rank per step")
    else:
        out.append(f"neighbor_ckpt side-by-side benchmark | {info['nproc']} CPU(s) {info['cpu_model']} | torch "
                   f"{info['torch']} | {res['world']} gloo ranks, {args.threads} intra-op thread(s) each | store "
                   f"{info['store_root']}")
        out.append(f"model: mcore GPT, {args.layers} layers, hidden {main['hidden']}, heads {args.heads}, seq "
                   f"{args.seq}, vocab {args.vocab}: {main['params']:,} params; distributed optimizer over "
                   f"DP={res['world']}; {args.micro_batches} micro-batches x {args.micro_batch_size} per rank per step")
    out.append(f"protocol: {args.steps} timed steps per variant in blocks of {args.block}, interleaved; "
               f"{args.warmup} warm-up steps in each variant's first block, 1 untimed step in later blocks; "
               f"step time = slowest rank" + ("; a step ends when the training stream is synchronized" if cuda
                                             else ""))
    out.append("")
    hdr = ["variant", "what", "median step ms", "x base", "overhead ms (95% CI)", "paired ovh ms",
           "ovh / neighbor ovh", "state per save (job)", "CPU ms/step/rank"]
    base_cpu = rows.get("base", {}).get("cpu", {}).get("process", float("nan"))
    table = []
    on = rows.get("neighbor", {}).get("overhead_s", float("nan"))
    order = [v for v in VARIANTS if v in rows]
    for name in order:
        r = rows[name]
        lo, hi = r["overhead_ci"]
        ci = "" if name == "base" else f" ({_ms(lo)}..{_ms(hi)})"
        rel = "-" if name in ("base",) or on != on or on <= 0 else f"{r['overhead_s'] / on:.1f}x"
        label = r["label"]
        table.append([label, DESCRIPTIONS.get(label, ""), _ms(r["median_s"]), f"{r['ratio']:.3f}",
                      ("0" if name == "base" else _ms(r["overhead_s"])) + ci,
                      "-" if name == "base" else _ms(r["paired_overhead_s"]), rel,
                      _fmt_bytes(r["bytes_per_save_job"]), _cpu_cell(r["cpu"].get("process"), base_cpu, name)])
    out.append(md_table(hdr, table))
    out.append("")
    for name, why in main.get("skipped", {}).items():
        out.append(f"* {name}: skipped: {why}")
    for name, why in main["failed"].items():
        out.append(f"* {name}: could not run here: {why}")
    for name in order:
        if rows[name]["note"]:
            out.append(f"* {rows[name]['label']}: {rows[name]['note']}")
    if "ratio" in verdict:
        b = verdict["best"]
        lo, hi = verdict["ratio_ci"]
        status = "MET" if verdict["met"] else "MISSED"
        if verdict["ratio"] != verdict["ratio"]:
            status = "INCONCLUSIVE (the best alternative's overhead is within noise)"
        out.append(f"* target 'neighbor_ckpt step overhead >= 10x lower than the best alternative': best alternative "
                   f"= {rows[b]['label']} (overhead {_ms(verdict['best_overhead_s'])} ms/step), neighbor_ckpt "
                   f"{_ms(verdict['neighbor_overhead_s'])} ms/step -> {verdict['ratio']:.1f}x lower (95% CI "
                   f"{lo:.1f}..{hi:.1f}; paired by round {verdict['paired_ratio']:.1f}x): {status}")
    bc, bs = rows.get("base", {}).get("cpu", {}).get("process"), rows.get("base", {}).get("median_s")
    if bc and bs and not cuda:
        util = bc * 1e-3 * res["world"] / (info["nproc"] * bs)
        out.append(f"* CPU budget: a base step costs {bc:.0f} ms of CPU per rank; {res['world']} ranks on "
                   f"{info['nproc']} core(s) keep them {100 * util:.0f}% busy during the median step. Work a "
                   f"checkpoint method does 'in the background' has no idle core to hide in here: its extra CPU shows "
                   f"up in the step time.")
    nbx = rows.get("neighbor", {}).get("extra", {})
    if nbx:
        out.append("* neighbor_ckpt per step (median over steps, median over ranks): training thread in snapshot() "
                   f"{_ms(nbx.get('snapshot_call_s', float('nan')))} ms, at the wait points "
                   f"{_ms(nbx.get('wait_s', float('nan')))} ms; background thread: copy "
                   f"{_ms(nbx.get('bg_copy_s', float('nan')))} ms, commit (extras + xxh3 + header) "
                   f"{_ms(nbx.get('bg_commit_s', float('nan')))} ms, stream + ack "
                   f"{_ms(nbx.get('bg_stream_s', float('nan')))} ms")
    d2h = d2h_line(res)
    if d2h:
        out.append(d2h)
    if res.get("optimizer"):
        out.append(f"* optimizer: {res['optimizer']}, distributed (fp32 main params and moments sharded over DP)")
    for name in order:
        cpu = rows[name]["cpu"]
        if cpu and name in ("base", "neighbor", *DIAGNOSTICS):
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if k != "process")
            out.append(f"* {rows[name]['label']} CPU ms per step per rank by thread: {parts}")
    for name in order:
        ex = rows[name]["extra"]
        if name not in ("base", "neighbor") and ex:
            parts = ", ".join(f"{k.removesuffix('_s')} {_ms(v)} ms" for k, v in ex.items())
            out.append(f"* {rows[name]['label']} per step (median): {parts}")
    out.append("")

    # -- scaling -------------------------------------------------------------------------------------------
    from neighbor_ckpt.planning.planner import HARDWARE, ModelShape, Parallelism, plan_job

    def shape(hidden: int) -> Any:
        return ModelShape(num_layers=args.layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                          num_attention_heads=args.heads, vocab_size=args.vocab, seq_length=args.seq,
                          share_embeddings_and_output_weights=False)  # GPTModel's default: untied

    scal = [{"hidden": main["hidden"], "params": main["params"], "rows": rows, "best": verdict.get("best"),
             "uniq": main.get("neighbor_unique_bytes_per_rank", [])}]
    for sr in res.get("scaling", []):
        ss = summarize({"main": sr})
        scal.append({"hidden": sr["hidden"], "params": sr["params"], "rows": ss["rows"],
                     "best": ss["verdict"].get("best"),
                     "uniq": sr.get("neighbor_unique_bytes_per_rank", []), "failed": sr.get("failed", {})})
    p0 = scal[0]["params"]
    hdr = ["params", "hidden", "unique/rank DP=1", "DP=2", "DP=4", f"live plan DP={res['world']}",
           "base ms", "neighbor ovh ms (95% CI)", "neighbor ovh %", "neighbor +CPU ms/rank", "best alt",
           "best alt ovh ms", "ratio"]
    table = []
    for sc in scal:
        pl = {d: plan_job(shape(sc["hidden"]), Parallelism(dp=d), HARDWARE["cpu"], extras_bytes=0).classes[0]
              for d in (1, 2, 4)}
        r = sc["rows"]
        base_s = r.get("base", {}).get("median_s", float("nan"))
        nb = r.get("neighbor", {})
        alt = [sc["best"]] if sc["best"] else []
        alt_ovh = r[alt[0]]["overhead_s"] if alt else float("nan")
        no = nb.get("overhead_s", float("nan"))
        nlo, nhi = nb.get("overhead_ci", (float("nan"), float("nan")))
        ncpu = nb.get("cpu", {}).get("process", float("nan")) - r.get("base", {}).get("cpu", {}).get("process",
                                                                                                     float("nan"))
        live = max(sc["uniq"]) if sc["uniq"] else None
        table.append([f"{sc['params']:,} ({sc['params'] / p0:.1f}x)", str(sc["hidden"]),
                      _fmt_bytes(pl[1].unique_payload_bytes), _fmt_bytes(pl[2].unique_payload_bytes),
                      _fmt_bytes(pl[4].unique_payload_bytes), _fmt_bytes(live), _ms(base_s),
                      f"{_ms(no)} ({_ms(nlo)}..{_ms(nhi)})", f"{100 * no / base_s:.1f}%" if base_s == base_s else "-",
                      "-" if ncpu != ncpu else f"{ncpu:+.1f}",
                      r[alt[0]]["label"] if alt else "-", _ms(alt_ovh),
                      ("-" if not alt or alt_ovh <= 0 else f"{alt_ovh / no:.1f}x" if no > 0 else "inf")])
        if sc["params"] != plan_job(shape(sc["hidden"]), Parallelism(dp=1), HARDWARE["cpu"]).classes[0].params_per_rank:
            out.append(f"* note: planner counts {pl[1].params_per_rank:,} params for hidden {sc['hidden']}, the live "
                       f"model has {sc['params']:,}")
        for name, why in sc.get("failed", {}).items():
            out.append(f"* scaling hidden {sc['hidden']}: {name} could not run: {why}")
    out.append("Scaling (unique/rank: 12 B/param/DP from neighbor_ckpt.planning.planner.plan_job, payload only; live plan: "
               "NeighborCheckpointer.plan.unique_bytes, max over ranks, incl. mcore's bucket padding):")
    out.append(md_table(hdr, table))
    out.append("")
    out.append(f"total benchmark time {res.get('wall_s', float('nan')):.0f} s "
               f"(workers {res.get('elapsed_s', 0):.0f} s); "
               f"other processes used {info.get('other_cpu_frac', float('nan')) * 100:.0f}% of the CPUs; "
               f"/proc/loadavg at start {info.get('loadavg_start')}"
               + ("  WARNING: the machine was busy, figures are skewed" if info.get("other_cpu_frac", 0) > 0.05
                  else ""))
    return "\n".join(out)
