"""The slot file: one memory-mapped snapshot (or replica, or lazy backup) of one rank, its format and its checks.

Layout of one slot file (all integers little-endian)::

    [0, 64)                 preamble  magic "NCKPTSLT" | format u32 | header_cap u32 | payload_cap u64 | extras_cap u64
    [64, 64+header_cap)     header    u32 length + JSON: job, owner rank, layout signature, iteration, sizes, checksums
    [P, P+payload_cap)      payload   the planned tensors at their plan offsets (P = 4 KiB aligned)
    [E, E+extras_cap)       extras    JSON of small state + raw bytes of its tensors
    [M, M+64)               marker    magic "NCKPTCMT" | iteration i64 | xxh3(header bytes) u64

A slot is *committed* only when its marker matches its header; the marker is zeroed before any byte of
a new version is written and written last. A slot is *trusted* only after its payload and extras
checksums verify. Nothing here unpickles anything: headers are JSON, tensors are raw bytes. Files are mode 0600,
opened without following links and only when this user owns them.

The slots of one rank, and where they live, are :mod:`neighbor_ckpt.snapshot.store`'s.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import xxhash

from neighbor_ckpt.snapshot import codec as _codec
from neighbor_ckpt.errors import HostMemoryError, SnapshotCorruptError, SnapshotMismatchError
from neighbor_ckpt.runtime.private_files import create_private, open_private, replace_private

logger = logging.getLogger(__name__)

__all__ = ["SlotFile", "SlotHeader", "SegmentChecksums", "FORMAT_VERSION", "MIN_EXTRAS_BYTES", "HEADER_ALLOWANCE_BYTES",
           "PREAMBLE_BYTES", "MARKER_BYTES", "extras_capacity", "slot_file_size", "checksum"]

MAGIC = b"NCKPTSLT"
MARKER_MAGIC = b"NCKPTCMT"
FORMAT_VERSION = 1
PREAMBLE = struct.Struct("<8sIIQQ")  # 32 bytes used of 64
MARKER = struct.Struct("<8sqQ")
PREAMBLE_BYTES = 64
MARKER_BYTES = 64
PAGE = 4096


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _offsets(header_cap: int, payload_cap: int, extras_cap: int) -> tuple[int, int, int, int]:
    p = _align(PREAMBLE_BYTES + header_cap, PAGE)
    e = _align(p + payload_cap, 64)
    m = _align(e + extras_cap, 64)
    return p, e, m, m + MARKER_BYTES


def slot_file_size(header_cap: int, payload_cap: int, extras_cap: int) -> int:
    """Bytes one slot file takes."""
    return _offsets(header_cap, payload_cap, extras_cap)[3]


MIN_EXTRAS_BYTES = 64 << 10
"""The smallest extras region of a slot: the engine allocates ``max(MIN_EXTRAS_BYTES, 2 x first extras)`` unless
configured (``store.extras_capacity_mb``); the preflight and the planner budget the same."""

HEADER_ALLOWANCE_BYTES = 1 << 20
"""What the host-memory budget reserves for one slot's JSON header (the tensor table): generous for thousands of
tensors. The engine sizes the real header from the plan; budgets use this."""


def extras_capacity(extras_bytes: int | None) -> int:
    """Extras region of a slot for extras of ``extras_bytes`` (None: not known yet): room to grow twice."""
    return max(MIN_EXTRAS_BYTES, 2 * (extras_bytes or 0))


def checksum(data: memoryview | bytes) -> int:
    """xxh3-64 of ``data`` (releases the GIL)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class SegmentChecksums:
    """xxh3-64 of byte ranges of a slot computed while they were received (``NeighborTransport.pull_image``): segment
    offset -> (length, checksum). :meth:`SlotFile.verify` uses one where its offset and length are exactly the
    range it would hash, and hashes the slot itself otherwise."""

    by_offset: dict[int, tuple[int, int]]

    def get(self, offset: int, nbytes: int) -> int | None:
        got = self.by_offset.get(offset)
        return got[1] if got is not None and got[0] == nbytes else None


@dataclass(frozen=True)
class SlotHeader:
    """The validated JSON header of a committed slot."""

    job_id: str
    owner_rank: int
    layout: str
    iteration: int
    role: str
    payload_nbytes: int
    payload_xxh3: int | None
    extras_json_nbytes: int
    extras_tensors: list[dict[str, Any]]
    extras_nbytes: int
    extras_xxh3: int | None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION, "job_id": self.job_id, "owner_rank": self.owner_rank,
            "layout": self.layout, "iteration": self.iteration, "role": self.role,
            "payload_nbytes": self.payload_nbytes, "payload_xxh3": self.payload_xxh3,
            "extras_json_nbytes": self.extras_json_nbytes, "extras_tensors": self.extras_tensors,
            "extras_nbytes": self.extras_nbytes, "extras_xxh3": self.extras_xxh3, "meta": self.meta,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> SlotHeader:
        try:
            if d["format"] != FORMAT_VERSION:
                raise SnapshotMismatchError(
                    f"{where}: snapshot format {d['format']!r} is not supported (this build reads {FORMAT_VERSION!r})")
            return cls(
                job_id=str(d["job_id"]), owner_rank=int(d["owner_rank"]), layout=str(d["layout"]),
                iteration=int(d["iteration"]), role=str(d["role"]), payload_nbytes=int(d["payload_nbytes"]),
                payload_xxh3=None if d["payload_xxh3"] is None else int(d["payload_xxh3"]),
                extras_json_nbytes=int(d["extras_json_nbytes"]), extras_tensors=list(d["extras_tensors"]),
                extras_nbytes=int(d["extras_nbytes"]),
                extras_xxh3=None if d["extras_xxh3"] is None else int(d["extras_xxh3"]),
                meta=dict(d.get("meta") or {}),
            )
        except SnapshotMismatchError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise SnapshotCorruptError(f"{where}: malformed header ({type(e).__name__}: {e})") from e


class SlotFile:
    """One memory-mapped slot file. Not thread-safe: one writer at a time (the engine serializes)."""

    def __init__(self, path: Path, mm: mmap.mmap, header_cap: int, payload_cap: int, extras_cap: int) -> None:
        self.path = path
        self._mm = mm
        self.header_cap = header_cap
        self.payload_cap = payload_cap
        self.extras_cap = extras_cap
        self.payload_off, self.extras_off, self.marker_off, self.size = _offsets(header_cap, payload_cap, extras_cap)
        self._buf = memoryview(mm)
        # Views created once; the engine copies into them every iteration without allocating.
        self.payload = torch.frombuffer(mm, dtype=torch.uint8, count=payload_cap, offset=self.payload_off) \
            if payload_cap else torch.empty(0, dtype=torch.uint8)
        self.pinned = False
        """Whether the payload is page-locked for CUDA (:meth:`pin_for_cuda`); False: pageable memory."""
        self._pin: tuple[int, int, Any] | None = None  # (address, device index, copy stream) of the registration

    # -- creation / opening ------------------------------------------------------------------------

    def payload_view(self, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The payload bytes at ``offset`` as a tensor of ``dtype`` and ``shape``: a view of the slot's memory, the
        one place a payload is sliced (the engine writes through it, recovery reads through it). A tensor with no
        elements is a fresh empty tensor (there are no bytes to view)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        return self.payload[offset:offset + nbytes].view(dtype).view(tuple(shape))

    @classmethod
    def create(cls, path: Path, *, header_cap: int, payload_cap: int, extras_cap: int) -> SlotFile:
        """Create (or re-create) a zeroed slot file of the given capacities, mode 0600.

        Its memory is reserved up front (``posix_fallocate``): a full ``/dev/shm`` is a :class:`HostMemoryError`
        here, never a SIGBUS later when a snapshot is copied into a sparse mapping, and the first copy into the
        slot does not pay for allocating its pages."""
        size = slot_file_size(header_cap, payload_cap, extras_cap)
        tmp = path.with_name(path.name + ".tmp")
        fd = create_private(tmp, what="slot file")
        _shape(fd, tmp, size, (header_cap, payload_cap, extras_cap), reserve=True, fchmod=True)
        replace_private(tmp, path)
        return cls.open(path)

    @classmethod
    def reshape(cls, source: Path, path: Path, *, header_cap: int, payload_cap: int, extras_cap: int) -> SlotFile:
        """A zeroed slot of these capacities made from ``source``, a slot file nobody wrote to (a staged slot,
        its pages already faulted in, its mappings closed): moved to ``path``, cut or grown to the new size (the
        pages it keeps stay in memory), its preamble rewritten. As :meth:`create` otherwise."""
        size = slot_file_size(header_cap, payload_cap, extras_cap)
        replace_private(source, path)
        fd = open_private(path, os.O_RDWR, what="slot file")
        grows = size > os.fstat(fd).st_size
        _shape(fd, path, size, (header_cap, payload_cap, extras_cap), reserve=grows, fchmod=False)
        return cls.open(path)

    @classmethod
    def open(cls, path: Path) -> SlotFile:
        """Map an existing slot file after checking its preamble and size. Opened relative to its checked directory,
        never through a link (:func:`~neighbor_ckpt.runtime.private_files.open_private`): a link, or a file another
        user owns, is a :class:`~neighbor_ckpt.errors.StoreDirError` and nothing of it is read."""
        fd = open_private(path, os.O_RDWR, what="slot file")
        try:
            size = os.fstat(fd).st_size
            if size < PREAMBLE_BYTES:
                raise SnapshotCorruptError(f"{path}: truncated slot file ({size} bytes)")
            raw = os.pread(fd, PREAMBLE.size, 0)
            magic, fmt, hcap, pcap, ecap = PREAMBLE.unpack(raw)
            if magic != MAGIC:
                raise SnapshotCorruptError(f"{path}: not a neighbor_ckpt slot (bad magic {magic!r})")
            if fmt != FORMAT_VERSION:
                raise SnapshotMismatchError(f"{path}: slot format {fmt} is not supported (expected {FORMAT_VERSION})")
            expected = slot_file_size(hcap, pcap, ecap)
            if size != expected:
                raise SnapshotCorruptError(f"{path}: truncated or padded slot file ({size} bytes, expected {expected})")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, mm, hcap, pcap, ecap)

    def close(self) -> None:
        """Unpin the payload if it was pinned, then drop this object's references. The mapping itself is released
        when the last tensor view of it is gone (``torch.frombuffer`` keeps the mmap object alive), so outstanding
        views never dangle; they are pageable memory from here on."""
        self.unpin()
        self.payload = torch.empty(0, dtype=torch.uint8)
        self._buf.release()

    def fault_in(self) -> None:
        """Write every page of the mapping once (each page's first byte, rewritten with its own value), so that the
        kernel allocates and zeroes it now: ``posix_fallocate`` on tmpfs reserves the pages but zeroes each on its
        first touch, about as slow as the copy that follows (docs/benchmarks.md section 6). Content is unchanged."""
        pages = torch.frombuffer(self._buf, dtype=torch.uint8)[::PAGE]  # torch: the GIL is free while pages fault
        pages.copy_(pages.clone())

    # -- page-locking for CUDA -------------------------------------------------------------------------

    def pin_for_cuda(self, device: torch.device | int | None = None, stream: Any = None) -> bool:
        """Page-lock the payload region, exactly ``[payload_off, payload_off + payload_cap)`` of the mapping
        (``cudaHostRegister``), so device-to-host copies into it are asynchronous DMA at full speed. Registered
        with ``device`` current (default: the calling thread's current device), so a worker thread never
        creates a context on device 0. ``stream``: the CUDA stream that copies into the payload are issued on;
        :meth:`unpin` waits for it (None: for the whole device). Idempotent; undone by :meth:`unpin` /
        :meth:`close`.

        Returns :attr:`pinned`. When CUDA refuses, one warning names the error and the slot, and the payload
        stays pageable: copies into it are still correct, only slower. Never raises a CUDA error.
        """
        if self.pinned:
            return True
        if not self.payload_cap:
            return False
        index = _cuda_index(device)
        ptr = self.payload.data_ptr()
        err = _cudart_call(index, "cudaHostRegister", ptr, self.payload_cap, 0)
        if err is not None:
            logger.warning("cudaHostRegister of the payload of %s (%d bytes) failed with %s: this slot stays in "
                           "pageable memory; snapshots into it are correct, only slower", self.path,
                           self.payload_cap, err)
            return False
        self._pin = (ptr, index, stream)
        self.pinned = True
        logger.debug("page-locked the payload of %s (%d bytes) for cuda:%d", self.path, self.payload_cap, index)
        return True

    def unpin(self) -> None:
        """Undo :meth:`pin_for_cuda` (``cudaHostUnregister``) once the copies still in flight into the payload
        (on the pinning stream) are done. Nothing when the payload is not pinned: no CUDA call on a CPU-only
        machine. Never raises a CUDA error (a failure is logged)."""
        if self._pin is None:
            return
        ptr, index, stream = self._pin
        self._pin = None
        self.pinned = False
        if not torch.cuda.is_initialized():  # e.g. a forked child: the registration is its parent's
            return
        try:
            with torch.cuda.device(index):
                if stream is not None:
                    stream.synchronize()
                else:
                    torch.cuda.synchronize(index)
            err = _cudart_call(index, "cudaHostUnregister", ptr)
        except RuntimeError as e:  # a sticky CUDA error: the process is failing anyway
            err = str(e)
        if err is not None:
            logger.warning("cudaHostUnregister of the payload of %s failed with %s", self.path, err)

    # -- write protocol ------------------------------------------------------------------------------

    def invalidate(self) -> None:
        """Zero the commit marker: from here on the slot is not a valid snapshot until :meth:`commit`."""
        self._buf[self.marker_off:self.marker_off + MARKER_BYTES] = bytes(MARKER_BYTES)

    def write_extras(self, text: str, tensors: list[torch.Tensor]) -> tuple[int, list[dict[str, Any]], int]:
        """Write small state; returns (json bytes, tensor metas, total bytes). Raises ValueError if too big."""
        raw = text.encode()
        metas, blob = _codec.tensors_to_bytes(tensors)
        start = _align(len(raw), 64)
        total = start + len(blob)
        if total > self.extras_cap:
            raise ValueError(f"extras of {total} bytes do not fit in {self.extras_cap}")
        o = self.extras_off
        self._buf[o:o + len(raw)] = raw
        self._buf[o + start:o + total] = blob
        return len(raw), metas, total

    def checksums(self, payload_nbytes: int, extras_nbytes: int) -> tuple[int, int]:
        p = checksum(self._buf[self.payload_off:self.payload_off + payload_nbytes])
        e = checksum(self._buf[self.extras_off:self.extras_off + extras_nbytes])
        return p, e

    def commit(self, header: SlotHeader, meta_text: str | None = None) -> None:
        """Write the header, then the commit marker (last). ``meta_text``: ``header.meta`` already encoded as JSON
        (:func:`encode_meta`): the tensor table of a large state is then not re-encoded at every commit."""
        if meta_text is None:
            raw = json.dumps(header.to_json(), separators=(",", ":")).encode()
        else:
            d = header.to_json()
            del d["meta"]
            raw = (json.dumps(d, separators=(",", ":"))[:-1] + ',"meta":' + meta_text + "}").encode()
        if 4 + len(raw) > self.header_cap:
            raise ValueError(f"header of {len(raw)} bytes does not fit in {self.header_cap}")
        h = PREAMBLE_BYTES
        self._buf[h:h + 4] = struct.pack("<I", len(raw))
        self._buf[h + 4:h + 4 + len(raw)] = raw
        marker = MARKER.pack(MARKER_MAGIC, header.iteration, checksum(raw))
        self._buf[self.marker_off:self.marker_off + len(marker)] = marker

    # -- read / validate ---------------------------------------------------------------------------------

    def read_header(self) -> SlotHeader:
        """The header of a committed slot; raises :class:`SnapshotCorruptError` if not committed/torn."""
        where = str(self.path)
        magic, iteration, hsum = MARKER.unpack(bytes(self._buf[self.marker_off:self.marker_off + MARKER.size]))
        if magic != MARKER_MAGIC:
            raise SnapshotCorruptError(f"{where}: no commit marker (never committed, or torn mid-write)")
        h = PREAMBLE_BYTES
        (n,) = struct.unpack("<I", bytes(self._buf[h:h + 4]))
        if n > self.header_cap - 4:
            raise SnapshotCorruptError(f"{where}: header length {n} exceeds capacity {self.header_cap}")
        raw = bytes(self._buf[h + 4:h + 4 + n])
        if checksum(raw) != hsum:
            raise SnapshotCorruptError(f"{where}: header does not match its commit marker (torn or corrupted)")
        try:
            d = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SnapshotCorruptError(f"{where}: header is not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise SnapshotCorruptError(f"{where}: header is not a JSON object")
        hdr = SlotHeader.from_json(d, where)
        if hdr.iteration != iteration:
            raise SnapshotCorruptError(f"{where}: marker iteration {iteration} != header iteration {hdr.iteration}")
        if not (0 <= hdr.payload_nbytes <= self.payload_cap and 0 <= hdr.extras_nbytes <= self.extras_cap
                and 0 <= hdr.extras_json_nbytes <= hdr.extras_nbytes):
            raise SnapshotCorruptError(f"{where}: header sizes exceed the slot's capacities")
        return hdr

    def verify(self, hdr: SlotHeader, received: SegmentChecksums | None = None) -> None:
        """Check payload and extras checksums; raises :class:`SnapshotCorruptError`. ``received``: checksums
        computed as the image arrived (a range they do not cover exactly is hashed here)."""
        p = e = None
        if received is not None:
            p = received.get(self.payload_off, hdr.payload_nbytes)
            e = received.get(self.extras_off, hdr.extras_nbytes)
        if p is None and hdr.payload_xxh3 is not None:
            p = checksum(self._buf[self.payload_off:self.payload_off + hdr.payload_nbytes])
        if e is None and hdr.extras_xxh3 is not None:
            e = checksum(self._buf[self.extras_off:self.extras_off + hdr.extras_nbytes])
        if hdr.payload_xxh3 is not None and p != hdr.payload_xxh3:
            raise SnapshotCorruptError(f"{self.path}: payload checksum mismatch (iteration {hdr.iteration})")
        if hdr.extras_xxh3 is not None and e != hdr.extras_xxh3:
            raise SnapshotCorruptError(f"{self.path}: extras checksum mismatch (iteration {hdr.iteration})")

    def read_extras(self, hdr: SlotHeader) -> Any:
        o = self.extras_off
        text = bytes(self._buf[o:o + hdr.extras_json_nbytes]).decode()
        start = _align(hdr.extras_json_nbytes, 64)
        tensors = _codec.bytes_to_tensors(hdr.extras_tensors, self._buf[o + start:o + hdr.extras_nbytes])
        return _codec.decode(text, tensors)

    # -- streaming ---------------------------------------------------------------------------------------

    def image_segments(self, hdr: SlotHeader) -> list[tuple[int, int]]:
        """(offset, length) of the bytes that make up a committed image: everything else is padding.

        The marker segment comes last, so a receiver that writes segments in order commits last.
        """
        segs = [(0, self.payload_off), (self.payload_off, hdr.payload_nbytes),
                (self.extras_off, hdr.extras_nbytes), (self.marker_off, MARKER_BYTES)]
        return [(o, n) for o, n in segs if n > 0]

    def segment(self, offset: int, length: int) -> torch.Tensor:
        """A uint8 tensor view of bytes [offset, offset+length) of the mapping (no copy)."""
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=length, offset=offset)

    @property
    def capacities(self) -> tuple[int, int, int]:
        return self.header_cap, self.payload_cap, self.extras_cap


def _shape(fd: int, path: Path, size: int, caps: tuple[int, int, int], *, reserve: bool, fchmod: bool) -> None:
    """Give the open slot file ``fd`` its size (its memory reserved when ``reserve``) and its preamble, then close
    ``fd``; on any error close it, delete ``path`` and raise."""
    try:
        if fchmod:
            os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        if reserve:
            _reserve(fd, size, path)
        os.pwrite(fd, PREAMBLE.pack(MAGIC, FORMAT_VERSION, *caps), 0)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def _reserve(fd: int, size: int, path: Path) -> None:
    """Allocate the file's blocks now; :class:`HostMemoryError` if the filesystem is full."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
            raise HostMemoryError(
                f"{path}: cannot reserve {size / 2**20:.1f} MiB for a host slot ({os.strerror(e.errno)}). Free shared "
                f"memory (e.g. remove old jobs under the store root), enlarge /dev/shm, or point "
                f"NEIGHBOR_CKPT_STORE_DIR at a larger tmpfs.") from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without fallocate: stays sparse
            raise


def _cuda_index(device: torch.device | int | None) -> int:
    """Index of a CUDA device given as a ``torch.device``, an int or None (the current device)."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"not a CUDA device: {d}")
    return torch.cuda.current_device() if d.index is None else d.index


# The codes cudaHostRegister / cudaHostUnregister return in practice (torch binds no cudaGetErrorName).
_CUDA_ERROR_NAMES = {1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation", 3: "cudaErrorInitializationError",
                     101: "cudaErrorInvalidDevice", 712: "cudaErrorHostMemoryAlreadyRegistered",
                     713: "cudaErrorHostMemoryNotRegistered", 800: "cudaErrorNotPermitted",
                     801: "cudaErrorNotSupported"}


def _cudart_call(index: int, name: str, *args: Any) -> str | None:
    """``torch.cuda.cudart().<name>(*args)`` with device ``index`` current: None on success, else the error as
    ``"<name> (<code>: <description>)"``, with the calling thread's CUDA last error reset.

    A failed runtime call leaves its code in the thread's last error, and PyTorch's next kernel-launch check in
    this thread would report it as that kernel's failure. torch binds no ``cudaGetLastError``: a no-op kernel
    launch reads (and so resets) it through its launch check, and the exception that check raises is discarded.
    """
    cudart = torch.cuda.cudart()
    with torch.cuda.device(index):
        rc = getattr(cudart, name)(*args)
        code = int(rc)
        if code == 0:
            return None
        try:
            torch.cuda._sleep(0)
        except RuntimeError:
            pass
    return f"{_CUDA_ERROR_NAMES.get(code, 'cudaError')} ({code}: {cudart.cudaGetErrorString(rc)})"
