"""The transport seam: everything that moves snapshot bytes between ranks goes through one
:class:`NeighborTransport`, chosen by ``neighbor_ckpt.transport.kind``
(:func:`neighbor_ckpt.snapshot.transport_kinds.make_transport`).

What moves:

* **streaming**: each committed snapshot to the DP-ring successor's replica slot (the engine's worker thread);
* **recovery images**: a replica back to the owner that lost its slot, a lazy backup to the DP members without one
  (:mod:`neighbor_ckpt.recovery.flow`), received with their checksums computed on arrival (:class:`Pulled`);
* **the elastic exchange**: one message per pair of ranks a reshard plan names (:mod:`neighbor_ckpt.recovery.elastic`).

The process group is passed in; the recovery's small collectives (the inventory and verdict all-gathers) run on
:attr:`NeighborTransport.group` beside the transport, which carries the point-to-point bytes.

Kinds (:mod:`neighbor_ckpt.snapshot.transport_kinds`, which maps each to its factory), in
:mod:`neighbor_ckpt.snapshot.gloo_transport`: ``gloo`` (everything over the
snapshot gloo group, point-to-point, a tag pair per purpose) and ``gloo_split`` (the same, with streaming over a gloo
group of its own). A new kind registers its factory with
:func:`~neighbor_ckpt.snapshot.transport_kinds.register_transport`, is added to
:data:`neighbor_ckpt.config.TRANSPORT_KINDS` (the configuration names the kinds it accepts without importing this
layer) and passes the contract test (``tests/multiproc/test_transport_contract.py``), which runs for every registered
kind.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from neighbor_ckpt.snapshot.slot import SegmentChecksums, SlotFile, SlotHeader
from neighbor_ckpt.snapshot.store import HostStore
from neighbor_ckpt.snapshot.topology import Topology

__all__ = ["NeighborTransport", "TrafficGate", "Pulled"]


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


@dataclass(frozen=True)
class Pulled:
    """What :meth:`NeighborTransport.pull_image` received."""

    index: int
    """Slot of the role that now holds the image."""
    iteration: int
    """The iteration the sender announced (the header, read after the marker landed, is what counts)."""
    checksums: SegmentChecksums | None
    """xxh3-64 of the payload and extras segments, computed as their chunks arrived (None: not asked for)."""


class NeighborTransport(ABC):
    """Moves snapshot bytes between the ranks of one job: streaming, recovery images, the elastic exchange.

    Call order on every rank::

        t = make_transport(config.transport, topology=..., store=..., group=...)  # at construction, every rank

        # recovery, before streaming starts; the pairs come from a decision identical on every rank, so every send
        # has its receive:
        t.send_image(slot, header, dst)    # blocking; may run on a thread while this rank pulls
        t.pull_image(role, src, index=i)   # -> Pulled: the image in slot i of role, hashed as it arrived
        t.exchange({dst: msg}, [src, ...]) # -> {src: msg}; sends and receives of one round, in any peer order

        # streaming, once training runs (a ring needs DP >= 2):
        t.start()                          # every rank; begins receiving the predecessor's images
        t.send(slot, header)               # the engine's worker thread, after each local commit; True: acknowledged
        t.close()                          # every rank, at the end; stops the receiver (a no-op if never started)

    The recovery methods and streaming are never in use at the same time (a recovery ends before :meth:`start`).
    A dead or silent neighbor never raises into training from :meth:`send`: it returns False, :attr:`healthy`
    turns False and streaming stops for the rest of the run (the next restart re-forms the ring). The recovery
    methods raise: a recovery decides what a failed transfer costs (the receiver's verification excludes the copy).

    Args:
        topology: this rank's place (ring successor and predecessor, DP group).
        store: this rank's host store (replicas and pulled images land in it).
        group: the snapshot process group, passed in (a kind may build more groups of its own from it).
    """

    kind: str = ""
    """The name :func:`make_transport` knows it by."""

    def __init__(self, *, topology: Topology, store: HostStore, group: dist.ProcessGroup) -> None:
        self.topology = topology
        self.store = store
        self.group = group
        self.replica_iteration: int | None = None
        """The newest iteration of the predecessor this rank received (None: none yet)."""
        self.bytes_sent = 0
        """Bytes streamed to the successor so far (acknowledged sends)."""
        self.send_seconds = 0.0
        """Seconds spent in acknowledged streaming sends."""

    # -- streaming --------------------------------------------------------------------------------------

    @abstractmethod
    def start(self) -> None:
        """Start receiving the predecessor's images into this rank's replica slots."""

    @abstractmethod
    def send(self, slot: SlotFile, header: SlotHeader) -> bool:
        """Send a committed image to the successor; True once the successor has committed its replica."""

    @abstractmethod
    def close(self, *, graceful: bool = True) -> None:
        """Stop streaming (collective in spirit: every rank calls it at the end of training). ``graceful=False``
        after a failure: stop without a word to the successor (its groups are being torn down)."""

    @property
    @abstractmethod
    def healthy(self) -> bool:
        """False once the neighbor failed; replicas are stale from then on."""

    # -- recovery ---------------------------------------------------------------------------------------

    @abstractmethod
    def send_image(self, slot: SlotFile, header: SlotHeader, dst: int) -> None:
        """Send a committed slot image to rank ``dst``, which receives it with :meth:`pull_image`. Blocking."""

    @abstractmethod
    def pull_image(self, role: str, src: int, *, index: int | None = None) -> Pulled:
        """Receive the image rank ``src`` sends with :meth:`send_image` into slot ``index`` of ``role`` (None: the
        slot to overwrite next). The slot is invalidated before the first byte lands, the commit marker lands last,
        and the payload and extras are hashed as they arrive (:attr:`Pulled.checksums`: verifying the copy needs
        no second pass)."""

    # -- the elastic exchange ---------------------------------------------------------------------------

    @abstractmethod
    def exchange(self, out: Mapping[int, torch.Tensor], expect_from: Sequence[int], *,
                 limits: Mapping[int, int] | None = None) -> dict[int, torch.Tensor]:
        """Send ``out[dst]`` (a 1-D uint8 tensor) to every ``dst`` and receive one message from every rank in
        ``expect_from``; returns them by sender. Every rank a message names calls it in the same round; no order of
        peers can deadlock. The bytes arrive as sent; checking them (a message's own checksum) is the caller's.
        ``limits``: the most bytes this rank expects from each sender; a larger announcement (a corrupted or foreign
        peer) raises :class:`~neighbor_ckpt.errors.TransportError` before anything is allocated for it."""
