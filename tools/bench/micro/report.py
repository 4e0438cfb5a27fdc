"""The micro-benchmark's table: cells of a row, and the rendering (rich when installed, plain text otherwise)."""

from __future__ import annotations

import argparse
from typing import Any

from tools.bench.micro.common import STAGE_ITERS_FACTOR, MiB, Row



def _fmt(x: float | None, unit: str = "") -> str:
    if x is None or x != x:
        return "-"
    if unit == "x":
        return f"{x:.4f}x"
    if unit == "GB/s":
        return f"{x:.2f} GB/s"
    return f"{x:.3g}{unit}"


def row_cells(r: Row) -> list[str]:
    """The table cells of a row: metric, measured, baseline, ratio, target, result."""
    if r.unit == "GB/s":
        base = _fmt(r.baseline, "GB/s")
    elif r.unit == "us":
        base = f"{r.baseline:.1f} us" if r.baseline is not None and r.baseline == r.baseline else "-"
    elif r.unit == "s":
        base = f"{r.baseline:.3f} s" if r.baseline is not None and r.baseline == r.baseline else "-"
    else:
        base = f"{r.baseline / MiB:.1f} MiB" if r.baseline is not None else "-"
    tgt = "-" if r.target is None else f"{r.op} {r.target:g}x"
    val = _fmt(r.value, r.unit) if r.unit != "x" else _fmt(r.value, "x")
    if r.unit == "us":
        val = f"{r.value:.2f} us" if r.value == r.value else "-"
    if r.unit == "s":
        val = f"{r.value:.3f} s" if r.value == r.value else "-"
        if "gbps" in r.detail:
            val += f" ({r.detail['gbps']:.2f} GB/s)"
    if r.section == "host":
        val = f"{r.detail.get('host_bytes', 0) / MiB:.2f} MiB"
    return [r.metric, val, f"{base} ({r.baseline_desc})", _fmt(r.ratio, "x"), tgt, r.status]


def render(info: dict[str, Any], args: argparse.Namespace, rows: list[Row], notes: list[str]) -> None:
    head = (f"neighbor_ckpt micro-benchmark | nproc {info['nproc']} | {info['cpu_model']} | torch {info['torch']} "
            f"({info['torch_threads']} intra-op threads) | numpy {info['numpy']} | xxhash {info['xxhash']} | "
            f"kernel {info['kernel']}")
    sub = (f"payload {args.mib:g} MiB unique fp32 in {args.tensors} tensors | iters {args.iters} "
           f"(x{STAGE_ITERS_FACTOR} for staging; {args.stat}, after {args.warmup} warm-up) | "
           f"chunk {args.chunk_mib:g} MiB | store {info['store_root']} | THP {info['thp_enabled']} / "
           f"shmem {info['thp_shmem']}")

    cells = row_cells

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(head)
        print(sub)
        hdrs = ["metric", "measured", "baseline", "ratio", "target", "result"]
        table = [hdrs] + [cells(r) for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(hdrs))]
        for k, row in enumerate(table):
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
            if k == 0:
                print("  ".join("-" * w for w in widths))
        for n in notes:
            print(f"* {n}")
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=170)
    console.print(head, style="bold", highlight=False, markup=False)
    console.print(sub, highlight=False, markup=False)
    table = Table(show_lines=False)
    for name, just in (("metric", "left"), ("measured", "right"), ("baseline", "left"), ("ratio", "right"),
                       ("target", "right"), ("result", "center")):
        table.add_column(name, justify=just)  # type: ignore[arg-type]
    style = {"PASS": "green", "MISS": "bold red", "INFO": "dim", "ERROR": "bold red"}
    for r in rows:
        c = cells(r)
        c[-1] = f"[{style[r.status]}]{r.status}[/]"
        table.add_row(*c)
    console.print(table)
    for n in notes:
        console.print(f"* {n}", highlight=False, markup=False)
