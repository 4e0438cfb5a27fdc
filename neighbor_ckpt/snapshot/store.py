"""Host store: the slot files of one rank (own snapshots, replicas of its ring predecessor, lazy backups), where
they live, and the slot a replaced rank prepares before its recovery pulls into it.

Directory: ``<root>/<user>/<job_id>/rank<r>/`` (mode 0700), files mode 0600, so snapshots are private to
the user and namespaced per job. One file's format is :mod:`neighbor_ckpt.snapshot.slot`'s (import its names from
there).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from neighbor_ckpt.config import effective_user
from neighbor_ckpt.errors import ConfigError, HostMemoryError, SnapshotCorruptError, SnapshotMismatchError, TransportError
from neighbor_ckpt.runtime.private_files import make_private_dirs
from neighbor_ckpt.snapshot.slot import HEADER_ALLOWANCE_BYTES, MIN_EXTRAS_BYTES, SlotFile, SlotHeader, slot_file_size
from neighbor_ckpt.snapshot.userdir import private_user_dir

logger = logging.getLogger(__name__)

__all__ = ["HostStore", "SlotRef", "store_bytes_per_rank", "rank_dir", "generation_dir", "store_generations",
           "remove_generations", "pick_slot_for_write", "encode_meta", "PreparedSlot", "stage_own_slot",
           "take_staged_slot", "discard_staged_slot", "discard_staged_slots", "staged_slot_files", "remove_staged_slots",
           "sweep_staged_slots",
           "STAGED_PREFIX", "ROLE_OWN", "ROLE_REPLICA", "ROLE_LAZY", "COMMIT_TIME_KEY"]

COMMIT_TIME_KEY = "committed_unix"
"""Header ``meta`` key of a slot's commit time (wall clock): where a recovery timeline starts."""

STAGED_PREFIX = "staged-"
"""A staged slot is ``<job dir>/staged-<pid>.own.slot`` (:func:`stage_own_slot`): ``<pid>`` is its process's."""


ROLE_OWN = "own"
ROLE_REPLICA = "replica"
ROLE_LAZY = "lazy"


def store_bytes_per_rank(*, unique_bytes: int, lazy_bytes: int, versions: int, extras_bytes: int | None) -> int:
    """Host bytes of one rank's store: ``versions`` x (own + replica) slots, plus one lazy-backup slot if needed.

    The one formula for a store's footprint: the preflight checks it against ``/dev/shm`` and ``MemAvailable``,
    the planner prints it per rank and node."""
    extras = max(MIN_EXTRAS_BYTES, extras_bytes or 0)
    slot = slot_file_size(HEADER_ALLOWANCE_BYTES, unique_bytes, extras)
    lazy = slot_file_size(HEADER_ALLOWANCE_BYTES, lazy_bytes, extras) if lazy_bytes else 0
    return 2 * versions * slot + lazy


@dataclass(frozen=True)
class SlotRef:
    """A committed slot found by :meth:`HostStore.inventory`."""

    role: str
    index: int
    header: SlotHeader


def _user() -> str:
    """This process's user name (its passwd entry, not ``$USER``): the name of its directory under the root."""
    return effective_user()


GENERATION_PREFIX = "g"
"""Generation ``k >= 1`` of a job's store lives in ``<job dir>/g<k>/``; generation 0 is the job directory itself."""


def generation_dir(root: Path, job_id: str, generation: int = 0) -> Path:
    """Directory of one generation of a job's store: ``<root>/<user>/<job_id>`` (generation 0), or its ``g<k>``
    subdirectory. A new generation begins when the data-parallel layout changes (an elastic reshard: every rank's
    number and shard may change, so the previous layout's slots stay apart until the new one is complete)."""
    if not job_id or "/" in job_id or "\0" in job_id or job_id in (".", ".."):
        raise ConfigError(f"neighbor_ckpt.job_id {job_id!r} cannot name a directory of the host store (it is empty, "
                          f"'.' or '..', or holds '/' or NUL): choose another job id")
    d = Path(root) / _user() / job_id
    return d if generation == 0 else d / f"{GENERATION_PREFIX}{generation}"


def rank_dir(root: Path, job_id: str, rank: int, generation: int = 0) -> Path:
    """Directory of one rank's slot files: ``<root>/<user>/<job_id>/rank<rank>`` (generation 0), or under the
    generation's subdirectory."""
    return generation_dir(root, job_id, generation) / f"rank{rank}"


def store_generations(root: Path, job_id: str) -> list[int]:
    """The generations of a job's store present under ``root`` (on this node), oldest first."""
    job = generation_dir(root, job_id)
    if not job.is_dir():
        return []
    out = [0] if any(p.is_dir() for p in job.glob("rank*")) else []
    for p in job.glob(f"{GENERATION_PREFIX}*"):
        num = p.name[len(GENERATION_PREFIX):]
        if p.is_dir() and num.isdigit() and int(num) > 0:
            out.append(int(num))
    return sorted(out)


def remove_generations(root: Path, job_id: str, *, below: int) -> list[Path]:
    """Delete this node's slot files of every generation of the job older than ``below`` (the previous layouts'
    snapshots, once the current layout has a complete version); returns what was removed. Several ranks of a node may
    call it at once."""
    removed: list[Path] = []
    for gen in store_generations(root, job_id):
        if gen >= below:
            continue
        targets = sorted(generation_dir(root, job_id).glob("rank*")) if gen == 0 else \
            [generation_dir(root, job_id, gen)]
        for d in targets:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class HostStore:
    """The slot files of one rank: ``versions`` own slots, ``versions`` replica slots, lazy backups.

    Args:
        root: store root (``StoreConfig.dir`` after the env override).
        job_id: job namespace.
        rank: global rank of this process.
        versions: slots per role.
        use_checksum: compute / verify xxh3 checksums.
        generation: the store generation (:func:`generation_dir`; 0 unless the data-parallel layout changed).
    """

    def __init__(self, root: Path, *, job_id: str, rank: int, versions: int = 2, use_checksum: bool = True,
                 generation: int = 0) -> None:
        self.root = Path(root)
        self.job_id = job_id
        self.rank = rank
        self.versions = versions
        self.use_checksum = use_checksum
        self.generation = generation
        self.user_dir = self.root / _user()
        """``<root>/<user>``: every job of this user on this node."""
        self.job_dir = generation_dir(self.root, job_id)
        """``<root>/<user>/<job_id>``: this job's store, every generation."""
        self.gen_dir = generation_dir(self.root, job_id, generation)
        """This generation's directory (the job directory for generation 0)."""
        self.dir = rank_dir(self.root, job_id, rank, generation)
        private_user_dir(self.root, self.user_dir.name)  # no link, this user's, 0700 (snapshot/userdir.py)
        # Made and checked relative to the user directory, one name at a time (runtime/private_files.py).
        make_private_dirs(self.dir)
        self.pull_bounds: dict[str, tuple[int, int, int]] = {}
        """Per role, the largest capacities (header, payload, extras) a slot pulled from a peer may ask for: what the
        slot's owner published (:class:`~neighbor_ckpt.runtime.launch_store.SlotCapacities`). A role without one
        is bounded by the filesystem's free space only (:meth:`preflight`)."""
        self._slots: dict[tuple[str, int], SlotFile] = {}
        self._prefault: PreparedSlot | None = None
        self._prefault_lock = threading.Lock()
        self.prepared: PreparedSlot | None = None
        """The slot :meth:`prefault` prepared, once taken in (its time, and whether a write used it)."""

    # -- files ---------------------------------------------------------------------------------------

    def path(self, role: str, index: int) -> Path:
        return self.dir / f"{role}.{index}.slot"

    def slot(self, role: str, index: int) -> SlotFile | None:
        """The mapped slot file, or None if absent / unreadable (unreadable files are reported). A slot still being
        prepared by :meth:`prefault` is absent (it holds nothing yet); :meth:`ensure` waits for it."""
        key = (role, index)
        pf = self._prefault
        if pf is not None and pf.key == key:
            if pf.thread.is_alive():
                return None
            self.wait_prepared()
        if key in self._slots:
            return self._slots[key]
        p = self.path(role, index)
        if not os.path.lexists(p):
            return None
        try:
            s = SlotFile.open(p)  # a link or another user's file: StoreDirError, nothing read
        except (SnapshotCorruptError, SnapshotMismatchError) as e:
            logger.warning("rank %d: ignoring unusable slot file: %s", self.rank, e)
            return None
        self._slots[key] = s
        return s

    def ensure(self, role: str, index: int, *, header_cap: int, payload_cap: int, extras_cap: int) -> SlotFile:
        """The slot file with at least these capacities, (re)created if needed (a slot :meth:`prefault` is preparing
        is waited for, and used when its capacities are these)."""
        pf = self._prefault
        if pf is not None and pf.key == (role, index):
            self.wait_prepared()
        s = self.slot(role, index)
        if s is not None and s.capacities == (header_cap, payload_cap, extras_cap):
            if self.prepared is not None and s is self.prepared.slot:
                self.prepared.used = True
            return s
        if s is not None:
            s.close()
            del self._slots[(role, index)]
        self.preflight(slot_file_size(header_cap, payload_cap, extras_cap))
        s = SlotFile.create(self.path(role, index), header_cap=header_cap, payload_cap=payload_cap,
                            extras_cap=extras_cap)
        self._slots[(role, index)] = s
        return s

    def ensure_pulled(self, role: str, index: int, *, header_cap: int, payload_cap: int, extras_cap: int,
                      src: int) -> SlotFile:
        """:meth:`ensure` for an image a peer announced (its capacities came over the network): refused with
        :class:`~neighbor_ckpt.errors.TransportError`, before anything is allocated, when they exceed what the
        slot's owner published for ``role`` (:attr:`pull_bounds`)."""
        bound = self.pull_bounds.get(role)
        caps = (header_cap, payload_cap, extras_cap)
        if bound is not None and any(c > b for c, b in zip(caps, bound)):
            raise TransportError(
                f"rank {self.rank}: rank {src} announced a {role} image of capacities {caps} (header, payload, "
                f"extras bytes), larger than the {bound} its owner published: refused before allocating it")
        return self.ensure(role, index, header_cap=header_cap, payload_cap=payload_cap, extras_cap=extras_cap)

    def prefault(self, role: str, *, header_cap: int, payload_cap: int, extras_cap: int) -> bool:
        """Prepare the slot the first write of ``role`` lands in, in a background thread: create it with these
        capacities and fault in every page (:meth:`SlotFile.fault_in`), so that the bytes a restore pulls into it
        land in memory that is already there, as they do in a raw transfer into a pre-allocated buffer. For a rank
        whose store is empty (a replaced node or a hot spare), started while the rest of the job still gets ready;
        the pull of :meth:`~neighbor_ckpt.snapshot.transport.NeighborTransport.pull_image` then waits for it in :meth:`ensure`.

        Only when ``role`` has no slot file yet and nothing else is being prepared; returns whether it started.
        Best effort: a failure (e.g. ``/dev/shm`` full) is logged and the slot is made when it is needed, where
        the same failure is a :class:`HostMemoryError`."""
        if self._prefault is not None or self.has_files(role):
            return False
        caps = (header_cap, payload_cap, extras_cap)
        staged = take_staged_slot(self.root, self.job_id)
        if staged is not None:
            if role == ROLE_OWN:
                # moved into this store's directory and cut to these capacities by wait_prepared
                staged.key, staged.target, staged.capacities = (role, 0), self.path(role, 0), caps
                self._prefault = staged
                return True
            discard_staged_slot(staged)
        pf = PreparedSlot((role, 0), caps, self.path(role, 0))
        pf.thread = threading.Thread(target=pf.run, name=f"neighbor-ckpt-prefault-{role}", daemon=True)
        self._prefault = pf
        pf.thread.start()
        return True

    @property
    def preparing(self) -> PreparedSlot | None:
        """The slot :meth:`prefault` is preparing, until a store user waits for it (:meth:`wait_prepared`)."""
        return self._prefault

    def has_files(self, role: str) -> bool:
        """Whether any slot file of ``role`` exists (committed or not)."""
        return any(os.path.lexists(self.path(role, i)) for i in range(self.versions))

    def wait_prepared(self) -> PreparedSlot | None:
        """Wait for the slot :meth:`prefault` prepares and take it into this store (once, whichever thread asks);
        returns :attr:`prepared` (None: nothing was prepared)."""
        with self._prefault_lock:
            pf = self._prefault
            if pf is None:
                return self.prepared
            t0 = time.perf_counter()
            pf.thread.join()
            pf.waited = time.perf_counter() - t0
            self._prefault = None
            self.prepared = pf
            if pf.slot is not None and pf.target is not None and pf.target != pf.path:
                h, p, e = pf.capacities
                pf.slot.close()  # a staged slot: nobody wrote to it, its pages are in memory
                try:
                    pf.slot = SlotFile.reshape(pf.path, pf.target, header_cap=h, payload_cap=p, extras_cap=e)
                    pf.path = pf.target
                except (OSError, HostMemoryError) as exc:
                    logger.warning("rank %d: could not take the staged slot into %s (%s); it is made when needed",
                                   self.rank, pf.target, exc)
                    Path(pf.path).unlink(missing_ok=True)
                    pf.slot, pf.error = None, exc
            if pf.slot is not None:
                self._slots[pf.key] = pf.slot
                logger.debug("rank %d: %s slot %d prepared in advance in %.3f s (waited %.3f s for it)", self.rank,
                             *pf.key, pf.seconds, pf.waited)
            else:
                logger.warning("rank %d: preparing the %s slot in advance failed (%s); it is made when needed",
                               self.rank, pf.key[0], pf.error)
            return pf

    def preflight(self, nbytes: int) -> None:
        """Raise :class:`HostMemoryError` if ``nbytes`` more do not fit in the store's filesystem."""
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize
        if nbytes > free:
            raise HostMemoryError(
                f"rank {self.rank}: the host store needs {nbytes / 2**20:.1f} MiB more in {self.dir} but only "
                f"{free / 2**20:.1f} MiB are free. Free shared memory (e.g. remove old jobs under "
                f"{self.root}), enlarge /dev/shm, or point NEIGHBOR_CKPT_STORE_DIR at a larger tmpfs.")

    def commit_image(self, slot: SlotFile, role: str, *, iteration: int, layout: str, payload_nbytes: int,
                     extras_text: str, extras_tensors: list[torch.Tensor], meta: dict[str, Any],
                     meta_text: str | None = None) -> SlotHeader:
        """Seal an image of this rank whose payload is already in ``slot`` (invalidated before it was written): write
        the small state, checksum payload and extras (if this store checksums), write the header, then the commit
        marker. The one place a header is built: the engine's background thread and its synchronous
        :func:`~neighbor_ckpt.snapshot.engine.write_image` both end here.

        The header's ``meta`` is ``meta`` plus ``committed_unix``, the wall-clock time of the commit (where a
        recovery timeline starts, :data:`COMMIT_TIME_KEY`). ``meta_text``: ``encode_meta(meta)``, encoded once by a
        caller that commits the same ``meta`` again and again (the engine): only the commit time is added to it."""
        jn, metas, en = slot.write_extras(extras_text, extras_tensors)
        psum, esum = slot.checksums(payload_nbytes, en) if self.use_checksum else (None, None)
        now = time.time()
        hdr = SlotHeader(job_id=self.job_id, owner_rank=self.rank, layout=layout, iteration=iteration, role=role,
                         payload_nbytes=payload_nbytes, payload_xxh3=psum, extras_json_nbytes=jn,
                         extras_tensors=metas, extras_nbytes=en, extras_xxh3=esum,
                         meta={**meta, COMMIT_TIME_KEY: now})
        if meta_text is not None:
            stamp = f'"{COMMIT_TIME_KEY}":{json.dumps(now)}'
            meta_text = meta_text[:-1] + ("," if len(meta_text) > 2 else "") + stamp + "}"
        slot.commit(hdr, meta_text)
        return hdr

    # -- inventory -----------------------------------------------------------------------------------------

    def committed(self, role: str, *, verify: bool, rejected: dict[int, str] | None = None) -> Iterator[SlotRef]:
        """Committed slots of ``role`` in this store (job id checked; checksums if ``verify``).

        Slots that fail a check are logged and skipped; if ``rejected`` is given, the iteration of each
        rejected slot whose header was readable is recorded there with the reason.
        """
        for i in range(self.versions):
            s = self.slot(role, i)
            if s is None:
                continue
            hdr = None
            try:
                hdr = s.read_header()
                if hdr.job_id != self.job_id:
                    raise SnapshotMismatchError(
                        f"{s.path}: snapshot of job {hdr.job_id!r}, this is job {self.job_id!r}")
                if verify and self.use_checksum:
                    s.verify(hdr)
            except (SnapshotCorruptError, SnapshotMismatchError) as e:
                logger.warning("rank %d: %s slot %d is not usable: %s", self.rank, role, i, e)
                if rejected is not None and hdr is not None:
                    rejected[hdr.iteration] = str(e).rsplit(": ", 1)[-1]
                continue
            yield SlotRef(role, i, hdr)

    def slot_for_write(self, role: str, keep: set[int] | None = None) -> int:
        """Index of the slot to overwrite next: an uncommitted one, else the oldest iteration."""
        return pick_slot_for_write(self.committed_iterations(role), role=role, keep=keep)

    def committed_iterations(self, role: str) -> list[int | None]:
        """Per slot index of ``role``: the iteration its header says it holds, None if absent or not committed.
        Reads (and checks) every header: a writer that owns the role's slots reads this once and keeps it up to
        date itself (the engine, :func:`pick_slot_for_write`)."""
        out: list[int | None] = []
        for i in range(self.versions):
            s = self.slot(role, i)
            try:
                out.append(None if s is None else s.read_header().iteration)
            except (SnapshotCorruptError, SnapshotMismatchError):
                out.append(None)
        return out

    def invalidate_after(self, role: str, iteration: int | None) -> None:
        """Invalidate every committed slot of ``role`` newer than ``iteration`` (None: all of them)."""
        for i in range(self.versions):
            s = self.slot(role, i)
            if s is None:
                continue
            try:
                it = s.read_header().iteration
            except (SnapshotCorruptError, SnapshotMismatchError):
                continue
            if iteration is None or it > iteration:
                s.invalidate()

    def close(self) -> None:
        self.wait_prepared()
        for s in self._slots.values():
            s.close()
        self._slots.clear()

    def destroy(self) -> None:
        """Close and delete this rank's files (the generation's and the job's directories go when they are empty)."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        for d in dict.fromkeys((self.gen_dir, self.job_dir)):
            try:
                d.rmdir()
            except OSError:
                pass

    def host_bytes(self) -> int:
        """Bytes of all slot files of this rank."""
        return sum(p.stat().st_size for p in self.dir.glob("*.slot"))


@dataclass(eq=False)
class PreparedSlot:
    """A slot :meth:`HostStore.prefault` prepares in its thread (the results are read after the join)."""

    key: tuple[str, int]
    capacities: tuple[int, int, int]
    path: Path
    thread: threading.Thread = field(init=False)
    slot: SlotFile | None = None
    error: BaseException | None = None
    seconds: float = 0.0
    """How long creating and faulting in took (in the background)."""
    used: bool = False
    """A write (a pull, the engine's first snapshot) landed in this slot."""
    waited: float = 0.0
    """How long the first one to need the slot (the recovery's pull) waited for the preparation to end (0: ready)."""
    target: Path | None = None
    """Where the slot file moves when a store takes it in (a slot staged by :func:`stage_own_slot`), else None."""
    staged: bool = False
    """Prepared by :func:`stage_own_slot`, before this process had its store (a hot spare while it idled, a replaced
    rank before it built its model)."""
    staged_when: str = ""
    """When it was staged, in words (for the recovery's note)."""

    def run(self) -> None:
        t0 = time.perf_counter()
        h, p, e = self.capacities
        try:
            slot = SlotFile.create(self.path, header_cap=h, payload_cap=p, extras_cap=e)
            slot.fault_in()
            self.slot = slot
        except Exception as exc:  # noqa: BLE001 - best effort: reported by wait_prepared, made again when needed
            self.error = exc
            self.path.unlink(missing_ok=True)
        self.seconds = time.perf_counter() - t0


_staged_lock = threading.Lock()
_staged: dict[tuple[str, str], PreparedSlot] = {}
"""Slots :func:`stage_own_slot` prepared in this process, by (store root, job id), until a store takes one."""


def stage_own_slot(root: Path, job_id: str, *, header_cap: int, payload_cap: int, extras_cap: int,
                   when: str = "while this hot spare idled") -> bool:
    """Prepare an own slot before this process knows its rank (a hot spare while it idles): create it with these
    capacities (the largest any rank needs) in the job's directory and fault in every page, in a background thread.
    The first :class:`HostStore` of this root and job whose :meth:`~HostStore.prefault` asks for an own slot takes
    it: moved into its rank directory and cut to the capacities asked (:meth:`SlotFile.reshape`; the pages it keeps
    stay in memory). This process's exit deletes it if nobody took it, and so does :func:`discard_staged_slots`.
    ``when``: for the recovery's note. Returns whether it started (once per root and job; best effort, as
    :meth:`HostStore.prefault`)."""
    import atexit

    root = Path(root)
    key = (str(root.resolve()), job_id)
    with _staged_lock:
        if key in _staged:
            return False
        try:
            private_user_dir(root, _user())
            job_dir = generation_dir(root, job_id)
            make_private_dirs(job_dir)
            need = slot_file_size(header_cap, payload_cap, extras_cap)
            st = os.statvfs(job_dir)
            if need > st.f_bavail * st.f_frsize:
                logger.info("neighbor_ckpt: no room to stage a %.1f MiB own slot in %s; it is made when needed",
                            need / 2**20, job_dir)
                return False
        except OSError as e:
            logger.info("neighbor_ckpt: cannot stage an own slot under %s: %s", root, e)
            return False
        pf = PreparedSlot((ROLE_OWN, 0), (header_cap, payload_cap, extras_cap),
                          job_dir / f"{STAGED_PREFIX}{os.getpid()}.{ROLE_OWN}.slot", staged=True, staged_when=when)
        pf.thread = threading.Thread(target=pf.run, name="neighbor-ckpt-prefault-staged", daemon=True)
        if not _staged:
            atexit.register(discard_staged_slots)
        _staged[key] = pf
        pf.thread.start()
    logger.info("neighbor_ckpt: preparing a %.1f MiB own slot %s", payload_cap / 2**20, when)
    return True


def take_staged_slot(root: Path, job_id: str) -> PreparedSlot | None:
    """The slot :func:`stage_own_slot` prepared for this root and job, removed from the registry (None: none)."""
    with _staged_lock:
        return _staged.pop((str(Path(root).resolve()), job_id), None)


def discard_staged_slot(pf: PreparedSlot) -> None:
    """Wait for a staged slot's preparation, then close and delete it."""
    pf.thread.join()
    if pf.slot is not None:
        pf.slot.close()
    Path(pf.path).unlink(missing_ok=True)


def discard_staged_slots() -> int:
    """Delete every slot this process staged that no store took (a store root or job other than the staging
    guessed); returns how many. The checkpointer calls it once its store has had its chance."""
    with _staged_lock:
        pending = list(_staged.values())
        _staged.clear()
    for pf in pending:
        logger.info("neighbor_ckpt: a slot staged %s was not taken (another store root or job, or nobody): deleted",
                    pf.staged_when)
        discard_staged_slot(pf)
    return len(pending)


def staged_slot_files(root: Path, pids: Sequence[int] | None = None) -> list[Path]:
    """The staged slots of this user's jobs under ``root`` on this node (:func:`stage_own_slot`), of the processes
    ``pids`` (None: of every process)."""
    udir = Path(root) / _user()
    prefixes = None if pids is None else tuple(f"{STAGED_PREFIX}{int(p)}." for p in pids)
    out = []
    for p in udir.glob(f"*/{STAGED_PREFIX}*.slot*"):  # .slot.tmp: killed while it was being made
        if prefixes is None or p.name.startswith(prefixes):
            out.append(p)
    return sorted(out)


def sweep_staged_slots(root: Path) -> list[Path]:
    """Delete the staged slots under ``root`` whose process is gone (its launcher was SIGKILLed or cut off before it
    could drop them: a node's launcher sweeps at its start); returns what was removed. A slot of a live process
    (another launch's idle spare on this node) is left alone. Never raises."""
    dead = set()
    for p in staged_slot_files(root):
        try:
            pid = int(p.name[len(STAGED_PREFIX):].split(".", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead.add(pid)
        except PermissionError:
            pass  # alive, another user's pid number: not ours to judge
    return remove_staged_slots(root, sorted(dead)) if dead else []


def remove_staged_slots(root: Path, pids: Sequence[int]) -> list[Path]:
    """Delete the staged slots of the processes ``pids`` under ``root`` (a hot spare SIGKILLed or stopped before it
    ran its own clean-up: its launcher calls this); returns what was removed. Never raises."""
    removed = []
    for p in staged_slot_files(root, pids):
        try:
            p.unlink()
            removed.append(p)
        except OSError as e:
            logger.warning("neighbor_ckpt: could not remove the staged slot %s: %s", p, e)
    return removed


def pick_slot_for_write(iterations: Sequence[int | None], *, role: str = "", keep: set[int] | None = None) -> int:
    """The slot to overwrite next, given each slot's committed iteration (None: absent or uncommitted): the first
    uncommitted one, else the oldest iteration not in ``keep``."""
    best, best_iter = None, None
    for i, it in enumerate(iterations):
        if it is None:
            return i
        if keep and it in keep:
            continue
        if best_iter is None or it < best_iter:
            best, best_iter = i, it
    if best is None:
        raise ValueError(f"every {role} slot holds an iteration in {sorted(keep or ())}; nothing may be overwritten")
    return best


def encode_meta(meta: dict[str, Any]) -> str:
    """A header ``meta`` as the JSON text :meth:`HostStore.commit_image` takes (``meta_text``)."""
    return json.dumps(meta, separators=(",", ":"))


def np_view(t: torch.Tensor) -> np.ndarray:
    """Byte view of a CPU tensor (helper for tests and tools)."""
    return t.view(-1).view(torch.uint8).numpy()
