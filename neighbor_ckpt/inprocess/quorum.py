"""The majority rules of a launch cut in two (a network partition), on both sides of the cut.

A cut that leaves both sides running must never leave two trainings under one job. The rules (the argument:
:mod:`neighbor_ckpt.inprocess.generation`):

* **Quorum set**: the last generation's members (idle spares included) less those whose exit a launcher saw
  (:func:`~neighbor_ckpt.inprocess.generation.exited`); for the launchers, every node of the launch.
* **Declare only with a majority left** (:func:`majority_left`): a detector never declares peers dead when the
  processes it would leave are not a majority of the quorum set, so a minority that still reaches the store does not
  re-form with its spares. A peer whose own launcher still beats on this store is not counted against: declared, it
  is killed by that launcher (it cannot go on elsewhere).
* **The cut-off lease** (:class:`MajorityLease`, :class:`LeaseGuard`): a process or launcher that has not seen a
  majority of its quorum set for :func:`cut_off_lease_s` logs one line containing :data:`CUT_OFF`, writes nothing
  more and exits with :data:`~neighbor_ckpt.inprocess.protocol.EXIT_CUT_OFF` (:func:`cut_off`), before the majority
  can declare it dead. "Seen" is a heartbeat that changed on the store it follows (``hb/<p>``; or, for a process,
  its node's launcher's ``lhb/<node>``). A client whose store does not answer is *in doubt* (the store may be the
  one cut off, with the majority moving to a standby): it waits, bounded, for a store promoted by a majority of the
  launchers, and is cut off when none comes; meanwhile nothing it would write reaches a store, and its training is
  blocked on the cut (every step needs every rank).

Pure rules first (:func:`majority_left`, :class:`MajorityLease`), then the thread that applies the lease.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional

from neighbor_ckpt.config import LEASE_TICK_S
from neighbor_ckpt.inprocess.protocol import EXIT_CUT_OFF

__all__ = ["CUT_OFF", "cut_off_lease_s", "lease_precedes_decision", "launcher_lease_s", "majority", "majority_left",
           "MajorityLease", "LeaseGuard", "LauncherLease", "cut_off", "guard_times"]

logger = logging.getLogger(__name__)

CUT_OFF = "cut off from the majority"
"""The words of the one line a process or launcher logs when it stops itself (tests and operators grep for it)."""


def cut_off_lease_s(timeout_s: float, interval_s: float, tick_s: float = LEASE_TICK_S) -> float:
    """The lease L: how long a process may go without seeing a majority, for a job whose ``detector.timeout_s`` (T)
    and ``detector.interval_s`` (I) are given: ``T - I - 2 tick``, 3.8 s at the defaults (5 s, 1 s), 1.55 s in the
    shipped CPU job files (2 s, 0.25 s). The argument (docs/timeouts.md): a process beats and looks once a round
    (:class:`~neighbor_ckpt.inprocess.monitor.Monitor`), every ``I``; let ``b`` be its last round before a cut at
    ``c``. Its beat of that round reached the store, so the majority declares it no earlier than ``b + T``.

    * **the renewal is no later than b**: a look that sees a majority's beats changed renews the lease as of the look
      *before* it (:meth:`MajorityLease.observe`): those beats were written after that look. Beats written before
      ``c`` are seen at the latest by the first look after ``c`` (``b + I``), which stamps ``b``: ``r <= b``;
    * **the cut-off comes first**: the guard cuts the process off once a look the store answered finds the lease
      expired (:meth:`LeaseGuard.check`): the first look after ``r + L``, within ``I``, then the guard's ``tick``. The
      process stops by ``b + L + I + tick``, which is before ``b + T`` when ``L < T - I - tick``; ``L`` leaves one
      more tick;
    * **a healthy majority keeps it**: each look sees every live member's beat of the round changed, stamped one look
      back: the renewal lags by less than ``2I``, so ``L`` must exceed ``2I``.

    L is as long as the first inequality allows, so that a healthy process whose peers' rounds a loaded machine delays
    does not stop itself (a false cut-off costs a healthy process). The second leaves at least a tick of slack exactly
    when ``T >= 3I + 3 tick``, which the configuration checks (:class:`~neighbor_ckpt.config.NeighborCkptConfig`) and
    :func:`lease_precedes_decision` states."""
    return timeout_s - interval_s - 2 * tick_s


def lease_precedes_decision(timeout_s: float, interval_s: float, tick_s: float = LEASE_TICK_S) -> bool:
    """Whether a process cut off from the majority stops before the majority may declare it, and a healthy majority
    renews the lease in time with a tick to spare (pure): the two inequalities of :func:`cut_off_lease_s`."""
    lease, eps = cut_off_lease_s(timeout_s, interval_s, tick_s), 1e-9 * max(1.0, timeout_s)  # the bound is accepted
    return lease + interval_s + tick_s < timeout_s and lease + eps >= 2 * interval_s + tick_s


def majority(quorum_set: Iterable[int]) -> int:
    """More than half of ``quorum_set``."""
    return len(frozenset(quorum_set)) // 2 + 1


def majority_left(members: Iterable[int], *, dead: Iterable[int], lost: Iterable[int], exited: Iterable[int],
                  vouched: Iterable[int] = (), alive: Optional[Iterable[int]] = None) -> bool:
    """Whether declaring ``lost`` dead leaves a majority of the quorum set (pure). ``members``: the generation's;
    ``dead``: declared already; ``exited``: gone for sure (a launcher saw the exit); ``vouched``: processes whose own
    launcher beats on this store (declared, they are killed: gone for sure too); ``alive``: the members seen lately
    (None: every member not declared), only those count as left."""
    members = frozenset(members)
    gone = frozenset(exited) | (frozenset(vouched) & frozenset(lost))
    left = members - frozenset(dead) - frozenset(lost) - frozenset(exited)
    if alive is not None:
        left &= frozenset(alive)
    return len(left) >= majority(members - gone)


class MajorityLease:
    """When this client last saw a majority of its quorum set (pure: times are given).

    :meth:`observe` takes what a look read for each member of the quorum set (its heartbeat text, with its node's
    launcher's beat for a process: any change counts); the client itself counts as seen at each look (a look is a
    store round trip that answered). A change is stamped with the time of the look *before* the one that saw it: the
    member wrote it after that, so it was alive then, and no later time is known. The first look (and the first after
    a :meth:`restart`) only learns the values: when they were written is not known. :meth:`renewed` is the latest
    time at which a majority was known alive (the majority-th latest stamp).

    The lease is armed once a majority is first seen, or when the client's first generation formed (:meth:`arm`:
    every member had arrived, and beats); before that (the others still starting) it never expires.
    """

    def __init__(self, lease_s: float, *, me: object, now: float, stamp_seen: bool = False) -> None:
        self.lease_s, self.me = lease_s, me
        self.stamp_seen = stamp_seen
        """Stamp a change when the look saw it, not one look back: the launchers' lease, which guards the launcher's
        own acts (its processes stop on their own lease, which is the provable one) and keeps the slack of a whole
        look for a launcher's loop that a loaded machine delays."""
        self._last: dict[object, tuple[object, float]] = {}
        self._renewed = now
        self._looked: Optional[float] = None
        """When the previous look was made (None: no look yet on this store, the next one only learns the values)."""
        self._provisional = False
        """The renewal is a move's grace (:meth:`restart`), replaced by the first majority seen on the new store."""
        self.armed = False
        self._over = False
        self.learning = False
        """The last look came after a gap (:meth:`after_gap`): it only learnt the values."""

    def arm(self, now: float) -> None:
        """The client's first generation formed at ``now``: every member had arrived (and beats), so the lease runs
        from here even if no look has seen a majority yet."""
        if not self._over and not self.armed:
            self.armed, self._renewed = True, max(self._renewed, now)

    def disarm(self) -> None:
        """The job completed: the others leave, and that is no cut; the lease never expires again."""
        self.armed, self._over = False, True

    def restart(self, until: float) -> None:
        """A fresh start after a move to another store (every beat starts again there): the lease holds until
        ``until`` (the peers' time to follow), or until a majority is seen on the new store, whichever comes first."""
        self._last.clear()
        self._looked = None
        self._renewed, self._provisional = max(self._renewed, until), True

    def observe(self, quorum_set: Iterable[object], seen: Mapping[object, object], now: float) -> bool:
        """One look: ``seen`` maps members to what was read for them (absent: nothing read). True when a majority
        of ``quorum_set`` has been seen within the lease, counting this look."""
        members = frozenset(quorum_set) | {self.me}
        self.learning = self.after_gap(now)
        if self.learning:
            self._looked = None
        since = now if self.stamp_seen else (-math.inf if self._looked is None else min(self._looked, now))
        for p, value in seen.items():
            old = self._last.get(p)
            if old is None or old[0] != value:
                self._last[p] = (value, since)
        self._last[self.me] = (None, now)
        self._looked = now
        stamps = sorted((self._last[p][1] for p in members if p in self._last), reverse=True)
        need = majority(members)
        if len(stamps) >= need and now - stamps[need - 1] <= self.lease_s:
            seen_at = stamps[need - 1]
            self._renewed = seen_at if self._provisional else max(self._renewed, seen_at)
            self._provisional, self.armed = False, not self._over
            return True
        return False

    def after_gap(self, now: float) -> bool:
        """Whether a look at ``now`` comes more than the lease after this client's previous one (its thread starved
        of the GIL, its process stopped): such a look only learns the values, like the first one (:meth:`observe`),
        and decides nothing (the client does not count it as answered): it cannot tell when the changes it sees were
        written, and this client's own silence was no cut. The next look, one round later, renews or decides."""
        return not self.stamp_seen and self._looked is not None and now - self._looked > self.lease_s

    def fresh(self, now: float, within_s: float) -> set[object]:
        """The members seen within ``within_s`` of ``now`` (this client included)."""
        return {p for p, (_, when) in self._last.items() if now - when <= within_s} | {self.me}

    def renewed(self) -> float:
        return self._renewed

    def expires_at(self) -> float:
        return self._renewed + self.lease_s

    def expired(self, now: float) -> bool:
        return self.armed and now > self.expires_at()


def guard_times(stores: Any, timeout_s: float) -> tuple[float, float]:
    """:class:`LeaseGuard`'s ``doubt_s`` and ``grace_s`` for a client of ``stores`` (a
    :class:`~neighbor_ckpt.inprocess.stores.StoreSet`) in a job whose ``detector.timeout_s`` is ``timeout_s``. In
    doubt, a move is waited for as long as the failover takes: the lost operation and its second try, the wait for
    the launchers' promotion, the peers' move after it. After a move, the peers get the time a live one needs to
    follow, or ``timeout_s`` if longer (what the monitor allows them too)."""
    return (2 * stores.timeout_s + stores.promotion_wait_s + stores.move_bound_s,
            max(timeout_s, stores.move_bound_s))


def cut_off(name: str, why: str, *, exit: Callable[[int], None] = os._exit) -> None:  # noqa: A002
    """Stop now, writing nothing more: one log line, the streams flushed, ``os._exit`` (no finalizer, no ``atexit``,
    no clean-up of the training function: those write snapshots, insurance and reports)."""
    logger.error("%s: %s (%s): stopping without writing anything more; exiting with status %d", name, CUT_OFF, why,
                 EXIT_CUT_OFF)
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    exit(EXIT_CUT_OFF)


class LeaseGuard:
    """The lease applied (a daemon thread, ``neighbor_ckpt-inprocess-lease``): every ``tick_s`` it looks at the
    lease; once it has expired, the first look the store answers (``answered_at``: when the client's last look
    returned) decides: a look answered after the lease ran out saw no majority, and the client is cut off at once.
    Until one answers the client is in doubt (its store may be the one cut off, the majority moving to a standby):
    it waits up to ``doubt_s`` for a move to a promoted store (``epoch`` changes; the lease then holds for
    ``grace_s``, or until a majority is seen there) and is cut off when none comes. Neither the time of the last
    answer alone nor the renewal's tells the sides apart: a majority process that lost its store looked last just
    after its renewal, a minority process long after.

    Args:
        lease: the lease, renewed by the client's looks.
        answered_at: monotonic time of the last look that the store answered.
        epoch: the store epoch the client is on.
        name: who this is, for the line.
        stop: what cuts off (default :func:`cut_off`; tests and the launcher pass their own: a launcher stops its
            processes first).
        done: True once there is nothing to guard (the job completed): the guard ends.
        last_look: asked (bounded: one store operation) before a cut-off while the store answers: True when the
            job completed meanwhile (the others left because it is over): the guard ends instead.
    """

    def __init__(self, lease: MajorityLease, *, answered_at: Callable[[], float], epoch: Callable[[], int],
                 name: str, doubt_s: float, grace_s: float, tick_s: float = LEASE_TICK_S,
                 stop: Optional[Callable[[str], None]] = None, done: Callable[[], bool] = lambda: False,
                 lock: Optional[threading.Lock] = None, last_look: Callable[[], bool] = lambda: False) -> None:
        self.lease, self.answered_at, self.epoch, self.name = lease, answered_at, epoch, name
        self.doubt_s, self.grace_s, self.tick_s, self.done, self.last_look = doubt_s, grace_s, tick_s, done, last_look
        self.stop = stop or (lambda why: cut_off(name, why))
        self.lock = lock or threading.Lock()
        """Held by the client while it feeds the lease (a look and its verdict are one step)."""
        self._doubt: Optional[tuple[float, int]] = None
        self._doubt_said = False
        self._epoch = epoch()
        self._quit = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="neighbor_ckpt-inprocess-lease", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._quit.set()

    def _run(self) -> None:
        ticked = time.monotonic()
        while not self._quit.wait(self.tick_s):
            if self.done():
                return
            now = time.monotonic()
            gap, ticked = now - ticked, now
            if gap > self.lease.lease_s:  # this thread was starved too: the client's next look tells first
                continue
            verdict = self.check(now)
            if verdict is None:
                continue
            try:
                over = self.done() or self.last_look()
            except Exception as e:  # noqa: BLE001 - no answer: nothing says the job completed
                logger.debug("%s: the last look before the cut-off: %s", self.name, e)
                over = False
            if over:
                return
            self.stop(verdict)
            return

    def check(self, now: float) -> Optional[str]:
        """One look at the lease (pure but for the clocks it is given): why the client is cut off, or None."""
        with self.lock:
            epoch = self.epoch()
            if epoch != self._epoch:
                self._epoch, self._doubt, self._doubt_said = epoch, None, False
                self.lease.restart(now + self.grace_s)
                return None
            if not self.lease.expired(now):
                self._doubt, self._doubt_said = None, False
                return None
            quiet = now - self.lease.renewed()
            answered = self.answered_at()
            if answered >= self.lease.expires_at():
                # a look the store answered found no majority within the lease: this side is the one cut off
                return (f"no majority of the last generation seen for {quiet:.1f} s (the lease: "
                        f"{self.lease.lease_s:g} s) while the store answers")
            # No look has answered since the lease ran out: the next one tells (within a round), or the store is
            # lost (perhaps the one cut off, the majority moving to a standby): in doubt, wait for a promoted store.
            if self._doubt is None:
                self._doubt = (now, epoch)
            if not self._doubt_said and now - answered > self.lease.lease_s and not self.lease.learning:
                self._doubt_said = True
                logger.warning("%s: no majority seen for %.1f s and the store does not answer: waiting up to %.0f s "
                               "for a store promoted by a majority of the launchers", self.name, quiet, self.doubt_s)
            if now - self._doubt[0] > self.doubt_s:
                return (f"no majority seen for {quiet:.1f} s and no store promoted by a majority of the launchers "
                        f"within {self.doubt_s:.0f} s")
            return None


def launcher_lease_s(timeout_s: float, beat_s: float) -> float:
    """A launcher's lease: ``timeout_s + beat_s``, longer than its processes' (:func:`cut_off_lease_s`: they stop by
    ``T - tick`` after the cut). A launcher that cuts itself off stops its store host with it, and a minority's
    processes decide on a look their store answered after their own lease ran out: a store that went first would
    leave them in doubt, waiting for a promotion (a partition e2e saw a minority's spare wait so, then join the
    majority after the heal). The lease guards the launcher's own acts (a restart, a replacement), which a minority
    cannot make count (it forms no generation); it leaves a healthy launcher four beats and more of slack."""
    return timeout_s + beat_s


class LauncherLease:
    """A launcher's side of the rules (see the module docstring): its lease over the launchers' beats
    (``lhb/<node>``), renewed by :meth:`look` after each of its own beats, and the guard that stops its processes,
    then itself, when the lease runs out (unless the job completed: ``done``). The quorum set is the nodes of the
    last generation's members (every node of the launch until one formed): like the processes', it changes only
    through a generation that a majority formed, so nodes lost for good leave it once the survivors re-formed.

    Args:
        node: this launcher's node; nodes: how many nodes the launch has.
        timeout_s, beat_s: ``detector.timeout_s`` and the launchers' beat period.
        stores: the launcher's :class:`~neighbor_ckpt.inprocess.stores.StoreSet` (:func:`guard_times`).
        owner: the :class:`~neighbor_ckpt.inprocess.launcher.Launcher` (its current attempt's ``children`` are
            SIGKILLed first, by process group; its ``known_complete()``: the job completed, nothing to guard).
    """

    def __init__(self, *, node: str, nodes: int, timeout_s: float, beat_s: float, stores: Any, owner: Any) -> None:
        self.node, self.nodes, self.owner = node, nodes, owner
        self._base: Optional[frozenset[str]] = None
        self._based_on: Optional[tuple[object, int]] = None

        def done() -> bool:
            return bool(stores.over) or owner.known_complete()

        self.lease = MajorityLease(launcher_lease_s(timeout_s, beat_s), me=node, now=time.monotonic(),
                                   stamp_seen=True)
        self.answered_at = time.monotonic()
        doubt_s, grace_s = guard_times(stores, timeout_s)
        att = lambda: getattr(owner, "_att", None)  # noqa: E731

        def last_look() -> bool:  # once, on the current store: a failover here could outlast the cut and a heal
            from neighbor_ckpt.inprocess.protocol import launch_prefix

            a = att()
            return a is not None and bool(stores.once("last-look", launch_prefix(owner.plan.run_id, a.number))
                                          .check(["complete"]))

        self.guard = LeaseGuard(self.lease, answered_at=lambda: self.answered_at, epoch=lambda: stores.epoch,
                                name=f"launcher {node}", doubt_s=doubt_s, grace_s=grace_s, stop=self.stop, done=done,
                                last_look=last_look)

    def look(self, store: object, before: object = None) -> None:
        """One look at the launchers' beats, through ``store`` (a view under the attempt's prefix this launcher
        beats in) and ``before`` (the previous attempt's, during a restart: a launcher still stopping its processes
        or meeting the others beats there); raises what the store raises."""
        from neighbor_ckpt.inprocess.protocol import key
        from neighbor_ckpt.inprocess.restart_rendezvous import parse_nodes

        s: Any = store
        try:
            self._rebase(s)
            if self._base is not None:
                names, unknown = sorted(self._base - {self.node}), []
            else:
                names = [n for n in parse_nodes(s.get("nodes") if s.check(["nodes"]) else None) if n != self.node]
                unknown = [f"?{i}" for i in range(max(0, self.nodes - 1 - len(names)))]  # not announced (yet)
            views: list[Any] = [s] if before is None else [s, before]
            seen = {n: tuple(v.get(key("lhb", n)) if v.check([key("lhb", n)]) else None for v in views)
                    for n in names}
            seen = {n: v for n, v in seen.items() if any(x is not None for x in v)}
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            # a garbled record, or a key found on one store and asked of the next (a move in between: torch's
            # DistStoreError): no look this time
            logger.debug("launcher %s: a look at the launchers' beats: %s", self.node, e)
            return
        now = time.monotonic()
        with self.guard.lock:
            self.answered_at = now
            self.lease.observe([*names, *unknown, self.node], seen, now)

    def _rebase(self, s: Any) -> None:
        """The nodes of the current generation's members, once per generation (kept across a restart until the new
        attempt's first generation formed)."""
        import json

        from neighbor_ckpt.inprocess.protocol import key

        raw = s.get("gen") if s.check(["gen"]) else None
        g = int(raw) if raw else 0
        where = (getattr(s, "prefix", None), g)
        members_key = key("gen", g, "members")
        if where == self._based_on or not s.check([members_key]):
            return
        nodes = set()
        for p in json.loads(s.get(members_key))["members"]:
            rec = s.get(key("proc", p)) if s.check([key("proc", p)]) else None
            node = json.loads(rec).get("node") if rec else None
            if node is not None:
                nodes.add(str(node))
        if nodes:
            self._base, self._based_on = frozenset(nodes | {self.node}), where

    def stop(self, why: str) -> None:
        """Cut off: this launcher's processes first (SIGKILL: they write nothing more either), then itself."""
        import signal

        try:
            for child in list(getattr(getattr(self.owner, "_att", None), "children", {}).values()):
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            drop = getattr(self.owner, "drop_staged_slots", None)
            if drop is not None:  # os._exit runs no clean-up: the staged slots would stay in /dev/shm
                drop()
        except Exception as e:  # noqa: BLE001 - stopping anyway
            logger.warning("launcher %s: before the cut-off: %s", self.node, e)
        finally:
            cut_off(f"launcher {self.node}", why)
