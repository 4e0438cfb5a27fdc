"""The gloo transports: snapshot bytes between ranks over gloo process groups, point-to-point, on the host.

Two kinds, one wire:

* ``gloo`` (:class:`GlooTransport`): everything over the snapshot group;
* ``gloo_split`` (:class:`GlooSplitTransport`): streaming over a gloo group of its own (its own connections), the
  recovery images and the elastic exchange over the snapshot group. A streamed chunk (``chunk_mb``, 16 MB by default)
  then never sits on a connection ahead of the small collectives the training thread runs on the snapshot group while
  streaming goes on in the background (the store-generation release, the failure verdicts, the closing barrier).
  The cost: one more gloo group (a collective when it is made, one more connection per pair of ranks).

:class:`GlooTransport` implements :class:`~neighbor_ckpt.snapshot.transport.NeighborTransport` (the call order is in
its docstring). Each purpose has its own pair of tags, so a purpose never takes another's message:

* streaming (``TAG_META`` / ``TAG_DATA`` / ``TAG_ACK``): one background receiver thread per rank takes the
  predecessor's images into its replica slots and acknowledges each once its commit marker landed;
* recovery images (``TAG_PULL_META`` / ``TAG_PULL_DATA``): :meth:`GlooTransport.send_image` /
  :meth:`GlooTransport.pull_image`, the receiver hashing chunk ``k`` while chunk ``k + 1`` arrives;
* the elastic exchange (``TAG_SIZES`` / ``TAG_MSG``): sizes first, then the messages, every receive and send posted
  before any wait, so no order of peers can deadlock.

An image on the wire: one int64 header message (``META_LEN`` numbers: kind, iteration, the slot's three capacities,
the segment count and each segment's offset and length), then the segments in :meth:`SlotFile.image_segments` order
(the commit marker's segment last), cut into ``chunk_bytes`` pieces. The receiver invalidates its slot before the first
byte lands, so a torn transfer leaves no committed slot.

:func:`send_image`, :func:`recv_image` and :func:`pull_image` are the same wire functions for callers holding a bare
group (benchmarks, older tests); the library itself calls the transport's methods.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import xxhash

from neighbor_ckpt.errors import TopologyError, TransportError
from neighbor_ckpt.runtime import failpoints
from neighbor_ckpt.snapshot.slot import SegmentChecksums, SlotFile, SlotHeader
from neighbor_ckpt.snapshot.store import ROLE_REPLICA, HostStore
from neighbor_ckpt.snapshot.topology import Topology
from neighbor_ckpt.snapshot.transport import NeighborTransport, Pulled, TrafficGate

if TYPE_CHECKING:
    from neighbor_ckpt.config import TransportConfig

logger = logging.getLogger(__name__)

__all__ = ["GlooTransport", "GlooSplitTransport", "GlooRingTransport", "send_image", "recv_image", "pull_image",
           "META_LEN", "make_gloo_transport", "make_gloo_split_transport"]

TAG_META = 7101
TAG_DATA = 7102
TAG_ACK = 7103
TAG_PULL_META = 7111
TAG_PULL_DATA = 7112
TAG_SIZES = 7201
TAG_MSG = 7202
META_LEN = 16
MSG_IMAGE = 1
MSG_CLOSE = 2


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
               gate: TrafficGate | None = None, rate_bps: float = 0.0, tags: tuple[int, int] = (TAG_META, TAG_DATA)
               ) -> None:
    """Send a committed slot image to ``dst`` (global rank). Blocking. ``tags``: (header, data) tags."""
    dist.send(_meta(MSG_IMAGE, header, slot), dst=dst, group=group, tag=tags[0])
    t0, sent = time.perf_counter(), 0
    for off, n in slot.image_segments(header):
        view = slot.segment(off, n)
        for s in range(0, n, chunk):
            if gate is not None:
                gate.wait_idle(1.0)
            part = view[s:s + chunk]
            dist.send(part, dst=dst, group=group, tag=tags[1])
            if not sent:
                failpoints.failpoint("snapshot.stream")
            sent += part.numel()
            if rate_bps > 0:
                ahead = sent / rate_bps - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)


def recv_image(store: HostStore, role: str, src: int, group: dist.ProcessGroup, *, chunk: int,
               meta: torch.Tensor | None = None, index: int | None = None,
               tags: tuple[int, int] = (TAG_META, TAG_DATA)) -> tuple[int, int] | None:
    """Receive an image from ``src`` into a slot of ``role``; returns (slot index, iteration), or None on CLOSE.

    The slot is invalidated before the first byte lands and the marker segment arrives last.
    """
    got = pull_image(store, role, src, group, chunk=chunk, meta=meta, index=index, hash_while_receiving=False,
                     tags=tags)
    return None if got is None else (got.index, got.iteration)


def pull_image(store: HostStore, role: str, src: int, group: dist.ProcessGroup, *, chunk: int,
               meta: torch.Tensor | None = None, index: int | None = None,
               hash_while_receiving: bool = True, tags: tuple[int, int] = (TAG_META, TAG_DATA)) -> Pulled | None:
    """:func:`recv_image` for a restore: receives chunk ``k + 1`` while hashing chunk ``k`` (the hash runs on this
    thread, the receive in gloo's), so verifying the pulled copy (:meth:`SlotFile.verify` with the returned
    ``checksums``) costs no second pass over it. None on CLOSE.

    The checksums cover the bytes as they lie in the slot once received, which are the bytes a restore loads
    (nothing else writes a slot being received)."""
    if meta is None:
        meta = torch.zeros(META_LEN, dtype=torch.int64)
        dist.recv(meta, src=src, group=group, tag=tags[0])
    if int(meta[0]) == MSG_CLOSE:
        return None
    iteration = int(meta[1])
    hcap, pcap, ecap, nseg = (int(x) for x in meta[2:6])
    idx = store.slot_for_write(role) if index is None else index
    # capacities off the wire: checked against what the slot's owner published before anything is allocated
    slot = store.ensure_pulled(role, idx, header_cap=hcap, payload_cap=pcap, extras_cap=ecap, src=src)
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
            work = dist.irecv(piece, src=src, group=group, tag=tags[1])
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


class GlooTransport(NeighborTransport):
    """Every byte between ranks over one gloo group (see the module docstring for the wire and the tags).

    Args:
        topology: this rank's topology (successor / predecessor).
        store: this rank's host store: the predecessor's images land in its replica slots, pulls in the role asked.
        group: a gloo group over all ranks (the snapshot group; the recovery's small collectives run on it too).
        chunk_bytes: bytes per send.
        gate: optional :class:`TrafficGate` (streaming yields to training traffic).
        rate_limit_bps: streaming bound in bytes per second, 0 for unlimited.
        on_replica: called with (iteration) after each replica commit (metrics).
    """

    kind = "gloo"

    def __init__(self, topology: Topology, store: HostStore, group: dist.ProcessGroup, *, chunk_bytes: int,
                 gate: TrafficGate | None = None, rate_limit_bps: float = 0.0,
                 on_replica: Callable[[int], None] | None = None) -> None:
        super().__init__(topology=topology, store=store, group=group)
        self.stream_group = group
        """The group streaming runs on (:class:`GlooSplitTransport`: one of its own)."""
        self.chunk = max(1, int(chunk_bytes))
        self.gate = gate
        self.rate = rate_limit_bps
        self.on_replica = on_replica
        self._healthy = True
        self._thread: threading.Thread | None = None

    # -- streaming --------------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._healthy

    def _mark_stale(self, what: str, err: BaseException) -> None:
        if self._healthy:
            logger.warning("rank %d: neighbor streaming stopped (%s: %s); replicas are stale until the next "
                           "restart, training continues", self.topology.rank, what, err)
        self._healthy = False

    def start(self) -> None:
        if self.topology.dp_size < 2:
            raise TopologyError(f"rank {self.topology.rank}: streaming to a ring successor needs a data-parallel "
                                f"group of at least two ranks (this one has {self.topology.dp_size})")
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._receive_loop, name="neighbor_ckpt-recv", daemon=True)
        self._thread.start()

    def _receive_loop(self) -> None:
        pred = self.topology.predecessor
        try:
            while True:
                got = recv_image(self.store, ROLE_REPLICA, pred, self.stream_group, chunk=self.chunk)
                if got is None:
                    return
                _, iteration = got
                self.replica_iteration = iteration
                dist.send(torch.tensor([iteration], dtype=torch.int64), dst=pred, group=self.stream_group,
                          tag=TAG_ACK)
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
            send_image(slot, header, succ, self.stream_group, chunk=self.chunk, gate=self.gate, rate_bps=self.rate)
            ack = torch.zeros(1, dtype=torch.int64)
            dist.recv(ack, src=succ, group=self.stream_group, tag=TAG_ACK)
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

    def close(self, timeout: float = 30.0, *, graceful: bool = True) -> None:
        if self._thread is None:
            return  # never streamed: the successor has no receiver waiting for a CLOSE
        if graceful and self._healthy:
            try:
                work = dist.isend(_meta(MSG_CLOSE, None, None), dst=self.topology.successor,
                                  group=self.stream_group, tag=TAG_META)
                work.wait(timeout=timedelta(seconds=timeout))
            except Exception as e:  # noqa: BLE001
                self._mark_stale("closing", e)
        # After a failure nothing is sent: the generation's groups are being torn down, and a send on them can wait
        # for the whole group timeout (measured: a CLOSE sent after an in-process abort waited 120 s for the
        # successor). The receiver thread was freed by the same failure; it is a daemon if it was not.
        self._thread.join(timeout if graceful else min(timeout, 2.0))
        if self._thread.is_alive():
            logger.warning("rank %d: receiver thread did not stop within %.0fs (predecessor gone?)",
                           self.topology.rank, timeout if graceful else min(timeout, 2.0))

    # -- recovery ---------------------------------------------------------------------------------------

    def send_image(self, slot: SlotFile, header: SlotHeader, dst: int) -> None:
        send_image(slot, header, dst, self.group, chunk=self.chunk, tags=(TAG_PULL_META, TAG_PULL_DATA))

    def pull_image(self, role: str, src: int, *, index: int | None = None) -> Pulled:
        got = pull_image(self.store, role, src, self.group, chunk=self.chunk, index=index,
                         tags=(TAG_PULL_META, TAG_PULL_DATA))
        if got is None:  # only streaming sends CLOSE, on other tags
            raise TransportError(f"rank {self.topology.rank}: rank {src} announced no image")
        return got

    # -- the elastic exchange ---------------------------------------------------------------------------

    def exchange(self, out: Mapping[int, torch.Tensor], expect_from: Sequence[int], *,
                 limits: Mapping[int, int] | None = None) -> dict[int, torch.Tensor]:
        _check_messages(out, self.topology.rank)
        sizes_in = {s: torch.zeros(1, dtype=torch.int64) for s in expect_from}
        works = [dist.irecv(t, src=s, group=self.group, tag=TAG_SIZES) for s, t in sizes_in.items()]
        sizes_out = {d: torch.tensor([m.numel()], dtype=torch.int64) for d, m in out.items()}
        works += [dist.isend(t, dst=d, group=self.group, tag=TAG_SIZES) for d, t in sizes_out.items()]
        for w in works:
            w.wait()
        check_announced({s: int(t.item()) for s, t in sizes_in.items()}, limits, self.topology.rank)
        data_in = {s: torch.empty(int(t.item()), dtype=torch.uint8) for s, t in sizes_in.items()}
        works = [dist.irecv(t, src=s, group=self.group, tag=TAG_MSG) for s, t in data_in.items() if t.numel()]
        works += [dist.isend(m.contiguous(), dst=d, group=self.group, tag=TAG_MSG) for d, m in out.items()
                  if m.numel()]
        for w in works:
            w.wait()
        return data_in


def check_announced(sizes: Mapping[int, int], limits: Mapping[int, int] | None, rank: int) -> None:
    """The sizes the senders announced are what this rank may allocate (pure): none negative, none above its
    ``limits`` entry; :class:`TransportError` naming the sender otherwise."""
    for src, n in sorted(sizes.items()):
        limit = None if limits is None else limits.get(src)
        if n < 0 or (limit is not None and n > limit):
            raise TransportError(f"rank {rank}: rank {src} announced a message of {n} bytes where at most "
                                 f"{limit} are expected: a corrupted or foreign peer; nothing allocated for it")


def _check_messages(out: Mapping[int, torch.Tensor], rank: int) -> None:
    for dst, m in out.items():
        if m.dtype != torch.uint8 or m.dim() != 1:
            raise TransportError(f"rank {rank}: the message for rank {dst} must be a 1-D uint8 tensor, got "
                                 f"{m.dtype} of shape {tuple(m.shape)}")
        if dst == rank:
            raise TransportError(f"rank {rank}: a rank does not exchange a message with itself")


GlooRingTransport = GlooTransport
"""The name :class:`GlooTransport` had when it streamed only."""


class GlooSplitTransport(GlooTransport):
    """Kind ``gloo_split``: :class:`GlooTransport` with streaming on ``stream_group``, a gloo group of its own (see
    the module docstring for why); recovery images and the exchange stay on ``group``.

    Args:
        stream_group: a gloo group over the same ranks as ``group``, used for nothing but streaming.
        (the rest as :class:`GlooTransport`)
    """

    kind = "gloo_split"

    def __init__(self, topology: Topology, store: HostStore, group: dist.ProcessGroup, *,
                 stream_group: dist.ProcessGroup, chunk_bytes: int, gate: TrafficGate | None = None,
                 rate_limit_bps: float = 0.0, on_replica: Callable[[int], None] | None = None) -> None:
        super().__init__(topology, store, group, chunk_bytes=chunk_bytes, gate=gate, rate_limit_bps=rate_limit_bps,
                         on_replica=on_replica)
        if dist.get_world_size(stream_group) != dist.get_world_size(group):
            raise TopologyError(f"rank {topology.rank}: the streaming group has {dist.get_world_size(stream_group)} "
                                f"ranks, the snapshot group {dist.get_world_size(group)}; they must be the same ranks")
        self.stream_group = stream_group


def make_gloo_transport(config: TransportConfig, *, topology: Topology, store: HostStore, group: dist.ProcessGroup,
                        gate: TrafficGate | None, on_replica: Callable[[int], None] | None) -> GlooTransport:
    """Kind ``gloo``: :class:`GlooTransport` over the snapshot group, with the configuration's chunk and rate."""
    return GlooTransport(topology, store, group, chunk_bytes=int(config.chunk_mb * 2**20), gate=gate,
                         rate_limit_bps=config.rate_limit_mb_per_s * 1e6, on_replica=on_replica)


def make_gloo_split_transport(config: TransportConfig, *, topology: Topology, store: HostStore,
                              group: dist.ProcessGroup, gate: TrafficGate | None,
                              on_replica: Callable[[int], None] | None) -> GlooSplitTransport:
    """Kind ``gloo_split``: :class:`GlooSplitTransport`; makes its streaming group (collective over the default group:
    every rank calls it at the same point), with the configuration's timeout."""
    stream_group = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                                  timeout=timedelta(seconds=config.timeout_s))
    return GlooSplitTransport(topology, store, group, stream_group=stream_group,
                              chunk_bytes=int(config.chunk_mb * 2**20), gate=gate,
                              rate_limit_bps=config.rate_limit_mb_per_s * 1e6, on_replica=on_replica)
