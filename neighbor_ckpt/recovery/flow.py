"""The restore flow, run collectively by every rank after a (re)start.

1. inventory: every committed slot of this rank is validated (header, commit marker, job, layout); a slot that
   fails is reported and skipped, never loaded. Payload checksums are left to step 5: hashing every version of
   every role here would make every rank hash 4x its state before the exchange, and the slowest would hold up all;
2. exchange: one all-gather of every rank's versions;
3. reconcile (pure, identical everywhere): target iteration and the source of every rank's state;
4. transfer, through the transport (:class:`~neighbor_ckpt.snapshot.transport.NeighborTransport`): a rank without
   its own copy receives the replica from its successor; DP groups with lazy state receive the holder's lazy backup;
5. verify: the chosen copies (local or received) are checksummed (a received copy was hashed chunk by chunk as it
   arrived, overlapped with the transfer: no second pass); any failure is excluded and we reconcile again;
6. load: tensors are handed out as views of host memory (the adapter copies them in).

If no iteration is restorable by every rank the report says ``insurance``; what happens then (insurance, starting
over, refusing) is decided by :class:`~neighbor_ckpt.recovery.recoverer.Recoverer`, never here.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from neighbor_ckpt.errors import SnapshotCorruptError, SnapshotMismatchError
from neighbor_ckpt.recovery.reconcile import SOURCE_OWN, SOURCE_REPLICA, RankVersions, RecoveryDecision, decode_row, \
    encode_row, reconcile
from neighbor_ckpt.snapshot import codec
from neighbor_ckpt.snapshot.slot import SegmentChecksums, SlotFile, SlotHeader
from neighbor_ckpt.snapshot.store import ROLE_LAZY, ROLE_OWN, ROLE_REPLICA, HostStore
from neighbor_ckpt.snapshot.topology import Topology
from neighbor_ckpt.snapshot.transport import NeighborTransport

logger = logging.getLogger(__name__)

__all__ = ["RecoveryReport", "Restored", "Transfer", "run_recovery", "read_tensors", "all_gather_int64", "max_rounds",
           "no_progress", "COPIES_PER_VERSION_RESTORE", "COPIES_PER_VERSION_RESHARD"]

COPIES_PER_VERSION_RESTORE = 4
"""Copies the restore flow may exclude per kept iteration, seen from one rank: its own slot, its replica on the
successor, and for its DP group's redundant state a lazy backup of its own and the holder's."""
COPIES_PER_VERSION_RESHARD = 2
"""Copies an elastic reshard may exclude per kept iteration of one old rank: its own slot and its replica (a reshard
moves unique state only)."""


def max_rounds(versions: int, *, copies_per_version: int) -> int:
    """Rounds of choose -> transfer -> verify before giving up on in-memory state (the restore flow and the elastic
    reshard both loop so).

    Every round but the last excludes at least one copy that failed verification, and a choice walks through at most
    ``copies_per_version`` copies for each of the ``versions`` kept iterations: beyond that no copy is left to try.
    Two more rounds: the one that finds nothing failed, and one to spare. The callers differ in what a version has:
    :data:`COPIES_PER_VERSION_RESTORE` (own, replica, two lazy backups) gives the restore flow ``4 * versions + 2``,
    :data:`COPIES_PER_VERSION_RESHARD` (own, replica) the reshard ``2 * versions + 2``."""
    return copies_per_version * versions + 2


@dataclass
class RecoveryReport:
    """What recovery did on this rank (identical decision on every rank)."""

    outcome: str = "fresh"
    """``fresh`` (nothing to restore), ``restored`` (in-memory version), ``insurance`` (fallback)."""
    iteration: int | None = None
    source: str | None = None
    """This rank's unique state came from ``own`` slot or the ``replica`` on its successor."""
    lazy_from: int | None = None
    """Rank whose lazy backup provided the redundant state (None: not needed)."""
    pulled_bytes: int = 0
    """Bytes of this rank's unique state received from its successor (0: restored from its own slot)."""
    lazy_bytes: int = 0
    """Bytes of redundant state received from the DP group's lazy-backup holder."""
    reason: str = ""
    newest: int | None = None
    """The newest iteration any rank holds any committed snapshot of (None: none anywhere)."""
    notes: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: inventory, exchange, transfer, verify, load."""
    data_parallel_before: int | None = None
    """Data-parallel size of the snapshots restored (None: not known, no restore)."""
    data_parallel_after: int | None = None
    """Data-parallel size of this layout (differs from :attr:`data_parallel_before` after an elastic reshard)."""
    decision: RecoveryDecision | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (without the decision object), for logs and tests."""
        return {"outcome": self.outcome, "iteration": self.iteration, "source": self.source,
                "lazy_from": self.lazy_from, "pulled_bytes": self.pulled_bytes, "lazy_bytes": self.lazy_bytes,
                "reason": self.reason, "newest": self.newest, "notes": list(self.notes), "phases": dict(self.phases),
                "data_parallel_before": self.data_parallel_before, "data_parallel_after": self.data_parallel_after}

    @property
    def resharded(self) -> bool:
        """The restored state was re-partitioned from another data-parallel size (an elastic reshard)."""
        return self.source == "reshard"

    def summary(self) -> str:
        if self.outcome == "restored" and self.resharded:
            return (f"{self.reason}; received {self.pulled_bytes} bytes of shards from other ranks; "
                    + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.phases.items()))
        if self.outcome == "restored":
            how = "its own host slot" if self.source == SOURCE_OWN else "the replica on its successor"
            lazy = f", redundant state from rank {self.lazy_from}'s lazy backup" if self.lazy_from is not None else ""
            return (f"restored iteration {self.iteration} from {how}{lazy}; pulled {self.pulled_bytes} bytes of "
                    f"unique state, {self.lazy_bytes} bytes of redundant state; "
                    + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.phases.items()))
        return f"{self.outcome}: {self.reason}"


@dataclass(frozen=True)
class Transfer:
    """What :func:`_transfer` did on this rank for one reconciliation round."""

    pulled_bytes: int
    """Bytes of this rank's unique state received from its successor (0: its own slot is used)."""
    lazy_bytes: int
    """Bytes of redundant state received from the DP group's lazy-backup holder."""
    own_index: int | None
    """Own-role slot that now holds this rank's state of the target iteration (None: not found/received)."""
    lazy_index: int | None
    """Lazy-role slot that holds the DP group's redundant state (None: not needed or not received)."""
    lazy_owner: int | None
    """Rank that wrote the lazy backup used here (None: the DP group has no lazy state)."""
    notes: tuple[str, ...] = ()
    """Why a replica was pulled, and sends that failed (the receiver's verification says what that cost)."""
    received: dict[str, SegmentChecksums] = field(default_factory=dict)
    """Per role received here, the checksums computed while it arrived (verification does not hash it again)."""


@dataclass
class Restored:
    """A validated version ready to load."""

    iteration: int
    tensors: dict[str, torch.Tensor]
    extras: Any


def read_tensors(slot: SlotFile, hdr: SlotHeader) -> dict[str, torch.Tensor]:
    """Tensors of a validated slot, as views of host memory (by the header's table)."""
    return {t["name"]: slot.payload_view(t["offset"], codec.dtype_named(t["dtype"]), t["shape"])
            for t in hdr.meta.get("tensors", [])}


def _inventory(store: HostStore, topology: Topology, layout: str, rejected: dict[int, str]
               ) -> tuple[RankVersions, dict[tuple[str, int], int]]:
    """Validate every slot; returns this rank's row and (role, iteration) -> slot index. Own slots that
    failed validation are recorded in ``rejected`` (iteration -> reason)."""
    where: dict[tuple[str, int], int] = {}
    own: set[int] = set()
    replica: set[int] = set()
    lazy: set[int] = set()
    needs_lazy: bool | None = None
    mismatch = False
    for ref in store.committed(ROLE_OWN, verify=False, rejected=rejected):
        if ref.header.layout != layout:
            logger.error("rank %d: own slot %d holds iteration %d of another layout (%s, expected %s)",
                         store.rank, ref.index, ref.header.iteration, ref.header.layout, layout)
            mismatch = True
            continue
        own.add(ref.header.iteration)
        where[(ROLE_OWN, ref.header.iteration)] = ref.index
        needs_lazy = bool(ref.header.meta.get("has_lazy", False))
    # Replicas of the rank that was this rank's predecessor when they were taken: the ring may have changed since (a
    # spare took one rank of a node: a cross-node ring orders by node), so they are reported with their owner.
    by_owner: dict[int, dict[int, int]] = {}
    for ref in store.committed(ROLE_REPLICA, verify=False):
        by_owner.setdefault(ref.header.owner_rank, {})[ref.header.iteration] = ref.index
    replica_of = -1
    if by_owner:
        replica_of = topology.predecessor if topology.predecessor in by_owner else \
            max(by_owner, key=lambda o: max(by_owner[o]))
        if replica_of != topology.predecessor:
            logger.info("rank %d: holds replicas of rank %d (the ring changed since: its predecessor is now %d)",
                        store.rank, replica_of, topology.predecessor)
        for other in sorted(set(by_owner) - {replica_of}):
            logger.warning("rank %d: replica slot(s) of rank %d ignored (this rank serves rank %d's)", store.rank,
                           other, replica_of)
        for it, index in by_owner[replica_of].items():
            replica.add(it)
            where[(ROLE_REPLICA, it)] = index
    for ref in store.committed(ROLE_LAZY, verify=False):
        if ref.header.layout != layout or ref.header.meta.get("dp_group") != min(topology.dp_ranks):
            logger.warning("rank %d: lazy backup %d is of another layout or DP group; ignored", store.rank, ref.index)
            continue
        lazy.add(ref.header.iteration)
        where[(ROLE_LAZY, ref.header.iteration)] = ref.index
    row = RankVersions(rank=topology.rank, successor=topology.successor, dp_group=min(topology.dp_ranks),
                       own=frozenset(own), replica=frozenset(replica), lazy=frozenset(lazy),
                       needs_lazy=needs_lazy, layout_mismatch=mismatch, replica_of=replica_of)
    return row, where


def all_gather_int64(mine: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Collective over ``group``: every rank's int64 row, by group rank (rows are the same size everywhere).

    The only collective recovery issues itself (the transfers are point-to-point, see :func:`_transfer`); which
    rows, and in which order, is written in :func:`run_recovery` and
    :meth:`~neighbor_ckpt.recovery.recoverer.Recoverer.recover`."""
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return out


def _check(slot: SlotFile | None, store: HostStore, *, iteration: int, layout: str | None, owner: int,
           received: SegmentChecksums | None = None) -> SlotHeader:
    if slot is None:
        raise SnapshotCorruptError("slot missing")
    hdr = slot.read_header()
    if hdr.iteration != iteration or hdr.owner_rank != owner:
        raise SnapshotCorruptError(f"received iteration {hdr.iteration} of rank {hdr.owner_rank}, "
                                   f"expected {iteration} of rank {owner}")
    if hdr.job_id != store.job_id:
        raise SnapshotMismatchError(f"received a snapshot of job {hdr.job_id!r}")
    if layout is not None and hdr.layout != layout:
        raise SnapshotMismatchError(f"received a snapshot of layout {hdr.layout}, expected {layout}")
    if store.use_checksum:
        slot.verify(hdr, received)
    return hdr


def no_progress(phase: str) -> None:
    """The default ``on_phase`` of a recovery: no progress display."""


def run_recovery(*, store: HostStore, topology: Topology, transport: NeighborTransport | None = None, layout: str,
                 on_phase: Callable[[str], None] = no_progress, failed_iterations: frozenset[int] = frozenset(),
                 group: dist.ProcessGroup | None = None, chunk_bytes: int | None = None
                 ) -> tuple[RecoveryReport, Restored | None]:
    """Collective over ``transport.group`` (all ranks). Returns the report and, if restorable, the validated
    version. ``on_phase`` is told the name of each phase as it starts (progress display); ``failed_iterations`` (the
    same on every rank) are never chosen.

    The slot images move through ``transport`` (:meth:`~neighbor_ckpt.snapshot.transport.NeighborTransport.send_image`
    / :meth:`~neighbor_ckpt.snapshot.transport.NeighborTransport.pull_image`); the small all-gathers run on its
    group. ``group`` and ``chunk_bytes`` instead of a transport: the ``gloo`` transport over that group (for callers
    that hold a bare group, e.g. benchmarks).

    Collectives on the group, in this order on every rank (every branch between them depends only on gathered,
    hence identical, data, so no rank can skip one another issues):

    1. exchange: one all-gather of every rank's inventory row; nothing more if no rank holds a snapshot or the
       table has no restorable iteration;
    2. per reconciliation round (at most :func:`max_rounds` with :data:`COPIES_PER_VERSION_RESTORE`):

       a. transfer: point-to-point sends and receives of slot images between the pairs the decision names, through
          the transport (:func:`_transfer`);
       b. restore verdict: one all-gather of ``[own copy failed, lazy copy failed, lazy writer]`` per rank; no
          failure anywhere ends the flow (restored), else the failed copies are excluded and the next round
          reconciles again.
    """
    if transport is None:
        if group is None or chunk_bytes is None:
            raise TypeError("run_recovery needs a transport (or a group and chunk_bytes)")
        from neighbor_ckpt.snapshot.gloo_transport import GlooTransport

        transport = GlooTransport(topology, store, group, chunk_bytes=chunk_bytes)
    group = transport.group
    rep = RecoveryReport(data_parallel_before=topology.dp_size, data_parallel_after=topology.dp_size)
    on_phase("inventory")
    t0 = time.perf_counter()
    rejected: dict[int, str] = {}
    row, where = _inventory(store, topology, layout, rejected)
    rep.phases["inventory"] = time.perf_counter() - t0

    on_phase("exchange")
    t0 = time.perf_counter()
    table = [decode_row(t, store.versions) for t in all_gather_int64(encode_row(row, store.versions), group)]
    rep.phases["exchange"] = time.perf_counter() - t0
    bad = [r.rank for r in table if r.layout_mismatch]
    if bad:
        raise SnapshotMismatchError(
            f"rank {topology.rank}: ranks {bad} hold snapshots of this job id with another layout (a different "
            f"model, optimizer or parallel configuration); refusing to load them. Delete {store.job_dir} or set "
            f"neighbor_ckpt.job_id to a new value to start fresh.")
    if not any(r.own or r.replica or r.lazy for r in table):
        rep.reason = "no in-memory snapshot on any rank"
        return rep, None
    rep.newest = max(max(r.own | r.replica | r.lazy, default=-1) for r in table)

    exclude: frozenset[tuple[int, int, str]] = frozenset()
    transfer_s = verify_s = 0.0
    rounds = max_rounds(store.versions, copies_per_version=COPIES_PER_VERSION_RESTORE)
    notes: list[str] = []  # every round's, so the report says why an earlier choice was dropped
    for _ in range(rounds):
        decision = reconcile(table, exclude, failed_iterations)
        rep.decision = decision
        if not decision.recoverable:
            rep.outcome, rep.reason = "insurance", decision.reason
            return rep, None
        it = decision.iteration
        assert it is not None  # noqa: S101
        on_phase("transfer")
        t1 = time.perf_counter()
        moved = _transfer(store, topology, transport, table, decision, where, exclude, rejected)
        errors = list(moved.notes)
        lazy_owner = moved.lazy_owner
        transfer_s += time.perf_counter() - t1
        on_phase("verify")
        t1 = time.perf_counter()
        own_fail = lazy_fail = 0
        own_hdr = lazy_hdr = None
        own_slot = store.slot(ROLE_OWN, moved.own_index) if moved.own_index is not None else None
        try:
            own_hdr = _check(own_slot, store, iteration=it, layout=layout, owner=topology.rank,
                             received=moved.received.get(ROLE_OWN))
        except (SnapshotCorruptError, SnapshotMismatchError) as e:
            own_fail = 1
            errors.append(f"copy of iteration {it} ({decision.sources[topology.rank]}) failed verification: {e}")
        lazy_slot = None
        if lazy_owner is not None:
            lazy_slot = store.slot(ROLE_LAZY, moved.lazy_index) if moved.lazy_index is not None else None
            try:
                lazy_hdr = _check(lazy_slot, store, iteration=it, layout=layout, owner=lazy_owner,
                                  received=moved.received.get(ROLE_LAZY))
            except (SnapshotCorruptError, SnapshotMismatchError) as e:
                lazy_fail = 1
                errors.append(f"lazy backup of iteration {it} written by rank {lazy_owner} failed verification: {e}")
        verify_s += time.perf_counter() - t1
        for e in errors:
            logger.warning("rank %d: %s", topology.rank, e)
        notes.extend(e for e in errors if e not in notes)
        verdict = torch.tensor([own_fail, lazy_fail, lazy_owner if lazy_owner is not None else -1], dtype=torch.int64)
        flags = [t.tolist() for t in all_gather_int64(verdict, group)]
        failed = set(exclude)
        for r, (of, lf, h) in enumerate(flags):
            if of:
                failed.add((r, it, decision.sources[r]))
            if lf and h >= 0:
                failed.add((h, it, "lazy"))
        if failed == set(exclude):
            rep.outcome, rep.iteration = "restored", it
            rep.source, rep.lazy_from = decision.sources[topology.rank], lazy_owner
            rep.pulled_bytes, rep.lazy_bytes = moved.pulled_bytes, moved.lazy_bytes
            rep.reason, rep.notes = decision.reason, notes
            rep.phases["transfer"], rep.phases["verify"] = transfer_s, verify_s
            on_phase("load")
            t1 = time.perf_counter()
            assert own_slot is not None and own_hdr is not None  # noqa: S101
            tensors = read_tensors(own_slot, own_hdr)
            if lazy_slot is not None and lazy_hdr is not None:
                tensors.update(read_tensors(lazy_slot, lazy_hdr))
            extras = own_slot.read_extras(own_hdr)
            rep.phases["load"] = time.perf_counter() - t1
            if rep.source == SOURCE_REPLICA:
                logger.warning("rank %d: restoring iteration %d from the replica held by rank %d", topology.rank,
                               it, decision.replica_holders.get(topology.rank, topology.successor))
            return rep, Restored(it, tensors, extras)
        exclude = frozenset(failed)
    rep.outcome, rep.reason = "insurance", f"copies kept failing verification after {rounds} rounds"
    return rep, None


def _transfer(store: HostStore, topology: Topology, transport: NeighborTransport, table: list[RankVersions],
              decision: RecoveryDecision, where: dict[tuple[str, int], int],
              exclude: frozenset[tuple[int, int, str]], rejected: dict[int, str]
              ) -> Transfer:
    """Move replicas to owners that lost theirs and lazy backups to DP members without one of their own.

    Point-to-point only, between the pairs the decision names (identical on every rank, so every send has its
    receive): a rank sends its predecessor's replica if that predecessor restores from it, the lazy-backup holder
    sends to every DP member without a backup of its own; sends run on a thread while this rank receives, in the
    order of ``recvs``, so two ranks that send to each other cannot block each other."""
    it = decision.iteration
    assert it is not None  # noqa: S101
    me = topology.rank
    sends: list[tuple[SlotFile, SlotHeader, int]] = []
    recvs: list[tuple[str, int]] = []  # (role, src)
    notes: list[str] = []
    by_rank = {r.rank: r for r in table}
    # replicas: I hold one rank's replica (my predecessor's when it was taken); send it if that rank needs it.
    owner = by_rank[me].replica_of
    if owner not in (-1, me) and decision.replica_holders.get(owner) == me:
        slot = store.slot(ROLE_REPLICA, where[(ROLE_REPLICA, it)])
        assert slot is not None  # noqa: S101
        sends.append((slot, slot.read_header(), owner))
    if decision.sources[me] == SOURCE_REPLICA:
        src = decision.replica_holders[me]
        recvs.append((ROLE_OWN, src))
        if it in by_rank[me].own:
            notes.append(f"own slot of iteration {it} was rejected; using the replica on rank {src}")
        elif it in rejected:
            notes.append(f"own slot of iteration {it} failed verification ({rejected[it]}); using the replica held "
                         f"by rank {src}")
        else:
            notes.append(f"own slot of iteration {it} missing; pulling the replica from rank {src}")
    holder = decision.lazy_holders.get(min(topology.dp_ranks))
    lazy_owner: int | None = None

    def has_own_lazy(r: int) -> bool:
        return it in by_rank[r].lazy and (r, it, "lazy") not in exclude

    if holder is not None:
        if has_own_lazy(me):
            lazy_owner = me  # every survivor wrote one: reload it locally
        else:
            lazy_owner = holder
            recvs.append((ROLE_LAZY, holder))
        if holder == me:
            slot = store.slot(ROLE_LAZY, where[(ROLE_LAZY, it)])
            assert slot is not None  # noqa: S101
            hdr = slot.read_header()
            sends.extend((slot, hdr, r) for r in topology.dp_ranks if r != me and not has_own_lazy(r))

    send_errors: list[BaseException] = []

    def _send_all() -> None:
        for slot, hdr, dst in sends:
            try:
                transport.send_image(slot, hdr, dst)
            except BaseException as e:  # noqa: BLE001
                send_errors.append(e)

    th = threading.Thread(target=_send_all, name="neighbor_ckpt-recovery-send", daemon=True)
    th.start()
    pulled = {ROLE_OWN: 0, ROLE_LAZY: 0}
    received: dict[str, SegmentChecksums] = {}
    own_idx = where.get((ROLE_OWN, it)) if decision.sources[me] == SOURCE_OWN else None
    lazy_idx = where.get((ROLE_LAZY, it)) if lazy_owner == me else None
    for role, src in recvs:
        keep = {it} if role == ROLE_OWN else None
        idx = store.slot_for_write(role, keep=keep)
        got = transport.pull_image(role, src, index=idx)
        assert got.checksums is not None  # noqa: S101
        received[role] = got.checksums
        s = store.slot(role, idx)
        try:
            if s is not None:
                pulled[role] += sum(n for _, n in s.image_segments(s.read_header()))
        except (SnapshotCorruptError, SnapshotMismatchError):
            pass  # reported by the verification step
        if role == ROLE_OWN:
            own_idx = idx
        else:
            lazy_idx = idx
    th.join()
    for e in send_errors:
        notes.append(f"sending a copy failed: {e}")
    return Transfer(pulled_bytes=pulled[ROLE_OWN], lazy_bytes=pulled[ROLE_LAZY], own_index=own_idx,
                    lazy_index=lazy_idx, lazy_owner=lazy_owner, notes=tuple(notes), received=received)
