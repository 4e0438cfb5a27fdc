"""The data-position check: after a recovery, the replayed step must see the input it saw before the failure.

A restore brings back the model, optimizer, RNG and counters, but the loader is the training script's: a loader whose
position was not restored (a ``DataLoader(shuffle=True)`` whose iterator is created after ``recover()`` restored the
global RNG draws another shuffle seed; a sampler restarted at the beginning of its epoch) feeds other batches, and
every loss after the restart differs from the run without failure, silently. This module notices it at the first
replayed step.

**Fingerprint.** :func:`fingerprint` is the xxh3-64 of the bytes of a step's input token ids (the first micro-batch
of the step: :func:`token_tensor` finds the ids in a batch; a 16 KiB sample of larger ones). A few microseconds per
step (``scripts/bench``).

**Where fingerprints live, so that they survive a restart of every rank** (torchrun's restart kills the survivors
too; their host store survives on their node):

* the *input record* (:class:`InputRecord`, :data:`RECORD_FILE` in the rank's store directory): a 1.5 KiB file,
  memory-mapped, holding the fingerprints of the last :data:`RING` steps, one 24-byte entry per step (step,
  fingerprint, check word) written with one store to the mapping as soon as the step's first micro-batch is seen. It
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
(in-memory or insurance), the fingerprint of step ``k + 1``'s first micro-batch is compared with the one recorded
before the failure (:func:`compare`). ``error``: a mismatch raises :class:`~neighbor_ckpt.errors.DataPositionError`
before the step trains, and leaves a marker (:data:`STOPPED_FILE`) so the launcher's further restarts of the same
launch stop at once with the same message instead of walking back through older versions; ``warn``: logged, training
goes on; ``off``: nothing is computed or written.

May import: :mod:`neighbor_ckpt.errors`, :mod:`neighbor_ckpt.runtime` (layer rule of :mod:`neighbor_ckpt.recovery`).
"""

from __future__ import annotations

import ctypes
import enum
import json
import logging
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import xxhash

from neighbor_ckpt.errors import DataPositionError
from neighbor_ckpt.runtime.atomic_json import write_atomic_json

logger = logging.getLogger(__name__)

__all__ = ["RECORD_FILE", "STOPPED_FILE", "SNAPSHOT_KEY", "RING", "TOKEN_KEYS", "fingerprint", "token_tensor",
           "InputRecord", "Verdict", "compare", "mismatch_message", "parse_input", "DataCheck", "ObservedIterator"]

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

_ENTRY = struct.Struct("<qQQ")
_MASK = (1 << 64) - 1
_MAGIC = 0x6E636B70_74646174  # "nckptdat"
_GOLDEN = 0x9E3779B9_7F4A7C15


def _check_word(step: int, fp: int) -> int:
    return ((step * _GOLDEN) ^ fp ^ _MAGIC) & _MASK


SAMPLE_BYTES = 16 * 1024
"""Token ids up to this size are hashed whole; larger ones by :data:`SAMPLE_WINDOWS` windows that together are this
size, spread evenly from the first byte to the last, and their total size. Another batch differs in every window (a
shuffled or shifted data position changes the ids throughout), and the cost stays a few microseconds whatever the
micro-batch size (a whole 8 x 8192-token batch would take ~30 us, the 1% budget of ``snapshot()`` is ~10 us)."""
SAMPLE_WINDOWS = 4


def fingerprint(tokens: torch.Tensor) -> int:
    """xxh3-64 of the tensor's bytes (its dtype's element size included, its shape not), sampled beyond
    :data:`SAMPLE_BYTES`. A CUDA tensor is copied to host memory first (a device synchronization: fingerprint the
    host batch, before ``.cuda()``, where you can)."""
    if tokens.is_cpu and tokens.is_contiguous():
        # Host token ids (what a loader yields): hashed in place through ctypes views of their memory (the tensor is
        # alive for the call). No numpy view and no copy: the fewest Python-level calls at the start of a step, which
        # is where this runs (BENCHMARKS, "Data-position check").
        return _hash_sampled(tokens.data_ptr(), tokens.numel() * tokens.element_size())
    t = tokens.detach()  # on a device, or a strided view: the bytes of its contiguous host copy
    host = (t if t.is_cpu else t.cpu()).contiguous()
    return _hash_sampled(host.data_ptr(), host.numel() * host.element_size())


def _hash_sampled(address: int, nbytes: int) -> int:
    """xxh3-64 of ``nbytes`` at ``address``: whole up to :data:`SAMPLE_BYTES`, else :data:`SAMPLE_WINDOWS` windows
    spread from the first byte to the last, seeded with the size."""
    if nbytes <= SAMPLE_BYTES:
        return xxhash.xxh3_64_intdigest((ctypes.c_char * nbytes).from_address(address) if nbytes else b"")
    window = SAMPLE_BYTES // SAMPLE_WINDOWS
    h = xxhash.xxh3_64(seed=nbytes)
    for i in range(SAMPLE_WINDOWS):
        h.update((ctypes.c_char * window).from_address(address + (nbytes - window) * i // (SAMPLE_WINDOWS - 1)))
    return h.intdigest()


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
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # a foreign size: start empty (zeros fail the check word)
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def put(self, step: int, fp: int) -> None:
        if self._map is not None:
            _ENTRY.pack_into(self._map, (step % RING) * _ENTRY.size, step, fp, _check_word(step, fp))

    def get(self, step: int) -> int | None:
        """The fingerprint recorded for ``step`` (None: never recorded, overwritten by a later step, or torn)."""
        if self._map is None or step < 0:
            return None
        s, fp, chk = _ENTRY.unpack_from(self._map, (step % RING) * _ENTRY.size)
        return fp if s == step and chk == _check_word(s, fp) else None

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


def mismatch_message(*, rank: int, step: int, expected: int, actual: int, source: str, restored: int | None) -> str:
    """What :class:`DataPositionError` (and the ``warn`` log line) says."""
    after = f"after the restore of iteration {restored}" if restored is not None else "after the recovery"
    return (f"rank {rank}: the data position was not restored: step {step}, replayed {after}, got other input than "
            f"before the failure (fingerprint of its first micro-batch {actual:016x}, recorded before the failure "
            f"{expected:016x}, from {source}). Training on would silently diverge from the run without the failure. "
            f"Resume the loader with the snapshot: put a torchdata StatefulDataLoader's state_dict() in snapshot()'s "
            f"user_state and load it after recover(), or build the sampler from result.next_step / the consumed "
            f"samples; give the loader and its sampler their own torch.Generator (DataLoader(shuffle=True) draws its "
            f"shuffle seed from the global RNG when its iterator is created, after recover() restored that RNG). "
            f"See README 'Data position in plain loops'. To train on anyway set neighbor_ckpt.data_check: warn.")


@dataclass(frozen=True)
class _Expectation:
    step: int
    fp: int
    source: str
    restored: int | None


def _hex(fp: int) -> str:
    return f"{fp:016x}"


class DataCheck:
    """The per-rank data-position check (see the module docstring).

    Args:
        mode: ``neighbor_ckpt.data_check`` (``error``, ``warn``, ``off``).
        store_dir: the rank's host-store directory (the input record and the marker go there).
        rank: for messages.
        attempt: the launcher's restart count (default ``TORCHELASTIC_RESTART_COUNT``; the marker stops restarts of
            the same launch only).

    The training thread calls :meth:`observe` for every micro-batch (only the first one of a step is fingerprinted)
    and :meth:`step_done` when the step's snapshot is taken; :meth:`arm` once after the recovery.
    """

    def __init__(self, mode: str, *, store_dir: Path, rank: int, attempt: int | None = None) -> None:
        self.mode = mode
        self.rank = rank
        self.attempt = attempt if attempt is not None else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.store_dir = Path(store_dir)
        self.record: InputRecord | None = InputRecord(self.store_dir / RECORD_FILE) if mode != "off" else None
        self._step = 0
        self._seen = False
        self._expect: _Expectation | None = None
        self.inflight: tuple[int, int] | None = None
        """(step, fingerprint) of the newest observed step (the in-flight one until its snapshot)."""
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
            data = json.loads(self.stopped_path.read_text())
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
            snapshot_input: Any = None, failure_input: tuple[int, int] | None = None) -> None:
        """After the recovery: the next step to be trained is ``next_step``. When something was restored, the input
        record's (or the failure event's) fingerprint of that step becomes the expectation for its first
        micro-batch; a fresh start empties the record (a new timeline).

        ``snapshot_input``: the restored snapshot's :data:`SNAPSHOT_KEY` extras (the input of the restored step);
        ``failure_input``: the (step, fingerprint) of this rank's failure event, if it had one."""
        self._step, self._seen, self._expect, self.inflight = next_step, False, None, None
        if self.record is None:
            return
        if not restored:
            self.record.clear()
            return
        source = "this rank's input record"
        expected = self.record.get(next_step)
        snap = parse_input(snapshot_input)
        if snap is not None and restored_iteration is not None and snap[0] == restored_iteration:
            mine = self.record.get(restored_iteration)
            if mine is not None and mine != snap[1]:
                logger.warning("rank %d: neighbor_ckpt data check: the input record is from another timeline (its "
                               "step %d differs from the restored snapshot's); not used", self.rank,
                               restored_iteration)
                expected = None
        if expected is None and failure_input is not None and failure_input[0] == next_step:
            expected, source = failure_input[1], "this rank's failure event"
        if expected is None:
            logger.info("rank %d: neighbor_ckpt data check: no input recorded for step %d on this rank (its store was "
                        "replaced, or the failure came before that step drew its input): not checked here",
                        self.rank, next_step)
            return
        self._expect = _Expectation(next_step, expected, source, restored_iteration)

    # -- per step ----------------------------------------------------------------------------------------

    def observe(self, batch: Any) -> None:
        """A micro-batch of the current step (a token tensor, or a batch :func:`token_tensor` understands): the
        first one of each step is fingerprinted, recorded, and after a recovery checked. Raises
        :class:`DataPositionError` (mode ``error``) before the mismatching step is recorded or trained."""
        if self._seen or self.record is None:
            return
        self._seen = True
        tokens = token_tensor(batch)
        if tokens is None:
            return
        step, fp = self._step, fingerprint(tokens)
        exp = self._expect
        if exp is not None and exp.step == step:
            self._expect = None
            self._judge(exp, fp)
        self.record.put(step, fp)
        self.inflight = (step, fp)

    def _judge(self, exp: _Expectation, fp: int) -> None:
        self.verdict = compare(exp.fp, fp)
        if self.verdict is Verdict.MATCH:
            logger.info("rank %d: neighbor_ckpt data check: step %d replays the input it had before the failure "
                        "(fingerprint %016x): data position verified", self.rank, exp.step, fp)
            return
        msg = mismatch_message(rank=self.rank, step=exp.step, expected=exp.fp, actual=fp, source=exp.source,
                               restored=exp.restored)
        if self.mode == "warn":
            logger.warning("neighbor_ckpt data check (data_check: warn, training goes on): %s", msg)
            return
        try:
            write_atomic_json(self.stopped_path, {"attempt": self.attempt, "step": exp.step, "message": msg})
        except OSError as e:
            logger.debug("rank %d: could not write %s: %s", self.rank, self.stopped_path, e)
        raise DataPositionError(msg, step=exp.step, rank=self.rank, expected=exp.fp, actual=fp)

    def step_done(self, iteration: int) -> None:
        """The snapshot of ``iteration`` is being taken: the next micro-batch belongs to ``iteration + 1``."""
        self._step, self._seen = iteration + 1, False

    def snapshot_extras(self, iteration: int) -> dict[str, Any] | None:
        """What the snapshot of ``iteration`` carries (:data:`SNAPSHOT_KEY`), None when its input was not seen."""
        cur = self.inflight
        if cur is None or cur[0] != iteration:
            return None
        return {"step": cur[0], "fp": _hex(cur[1])}

    def failure_extras(self) -> dict[str, Any] | None:
        """What a failure event records: the in-flight step and its fingerprint (None: none observed)."""
        cur = self.inflight
        return None if cur is None else {"step": cur[0], "fp": _hex(cur[1])}

    def close(self) -> None:
        if self.record is not None:
            self.record.close()


def parse_input(value: Any) -> tuple[int, int] | None:
    """``{"step": i, "fp": hex}`` (a snapshot's or a failure event's) -> (i, fingerprint); None when absent or
    malformed."""
    try:
        return int(value["step"]), int(str(value["fp"]), 16)
    except (TypeError, KeyError, ValueError):
        return None


class ObservedIterator:
    """Wraps a data iterator: every item goes to ``observe`` (e.g. :meth:`NeighborCheckpointer.observe_input`)
    before the training loop gets it. Attributes of the wrapped iterator are reachable through the wrapper."""

    def __init__(self, inner: Any, observe: Any) -> None:
        self.inner = inner
        self._it: Iterator[Any] = iter(inner)
        self._observe = observe

    def __iter__(self) -> ObservedIterator:
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        self._observe(item)
        return item

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "_it", "_observe"):
            raise AttributeError(name)
        return getattr(self.inner, name)
