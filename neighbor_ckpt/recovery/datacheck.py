"""The data-position check: after a recovery, the replayed step must see the input it saw before the failure.

A restore brings back the model, optimizer, RNG and counters, but the loader is the training script's: a loader whose
position was not restored (a ``DataLoader(shuffle=True)`` whose iterator is created after ``recover()`` restored the
global RNG draws another shuffle seed; a sampler restarted at the beginning of its epoch) feeds other batches, and
every loss after the restart differs from the run without failure, silently. This module notices it at the first
replayed step.

**Fingerprint.** Every sample (row) of every micro-batch of a step is hashed (:func:`sample_hashes`: xxh3-64 of a
bounded part of each row, its first and last bytes and a fixed-stride sample between them; :func:`token_tensor`
finds the ids in a batch). A micro-batch's :func:`fingerprint` is the hash of its per-sample hashes in order; the
step's (:func:`step_fingerprint`) chains its micro-batches in order; beside it the step keeps the order-independent
sum of its per-sample hashes (:func:`combine_samples`), the figure a changed data-parallel layout can compare. A few
microseconds per micro-batch (``tools/bench/micro/fingerprint.py``).

**Where the micro-batches come from:** :func:`megatron_patches.data_iter.observe_forward_backward` wraps the
``data_iterator`` handed to megatron-core's forward-backward function (installed by ``install_hooks``, hence by the
NeMo callback; a Megatron-Bridge callback installs it the same way); the Lightning callback feeds each training
batch; other
loops call :meth:`~neighbor_ckpt.NeighborCheckpointer.observe_input` or wrap their iterator
(``hooks.observe``, :func:`megatron_patches.data_iter.observe_iterator`).

**Where fingerprints live, so that they survive a restart of every rank** (torchrun's restart kills the survivors
too; their host store survives on their node):

* the *input record* (:class:`InputRecord`, :data:`RECORD_FILE` in the rank's store directory): a 2.5 KiB file,
  memory-mapped, holding the fingerprints of the last :data:`RING` steps, one 40-byte entry per step (step,
  fingerprint, micro-batches seen, sample sum, check word) rewritten with one store to the mapping at each
  micro-batch. It
  therefore holds the *in-flight* step (the one the failure interrupted), survives any death of the process (the
  page is the file's, not the process's) and needs no system call per step. A torn entry fails its check word and is
  ignored;
* the snapshot of step ``i`` carries the fingerprint of step ``i``'s input (extras key :data:`SNAPSHOT_KEY`): after a
  restore it says whether the input record belongs to the restored timeline (a record whose entry for the restored
  step differs is from another timeline and is not used);
* a survivor's failure event (:func:`~neighbor_ckpt.recovery.journal.record_failure_event`) names its in-flight step
  and fingerprint: the record of the failure, and a second source when the input record is unreadable.

A rank whose store was lost (a replaced node) has nothing recorded for its in-flight step and checks nothing; its
peers, whose stores survived, check theirs (a loader mistake is the same on every rank).

**The check** (:class:`DataCheck`, configured by ``neighbor_ckpt.data_check``): after a restore of iteration ``k``
(in-memory or insurance), the fingerprint of step ``k + 1``'s first ``n`` micro-batches (``n``: as many as were
recorded before the failure) is compared with the one recorded before the failure (:func:`compare`). ``error``: a
mismatch raises :class:`~neighbor_ckpt.errors.DataPositionError` before the micro-batch trains, and leaves a marker
(:data:`STOPPED_FILE`) so the launcher's further restarts of the same launch stop at once with the same message
instead of walking back through older versions; ``warn``: logged, training goes on; ``off``: nothing is computed or
written.

After an elastic reshard (:meth:`DataCheck.arm_reshard`, :meth:`DataCheck.before_snapshot`) the replayed step's
global batch is compared instead: the sum of its per-sample hashes over every rank, against the previous layout's
input records found on the nodes.

May import: :mod:`neighbor_ckpt.errors`, :mod:`neighbor_ckpt.runtime` (layer rule of :mod:`neighbor_ckpt.recovery`).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import json
import logging
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import numpy as np
import torch
import xxhash

from neighbor_ckpt.errors import DataPositionError
from neighbor_ckpt.runtime.atomic_json import write_atomic_json
from neighbor_ckpt.runtime.private_files import open_private, read_private

logger = logging.getLogger(__name__)

__all__ = ["RECORD_FILE", "STOPPED_FILE", "SNAPSHOT_KEY", "RING", "TOKEN_KEYS", "fingerprint", "sample_hashes",
           "step_fingerprint", "combine_samples", "token_tensor", "InputMark", "InputRecord", "Verdict", "compare",
           "mismatch_message", "parse_input", "parse_mark", "read_mark", "DataCheck"]

RECORD_FILE = "inputs.bin"
"""Per-rank input record in the rank's store directory (mode 0600)."""

STOPPED_FILE = "datacheck_stopped.json"
"""Per-rank marker: an attempt of this launch stopped on a data-position mismatch."""

SNAPSHOT_KEY = "input"
"""Key of a snapshot's extras holding ``{"step": i, "fp": "<16 hex digits>"}`` (the input of step i)."""

RING = 64
"""Steps the input record keeps: an insurance checkpoint up to this many steps back is checked too."""

TOKEN_KEYS = ("tokens", "input_ids", "text")
"""Keys under which :func:`token_tensor` looks for the token ids of a dict batch, in this order."""

_ENTRY = struct.Struct("<qQQQQ")  # step, fingerprint, micro-batches, sample sum, check word
_PAIR = struct.Struct("<QQ")
_MASK = (1 << 64) - 1
_MAGIC = 0x6E636B70_74646174  # "nckptdat"
_GOLDEN = 0x9E3779B9_7F4A7C15


def _check_word(step: int, fp: int, n: int = 0, total: int = 0) -> int:
    return ((step * _GOLDEN) ^ fp ^ _MAGIC ^ (n * 0xC2B2AE3D_27D4EB4F) ^ ((total << 1) | (total >> 63))) & _MASK


class InputMark(NamedTuple):
    """What was recorded of one step's input: its fingerprint after ``n`` micro-batches, and the order-independent
    sum of those micro-batches' per-sample hashes (:func:`combine_samples`)."""

    step: int
    fp: int
    n: int = 0
    """Micro-batches seen (0: not recorded, e.g. a record of an older release: compared at the first one)."""
    total: int = 0


ROW_WHOLE_BYTES = 1024
"""A sample (one row: the first dimension of the token ids) up to this size is hashed whole."""
ROW_EDGE_BYTES = 256
"""Of a longer sample: its first and last this many bytes ..."""
ROW_STRIDED = 32
"""... and this many elements at a fixed stride across the rest, with the sample's size as the hash seed. Bounded
per sample (at most 2 x 256 bytes + 32 elements, gathered into one small copy for the micro-batch; from a device
only that copy crosses to the host), and every sample is read: a shuffled or shifted data position changes each
sample's first bytes; another sample in one row changes that row's hash."""


def sample_hashes(tokens: torch.Tensor) -> list[int]:
    """The per-sample hashes of a micro-batch's token ids: one xxh3-64 per row of the first dimension (a 0- or
    1-dimensional tensor is one sample), of the whole row up to :data:`ROW_WHOLE_BYTES`, else of its first and last
    :data:`ROW_EDGE_BYTES` and :data:`ROW_STRIDED` elements in between, seeded with the row's size in bytes (its
    dtype's element size included, its values' shape not). Host tensors are hashed in place; of a device tensor or
    a strided view only the sampled part is copied."""
    t = tokens
    shape = t.shape
    numel = t.numel()
    rows = shape[0] if len(shape) >= 2 else 1
    if rows == 0 or numel == 0:
        return []
    esize = t.element_size()
    per_row = numel // rows
    row_bytes = per_row * esize
    host = t.is_cpu and t.is_contiguous()
    if row_bytes <= ROW_WHOLE_BYTES:
        if not host:
            t = (t if t.is_cpu else t.cpu()).contiguous()
        # Host token ids (what a loader yields): hashed in place through ctypes views of their memory (the tensor is
        # alive for the call). No numpy view and no copy: the fewest Python-level calls at the start of a micro-batch.
        return _row_hashes(t.data_ptr(), rows, row_bytes, row_bytes)
    if host:
        # one gather of the sampled bytes of every row (numpy over the tensor's memory, an index cached per row
        # size), then one xxh3 per row of the gathered copy: the fewest Python-level calls for a few hundred bytes
        # per row (each call counts on a training thread that shares the CPU with the engine's)
        raw = np.frombuffer((ctypes.c_char * (rows * row_bytes)).from_address(t.data_ptr()), dtype=np.uint8)
        sampled_bytes = raw.reshape(rows, row_bytes).take(_sampled_bytes(per_row, esize), axis=1)  # C order
        h = xxhash.xxh3_64_intdigest
        return [h(row, row_bytes) for row in sampled_bytes]
    # on a device, or a strided view: the same elements gathered there, only they copied to the host
    sampled = t.reshape(rows, per_row).index_select(1, _device_index(per_row, esize, t.device))
    sampled = (sampled if sampled.is_cpu else sampled.cpu()).contiguous()
    return _row_hashes(sampled.data_ptr(), rows, sampled.shape[1] * esize, row_bytes)


@functools.lru_cache(maxsize=64)
def _sampled_elements(per_row: int, esize: int) -> tuple[int, ...]:
    """The element indices of a row that :func:`sample_hashes` reads, in order (first, strided, last)."""
    edge = max(1, ROW_EDGE_BYTES // esize)
    middle = per_row - 2 * edge
    stride = max(1, middle // ROW_STRIDED) if middle > 0 else 1
    strided = list(range(edge, per_row - edge, stride))[:ROW_STRIDED] if middle > 0 else []
    return (*range(edge), *strided, *range(per_row - edge, per_row))


@functools.lru_cache(maxsize=64)
def _device_index(per_row: int, esize: int, device: torch.device) -> torch.Tensor:
    """:func:`_sampled_elements` as an index tensor on ``device`` (made once: no host-to-device copy per step)."""
    return torch.tensor(_sampled_elements(per_row, esize), dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=64)
def _sampled_bytes(per_row: int, esize: int) -> np.ndarray:
    elements = np.asarray(_sampled_elements(per_row, esize), dtype=np.int64)
    return (elements[:, None] * esize + np.arange(esize)[None, :]).reshape(-1)


def _row_hashes(address: int, rows: int, stride_bytes: int, seed: int) -> list[int]:
    view = ctypes.c_char * stride_bytes
    h = xxhash.xxh3_64_intdigest
    return [h(view.from_address(address + r * stride_bytes), seed) for r in range(rows)]


def _combine(hashes: list[int], esize: int) -> int:
    """The micro-batch fingerprint: xxh3-64 of its per-sample hashes in order, seeded with the element size."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(hashes)}Q", *hashes), seed=esize)


def fingerprint(tokens: torch.Tensor) -> int:
    """A micro-batch's fingerprint: the xxh3-64 of its :func:`sample_hashes` in order (every sample, a bounded part
    of each). A CUDA tensor's sampled part is copied to host memory (a device synchronization: fingerprint the host
    batch, before ``.cuda()``, where you can)."""
    return _combine(sample_hashes(tokens), tokens.element_size())


def step_fingerprint(previous: int | None, micro_batch: int) -> int:
    """The step's fingerprint after one more micro-batch: the first micro-batch's own fingerprint, then an ordered
    chain (every micro-batch of the step enters it; another order is another fingerprint)."""
    if previous is None:
        return micro_batch
    return xxhash.xxh3_64_intdigest(_PAIR.pack(previous, micro_batch), seed=_GOLDEN)


def combine_samples(hashes: Iterable[int], start: int = 0) -> int:
    """Order-independent combination of per-sample hashes: their sum mod 2^64. Partial sums of any split of a
    global batch (per rank, per micro-batch, in any data-parallel layout) add up to the same value, which is what
    is compared across an elastic reshard."""
    return (start + sum(hashes)) & _MASK


def token_tensor(batch: Any) -> torch.Tensor | None:
    """The tensor that stands for a batch's input: a tensor itself; in a dict, the first of :data:`TOKEN_KEYS`, else
    its first tensor value; in a list or tuple, the first element that has one (``(inputs, labels)`` -> inputs).
    None when the batch holds no tensor."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        for k in TOKEN_KEYS:
            v = batch.get(k)
            if isinstance(v, torch.Tensor):
                return v
        values = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return None
    for v in values:
        t = token_tensor(v)
        if t is not None:
            return t
    return None


class InputRecord:
    """The memory-mapped ring of (step, fingerprint) of one rank (see the module docstring). Not thread-safe: the
    training thread writes it; a reader is the next process."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        size = RING * _ENTRY.size
        self.existed = os.path.lexists(self.path)
        """Whether the file was there before (False: a new store, e.g. a replaced node's, or a first start)."""
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT, 0o600, what="input record")  # no link, this user's
        try:
            os.fchmod(fd, 0o600)
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # a foreign size: start empty (zeros fail the check word)
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def put(self, step: int, fp: int, n: int = 1, total: int = 0) -> None:
        if self._map is not None:
            _ENTRY.pack_into(self._map, (step % RING) * _ENTRY.size, step, fp, n, total,
                             _check_word(step, fp, n, total))

    def mark(self, step: int) -> InputMark | None:
        """What was recorded for ``step`` (None: never recorded, overwritten by a later step, or torn)."""
        if self._map is None or step < 0:
            return None
        s, fp, n, total, chk = _ENTRY.unpack_from(self._map, (step % RING) * _ENTRY.size)
        return InputMark(s, fp, n, total) if s == step and chk == _check_word(s, fp, n, total) else None

    def get(self, step: int) -> int | None:
        """The fingerprint recorded for ``step`` (None: never recorded, overwritten by a later step, or torn)."""
        m = self.mark(step)
        return None if m is None else m.fp

    def any_recorded(self) -> bool:
        """Whether any step is recorded (a record that never saw an input holds none)."""
        if self._map is None:
            return False
        return any(self.mark(s) is not None
                   for s, *_ in (_ENTRY.unpack_from(self._map, i * _ENTRY.size) for i in range(RING)) if s >= 0)

    def clear(self) -> None:
        if self._map is not None:
            self._map[:] = bytes(len(self._map))

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


class Verdict(str, enum.Enum):
    MATCH = "match"
    MISMATCH = "mismatch"
    UNKNOWN = "unknown"
    """Nothing was recorded for that step on this rank: nothing to compare."""


def compare(expected: int | None, actual: int) -> Verdict:
    """Pure: the verdict for a replayed step's fingerprint (``expected``: recorded before the failure, or None)."""
    if expected is None:
        return Verdict.UNKNOWN
    return Verdict.MATCH if expected == actual else Verdict.MISMATCH


def mismatch_message(*, rank: int, step: int, expected: int, actual: int, source: str, restored: int | None,
                     micro_batches: int = 1, seen: int | None = None) -> str:
    """What :class:`DataPositionError` (and the ``warn`` log line) says. ``micro_batches``: how many of the step's
    micro-batches the recorded fingerprint covers; ``seen``: how many the replay had when judged (default: as many)."""
    after = f"after the restore of iteration {restored}" if restored is not None else "after the recovery"
    seen = micro_batches if seen is None else seen
    what = (f"of its first {micro_batches} micro-batch(es)" if seen == micro_batches else
            f"of {seen} micro-batch(es), the step ended before the {micro_batches} seen before the failure")
    return (f"rank {rank}: the data position was not restored: step {step}, replayed {after}, got other input than "
            f"before the failure (fingerprint {what} {actual:016x}, recorded before the failure "
            f"{expected:016x}, from {source}). Training on would silently diverge from the run without the failure. "
            f"Resume the loader with the snapshot: put a torchdata StatefulDataLoader's state_dict() in snapshot()'s "
            f"user_state and load it after recover(), or build the sampler from result.next_step / the consumed "
            f"samples; give the loader and its sampler their own torch.Generator (DataLoader(shuffle=True) draws its "
            f"shuffle seed from the global RNG when its iterator is created, after recover() restored that RNG). "
            f"See docs/data-position.md. To train on anyway set neighbor_ckpt.data_check: warn.")


@dataclass(frozen=True)
class _Expectation:
    step: int
    fp: int
    n: int
    source: str
    restored: int | None


@dataclass(frozen=True)
class _GlobalExpectation:
    step: int
    total: int
    group: Any
    restored: int | None


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


_NO_RECORD, _EMPTY, _HAS_STEP, _STEP_MISSING = 0, 1, 2, 3
"""What :func:`read_mark` found (ordered so that the all-reduce MAX of :meth:`DataCheck.arm_reshard` keeps what
any node found)."""


def read_mark(path: Path, step: int) -> tuple[int, InputMark | None]:
    """Read another process's input record without changing it: (what was found, the step's mark or None)."""
    try:
        raw = read_private(path, what="input record")
    except OSError:  # absent, or a link or another user's file (StoreDirError): nothing of it read
        return _NO_RECORD, None
    if len(raw) != RING * _ENTRY.size:
        return _NO_RECORD, None
    marks = {}
    for i in range(RING):
        s, fp, n, total, chk = _ENTRY.unpack_from(raw, i * _ENTRY.size)
        if s >= 0 and chk == _check_word(s, fp, n, total) and (s, fp, n, total, chk) != (0, 0, 0, 0, 0):
            marks[s] = InputMark(s, fp, n, total)
    if step in marks:
        return _HAS_STEP, marks[step]
    return (_STEP_MISSING if marks else _EMPTY), None


def _hex(fp: int) -> str:
    return f"{fp:016x}"


def _no_input_reason(record: InputRecord, step: int) -> str:
    """Why nothing is recorded for ``step`` on this rank, from what the record shows (one line, never a guess)."""
    if not record.existed:
        return ("this rank's input record did not exist when this attempt started (a new host store: a replaced node, "
                "or a store directory that was removed)")
    if not record.any_recorded():
        return ("no input reached the data check on this rank before the failure (the data iterator handed to "
                "megatron-core's forward-backward function is observed through install_hooks, NeMo and Bridge; "
                "other loops call observe(); a pipeline stage that reads no data has nothing to record)")
    return f"the failure came before step {step} drew its input on this rank"


class DataCheck:
    """The per-rank data-position check (see the module docstring).

    Args:
        mode: ``neighbor_ckpt.data_check`` (``error``, ``warn``, ``off``).
        store_dir: the rank's host-store directory (the input record and the marker go there).
        rank: for messages.
        attempt: the launcher's restart count (default ``TORCHELASTIC_RESTART_COUNT``; the marker stops restarts of
            the same launch only).

    The training thread calls :meth:`observe` for every micro-batch (every one enters the step's fingerprint) and
    :meth:`step_done` when the step's snapshot is taken; :meth:`arm` once after the recovery.
    """

    def __init__(self, mode: str, *, store_dir: Path, rank: int, attempt: int | None = None) -> None:
        self.mode = mode
        self.rank = rank
        self.attempt = attempt if attempt is not None else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.store_dir = Path(store_dir)
        self.record: InputRecord | None = InputRecord(self.store_dir / RECORD_FILE) if mode != "off" else None
        self._step = 0
        self._fp: int | None = None
        self._n = 0
        self._total = 0
        self._expect: _Expectation | None = None
        self._global: _GlobalExpectation | None = None
        self.inflight: InputMark | None = None
        """What was seen of the newest observed step (the in-flight one until its snapshot)."""
        self.verdict: Verdict | None = None
        """Outcome of the last check (None: none ran yet)."""

    @property
    def enabled(self) -> bool:
        return self.record is not None

    @property
    def stopped_path(self) -> Path:
        return self.store_dir / STOPPED_FILE

    # -- before / after the recovery -------------------------------------------------------------------

    def refuse_if_stopped(self) -> None:
        """Raise the recorded :class:`DataPositionError` when an earlier attempt of this launch stopped on a
        mismatch (a later restart would only walk back through older versions and stop again). A marker of another
        launch (attempt 0 now), or with the check not ``error``, is removed."""
        try:
            data = json.loads(read_private(self.stopped_path, what="data-position stop marker"))
            marked, message = int(data["attempt"]), str(data["message"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError):
            self.stopped_path.unlink(missing_ok=True)
            return
        if self.mode == "error" and self.attempt > marked:
            raise DataPositionError(f"attempt {marked} of this launch stopped on a data-position mismatch; this "
                                    f"restart stops too (delete {self.stopped_path} to retry anyway). {message}",
                                    step=int(data.get("step", -1)), rank=self.rank)
        self.stopped_path.unlink(missing_ok=True)

    def arm(self, next_step: int, *, restored: bool, restored_iteration: int | None = None,
            snapshot_input: Any = None, failure_input: tuple[int, ...] | None = None) -> None:
        """After the recovery: the next step to be trained is ``next_step``. When something was restored, the input
        record's (or the failure event's) fingerprint of that step becomes the expectation for the same number of
        its micro-batches; a fresh start empties the record (a new timeline).

        ``snapshot_input``: the restored snapshot's :data:`SNAPSHOT_KEY` extras (the input of the restored step);
        ``failure_input``: this rank's failure event's (step, fingerprint[, micro-batches, sum]), if it had one
        (:func:`parse_mark`)."""
        self._begin(next_step)
        self._expect, self.inflight = None, None
        if self.record is None:
            return
        if not restored:
            self.record.clear()
            return
        source = "this rank's input record"
        expected = self.record.mark(next_step)
        snap = parse_input(snapshot_input)
        if snap is not None and restored_iteration is not None and snap[0] == restored_iteration:
            mine = self.record.get(restored_iteration)
            if mine is not None and mine != snap[1]:
                logger.warning("rank %d: neighbor_ckpt data check: the input record is from another timeline (its "
                               "step %d differs from the restored snapshot's); not used", self.rank,
                               restored_iteration)
                expected = None
        if expected is None and failure_input is not None and failure_input[0] == next_step:
            expected, source = InputMark(*failure_input), "this rank's failure event"
        if expected is None:
            logger.info("rank %d: neighbor_ckpt data check: no input recorded for step %d on this rank: %s; not "
                        "checked here", self.rank, next_step, _no_input_reason(self.record, next_step))
            return
        self._expect = _Expectation(next_step, expected.fp, expected.n, source, restored_iteration)

    # -- across an elastic reshard ---------------------------------------------------------------------------

    def arm_reshard(self, next_step: int, *, group: Any, old_generation: Path, old_world: int,
                    restored_iteration: int | None = None) -> None:
        """Collective over ``group`` (every rank of the new layout; a one-time all-reduce): after an elastic reshard
        restored iteration ``next_step - 1``, the global batch of ``next_step`` is compared instead of each rank's
        micro-batches (another data-parallel size deals the samples to other ranks). The expectation is the sum of
        the previous layout's recorded sample sums of that step (:func:`combine_samples`; every old rank's input
        record under ``old_generation`` on every node), compared at the end of the step (:meth:`before_snapshot`)
        with the same sum over this layout. Tensor and pipeline parallel sizes are unchanged by a reshard, so the
        ranks that observe a global batch count it as often in both layouts.

        Not checked, said in one line: an old rank's record is missing (its node's store is gone) or lacks the step
        (it failed before drawing it), or the old ranks saw different numbers of micro-batches (the failure came
        while they drew it)."""
        self._begin(next_step)
        self._expect, self.inflight, self._global = None, None, None
        if self.record is None:
            return
        self.record.clear()  # the new generation's record: a new layout's timeline
        status = torch.zeros(max(old_world, 1), 5, dtype=torch.int64)  # found, n, sum lo, sum hi, seen by
        for d in Path(old_generation).glob("rank*"):
            try:
                old = int(d.name[4:])
            except ValueError:
                continue
            if 0 <= old < old_world:
                code, mark = read_mark(d / RECORD_FILE, next_step)
                status[old, 0] = code
                if mark is not None:
                    status[old, 1:4] = torch.tensor([mark.n, mark.total & 0xFFFFFFFF, mark.total >> 32])
        torch.distributed.all_reduce(status, op=torch.distributed.ReduceOp.MAX, group=group)
        codes = status[:, 0].tolist()
        missing = [r for r, c in enumerate(codes) if c == _NO_RECORD]
        lacking = [r for r, c in enumerate(codes) if c == _STEP_MISSING]
        counts = sorted({int(status[r, 1]) for r, c in enumerate(codes) if c == _HAS_STEP})
        why = None
        if missing:
            why = f"the input record of old rank(s) {_ranks(missing)} did not survive (their node's store is gone)"
        elif lacking:
            why = f"old rank(s) {_ranks(lacking)} failed before step {next_step} drew its input"
        elif len(counts) > 1:
            why = (f"the failure came while the old ranks drew step {next_step}'s input (they saw "
                   f"{counts[0]} to {counts[-1]} micro-batches)")
        elif not counts:
            why = "no old rank recorded any input (nothing reached the data check before the failure)"
        if why is not None:
            logger.info("rank %d: neighbor_ckpt data check: not checked after the elastic reshard: %s", self.rank,
                        why)
            return
        total = 0
        for r, c in enumerate(codes):
            if c == _HAS_STEP:
                total += int(status[r, 2]) | (int(status[r, 3]) << 32)
        self._global = _GlobalExpectation(next_step, total & _MASK, group, restored_iteration)

    def before_snapshot(self, iteration: int) -> None:
        """Collective over the group of :meth:`arm_reshard`, on every rank, when the first step after a reshard
        ends (the checkpointer calls it before that step's snapshot is taken; a no-op otherwise): the global batch's
        sample sum is compared. Raises :class:`DataPositionError` on every rank alike (mode ``error``)."""
        exp = self._global
        if exp is None or exp.step != iteration:
            return
        self._global = None
        mine = self._total if self._step == iteration else 0
        halves = torch.tensor([mine & 0xFFFFFFFF, mine >> 32], dtype=torch.int64)
        torch.distributed.all_reduce(halves, group=exp.group)
        actual = (int(halves[0]) + (int(halves[1]) << 32)) & _MASK
        self.verdict = compare(exp.total, actual)
        if self.verdict is Verdict.MATCH:
            logger.info("rank %d: neighbor_ckpt data check: step %d's global batch after the elastic reshard is the "
                        "one drawn before the failure (sample sum %016x): data position verified", self.rank,
                        iteration, actual)
            return
        after = f"the restore of iteration {exp.restored}" if exp.restored is not None else "the recovery"
        msg = (f"rank {self.rank}: the data position was not restored: step {iteration}, replayed after {after} "
               f"resharded to another data-parallel size, got another global batch than before the failure (sum of "
               f"its per-sample fingerprints {actual:016x} over every rank, recorded before the failure "
               f"{exp.total:016x}, from the previous layout's input records). Training on would silently diverge "
               f"from the run without the failure. Resume the loader from the consumed samples at the new "
               f"data-parallel size (the global batch is kept: docs/failures.md). To train on anyway set "
               f"neighbor_ckpt.data_check: warn.")
        self._stop_or_warn(iteration, msg, expected=exp.total, actual=actual)

    def _stop_or_warn(self, step: int, msg: str, *, expected: int, actual: int) -> None:
        if self.mode == "warn":
            logger.warning("neighbor_ckpt data check (data_check: warn, training goes on): %s", msg)
            return
        try:
            write_atomic_json(self.stopped_path, {"attempt": self.attempt, "step": step, "message": msg})
        except OSError as e:
            logger.debug("rank %d: could not write %s: %s", self.rank, self.stopped_path, e)
        raise DataPositionError(msg, step=step, rank=self.rank, expected=expected, actual=actual)

    # -- per step ----------------------------------------------------------------------------------------

    def _begin(self, step: int) -> None:
        self._step, self._fp, self._n, self._total = step, None, 0, 0

    def observe(self, batch: Any) -> None:
        """A micro-batch of the current step (a token tensor, or a batch :func:`token_tensor` understands): its
        per-sample hashes enter the step's fingerprint (ordered) and its sample sum (order-independent); the record
        is updated; after a recovery, once as many micro-batches as were recorded before the failure were seen, the
        step is checked. Raises :class:`DataPositionError` (mode ``error``) before the mismatching micro-batch is
        recorded or trained."""
        if self.record is None:
            return
        tokens = token_tensor(batch)
        if tokens is None:
            return
        hashes = sample_hashes(tokens)
        step = self._step
        fp = step_fingerprint(self._fp, _combine(hashes, tokens.element_size()))
        n, total = self._n + 1, combine_samples(hashes, self._total)
        exp = self._expect
        if exp is not None and exp.step == step and n >= exp.n:
            # exp.n == 0: no count recorded (a failure event of an older release, whose fingerprint was the first
            # micro-batch's): compared at the first one
            self._expect = None
            self._judge(exp, fp, n)
        self._fp, self._n, self._total = fp, n, total
        self.record.put(step, fp, n, total)
        self.inflight = InputMark(step, fp, n, total)

    def _judge(self, exp: _Expectation, fp: int, n: int) -> None:
        self.verdict = compare(exp.fp, fp) if n == max(exp.n, 1) else Verdict.MISMATCH
        if self.verdict is Verdict.MATCH:
            logger.info("rank %d: neighbor_ckpt data check: step %d replays the input it had before the failure "
                        "(fingerprint %016x of %d micro-batch(es)): data position verified", self.rank, exp.step, fp,
                        n)
            return
        msg = mismatch_message(rank=self.rank, step=exp.step, expected=exp.fp, actual=fp, source=exp.source,
                               restored=exp.restored, micro_batches=max(exp.n, 1), seen=n)
        self._stop_or_warn(exp.step, msg, expected=exp.fp, actual=fp)

    def step_done(self, iteration: int) -> None:
        """The snapshot of ``iteration`` is being taken: the next micro-batch belongs to ``iteration + 1``. A replayed
        step that ended with fewer micro-batches than were recorded before the failure is judged here (a
        mismatch); one that drew none through the check is logged."""
        exp = self._expect
        if exp is not None and exp.step == iteration:
            self._expect = None
            if self._n:
                self._judge(exp, self._fp or 0, self._n)
            else:
                logger.warning("rank %d: neighbor_ckpt data check: step %d trained without any input reaching the "
                               "check in this attempt (before the failure it saw %d micro-batch(es)): not checked",
                               self.rank, iteration, exp.n)
        self._begin(iteration + 1)

    def snapshot_extras(self, iteration: int) -> dict[str, Any] | None:
        """What the snapshot of ``iteration`` carries (:data:`SNAPSHOT_KEY`), None when its input was not seen."""
        cur = self.inflight
        if cur is None or cur.step != iteration:
            return None
        return _extras(cur)

    def failure_extras(self) -> dict[str, Any] | None:
        """What a failure event records: the in-flight step, its fingerprint, micro-batches and sample sum (None:
        none observed)."""
        cur = self.inflight
        return None if cur is None else _extras(cur)

    def close(self) -> None:
        if self.record is not None:
            self.record.close()


def _extras(m: InputMark) -> dict[str, Any]:
    return {"step": m.step, "fp": _hex(m.fp), "n": m.n, "sum": _hex(m.total)}


def parse_input(value: Any) -> tuple[int, int] | None:
    """``{"step": i, "fp": hex, ...}`` (a snapshot's or a failure event's) -> (i, fingerprint); None when absent or
    malformed."""
    try:
        return int(value["step"]), int(str(value["fp"]), 16)
    except (TypeError, KeyError, ValueError):
        return None


def parse_mark(value: Any) -> InputMark | None:
    """Like :func:`parse_input`, with the micro-batch count and sample sum where recorded (0 where not)."""
    head = parse_input(value)
    if head is None:
        return None
    try:
        return InputMark(head[0], head[1], int(value.get("n", 0)), int(str(value.get("sum", "0")), 16))
    except (TypeError, ValueError, AttributeError):
        return InputMark(head[0], head[1])
