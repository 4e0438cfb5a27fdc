"""A launcher that reaches no store: it says so at once, and the others go on without its processes.

**Its own side** (:func:`reach_any`): before anything else a launcher opens a plain TCP connection to the stores of
its list, in turn, until one accepts, for at most :attr:`~neighbor_ckpt.inprocess.launcher_plan.LauncherPlan.reach_s`
(the store timeout plus ``detector.timeout_s``); when none did, it exits
(:data:`~neighbor_ckpt.inprocess.protocol.EXIT_NO_STORE`) with one line naming every store it tried and why, and
starts nothing. A store that accepts but is slow to answer (its host still importing torch behind a socket bound for
it) is reached: the launcher's first store operation then waits ``--connect-timeout`` as before.

**The others' side** (:class:`RollCall`): the launchers of attempt 0 hold a roll call. Once a process of the launch
announced itself ready (its imports done: everything a launcher does before it appends its node to ``nodes`` takes
far less, so a launcher that could start has done so by then), and ``detector.timeout_s`` plus the store timeout
more have passed as this launcher watched, a launch with fewer launchers in ``nodes`` than ``--nodes`` has lost
the missing ones: the process indices that no launcher that came runs (``launcher/<node>``), that were not declared
dead and did not exit are declared dead (``exited: never started``), each by every launcher that sees it (the writes
are idempotent: :mod:`~neighbor_ckpt.inprocess.launch_counts`), but only by the launchers of a majority of the
launch's nodes: fewer may be the side of a cut that holds this store while the others promoted a standby and train
there, so such a launcher says it is ``cut off from the majority``, stops its processes and exits
(:data:`~neighbor_ckpt.inprocess.protocol.EXIT_CUT_OFF`), writing nothing (generation 0 needs a majority of every
process of the launch too: :func:`~neighbor_ckpt.inprocess.generation.quorum_set`). The spares take their ranks in
generation 0's barrier; when the processes left cannot cover the job's ranks, every launcher says so in one line and
stops
(:func:`~neighbor_ckpt.inprocess.restart_rendezvous.restart_verdict`'s rule). A launcher that reaches a store after its
processes were declared so starts none of them and stays in the launch without them.

The roll call is of the launch's start only: it ends once generation 0 formed (its barrier needed nobody absent)
or the store moved (a new store holds only the launchers that wrote their part there again).

Nothing here waits for a barrier: the processes in generation 0's barrier see the missing ones declared dead within
``detector.timeout_s`` plus the store timeout of the first ready process, never ``inprocess.barrier_timeout_s``."""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from neighbor_ckpt.inprocess.generation import parse_dead, parse_list
from neighbor_ckpt.inprocess.launch_counts import exited
from neighbor_ckpt.inprocess.protocol import key
from neighbor_ckpt.inprocess.quorum import CUT_OFF, majority
from neighbor_ckpt.inprocess.restart_rendezvous import Verdict, parse_nodes, restart_verdict

__all__ = ["reach_any", "unreached_stores", "RollCall", "absent_processes"]



def reach_any(addresses: Sequence[tuple[str, int]], within_s: float, *, token: Optional[bytes] = None,
              poll_s: float = 0.2) -> tuple[Optional[int], dict[int, str]]:
    """The index of the first store of ``addresses`` that accepts a TCP connection, trying them in turn for at most
    ``within_s``; or None and why each one did not (its last error). With the launch's ``token`` the connection
    proves it to the store's gate before it is closed, as a client does (a gate logs a connection that does not)."""
    from neighbor_ckpt.inprocess.store_auth import HANDSHAKE_TIMEOUT_S, prove

    why: dict[int, str] = {}
    deadline = time.monotonic() + within_s
    while True:
        for i, (host, port) in enumerate(addresses):
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection((host, port), timeout=max(0.2, min(1.0, left)))
            except OSError as e:
                why[i] = e.strerror or type(e).__name__
                continue
            with sock:
                if token is not None:
                    sock.settimeout(HANDSHAKE_TIMEOUT_S)
                    try:
                        prove(sock, token)
                    except OSError:
                        pass  # reached: what the gate says is the first store operation's to report
            return i, why
        if time.monotonic() >= deadline:
            return None, why
        time.sleep(poll_s)


def unreached_stores(why: Mapping[int, str], *, before: int) -> tuple[int, ...]:
    """The stores ahead of the one :func:`reach_any` reached (``before``) that it could not connect to for another
    reason than a refusal (pure): a timeout or no route, i.e. the network to them is cut or their node is gone. A
    refusal is not counted: a store host still starting refuses until it listens."""
    refused = os.strerror(errno.ECONNREFUSED)
    return tuple(i for i in range(before) if i in why and why[i] != refused)


def absent_processes(*, processes: int, nodes: int, came: Sequence[str], records: Mapping[str, Sequence[int]],
                     dead: Mapping[int, str], gone: set[int]) -> Optional[tuple[int, ...]]:
    """The process indices ``0..processes-1`` of launchers that never came (pure): None when every one of the
    ``nodes`` launchers came, or while a launcher that came has not written which processes it runs; else the
    indices no record holds, not ``dead`` and not ``gone`` (exited)."""
    if len(set(came)) >= nodes or any(n not in records for n in came):
        return None
    held = {p for procs in records.values() for p in procs}
    return tuple(p for p in range(processes) if p not in held and p not in dead and p not in gone)


@dataclass
class RollCall:
    """One launcher's roll call of attempt 0 (see the module docstring)."""

    processes: int
    """The launch's processes (``--processes``)."""
    nodes: int
    """The launch's launchers (``--nodes``)."""
    bound_s: float
    """``detector.timeout_s`` + the store timeout: after the first ready process, how long a launcher may still be
    missing."""
    ready_at: Optional[float] = None
    """When this launcher first saw a process ready (monotonic)."""
    done: bool = False

    def cause(self, came: Sequence[str]) -> str:
        missing = self.nodes - len(set(came))
        return (f"{missing} of the {self.nodes} launchers never reached a store ({len(came)} came: {', '.join(came)}; "
                f"{self.bound_s:.0f} s after the first process was ready)")

    def verdict(self, absent: Sequence[int], came: Sequence[str], *, spares: int, elastic: bool) -> Verdict:
        """Go on without the ``absent`` processes (their spares, or elastic), or stop: one line saying why. Only the
        launchers of a majority of the launch's nodes may go on without the others: fewer may be the side of a cut
        that holds this store while the majority promoted another one and trains there (``cut_off``: stop, writing
        nothing, whatever the spares could cover)."""
        cause, left = self.cause(came), self.processes - len(absent)
        if len(set(came)) < majority(range(self.nodes)):
            return Verdict(False, f"{cause}: {CUT_OFF}: {len(set(came))} of the {self.nodes} launchers are no "
                                  f"majority (at least {majority(range(self.nodes))}); the others may have started "
                                  "on a store they promoted, so this side forms no generation", cut_off=True)
        if restart_verdict(lost={"": tuple(absent)}, processes=self.processes, spares=spares, elastic=elastic).go_on:
            return Verdict(True, f"{cause}: their process(es) {list(absent)} never started: declared dead (the "
                                 "spares take their ranks)")
        return Verdict(False, f"{cause}: their process(es) {list(absent)} never started, and the {left} left cannot "
                              f"cover the job's {self.processes - spares} ranks (add spares, or set "
                              "neighbor_ckpt.elastic.enabled: true)")

    def lost(self, came: Sequence[str], absent: Sequence[int]) -> dict[str, tuple[int, ...]]:
        """The launchers that never came, as lost nodes for a later restart's rendezvous (it does not wait for
        them): ``unreached<i>`` (their node ids are unknown), the first holding the absent processes."""
        return {f"unreached{i}": tuple(absent) if i == 0 else () for i in range(self.nodes - len(set(came)))}

    def due(self, now: float) -> bool:
        return not self.done and self.ready_at is not None and now - self.ready_at > self.bound_s

    def look(self, s: Any, now: float) -> Optional[tuple[tuple[int, ...], list[str]]]:
        """One look (``s``: attempt 0's store): the absent processes and the nodes that came, once due and some are
        absent; None otherwise (the roll call ends once every launcher came or the absent were found)."""
        if self.done:
            return None
        if self.ready_at is None:
            if s.check(["ready"]) and parse_list(s.get("ready")):
                self.ready_at = now
            return None
        if not self.due(now):
            return None
        if s.check([key("gen", 0, "members")]):  # generation 0 formed: its barrier waited for nobody absent
            self.done = True
            return None
        came = parse_nodes(s.get("nodes") if s.check(["nodes"]) else None)
        if len(came) >= self.nodes:
            self.done = True
            return None
        records: dict[str, tuple[int, ...]] = {}
        for n in came:
            r = key("launcher", n)
            if s.check([r]):
                records[n] = tuple(int(p) for p in json.loads(s.get(r)).get("processes", []))
        dead = parse_dead(s.get("dead") if s.check(["dead"]) else None)
        absent = absent_processes(processes=self.processes, nodes=self.nodes, came=came, records=records, dead=dead,
                                  gone=exited(s))
        if absent is None:
            return None
        self.done = True
        return (absent, came) if absent else None
