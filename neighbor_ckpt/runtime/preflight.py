"""Host-memory preflight: before the first snapshot, check that the host store fits.

One rank's store (:func:`~neighbor_ckpt.snapshot.store.store_bytes_per_rank`, computed by the caller) holds ``versions`` own slots, ``versions`` replica slots (its predecessor's snapshots are the
same size under an even shard) and, when the plan has redundant state, room for one lazy backup. Every rank of
the node puts its store on the same memory-backed filesystem, so the node needs that times the ranks on it.
Slot files this job already holds there (a restart reuses them) do not count twice, nor do the slots its hot spares
staged there while they idled (``<job dir>/staged-<pid>.own.slot``: an activated spare's store takes one; the
launcher removes those of spares that exit).

The check compares with the free space of the store's filesystem (``statvfs``: the ``/dev/shm`` size limit)
and with the node's available memory (``MemAvailable``: tmpfs pages are RAM). The verdict is collective in
:class:`~neighbor_ckpt.checkpointer.NeighborCheckpointer`: if any rank fails, every rank raises
:class:`~neighbor_ckpt.errors.HostMemoryError` before anything is written, so nothing hangs half-allocated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from neighbor_ckpt.runtime.procs import mem_available_bytes

__all__ = ["HostMemoryCheck", "check_host_memory", "STAGED_GLOB"]


STAGED_GLOB = "staged-*.slot"
"""Staged spare slots in a job directory (``snapshot.store.STAGED_PREFIX``; runtime cannot import the store)."""


def _bytes(job_dir: Path, pattern: str) -> int:
    if not job_dir.is_dir():
        return 0
    return sum(p.lstat().st_size for p in job_dir.glob(pattern) if p.is_file() and not p.is_symlink())


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


@dataclass(frozen=True, kw_only=True, slots=True)
class HostMemoryCheck:
    """The numbers of one rank's preflight and its verdict."""

    need_per_rank: int
    """Bytes of this rank's store."""

    ranks_on_node: int
    """Ranks of this job on the node (``LOCAL_WORLD_SIZE``)."""

    existing: int
    """Bytes of this job's slot files already on the filesystem (reused on a restart), staged ones included."""

    staged: int = 0
    """Of :attr:`existing`: bytes of slots this job's hot spares staged on the node (:data:`STAGED_GLOB`)."""

    fs_path: str
    """The store's directory."""

    fs_free: int
    """Free bytes of its filesystem."""

    fs_total: int
    """Size of its filesystem."""

    mem_available: int | None
    """Node's ``MemAvailable`` (None: unknown)."""

    @property
    def need_on_node(self) -> int:
        """New bytes the node's stores still need."""
        return max(0, self.need_per_rank * self.ranks_on_node - self.existing)

    @property
    def ok(self) -> bool:
        fits_fs = self.need_on_node <= self.fs_free
        fits_mem = self.mem_available is None or self.need_on_node <= self.mem_available
        return fits_fs and fits_mem

    def message(self) -> str:
        """One line with the numbers and what to do."""
        mem = "unknown" if self.mem_available is None else _gb(self.mem_available)
        return (f"the host store needs {_gb(self.need_per_rank)} per rank x {self.ranks_on_node} ranks on this node "
                f"= {_gb(self.need_per_rank * self.ranks_on_node)} ({_gb(self.existing)} already allocated by this "
                f"job, {_gb(self.staged)} of it staged by hot spares), but {self.fs_path} has {_gb(self.fs_free)} "
                f"free of {_gb(self.fs_total)} and the node has "
                f"{mem} available. Give the store more room (docker --shm-size, a larger tmpfs for "
                f"neighbor_ckpt.store.dir), keep fewer versions (neighbor_ckpt.store.versions), or shard the optimizer "
                f"over more ranks")


def check_host_memory(store_dir: Path, job_dir: Path, *, need_per_rank: int, ranks_on_node: int | None = None,
                      mem_available: int | None | bool = True) -> HostMemoryCheck:
    """Measure and judge. ``ranks_on_node`` defaults to ``LOCAL_WORLD_SIZE`` (1 outside a launcher);
    ``mem_available=True`` asks the machine (:func:`~neighbor_ckpt.runtime.procs.mem_available_bytes`), a number or
    None is used as given (tests)."""
    path = Path(store_dir)
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    st = os.statvfs(probe)
    ranks = ranks_on_node if ranks_on_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    staged = _bytes(Path(job_dir), STAGED_GLOB)
    return HostMemoryCheck(need_per_rank=need_per_rank, ranks_on_node=ranks,
                           existing=_bytes(Path(job_dir), "rank*/*.slot") + staged, staged=staged,
                           fs_path=str(path), fs_free=st.f_bavail * st.f_frsize, fs_total=st.f_blocks * st.f_frsize,
                           mem_available=mem_available_bytes() if mem_available is True else
                           (None if mem_available is False else mem_available))
