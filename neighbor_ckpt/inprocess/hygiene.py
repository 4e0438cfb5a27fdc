"""Is a process clean enough to take part in the next generation after a failed one?

In-process recovery keeps a survivor's process alive through failures; what a failed generation leaves behind
(threads still running its code, memory its frames still hold, CUDA tensors) would otherwise pile up with every
failure, and a leaked thread may go on touching the old model or groups. So after the engine has finalised a failed
generation (aborted, unwound the training thread, destroyed the groups), it compares the process with the state it
had before generation 0; a process that is not clean exits with :data:`~neighbor_ckpt.inprocess.protocol.
EXIT_HYGIENE` and its launcher starts a fresh process in its place (which joins as a spare).

The checks (:func:`compare`, a pure function of two :class:`ProcessState` and the generation count):

* **Python threads**: the names of ``threading.enumerate()`` must equal the baseline's as a multiset, ignoring
  names that start with one of ``allowed_prefixes`` (the engine's own monitor and watchdog threads). Native threads
  (gloo's loops, OpenMP, NCCL's watchdog) are not compared: pools created lazily by the first step would always
  differ from a baseline taken before generation 0.
* **Resident memory** ("grows at most 50 MiB over five generations"): ``rss - baseline.rss <= rss_limit *
  max(1, generations_done / rss_window)``, with 50 MiB and 5 by default. Up to five failed generations the growth
  may reach 50 MiB in total, whenever it happens (allocator arenas, lazily imported modules and caches grow once,
  usually in the first generation); beyond, the allowance rises by ``rss_limit / rss_window`` (10 MiB) per
  generation, i.e. a steady leak of more than 10 MiB per failed generation fails after at most five of them.
* **CUDA memory** (where torch has initialised CUDA): ``torch.cuda.memory_allocated()`` of the current device back
  to at most the baseline's plus ``cuda_slack_bytes`` (0): tensors of a failed generation must all be freed. Read
  after dropping torch's cuBLAS/cuBLASLt workspaces (``torch._C._cuda_clearCublasWorkspaces()``, as torch's own
  CUDA leak check does): torch allocates one per (cuBLAS handle, stream) through its caching allocator at the first
  matmul and keeps it for the process's life, so they count in ``memory_allocated()`` though no generation owns
  them. Measured on an H100 (torch 2.11, ``tools/gpu_probe/cuda_leak.py``): after a failed generation of a small MLP,
  65 MiB stayed allocated with no CUDA tensor left anywhere: a 32 MiB cuBLAS workspace of the forward on the training
  thread, another of the backward on autograd's device thread and the 1 MiB cuBLASLt workspace; the same 65 MiB
  after every generation (no growth), and none once they are cleared. The next matmul allocates its workspace again
  from the allocator's cached blocks.

Usage::

    baseline = HygieneBaseline.capture()                       # before generation 0
    ...a generation fails, is aborted and finalised (groups destroyed)...
    result = check(baseline, generations_done=failed_so_far, allowed_prefixes=("neighbor_ckpt-",))
    if not result.ok:
        logger.error("%s", result.summary()); sys.exit(EXIT_HYGIENE)
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

__all__ = ["ProcessState", "HygieneBaseline", "HygieneResult", "HygieneGuard", "compare", "check", "RSS_LIMIT_BYTES",
           "RSS_WINDOW_GENERATIONS", "rss_allowance"]

logger = logging.getLogger(__name__)

MiB = 1 << 20
RSS_LIMIT_BYTES = 50 * MiB
"""How much resident memory may grow over :data:`RSS_WINDOW_GENERATIONS` failed generations."""
RSS_WINDOW_GENERATIONS = 5


def _rss_bytes() -> int:
    """Resident memory less what malloc holds free in its arenas (glibc's ``mallinfo2().fordblks``): freed tensors of
    a failed generation can stay resident there (malloc's mmap threshold rises after large frees), which would read as
    a leak the size of the model although the next generation reuses that memory. Not ``malloc_trim``: handing it
    back costs the next generation's first step its page faults (measured: +70 ms on the tiny GPT's first step)."""
    import psutil

    return max(0, int(psutil.Process().memory_info().rss) - _malloc_free_bytes())


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_free_bytes() -> int:
    """Free bytes malloc keeps in its arenas (0 where that is not glibc >= 2.33)."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0
    fn.restype = _MallInfo2
    return int(fn().fordblks)


def _clear_library_workspaces(torch: object) -> None:
    """Free torch's cuBLAS/cuBLASLt workspaces (process-lifetime caches of the CUDA libraries, allocated through
    the caching allocator, see the module docstring). Best effort: a torch without the binding keeps them."""
    clear = getattr(getattr(torch, "_C", None), "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return
    try:
        clear()
    except Exception as e:  # noqa: BLE001 - the measurement then includes them, as before
        logger.debug("could not clear the cuBLAS workspaces: %s", e)


def _cuda_allocated() -> int | None:
    """Bytes allocated by torch's caching allocator on the current device, or None where no CUDA is initialised
    (torch not imported, no device, or nothing touched it yet: then nothing can have leaked there either, and the
    check must not initialise a CUDA context). The CUDA libraries' workspaces are dropped first: they are no
    tensor of any generation."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    _clear_library_workspaces(torch)
    return int(torch.cuda.memory_allocated())


@dataclass(frozen=True)
class ProcessState:
    """What the checks compare: Python thread names (sorted, repeated names repeated), resident memory, CUDA memory
    allocated by torch (None without an initialised device)."""

    thread_names: tuple[str, ...]
    rss_bytes: int
    cuda_allocated_bytes: int | None

    @classmethod
    def capture(cls) -> ProcessState:
        return cls(tuple(sorted(t.name for t in threading.enumerate())), _rss_bytes(), _cuda_allocated())


HygieneBaseline = ProcessState
"""The state before generation 0: ``HygieneBaseline.capture()``."""


@dataclass(frozen=True)
class HygieneResult:
    """The verdict, with what differs (``problems``: one readable line each)."""

    extra_threads: tuple[str, ...]
    missing_threads: tuple[str, ...]
    rss_growth_bytes: int
    rss_allowed_bytes: int
    cuda_growth_bytes: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line for the log."""
        if self.ok:
            return (f"process clean (RSS +{self.rss_growth_bytes / MiB:.1f} MiB of "
                    f"{self.rss_allowed_bytes / MiB:.1f} MiB allowed)")
        return "process not clean after the failed generation: " + "; ".join(self.problems)


def _threads(names: Iterable[str], allowed_prefixes: tuple[str, ...]) -> Counter[str]:
    return Counter(n for n in names if not n.startswith(allowed_prefixes))


def rss_allowance(generations_done: int, *, rss_limit_bytes: int = RSS_LIMIT_BYTES,
                  rss_window: int = RSS_WINDOW_GENERATIONS) -> int:
    """How far resident memory may be above the baseline after ``generations_done`` failed generations (see the
    module docstring)."""
    return int(rss_limit_bytes * max(1.0, generations_done / rss_window))


def compare(baseline: ProcessState, now: ProcessState, *, generations_done: int,
            allowed_prefixes: Iterable[str] = (), rss_limit_bytes: int = RSS_LIMIT_BYTES,
            rss_window: int = RSS_WINDOW_GENERATIONS, cuda_slack_bytes: int = 0) -> HygieneResult:
    """The checks of the module docstring, on two captured states; pure."""
    if generations_done < 0 or rss_window < 1 or rss_limit_bytes < 0 or cuda_slack_bytes < 0:
        raise ValueError(f"generations_done, rss_limit_bytes, cuda_slack_bytes must be >= 0 and rss_window >= 1 "
                         f"(got {generations_done}, {rss_limit_bytes}, {cuda_slack_bytes}, {rss_window})")
    prefixes = tuple(allowed_prefixes)
    before, after = _threads(baseline.thread_names, prefixes), _threads(now.thread_names, prefixes)
    extra = tuple(sorted((after - before).elements()))
    missing = tuple(sorted((before - after).elements()))
    growth = now.rss_bytes - baseline.rss_bytes
    allowed = rss_allowance(generations_done, rss_limit_bytes=rss_limit_bytes, rss_window=rss_window)
    cuda_growth = (now.cuda_allocated_bytes or 0) - (baseline.cuda_allocated_bytes or 0)
    problems = []
    if extra:
        problems.append(f"threads left running: {', '.join(extra)}")
    if missing:
        problems.append(f"threads gone since the start: {', '.join(missing)}")
    if growth > allowed:
        problems.append(f"resident memory grew {growth / MiB:.1f} MiB, more than the {allowed / MiB:.1f} MiB "
                        f"allowed after {generations_done} failed generation(s)")
    if cuda_growth > cuda_slack_bytes:
        problems.append(f"CUDA memory still allocated: {cuda_growth / MiB:.1f} MiB above the start")
    return HygieneResult(extra, missing, growth, allowed, cuda_growth, tuple(problems))


def check(baseline: ProcessState, generations_done: int, *, allowed_prefixes: Iterable[str] = (),
          rss_limit_bytes: int = RSS_LIMIT_BYTES, rss_window: int = RSS_WINDOW_GENERATIONS,
          cuda_slack_bytes: int = 0, collect: bool = True, log: bool = True) -> HygieneResult:
    """Capture the process now and :func:`compare` it with ``baseline``. ``collect``: run the garbage collector
    first (the failed generation's traceback holds its frames, and they its tensors, in reference cycles). ``log``:
    say the verdict (an error when not clean)."""
    if collect:
        gc.collect()
    result = compare(baseline, ProcessState.capture(), generations_done=generations_done,
                     allowed_prefixes=allowed_prefixes, rss_limit_bytes=rss_limit_bytes, rss_window=rss_window,
                     cuda_slack_bytes=cuda_slack_bytes)
    if log:
        (logger.info if result.ok else logger.error)("%s", result.summary())
    return result


LOOKS = 4
"""Looks at the process's threads after a failed generation, 0.5 s apart, before it is declared not clean."""


class HygieneGuard:
    """One process's hygiene across its generations: the state before generation 0 and, from the first failed
    generation on, its resident memory; :meth:`is_clean` after each failed generation.

    Args:
        allowed_prefixes: names of threads that may outlive a generation (the engine's own, for the process's life).
        rss_limit_bytes: how much resident memory may grow over :data:`RSS_WINDOW_GENERATIONS` failed generations
            (``inprocess.hygiene_rss_growth_mib``).
        reabort: called between two looks with the failed generation: a thread of it may still wait on a peer whose
            listener the first abort missed (the engine's: the wide abort, every connection of the attempt but the
            live stores').
    """

    def __init__(self, *, allowed_prefixes: Iterable[str], rss_limit_bytes: int,
                 reabort: Callable[[int], None]) -> None:
        self.allowed_prefixes, self.rss_limit_bytes = tuple(allowed_prefixes), rss_limit_bytes
        self.reabort = reabort
        self._baseline: ProcessState | None = None
        self._rss_reference: tuple[int, int] | None = None

    def capture(self) -> None:
        """The process before generation 0 (after its imports and the engine's own threads)."""
        self._baseline = ProcessState.capture()

    def is_clean(self, generation: int, *, name: str = "this process") -> HygieneResult:
        """Off the training path (between the finalisation and the next barrier): thread names are compared with
        those before generation 0; resident memory with the process after the first failed generation. Threads
        that finish on their own (a timeline picture being drawn) get a moment to do so."""
        if self._baseline is None:
            raise RuntimeError("HygieneGuard.is_clean before capture()")
        if self._rss_reference is None:
            # Resident memory is measured from the first failed generation on: generation 0 builds what stays for
            # the process's life (the host slots' mappings, allocator arenas, lazily imported modules).
            self._rss_reference = (generation, ProcessState.capture().rss_bytes)
        first, rss = self._rss_reference
        baseline = dataclasses.replace(self._baseline, rss_bytes=rss)
        for look in range(LOOKS):
            result = check(baseline, max(1, generation - first), allowed_prefixes=self.allowed_prefixes,
                           rss_limit_bytes=self.rss_limit_bytes, log=False)
            if result.ok or not result.extra_threads or look == LOOKS - 1:
                (logger.info if result.ok else logger.error)("%s", result.summary())
                break
            # not a verdict yet: a thread blocked on a peer cut off is freed by the wide abort below
            logger.warning("%s: threads still running after generation %d: %s: aborting every connection of the "
                           "attempt and looking again (%d of %d)", name, generation,
                           ", ".join(result.extra_threads), look + 2, LOOKS)
            time.sleep(0.5)
            try:
                self.reabort(generation)
            except Exception as e:  # noqa: BLE001 - the look below decides
                logger.warning("%s: repeated abort of generation %d: %s", name, generation, e)
        return result
