"""The launchers' restart rendezvous, and the nodes that will not come to it.

When in-process recovery gives up, every launcher restarts its processes together with the others: each joins the
next attempt's rendezvous (its node appended to ``joined``, read as a set: a join written again after a failover,
or retried, counts once; :mod:`~neighbor_ckpt.inprocess.launch_counts`; the process indices it restarts under
``joined/<node>``) and waits until every launcher of the launch joined. A launcher that moves to a new store during
the rendezvous writes its join there again (the launcher's failover handler, :meth:`RestartRendezvous.rejoin`), so a
failover keeps every launcher's join. A node lost for good (its launcher SIGKILLed with its processes, or cut off
from the majority by a partition) never joins: waiting for it would cost ``--rendezvous-timeout`` (300 s) and then
end the job. So the rendezvous also watches the launchers that have not joined: a node of the previous attempt is
**lost** when its launcher's heartbeat there (``lhb/<node>``, which a live launcher keeps beating until it joined)
has stood still for ``detector.timeout_s`` as this launcher watched it, and every process of it (``launcher/<node>``)
is listed in the previous attempt's ``dead`` (the detectors declared them: :mod:`~neighbor_ckpt.inprocess.monitor`'s
lost node); or, when the job gave up before a detector could declare them, for ``detector.timeout_s`` plus the
launcher's store timeout (a live launcher stuck in one store operation beats again within it). A launcher that
never wrote to this store at all (the store moved while it was cut off: a live one writes its part on the promoted
store at once, :meth:`~neighbor_ckpt.inprocess.launcher.Launcher._on_failover`) is lost after that bound too, as
this launcher watched. Once every launcher of the launch has joined or is lost:

* the launchers that joined are not a majority of the launch's (less the nodes lost for good at an earlier restart,
  and the lost nodes that the previous attempt's last generation had left out: only a majority forms a generation,
  as only a majority restarts): this side may be the one cut off, and a minority must never restart the job (the
  majority rules of :mod:`~neighbor_ckpt.inprocess.quorum`): one line containing
  :data:`~neighbor_ckpt.inprocess.quorum.CUT_OFF`, and the launcher exits
  :data:`~neighbor_ckpt.inprocess.protocol.EXIT_CUT_OFF` (:attr:`RestartRendezvous.cut_off`);
* else enough processes are left for the job's ranks (the spares cover the lost nodes: the processes left are those
  the joined launchers restart), or ``neighbor_ckpt.elastic.enabled`` (a smaller data-parallel size): the restart
  goes on without the lost nodes, whose processes are declared dead in the new attempt before it starts (one
  launcher claims each node: ``lost/<node>``), so no barrier waits for them;
* else: one line naming the lost node(s) and the setting to change, and the launcher exits
  (:data:`~neighbor_ckpt.inprocess.launcher.EXIT_LAUNCHER_ERROR`), every launcher alike, without the timeout. The
  first launcher to reach that verdict writes it (``stop``, first write wins) and every other launcher of the
  rendezvous takes it at its next look, so none of them is still watching when the store goes away; each one that
  stops says so (``stopped``), and the launcher hosting the store in use keeps it up until every launcher that joined
  has (:meth:`RestartRendezvous.wait_stopped`, bounded). Without that, a launcher whose own watch had not yet reached
  the verdict lost the store with the first one's exit, and took itself for cut off (exit 79, where its peers said 1).

The decisions are pure (:class:`LostNodes`, :func:`restart_verdict`, :func:`rendezvous_verdict`);
:class:`RestartRendezvous` runs them against the store through the launcher's bounded calls.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from neighbor_ckpt.inprocess.generation import GenerationStore, parse_dead
from neighbor_ckpt.inprocess.protocol import key
from neighbor_ckpt.inprocess.quorum import CUT_OFF, majority

__all__ = ["LostNodes", "restart_verdict", "rendezvous_verdict", "parse_nodes", "RestartRendezvous", "Verdict",
           "wait_said"]

logger = logging.getLogger(__name__)

STOP, STOPPED = "stop", "stopped"
"""The restart's stop verdict (first write wins), and the launchers that took it (``node,`` each)."""


def parse_nodes(raw: bytes | str | None) -> list[str]:
    """``"node0,node2,"`` -> ``["node0", "node2"]`` (an append-only list of node ids, each once, in order)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else (raw or "")
    out: list[str] = []
    for node in text.split(","):
        if node.strip() and node.strip() not in out:
            out.append(node.strip())
    return out


@dataclass
class LostNodes:
    """How long each launcher's heartbeat has stood still, as this launcher watched it (pure: times are passed in)."""

    timeout_s: float
    """``detector.timeout_s``: a launcher silent for longer, every process of its node declared dead, is gone."""
    bound_s: float
    """A launcher silent for longer is gone even if its processes were not all declared dead (a node lost while
    the job gave up: everyone left before a detector could declare them): a live launcher beats again within one
    store operation's timeout, so ``detector.timeout_s`` + the launcher's store timeout."""
    _seen: dict[str, tuple[Optional[str], float]] = field(default_factory=dict)

    def observe(self, node: str, beat: Optional[str], now: float) -> None:
        last = self._seen.get(node)
        if last is None or last[0] != beat:
            self._seen[node] = (beat, now)

    def lost(self, candidates: Sequence[str], *, processes: Mapping[str, Sequence[int]],
             dead: Mapping[int, str], now: float) -> tuple[str, ...]:
        """The ``candidates`` (nodes that have not joined) whose launcher has been silent for ``timeout_s`` with every
        one of their ``processes`` in ``dead``, or for ``bound_s`` whatever their processes (also a launcher whose
        record is not on this store: observed with no beat from this launcher's first look on)."""
        out = []
        for node in candidates:
            seen = self._seen.get(node)
            procs = processes.get(node)
            if seen is None:
                continue
            quiet = now - seen[1]
            if quiet > self.bound_s or (quiet > self.timeout_s and procs is not None and all(p in dead for p in procs)):
                out.append(node)
        return tuple(out)


@dataclass(frozen=True)
class Verdict:
    """What the restart does about lost nodes (pure)."""

    go_on: bool
    message: str
    cut_off: bool = False
    """The launchers that joined are not a majority: this side may be the one cut off (it must not restart)."""


def restart_verdict(*, lost: Mapping[str, Sequence[int]], processes: int, spares: int, elastic: bool) -> Verdict:
    """Go on without the ``lost`` nodes (node -> its process indices) when the processes left cover the job's
    ``processes - spares`` ranks, or ``elastic`` lets the job go on at a smaller data-parallel size; else say which
    nodes are gone and what to set."""
    gone = sorted({p for procs in lost.values() for p in procs})
    left, ranks = processes - len(gone), processes - spares
    names = ", ".join(sorted(lost))
    if left >= ranks:
        return Verdict(True, f"node(s) {names} lost for good (processes {gone}): the restart goes on without them, "
                             f"{left} processes for {ranks} ranks (spares take their places)")
    if elastic:
        return Verdict(True, f"node(s) {names} lost for good (processes {gone}): the restart goes on without them, "
                             f"{left} processes for the job's {ranks} ranks: a smaller data-parallel size "
                             "(neighbor_ckpt.elastic.enabled)")
    return Verdict(False, f"node(s) {names} lost for good (processes {gone}; their launcher silent for "
                          "detector.timeout_s): the job's {ranks} ranks need {need} more process(es) than the {left} "
                          "left; set neighbor_ckpt.elastic.enabled: true to go on at a smaller data-parallel size, "
                          "or add spare nodes (neighbor_ckpt.inprocess.spares)".format(ranks=ranks, left=left,
                                                                                        need=ranks - left))


def rendezvous_verdict(*, launchers: int, lost_before: Mapping[str, Sequence[int]],
                       joined: Mapping[str, Sequence[int]], lost: Mapping[str, Sequence[int]], processes: int,
                       spares: int, elastic: bool, members: Optional[frozenset[int]] = None
                       ) -> tuple[Verdict, dict[str, tuple[int, ...]]]:
    """The restart's verdict once every launcher of the launch joined or is lost (pure).

    Args:
        launchers: the launch's launchers (``--nodes``).
        lost_before: the nodes lost for good earlier (an earlier restart, the start's roll call) -> their processes:
            out of the quorum set (a majority decided it, or they never came).
        joined: the launchers that joined -> the process indices each restarts.
        lost: the nodes found lost now -> their processes as far as known (their launcher's record; empty for a
            launcher never seen on this store); every process the joined launchers do not restart is lost with
            them, whichever node held it.
        processes, spares, elastic: the launch's.
        members: the last generation of the previous attempt that formed, its members (idle spares included); None
            when none formed. A lost node none of whose recorded processes is among them had left the quorum set
            already (a generation, which only a majority forms, went on without it).

    Returns:
        the verdict, and the nodes lost now -> their processes (what the new attempt declares dead).
    """
    left_out = [n for n, procs in lost.items() if members is not None and procs and not members.intersection(procs)]
    quorum = launchers - len(lost_before) - len(left_out)
    if len(joined) < majority(range(quorum)):
        return Verdict(False, f"only {len(joined)} of the {quorum} launcher(s) joined ({', '.join(sorted(joined))}) "
                              f"and the others are silent: {CUT_OFF} (not a majority: this side may be the one cut "
                              "off), not restarting", cut_off=True), {}
    held = {p for procs in joined.values() for p in procs} | {p for procs in lost_before.values() for p in procs}
    gone = set(range(processes)) - held
    now: dict[str, tuple[int, ...]] = {}
    for node in sorted(lost):
        now[node] = tuple(sorted(gone.intersection(lost[node]) - {p for v in now.values() for p in v}))
    rest = tuple(sorted(gone - {p for v in now.values() for p in v}))
    if rest and now:  # processes whose node's record did not list them (exited before it was written): the first's
        first = sorted(now)[0]
        now[first] = tuple(sorted((*now[first], *rest)))
    return restart_verdict(lost={**lost_before, **now}, processes=processes, spares=spares, elastic=elastic), now


def wait_said(call: Callable[[int, Callable[[Any], Any]], Any], attempt: int, *, listed: str, said: str,
              bound_s: float, poll_s: float, but: Sequence[str] = ()) -> bool:
    """Wait until every node of the node list ``listed`` (less ``but``) is in the node list ``said`` too, both under
    ``attempt``'s prefix (``call``: the launcher's bounded call), or ``bound_s`` passed: True when they all are. What
    the launcher hosting the store in use waits for before it exits, taking the store with it (the others' ``left``
    once the job completed, their ``stopped`` when a restart stops)."""
    deadline = time.monotonic() + bound_s
    while True:
        got = call(attempt, lambda s: [parse_nodes(s.get(k) if s.check([k]) else None) for k in (listed, said)])
        if got is not None and set(got[0]) - set(but) <= set(got[1]):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(max(poll_s, 0.05))


class RestartRendezvous:
    """One launcher's side of the restart rendezvous (see the module docstring).

    Args:
        node: this launcher's node id.
        nodes: the launchers of the launch.
        indices: the process indices this launcher starts in each attempt.
        call: ``call(attempt, fn)``: ``fn(store)`` under that attempt's prefix; None when no store answers.
        later: ``later(attempt, fn)``: a write that must reach the store (queued while none answers).
        pending: whether queued writes are still waiting for a store.
        beat: ``beat(attempt)``: this launcher's heartbeat under that attempt's prefix.
        timeout_s, store_timeout_s, poll_s, rendezvous_timeout_s, processes, spares, elastic: the launcher's plan.
        stopped: whether the launcher was signalled (it stops waiting).
        store_lost: whether the store has not answered for ``--store-grace``.
    """

    def __init__(self, *, node: str, nodes: int, indices: Sequence[int] = (),
                 call: Callable[[int, Callable[[Any], Any]], Any],
                 later: Callable[[int, Callable[[Any], Any]], None], pending: Callable[[], bool],
                 beat: Callable[[int], None], timeout_s: float, store_timeout_s: float, poll_s: float,
                 rendezvous_timeout_s: float,
                 processes: int, spares: int, elastic: bool, stopped: Callable[[], bool],
                 store_lost: Callable[[], bool]) -> None:
        self.node, self.nodes, self.indices = node, nodes, tuple(indices)
        self._call, self._later, self._pending, self._beat = call, later, pending, beat
        self.timeout_s, self.poll_s, self.rendezvous_timeout_s = timeout_s, poll_s, rendezvous_timeout_s
        self.store_timeout_s = store_timeout_s
        self.processes, self.spares, self.elastic = processes, spares, elastic
        self._stopped, self._store_lost = stopped, store_lost
        self.lost: dict[str, tuple[int, ...]] = {}
        """The nodes lost for good so far (node -> its process indices): not waited for by later restarts."""
        self.joining: Optional[int] = None
        """The attempt whose rendezvous this launcher joined last (its join is written again after a failover)."""
        self.cut_off = False
        """Set when the last rendezvous ended without a majority of the launchers (this side may be cut off)."""

    def announce(self, attempt: int) -> None:
        """This node takes part in ``attempt`` (``nodes``: the nodes a later rendezvous looks for)."""
        me = self.node
        self._later(attempt, lambda s: s.append("nodes", f"{me},"))

    def to_declare(self, attempt: int) -> list[int]:
        """The processes of the lost nodes this launcher claimed for ``attempt`` (``lost/<node>``, first claim
        wins): it declares them dead in that attempt before anything starts."""
        me, out = self.node, []
        for node, procs in sorted(self.lost.items()):
            won = self._call(attempt, lambda s, n=node: s.compare_set(key("lost", n), "", me))
            if won is not None and won.decode(errors="replace") == me:
                out.extend(procs)
        return out

    def rejoin(self, store: Any) -> None:
        """This launcher's join (``store``: under the attempt's prefix): the processes it restarts, then its node in
        ``joined`` (a node listed there has its processes written). Idempotent: written again after a failover."""
        store.set(key("joined", self.node), json.dumps(list(self.indices)))
        store.append("joined", f"{self.node},")

    def meet(self, number: int) -> bool:
        """Join attempt ``number`` and wait for every launcher, going on without the nodes lost for good when the
        job can; False when it cannot (said in one line; :attr:`cut_off` when no majority joined) or the wait timed
        out."""
        prev = number - 1
        want = self.nodes - len(self.lost)
        self.joining, self.cut_off = number, False
        self._later(number, self.rejoin)
        watch = LostNodes(self.timeout_s, bound_s=self.timeout_s + self.store_timeout_s)
        deadline = time.monotonic() + self.rendezvous_timeout_s
        joined = 0
        while not self._stopped():
            self._beat(prev)  # the others judge this launcher alive by its beat under the previous attempt
            if not self._pending():
                seen = self._call(number, lambda s: (parse_nodes(s.get("joined") if s.check(["joined"]) else None),
                                                     s.get(STOP).decode(errors="replace") if s.check([STOP]) else None))
                joined = len(seen[0]) if seen is not None else joined
                if seen is not None and seen[1] is not None:  # another launcher's verdict: every launcher stops alike
                    logger.error("restart %d: %s", number, seen[1])
                    return self._stopped_here(number)
                if joined >= want:
                    return True
                verdict = self._look(prev, number, watch)
                if verdict is not None:
                    (logger.warning if verdict.go_on else logger.error)("restart %d: %s", number, verdict.message)
                    self.cut_off = verdict.cut_off
                    if not verdict.go_on and not verdict.cut_off:  # a minority's verdict binds nobody else
                        self._call(number, lambda s: s.compare_set(STOP, "", verdict.message))
                        return self._stopped_here(number)
                    return verdict.go_on
            if time.monotonic() > deadline or self._store_lost():
                logger.error("restart %d: only %d of %d launcher(s) joined within %.0f s: not restarting", number,
                             joined, want, self.rendezvous_timeout_s)
                return False
            time.sleep(max(self.poll_s, 0.1))
        return False

    def _stopped_here(self, number: int) -> bool:
        """This launcher stops at restart ``number`` (the ``stop`` verdict): it says so in ``stopped``."""
        me = self.node
        self._call(number, lambda s: s.append(STOPPED, f"{me},"))
        return False

    def wait_stopped(self, number: int, bound_s: float) -> None:
        """Until every launcher that joined restart ``number`` said it stops, or ``bound_s``: the launcher hosting the
        store in use waits for it before it exits (taking the store with it)."""
        if not wait_said(self._call, number, listed="joined", said=STOPPED, bound_s=bound_s, poll_s=self.poll_s):
            logger.warning("restart %d: not every launcher said it stops within %.0f s: exiting anyway", number,
                           bound_s)

    def leave(self, attempt: int, *, hosting: bool, reachable: bool, bound_s: float) -> None:
        """The job completed and every process of this node exited. ``hosting`` the store in use: wait until every
        other launcher of ``attempt`` left, at most ``bound_s`` (they and their idle spares read ``complete`` there;
        a lost node never leaves). Else say this launcher leaves (``left``) if the store is ``reachable``."""
        me = self.node
        if hosting:
            wait_said(self._call, attempt, listed="nodes", said="left", but=(me,), bound_s=bound_s, poll_s=self.poll_s)
        elif reachable:
            self._call(attempt, lambda s: s.append("left", f"{me},"))

    def _look(self, prev: int, number: int, watch: LostNodes) -> Optional[Verdict]:
        """One look at the launchers of the launch that have not joined ``number`` (those of attempt ``prev`` on
        this store, and those never seen on it): the verdict once every one of them is lost, else None."""
        def read(s: Any) -> tuple[list[str], dict[int, str], dict[str, Optional[str]], dict[str, tuple[int, ...]],
                                  Optional[frozenset[int]]]:
            nodes = parse_nodes(s.get("nodes") if s.check(["nodes"]) else None)
            dead = parse_dead(s.get("dead") if s.check(["dead"]) else None)
            beats: dict[str, Optional[str]] = {}
            procs: dict[str, tuple[int, ...]] = {}
            for n in nodes:
                k = key("lhb", n)
                beats[n] = s.get(k).decode(errors="replace") if s.check([k]) else None
                r = key("launcher", n)
                if s.check([r]):
                    procs[n] = tuple(int(p) for p in json.loads(s.get(r)).get("processes", []))
            gens = GenerationStore(s, process=-1)
            formed = next((m for m in (gens.members(g) for g in range(gens.current(), -1, -1)) if m is not None), None)
            return nodes, dead, beats, procs, None if formed is None else formed.members

        def joins(s: Any) -> dict[str, Optional[tuple[int, ...]]]:
            names = parse_nodes(s.get("joined") if s.check(["joined"]) else None)
            return {n: tuple(json.loads(s.get(key("joined", n)))) if s.check([key("joined", n)]) else None
                    for n in names}

        got = self._call(prev, read)
        joined = self._call(number, joins)
        if got is None or joined is None:
            return None
        nodes, dead, beats, procs, members = got
        now = time.monotonic()
        missing = [n for n in nodes if n not in joined and n not in self.lost]
        known = set(nodes) | set(joined)
        absent = self.nodes - len(self.lost) - len(known - set(self.lost))  # launchers never seen on this store
        unseen = [f"unseen{number}.{i}" for i in range(max(0, absent))]
        for n in missing:
            watch.observe(n, beats.get(n), now)
        for n in unseen:
            watch.observe(n, None, now)  # never on this store: silent from this launcher's first look on
        missing += unseen
        if not missing or any(v is None for v in joined.values()):
            return None
        lost = watch.lost(missing, processes=procs, dead=dead, now=now)
        if len(lost) < len(missing):
            return None
        verdict, found = rendezvous_verdict(
            launchers=self.nodes, lost_before=self.lost, joined={n: v or () for n, v in joined.items()},
            lost={n: procs.get(n, ()) for n in lost}, processes=self.processes, spares=self.spares,
            elastic=self.elastic, members=members)
        if verdict.go_on:
            self.lost.update(found)
        return verdict
