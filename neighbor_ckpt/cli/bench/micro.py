"""Micro-benchmark of the neighbor_ckpt data path, with every figure given as a ratio to a plain baseline.

One run prints one table:

1. **Staging vs memcpy.** :class:`~neighbor_ckpt.snapshot.engine.SnapshotEngine` on one rank, no transport. The copy
   into the slot (``stats.stage_seconds``) and the whole local commit (copy + extras + xxh3 + header +
   marker) are timed separately, and compared with a plain copy of the same tensors into pre-allocated,
   pre-faulted memory. Four copies are timed (``torch.Tensor.copy_`` and ``numpy.copyto``, into anonymous
   memory and into a ``/dev/shm`` mapping) and the fastest is the baseline. xxh3 throughput is shown too.
2. **Streaming vs raw gloo.** W processes (spawn, gloo, file init on localhost) in a ring. Each rank
   streams its newest committed own slot to its successor with :meth:`GlooRingTransport.send` (which
   returns after the successor's acknowledgement), all ranks at once. The baseline sends the same messages
   (16 x int64 meta, the image in the same segments and chunks, an 8-byte ack) with ``dist.send`` /
   ``dist.recv`` between pre-faulted anonymous tensors, over a second gloo group. A rank's time ends when
   its own send is acknowledged and its predecessor's image has fully landed; an iteration's time is the
   slowest rank's. The two variants alternate, iteration by iteration.
3. **Host memory vs unique bytes.** After the streaming run, ``HostStore.host_bytes()`` of a rank
   (2 own + 2 replica slots written by the real engine + transport) over ``plan.unique_bytes``.
4. **Restore vs raw transfer.** After the streaming run (the transport closed, as before a recovery), every
   rank "restarts" (a new :class:`HostStore` on the surviving files) and all ranks run
   :func:`~neighbor_ckpt.recovery.flow.run_recovery` on the transport's group, as
   :meth:`NeighborCheckpointer.recover` does, then copy the returned views into pre-allocated live tensors
   (what an adapter's ``load`` does). Two cases, each alternating round by round with its baseline:
   *lost store* (rank 0's store directory is deleted, a replaced node: inventory, all-gather, reconciliation,
   pull of the replica from its successor over gloo, checksum verification, load) timed on rank 0 against a
   raw ``dist.send``/``dist.recv`` of the same bytes in the same chunks between the same two ranks into a
   pre-faulted buffer plus a ``torch.copy_`` into the live tensors, target ``restore <= 1.5x raw``; and *local*
   (every store survived: own slot, verified, into the live tensors; slowest rank) against a ``torch.copy_``
   of the same bytes from a /dev/shm mapping, informational (a checksum pass alone costs about half a copy).
   The notes give the ``RecoveryReport.phases`` breakdown. ``--no-restore`` skips this.

Every timing is a median over ``--iters`` iterations after warm-up (first-touch page faults of a fresh
``/dev/shm`` file are not steady state). Stores go under ``$NEIGHBOR_CKPT_STORE_DIR`` (default
``/dev/shm``) and are removed at the end.

Run ``scripts/bench`` (or ``python -m neighbor_ckpt.cli.bench.micro``) with ``--mib``, ``--iters``, ``--world``,
``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import xxhash

from neighbor_ckpt.config import STORE_DIR_ENV, TransportConfig
from neighbor_ckpt.snapshot.engine import SnapshotEngine
from neighbor_ckpt.snapshot.razor import ShardPlan, StateKind, TensorMeta, plan_shards
from neighbor_ckpt.snapshot.store import ROLE_OWN, ROLE_REPLICA, HostStore, checksum

MiB = 2**20
GB = 1e9
STAGE_ITERS_FACTOR = 3
"""A staging iteration is ~10x cheaper than a streaming one: section 1 runs this many times ``--iters``."""

# --------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------


_STAT = "median"


def _summary(xs: Sequence[float]) -> float:
    """The summary statistic of a list of timings: the median (default) or, with ``--stat min``, the best."""
    if not xs:
        return float("nan")
    return min(xs) if _STAT == "min" else statistics.median(xs)


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


def _parse_size(text: str | None) -> int | None:
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


def make_metas(mib: float, ntensors: int) -> list[TensorMeta]:
    """``mib`` MiB of fp32 state in ``ntensors`` 1-D tensors: weights 3:3:...:1 (Adam-shard-like)."""
    total = int(mib * MiB) // 4
    weights = [3] * (ntensors - 1) + [1] if ntensors > 1 else [1]
    counts = [total * w // sum(weights) for w in weights]
    counts[0] += total - sum(counts)
    names = ["main/shard", "opt/exp_avg", "opt/exp_avg_sq"] + [f"opt/aux{i}" for i in range(max(0, ntensors - 3))]
    kinds = [StateKind.MAIN_PARAM] + [StateKind.OPTIMIZER] * (ntensors - 1)
    return [TensorMeta(names[i], kinds[i], torch.float32, (counts[i],)) for i in range(ntensors)]


def make_plan(metas: list[TensorMeta], dp: int) -> ShardPlan:
    plan = plan_shards(metas, dp_size=dp, distributed_optimizer=True)
    assert len(plan.unique) == len(metas), "benchmark state must be all unique"  # noqa: S101
    return plan


def make_sources(plan: ShardPlan, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.meta.shape, generator=g, dtype=p.meta.dtype) for p in plan.unique]


def small_extras(i: int) -> dict[str, Any]:
    return {"step": i, "consumed": i * 1024, "rng": torch.get_rng_state()}


class ShmBuffer:
    """A pre-faulted file mapping in the store root (same memory kind as a slot)."""

    def __init__(self, root: Path, nbytes: int, tag: str = "") -> None:
        self.path = root / f"memcpy-baseline-{os.getpid()}{tag}.bin"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes)
        self.tensor.fill_(1)

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self.mm.close()
        except BufferError:
            pass
        self.path.unlink(missing_ok=True)


def _views_like(buf: torch.Tensor, plan: ShardPlan) -> list[torch.Tensor]:
    return [buf[p.offset:p.offset + p.meta.nbytes].view(p.meta.dtype).view(p.meta.shape) for p in plan.unique]


@dataclass
class Row:
    section: str
    metric: str
    value: float
    unit: str
    baseline: float | None
    baseline_desc: str
    ratio: float | None
    target: float | None = None
    op: str = ">="
    status: str = "INFO"
    detail: dict[str, Any] = field(default_factory=dict)

    def judge(self) -> Row:
        if self.target is None or self.ratio is None or self.ratio != self.ratio:
            self.status = "INFO" if self.target is None else "ERROR"
        elif self.op == ">=":
            self.status = "PASS" if self.ratio >= self.target else "MISS"
        else:
            self.status = "PASS" if self.ratio <= self.target else "MISS"
        return self


# --------------------------------------------------------------------------------------------------------
# 1. staging vs memcpy
# --------------------------------------------------------------------------------------------------------


def bench_staging(args: argparse.Namespace, root: Path) -> tuple[list[Row], dict[str, Any]]:
    metas = make_metas(args.mib, args.tensors)
    plan = make_plan(metas, dp=1)
    nbytes = sum(p.meta.nbytes for p in plan.unique)
    sources = make_sources(plan, seed=0)
    store = HostStore(root, job_id=f"bench-stage-{os.getpid()}", rank=0, versions=2, use_checksum=True)
    # wait_for_replica=True: with no transport "done" follows the commit at once, and the stats are written
    # before "done" (with False, wait() returns on "committed", before the stats are updated).
    engine = SnapshotEngine(store=store, plan=plan, sources=sources, layout="bench", meta={"bench": "micro"},
                            transport=None, wait_for_replica=True)

    # Every candidate gets its own destination, so no copy lands on lines the previous one left in cache.
    anons = [torch.empty(plan.unique_bytes, dtype=torch.uint8) for _ in range(2)]
    for a in anons:
        a.fill_(1)
    shms = [ShmBuffer(store.dir, plan.unique_bytes, tag=str(i)) for i in range(2)]
    anon_views = _views_like(anons[0], plan)
    shm_views = _views_like(shms[0].tensor, plan)
    src_np = [s.numpy() for s in sources]
    anon_np = [v.numpy() for v in _views_like(anons[1], plan)]
    shm_np = [v.numpy() for v in _views_like(shms[1].tensor, plan)]

    def torch_copy(dsts: list[torch.Tensor]) -> Callable[[], None]:
        def f() -> None:
            for d, s in zip(dsts, sources):
                d.copy_(s)
        return f

    def numpy_copy(dsts: list[np.ndarray]) -> Callable[[], None]:
        def f() -> None:
            for d, s in zip(dsts, src_np):
                np.copyto(d, s)
        return f

    baselines: dict[str, Callable[[], None]] = {
        "torch.copy_ -> anon": torch_copy(anon_views),
        "numpy.copyto -> anon": numpy_copy(anon_np),
        "torch.copy_ -> /dev/shm map": torch_copy(shm_views),
        "numpy.copyto -> /dev/shm map": numpy_copy(shm_np),
    }
    names = list(baselines)
    samples: dict[str, list[float]] = {k: [] for k in names}
    samples.update({"engine.stage": [], "engine.commit": [], "engine.wall": [], "xxh3": []})

    try:
        # Warm-up: both own slots created and first-touched, every baseline run twice.
        step = 0
        for _ in range(max(2, args.warmup) + 2):
            engine.snapshot(step, small_extras(step))
            engine.wait()
            step += 1
        for f in baselines.values():
            f()
            f()
        for it in range(args.iters * STAGE_ITERS_FACTOR):
            t0 = time.perf_counter()
            engine.snapshot(step, small_extras(step))
            engine.wait()
            wall = time.perf_counter() - t0
            if engine.stats.failures:
                raise RuntimeError(f"engine reported {engine.stats.failures} failed snapshot(s)")
            samples["engine.wall"].append(wall)
            samples["engine.stage"].append(engine.stats.stage_seconds)
            samples["engine.commit"].append(engine.stats.stage_seconds + engine.stats.commit_seconds)
            step += 1
            # the committed slot's payload, read-only
            ref = max(store.committed(ROLE_OWN, verify=False), key=lambda r: r.header.iteration)
            slot = store.slot(ROLE_OWN, ref.index)
            assert slot is not None  # noqa: S101
            payload = slot.segment(slot.payload_off, plan.unique_bytes).numpy()
            t0 = time.perf_counter()
            checksum(payload)
            samples["xxh3"].append(time.perf_counter() - t0)
            del payload
            order = list(baselines.items())
            if it % 2:
                order.reverse()
            for name, f in order:
                t0 = time.perf_counter()
                f()
                samples[name].append(time.perf_counter() - t0)
    finally:
        engine.close()
        baselines.clear()  # the closures hold views of the mapping
        del shm_views, shm_np
        for b in shms:
            b.close()
        store.destroy()

    med = {k: _summary(v) for k, v in samples.items()}
    gbps = {k: nbytes / v / GB for k, v in med.items()}
    best = min(names, key=lambda k: med[k])
    base = med[best]
    desc = f"{best}"
    rows = [
        Row("staging", "engine copy into slot (stats.stage_seconds)", gbps["engine.stage"], "GB/s",
            gbps[best], desc, base / med["engine.stage"], 0.9, ">=").judge(),
        Row("staging", "engine local commit (copy+extras+xxh3+header)", gbps["engine.commit"], "GB/s",
            gbps[best], desc, base / med["engine.commit"]).judge(),
        Row("staging", "snapshot() -> committed, wall", gbps["engine.wall"], "GB/s",
            gbps[best], desc, base / med["engine.wall"]).judge(),
        Row("staging", "xxh3-64 of the slot payload", gbps["xxh3"], "GB/s",
            gbps[best], desc, base / med["xxh3"]).judge(),
    ]
    # Ideal commit throughput if copy and hash ran back to back at their measured speeds.
    serial = 1 / (1 / gbps[best] + 1 / gbps["xxh3"])
    paired = {k: statistics.median(b / e for b, e in zip(samples[best], samples[k]))
              for k in ("engine.stage", "engine.commit")}
    rows[0].detail["paired_ratio_median"] = paired["engine.stage"]
    rows[1].detail["paired_ratio_median"] = paired["engine.commit"]
    extra = {
        "paired_ratio_median": paired,
        "payload_bytes": nbytes, "slot_payload_bytes": plan.unique_bytes,
        "median_seconds": med, "gbps": gbps, "baseline": best, "samples_seconds": samples,
        "ideal_serial_copy_then_hash_gbps": serial,
    }
    return rows, extra


# --------------------------------------------------------------------------------------------------------
# 2 + 3. streaming vs raw gloo, host memory
# --------------------------------------------------------------------------------------------------------

_RAW_META, _RAW_DATA, _RAW_ACK = 11, 12, 13


def _stream_worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    import torch.distributed as dist

    from neighbor_ckpt.snapshot.topology import build_topology
    from neighbor_ckpt.snapshot.transport import META_LEN, GlooRingTransport

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=cfg["timeout_s"])
    dist.init_process_group("gloo", init_method=f"file://{cfg['init_file']}", rank=rank, world_size=world,
                            timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=timeout)  # the transport's, as NeighborCheckpointer does
    raw_group = dist.new_group(backend="gloo", timeout=timeout)  # the baseline's
    topo = build_topology(rank=rank, world_size=world, dp_ranks=list(range(world)),
                          nodes=[f"node{r}" for r in range(world)], policy="next")
    succ, pred = topo.successor, topo.predecessor
    plan = make_plan(make_metas(cfg["mib"], cfg["tensors"]), dp=world)
    store = HostStore(Path(cfg["root"]), job_id=cfg["job_id"], rank=rank, versions=2, use_checksum=True)
    chunk = cfg["chunk_bytes"]
    landed: queue.Queue[float] = queue.Queue()
    transport = GlooRingTransport(topo, store, group, chunk_bytes=chunk,
                                  on_replica=lambda _it: landed.put(time.perf_counter()))
    transport.start()
    transport_open = True
    result: dict[str, Any] = {}
    raw_thread = None
    try:
        # -- the real engine + transport fill 2 own and 2 replica slots, and warm them -------------------
        sources = make_sources(plan, seed=rank)
        engine = SnapshotEngine(store=store, plan=plan, sources=sources, layout="bench",
                                meta={"bench": "micro"}, transport=transport, wait_for_replica=True)
        e2e = []
        for i in range(2 + cfg["warmup"]):
            t0 = time.perf_counter()
            engine.snapshot(i, small_extras(i))
            engine.wait()
            e2e.append({"wall": time.perf_counter() - t0, "stage": engine.stats.stage_seconds,
                        "commit": engine.stats.commit_seconds, "stream": engine.stats.stream_seconds})
        engine.close()
        if engine.stats.failures or not transport.healthy:
            raise RuntimeError(f"rank {rank}: engine failures={engine.stats.failures} "
                               f"transport healthy={transport.healthy}")
        del engine, sources
        while not landed.empty():
            landed.get()
        dist.barrier()

        ref = max(store.committed(ROLE_OWN, verify=False), key=lambda r: r.header.iteration)
        slot = store.slot(ROLE_OWN, ref.index)
        assert slot is not None  # noqa: S101
        hdr = ref.header
        segs = slot.image_segments(hdr)
        image_bytes = sum(n for _, n in segs)

        # -- raw baseline: same messages between pre-faulted anonymous tensors ----------------------------
        send_buf = torch.empty(image_bytes, dtype=torch.uint8)
        pos = 0
        for o, n in segs:
            send_buf[pos:pos + n].copy_(slot.segment(o, n))
            pos += n
        recv_buf = torch.zeros(image_bytes, dtype=torch.uint8)
        recv_buf.fill_(1)
        spans = []
        pos = 0
        for _, n in segs:
            spans.append((pos, n))
            pos += n
        rounds = cfg["warmup"] + cfg["iters"]
        raw_landed: queue.Queue[float] = queue.Queue()
        raw_err: list[BaseException] = []

        def raw_receiver() -> None:
            try:
                meta = torch.zeros(META_LEN, dtype=torch.int64)
                for _ in range(rounds):
                    dist.recv(meta, src=pred, group=raw_group, tag=_RAW_META)
                    for p0, n in spans:
                        for s in range(0, n, chunk):
                            dist.recv(recv_buf[p0 + s:p0 + min(n, s + chunk)], src=pred, group=raw_group,
                                      tag=_RAW_DATA)
                    dist.send(meta[1:2].clone(), dst=pred, group=raw_group, tag=_RAW_ACK)
                    raw_landed.put(time.perf_counter())
            except BaseException as e:  # noqa: BLE001
                raw_err.append(e)
                raw_landed.put(float("nan"))

        raw_thread = threading.Thread(target=raw_receiver, name="bench-raw-recv", daemon=True)
        raw_thread.start()
        raw_meta = torch.zeros(META_LEN, dtype=torch.int64)
        raw_ack = torch.zeros(1, dtype=torch.int64)

        def raw_send(i: int) -> None:
            raw_meta[1] = i
            dist.send(raw_meta, dst=succ, group=raw_group, tag=_RAW_META)
            for p0, n in spans:
                for s in range(0, n, chunk):
                    dist.send(send_buf[p0 + s:p0 + min(n, s + chunk)], dst=succ, group=raw_group, tag=_RAW_DATA)
            dist.recv(raw_ack, src=succ, group=raw_group, tag=_RAW_ACK)

        def neighbor_send(_i: int) -> None:
            if not transport.send(slot, hdr):
                raise RuntimeError(f"rank {rank}: GlooRingTransport.send failed")

        variants = {"neighbor": (neighbor_send, landed), "raw": (raw_send, raw_landed)}
        times: dict[str, list[float]] = {"neighbor": [], "raw": []}
        send_times: dict[str, list[float]] = {"neighbor": [], "raw": []}
        for it in range(rounds):
            order = ["neighbor", "raw"] if it % 2 == 0 else ["raw", "neighbor"]
            for name in order:
                fn, q = variants[name]
                dist.barrier()
                t0 = time.perf_counter()
                fn(it)
                t_send = time.perf_counter()
                t_recv = q.get(timeout=cfg["timeout_s"])
                if raw_err:
                    raise RuntimeError(f"rank {rank}: raw receiver failed: {raw_err[0]!r}")
                red = torch.tensor([max(t_send, t_recv) - t0, t_send - t0], dtype=torch.float64)
                dist.all_reduce(red, op=dist.ReduceOp.MAX)
                if it >= cfg["warmup"]:
                    times[name].append(float(red[0]))
                    send_times[name].append(float(red[1]))
        raw_thread.join(timeout=cfg["timeout_s"])

        # -- host memory ---------------------------------------------------------------------------------
        files = sorted(p.name for p in store.dir.glob("*.slot"))
        hb = torch.tensor([store.host_bytes(), len(files)], dtype=torch.float64)
        dist.all_reduce(hb, op=dist.ReduceOp.MAX)
        e2e_last = torch.tensor([e2e[-1][k] for k in ("wall", "stage", "commit", "stream")], dtype=torch.float64)
        dist.all_reduce(e2e_last, op=dist.ReduceOp.MAX)
        result = {
            "world": world, "image_bytes": image_bytes, "unique_bytes": plan.unique_bytes, "chunk_bytes": chunk,
            "segments": segs, "seconds": times, "send_seconds": send_times,
            "host_bytes_max": int(hb[0]), "slot_files_max": int(hb[1]), "slot_files_rank0": files,
            "engine_last_snapshot_max_seconds": dict(zip(("wall", "stage", "commit", "stream"),
                                                         e2e_last.tolist())),
        }

        # -- 4. restore (recovery runs before the transport starts, on the same group) ------------------------
        if cfg.get("restore", True):
            transport.close(timeout=cfg["timeout_s"])
            transport_open = False
            del neighbor_send, variants, slot, hdr, ref, send_buf, recv_buf
            dist.barrier()
            result["restore"], store = _restore_section(rank, world, cfg, topo, group, raw_group, plan, store)
    finally:
        if transport_open:
            transport.close(timeout=cfg["timeout_s"])
        try:
            dist.barrier()
        finally:
            store.destroy()
            dist.destroy_process_group()
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(result))


RESTORE_PHASES = ("inventory", "exchange", "transfer", "verify", "load", "copy")
"""Seconds kept per restore: ``RecoveryReport.phases`` (inventory .. load) and the copy into the live tensors."""
_RAW_RESTORE_META, _RAW_RESTORE_DATA = 21, 22


def _restore_section(rank: int, world: int, cfg: dict[str, Any], topo: Any, group: Any, raw_group: Any,
                     plan: ShardPlan, store: HostStore) -> tuple[dict[str, Any], HostStore]:
    """Restore figures, after the streaming run left 2 own + 2 replica slots on every rank.

    Every restore is a restart: each rank closes its :class:`HostStore` and opens a new one (fresh mappings of
    the surviving files), then all ranks run :func:`~neighbor_ckpt.recovery.flow.run_recovery` on the transport's
    group, as :meth:`NeighborCheckpointer.recover` does, and copy the returned views into pre-allocated live
    tensors (what the adapter's ``load`` does). Variants alternate round by round with their baselines.

    * local: every store survived; each rank restores its own slot (checksummed in the verify step, the only slot
      of the rank that is hashed). Baseline: ``torch.copy_`` of the same bytes from a
      pre-faulted /dev/shm mapping into the same live tensors. A round's time is the slowest rank's.
    * lost: rank ``victim`` lost its whole store (a replaced node: its directory is deleted, so the pulled image
      lands in a new /dev/shm file); it pulls its state from the replica on its ring successor. Timed on the
      victim. Baseline: the successor sends the same bytes (meta + the image in ``chunk_bytes`` chunks) with
      ``dist.send`` into a pre-faulted anonymous buffer of the victim over a second gloo group, and the victim
      ``torch.copy_``-s the payload into the live tensors.

    Returns (results for rank 0, the store now open).
    """
    import torch.distributed as dist

    from neighbor_ckpt.recovery.reconcile import SOURCE_OWN, SOURCE_REPLICA
    from neighbor_ckpt.recovery.flow import run_recovery
    from neighbor_ckpt.snapshot.topology import build_topology
    from neighbor_ckpt.snapshot.transport import META_LEN

    chunk = cfg["chunk_bytes"]
    rounds = cfg["warmup"] + cfg["iters"]
    root = Path(cfg["root"])
    victim = int(cfg.get("restore_victim", 0)) % world
    vsucc = build_topology(rank=victim, world_size=world, dp_ranks=list(range(world)),
                           nodes=[f"node{r}" for r in range(world)], policy="next").successor
    # The live model / optimizer state exists before recover() runs: pre-allocated and pre-faulted.
    live = {p.meta.name: torch.zeros(p.meta.shape, dtype=p.meta.dtype) for p in plan.unique}
    names = [p.meta.name for p in plan.unique]
    nbytes = plan.unique_bytes

    def reopen(lose: bool) -> HostStore:
        store.close()
        if lose:
            shutil.rmtree(store.dir, ignore_errors=True)
        return HostStore(root, job_id=cfg["job_id"], rank=rank, versions=2, use_checksum=True)

    def restore(expect: str) -> tuple[list[float], int, int]:
        """One run_recovery + load; returns ([total, *phases], iteration, pulled bytes)."""
        t0 = time.perf_counter()
        rep, restored = run_recovery(store=store, topology=topo, group=group, layout="bench", chunk_bytes=chunk)
        t1 = time.perf_counter()
        if restored is None or rep.source != expect or set(restored.tensors) != set(live):
            raise RuntimeError(f"rank {rank}: restore from {expect} failed: {rep.to_dict()}")
        for name, t in restored.tensors.items():
            live[name].copy_(t)
        t2 = time.perf_counter()
        del restored
        ph = dict(rep.phases, copy=t2 - t1)
        return [t2 - t0] + [ph.get(k, 0.0) for k in RESTORE_PHASES], int(rep.iteration or 0), rep.pulled_bytes

    def reduce_max(v: list[float]) -> list[float]:
        t = torch.tensor(v, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    out: dict[str, Any] = {"victim": victim, "source_rank": vsucc, "unique_bytes": nbytes,
                           "phase_names": list(RESTORE_PHASES)}
    zeros = [0.0] * len(RESTORE_PHASES)

    # -- local restore vs copy_ from a /dev/shm map --------------------------------------------------------
    refs = sorted(store.committed(ROLE_OWN, verify=False), key=lambda r: r.header.iteration)
    own = store.slot(ROLE_OWN, refs[-1].index)
    assert own is not None  # noqa: S101
    shm = ShmBuffer(root, nbytes, tag=f"-restore{rank}")
    try:
        shm.tensor.copy_(own.payload[:nbytes])
        del own, refs
        shm_views = _views_like(shm.tensor, plan)
        local: dict[str, list[Any]] = {"restore": [], "copy": [], "phases": []}
        for it in range(rounds):
            for name in (("restore", "copy") if it % 2 == 0 else ("copy", "restore")):
                if name == "restore":
                    store = reopen(lose=False)
                dist.barrier()
                if name == "restore":
                    v, _, _ = restore(SOURCE_OWN)
                else:
                    t0 = time.perf_counter()
                    for n, src in zip(names, shm_views):
                        live[n].copy_(src)
                    v = [time.perf_counter() - t0] + zeros
                v = reduce_max(v)
                if it >= cfg["warmup"]:
                    local[name].append(v[0])
                    if name == "restore":
                        local["phases"].append(dict(zip(RESTORE_PHASES, v[1:])))
    finally:
        shm_views = []
        shm.close()
    out["local"] = local

    # -- restore of a rank that lost its store vs raw gloo + copy_ ----------------------------------------
    own_refs = sorted(store.committed(ROLE_OWN, verify=False), key=lambda r: r.header.iteration)
    image = store.slot(ROLE_OWN, own_refs[-1].index)
    assert image is not None  # noqa: S101
    segs = image.image_segments(own_refs[-1].header)  # the victim's image has this layout on every rank
    image_bytes = sum(n for _, n in segs)
    payload_at = segs[0][1]  # the first segment is preamble + header, up to the payload
    del image, own_refs
    send_buf = recv_buf = None
    if rank == vsucc:
        rrefs = sorted(store.committed(ROLE_REPLICA, verify=False), key=lambda r: r.header.iteration)
        rs = store.slot(ROLE_REPLICA, rrefs[-1].index)
        assert rs is not None  # noqa: S101
        rsegs = rs.image_segments(rrefs[-1].header)
        send_buf = torch.empty(sum(n for _, n in rsegs), dtype=torch.uint8)
        pos = 0
        for o, n in rsegs:
            send_buf[pos:pos + n].copy_(rs.segment(o, n))
            pos += n
        del rs, rrefs
    if rank == victim:
        recv_buf = torch.empty(image_bytes, dtype=torch.uint8)
        recv_buf.fill_(1)
        recv_views = _views_like(recv_buf[payload_at:payload_at + nbytes], plan)
    spans = []
    pos = 0
    for _, n in segs:
        spans.append((pos, n))
        pos += n

    def raw_pull() -> float:
        """The baseline; returns the seconds of its gloo part on the victim (0 elsewhere)."""
        t0 = time.perf_counter()
        meta = torch.zeros(META_LEN, dtype=torch.int64)
        if rank == vsucc:
            assert send_buf is not None  # noqa: S101
            meta[0] = send_buf.numel()
            dist.send(meta, dst=victim, group=raw_group, tag=_RAW_RESTORE_META)
            for p0, n in spans:
                for s0 in range(0, n, chunk):
                    dist.send(send_buf[p0 + s0:p0 + min(n, s0 + chunk)], dst=victim, group=raw_group,
                              tag=_RAW_RESTORE_DATA)
        elif rank == victim:
            assert recv_buf is not None  # noqa: S101
            dist.recv(meta, src=vsucc, group=raw_group, tag=_RAW_RESTORE_META)
            if int(meta[0]) != image_bytes:
                raise RuntimeError(f"rank {rank}: replica image of {int(meta[0])} bytes, own image {image_bytes}")
            for p0, n in spans:
                for s0 in range(0, n, chunk):
                    dist.recv(recv_buf[p0 + s0:p0 + min(n, s0 + chunk)], src=vsucc, group=raw_group,
                              tag=_RAW_RESTORE_DATA)
            t_gloo = time.perf_counter() - t0
            for n, src in zip(names, recv_views):
                live[n].copy_(src)
            return t_gloo
        return 0.0

    lost: dict[str, list[Any]] = {"restore": [], "raw": [], "raw_gloo": [], "phases": [], "slowest_rank_restore": [],
                                  "slowest_inventory": []}
    pulled = 0
    for it in range(rounds):
        for name in (("restore", "raw") if it % 2 == 0 else ("raw", "restore")):
            if name == "restore":
                store = reopen(lose=rank == victim)
            dist.barrier()
            if name == "restore":
                v, _, got = restore(SOURCE_REPLICA if rank == victim else SOURCE_OWN)
                if rank == victim:
                    pulled = got
            else:
                t0 = time.perf_counter()
                t_gloo = raw_pull()
                v = [time.perf_counter() - t0, t_gloo] + zeros[1:]
            mine = v if rank == victim else [0.0] * len(v)
            red = reduce_max(mine + [v[0], v[1]])
            if it >= cfg["warmup"]:
                lost[name].append(red[0])
                if name == "restore":
                    lost["phases"].append(dict(zip(RESTORE_PHASES, red[1:-2])))
                    lost["slowest_rank_restore"].append(red[-2])
                    lost["slowest_inventory"].append(red[-1])
                else:
                    lost["raw_gloo"].append(red[1])
    # What a replaced node pays before any byte can land: first touch of a new /dev/shm file of the image's size
    # (the restore receives into one; the baseline into a pre-faulted buffer).
    touch = []
    if rank == victim:
        for _ in range(3):
            t0 = time.perf_counter()
            b = ShmBuffer(root, image_bytes, tag="-fresh")  # creates, maps and writes every page
            touch.append(time.perf_counter() - t0)
            b.close()
    lost["fresh_file_touch"] = reduce_max([statistics.median(touch) if touch else 0.0])[0]
    out["lost"] = lost
    out["image_bytes"] = image_bytes
    out["pulled_bytes"] = int(reduce_max([float(pulled)])[0])
    return out, store


def restore_rows(res: dict[str, Any], world: int, chunk_mib: float) -> tuple[list[Row], list[str]]:
    """Table rows and notes of one world's restore results (pure: from :func:`_restore_section`'s output)."""
    rr = res["restore"]
    lost, local = rr["lost"], rr["local"]
    nb, ub = rr["image_bytes"], rr["unique_bytes"]
    tl, tr = _summary(lost["restore"]), _summary(lost["raw"])
    ll, lc = _summary(local["restore"]), _summary(local["copy"])
    rows = [
        Row("restore", f"restore W={world}, lost store: run_recovery + copy_ into live (pulling rank)", tl, "s",
            tr, f"raw gloo send/recv of the same {nb / MiB:.1f} MiB, {chunk_mib:g} MiB chunks, + torch.copy_",
            tl / tr if tr else float("nan"), 1.5, "<=").judge(),
        Row("restore", f"restore W={world}, local: own slot (xxh3 verified) -> live (slowest rank)", ll, "s",
            lc, f"torch.copy_ of {ub / MiB:.1f} MiB from a /dev/shm map -> live", ll / lc if lc else float("nan"),
            ).judge(),
    ]
    rows[0].detail = {"gbps": nb / tl / GB, "baseline_gbps": nb / tr / GB, "paired_ratio_median":
                      _paired(lost["restore"], lost["raw"]), "phases": phase_summary(lost["phases"])}
    rows[1].detail = {"gbps": ub / ll / GB, "baseline_gbps": ub / lc / GB, "paired_ratio_median":
                      _paired(local["restore"], local["copy"]), "phases": phase_summary(local["phases"])}
    gloo = _summary(lost.get("raw_gloo", []))
    touch = lost.get("fresh_file_touch", float("nan"))
    rows[0].detail.update({"raw_gloo_seconds": gloo, "fresh_file_touch_seconds": touch,
                           "slowest_inventory_seconds": _summary(lost.get("slowest_inventory", [])),
                           "ratio_less_fresh_touch": (tl - touch) / tr if tr else float("nan")})
    notes = [
        f"W={world} restore, rank {rr['victim']} lost its store and pulled {rr['pulled_bytes'] / MiB:.1f} MiB from "
        f"rank {rr['source_rank']}: {_fmt_phases(rows[0].detail['phases'])} ({_STAT}s); total {tl:.3f}s "
        f"({nb / tl / GB:.2f} GB/s) vs raw {tr:.3f}s ({nb / tr / GB:.2f} GB/s; gloo {gloo:.3f} + copy_); median of "
        f"per-round ratios {rows[0].detail['paired_ratio_median']:.3f}x; slowest rank's restore "
        f"{_summary(lost['slowest_rank_restore']):.3f}s; slowest rank's inventory (headers and commit markers; the "
        f"exchange waits for it) {_summary(lost.get('slowest_inventory', [])):.3f}s; first touch of a new /dev/shm "
        f"file of the image's size {touch:.3f}s (the restore receives into one, the baseline into a pre-faulted "
        f"buffer; less that, the ratio would be about {rows[0].detail['ratio_less_fresh_touch']:.2f}x).",
        f"W={world} local restore (every store intact), slowest rank: {_fmt_phases(rows[1].detail['phases'])} "
        f"({_STAT}s); total {ll:.3f}s vs copy_ {lc:.3f}s; median of per-round ratios "
        f"{rows[1].detail['paired_ratio_median']:.3f}x.",
    ]
    return rows, notes


def _paired(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of per-round ratios a/b (robust to load drift between rounds)."""
    r = [x / y for x, y in zip(a, b) if y > 0]
    return statistics.median(r) if r else float("nan")


def phase_summary(phases: Sequence[dict[str, float]]) -> dict[str, float]:
    """Summary (``--stat``) of each restore phase over rounds."""
    keys = [k for k in RESTORE_PHASES if any(k in p for p in phases)]
    return {k: _summary([p.get(k, 0.0) for p in phases]) for k in keys}


def _fmt_phases(ph: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in ph.items())


def bench_stream(args: argparse.Namespace, root: Path, world: int) -> tuple[list[Row], dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ncb-", dir=root) as tmp:
        cfg = {
            "mib": args.mib, "tensors": args.tensors, "iters": args.iters, "warmup": args.warmup,
            "chunk_bytes": int(args.chunk_mib * MiB), "root": str(root), "job_id": f"bench-ring{world}-{os.getpid()}",
            "init_file": os.path.join(tmp, "pg_init"), "out": os.path.join(tmp, "result.json"),
            "timeout_s": args.timeout, "restore": not getattr(args, "no_restore", False),
        }
        mp.start_processes(_stream_worker, args=(world, cfg), nprocs=world, join=True, start_method="spawn")
        res = json.loads(Path(cfg["out"]).read_text())

    nb = res["image_bytes"]
    tn, tr = _summary(res["seconds"]["neighbor"]), _summary(res["seconds"]["raw"])
    chunk_desc = f"raw gloo send/recv, {args.chunk_mib:g} MiB chunks"
    rows = [
        Row("stream", f"ring W={world}: GlooRingTransport.send incl. ack (per rank)", nb / tn / GB, "GB/s",
            nb / tr / GB, chunk_desc, tr / tn, 0.9, ">=").judge(),
        Row("host", f"host bytes / unique bytes (W={world}, 2 own + 2 replica)",
            res["host_bytes_max"] / res["unique_bytes"], "x", float(res["unique_bytes"]),
            "plan.unique_bytes", res["host_bytes_max"] / res["unique_bytes"], 4.05, "<=").judge(),
    ]
    rows[0].detail["paired_ratio_median"] = statistics.median(
        r / n for n, r in zip(res["seconds"]["neighbor"], res["seconds"]["raw"]))
    rows[1].detail = {"host_bytes": res["host_bytes_max"], "slot_files": res["slot_files_max"]}
    if "restore" in res:
        rrows, rnotes = restore_rows(res, world, args.chunk_mib)
        rows += rrows
        res["restore_notes"] = rnotes
    return rows, res


# --------------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------------


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
    elif r.unit == "s":
        base = f"{r.baseline:.3f} s" if r.baseline is not None and r.baseline == r.baseline else "-"
    else:
        base = f"{r.baseline / MiB:.1f} MiB" if r.baseline is not None else "-"
    tgt = "-" if r.target is None else f"{r.op} {r.target:g}x"
    val = _fmt(r.value, r.unit) if r.unit != "x" else _fmt(r.value, "x")
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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=256.0, help="unique state per rank in MiB (default 256)")
    ap.add_argument("--iters", type=int, default=8, help="timed iterations per measurement (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    ap.add_argument("--tensors", type=int, default=4, help="fp32 tensors the state is split into (default 4)")
    ap.add_argument("--world", default="4,2", help="ring sizes to stream with, comma-separated (default 4,2; "
                                                   "'' to skip streaming)")
    ap.add_argument("--chunk-mib", type=float, default=TransportConfig().chunk_mb,
                    help="transport chunk in MiB (default: TransportConfig.chunk_mb)")
    ap.add_argument("--store-dir", default=None, help=f"store root (default ${STORE_DIR_ENV} or /dev/shm)")
    ap.add_argument("--timeout", type=float, default=120.0, help="process-group / receive timeout in s")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write all results to PATH")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="summary of the timed iterations (default median; min = best-of, for noisy machines)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="first wait up to S seconds for other processes to use < 10%% of the CPUs")
    ap.add_argument("--no-restore", action="store_true",
                    help="skip the restore figures (run after the streaming run of every --world size)")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any target is missed (2 on errors always)")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.tensors < 1 or args.mib <= 0:
        ap.error("--iters, --tensors and --mib must be positive")
    worlds = [int(w) for w in args.world.split(",") if w.strip()]
    if any(w < 2 for w in worlds):
        ap.error("--world sizes must be >= 2")

    global _STAT
    _STAT = args.stat
    if args.wait_quiet > 0:
        ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        wait_until_quiet(args.wait_quiet, ncpu)
    base = Path(args.store_dir or os.environ.get(STORE_DIR_ENV) or "/dev/shm")
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="neighbor_ckpt_bench-", dir=base))
    info = machine_info(base)
    t_start = time.perf_counter()
    cpu0 = cpu_sample()
    rows: list[Row] = []
    notes: list[str] = []
    results: dict[str, Any] = {"machine": info, "args": vars(args)}
    try:
        try:
            r, extra = bench_staging(args, root)
            rows += r
            results["staging"] = extra
            g = extra["gbps"]
            cands = ", ".join(f"{k} {g[k]:.2f}" for k in ("torch.copy_ -> anon", "numpy.copyto -> anon",
                                                         "torch.copy_ -> /dev/shm map",
                                                         "numpy.copyto -> /dev/shm map"))
            notes.append(f"memcpy candidates (GB/s): {cands}; baseline = fastest ({extra['baseline']}).")
            l3 = _parse_size(info.get("l3_cache"))
            if l3 and extra["payload_bytes"] < 4 * l3:
                notes.append(f"payload is less than 4x the L3 cache ({info['l3_cache']}): part of every copy may "
                             f"run from cache; use a larger --mib to measure memory bandwidth alone.")
            pr = extra["paired_ratio_median"]
            notes.append(f"median of per-iteration ratios (engine and baseline timed back to back, robust to load "
                         f"drift): copy {pr['engine.stage']:.3f}x, local commit {pr['engine.commit']:.3f}x.")
            notes.append(f"copy then xxh3 back to back at those speeds would commit at "
                         f"{extra['ideal_serial_copy_then_hash_gbps']:.2f} GB/s (the commit row's ceiling "
                         f"while the hash runs after the copy on one thread).")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append(Row("staging", "staging benchmark", float("nan"), "", None, f"failed: {e!r}", None,
                            0.9).judge())
        for w in worlds:
            try:
                r, extra = bench_stream(args, root, w)
                rows += r
                results[f"stream_w{w}"] = extra
                tn = extra["seconds"]["neighbor"]
                tr = extra["seconds"]["raw"]
                eng = extra["engine_last_snapshot_max_seconds"]
                notes.append(
                    f"W={w}: median of per-iteration ratios {r[0].detail['paired_ratio_median']:.3f}x; image {extra['image_bytes'] / MiB:.2f} MiB/rank; slowest-rank seconds neighbor "
                    f"min/med/max {min(tn):.3f}/{statistics.median(tn):.3f}/{max(tn):.3f}, raw {min(tr):.3f}/"
                    f"{statistics.median(tr):.3f}/{max(tr):.3f}; aggregate "
                    f"{w * extra['image_bytes'] / _summary(tn) / GB:.2f} GB/s; engine end-to-end (last warm-up "
                    f"snapshot, slowest rank) wall {eng['wall']:.3f}s = stage {eng['stage']:.3f} + commit "
                    f"{eng['commit']:.3f} + stream {eng['stream']:.3f}.")
                notes += extra.get("restore_notes", [])
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append(Row("stream", f"ring W={w}", float("nan"), "", None, f"failed: {e!r}", None,
                                0.9).judge())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    fl = foreign_load(cpu0, cpu_sample(), info["nproc"] or 1)
    results["foreign_load"] = fl
    warn = "  WARNING: other processes were busy, figures are skewed" if fl["other_cpu_frac"] > 0.05 else ""
    notes.append(f"total benchmark time {elapsed:.1f}s; other processes used {fl['other_cpu_s']:.1f} CPU-s "
                 f"({100 * fl['other_cpu_frac']:.0f}% of the {info['nproc']} cores), hypervisor steal "
                 f"{100 * fl['steal_frac']:.0f}%; /proc/loadavg at start {info['loadavg_start']}.{warn}")
    results["rows"] = [asdict(r) for r in rows]
    results["elapsed_seconds"] = elapsed
    render(info, args, rows, notes)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    if any(r.status == "ERROR" for r in rows):
        return 2
    return 1 if args.strict and any(r.status == "MISS" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
