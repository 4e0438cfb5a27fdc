"""What the in-process engine knows about its generations, as one object its collaborators share.

:class:`~neighbor_ckpt.inprocess.engine.InprocessRecovery` runs the generations and writes this state; its threads
and collaborators read it: the monitor (the generation, its members, whether the training thread is inside), the
peers' listeners (:mod:`~neighbor_ckpt.inprocess.peer_listeners`), the failover replay
(:mod:`~neighbor_ckpt.inprocess.failover_replay`, which writes again from it what a new store must know), the spare's
slot (:mod:`~neighbor_ckpt.inprocess.spare_slot`: is the process still idle). A field is written by one thread; the
lists and sets are changed under :attr:`EngineState.lock`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from neighbor_ckpt.inprocess.assignment import Assignment
from neighbor_ckpt.inprocess.generation import GenerationFailure, Members

__all__ = ["Attempt", "EngineState"]


@dataclass
class Attempt:
    """One call of the training function (generation ``iteration``; 0: the first)."""

    iteration: int
    rank: int
    """This generation's rank (survivors keep theirs, a spare gets the lost one)."""
    world_size: int
    initial_rank: int
    """The process index (the rank this process was started as; a spare's is >= the active world size)."""
    assignment: Assignment = field(repr=False, default=None)  # type: ignore[assignment]


@dataclass
class EngineState:
    """One process's view of the generations (see the module docstring)."""

    process: int
    """This process's index (stable for its life)."""
    generation: int = 0
    """The generation this process is in (or waits in, as an idle spare)."""
    members: frozenset[int] = frozenset()
    """The current generation's members."""
    members_record: Optional[Members] = None
    """The current generation's barrier outcome as the store holds it (written again after a failover)."""
    assignment: Optional[Assignment] = None
    """The current generation's ranks."""
    inside: bool = False
    """The training thread is inside the training function."""
    current: Optional[Attempt] = None
    """The attempt running now (None outside the training function)."""
    progressed: set[int] = field(default_factory=set)
    """Generations in which this process completed a training step."""
    finished: Optional[int] = None
    """The generation in which this process's training function returned."""
    joining: Optional[int] = None
    """The generation whose barrier this process is joining now."""
    failures: list[GenerationFailure] = field(default_factory=list)
    """The failures of the generations this process was part of, as recorded in the store."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """``{"iteration", "name", "unix"}``: abort_start/abort_end/finalize_end (this process's abort of a failed
    generation), initialize, enter, and whatever the training function records."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def name(self) -> str:
        """``process 3`` or ``process 3 (rank 1)``: who this is, for the log."""
        a = self.assignment
        r = None if a is None else a.rank_of(self.process)
        return f"process {self.process}" + ("" if r is None else f" (rank {r})")

    def event(self, name: str, when: Optional[float] = None) -> float:
        """Record event ``name`` of the current generation (now, or at ``when``); returns its time."""
        t = time.time() if when is None else when
        with self.lock:
            self.events.append({"iteration": self.generation, "name": name, "unix": t})
        return t

    def events_of(self, generation: int) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.events if e["iteration"] == generation]

    def add_failure(self, failed: GenerationFailure) -> None:
        with self.lock:
            self.failures.append(failed)

    def failures_of(self, generation: int) -> list[GenerationFailure]:
        with self.lock:
            return [f for f in self.failures if f.generation == generation]
