"""Streaming committed snapshots to the DP-ring successor.

:class:`NeighborTransport` is the small interface; :class:`GlooRingTransport` implements it over a
dedicated gloo process group with one background receiver thread. Call order::

    start()                  # all ranks; spawns the receiver thread
    send(slot, header)       # engine worker thread, after each local commit; True when acknowledged
    close()                  # all ranks; tells the successor to stop, joins the receiver

A dead or silent neighbor never raises into training: :meth:`send` returns False, the replica is marked
stale and streaming stops for the rest of the run (the next restart re-forms the ring).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import xxhash

from neighbor_ckpt.runtime import failpoints
from neighbor_ckpt.snapshot.store import ROLE_REPLICA, HostStore, SegmentChecksums, SlotFile, SlotHeader
from neighbor_ckpt.snapshot.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["NeighborTransport", "GlooRingTransport", "TrafficGate", "send_image", "recv_image", "pull_image", "Pulled"]

TAG_META = 7101
TAG_DATA = 7102
TAG_ACK = 7103
META_LEN = 16
MSG_IMAGE = 1
MSG_CLOSE = 2


class TrafficGate:
    """STATE traffic yields to TRAIN traffic: chunks are only sent while no training collective is marked
    in flight. ``megatron_patches`` marks gradient reduce-scatter / param all-gather; a plain loop may call
    :meth:`train_begin` / :meth:`train_end` itself. Unmarked, the gate is always open."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()
        self._depth = 0
        self._lock = threading.Lock()

    def train_begin(self) -> None:
        with self._lock:
            self._depth += 1
            self._idle.clear()

    def train_end(self) -> None:
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0:
                self._idle.set()

    def wait_idle(self, timeout: float) -> None:
        self._idle.wait(timeout)


class NeighborTransport(ABC):
    """Moves committed slot images to the ring successor (see module docstring for the call order)."""

    @abstractmethod
    def start(self) -> None:
        """Start receiving the predecessor's images into this rank's replica slots."""

    @abstractmethod
    def send(self, slot: SlotFile, header: SlotHeader) -> bool:
        """Send a committed image; True once the successor has committed its replica."""

    @abstractmethod
    def close(self) -> None:
        """Stop streaming (collective in spirit: every rank calls it at the end of training)."""

    @property
    @abstractmethod
    def healthy(self) -> bool:
        """False once the neighbor failed; replicas are stale from then on."""


def _meta(kind: int, header: SlotHeader | None, slot: SlotFile | None) -> torch.Tensor:
    m = torch.zeros(META_LEN, dtype=torch.int64)
    m[0] = kind
    if header is not None and slot is not None:
        m[1] = header.iteration
        m[2], m[3], m[4] = slot.capacities
        segs = slot.image_segments(header)
        m[5] = len(segs)
        for i, (o, n) in enumerate(segs):
            m[6 + 2 * i], m[7 + 2 * i] = o, n
    return m


def send_image(slot: SlotFile, header: SlotHeader, dst: int, group: dist.ProcessGroup, *, chunk: int,
               gate: TrafficGate | None = None, rate_bps: float = 0.0) -> None:
    """Send a committed slot image to ``dst`` (global rank). Blocking."""
    dist.send(_meta(MSG_IMAGE, header, slot), dst=dst, group=group, tag=TAG_META)
    t0, sent = time.perf_counter(), 0
    for off, n in slot.image_segments(header):
        view = slot.segment(off, n)
        for s in range(0, n, chunk):
            if gate is not None:
                gate.wait_idle(1.0)
            part = view[s:s + chunk]
            dist.send(part, dst=dst, group=group, tag=TAG_DATA)
            if not sent:
                failpoints.failpoint("snapshot.stream")
            sent += part.numel()
            if rate_bps > 0:
                ahead = sent / rate_bps - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)


def recv_image(store: HostStore, role: str, src: int, group: dist.ProcessGroup, *, chunk: int,
               meta: torch.Tensor | None = None, index: int | None = None) -> tuple[int, int] | None:
    """Receive an image from ``src`` into a slot of ``role``; returns (slot index, iteration), or None on CLOSE.

    The slot is invalidated before the first byte lands and the marker segment arrives last.
    """
    got = pull_image(store, role, src, group, chunk=chunk, meta=meta, index=index, hash_while_receiving=False)
    return None if got is None else (got.index, got.iteration)


@dataclass(frozen=True)
class Pulled:
    """What :func:`pull_image` received."""

    index: int
    """Slot of the role that now holds the image."""
    iteration: int
    """The iteration the sender announced (the header, read after the marker landed, is what counts)."""
    checksums: SegmentChecksums | None
    """xxh3-64 of the payload and extras segments, computed as their chunks arrived (None: not asked for)."""


def pull_image(store: HostStore, role: str, src: int, group: dist.ProcessGroup, *, chunk: int,
               meta: torch.Tensor | None = None, index: int | None = None,
               hash_while_receiving: bool = True) -> Pulled | None:
    """:func:`recv_image` for a restore: receives chunk ``k + 1`` while hashing chunk ``k`` (the hash runs on this
    thread, the receive in gloo's), so verifying the pulled copy (:meth:`SlotFile.verify` with the returned
    ``checksums``) costs no second pass over it. None on CLOSE.

    The checksums cover the bytes as they lie in the slot once received, which are the bytes a restore loads
    (nothing else writes a slot being received)."""
    if meta is None:
        meta = torch.zeros(META_LEN, dtype=torch.int64)
        dist.recv(meta, src=src, group=group, tag=TAG_META)
    if int(meta[0]) == MSG_CLOSE:
        return None
    iteration = int(meta[1])
    hcap, pcap, ecap, nseg = (int(x) for x in meta[2:6])
    idx = store.slot_for_write(role) if index is None else index
    slot = store.ensure(role, idx, header_cap=hcap, payload_cap=pcap, extras_cap=ecap)
    slot.invalidate()
    hashers: dict[int, tuple[int, xxhash.xxh3_64]] = {}  # segment offset -> (length, running hash)
    pending: tuple[dist.Work, torch.Tensor, xxhash.xxh3_64 | None] | None = None
    for i in range(nseg):
        off, n = int(meta[6 + 2 * i]), int(meta[7 + 2 * i])
        h = None
        if hash_while_receiving and off in (slot.payload_off, slot.extras_off):
            h = xxhash.xxh3_64()
            hashers[off] = (n, h)
        view = slot.segment(off, n)
        for s in range(0, n, chunk):
            piece = view[s:s + chunk]
            work = dist.irecv(piece, src=src, group=group, tag=TAG_DATA)
            if pending is not None:
                _land(pending)
            pending = (work, piece, h)
    if pending is not None:
        _land(pending)
    sums = None
    if hash_while_receiving:
        sums = SegmentChecksums({off: (n, h.intdigest()) for off, (n, h) in hashers.items()})
    return Pulled(idx, iteration, sums)


def _land(pending: tuple[dist.Work, torch.Tensor, xxhash.xxh3_64 | None]) -> None:
    """Wait for a chunk (chunks of one source and tag land in the order they were posted) and hash it."""
    work, piece, h = pending
    work.wait()
    if h is not None:
        h.update(piece.numpy())


class GlooRingTransport(NeighborTransport):
    """Ring streaming over a dedicated gloo group.

    Args:
        topology: this rank's topology (successor / predecessor).
        store: host store whose replica slots receive the predecessor's images.
        group: a gloo group over all ranks, used only for snapshot traffic.
        chunk_bytes: bytes per send.
        gate: optional :class:`TrafficGate`.
        rate_limit_bps: 0 for unlimited.
        on_replica: called with (iteration) after each replica commit (metrics).
    """

    def __init__(self, topology: Topology, store: HostStore, group: dist.ProcessGroup, *, chunk_bytes: int,
                 gate: TrafficGate | None = None, rate_limit_bps: float = 0.0,
                 on_replica: Callable[[int], None] | None = None) -> None:
        if topology.dp_size < 2:
            raise ValueError("a ring transport needs a DP group of at least two ranks")
        self.topology = topology
        self.store = store
        self.group = group
        self.chunk = max(1, int(chunk_bytes))
        self.gate = gate
        self.rate = rate_limit_bps
        self.on_replica = on_replica
        self._healthy = True
        self._thread: threading.Thread | None = None
        self.replica_iteration: int | None = None
        self.bytes_sent = 0
        self.send_seconds = 0.0

    @property
    def healthy(self) -> bool:
        return self._healthy

    def _mark_stale(self, what: str, err: BaseException) -> None:
        if self._healthy:
            logger.warning("rank %d: neighbor streaming stopped (%s: %s); replicas are stale until the next "
                           "restart, training continues", self.topology.rank, what, err)
        self._healthy = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._receive_loop, name="neighbor_ckpt-recv", daemon=True)
        self._thread.start()

    def _receive_loop(self) -> None:
        pred = self.topology.predecessor
        try:
            while True:
                got = recv_image(self.store, ROLE_REPLICA, pred, self.group, chunk=self.chunk)
                if got is None:
                    return
                _, iteration = got
                self.replica_iteration = iteration
                dist.send(torch.tensor([iteration], dtype=torch.int64), dst=pred, group=self.group, tag=TAG_ACK)
                if self.on_replica is not None:
                    self.on_replica(iteration)
        except Exception as e:  # noqa: BLE001 - a dead predecessor must not take training down
            self._mark_stale(f"receiving from rank {pred}", e)

    def send(self, slot: SlotFile, header: SlotHeader) -> bool:
        if not self._healthy:
            return False
        succ = self.topology.successor
        t0 = time.perf_counter()
        try:
            send_image(slot, header, succ, self.group, chunk=self.chunk, gate=self.gate, rate_bps=self.rate)
            ack = torch.zeros(1, dtype=torch.int64)
            dist.recv(ack, src=succ, group=self.group, tag=TAG_ACK)
        except Exception as e:  # noqa: BLE001
            self._mark_stale(f"sending to rank {succ}", e)
            return False
        self.send_seconds += time.perf_counter() - t0
        self.bytes_sent += sum(n for _, n in slot.image_segments(header))
        if int(ack[0]) != header.iteration:
            self._mark_stale(f"rank {succ} acknowledged iteration {int(ack[0])} for {header.iteration}",
                             RuntimeError("out-of-order acknowledgement"))
            return False
        return True

    def close(self, timeout: float = 30.0) -> None:
        if self._healthy:
            try:
                dist.send(_meta(MSG_CLOSE, None, None), dst=self.topology.successor, group=self.group, tag=TAG_META)
            except Exception as e:  # noqa: BLE001
                self._mark_stale("closing", e)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("rank %d: receiver thread did not stop within %.0fs (predecessor gone?)",
                               self.topology.rank, timeout)
