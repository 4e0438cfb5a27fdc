"""Sections 2 + 3: ring streaming vs raw gloo, and host memory vs unique bytes (W processes, spawn, gloo).

The worker also runs section 4 (:mod:`tools.bench.micro.restore`) on the stores it leaves behind."""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tools.bench.micro.common import (GB, MiB, Row, stat_summary, make_metas, make_plan, make_sources,
                                                  small_extras)
from tools.bench.micro.restore import restore_rows, restore_section
from neighbor_ckpt.snapshot.engine import SnapshotEngine
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore

_RAW_META, _RAW_DATA, _RAW_ACK = 11, 12, 13


def _stream_worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    import torch.distributed as dist

    from neighbor_ckpt.snapshot.topology import build_topology
    from neighbor_ckpt.snapshot.gloo_transport import META_LEN, GlooRingTransport

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
            result["restore"], store = restore_section(rank, world, cfg, topo, group, raw_group, plan, store)
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
    tn, tr = stat_summary(res["seconds"]["neighbor"]), stat_summary(res["seconds"]["raw"])
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
