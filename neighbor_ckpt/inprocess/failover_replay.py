"""What a process writes again to a new store after a failover, from its own memory.

A standby store starts empty. Every process that moves to it writes there what the next generation needs to form
(:mod:`neighbor_ckpt.inprocess.stores` says why this is enough): its ``proc/<p>`` record and readiness, the exits it
has seen (facts: a launcher saw the process exit; never a suspicion of its own or another detector's, ``silent`` or
``hung``: a client that comes back from the minority side of a partition would fence the healthy majority with
them), the current generation's barrier outcome and assignment, its progress and ``finished`` entry, the
generation's failure (kind ``store`` when none was recorded and the training thread is still inside), its gloo
listeners and its arrival at a barrier it is joining. :class:`ReplayFacts` is what one process knows (pure, frozen);
:func:`replay` writes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Optional

from neighbor_ckpt.inprocess import protocol
from neighbor_ckpt.inprocess.assignment import Assignment
from neighbor_ckpt.inprocess.generation import GenerationFailure, GenerationStore, Members

__all__ = ["ReplayFacts", "replay"]


@dataclass(frozen=True)
class ReplayFacts:
    """What one process knows that a new store must hold (see the module docstring)."""

    record: str
    """This process's ``proc/<p>`` value."""
    dead: Mapping[int, str]
    """Every death this process has seen (process -> reason); only exits (``exited:``) are written again."""
    generation: int
    """The generation this process is in."""
    members: Optional[Members] = None
    assignment: Optional[Assignment] = None
    progressed: bool = False
    """This process completed a step in ``generation``."""
    finished_world_size: Optional[int] = None
    """Set when this process's training function returned in ``generation`` (that generation's world size)."""
    failure: Optional[GenerationFailure] = None
    """``generation``'s failure as this process knows it."""
    inside: bool = False
    """The training thread is still inside the training function."""
    listeners: Optional[str] = None
    """This process's gloo listeners of ``generation``, as published."""
    joining: Optional[int] = None
    """The generation whose barrier this process is joining now."""


def replay(gens: GenerationStore, facts: ReplayFacts, *, by: str, why: str, new_store: str) -> None:
    """Write ``facts`` to the store of ``gens`` (the new one). ``by``: this process, for a failure record; ``why``:
    why the store moved; ``new_store``: where the next generation forms."""
    s, g = gens.store, facts.generation
    s.set(protocol.key("proc", gens.process), facts.record)
    gens.announce_ready()
    gone = "".join(f"{p}:{r.replace(';', ',')};" for p, r in sorted(facts.dead.items()) if r.startswith("exited:"))
    if gone:
        s.append("dead", gone)
    if facts.members is not None:
        s.compare_set(protocol.key("gen", g, "members"), "", facts.members.to_json())
    if facts.assignment is not None:
        gens.publish_assignment(g, facts.assignment)
    if facts.progressed:
        gens.mark_progress(g)
    if gens.current() < g:
        s.set("gen", str(g))
    if facts.finished_world_size is not None:
        gens.finished(g, facts.finished_world_size)  # the job may be complete: the others write theirs too
    if facts.failure is not None:
        s.compare_set(protocol.key("gen", g, "failed"), "", facts.failure.to_json())
    elif facts.inside:
        # Only a rank still in the training function fails the generation: when every rank had returned (the job
        # done as the store went), their `finished` entries complete the job on the new store instead.
        record = GenerationFailure(generation=g, by=by, kind="store", ranks=(), unix=time.time(),
                                   reason=f"{why}; the next generation forms on {new_store}")
        s.compare_set(protocol.key("gen", g, "failed"), "", record.to_json())
    if facts.listeners is not None:
        s.set(protocol.key("gen", g, "listen", gens.process), facts.listeners)
    if facts.joining is not None:
        s.append(protocol.key("gen", facts.joining, "arrived"), f"{gens.process},")
