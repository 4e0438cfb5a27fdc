"""Section 4: restore vs raw transfer, after the streaming run (a local restore, and a rank that lost its store)."""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from tools.bench.micro import common
from tools.bench.micro.common import GB, MiB, Row, ShmBuffer, stat_summary, views_like
from neighbor_ckpt.snapshot.razor import ShardPlan
from neighbor_ckpt.snapshot.store import ROLE_OWN, ROLE_REPLICA, HostStore

RESTORE_PHASES = ("inventory", "exchange", "transfer", "verify", "load", "copy")
"""Seconds kept per restore: ``RecoveryReport.phases`` (inventory .. load) and the copy into the live tensors."""
_RAW_RESTORE_META, _RAW_RESTORE_DATA = 21, 22


def restore_section(rank: int, world: int, cfg: dict[str, Any], topo: Any, group: Any, raw_group: Any,
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
      victim. Two variants: ``restore``, where the victim prepared its receive slot before the clock starts, as a
      replaced rank does while its process starts (``HostStore.prefault`` with the capacities it published,
      :mod:`neighbor_ckpt.runtime.launch_store`; the time it took is kept apart, ``prepare``), and ``unprepared``,
      where the pull makes the slot. Baseline: the successor sends the same bytes (meta + the image in
      ``chunk_bytes`` chunks) with ``dist.send`` into a pre-faulted anonymous buffer of the victim over a second
      gloo group, and the victim ``torch.copy_``-s the payload into the live tensors.

    Returns (results for rank 0, the store now open).
    """
    import torch.distributed as dist

    from neighbor_ckpt.recovery.reconcile import SOURCE_OWN, SOURCE_REPLICA
    from neighbor_ckpt.recovery.flow import run_recovery
    from neighbor_ckpt.snapshot.topology import build_topology
    from neighbor_ckpt.snapshot.gloo_transport import META_LEN

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

    def reopen(lose: bool, prepare: tuple[int, int, int] | None = None, wait: bool = True) -> HostStore:
        """A restarted rank's store (``lose``: a replaced node's, empty; ``prepare``: its own slot made in advance;
        ``wait``: finished before the clock starts, as when the preparation began early enough, else still running
        when the recovery starts, as when the checkpointer's constructor starts it right before ``recover()``)."""
        store.close()
        if lose:
            shutil.rmtree(store.dir, ignore_errors=True)
        fresh = HostStore(root, job_id=cfg["job_id"], rank=rank, versions=2, use_checksum=True)
        if prepare is not None:
            fresh.prefault(ROLE_OWN, header_cap=prepare[0], payload_cap=prepare[1], extras_cap=prepare[2])
            if wait:
                fresh.wait_prepared()
        return fresh

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
        shm_views = views_like(shm.tensor, plan)
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
    own_caps = image.capacities  # what the victim published (SlotCapacities) before it lost its store
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
        recv_views = views_like(recv_buf[payload_at:payload_at + nbytes], plan)
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

    lost: dict[str, list[Any]] = {"restore": [], "raw": [], "unprepared": [], "raw_gloo": [], "phases": [],
                                  "unprepared_phases": [], "slowest_rank_restore": [], "slowest_inventory": [],
                                  "prepare": [], "constructed": [], "constructed_phases": [], "constructed_wait": []}
    pulled = 0
    # restore: the slot prepared before the recovery (a preparation that began early enough); constructed: its
    # preparation started right before the recovery, as the checkpointer's constructor does today; unprepared: the
    # pull makes the slot; raw: the baseline.
    variants = ("restore", "raw", "unprepared", "constructed")
    phase_key = {"restore": "phases", "unprepared": "unprepared_phases", "constructed": "constructed_phases"}
    for it in range(rounds):
        for name in variants[it % 4:] + variants[:it % 4]:  # the order rotates round by round
            if name != "raw":
                prepared = name in ("restore", "constructed") and rank == victim
                store = reopen(lose=rank == victim, prepare=own_caps if prepared else None, wait=name == "restore")
                if name == "restore" and store.prepared is not None and it >= cfg["warmup"]:
                    lost["prepare"].append(store.prepared.seconds)
            dist.barrier()
            if name != "raw":
                v, _, got = restore(SOURCE_REPLICA if rank == victim else SOURCE_OWN)
                if rank == victim:
                    pulled = got
                    if name in ("restore", "constructed") and not (store.prepared is not None
                                                                   and store.prepared.used):
                        raise RuntimeError(f"rank {rank}: the pull did not land in the prepared slot")
                    if name == "constructed" and it >= cfg["warmup"]:
                        assert store.prepared is not None  # noqa: S101 - used, just checked
                        lost["constructed_wait"].append(store.prepared.waited)
            else:
                t0 = time.perf_counter()
                t_gloo = raw_pull()
                v = [time.perf_counter() - t0, t_gloo] + zeros[1:]
            mine = v if rank == victim else [0.0] * len(v)
            red = reduce_max(mine + [v[0], v[1]])
            if it >= cfg["warmup"]:
                lost[name].append(red[0])
                if name != "raw":
                    lost[phase_key[name]].append(dict(zip(RESTORE_PHASES, red[1:-2])))
                if name == "restore":
                    lost["slowest_rank_restore"].append(red[-2])
                    lost["slowest_inventory"].append(red[-1])
                elif name == "raw":
                    lost["raw_gloo"].append(red[1])
    # What preparing the receive slot took (in the background of a process start; not in the restore's time).
    lost["prepare_seconds"] = reduce_max([statistics.median(lost["prepare"]) if lost["prepare"] else 0.0])[0]
    # How long the pull waited for a preparation started right before it (the victim's; 0 on the other ranks).
    lost["constructed_wait"] = [reduce_max([w])[0] for w in
                                (lost["constructed_wait"] or [0.0] * len(lost["constructed"]))]
    out["lost"] = lost
    out["image_bytes"] = image_bytes
    out["pulled_bytes"] = int(reduce_max([float(pulled)])[0])
    return out, store


def restore_rows(res: dict[str, Any], world: int, chunk_mib: float) -> tuple[list[Row], list[str]]:
    """Table rows and notes of one world's restore results (pure: from :func:`restore_section`'s output): the lost
    store with its receive slot prepared (the target), the same without (the slot made by the pull), the local
    restore."""
    rr = res["restore"]
    lost, local = rr["lost"], rr["local"]
    nb, ub = rr["image_bytes"], rr["unique_bytes"]
    tl, tr = stat_summary(lost["restore"]), stat_summary(lost["raw"])
    tu = stat_summary(lost["unprepared"]) if lost.get("unprepared") else float("nan")
    ll, lc = stat_summary(local["restore"]), stat_summary(local["copy"])
    raw_desc = f"raw gloo send/recv of the same {nb / MiB:.1f} MiB, {chunk_mib:g} MiB chunks, + torch.copy_"
    real = bool(lost.get("constructed"))
    rows = [
        Row("restore", f"restore W={world}, lost store, receive slot prepared"
            + (" before the recovery (a preparation begun early enough)" if real else "")
            + ": run_recovery + copy_ (pulling rank)", tl, "s", tr, raw_desc, tl / tr if tr else float("nan"),
            *(() if real else (1.5, "<="))).judge(),
        Row("restore", f"restore W={world}, lost store, slot made by the pull (pulling rank)", tu, "s", tr, raw_desc,
            tu / tr if tr else float("nan")).judge(),
        Row("restore", f"restore W={world}, local: own slot (xxh3 verified) -> live (slowest rank)", ll, "s",
            lc, f"torch.copy_ of {ub / MiB:.1f} MiB from a /dev/shm map -> live", ll / lc if lc else float("nan"),
            ).judge(),
    ]
    prepare = lost.get("prepare_seconds", float("nan"))
    rows[0].detail = {"gbps": nb / tl / GB, "baseline_gbps": nb / tr / GB, "paired_ratio_median":
                      _paired(lost["restore"], lost["raw"]), "phases": phase_summary(lost["phases"]),
                      "raw_gloo_seconds": stat_summary(lost.get("raw_gloo", [])), "prepare_seconds": prepare,
                      "slowest_inventory_seconds": stat_summary(lost.get("slowest_inventory", []))}
    rows[1].detail = {"paired_ratio_median": _paired(lost.get("unprepared", []), lost["raw"]),
                      "phases": phase_summary(lost.get("unprepared_phases", []))}
    rows[2].detail = {"gbps": ub / ll / GB, "baseline_gbps": ub / lc / GB, "paired_ratio_median":
                      _paired(local["restore"], local["copy"]), "phases": phase_summary(local["phases"])}
    if real:
        # Today's order: the checkpointer's constructor starts the preparation right before recover() (the target's
        # row: what a replaced rank gets unless its preparation begins earlier).
        tc = stat_summary(lost["constructed"])
        rows.insert(1, Row("restore", f"restore W={world}, lost store, slot preparation started at the checkpointer's "
                           "construction, right before the recovery (pulling rank)", tc, "s", tr, raw_desc,
                           tc / tr if tr else float("nan"), 1.5, "<=").judge())
        rows[1].detail = {"paired_ratio_median": _paired(lost["constructed"], lost["raw"]),
                          "phases": phase_summary(lost.get("constructed_phases", [])),
                          "slot_wait_seconds": stat_summary(lost.get("constructed_wait", []) or [0.0])}
    gloo = rows[0].detail["raw_gloo_seconds"]
    notes = [
        f"W={world} restore, rank {rr['victim']} lost its store and pulled {rr['pulled_bytes'] / MiB:.1f} MiB from "
        f"rank {rr['source_rank']} into a receive slot prepared before the recovery ({prepare:.3f}s; the best case: "
        f"a preparation begun early enough): {_fmt_phases(rows[0].detail['phases'])} ({common.STAT}s); total "
        f"{tl:.3f}s ({nb / tl / GB:.2f} GB/s) vs raw {tr:.3f}s ({nb / tr / GB:.2f} GB/s; gloo {gloo:.3f} + copy_); "
        f"median of per-round ratios {rows[0].detail['paired_ratio_median']:.3f}x; slowest rank's restore "
        f"{stat_summary(lost['slowest_rank_restore']):.3f}s; slowest rank's inventory (headers and commit markers; the "
        f"exchange waits for it) {rows[0].detail['slowest_inventory_seconds']:.3f}s. Without the prepared slot "
        f"(the pull makes it): {_fmt_phases(rows[-2].detail['phases'])}; total {tu:.3f}s, median of per-round ratios "
        f"{rows[-2].detail['paired_ratio_median']:.3f}x.",
        f"W={world} local restore (every store intact), slowest rank: {_fmt_phases(rows[-1].detail['phases'])} "
        f"({common.STAT}s); total {ll:.3f}s vs copy_ {lc:.3f}s; median of per-round ratios "
        f"{rows[-1].detail['paired_ratio_median']:.3f}x.",
    ]
    if real:
        notes.insert(1, f"W={world} restore in today's order (the slot's preparation started right before the "
                        f"recovery, as the checkpointer's constructor does): {_fmt_phases(rows[1].detail['phases'])} "
                        f"({common.STAT}s); the pull waited {rows[1].detail['slot_wait_seconds']:.3f}s for the slot; "
                        f"total {rows[1].value:.3f}s, median of per-round ratios "
                        f"{rows[1].detail['paired_ratio_median']:.3f}x.")
    return rows, notes


def _paired(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of per-round ratios a/b (robust to load drift between rounds)."""
    r = [x / y for x, y in zip(a, b) if y > 0]
    return statistics.median(r) if r else float("nan")


def phase_summary(phases: Sequence[dict[str, float]]) -> dict[str, float]:
    """Summary (``--stat``) of each restore phase over rounds."""
    keys = [k for k in RESTORE_PHASES if any(k in p for p in phases)]
    return {k: stat_summary([p.get(k, 0.0) for p in phases]) for k in keys}


def _fmt_phases(ph: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in ph.items())
