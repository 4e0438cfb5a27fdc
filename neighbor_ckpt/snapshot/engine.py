"""The snapshot engine: copy the unique state into a host slot off the training thread.

Call order on the training thread::

    engine.snapshot(i, extras)   # right after optimizer step i: records what to copy, returns at once
    ...forward of i+1...
    engine.wait()                # the one wait point: before this rank's first gradient collective of i+1
    ...backward / optimizer step of i+1 may now mutate the source tensors...

Between the two calls a background thread copies the planned tensors into the oldest own slot (on CUDA:
a side stream into page-locked slot memory, ordered after the optimizer step by an event), writes the
extras, checksums, header and commit marker, then streams the image to the ring successor. Slots and
their tensor views are created once; the steady state allocates nothing per iteration except the small
extras encoding. What does not change between snapshots is computed once: the header's tensor table (encoded
JSON), the header capacity, and which own slot holds which iteration (read from the headers at the first
snapshot, then kept by the engine, the only writer of its own slots).

Small tensors are taken on the training thread, in :meth:`SnapshotEngine.snapshot`: the extras' tensors (RNG
states, a loss scaler's scale) and the *staged* tensors of the plan (module buffers the next forward mutates, so no
background copy may read them). Each goes through one function, :func:`_stage_small`: into host memory, without
waiting for the device (a CUDA tensor: ``non_blocking`` into page-locked memory on the current stream, so the copy
runs after the kernels that produced it and before any later kernel of the stream can change it; one event marks
the end of the copies, and the background thread waits for it before reading them). On CPU the copy is immediate
and there is no event: the same code path, without the device.

Why the wait point is before the next gradient collective: no rank can complete optimizer step i+1
before every rank has committed (and, with ``wait_for_replica``, replicated) snapshot i. So the newest
versions of any two ranks differ by at most one, and with two versions kept a common one always exists.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from neighbor_ckpt.snapshot import codec as _codec
from neighbor_ckpt.runtime import failpoints
from neighbor_ckpt.snapshot.razor import Disposition, PlannedTensor, ShardPlan
from neighbor_ckpt.snapshot.slot import SlotFile, SlotHeader, extras_capacity
from neighbor_ckpt.snapshot.store import ROLE_LAZY, ROLE_OWN, HostStore, encode_meta, pick_slot_for_write
from neighbor_ckpt.snapshot.transport import NeighborTransport

logger = logging.getLogger(__name__)

__all__ = ["SnapshotEngine", "EngineStats", "header_capacity", "write_image"]



@dataclass
class EngineStats:
    """Figures of the last snapshot, for logs and metrics."""

    iteration: int = -1
    stage_seconds: float = 0.0
    """Copy of the unique tensors into the slot."""
    commit_seconds: float = 0.0
    """Extras, checksums, header and marker."""
    stream_seconds: float = 0.0
    """Send to the successor until its acknowledgement."""
    wait_seconds: float = 0.0
    """Time the training thread spent blocked at the last wait point (the first wait after a snapshot; a later
    call for the same snapshot returns at once and changes nothing)."""
    snapshot_seconds: float = 0.0
    """Training-thread time of the last :meth:`SnapshotEngine.snapshot` call (encoding and staging the small state;
    a wait for the previous snapshot is in :attr:`wait_seconds`)."""
    unique_bytes: int = 0
    extras_bytes: int = 0
    """Small state (optimizer hyper-parameters, RNG, counters) written next to the unique tensors."""
    replicated_iteration: int = -1
    failures: int = 0
    history: list[float] = field(default_factory=list)


def header_capacity(meta: dict[str, Any] | str) -> int:
    """Room for a header whose ``meta`` is ``meta`` (or its JSON text; the rest of the header is small and
    bounded)."""
    n = len(meta) if isinstance(meta, str) else len(json.dumps(meta))
    return -(-(2 * n + 8192) // 4096) * 4096


def _stage_small(src: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
    """Copy a small tensor into host memory from the training thread without waiting for its device; returns the
    host copy (``dst`` when given, else a new tensor: page-locked for a CUDA source).

    A CUDA source is copied ``non_blocking`` on the current stream: after the kernels that produced it, before the
    later kernels of the stream that may change it. The copy is complete once an event recorded after it on that
    stream is (the caller records one; the engine thread waits for it). A CPU source is copied at once."""
    if dst is None:
        if not src.is_cuda:
            return src.detach().clone()  # one op: a third of empty() + copy_() for a 5 KB RNG state
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    dst.copy_(src.detach(), non_blocking=src.is_cuda)
    return dst


def tensor_table(planned: Sequence[PlannedTensor]) -> list[dict[str, Any]]:
    return [dict(p.meta.to_json(), offset=p.offset) for p in planned]


def _typed_views(slot: SlotFile, planned: Sequence[PlannedTensor]) -> list[torch.Tensor]:
    return [slot.payload_view(p.offset, p.meta.dtype, p.meta.shape) for p in planned]


def _extras_need(text: str, tensors: Sequence[torch.Tensor]) -> int:
    """Bytes the encoded small state takes in a slot's extras region (with room for alignment)."""
    return len(text.encode()) + sum(t.numel() * t.element_size() for t in tensors) + 128


def write_image(store: HostStore, role: str, *, planned: Sequence[PlannedTensor], sources: Sequence[torch.Tensor],
                payload_bytes: int, iteration: int, layout: str, meta: dict[str, Any], extras: Any,
                extras_cap: int | None = None) -> tuple[SlotFile, SlotHeader]:
    """Synchronously write and commit one image (used for lazy backups and by tests)."""
    text, ets = _codec.encode(extras)
    ecap = extras_capacity(_extras_need(text, ets)) if extras_cap is None else extras_cap
    full_meta = dict(meta, tensors=tensor_table(planned))
    idx = store.slot_for_write(role)
    slot = store.ensure(role, idx, header_cap=header_capacity(full_meta), payload_cap=payload_bytes, extras_cap=ecap)
    slot.invalidate()
    with torch.no_grad():
        for dst, src in zip(_typed_views(slot, planned), sources):
            dst.copy_(src)
    hdr = store.commit_image(slot, role, iteration=iteration, layout=layout, payload_nbytes=payload_bytes,
                             extras_text=text, extras_tensors=ets, meta=full_meta)
    return slot, hdr


@dataclass
class _Job:
    iteration: int
    text: str
    tensors: list[torch.Tensor]
    """Host copies of the extras' tensors (complete once ``event`` is)."""
    event: Any
    """CUDA event after the optimizer step and the small copies (None: no CUDA tensor involved)."""
    done: threading.Event = field(default_factory=threading.Event)
    committed: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class SnapshotEngine:
    """Asynchronous per-iteration snapshots of a rank's unique state.

    Args:
        store: this rank's host store.
        plan: the razor's plan; ``plan.unique`` decides what is copied.
        sources: live tensors, one per ``plan.unique`` entry, in the same order.
        layout: identity hash of the job layout (written into every header, checked at restore).
        meta: extra header metadata (topology, plan signature...).
        transport: streams each committed image to the successor (None: local only).
        wait_for_replica: the wait point also waits for the successor's acknowledgement.
        extras_capacity: bytes reserved for extras (None: twice the first snapshot's, at least 64 KiB).
    """

    def __init__(self, *, store: HostStore, plan: ShardPlan, sources: Sequence[torch.Tensor], layout: str,
                 meta: dict[str, Any], transport: NeighborTransport | None = None, wait_for_replica: bool = True,
                 extras_capacity: int | None = None) -> None:
        if len(sources) != len(plan.unique):
            raise ValueError(f"{len(sources)} source tensors for {len(plan.unique)} planned")
        for p, s in zip(plan.unique, sources):
            if s.dtype != p.meta.dtype or tuple(s.shape) != p.meta.shape:
                raise ValueError(f"source {p.meta.name} is {s.dtype}{tuple(s.shape)}, plan says "
                                 f"{p.meta.dtype}{p.meta.shape}")
        self.store = store
        self.plan = plan
        self.sources = list(sources)
        self.layout = layout
        self.meta = dict(meta, tensors=tensor_table(plan.unique), plan=plan.signature)
        self._meta_text = encode_meta(self.meta)  # the tensor table is encoded once, not at every commit
        self._header_cap = header_capacity(self._meta_text)
        self.transport = transport
        self.wait_for_replica = wait_for_replica
        self.extras_capacity = extras_capacity
        self.stats = EngineStats(unique_bytes=plan.unique_bytes)
        # Staged tensors (changing module buffers) are copied by the training thread into these host tensors at
        # every snapshot; the background thread copies from them. The live tensors of the other entries are read
        # by the background thread directly.
        self._staged = [(i, s, _stage_small(s)) for i, (p, s) in enumerate(zip(plan.unique, self.sources))
                        if p.disposition is Disposition.STAGED]
        self._copy_sources = list(self.sources)
        for i, _, host in self._staged:
            self._copy_sources[i] = host
        self._cuda = any(s.is_cuda for s in self._copy_sources)  # the background copies read device memory
        self._device = any(s.is_cuda for s in self.sources)  # every snapshot records an event
        self._stream = torch.cuda.Stream() if self._cuda else None
        self._views: dict[int, tuple[SlotFile, list[torch.Tensor]]] = {}
        self._own_iterations: list[int | None] | None = None  # per own slot (read once, then kept here)
        self._pending: _Job | None = None
        self._waited: _Job | None = None  # the job the last wait point waited for
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="neighbor_ckpt-engine", daemon=True)
        self._worker.start()
        self._closed = False

    # -- training thread -------------------------------------------------------------------------------

    def snapshot(self, iteration: int, extras: Any) -> None:
        """Start snapshotting iteration ``iteration``; returns without copying the unique tensors. The small ones
        (the extras' tensors, the staged buffers) are copied here, on the training thread, without waiting for a
        device (:func:`_stage_small`)."""
        if self._closed:
            raise RuntimeError("snapshot() after close()")
        self.wait()  # a flag check when the wait point already ran for the previous snapshot
        t0 = time.perf_counter()
        text, tensors = _codec.encode(extras)
        # The previous job is committed (the wait above): its host copies are no longer read and may be reused.
        for _, src, host in self._staged:
            _stage_small(src, host)
        host_tensors = [_stage_small(t) for t in tensors]
        event = None
        if self._device or any(t.is_cuda for t in tensors):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
        job = _Job(iteration, text, host_tensors, event)
        self._pending = job
        self._queue.put(job)
        self.stats.snapshot_seconds = time.perf_counter() - t0

    def wait(self) -> None:
        """The wait point: returns once the last snapshot is committed (and replicated, if configured). Blocks at
        most once per snapshot: later calls for the same snapshot (a hook per gradient bucket, the optimizer step's
        tag, :meth:`snapshot`) return at once."""
        job = self._pending
        if job is None or job is self._waited:
            return
        t0 = time.perf_counter()
        (job.done if self.wait_for_replica else job.committed).wait()
        self.stats.wait_seconds = time.perf_counter() - t0
        self._waited = job
        if job.done.is_set():
            self._pending = None

    def drain(self) -> None:
        """Wait for everything in flight, replication included."""
        job = self._pending
        if job is not None:
            job.done.wait()
            self._pending = None

    def close(self) -> None:
        """Drain and stop the worker thread (the store and transport are closed by their owner)."""
        if self._closed:
            return
        self.drain()
        self._closed = True
        self._queue.put(None)
        self._worker.join(timeout=60)

    # -- worker thread ---------------------------------------------------------------------------------

    def _slot_views(self, idx: int, slot: SlotFile) -> list[torch.Tensor]:
        cached = self._views.get(idx)
        if cached is not None and cached[0] is slot:
            return cached[1]
        # First use of this slot file (or it was re-created with other capacities): views made once.
        views = _typed_views(slot, self.plan.unique)
        self._views[idx] = (slot, views)
        if self._cuda and slot.payload_cap:
            # Page-lock the slot once so D2H copies run at full PCIe speed, asynchronously; the slot unpins itself
            # when it is closed or re-created. If CUDA refuses, the slot says so once and stays pageable (correct,
            # slower): ``slot.pinned``.
            slot.pin_for_cuda(self._cuda_device(), self._stream)
        return views

    def _cuda_device(self) -> torch.device:
        """The device of the CUDA sources (this worker thread's current device would be cuda:0)."""
        return next(s.device for s in self.sources if s.is_cuda)

    @property
    def own_capacities(self) -> tuple[int, int, int] | None:
        """(header, payload, extras) capacities of this rank's own slots; None until the first snapshot has sized
        the extras region."""
        ecap = self.extras_capacity
        return None if ecap is None else (self._header_cap, self.plan.unique_bytes, ecap)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._process(job)
            except BaseException as e:  # noqa: BLE001 - reported, never raised into training
                job.error = e
                self.stats.failures += 1
                logger.error("rank %d: snapshot of iteration %d failed: %s", self.store.rank, job.iteration, e)
            finally:
                job.committed.set()
                job.done.set()

    def _process(self, job: _Job) -> None:
        ecap_needed = _extras_need(job.text, job.tensors)
        if self.extras_capacity is None or ecap_needed > self.extras_capacity:
            if self.extras_capacity is not None:
                logger.warning("rank %d: small state grew to %d bytes; enlarging slots", self.store.rank, ecap_needed)
            self.extras_capacity = extras_capacity(ecap_needed)
        if self._own_iterations is None:  # once: the engine is the only writer of its own slots from here on
            self._own_iterations = self.store.committed_iterations(ROLE_OWN)
        idx = pick_slot_for_write(self._own_iterations, role=ROLE_OWN)
        slot = self.store.ensure(ROLE_OWN, idx, header_cap=self._header_cap,
                                 payload_cap=self.plan.unique_bytes, extras_cap=self.extras_capacity)
        views = self._slot_views(idx, slot)
        self._own_iterations[idx] = None
        slot.invalidate()
        if job.event is not None:
            job.event.synchronize()  # the small host copies are complete (and the optimizer step is done)
        if not views:
            failpoints.failpoint("snapshot.copy")  # no tensor to copy (e.g. plain DDP: the snapshot is small state only)
        t0 = time.perf_counter()
        with torch.no_grad():
            if self._cuda:
                assert self._stream is not None  # noqa: S101 - internal invariant
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(job.event)
                    for i, (dst, src) in enumerate(zip(views, self._copy_sources)):
                        dst.copy_(src, non_blocking=True)
                        if i == 0:
                            failpoints.failpoint("snapshot.copy")
                    self._stream.synchronize()
            else:
                for i, (dst, src) in enumerate(zip(views, self._copy_sources)):
                    dst.copy_(src)
                    if i == 0:
                        failpoints.failpoint("snapshot.copy")
        t1 = time.perf_counter()
        hdr = self.store.commit_image(slot, ROLE_OWN, iteration=job.iteration, layout=self.layout,
                                      payload_nbytes=self.plan.unique_bytes, extras_text=job.text,
                                      extras_tensors=job.tensors, meta=self.meta, meta_text=self._meta_text)
        self._own_iterations[idx] = job.iteration
        t2 = time.perf_counter()
        job.committed.set()
        self.stats.iteration = job.iteration
        self.stats.stage_seconds, self.stats.commit_seconds = t1 - t0, t2 - t1
        self.stats.extras_bytes = hdr.extras_nbytes
        if self.transport is not None and self.transport.healthy:
            if self.transport.send(slot, hdr):
                self.stats.replicated_iteration = job.iteration
            self.stats.stream_seconds = time.perf_counter() - t2


def write_lazy_backup(store: HostStore, *, planned: Sequence[PlannedTensor], sources: Sequence[torch.Tensor],
                      payload_bytes: int, iteration: int, layout: str, meta: dict[str, Any]) -> SlotHeader:
    """Write the redundant (lazy) state of this rank as the DP group's backup for ``iteration``."""
    _, hdr = write_image(store, ROLE_LAZY, planned=planned, sources=sources, payload_bytes=payload_bytes,
                         iteration=iteration, layout=layout, meta=meta, extras={})
    return hdr
