"""Generations over the store: who is dead, which generation failed and why, who joined the next one.

A *generation* is one call of the training function on a fixed set of processes with fixed ranks. It ends with
success (every active rank returned: ``complete``) or with a failure, recorded once under ``gen/<g>/failed`` (the
first ``compare_set`` wins, so every process acts on the same record). The next generation forms behind a barrier
that waits for every process expected in it, except those declared dead meanwhile; its canonical outcome is again
written once (``gen/<g>/members``), and every process derives its rank from it with the pure
:func:`~neighbor_ckpt.inprocess.assignment.next_assignment`. Key names and formats:
:mod:`neighbor_ckpt.inprocess.protocol`.

**Split brain (a network partition).** Every training step needs every rank of its generation (the data-parallel
all-reduce), so once the network is cut neither side completes a step of the generation it was in. A new generation
forms only with more than half of the last one's members that may still run (its members, idle spares included,
less those whose exit a launcher saw: :func:`quorum`), at every generation; a detector declares nobody dead when the
processes it would leave are not such a majority (:func:`~neighbor_ckpt.inprocess.quorum.majority_left`); and a
standby store is promoted only by a majority of the launchers' votes (:mod:`~neighbor_ckpt.inprocess.stores`). At
most one side of a cut holds a majority, so at most one side forms a generation. The other side stops itself: a
process or launcher that sees no majority's heartbeats for its lease (shorter than the ``detector.timeout_s`` of
silence the majority waits for before it declares anyone dead, and the barrier after it) logs one line, "cut off
from the majority", writes nothing more and exits (:mod:`~neighbor_ckpt.inprocess.quorum`); one that can reach no
store waits, bounded, for a store the majority promoted, and is cut off when none comes. When the cut heals, a
client that moves to the majority's store writes there only facts (exits a launcher saw), never its own
suspicions, so it cannot fence a member of the majority; it finds itself fenced (declared dead, or not a member of
the current generation) and exits, or its node's processes come back as spares (``grow_back``).

**Fencing.** A process declared dead (its launcher saw it exit, or a detector found it silent or hung) is listed in
``dead`` for good: when it runs again (a SIGSTOPped process resumed) it finds itself there at its next store access
and exits with :data:`~neighbor_ckpt.inprocess.protocol.EXIT_FENCED`; the generations after its own use process
groups under prefixes it never joined, so it cannot disturb them before that.

Every method is one or two store operations; :meth:`GenerationStore.join` polls (every ``poll_s``), which at a few
thousand processes is a few kilobytes per poll: the lists are single keys, read whole.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from neighbor_ckpt.errors import NeighborCkptError
from neighbor_ckpt.inprocess.assignment import Assignment
from neighbor_ckpt.inprocess.protocol import FAILURE_KINDS, key

__all__ = ["GenerationStore", "Members", "GenerationFailure", "Fault", "Fenced", "BarrierTimeout", "QuorumLost",
           "parse_list", "parse_dead", "exited", "quorum", "quorum_set", "gate"]

logger = logging.getLogger(__name__)


class Fenced(NeighborCkptError):
    """This process was declared dead; it must exit (:data:`~neighbor_ckpt.inprocess.protocol.EXIT_FENCED`)."""


class BarrierTimeout(NeighborCkptError):
    """A generation's barrier did not complete within ``inprocess.barrier_timeout_s``."""


class QuorumLost(NeighborCkptError):
    """Fewer than a majority of the last generation's members that may still run joined the next one."""


@dataclass(frozen=True)
class Members:
    """The canonical outcome of one generation's barrier."""

    generation: int
    members: frozenset[int]
    """Process indices in the generation."""
    progressed: bool
    """The previous generation completed a training step."""
    hangs: int
    """Generations so far that failed on a hang with every rank's progress tag equal."""

    def to_json(self) -> str:
        return json.dumps({"members": sorted(self.members), "progressed": self.progressed, "hangs": self.hangs})

    @classmethod
    def from_json(cls, generation: int, raw: bytes | str) -> "Members":
        d = json.loads(raw)
        return cls(generation=generation, members=frozenset(int(p) for p in d["members"]),
                   progressed=bool(d["progressed"]), hangs=int(d["hangs"]))


@dataclass(frozen=True)
class GenerationFailure:
    """Why a generation failed (``gen/<g>/failed``)."""

    generation: int
    by: str
    kind: str
    ranks: tuple[int, ...]
    """Process indices at fault (empty when unknown or nobody, e.g. ``hang_all``)."""
    reason: str
    unix: float

    def to_json(self) -> str:
        return json.dumps({"by": self.by, "kind": self.kind, "ranks": list(self.ranks), "reason": self.reason,
                           "unix": self.unix})

    @classmethod
    def from_json(cls, generation: int, raw: bytes | str) -> "GenerationFailure":
        d = json.loads(raw)
        return cls(generation=generation, by=str(d.get("by", "?")), kind=str(d.get("kind", "?")),
                   ranks=tuple(int(r) for r in d.get("ranks", ())), reason=str(d.get("reason", "")),
                   unix=float(d.get("unix", 0.0)))


@dataclass(frozen=True)
class Fault:
    """When a generation's fault happened, as one witness saw it: a launcher the exit of its process, a monitor the
    last heartbeat of a silent peer or the last move of a stuck rank's progress, a process its own exception. The
    recovery timeline's *detect* starts at the earliest (:mod:`neighbor_ckpt.report.timeline`)."""

    unix: float
    what: str
    """Which event, in words (``exit of process 1 seen by its launcher``)."""

    def to_entry(self) -> str:
        return f"{self.unix:.6f} {self.what.replace(';', ',')};"

    @classmethod
    def parse_entries(cls, raw: bytes | str | None) -> list["Fault"]:
        """``"<unix> <what>;"`` entries; a garbled one is skipped."""
        out = []
        for entry in _text(raw).split(";") if raw is not None else []:
            when, _, what = entry.strip().partition(" ")
            try:
                out.append(cls(float(when), what))
            except ValueError:
                continue
        return out


def gate(members: Members, *, max_restarts: Optional[int]) -> Optional[str]:
    """Why the generation ``members`` formed must not go on in process (None: it may), before ranks are assigned;
    every process decides alike (the same canonical outcome, the same rules):

    * more than ``max_restarts`` generations after the first (``inprocess.max_restarts``; None: unbounded);
    * the previous generation failed before completing a step, from generation 2 on (a failure during recovery, or a
      second failure in its window: such a state is not tried again in process);
    * a second generation failed on a hang with every rank's progress tag equal (no rank to blame twice)."""
    g = members.generation
    if max_restarts is not None and g > max_restarts:
        return f"more than {max_restarts} in-process restarts (inprocess.max_restarts)"
    if g >= 2 and not members.progressed:
        return (f"in-process restart {g - 1} failed before completing a step (a failure during recovery, or a second "
                "failure in its window)")
    if members.hangs >= 2:
        return "a second hang with every rank's progress tag equal: no rank to blame"
    return None


def _text(raw: bytes | str) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def parse_list(raw: bytes | str | None) -> list[int]:
    """``"3,5,"`` -> ``[3, 5]`` (an append-only list key)."""
    if not raw:
        return []
    return [int(x) for x in _text(raw).split(",") if x.strip()]


def parse_dead(raw: bytes | str | None) -> dict[int, str]:
    """``"3:exited with status -9;5:silent for 2.1 s;"`` -> ``{3: "exited ...", 5: "silent ..."}`` (first reason
    of each process kept)."""
    out: dict[int, str] = {}
    if not raw:
        return out
    for entry in _text(raw).split(";"):
        p, sep, why = entry.partition(":")
        if sep and p.strip().lstrip("-").isdigit():
            out.setdefault(int(p), why.strip())
    return out


def exited(raw: bytes | str | None) -> set[int]:
    """The processes of ``dead`` (its raw text) whose exit a launcher saw (an ``exited:`` entry, whatever was
    written for them before): gone for sure, not running elsewhere."""
    out: set[int] = set()
    for entry in _text(raw).split(";") if raw else ():
        p, sep, why = entry.partition(":")
        if sep and p.strip().lstrip("-").isdigit() and why.strip().startswith("exited:"):
            out.add(int(p))
    return out


def quorum_set(generation: int, *, processes: int, last: frozenset[int]) -> frozenset[int]:
    """Whose majority ``generation`` needs (pure): the last generation's members (idle spares included); for the first
    generation, every process of the launch (``processes``, spares included), so that a side cut off at start-up
    cannot form it alone on the others' declared absence."""
    return frozenset(range(processes)) if generation == 0 else frozenset(last)


def quorum(last: frozenset[int], gone: set[int]) -> int:
    """The fewest live processes a generation may form with (pure): more than half of the last generation's members
    that may still run (``gone``: those whose exit a launcher saw)."""
    return len(last - gone) // 2 + 1


class GenerationStore:
    """One process's view of the generations (a client of the launch's store, keys under the launch prefix).

    Not thread-safe: the engine's main thread and its monitor thread each hold their own (own store connections)."""

    def __init__(self, store: Any, *, process: int, name: Optional[str] = None) -> None:
        self.store = store
        self.process = process
        self.name = name or f"process {process}"
        self.seen_dead: dict[int, str] = {}
        """Every process this client has read in ``dead`` (only those whose exit a launcher saw are written again
        after a store failover: the rest are suspicions, :mod:`~neighbor_ckpt.inprocess.failover_replay`)."""
        self.exited: set[int] = set()
        """The processes of ``dead`` whose exit a launcher saw, as of the last read (:func:`exited`)."""

    # -- reads --------------------------------------------------------------------------------------------------

    def _get(self, k: str) -> Optional[bytes]:
        return self.store.get(k) if self.store.check([k]) else None

    def dead(self) -> dict[int, str]:
        raw = self._get("dead")
        dead = parse_dead(raw)
        self.exited = exited(raw)
        for p, why in dead.items():
            self.seen_dead.setdefault(p, why)
        for p in self.exited:  # a fact now, whatever was suspected of it first
            if not self.seen_dead[p].startswith("exited:"):
                self.seen_dead[p] = f"exited: after {self.seen_dead[p]}"
        return dead

    def ready(self) -> list[int]:
        return parse_list(self._get("ready"))

    def failure(self, generation: int) -> Optional[GenerationFailure]:
        raw = self._get(key("gen", generation, "failed"))
        return None if raw is None else GenerationFailure.from_json(generation, raw)

    def complete(self) -> bool:
        return self.store.check(["complete"])

    def gave_up(self) -> Optional[str]:
        raw = self._get("giveup")
        return None if raw is None else _text(raw)

    def current(self) -> int:
        raw = self._get("gen")
        return int(raw) if raw else 0

    def assignment(self, generation: int) -> Optional[Assignment]:
        raw = self._get(key("gen", generation, "assignment"))
        return None if raw is None else Assignment.from_json(raw)

    def members(self, generation: int) -> Optional[Members]:
        raw = self._get(key("gen", generation, "members"))
        return None if raw is None else Members.from_json(generation, raw)

    def check_fenced(self) -> None:
        why = self.dead().get(self.process)
        if why is not None:
            raise Fenced(f"{self.name} was declared dead ({why}); a newer generation goes on without it")

    # -- writes -------------------------------------------------------------------------------------------------

    def announce_ready(self) -> None:
        """This process is up (imports done): generations after the current one wait for it."""
        self.store.append("ready", f"{self.process},")

    def declare_dead(self, processes: Iterable[int], reason: str) -> None:
        entry = "".join(f"{p}:{reason.replace(';', ',')};" for p in processes)
        if entry:
            self.store.append("dead", entry)

    def holdings(self, generation: int, processes: Iterable[int]) -> dict[int, bytes]:
        """What each of ``processes`` published of its node's snapshots before joining ``generation`` (absent: none
        published)."""
        found = {p: self._get(key("gen", generation, "holds", p)) for p in sorted(processes)}
        return {p: raw for p, raw in found.items() if raw is not None}

    def publish_holdings(self, generation: int, raw: str) -> None:
        """This process's node's snapshots (:mod:`neighbor_ckpt.inprocess.holdings`), before it joins ``generation``."""
        self.store.set(key("gen", generation, "holds", self.process), raw)

    def publish_assignment(self, generation: int, assignment: Assignment) -> None:
        """The generation's ranks, for processes that join later (a replacement) and for the launchers (is a process
        that died active, or an idle spare?). Every member computes the same; any may write it."""
        self.store.set(key("gen", generation, "assignment"), assignment.to_json())

    def report_death(self, processes: Iterable[int], *, kind: str, reason: str, by: Optional[str] = None,
                     fault: Optional[Fault] = None, generation: Optional[int] = None) -> Optional[GenerationFailure]:
        """``processes`` are dead: list them in ``dead`` and, if one of them is active in the generation the decision
        is about (``generation``; None: the current one, read *before* they are declared: once they are, the others
        may form the next generation without them, which this death must not fail), record that generation's failure
        (the push every survivor waits for) and, given, when the fault happened as the reporter knows it. An idle
        spare's death fails nothing: the job goes on, the spare is no longer counted. Returns the generation's
        failure record, if one was recorded."""
        processes = tuple(processes)
        g = self.current() if generation is None else generation
        self.declare_dead(processes, f"{kind}: {reason}")
        assigned = self.assignment(g)
        if assigned is not None and not any(p in assigned.ranks for p in processes):
            logger.warning("%s: idle spare(s) %s lost (%s): the job goes on without them", by or self.name,
                           list(processes), reason)
            return None
        if fault is not None:
            self.record_fault(g, fault)
        return self.fail(g, kind=kind, ranks=processes, reason=reason, by=by)

    def record_fault(self, generation: int, fault: Fault) -> None:
        """When ``generation``'s fault happened, as one witness knows it (``gen/<g>/faults``; the earliest counts)."""
        self.store.append(key("gen", generation, "faults"), fault.to_entry())

    def faults(self, generation: int) -> list[Fault]:
        """Every witness's time of ``generation``'s fault, earliest first (empty: none recorded)."""
        return sorted(Fault.parse_entries(self._get(key("gen", generation, "faults"))), key=lambda f: f.unix)

    def fail(self, generation: int, *, kind: str, ranks: Iterable[int] = (), reason: str,
             by: Optional[str] = None) -> GenerationFailure:
        """Record that ``generation`` failed; returns the record that stands (this one, or an earlier one)."""
        if kind not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {kind!r}")
        mine = GenerationFailure(generation=generation, by=by or self.name, kind=kind, ranks=tuple(ranks),
                                 reason=reason[:400], unix=time.time())
        stored = self.store.compare_set(key("gen", generation, "failed"), "", mine.to_json())
        self._mine = mine
        return GenerationFailure.from_json(generation, stored)

    def won(self, record: GenerationFailure) -> bool:
        """Whether ``record`` (returned by :meth:`fail`) is the one this client wrote last."""
        return record == getattr(self, "_mine", None)

    def give_up(self, reason: str) -> str:
        """Record that in-process recovery gives up; returns the reason that stands."""
        return _text(self.store.compare_set("giveup", "", reason[:400]))

    def mark_progress(self, generation: int) -> None:
        self.store.set(key("progress", generation), str(self.process))

    def finished(self, generation: int, world_size: int) -> None:
        """This active rank's training function returned; the last of the generation marks the job complete.
        Idempotent (a list of processes, not a counter): a rank writes it again on a new store after a failover."""
        self.store.append(key("gen", generation, "finished"), f"{self.process},")
        if len(set(parse_list(self._get(key("gen", generation, "finished"))))) >= world_size:
            self.store.set("complete", str(generation))

    # -- waiting ------------------------------------------------------------------------------------------------

    def wait_outcome(self, generation: int, failed: "threading.Event", *, poll_s: float = 0.1) -> \
            Optional[GenerationFailure]:
        """Block until the job is complete (None) or ``generation`` failed (its record). ``failed`` is set by the
        process's :class:`~neighbor_ckpt.inprocess.monitor.FailureListener` (the store's push); the completion,
        which nothing waits for urgently, and this process's fencing are looked at every ``poll_s``."""
        while True:
            if failed.wait(poll_s):
                record = self.failure(generation)
                if record is not None:
                    return record
            if self.complete():
                return None
            self.check_fenced()

    def join(self, generation: int, *, expected: Iterable[int], timeout_s: float,
             poll_s: float = 0.01, quorum_of: Iterable[int] = ()) -> Members:
        """Arrive at ``generation``'s barrier and return its canonical outcome, once every expected process arrived
        or was declared dead (whoever sees that first writes the outcome; everyone reads the same). ``quorum_of``
        (:func:`quorum_set`: the last generation's members, every process of the launch for the first): the
        generation needs more than half of
        those of them whose exit no launcher reported, i.e. that may still run, cut off with the other side of a
        partition (:func:`quorum`); while fewer are live it does not form, and waits for the launchers' reports of
        exits (a process declared dead is killed by its launcher, which reports it).

        Raises:
            Fenced: this process was declared dead.
            BarrierTimeout: not complete within ``timeout_s`` (the processes still missing are named).
            QuorumLost: every expected process arrived or was declared dead within ``timeout_s``, and fewer than
                the quorum were live."""
        last = frozenset(quorum_of)
        members_key = key("gen", generation, "members")
        arrived_key = key("gen", generation, "arrived")
        self.store.append(arrived_key, f"{self.process},")
        want = frozenset(expected) | {self.process}
        deadline = time.monotonic() + timeout_s
        while True:
            raw = self._get(members_key)
            if raw is not None:
                return self._admitted(Members.from_json(generation, raw))
            dead = self.dead()
            if self.process in dead:
                raise Fenced(f"{self.name} was declared dead ({dead[self.process]}) before generation "
                             f"{generation} formed")
            arrived = set(parse_list(self._get(arrived_key)))
            missing = want - arrived - dead.keys()
            short: Optional[tuple[int, int]] = None
            if not missing:
                live = arrived - dead.keys()
                need = quorum(last, exited(self._get("dead"))) if last else 0
                if len(live) >= need:
                    return self._admitted(self._settle(generation, live))
                short = (len(live), need)
            if time.monotonic() > deadline:
                if short is not None:
                    raise QuorumLost(f"generation {generation} would form with {short[0]} process(es), fewer than a "
                                     f"majority ({short[1]}) of the last generation's that may still run: the others "
                                     "may go on elsewhere, so these stop")
                raise BarrierTimeout(f"generation {generation} did not form within {timeout_s:g} s "
                                     f"(inprocess.barrier_timeout_s): processes {sorted(missing)} neither joined nor "
                                     f"were declared dead")
            time.sleep(poll_s)

    def _settle(self, generation: int, members: set[int]) -> Members:
        progressed = generation == 0 or self.store.check([key("progress", generation - 1)])
        hangs = 0
        if generation > 0:
            prev_raw = self._get(key("gen", generation - 1, "members"))
            prev = Members.from_json(generation - 1, prev_raw) if prev_raw is not None else None
            failed = self.failure(generation - 1)
            hangs = (prev.hangs if prev is not None else 0) + int(failed is not None and failed.kind == "hang_all")
        mine = Members(generation=generation, members=frozenset(members), progressed=progressed, hangs=hangs)
        stored = self.store.compare_set(key("gen", generation, "members"), "", mine.to_json())
        if _text(stored) == mine.to_json():
            self.store.set("gen", str(generation))
        return Members.from_json(generation, stored)

    def _admitted(self, members: Members) -> Members:
        if self.process not in members.members:
            raise Fenced(f"{self.name} is not a member of generation {members.generation} (declared dead while it "
                         "joined)")
        return members
