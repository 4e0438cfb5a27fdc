"""The in-process failure detector: one daemon thread per process, for the process's whole life.

It runs the same decisions as the restart path's :class:`~neighbor_ckpt.runtime.detector.FailureDetector`
(:class:`~neighbor_ckpt.runtime.detector.Watch` for silent peers, :class:`~neighbor_ckpt.runtime.detector.
ProgressClock` for a stuck training thread, the same ``neighbor_ckpt.detector`` timers); what differs is the action:
the restart path's detector kills and exits so the launcher restarts the job, this one records the failure of the
current generation in the store, where every process waits for it, and the engine aborts in place. Every
``detector.interval_s`` it:

* publishes this process's heartbeat and the training thread's progress tag (``hb/<p>``);
* hands the current generation's failure to the engine; the store pushes it: a :class:`FailureListener` thread
  blocks on ``gen/<g>/failed`` (no timeout: a store ``wait`` that timed out left the next ones hanging, measured on
  torch 2.13's TCPStore) and is woken when any process or launcher records a failure, so a dead rank is pushed, not
  polled for;
* reads the heartbeat of its predecessor in the ring of the generation's members (spares included, so an idle spare
  that dies is noticed too): silent for more than ``detector.timeout_s`` -> that process is declared dead (its
  launcher SIGKILLs it: a SIGSTOPped process ignores everything else) and the generation failed (``silent``). A
  predecessor on another node is watched together with that node's launcher (``lhb/<node>``): when the launcher is
  quiet too (:data:`NODE_LAUNCHER_QUIET`), the node is lost, and every process of it in the generation is declared
  dead in that one decision, so a node of ``k`` ranks costs one detection, not ``k`` in a row. A silent predecessor
  whose node's launcher beats and vouches it running in the kernel (:mod:`~neighbor_ckpt.inprocess.kernel_liveness`:
  its heartbeat thread starved of the GIL, or the process stuck alive) is not declared: a stuck process is the hang
  detector's (below). A node whose launcher has been quiet for :data:`LAUNCHER_LOST` x ``detector.timeout_s`` is
  lost whole even while its processes beat (a SIGSTOPped launcher costs its node);
* watches its own training thread: when its progress tag stood still for ``detector.hang_timeout_s`` it reads every
  active rank's tag. The ranks whose tag lags the others' are declared dead and replaced (``hung``: stuck in a C
  call or a collective the others already left) when declaring them leaves a majority of the members, counting them
  (a lagging tag is a suspicion, and may name the larger side of a cut whose smaller side got one more progress
  mark); when every tag is equal, or the laggards are no minority, the ranks a majority cannot reach over
  their own network are blamed (:mod:`~neighbor_ckpt.inprocess.reachability`: a cut of the ranks' links, the store
  reachable), else nobody is: the generation fails with ``hang_all`` and the same ranks re-form (a second time, the
  engine falls back to the restart path);
* exits the process with :data:`~neighbor_ckpt.inprocess.protocol.EXIT_FENCED` when it finds itself declared dead;
* never declares peers dead when the processes it would leave are not a majority of the generation's members that may
  still run (:func:`~neighbor_ckpt.inprocess.quorum.majority_left`: a minority cut off with the store does not
  re-form with its spares), and reads every such member's heartbeat (or its node's launcher's) for the cut-off lease
  (:class:`~neighbor_ckpt.inprocess.quorum.MajorityLease`).

The decision on the tags is :func:`laggards` (pure).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional

from neighbor_ckpt.inprocess.generation import Fault, GenerationFailure, GenerationStore
from neighbor_ckpt.inprocess.kernel_liveness import parse_beat
from neighbor_ckpt.inprocess.protocol import EXIT_FENCED, key
from neighbor_ckpt.inprocess.quorum import MajorityLease, majority_left
from neighbor_ckpt.inprocess.reachability import ReachProbe
from neighbor_ckpt.runtime.detector import PAUSED, ProgressClock, Watch
from neighbor_ckpt.runtime.procs import flush_logs

__all__ = ["Monitor", "FailureListener", "laggards", "ring_predecessor", "Tag", "parse_heartbeat"]

logger = logging.getLogger(__name__)

Tag = tuple[int, Optional[int], str]
"""A training thread's progress tag: (counter, last completed iteration or None, phase)."""

IDLE_TAG: Tag = (0, None, "idle")

LAUNCHER = -1
"""The watch entry of the predecessor's node's launcher (``lhb/<node>``), beside the predecessor's own heartbeat."""

NODE_LAUNCHER_QUIET = 0.5
"""A silent predecessor on another node takes its whole node with it when that node's launcher has not beaten for
this fraction of ``detector.timeout_s`` either: a live launcher beats four times per timeout (at most every second),
and a launcher lost with its processes has been quiet for about ``timeout_s - interval_s - its beat period`` by the
time the predecessor counts as silent, which exceeds half the timeout at the defaults (5 s, 1 s, 1 s) and in the
tests (2 s, 0.2 s, 0.5 s)."""


LAUNCHER_LOST = 2.0
"""A node whose launcher has not beaten for this many ``detector.timeout_s`` is lost whole, its processes too, even
those that still beat (:meth:`Monitor._launcher_lost`). At least 1 + the launcher's beat period / ``timeout_s`` (its
last beat before a cut is at most one period old), so the decision comes no earlier than ``timeout_s`` after the
last beat of any of its processes before a cut (the lease's argument, docs/timeouts.md); twice leaves a launcher's
loop that a loaded machine delays a whole ``timeout_s`` more."""


def vouched_running(raw: bytes | str | None, process: int) -> bool:
    """Whether a launcher's beat (``lhb/<node>``) vouches ``process`` running in the kernel
    (:func:`~neighbor_ckpt.inprocess.kernel_liveness.parse_beat`)."""
    summary = parse_beat(raw)
    return summary is not None and process in summary.running


def parse_heartbeat(raw: bytes | str | None) -> Optional[tuple[int, int, Tag]]:
    """``"<beat> <generation> <counter> <iteration> <phase>"`` -> (beat, generation, tag); None if absent/garbled."""
    if raw is None:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    parts = text.split(" ", 4)
    if len(parts) != 5:
        return None
    try:
        beat, gen, counter = int(parts[0]), int(parts[1]), int(parts[2])
        it = None if parts[3] in ("None", "-") else int(parts[3])
    except ValueError:
        return None
    return beat, gen, (counter, it, parts[4])


def laggards(tags: Mapping[int, Tag]) -> tuple[int, ...]:
    """The processes whose progress tag lags the others' (fewest progress marks in this generation): the ones to
    blame for a hang. Empty when every tag is equal (no one to blame) or there are no tags."""
    if not tags:
        return ()
    counters = {p: t[0] for p, t in tags.items()}
    low = min(counters.values())
    if all(c == low for c in counters.values()):
        return ()
    return tuple(sorted(p for p, c in counters.items() if c == low))


def ring_predecessor(process: int, members: frozenset[int] | set[int]) -> Optional[int]:
    """The member before ``process`` in the ring of ``members`` ordered by process index (None: alone)."""
    ring = sorted(members)
    if process not in ring or len(ring) < 2:
        return None
    return ring[ring.index(process) - 1]


class FailureListener:
    """The push of failures: one daemon thread blocked on ``gen/<g>/failed`` for ``g = first, first + 1, ...`` on a
    store connection of its own. Every generation but the job's last ends with a failure, so each wait returns; the
    last one is abandoned with the process. For each record it sets :meth:`event` and calls ``on_failure`` (on this
    thread: the engine's abort runs here, off the monitor's heartbeat)."""

    WAIT = timedelta(days=7)

    def __init__(self, gens: GenerationStore, *, on_failure: Callable[[GenerationFailure], None],
                 first: int = 0) -> None:
        self.gens, self.on_failure, self._next = gens, on_failure, first
        self._lock = threading.Lock()
        self._events: dict[int, threading.Event] = {}
        self._records: dict[int, GenerationFailure] = {}
        self._thread: Optional[threading.Thread] = None
        self.retired = False
        """Set when a successor listens on a newer store: this one acts on nothing more."""

    def successor(self, gens: GenerationStore) -> "FailureListener":
        """A listener on ``gens`` (the store after a failover) that goes on from the generation this one waits for,
        with the same events and records; this one is retired (it may stay blocked on the lost store)."""
        nxt = FailureListener(gens, on_failure=self.on_failure, first=self._next)
        with self._lock:
            self.retired = True
            nxt._lock, nxt._events, nxt._records = self._lock, self._events, self._records
        return nxt

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="neighbor_ckpt-inprocess-listener", daemon=True)
        self._thread.start()

    def event(self, generation: int) -> threading.Event:
        """Set once ``generation``'s failure is recorded."""
        with self._lock:
            return self._events.setdefault(generation, threading.Event())

    def record(self, generation: int) -> Optional[GenerationFailure]:
        with self._lock:
            return self._records.get(generation)

    def _run(self) -> None:
        while not self.retired:
            g = self._next
            try:
                self.gens.store.wait([key("gen", g, "failed")], self.WAIT)
                record = self.gens.failure(g)
            except Exception as e:  # noqa: BLE001 - the store went away: try again (the monitor says it too)
                if self.retired:
                    return
                logger.warning("%s: failure listener: %s: %s", self.gens.name, type(e).__name__, e)
                time.sleep(1.0)
                continue
            if record is None:
                continue
            with self._lock:
                if self.retired:
                    return
                self._records.setdefault(g, record)
                self._next = g + 1
            self.event(g).set()
            try:
                self.on_failure(record)
            except Exception:  # noqa: BLE001 - the engine's abort must not stop the listening
                logger.exception("%s: handling the failure of generation %d", self.gens.name, g)


class Monitor:
    """The detector thread of one process (see the module docstring).

    Args:
        gens: a :class:`GenerationStore` on a store connection of this thread alone.
        state: returns ``(generation, members, active ranks {process: rank} or None between generations, whether
            the training thread is inside the training function)``.
        progress: returns the training thread's current tag (:data:`IDLE_TAG` outside an attempt).
        listener: the failure push (its records wake this thread too).
        interval_s, timeout_s, hang_timeout_s: ``neighbor_ckpt.detector``.
        exit: how to leave when fenced (``os._exit``; tests pass a recorder).
        lease: the cut-off lease this monitor renews each round (:class:`~neighbor_ckpt.inprocess.quorum.
            MajorityLease`; None: none), under ``lease_lock`` (its guard's).
    """

    def __init__(self, gens: GenerationStore, *,
                 state: Callable[[], tuple[int, frozenset[int], Optional[Mapping[int, int]], bool]],
                 progress: Callable[[], Tag], listener: FailureListener, interval_s: float, timeout_s: float, hang_timeout_s: Optional[float],
                 exit: Callable[[int], None] = os._exit, stores: Any = None,  # noqa: A002
                 every_round: Optional[Callable[[], None]] = None, lease: Optional[MajorityLease] = None,
                 lease_lock: Optional[threading.Lock] = None) -> None:
        self.gens, self.state, self.progress, self._listener = gens, state, progress, listener
        self.lease, self.lease_lock = lease, lease_lock or threading.Lock()
        """The cut-off lease this monitor renews (None: no lease), and the lock its guard holds while it judges."""
        self.answered_at = time.monotonic()
        """When the store last answered this monitor's look (the lease guard decides on a look answered after the
        lease ran out; none: in doubt)."""
        self._refused: set[tuple[int, tuple[int, ...]]] = set()
        self._vouched: set[tuple[int, int]] = set()
        self._no_minority: set[tuple[int, tuple[int, ...]]] = set()
        self.stores = stores
        """The process's :class:`~neighbor_ckpt.inprocess.stores.StoreSet` (None: one store, no failover): after
        every move to another store a peer is silent only once it has had the time a live process needs to follow
        (:attr:`~neighbor_ckpt.inprocess.stores.StoreSet.move_bound_s`) and then ``timeout_s`` (its heartbeats start
        again there)."""
        self._epoch = None if stores is None else stores.epoch
        self.every_round = every_round
        """Called after each round's beat (the engine keeps the peers' listeners in memory)."""
        self.interval_s, self.timeout_s, self.hang_timeout_s = interval_s, timeout_s, hang_timeout_s
        self._exit = exit
        self._beat = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._watch: Optional[tuple[tuple[int, Optional[int], Optional[str]], Watch]] = None
        self._nodes: dict[int, str] = {}
        """Process -> its node (``proc/<p>``), read once per process."""
        self._clock: tuple[int, ProgressClock] = (-1, ProgressClock(hang_timeout_s))
        self._grace_until = 0.0
        self._reach = ReachProbe(gens.store, gens.process, timeout_s=max(0.5, timeout_s / 2))
        self.decisions: list[GenerationFailure] = []
        """Failures this monitor recorded itself (for tests and the log)."""

    @property
    def listener(self) -> FailureListener:
        return self._listener

    @listener.setter
    def listener(self, value: FailureListener) -> None:
        self._listener = value

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="neighbor_ckpt-inprocess-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s * 4 + 2)

    # -- one round --------------------------------------------------------------------------------------------------

    def beat(self) -> None:
        gen, _, _, _ = self.state()
        counter, it, phase = self.progress()
        self._beat += 1
        self.gens.store.set(key("hb", self.gens.process), f"{self._beat} {gen} {counter} {it} {phase}")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.round()
            except SystemExit:
                raise
            except Exception as e:  # noqa: BLE001 - the store went away, or a bug: keep watching, say it once
                logger.warning("%s: in-process monitor: %s: %s", self.gens.name, type(e).__name__, e)
                self._stop.wait(self.interval_s)

    def round(self) -> None:
        """Wait one interval (less when a failure is recorded), then beat and look (one detector round)."""
        gen, _, _, _ = self.state()
        self.listener.event(gen).wait(self.interval_s)
        if self._stop.is_set():
            return
        gen2, members, active, inside = self.state()
        if gen2 != gen:
            return  # a new generation formed meanwhile: look at it next round
        if self.listener.record(gen) is not None:
            self._stop.wait(self.interval_s)  # the event stays set: do not spin
        dead = self.gens.dead()
        self._fenced(dead)
        self.beat()
        if self.every_round is not None:
            self.every_round()
        failed = self.gens.failure(gen)
        now = time.monotonic()
        if self.stores is not None and self.stores.epoch != self._epoch:
            self.moved(self.stores.epoch, now)
        self._look_at_majority(members, dead)
        # Silent peers are looked for after a failure too: the next generation's barrier waits for every process
        # not declared dead, and a process killed without a launcher to report it is found only this way.
        self._silent_peer(gen, members - dead.keys(), now)
        if failed is None and active is not None and inside and self.gens.process in active:
            self._hang(gen, active, now)

    def _look_at_majority(self, members: frozenset[int], dead: Mapping[int, str]) -> None:
        """Feed the lease: the heartbeat of every member that may still run, with its node's launcher's beat (a
        process stopped on a node whose launcher beats is on this side of any cut); this round answered. Once the
        job completed, the others leave: the lease is disarmed."""
        if self.lease is None:
            return
        if self.gens.complete():
            self.lease.disarm()
            return
        quorum_set = sorted(members - self.gens.exited - {self.gens.process})
        beats = dict(zip(quorum_set, self._read([key("hb", p) for p in quorum_set])))
        nodes = {p: self._node_of(p) for p in quorum_set}
        names = sorted({n for n in nodes.values() if n is not None})
        launchers = dict(zip(names, self._read([key("lhb", n) for n in names])))
        seen = {p: (beats[p], launchers.get(nodes[p])) for p in quorum_set
                if beats[p] is not None or launchers.get(nodes[p]) is not None}
        now = time.monotonic()
        with self.lease_lock:
            if not self.lease.after_gap(now):  # a look after a starved gap decides nothing (MajorityLease.after_gap)
                self.answered_at = now
            self.lease.observe(set(quorum_set) | {self.gens.process}, seen, now)

    def _read(self, keys: list[str]) -> list[Optional[bytes]]:
        """The values of ``keys`` (None: absent): two store operations when every key is there."""
        if not keys:
            return []
        s = self.gens.store
        if s.check(keys):
            return list(s.multi_get(keys))
        return [s.get(k) if s.check([k]) else None for k in keys]

    def _leaves_majority(self, gen: int, members: frozenset[int], lost: tuple[int, ...], *,
                         vouched: tuple[int, ...] = (), quiet: bool = False) -> bool:
        """Whether declaring ``lost`` dead leaves a majority of the members that may still run; said once per
        decision when it does not (``quiet``: not said; the caller asks something else next)."""
        dead = self.gens.dead()
        # The survivors are those seen within the lease, not merely undeclared nor within the detector's timeout: the
        # peers on the far side of a cut go silent together, and the first to pass timeout_s would otherwise be
        # declared while the others still counted as seen (a minority's spare once declared a majority member so)
        with self.lease_lock:
            alive = None if self.lease is None else self.lease.fresh(time.monotonic(), self.lease.lease_s)
        if majority_left(members, dead=dead.keys(), lost=lost, exited=self.gens.exited, vouched=vouched,
                         alive=alive):
            return True
        if not quiet and (gen, lost) not in self._refused:
            self._refused.add((gen, lost))
            logger.error("%s: not declaring process(es) %s dead: the processes left would not be a majority of "
                         "generation %d's %d member(s) that may still run (this side may be the one cut off)",
                         self.gens.name, list(lost), gen, len(members - self.gens.exited))
        return False

    def moved(self, epoch: int, now: float) -> None:
        """This process now uses store ``epoch``: every peer starts again there, and is not looked at before it has
        had the time to follow (a peer whose operation was in flight on the lost store: the campaign saw a healthy
        process declared silent, and fenced, 8.5 s after the move with a 3 s + 3 s allowance)."""
        self._epoch, self._watch = epoch, None
        self._grace_until = now + max(self.timeout_s, getattr(self.stores, "move_bound_s", 0.0))

    def _fenced(self, dead: Mapping[int, str]) -> None:
        why = dead.get(self.gens.process)
        if why is None:
            return
        logger.error("%s: declared dead by the others (%s): a newer generation goes on without this process; "
                     "exiting with status %d", self.gens.name, why, EXIT_FENCED)
        flush_logs()
        self._exit(EXIT_FENCED)

    def _node_of(self, process: int) -> Optional[str]:
        """The node process ``process`` runs on (its ``proc/<p>`` record, read once), None while unknown."""
        if process not in self._nodes:
            k = key("proc", process)
            raw = self.gens.store.get(k) if self.gens.store.check([k]) else None
            try:
                node = None if raw is None else json.loads(raw).get("node")
            except (ValueError, AttributeError):
                node = None
            if node is None:
                return None
            self._nodes[process] = str(node)
        return self._nodes[process]

    def _silent_peer(self, gen: int, members: frozenset[int], now: float) -> Optional[GenerationFailure]:
        peer = ring_predecessor(self.gens.process, members)
        # The predecessor is watched with its node's launcher, which vouches for it in the kernel; on another node,
        # that launcher quiet too is the whole node lost, in one decision.
        home = None if peer is None else self._node_of(peer)
        node = None if home == self._node_of(self.gens.process) else home
        if self._watch is None or self._watch[0] != (gen, peer, node):
            watched = () if peer is None else (peer,) if home is None else (peer, LAUNCHER)
            self._watch = ((gen, peer, node), Watch(watched, timeout_s=self.timeout_s,
                                                    now=max(now, self._grace_until)))
        if peer is None:
            return None
        watch = self._watch[1]
        raw = self.gens.store.get(key("hb", peer)) if self.gens.store.check([key("hb", peer)]) else None
        watch.observe(peer, None if raw is None else raw.decode(errors="replace"), now)
        beat = None
        if home is not None:
            beat = self.gens.store.get(key("lhb", home)) if self.gens.store.check([key("lhb", home)]) else None
            watch.observe(LAUNCHER, None if beat is None else beat.decode(errors="replace"), now)
        silent = dict(watch.silent(now))
        if peer not in silent:
            if node is not None and watch.quiet(LAUNCHER, now) > self.timeout_s * LAUNCHER_LOST:
                return self._launcher_lost(gen, members, peer, node, watch.quiet(LAUNCHER, now))
            return None
        length = silent[peer]
        if peer in self.gens.dead() or self.gens.complete():
            return None  # already declared (its launcher saw it go), or the job is over and it left
        if home is not None and watch.quiet(LAUNCHER, now) <= self.timeout_s * NODE_LAUNCHER_QUIET:
            if vouched_running(beat, peer):  # starved of the GIL, or stuck: the hang detector's, not a death
                if (gen, peer) not in self._vouched:
                    self._vouched.add((gen, peer))
                    logger.warning("%s: process %d sent no heartbeat for %.1f s (detector.timeout_s %g), but its "
                                   "launcher vouches it running in the kernel: not declared (a process stuck alive "
                                   "is the hang detector's: detector.hang_timeout_s)", self.gens.name, peer, length,
                                   self.timeout_s)
                return None
        lost = (peer,)
        # on this node, or its node's launcher beats here: declared, it is killed (it cannot go on elsewhere)
        known = self._node_of(peer) is not None
        vouched: tuple[int, ...] = (peer,) if known else ()
        if node is not None and watch.quiet(LAUNCHER, now) > self.timeout_s * NODE_LAUNCHER_QUIET:
            lost = tuple(sorted(p for p in members if self._node_of(p) == node)) or lost
            vouched = ()
        if not self._leaves_majority(gen, self.state()[1], lost, vouched=vouched):
            return None
        if len(lost) > 1:
            reason = (f"node {node} is lost: process {peer} sent no heartbeat for {length:.1f} s (detector.timeout_s "
                      f"{self.timeout_s:g}) and its launcher none for {watch.quiet(LAUNCHER, now):.1f} s")
            logger.error("%s: %s: declaring its process(es) %s dead together", self.gens.name, reason, list(lost))
        else:
            reason = f"process {peer} sent no heartbeat for {length:.1f} s (detector.timeout_s {self.timeout_s:g})"
            logger.error("%s: %s: declaring it dead (its launcher kills it)", self.gens.name, reason)
        last_beat = Fault(time.time() - length, f"last heartbeat of process {peer} seen by {self.gens.name}")
        record = self.gens.report_death(lost, kind="silent", reason=reason, fault=last_beat, generation=gen)
        if record is not None and self.gens.won(record):
            self.decisions.append(record)
        return record

    def _launcher_lost(self, gen: int, members: frozenset[int], peer: int, node: str,
                       quiet: float) -> Optional[GenerationFailure]:
        """``node``'s launcher sent no beat for :data:`LAUNCHER_LOST` x ``detector.timeout_s`` while its process
        ``peer`` beats: the node is lost whole (nobody there sees its processes' exits, vouches for them or kills
        them; a SIGSTOPped launcher costs its node). Every process of it is declared in one decision."""
        dead = self.gens.dead()
        lost = tuple(sorted(p for p in members if self._node_of(p) == node and p not in dead))
        if not lost or self.gens.complete() or not self._leaves_majority(gen, self.state()[1], lost):
            return None
        reason = (f"node {node} is lost: its launcher sent no beat for {quiet:.1f} s ({LAUNCHER_LOST:g} x "
                  f"detector.timeout_s {self.timeout_s:g}), though process {peer} beats: nobody on it vouches for "
                  "its processes or kills them")
        logger.error("%s: %s: declaring its process(es) %s dead together", self.gens.name, reason, list(lost))
        seen = Fault(time.time() - quiet, f"last beat of node {node}'s launcher seen by {self.gens.name}")
        record = self.gens.report_death(lost, kind="silent", reason=reason, fault=seen, generation=gen)
        if record is not None and self.gens.won(record):
            self.decisions.append(record)
        return record

    def _hang(self, gen: int, active: Mapping[int, int], now: float) -> Optional[GenerationFailure]:
        if self.hang_timeout_s is None:
            return None
        if self._clock[0] != gen:
            self._clock = (gen, ProgressClock(self.hang_timeout_s))
        clock = self._clock[1]
        clock.observe(self.progress(), now)
        stalled = clock.stalled(now)
        if stalled is None:
            return None
        procs = sorted(active)
        values = self.gens.store.multi_get([key("hb", p) for p in procs])
        tags: dict[int, Tag] = {}
        for p, raw in zip(procs, values):
            hb = parse_heartbeat(raw)
            if hb is not None and hb[1] == gen and hb[2][2] != PAUSED:
                tags[p] = hb[2]
        blame = laggards(tags)
        # a lagging tag is a suspicion: it may name the larger side of a cut of the ranks' network (the smaller side
        # got one more progress mark before the cut), which must never be evicted by the smaller one. Laggards that
        # would leave no majority of the members are not blamed: who is cut off from whom is then the reach probe's
        if blame and not self._leaves_majority(gen, self.state()[1], blame, quiet=True):
            if (gen, blame) not in self._no_minority:  # said once: the probe's answer may take several rounds
                self._no_minority.add((gen, blame))
                logger.warning("%s: the lagging process(es) %s are no minority of generation %d: asking who reaches "
                               "whom instead", self.gens.name, list(blame), gen)
            blame = ()
        if blame:
            where = ", ".join(f"process {p} (rank {active[p]}) at {tags[p][2]} #{tags[p][0]}" for p in blame)
            reason = (f"no progress for {stalled:.1f} s (detector.hang_timeout_s {self.hang_timeout_s:g}); lagging: "
                      f"{where}")
            self.gens.record_fault(gen, Fault(time.time() - stalled, f"last progress seen by {self.gens.name}"))
            return self._decide(gen, kind="hung", culprits=blame, reason=reason)
        cut, complete = self._reach.blame(gen, procs)
        if cut:
            reason = (f"no progress on any rank for {stalled:.1f} s (detector.hang_timeout_s {self.hang_timeout_s:g}) "
                      f"and process(es) {list(cut)} unreachable from a majority over the ranks' network")
            self.gens.record_fault(gen, Fault(time.time() - stalled, f"last progress seen by {self.gens.name}"))
            return self._decide(gen, kind="hung", culprits=cut, reason=reason)
        if not complete and stalled < 2 * self.hang_timeout_s:
            return None  # the others' reports may still come
        reason = (f"no progress on any rank for {stalled:.1f} s (detector.hang_timeout_s {self.hang_timeout_s:g}), "
                  "every progress tag equal: the same ranks re-form")
        self.gens.record_fault(gen, Fault(time.time() - stalled, f"last progress seen by {self.gens.name}"))
        return self._decide(gen, kind="hang_all", culprits=(), reason=reason)

    def _decide(self, gen: int, *, kind: str, culprits: tuple[int, ...], reason: str) -> Optional[GenerationFailure]:
        """Record the failure; if this record is the one that stands, declare the culprits dead (their launchers
        kill them). The record that stands (maybe another process's) is returned either way. The culprits are
        suspected, not seen to exit: they count in the majority's denominator (their launchers would kill them once
        declared, but a smaller side must not be the one that declares)."""
        if culprits and not self._leaves_majority(gen, self.state()[1], culprits):
            return None
        record = self.gens.fail(gen, kind=kind, ranks=culprits, reason=reason)
        if self.gens.won(record):
            self.decisions.append(record)
            if culprits:
                self.gens.declare_dead(culprits, f"{kind}: {reason}")
            logger.error("%s: generation %d failed (%s): %s", self.gens.name, gen, kind, reason)
        return record
