"""The harness on every rank: interleaved blocks of variants on one model, the step clock and CPU accounting."""

from __future__ import annotations

import gc
import math
import os
import shutil
import statistics
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from tools.bench.compare.gpt import Trainer
    from tools.bench.compare.systems.variant import Variant


_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_by_thread() -> dict[str, float]:
    """CPU seconds used so far: this process (``process``, reaped children included) and each Python thread by
    name (numbers folded: ``ThreadPoolExecutor-0_0`` -> ``ThreadPoolExecutor``); ``other`` = threads that are
    not Python threads (gloo's, torch's)."""
    import threading

    t = os.times()
    out: dict[str, float] = {"process": t.user + t.system + t.children_user + t.children_system}
    named = 0.0
    for th in threading.enumerate():
        tid = th.native_id
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / _CLK
        except (OSError, IndexError, ValueError):
            continue
        name = "main" if th is threading.main_thread() else th.name.split("-")[0] if th.name.startswith(
            ("ThreadPoolExecutor", "Thread")) else th.name
        out[name] = out.get(name, 0.0) + cpu
        named += cpu
    out["other"] = t.user + t.system - named
    return out


def _release_host_memory() -> None:
    """--device cuda, after a block (untimed, outside its CPU accounting): hand host memory the finished variant freed
    back to the OS, so GB-sized staging copies do not pile up across variants: the CUDA caching host allocator's
    pinned blocks (mcore's and NVRx's non-blocking D2H copies land there) and glibc's free heap. The next block's
    first step, untimed, pins again what it needs."""
    import torch

    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None:
        empty_host_cache()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text[:300]


class Runner:
    """Interleaved blocks of variants on one model, every rank in lock step."""

    def __init__(self, tr: Trainer, variants: dict[str, Variant], cfg: dict[str, Any], label: str) -> None:
        self.tr, self.variants, self.cfg, self.label = tr, variants, cfg, label
        self.times: dict[str, list[float]] = {k: [] for k in variants}  # this rank's timed steps
        self.blocks: dict[str, list[int]] = {k: [] for k in variants}  # round index of each timed step
        self.failed: dict[str, str] = {}
        self.cpu: dict[str, dict[str, float]] = {k: {} for k in variants}  # CPU s over the timed steps, by thread
        self.step_no = 0
        self.cuda = cfg.get("device", "cpu") == "cuda"
        self.roots = [v.root for v in variants.values()]

    def _agree(self, err: str | None) -> str | None:
        """Collective: the first rank's error, or None when every rank succeeded."""
        import torch.distributed as dist

        errs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
        bad = [(r, e) for r, e in enumerate(errs) if e]
        return None if not bad else f"rank {bad[0][0]}: {bad[0][1]}"

    def setup(self) -> None:
        for name in list(self.variants):
            err = None
            try:
                self.variants[name].setup()
            except Exception as e:  # noqa: BLE001
                err = one_line(e)
                if self.cfg["verbose"]:
                    traceback.print_exc()
            err = self._agree(err)
            if err:
                self.failed[name] = f"setup failed: {err}"
                del self.variants[name]
                for per_variant in (self.times, self.blocks, self.cpu):
                    per_variant.pop(name, None)

    def block(self, name: str, untimed: int, timed: int, rnd: int) -> str | None:
        import torch
        import torch.distributed as dist

        v = self.variants[name]
        # Under NCCL the default group's collectives need CUDA tensors; the flag lives on this rank's GPU.
        flag = torch.zeros(1, device="cuda") if self.cuda else torch.zeros(1)
        err: str | None = None
        try:
            v.start_block()
        except Exception as e:  # noqa: BLE001
            err = one_line(e)
        flag[0] = 1.0 if err else 0.0
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag[0]:
            return self._agree(err) or "failed on another rank"
        cpu0: dict[str, float] = {}
        for k in range(untimed + timed):
            if k == untimed:
                cpu0 = _cpu_by_thread()
            t0 = time.perf_counter()
            try:
                self.tr.step()
                v.save(self.step_no)
            except Exception as e:  # noqa: BLE001
                err = one_line(e)
                if self.cfg["verbose"]:
                    traceback.print_exc()
            self.step_no += 1
            flag[0] = 1.0 if err else 0.0
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the step's end: a barrier with a failure flag
            if self.cuda:
                # GPU work is asynchronous: the step ends when the training stream (the step's kernels, then the
                # flag's all-reduce) is done. Only this stream: a device-wide torch.cuda.synchronize() would also
                # wait for copies a method runs on its own side stream (neighbor_ckpt's D2H staging) and charge its
                # background work to the step.
                torch.cuda.current_stream().synchronize()
            dt = time.perf_counter() - t0
            if flag[0]:
                return self._agree(err) or "failed on another rank"
            if k >= untimed:
                self.times[name].append(dt)
                self.blocks[name].append(rnd)
            v.after_step()
        cpu1 = _cpu_by_thread()
        acc = self.cpu[name]
        for key in set(cpu0) | set(cpu1):
            acc[key] = acc.get(key, 0.0) + cpu1.get(key, 0.0) - cpu0.get(key, 0.0)
        try:
            v.end_block()
        except Exception as e:  # noqa: BLE001
            err = one_line(e)
        err = self._agree(err)
        gc.collect()
        if self.cuda:
            _release_host_memory()
        return err

    def run(self, steps: int, block: int, warmup: int, on_fail: Callable[[str, str], bool] | None = None) -> None:
        rounds = math.ceil(steps / block)
        for rnd in range(rounds):
            names = list(self.variants)
            k = rnd % len(names) if names else 0
            order = names[k:] + names[:k]
            if rnd % 2:
                order.reverse()
            for name in order:
                if name not in self.variants:
                    continue
                timed = min(block, steps - len(self.times[name]))
                if timed <= 0:
                    continue
                untimed = warmup if rnd == 0 else 1
                err = self.block(name, untimed, timed, rnd)
                while err and rnd == 0 and on_fail is not None and on_fail(name, err):
                    self.times[name].clear()
                    self.blocks[name].clear()
                    self.cpu[name].clear()
                    err = self.block(name, untimed, timed, rnd)
                if err:
                    self.failed[name] = err
                    v = self.variants.pop(name)
                    self.times.pop(name, None)
                    try:
                        v.close()
                    except Exception:  # noqa: BLE001
                        pass
            if self.cfg["verbose"] and int(os.environ.get("RANK", "0")) == 0:
                print(f"[compare] {self.label}: round {rnd + 1}/{rounds} done", flush=True)

    def close(self) -> None:
        for name, v in list(self.variants.items()):
            try:
                v.close()
            except Exception as e:  # noqa: BLE001
                self.failed.setdefault(name, f"close failed: {one_line(e)}")
        if self.cuda:
            # GB-sized checkpoints in /dev/shm are host memory: free them before another model is built. Every
            # rank has closed (finalized its writes) before rank 0 removes the shared directories.
            import torch.distributed as dist

            dist.barrier()
            if dist.get_rank() == 0:
                for root in self.roots:
                    shutil.rmtree(root, ignore_errors=True)
            dist.barrier()

    def results(self) -> dict[str, Any]:
        """Collective: per-variant per-step times (max over ranks), extras from every rank."""
        import torch.distributed as dist

        mine = {"times": self.times, "blocks": self.blocks, "cpu": self.cpu,
                "extra": {k: v.extra for k, v in self.variants.items()},
                "bytes": {k: v.bytes_per_save for k, v in self.variants.items()}}
        allr: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(allr, mine)
        out: dict[str, Any] = {"variants": {}, "failed": dict(self.failed)}
        for name in self.times:
            per_rank = [r["times"][name] for r in allr]
            n = min(len(x) for x in per_rank)
            v = self.variants[name]
            out["variants"][name] = {
                "step_s": [max(x[i] for x in per_rank) for i in range(n)],
                "round": allr[0]["blocks"][name][:n],
                "label": v.name, "note": v.mode_note,
                "bytes_per_save_job": sum(r["bytes"][name] or 0 for r in allr),
                # CPU per timed step, by thread, averaged over ranks (ms of one core)
                "cpu_ms_per_step": {k: 1e3 * statistics.mean(r["cpu"][name].get(k, 0.0) for r in allr) / max(n, 1)
                                    for k in sorted(set().union(*(r["cpu"][name] for r in allr)))},
                "extra_median": {k: statistics.median([statistics.median(r["extra"][name][k]) for r in allr
                                                       if r["extra"][name].get(k)] or [float("nan")])
                                 for k in allr[0]["extra"][name]},
                "extra_max_rank_median": {k: max([statistics.median(r["extra"][name][k]) for r in allr
                                                  if r["extra"][name].get(k)] or [float("nan")])
                                          for k in allr[0]["extra"][name]},
            }
        return out
