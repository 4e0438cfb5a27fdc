"""Elastic resharding, the collective part: the previous data-parallel layout's snapshots, found in the host stores of
the surviving processes, re-partitioned into this layout (the plan is pure: :mod:`neighbor_ckpt.recovery.reshard`).

When it runs: the checkpointer's store generation check (:func:`decide_generation`, at construction) found that the
newest snapshots of this job were taken with another world size or data-parallel size, and ``neighbor_ckpt.elastic``
is on. Every rank's number may have changed (in-process shrink renumbers the survivors; a launcher restart with fewer
nodes assigns ranks anew), so snapshots are found by *scanning* every rank directory of the previous generation on
this node, not by this rank's number, and this layout's snapshots go to a new generation (``g<k>``) of the store.

:func:`run_reshard`, collective over the snapshot group (the transport's), in this order on every rank:

1. exchange: one all-gather (:func:`all_gather_bytes`) of what each process holds (every committed own or replica
   slot of the previous generation on its node: old owner, iteration, the old rank's layout) and this rank's new
   layout (its unique tensors with their shard spans);
2. per round (at most :func:`~neighbor_ckpt.recovery.flow.max_rounds` with two copies per version): the choice
   (:func:`~neighbor_ckpt.recovery.reshard.choose_version`, pure), the holders verify the checksums of the copies
   they serve, one all-gather of the failed copies; none failed ends the rounds, else they are excluded and the next
   round chooses again;
3. the moves (:func:`~neighbor_ckpt.recovery.reshard.plan_reshard`, pure): one message per pair the plan names,
   through the transport's exchange (:meth:`~neighbor_ckpt.snapshot.transport.NeighborTransport.exchange`); each
   message carries the xxh3 of its bytes, checked on arrival;
4. the move verdict: one all-gather of each rank's problem, if any (a message that failed its checksum): one failure
   anywhere and every rank reports the fallback (the restore flow's insurance outcome), so no rank loads a resharded
   state while another cannot.

Nothing is loaded unless every piece arrived and checked on every rank; the caller loads the result into the optimizer
(the adapter) and regenerates the weights with the new layout's param all-gather.

May import: :mod:`neighbor_ckpt.snapshot`, :mod:`neighbor_ckpt.errors`, the rest of :mod:`neighbor_ckpt.recovery`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from neighbor_ckpt.errors import SnapshotCorruptError, SnapshotMismatchError
from neighbor_ckpt.recovery.flow import COPIES_PER_VERSION_RESHARD, RecoveryReport, Restored, max_rounds, no_progress
from neighbor_ckpt.recovery.reshard import (Copy, Piece, RankLayout, ReshardPlan, ShardSpan, TensorEntry,
                                            VersionChoice, choose_version, plan_reshard)
from neighbor_ckpt.snapshot import codec
from neighbor_ckpt.snapshot.razor import StateKind, plan_shards
from neighbor_ckpt.snapshot.slot import SlotFile, SlotHeader
from neighbor_ckpt.snapshot.store import ROLE_OWN, ROLE_REPLICA, generation_dir, remove_generations, store_generations
from neighbor_ckpt.snapshot.topology import Topology
from neighbor_ckpt.snapshot.transport import NeighborTransport

logger = logging.getLogger(__name__)

__all__ = ["GenerationInfo", "LocalGeneration", "local_generation", "local_generations", "decide_generation",
           "scan_copies", "layout_from_meta", "run_reshard", "all_gather_bytes", "ELASTIC_META_KEYS", "Generations",
           "model_identity", "rank_layout"]

ELASTIC_META_KEYS = ("world_size", "dp_ranks", "coord", "model", "shards", "tensors")
"""What a slot header's ``meta`` must hold for its snapshot to be resharded (the checkpointer writes them all)."""


# -- generations ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalGeneration:
    """A generation of this job's store on this node that holds a committed snapshot, the layout of its snapshots
    (-1: none), and which old ranks' iterations its committed copies hold (``copies``: (owner, iteration) pairs;
    empty: not known)."""

    generation: int = -1
    world_size: int = -1
    dp_size: int = -1
    copies: tuple[tuple[int, int], ...] = ()

    def to_json(self) -> list[Any]:
        return [self.generation, self.world_size, self.dp_size, [list(c) for c in self.copies]]

    @classmethod
    def from_json(cls, v: list[Any]) -> LocalGeneration:
        return cls(int(v[0]), int(v[1]), int(v[2]), tuple((int(o), int(i)) for o, i in v[3]))


@dataclass(frozen=True)
class GenerationInfo:
    """Which store generation this process uses, and whether it reshards into it (:func:`decide_generation`)."""

    generation: int
    """The generation this layout's snapshots go to (and are restored from)."""
    reshard_from: int | None = None
    """The previous generation, when its snapshots were taken with another world or data-parallel size: they are
    resharded into this one (None: an ordinary restore, or a fresh start)."""
    world_before: int | None = None
    dp_before: int | None = None
    skipped: int | None = None
    """The newest generation, when it holds no complete version and an older one (not yet released) does: that older
    one is resharded instead (a failure before the newest layout's first complete snapshot)."""


def _committed_headers(gen_dir: Path) -> list[tuple[str, Path, SlotHeader]]:
    """Every committed own / replica slot under a generation directory (unreadable or torn slots skipped)."""
    out: list[tuple[str, Path, SlotHeader]] = []
    for rd in sorted(gen_dir.glob("rank*")):
        if not rd.is_dir():
            continue
        for role in (ROLE_OWN, ROLE_REPLICA):
            for path in sorted(rd.glob(f"{role}.*.slot")):
                try:
                    slot = SlotFile.open(path)
                except (SnapshotCorruptError, SnapshotMismatchError, OSError):
                    continue
                try:
                    out.append((role, path, slot.read_header()))
                except (SnapshotCorruptError, SnapshotMismatchError):
                    pass
                finally:
                    slot.close()
    return out


def local_generations(root: Path, job_id: str) -> list[LocalGeneration]:
    """Every generation of the job on this node with a committed snapshot, newest first: its layout and the (owner,
    iteration) of each committed copy."""
    out: list[LocalGeneration] = []
    for gen in reversed(store_generations(root, job_id)):
        hdrs = [hdr for _, _, hdr in _committed_headers(generation_dir(root, job_id, gen)) if hdr.job_id == job_id]
        if not hdrs:
            continue
        world = int(hdrs[0].meta.get("world_size", -1))
        dp = len(hdrs[0].meta.get("dp_ranks", ())) or -1
        copies = tuple(sorted({(int(h.owner_rank), int(h.iteration)) for h in hdrs}))
        out.append(LocalGeneration(gen, world, dp, copies))
    return out


def local_generation(root: Path, job_id: str) -> LocalGeneration:
    """This node's newest generation of the job with a committed snapshot, and that snapshot's layout."""
    found = local_generations(root, job_id)
    return found[0] if found else LocalGeneration()


def _complete(nodes: list[list[LocalGeneration]], generation: int) -> bool:
    """Whether the copies every process reported for ``generation`` hold one iteration for every rank of its layout
    (:func:`~neighbor_ckpt.recovery.reshard.choose_version`, pure); True when no process reported its copies."""
    rows = [(h, g) for h, gens in enumerate(nodes) for g in gens if g.generation == generation]
    if not any(g.copies for _, g in rows):
        return True
    world = min(g.world_size for _, g in rows)
    copies = [Copy(o, i, h, "own") for h, g in rows for o, i in g.copies]
    return world > 0 and choose_version(copies, old_world=world).iteration is not None


def decide_generation(rows: list[LocalGeneration] | list[list[LocalGeneration]], *, world_size: int, dp_size: int,
                      elastic: bool) -> GenerationInfo:
    """Pure (every process's :func:`local_generations`, gathered; or each one's newest, :func:`local_generation`):
    the newest generation anywhere; an ordinary restore in it when its snapshots have this world and data-parallel
    size (or elastic is off: the restore flow then refuses another layout, as always), else a reshard from it into the
    next generation.

    With elastic on, a newest generation that holds no complete version (a failure before its layout's first
    snapshot was committed on every rank) while an older one, not yet released, does: that older layout's snapshots
    are resharded into the next generation instead of falling back to insurance."""
    nodes = [r if isinstance(r, list) else ([r] if r.generation >= 0 else []) for r in rows]
    gens = sorted({g.generation for gens in nodes for g in gens}, reverse=True)
    if not gens:
        return GenerationInfo(0)
    newest = gens[0]

    def layout(gen: int) -> set[tuple[int, int]]:
        return {(g.world_size, g.dp_size) for gens_ in nodes for g in gens_ if g.generation == gen}

    if elastic and not _complete(nodes, newest):
        older = next((g for g in gens[1:] if _complete(nodes, g)), None)
        if older is not None:
            world, dp = min(layout(older))
            return GenerationInfo(newest + 1, reshard_from=older, world_before=world, dp_before=dp, skipped=newest)
    layouts = layout(newest)
    world, dp = min(layouts)
    if not elastic or layouts == {(world_size, dp_size)}:
        return GenerationInfo(newest)
    return GenerationInfo(newest + 1, reshard_from=newest, world_before=world, dp_before=dp)


def gather_generations(mine: list[LocalGeneration], group: dist.ProcessGroup) -> list[list[LocalGeneration]]:
    """Collective over ``group`` (two all-gathers: :func:`all_gather_bytes`): every process's
    :func:`local_generations`, by group rank."""
    data = json.dumps([g.to_json() for g in mine], separators=(",", ":")).encode()
    return [[LocalGeneration.from_json(v) for v in json.loads(b)] for b in all_gather_bytes(data, group)]


class Generations:
    """The checkpointer's side of the store generations: which one this layout uses (:func:`decide_generation`,
    collective, at construction), what a snapshot header records for a later reshard (:meth:`snapshot_meta`), and the
    release of the previous layout's snapshots once this layout has a complete version (:meth:`maybe_release`,
    collective).

    Args:
        root, job_id: the host store's root and job.
        topology: this rank's place in this layout.
        group: the snapshot group (gloo).
        elastic: ``neighbor_ckpt.elastic.enabled`` (off: the newest generation is restored as it is; a snapshot of
            another layout is then refused by the restore flow, as always).
    """

    def __init__(self, *, root: Path, job_id: str, topology: Topology, group: dist.ProcessGroup,
                 elastic: bool) -> None:
        self.root, self.job_id, self.topology, self.group = Path(root), job_id, topology, group
        rows = gather_generations(local_generations(self.root, job_id), group)
        self.info = decide_generation(rows, world_size=topology.world_size, dp_size=topology.dp_size,
                                      elastic=elastic)
        """The generation this layout uses, and the one it reshards from (if any)."""
        self._release_below: int | None = self.info.generation if self.info.reshard_from is not None else None
        if self.info.skipped is not None:
            logger.warning("rank %d: neighbor_ckpt: store generation %d holds no complete version (a failure before "
                           "its layout's first snapshot was committed and replicated everywhere); generation %d, not "
                           "released yet, does: resharding it from memory instead of falling back to insurance",
                           topology.rank, self.info.skipped, self.info.reshard_from)
        if self.info.reshard_from is not None:
            logger.info("rank %d: neighbor_ckpt: the newest snapshots (store generation %d) were taken with %d ranks, "
                        "data-parallel size %d; this job has %d ranks, data-parallel size %d: elastic reshard into "
                        "generation %d", topology.rank, self.info.reshard_from, self.info.world_before,
                        self.info.dp_before, topology.world_size, topology.dp_size, self.info.generation)

    @property
    def generation(self) -> int:
        return self.info.generation

    @property
    def reshard_from(self) -> int | None:
        return self.info.reshard_from

    def snapshot_meta(self, adapter: Any, unique: set[str]) -> dict[str, Any]:
        """What every snapshot header records for a later elastic reshard (:func:`layout_from_meta`): this rank's
        model-parallel coordinate, the model identity and the shard span of each DP-sharded unique tensor."""
        return {"coord": list(self.topology.model_parallel_coord), "model": model_identity(adapter),
                "shards": {n: list(span) for n, span in (adapter.dp_shards() or {}).items() if n in unique}}

    def maybe_release(self, *, first_snapshot: int, committed: int, replicated: int | None) -> None:
        """Collective (one all-reduce), on every rank at the same iterations from this layout's second snapshot on,
        until it succeeds: once every rank's first snapshot in this layout is committed and (``replicated``, None
        without a ring) replicated, the previous layouts' snapshots are deleted on every node; until then they are
        what a failure would be resharded from again."""
        if self._release_below is None:
            return
        ready = committed >= first_snapshot and (replicated is None or replicated >= first_snapshot)
        verdict = torch.tensor([1 if ready else 0], dtype=torch.int64)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=self.group)
        if int(verdict.item()):
            self.release()

    def release(self) -> None:
        """Delete this node's snapshots of the previous layouts (not collective; at the end of a successful run)."""
        below, self._release_below = self._release_below, None
        if below is None:
            return
        removed = remove_generations(self.root, self.job_id, below=below)
        logger.info("rank %d: neighbor_ckpt: this layout has a complete snapshot; the previous layout's snapshots are "
                    "released (%d director%s on this node)", self.topology.rank, len(removed),
                    "y" if len(removed) == 1 else "ies")

    @property
    def release_pending(self) -> bool:
        return self._release_below is not None


def model_identity(adapter: Any) -> str:
    """Identity of the model a rank holds a part of, independent of the data-parallel size (the adapter, the names,
    dtypes and shapes of its weights): an elastic reshard accepts snapshots of the same model identity only."""
    key = {"adapter": type(adapter).__name__,
           "weights": [(m.name, str(m.dtype), list(m.shape)) for m, _ in adapter.named_tensors()
                       if m.kind is StateKind.WEIGHT]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def rank_layout(adapter: Any, topology: Topology) -> RankLayout:
    """This rank's unique tensors in this layout, with the shard span of each data-parallel-sharded one: what an
    elastic reshard fills."""
    adapter.materialize()  # optimizer state that exists after a first step only: named, so it is filled too
    tensors = adapter.named_tensors()
    plan = plan_shards([m for m, _ in tensors], dp_size=topology.dp_size,
                       distributed_optimizer=adapter.distributed_optimizer)
    shards = adapter.dp_shards() or {}
    return RankLayout(
        rank=topology.rank, world_size=topology.world_size, coord=tuple(topology.model_parallel_coord),
        dp_index=topology.dp_rank, dp_size=topology.dp_size, model=model_identity(adapter),
        tensors=tuple(TensorEntry(p.meta.name, str(p.meta.dtype).removeprefix("torch."), tuple(p.meta.shape),
                                  ShardSpan(*shards[p.meta.name]) if p.meta.name in shards else None)
                      for p in plan.unique))


# -- what this process holds ------------------------------------------------------------------------------------


def layout_from_meta(owner: int, meta: Mapping[str, Any]) -> RankLayout | None:
    """The old rank's layout as its snapshot header recorded it; None when the header lacks what a reshard needs."""
    if any(k not in meta for k in ELASTIC_META_KEYS):
        return None
    dp_ranks = [int(r) for r in meta["dp_ranks"]]
    if owner not in dp_ranks:
        return None
    shards = meta["shards"]
    tensors = tuple(TensorEntry(str(t["name"]), str(t["dtype"]), tuple(int(x) for x in t["shape"]),
                                ShardSpan.from_json(shards[t["name"]]) if t["name"] in shards else None)
                    for t in meta["tensors"])
    return RankLayout(rank=owner, world_size=int(meta["world_size"]), coord=tuple(int(c) for c in meta["coord"]),
                      dp_index=dp_ranks.index(owner), dp_size=len(dp_ranks), model=str(meta["model"]),
                      tensors=tensors)


@dataclass
class LocalCopies:
    """The previous generation's snapshots this process can read."""

    copies: list[Copy] = field(default_factory=list)
    layouts: dict[int, RankLayout] = field(default_factory=dict)
    paths: dict[tuple[int, int, str], Path] = field(default_factory=dict)
    """(owner, iteration, role) -> slot file."""


def scan_copies(root: Path, job_id: str, generation: int, *, holder: int) -> LocalCopies:
    """Every committed own / replica slot of ``generation`` on this node whose header is intact, of this job, and
    carries the layout a reshard needs (checksums are verified later, for the copies chosen)."""
    found = LocalCopies()
    for role, path, hdr in _committed_headers(generation_dir(root, job_id, generation)):
        if hdr.job_id != job_id:
            logger.warning("rank %d: %s holds a snapshot of job %r; ignored", holder, path, hdr.job_id)
            continue
        layout = layout_from_meta(hdr.owner_rank, hdr.meta)
        if layout is None:
            logger.warning("rank %d: %s lacks the layout a reshard needs (written by an older neighbor_ckpt); "
                           "ignored", holder, path)
            continue
        key = (hdr.owner_rank, hdr.iteration, role)
        if key in found.paths:
            continue
        found.paths[key] = path
        found.copies.append(Copy(hdr.owner_rank, hdr.iteration, holder, role))
        found.layouts.setdefault(hdr.owner_rank, layout)
    return found


# -- collectives ------------------------------------------------------------------------------------------------


def all_gather_bytes(data: bytes, group: dist.ProcessGroup) -> list[bytes]:
    """Collective over ``group``: every rank's ``data``, by group rank (two all-gathers: lengths, then the padded
    bytes)."""
    world = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64)
    lens = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(lens, n, group=group)
    size = max(int(x.item()) for x in lens)
    buf = torch.zeros(max(size, 1), dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    return [bytes(o[:int(n_.item())].numpy().tobytes()) for o, n_ in zip(out, lens)]


# -- the reshard ------------------------------------------------------------------------------------------------


@dataclass
class _Open:
    """The chosen copies this process serves, opened and verified."""

    slots: dict[int, tuple[SlotFile, SlotHeader]] = field(default_factory=dict)
    """old owner -> (slot, header)."""

    def close(self) -> None:
        for slot, _ in self.slots.values():
            slot.close()
        self.slots.clear()


def _serve(choice: VersionChoice, local: LocalCopies, *, rank: int, verify: bool) -> tuple[_Open, list[list]]:
    """Open (and checksum) the copies this process was chosen to serve; returns them and the keys that failed."""
    opened, failed = _Open(), []
    for c in choice.sources:
        if c.holder != rank:
            continue
        path = local.paths[(c.owner, c.iteration, c.role)]
        try:
            slot = SlotFile.open(path)
            hdr = slot.read_header()
            if hdr.iteration != c.iteration or hdr.owner_rank != c.owner:
                raise SnapshotCorruptError(f"{path}: holds iteration {hdr.iteration} of rank {hdr.owner_rank} now")
            if verify:
                slot.verify(hdr)
            opened.slots[c.owner] = (slot, hdr)
        except (SnapshotCorruptError, SnapshotMismatchError, OSError) as e:
            logger.warning("rank %d: old rank %d's %s copy of iteration %d failed verification: %s", rank, c.owner,
                           c.role, c.iteration, e)
            failed.append(list(c.key))
    return opened, failed


def _views(slot: SlotFile, hdr: SlotHeader) -> dict[str, torch.Tensor]:
    """The slot's tensors, flat, as views of host memory."""
    return {t["name"]: slot.payload_view(t["offset"], codec.dtype_named(t["dtype"]), t["shape"]).reshape(-1)
            for t in hdr.meta.get("tensors", [])}


def _pack(pieces: list[Piece], opened: _Open, extras_owner: int | None) -> tuple[dict[str, Any], np.ndarray]:
    """What one receiver gets from this process: the pieces' bytes in plan order, then (when this process serves the
    receiver's extras owner) that old rank's extras region, and the optimizer's per-param scalars of the params it
    sends. Returns (JSON part, bytes)."""
    views: dict[int, dict[str, torch.Tensor]] = {}
    chunks: list[np.ndarray] = []
    scalars: dict[str, Any] = {}
    for p in pieces:
        if p.owner not in views:
            views[p.owner] = _views(*opened.slots[p.owner])
        src = views[p.owner][p.tensor][p.src_offset:p.src_offset + p.count]
        chunks.append(src.contiguous().view(torch.uint8).numpy())
    owners = sorted({p.owner for p in pieces})
    for o in owners:
        slot, hdr = opened.slots[o]
        adapter = (slot.read_extras(hdr) or {}).get("adapter") or {}
        names = {p.tensor.split("/", 2)[1] for p in pieces if p.owner == o and p.tensor.startswith(("main/", "optim/"))}
        for name, vals in (adapter.get("scalars") or {}).items():
            if name in names:
                scalars.setdefault(name, vals)
    head: dict[str, Any] = {"pieces_nbytes": int(sum(c.nbytes for c in chunks))}
    text, tensors = codec.encode(scalars)
    if tensors:
        raise SnapshotMismatchError("per-parameter optimizer scalars hold tensors; they cannot be resharded")
    head["scalars"] = text
    if extras_owner is not None:
        slot, hdr = opened.slots[extras_owner]
        region = slot.segment(slot.extras_off, hdr.extras_nbytes).numpy()
        chunks.append(region)
        head["extras"] = {"owner": extras_owner, "json_nbytes": hdr.extras_json_nbytes,
                          "tensors": hdr.extras_tensors, "nbytes": hdr.extras_nbytes}
    blob = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)
    head["xxh3"] = xxhash.xxh3_64_intdigest(blob)
    return head, blob


def _refusal(reason: str) -> tuple[dict[str, Any], np.ndarray]:
    """The message a process sends in place of its data when it could not pack it (:func:`_decode_message` raises
    it on the receiver)."""
    blob = np.zeros(0, dtype=np.uint8)
    return {"refused": reason, "pieces_nbytes": 0, "xxh3": xxhash.xxh3_64_intdigest(blob)}, blob


def _encode_message(head: dict[str, Any], blob: np.ndarray) -> torch.Tensor:
    raw = json.dumps(head, separators=(",", ":")).encode()
    pad = (-len(raw)) % 8
    out = np.empty(8 + len(raw) + pad + blob.nbytes, dtype=np.uint8)
    out[:8] = np.frombuffer(np.int64(len(raw)).tobytes(), dtype=np.uint8)
    out[8:8 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    out[8 + len(raw):8 + len(raw) + pad] = 0
    out[8 + len(raw) + pad:] = blob
    return torch.from_numpy(out)


MESSAGE_HEAD_ALLOWANCE = 256 << 20
"""What a reshard message may hold beyond the pieces the plan sends this rank: its header (the extras owner's small
state: RNG streams, counters, user state, each far below this) and alignment. A peer announcing more is refused
before anything is allocated (:meth:`~neighbor_ckpt.snapshot.transport.NeighborTransport.exchange`)."""


def _decode_message(buf: torch.Tensor, src: int, rank: int) -> tuple[dict[str, Any], np.ndarray]:
    """A message of :func:`_encode_message`, checked: a damaged one raises :class:`SnapshotCorruptError` (which
    :func:`run_reshard` reports collectively), whether the damage hit its bytes or the header that frames them."""
    arr = buf.numpy()
    try:
        if arr.size < 8:
            raise ValueError(f"{arr.size} bytes")
        n = int(np.frombuffer(arr[:8].tobytes(), dtype=np.int64)[0])
        if not 0 <= n <= arr.size - 8:
            raise ValueError(f"a header of {n} bytes in a message of {arr.size}")
        head = json.loads(arr[8:8 + n].tobytes())
        digest = int(head["xxh3"])
    except (ValueError, KeyError, TypeError) as e:  # JSON and Unicode decode errors are ValueErrors
        raise SnapshotCorruptError(f"rank {rank}: the reshard message received from rank {src} is unreadable "
                                   f"({e})") from e
    blob = arr[8 + n + ((-n) % 8):]
    if xxhash.xxh3_64_intdigest(blob) != digest:
        raise SnapshotCorruptError(f"rank {rank}: the reshard data received from rank {src} fails its checksum")
    if head.get("refused"):
        raise SnapshotCorruptError(f"rank {rank}: rank {src} could not send its part of the reshard: "
                                   f"{head['refused']}")
    return head, blob


def run_reshard(*, root: Path, job_id: str, generation: int, rank: int, new_layout: RankLayout,
                transport: NeighborTransport, versions: int, verify: bool,
                failed_iterations: frozenset[int] = frozenset(),
                on_phase: Callable[[str], None] = no_progress) -> tuple[RecoveryReport, Restored | None]:
    """Collective over ``transport.group`` (every rank): reshard the snapshots of store ``generation`` into
    ``new_layout`` (see the module docstring for the order of the collectives; the shards move through
    ``transport``). Returns the report and, when every old rank's state was found and moved, this rank's
    :class:`~neighbor_ckpt.recovery.flow.Restored` (tensors by name, the extras of its extras owner with the scalars
    of its params merged in)."""
    group = transport.group
    rep = RecoveryReport()
    on_phase("inventory")
    t0 = time.perf_counter()
    local = scan_copies(root, job_id, generation, holder=rank)
    rep.phases["inventory"] = time.perf_counter() - t0

    on_phase("exchange")
    t0 = time.perf_counter()
    mine = {"copies": [list(c.key) for c in local.copies],
            "layouts": {str(o): lay.to_json() for o, lay in local.layouts.items()},
            "new": new_layout.to_json()}
    rows = [json.loads(b) for b in all_gather_bytes(json.dumps(mine, separators=(",", ":")).encode(), group)]
    rep.phases["exchange"] = time.perf_counter() - t0
    copies = [Copy(int(o), int(i), int(h), str(r)) for row in rows for o, i, h, r in row["copies"]]
    old: dict[int, RankLayout] = {}
    for row in rows:
        for o, lay in row["layouts"].items():
            old.setdefault(int(o), RankLayout.from_json(lay))
    new = {int(row["new"]["rank"]): RankLayout.from_json(row["new"]) for row in rows}
    if not copies:
        rep.reason = f"no snapshot of store generation {generation} on any rank"
        return rep, None
    rep.newest = max(c.iteration for c in copies)
    worlds = {lay.world_size for lay in old.values()}
    if len(worlds) != 1:
        raise SnapshotMismatchError(f"rank {rank}: the snapshots of store generation {generation} were taken with "
                                    f"world sizes {sorted(worlds)}; refusing to reshard them")
    old_world = worlds.pop()
    rep.data_parallel_before = next(iter(old.values())).dp_size
    rep.data_parallel_after = new_layout.dp_size

    exclude: set[tuple[int, int, int, str]] = set()
    verify_s = 0.0
    for _ in range(max_rounds(versions, copies_per_version=COPIES_PER_VERSION_RESHARD)):
        choice = choose_version(copies, old_world=old_world, exclude=exclude, failed_iterations=failed_iterations)
        if choice.iteration is None:
            rep.outcome, rep.reason = "insurance", choice.reason
            return rep, None
        on_phase("verify")
        t1 = time.perf_counter()
        opened, failed = _serve(choice, local, rank=rank, verify=verify)
        verify_s += time.perf_counter() - t1
        verdicts = [json.loads(b) for b in all_gather_bytes(json.dumps(failed).encode(), group)]
        bad = {tuple(k) for v in verdicts for k in v}
        if not bad:
            break
        opened.close()
        exclude |= bad  # type: ignore[arg-type]
    else:
        rep.outcome, rep.reason = "insurance", "copies of the previous layout kept failing verification"
        return rep, None
    rep.phases["verify"] = verify_s

    problem = ""
    try:
        plan = plan_reshard({o: old[o] for o in range(old_world)}, new, choice)
        on_phase("transfer")
        t1 = time.perf_counter()
        try:
            restored: Restored | None = _move(plan, opened, rank=rank, new_layout=new_layout, transport=transport)
        except (SnapshotCorruptError, SnapshotMismatchError) as e:  # raised after the exchange: every peer got past it
            restored, problem = None, str(e)
            logger.error("rank %d: %s", rank, problem)
        rep.phases["transfer"] = time.perf_counter() - t1
    finally:
        opened.close()
    problems = [json.loads(b) for b in all_gather_bytes(json.dumps(problem).encode(), group)]
    failed_ranks = [r for r, p in enumerate(problems) if p]
    if failed_ranks:
        rep.outcome = "insurance"
        rep.reason = (f"the resharded state did not arrive intact on rank(s) {failed_ranks} "
                      f"({problems[failed_ranks[0]]})")
        return rep, None
    it = plan.iteration
    rep.outcome, rep.iteration, rep.source = "restored", it, "reshard"
    rep.pulled_bytes = plan.moved_bytes(rank)
    rep.reason = (f"resharded iteration {it} from data-parallel size {plan.dp_before} ({old_world} ranks) to "
                  f"{plan.dp_after} ({len(new)} ranks)")
    rep.notes = [f"small state (RNG streams, counters, user state) from old rank {plan.extras_from(rank)}"]
    return rep, restored


def _move(plan: ReshardPlan, opened: _Open, *, rank: int, new_layout: RankLayout,
          transport: NeighborTransport) -> Restored:
    """Execute ``plan`` for this rank: pack what others need, exchange them through ``transport`` (one message per
    peer, sent and received in one round: no order of peers can deadlock), assemble this rank's tensors."""
    outgoing = plan.outgoing(rank)
    extras_dsts = {dst for dst, owner in plan.extras_owner if plan.holder_of(owner) == rank}
    messages: dict[int, tuple[dict[str, Any], np.ndarray]] = {}
    dsts = sorted(set(outgoing) | extras_dsts)
    refused: SnapshotCorruptError | SnapshotMismatchError | None = None
    try:
        for dst in dsts:
            messages[dst] = _pack(outgoing.get(dst, []), opened,
                                  plan.extras_from(dst) if dst in extras_dsts else None)
    except (SnapshotCorruptError, SnapshotMismatchError) as e:
        # The peers are about to wait for these messages: each gets a refusal instead, so every rank leaves the
        # exchange and the failure is reported collectively (run_reshard's problem gather), none hangs.
        refused = e
        messages = {dst: _refusal(f"rank {rank}: {e}") for dst in dsts}
    incoming = plan.incoming(rank)
    eo = plan.extras_from(rank)
    senders = sorted((set(incoming) | {plan.holder_of(eo)}) - {rank})
    limits = {s: sum(p.nbytes for p in incoming.get(s, [])) + MESSAGE_HEAD_ALLOWANCE for s in senders}
    received = transport.exchange({d: _encode_message(*m) for d, m in messages.items() if d != rank}, senders,
                                  limits=limits)
    if refused is not None:
        raise refused
    parts = {s: _decode_message(buf, s, rank) for s, buf in received.items()}
    if rank in messages:
        parts[rank] = messages[rank]

    tensors = {t.name: torch.empty(t.shape, dtype=codec.dtype_named(t.dtype)) for t in new_layout.tensors}
    scalars: dict[str, Any] = {}
    extras: Any = None
    for src in sorted(parts):
        head, blob = parts[src]
        offset = 0
        for p in incoming.get(src, []):
            n = p.nbytes
            dst = tensors[p.tensor].reshape(-1).view(torch.uint8)
            item = n // p.count if p.count else 1
            dst[p.dst_offset * item:p.dst_offset * item + n] = torch.from_numpy(blob[offset:offset + n].copy())
            offset += n
        if offset != head["pieces_nbytes"]:
            raise SnapshotCorruptError(f"rank {rank}: rank {src} sent {head['pieces_nbytes']} bytes of shards, the "
                                       f"plan says {offset}")
        for name, vals in codec.decode(head["scalars"], []).items():
            scalars.setdefault(name, vals)
        if head.get("extras") is not None and head["extras"]["owner"] == eo:
            e = head["extras"]
            region = blob[offset:offset + e["nbytes"]]
            text = region[:e["json_nbytes"]].tobytes().decode()
            start = -(-e["json_nbytes"] // 64) * 64
            extras = codec.decode(text, codec.bytes_to_tensors(e["tensors"], memoryview(region[start:])))
    if extras is None:
        raise SnapshotCorruptError(f"rank {rank}: the small state of old rank {eo} did not arrive")
    adapter = extras.get("adapter")
    if isinstance(adapter, dict) and "scalars" in adapter:
        adapter["scalars"] = scalars
    return Restored(plan.iteration, tensors, extras)
