"""Elastic resharding, the pure part: which bytes of the old data-parallel layout's snapshots each rank of the new
layout needs, and from whom (ReCoVer's "continue on fewer ranks", from memory).

Under megatron-core's distributed optimizer a rank's unique state is, per parameter, a contiguous slice of the
parameter's flattened fp32 main copy and of each Adam moment: its *shard span* ``[start, end)`` of ``numel`` elements.
Another data-parallel size cuts the same parameters at other places. Every old rank's slices survive a single loss
(its own slots, or the replica on its ring successor), so together the survivors hold every element; this module
decides, per new rank and tensor, which old snapshot holds each element range and which surviving process reads it
and sends it. Tensors without a span (module buffers that change during training, which every rank stages whole)
come from one old rank, the new rank's *extras owner*: the old rank with the same model-parallel coordinate and data-
parallel index (modulo the old size), which also gives the new rank its small state (RNG streams, loop counters, the
user's state).

Everything here is a function of gathered data (identical on every rank), tested by building every rank's plan in one
process: :func:`choose_version` (the newest iteration every old rank can serve), :func:`plan_reshard` (the moves).
The collective part (inventory exchange, verification, the point-to-point moves) is
:mod:`neighbor_ckpt.recovery.elastic`.

May import: :mod:`neighbor_ckpt.errors`.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from neighbor_ckpt.errors import ConfigError, SnapshotMismatchError

__all__ = ["ShardSpan", "TensorEntry", "RankLayout", "Copy", "Piece", "ReshardPlan", "VersionChoice", "choose_version",
           "plan_reshard", "ElasticPolicy", "DTYPE_BYTES", "micro_batches_per_rank"]

DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1}
"""Element size of the dtypes a snapshot tensor can have (names as ``str(torch.dtype)`` without ``torch.``)."""


@dataclass(frozen=True)
class ShardSpan:
    """The elements ``[start, end)`` of a flattened tensor of ``numel`` elements that a sharded tensor holds."""

    numel: int
    start: int
    end: int

    def to_json(self) -> list[int]:
        return [self.numel, self.start, self.end]

    @classmethod
    def from_json(cls, v: Sequence[int]) -> ShardSpan:
        numel, start, end = (int(x) for x in v)
        if not 0 <= start <= end <= numel:
            raise ValueError(f"shard span [{start}, {end}) is not inside a tensor of {numel} elements")
        return cls(numel, start, end)


@dataclass(frozen=True)
class TensorEntry:
    """One unique tensor of a rank's snapshot: its name (the same in every layout), dtype, shape and, for a tensor
    sharded over data parallelism, its span."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    span: ShardSpan | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        try:
            return DTYPE_BYTES[self.dtype]
        except KeyError:
            raise SnapshotMismatchError(f"tensor {self.name!r} has dtype {self.dtype!r}, which resharding does not "
                                        f"know") from None


@dataclass(frozen=True)
class RankLayout:
    """One rank's unique tensors in one data-parallel layout, and its place in that layout."""

    rank: int
    world_size: int
    coord: tuple[int, ...]
    """Model-parallel coordinate (tp, pp, cp): the same for every member of a data-parallel group."""
    dp_index: int
    dp_size: int
    model: str
    """Identity of the model this rank holds a part of, independent of the data-parallel size (parameter names,
    shapes and dtypes, the optimizer family): a reshard between two models is refused."""
    tensors: tuple[TensorEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "coord": list(self.coord),
                "dp_index": self.dp_index, "dp_size": self.dp_size, "model": self.model,
                "tensors": [[t.name, t.dtype, list(t.shape), None if t.span is None else t.span.to_json()]
                            for t in self.tensors]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankLayout:
        return cls(rank=int(d["rank"]), world_size=int(d["world_size"]), coord=tuple(int(c) for c in d["coord"]),
                   dp_index=int(d["dp_index"]), dp_size=int(d["dp_size"]), model=str(d["model"]),
                   tensors=tuple(TensorEntry(str(n), str(dt), tuple(int(x) for x in shape),
                                             None if span is None else ShardSpan.from_json(span))
                                 for n, dt, shape, span in d["tensors"]))


@dataclass(frozen=True)
class Copy:
    """A committed snapshot of old rank ``owner`` at ``iteration`` that process ``holder`` (a rank of the new layout)
    can read: the owner's own slot (``role`` own) or the replica its ring successor kept (``replica``)."""

    owner: int
    iteration: int
    holder: int
    role: str

    @property
    def key(self) -> tuple[int, int, int, str]:
        return (self.owner, self.iteration, self.holder, self.role)


@dataclass(frozen=True)
class VersionChoice:
    """What :func:`choose_version` decided: the iteration and the copy of every old rank that serves it (None: no
    iteration is complete; ``reason`` says why)."""

    iteration: int | None
    sources: tuple[Copy, ...] = ()
    reason: str = ""

    def source_of(self, owner: int) -> Copy:
        for c in self.sources:
            if c.owner == owner:
                return c
        raise KeyError(owner)


def choose_version(copies: Iterable[Copy], *, old_world: int, exclude: Iterable[tuple[int, int, int, str]] = (),
                   failed_iterations: Iterable[int] = ()) -> VersionChoice:
    """The newest iteration of which every old rank ``0..old_world-1`` has a usable copy, and the copy of each.

    Preference among the copies of one old rank: its own slot over a replica, then the lowest holder (deterministic:
    every rank computes the same choice). ``exclude``: copies that failed verification (:attr:`Copy.key`);
    ``failed_iterations``: iterations a previous attempt restored and died with."""
    excluded = set(exclude)
    failed = set(failed_iterations)
    by_version: dict[int, dict[int, list[Copy]]] = defaultdict(lambda: defaultdict(list))
    for c in copies:
        if c.key not in excluded and c.iteration not in failed and 0 <= c.owner < old_world:
            by_version[c.iteration][c.owner].append(c)
    if not by_version:
        return VersionChoice(None, reason="no usable snapshot of the previous layout on any surviving rank")
    missing_newest: list[int] = []
    for it in sorted(by_version, reverse=True):
        owners = by_version[it]
        missing = [o for o in range(old_world) if not owners.get(o)]
        if not missing:
            chosen = tuple(min(owners[o], key=lambda c: (c.role != "own", c.holder)) for o in range(old_world))
            return VersionChoice(it, chosen, reason=f"iteration {it} is held for all {old_world} ranks of the "
                                                     f"previous layout")
        if not missing_newest:
            missing_newest = missing
    newest = max(by_version)
    return VersionChoice(None, reason=f"no iteration is held for every rank of the previous layout (of the newest, "
                                      f"{newest}, no surviving rank holds old rank(s) {missing_newest}: a rank and "
                                      f"its ring successor were both lost)")


@dataclass(frozen=True)
class Piece:
    """``count`` elements of tensor ``tensor``: from element ``src_offset`` of old rank ``owner``'s copy (read by
    process ``src``) to element ``dst_offset`` of the new rank ``dst``'s tensor."""

    owner: int
    src: int
    dst: int
    tensor: str
    dtype: str
    src_offset: int
    dst_offset: int
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class ReshardPlan:
    """Every move of a reshard (:func:`plan_reshard`), identical on every rank."""

    iteration: int
    dp_before: int
    dp_after: int
    sources: tuple[Copy, ...]
    """The copy of every old rank that is read."""
    pieces: tuple[Piece, ...]
    extras_owner: tuple[tuple[int, int], ...]
    """``(new rank, old rank)``: whose small state (RNG, counters, user state, optimizer hyper-parameters) each new
    rank takes; the same old rank gives its unsharded tensors."""

    def extras_from(self, rank: int) -> int:
        for r, owner in self.extras_owner:
            if r == rank:
                return owner
        raise KeyError(rank)

    def holder_of(self, owner: int) -> int:
        for c in self.sources:
            if c.owner == owner:
                return c.holder
        raise KeyError(owner)

    def incoming(self, rank: int) -> dict[int, list[Piece]]:
        """Pieces ``rank`` receives, by sending process, in plan order (the order they travel in)."""
        out: dict[int, list[Piece]] = defaultdict(list)
        for p in self.pieces:
            if p.dst == rank:
                out[p.src].append(p)
        return dict(out)

    def outgoing(self, rank: int) -> dict[int, list[Piece]]:
        """Pieces ``rank`` reads and sends, by receiving process, in plan order."""
        out: dict[int, list[Piece]] = defaultdict(list)
        for p in self.pieces:
            if p.src == rank:
                out[p.dst].append(p)
        return dict(out)

    def moved_bytes(self, rank: int) -> int:
        """Bytes ``rank`` receives from other processes."""
        return sum(p.nbytes for p in self.pieces if p.dst == rank and p.src != rank)


def plan_reshard(old: Mapping[int, RankLayout], new: Mapping[int, RankLayout], choice: VersionChoice) -> ReshardPlan:
    """Pure: the pieces that give every new rank its unique tensors, cut from the old ranks' copies in ``choice``.

    Raises:
        SnapshotMismatchError: the layouts hold another model (names, shapes, dtypes), a new model-parallel coordinate
            that no old rank had, or spans that do not cover a new rank's span: nothing can be resharded.
    """
    if choice.iteration is None:
        raise ValueError("plan_reshard needs a chosen iteration")
    by_coord: dict[tuple[int, ...], list[RankLayout]] = defaultdict(list)
    for lay in old.values():
        by_coord[lay.coord].append(lay)
    # Per (coord, tensor): the old spans, sorted by start, for the sweep below.
    spans: dict[tuple[tuple[int, ...], str], list[tuple[int, int, int, TensorEntry]]] = defaultdict(list)
    whole: dict[tuple[int, str], TensorEntry] = {}
    for lay in old.values():
        for t in lay.tensors:
            if t.span is None:
                whole[(lay.rank, t.name)] = t
            else:
                spans[(lay.coord, t.name)].append((t.span.start, t.span.end, lay.rank, t))
    for v in spans.values():
        v.sort()
    holder = {c.owner: c.holder for c in choice.sources}
    dp_before = {lay.dp_size for lay in old.values()}
    dp_after = {lay.dp_size for lay in new.values()}
    if len(dp_before) != 1 or len(dp_after) != 1:
        raise SnapshotMismatchError(f"data-parallel sizes differ between model-parallel groups (before: "
                                    f"{sorted(dp_before)}, after: {sorted(dp_after)})")
    pieces: list[Piece] = []
    extras_owner: list[tuple[int, int]] = []
    for rank in sorted(new):
        lay = new[rank]
        group = by_coord.get(lay.coord)
        if not group:
            raise SnapshotMismatchError(f"rank {rank} has model-parallel coordinate {list(lay.coord)}, which no rank "
                                        f"of the previous layout had (coordinates: {sorted(map(list, by_coord))}): "
                                        f"only the data-parallel size may change")
        models = {g.model for g in group}
        if models != {lay.model}:
            raise SnapshotMismatchError(f"rank {rank}: the snapshots of the previous layout hold another model "
                                        f"({sorted(models)} vs {lay.model}): another model, optimizer or model-parallel "
                                        f"configuration cannot be resharded")
        old_dp = group[0].dp_size
        eo = next(g.rank for g in group if g.dp_index == lay.dp_index % old_dp)
        extras_owner.append((rank, eo))
        for t in lay.tensors:
            if t.span is None:
                src = whole.get((eo, t.name))
                if src is None or src.dtype != t.dtype or src.shape != t.shape:
                    raise SnapshotMismatchError(
                        f"rank {rank}: {t.name!r} ({t.dtype}{list(t.shape)}) is not in old rank {eo}'s snapshot as "
                        f"the same whole tensor ({'absent' if src is None else f'{src.dtype}{list(src.shape)}'})")
                pieces.append(Piece(eo, holder[eo], rank, t.name, t.dtype, 0, 0, t.numel))
                continue
            cand = spans.get((lay.coord, t.name), [])
            starts = [c[0] for c in cand]
            cursor, end = t.span.start, t.span.end
            while cursor < end:
                i = bisect.bisect_right(starts, cursor) - 1
                if i < 0 or not cand[i][0] <= cursor < cand[i][1]:
                    raise SnapshotMismatchError(
                        f"rank {rank}: elements [{cursor}, ...) of {t.name!r} are in no old rank's shard (spans "
                        f"{[(s, e) for s, e, _, _ in cand]}): the layouts do not shard the same tensor")
                s, e, owner, ot = cand[i]
                if ot.span is None or ot.span.numel != t.span.numel or ot.dtype != t.dtype:
                    raise SnapshotMismatchError(f"rank {rank}: {t.name!r} is a tensor of {t.span.numel} {t.dtype} "
                                                f"elements here and of another size or dtype in old rank {owner}")
                n = min(e, end) - cursor
                pieces.append(Piece(owner, holder[owner], rank, t.name, t.dtype, cursor - s, cursor - t.span.start, n))
                cursor += n
    return ReshardPlan(iteration=choice.iteration, dp_before=dp_before.pop(), dp_after=dp_after.pop(),
                       sources=choice.sources, pieces=tuple(pieces), extras_owner=tuple(extras_owner))


@dataclass(frozen=True)
class ElasticPolicy:
    """Which world size a job may continue with after losing ranks for good (``neighbor_ckpt.elastic``): a multiple of
    the model-parallel size (TP x PP x CP) whose data-parallel size is at least ``min_data_parallel`` and divides the
    global batch in micro-batches (``batch_micro_batches`` = global batch / micro-batch size), so every rank trains the
    same number of micro-batches and the global batch stays what it was (ReCoVer's invariant)."""

    model_parallel: int = 1
    min_data_parallel: int = 1
    batch_micro_batches: int | None = None
    """Global batch / micro-batch size (None: any data-parallel size keeps the global batch)."""

    def __post_init__(self) -> None:
        if self.model_parallel < 1 or self.min_data_parallel < 1:
            raise ValueError(f"ElasticPolicy: model_parallel {self.model_parallel} and min_data_parallel "
                             f"{self.min_data_parallel} must be >= 1")
        if self.batch_micro_batches is not None and self.batch_micro_batches < 1:
            raise ValueError(f"ElasticPolicy: batch_micro_batches {self.batch_micro_batches} must be >= 1")

    def data_parallel_ok(self, dp: int) -> bool:
        return dp >= self.min_data_parallel and (self.batch_micro_batches is None
                                                 or self.batch_micro_batches % dp == 0)

    def world_size(self, available: int) -> int | None:
        """The largest world size of at most ``available`` ranks the job can continue with (None: none)."""
        for dp in range(available // self.model_parallel, 0, -1):
            if self.data_parallel_ok(dp):
                return dp * self.model_parallel
        return None

    def why_not(self, available: int) -> str:
        """Why no world size of at most ``available`` ranks works (for the give-up message)."""
        return (f"{available} ranks left: no data-parallel size <= {available // self.model_parallel} (model-parallel "
                f"size {self.model_parallel}) is >= elastic.min_data_parallel {self.min_data_parallel}"
                + ("" if self.batch_micro_batches is None else
                   f" and divides the global batch's {self.batch_micro_batches} micro-batches"))


def micro_batches_per_rank(global_batch: int, micro_batch_size: int, data_parallel: int) -> int:
    """Micro-batches each data-parallel rank trains per step so that the step holds exactly ``global_batch`` samples
    (megatron-core's num-microbatches rule: ``global_batch / (micro_batch_size x data_parallel)``); what keeps an
    elastic reshard on the same trajectory (ReCoVer's constant global batch).

    Raises:
        ConfigError: a size below 1, or a data-parallel size whose ranks cannot split the global batch evenly (the
            message names the sizes and the data-parallel sizes that would)."""
    if global_batch < 1 or micro_batch_size < 1 or data_parallel < 1:
        raise ConfigError(f"global batch {global_batch}, micro-batch size {micro_batch_size} and data-parallel size "
                          f"{data_parallel} must all be >= 1")
    if global_batch % (micro_batch_size * data_parallel):
        fits = [d for d in range(1, global_batch // micro_batch_size + 1)
                if global_batch % (micro_batch_size * d) == 0]
        raise ConfigError(
            f"the global batch of {global_batch} samples cannot be kept at data-parallel size {data_parallel}: "
            f"{global_batch} is not a multiple of micro-batch size {micro_batch_size} x data-parallel size "
            f"{data_parallel} = {micro_batch_size * data_parallel}, so the ranks would train unequal numbers of "
            f"micro-batches. Start the job on a world whose data-parallel size divides it (data-parallel sizes that "
            f"do: {fits}), or change the global batch (a change of trajectory)")
    return global_batch // (micro_batch_size * data_parallel)
