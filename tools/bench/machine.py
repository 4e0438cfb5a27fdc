"""Facts about the machine a benchmark runs on, and how busy other processes keep it (both benchmarks use these)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash


def machine_info(store_root: Path) -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass

    def _read(p: str) -> str | None:
        try:
            return Path(p).read_text().strip()
        except OSError:
            return None

    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": model,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "xxhash": xxhash.VERSION,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "mem_total_bytes": mem,
        "store_root": str(store_root),
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "loadavg_start": _read("/proc/loadavg"),
        "l3_cache": _read("/sys/devices/system/cpu/cpu0/cache/index3/size"),
    }


def parse_size(text: str | None) -> int | None:
    """'32768K' / '32M' (sysfs cache sizes) to bytes."""
    if not text:
        return None
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1].upper(), 1)
    try:
        return int(text.rstrip("KkMmGg")) * mult
    except ValueError:
        return None


def cpu_sample() -> tuple[float, float, float, float]:
    """(wall, busy CPU-s of the machine, steal CPU-s, CPU-s of this process and its reaped children)."""
    busy = steal = float("nan")
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        # user nice system idle iowait irq softirq steal ... (irq/softirq left out: loopback TCP of the
        # streaming section is processed there and is not charged to our processes)
        busy = (f[0] + f[1] + f[2]) / hz
        steal = (f[7] if len(f) > 7 else 0) / hz
    except (OSError, ValueError, IndexError):
        pass
    t = os.times()
    return time.perf_counter(), busy, steal, t.user + t.system + t.children_user + t.children_system


def wait_until_quiet(seconds: float, ncpu: int, *, poll_s: float = 1.0, threshold: float = 0.10) -> None:
    """Wait until other processes use less than ``threshold`` of the CPUs, at most ``seconds``; say so if not."""
    deadline = time.perf_counter() + seconds
    while True:
        a = cpu_sample()
        time.sleep(poll_s)
        fl = foreign_load(a, cpu_sample(), ncpu)
        if fl["other_cpu_frac"] < threshold:
            return
        if time.perf_counter() > deadline:
            print(f"other processes still use {100 * fl['other_cpu_frac']:.0f}% of the CPUs after "
                  f"{seconds:g} s; starting anyway", flush=True)
            return


def foreign_load(a: tuple[float, float, float, float], b: tuple[float, float, float, float],
                 ncpu: int) -> dict[str, float]:
    """CPU used by other processes (and stolen by the hypervisor) between two :func:`cpu_sample` calls."""
    wall = b[0] - a[0]
    other = max(0.0, (b[1] - a[1]) - (b[3] - a[3]))
    return {"wall_s": wall, "other_cpu_s": other, "other_cpu_frac": other / (wall * ncpu) if wall > 0 else 0.0,
            "steal_cpu_s": b[2] - a[2], "steal_frac": (b[2] - a[2]) / (wall * ncpu) if wall > 0 else 0.0}

