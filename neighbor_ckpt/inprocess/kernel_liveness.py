"""Liveness from the kernel: what a node's launcher knows of its processes without asking them.

A process's heartbeat is written by a Python thread (:mod:`~neighbor_ckpt.inprocess.monitor`); a thread starved of
the GIL (the main thread in a long call that does not release it: a model rebuild, a big ``pickle``) beats late and,
judged by its heartbeat alone, looks dead. The kernel knows better: its launcher (the process's parent, on its node)
reads ``/proc/<pid>/stat`` of each of its processes every tick of its loop (:func:`read_state`, microseconds) and
judges it by what the kernel says, not by what the process says:

* **exited**: the launcher sees it (``waitpid``, a pidfd: :mod:`~neighbor_ckpt.inprocess.exit_clock`), as before;
* **stopped** (``T``, ``t``: SIGSTOP, a debugger) or **in an uninterruptible sleep** (``D``) *without using CPU time*
  for longer than ``detector.timeout_s`` (:class:`KernelWatch`): *held*. The launcher SIGKILLs it and declares it
  dead as a fact, like an exit (a stopped process ignores every other signal, and once killed it cannot come back);
* anything else (``R``, ``S``: running, or sleeping, e.g. a rank blocked in a collective, which uses no CPU either):
  alive. The launcher *vouches* for it in its beat; whether it makes progress is the hang detector's business (the
  progress tags and ``detector.hang_timeout_s``), not the heartbeat's.

The launcher carries what it saw in its one write per beat (``lhb/<node>``, :func:`format_beat`):
``"<beat> run=<p>,<p> held=<p>:<T|D>:<seconds>"``: the processes it vouches running, and those held, with how long
(seconds, not a time: clocks of nodes differ). A monitor whose ring predecessor sent no heartbeat for
``detector.timeout_s`` does not declare it silent while that process's launcher beats and vouches for it
(:func:`parse_beat`); a bare counter (an older launcher) vouches for nobody.

Which process is judged: the launcher's child, and the process the engine recorded under ``proc/<p>`` when that is
another one on this node (the test suite's warm fork: :func:`~neighbor_ckpt.inprocess.launcher_children.
recorded_pid_to_kill` checks it), the worse of the two (gone, then stopped, then in D, then running). Only the state
of the main thread is read (``/proc/<pid>/stat``): that is the training thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

__all__ = ["KernelState", "read_state", "Verdict", "KernelWatch", "ChildrenInKernel", "NodeSummary", "format_beat",
           "parse_beat", "RUNNING", "STOPPED", "DISK", "GONE"]

RUNNING, DISK, STOPPED, GONE = "running", "disk", "stopped", "gone"
"""A process's status as the kernel shows it, from the best to the worst."""
_RANK = {RUNNING: 0, DISK: 1, STOPPED: 2, GONE: 3}
_LETTER = {STOPPED: "T", DISK: "D"}


@dataclass(frozen=True)
class KernelState:
    """One read of ``/proc/<pid>/stat``."""

    letter: str
    """The state field: ``R``, ``S``, ``D``, ``T``, ``t``, ``Z``, ``X``, ..."""
    cpu_ticks: int
    """``utime + stime`` (clock ticks): what it ran so far."""
    start: int
    """``starttime`` (clock ticks after boot): which process this pid is."""

    @property
    def status(self) -> str:
        if self.letter in ("T", "t"):
            return STOPPED
        if self.letter == "D":
            return DISK
        if self.letter in ("Z", "X", "x"):
            return GONE
        return RUNNING


def read_state(pid: int) -> Optional[KernelState]:
    """``pid``'s state as the kernel shows it; None when there is no such process (or it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw.rpartition(b")")[2].split()  # the command name may hold spaces and parentheses
    try:
        return KernelState(fields[0].decode(), int(fields[11]) + int(fields[12]), int(fields[19]))
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Verdict:
    """What the kernel says of one process, and for how long."""

    process: int
    status: str
    held_s: float = 0.0
    """How long it has been stopped, or in ``D`` without CPU time (0 while running)."""

    @property
    def letter(self) -> str:
        return _LETTER.get(self.status, "?")

    @property
    def event(self) -> str:
        """What happened to it, in a word or two (a fault's witness: ``stop of process 3 seen by its launcher``)."""
        return "stop" if self.status == STOPPED else "uninterruptible sleep"

    def describe(self) -> str:
        what = ("stopped (state T)" if self.status == STOPPED else
                "in an uninterruptible sleep without CPU time (state D)")
        return f"{what} for {self.held_s:.1f} s in the kernel"


class KernelWatch:
    """The launcher's view of its processes (pure: states and times are given). ``limit_s``: how long a process may
    be held (stopped, or in ``D`` without CPU time) before it is :meth:`overdue` (``detector.timeout_s``)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._seen: dict[int, tuple[str, float, int]] = {}
        """process -> (status, since when, CPU ticks then)."""

    def observe(self, process: int, states: Sequence[Optional[KernelState]], now: float) -> Verdict:
        """One look at the pids that run ``process`` (None: no such pid): the worst of them counts. A held status
        runs from the first look that saw it; ``D`` only while the process uses no CPU time."""
        worst = max((GONE if s is None else s.status for s in states), key=_RANK.__getitem__, default=GONE)
        cpu = sum(s.cpu_ticks for s in states if s is not None)
        old = self._seen.get(process)
        if old is None or old[0] != worst or (worst == DISK and cpu != old[2]):
            old = self._seen[process] = (worst, now, cpu)
        return self.verdict(process, now)

    def verdict(self, process: int, now: float) -> Verdict:
        status, since, _ = self._seen.get(process, (GONE, now, 0))
        return Verdict(process, status, now - since if status in (STOPPED, DISK) else 0.0)

    def overdue(self, now: float) -> list[Verdict]:
        """The processes held for longer than ``limit_s`` (to be SIGKILLed and declared dead)."""
        out = [self.verdict(p, now) for p in sorted(self._seen)]
        return [v for v in out if v.status in (STOPPED, DISK) and v.held_s > self.limit_s]

    def forget(self, processes: Iterable[int]) -> None:
        """Processes that exited (or were never this launcher's): no longer in its beat."""
        for p in processes:
            self._seen.pop(p, None)

    def keep(self, processes: Iterable[int]) -> None:
        """Forget every process but ``processes`` (the children still running)."""
        self.forget(set(self._seen) - set(processes))

    def verdicts(self, now: float) -> list[Verdict]:
        return [self.verdict(p, now) for p in sorted(self._seen)]


@dataclass(frozen=True)
class NodeSummary:
    """A launcher's beat, read back (:func:`parse_beat`)."""

    beat: str
    running: frozenset[int]
    """The processes it vouches running in the kernel."""
    held: Mapping[int, tuple[str, float]]
    """Held processes: (``T`` or ``D``, seconds) as of the beat."""


def format_beat(beat: int, verdicts: Iterable[Verdict]) -> str:
    """``lhb/<node>``'s value: the beat counter first (what every reader of a launcher's beat compares), then the
    kernel's word on each of its processes (a process that is gone is left out: its exit is reported)."""
    verdicts = list(verdicts)
    run = ",".join(str(v.process) for v in verdicts if v.status == RUNNING)
    held = ",".join(f"{v.process}:{v.letter}:{v.held_s:.1f}" for v in verdicts if v.status in (STOPPED, DISK))
    return f"{beat} run={run} held={held}"


def parse_beat(raw: bytes | str | None) -> Optional[NodeSummary]:
    """A launcher's beat as :func:`format_beat` wrote it; None when absent or a bare counter (it vouches for
    nobody). A garbled part vouches for nobody either."""
    if raw is None:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    beat, _, rest = text.partition(" ")
    parts = dict(p.partition("=")[::2] for p in rest.split())
    if "run" not in parts:
        return None
    try:
        running = frozenset(int(p) for p in parts["run"].split(",") if p)
        held: dict[int, tuple[str, float]] = {}
        for entry in parts.get("held", "").split(","):
            if entry:
                p, letter, seconds = entry.split(":")
                held[int(p)] = (letter, float(seconds))
    except ValueError:
        return None
    return NodeSummary(beat, running - held.keys(), held)


class ChildrenInKernel:
    """A launcher's children as the kernel shows them (:class:`~neighbor_ckpt.inprocess.launcher.Launcher` holds one):
    :meth:`look` every tick of its loop (reads of ``/proc`` only), :meth:`beat` once per beat (its text for
    ``lhb/<node>``; and, until found, each child's ``proc/<p>`` record through ``record``: the process the engine
    runs in, when that is not the child itself).

    Args:
        limit_s: ``detector.timeout_s``: how long a child may be held before it is :meth:`look`'s to kill.
        node: the launcher's node (a recorded pid is judged only when recorded on it).
    """

    def __init__(self, limit_s: float, *, node: str) -> None:
        self.watch, self.node = KernelWatch(limit_s), node
        self._other: dict[int, Optional[tuple[int, Optional[int]]]] = {}
        """child pid -> the other pid its engine runs in and that one's start (None: the child itself), once its
        record was read (by the child's pid: a process index starts again at a launcher-level restart)."""

    def pids(self, child: int) -> list[int]:
        other = self._other.get(child)
        return [child] if other is None else [child, other[0]]

    def _states(self, child: int) -> list[Optional[KernelState]]:
        states = [read_state(p) for p in self.pids(child)]
        other = self._other.get(child)
        if other is not None and states[1] is not None and states[1].start != other[1]:
            states[1] = None  # its pid reused by another process since: the one recorded is gone
        return states

    def look(self, children: Mapping[int, int], now: float) -> list[Verdict]:
        """One look at ``children`` (process -> the child's pid): those held for longer than the limit."""
        self.watch.keep(children)
        self._other = {pid: v for pid, v in self._other.items() if pid in children.values()}
        for process, pid in children.items():
            self.watch.observe(process, self._states(pid), now)
        return self.watch.overdue(now)

    def beat(self, count: int, children: Mapping[int, int], now: float,
             record: Callable[[int], Optional[bytes]]) -> str:
        """``lhb/<node>``'s value for beat ``count`` (:func:`format_beat`); first, each child whose ``proc/<p>`` was
        not found yet is looked up (``record``: its raw value, None while absent)."""
        from neighbor_ckpt.inprocess.launcher_children import recorded_pid_to_kill

        for process, pid in children.items():
            if pid not in self._other:
                raw = record(process)
                if raw is not None:
                    other = recorded_pid_to_kill(raw, node=self.node, child=pid)
                    state = None if other is None else read_state(other)
                    self._other[pid] = None if other is None else (other, None if state is None else state.start)
        return format_beat(count, (v for v in self.watch.verdicts(now) if v.process in children))
