"""One worker OS process of the scale harness: hosts simulated nodes and does what the coordinator says.

``python -m tools.bench.scale_worker PLAN.json``: the plan (JSON) names the launch and what this worker hosts:
full-tier processes, beat-tier processes, population groups and launchers (full or beat-only). Commands come as JSON
lines on stdin; each gets one JSON line back on the original stdout (everything else the worker or torch prints goes
to stderr). Nothing is pickled. Every binding to the control plane is :mod:`tools.bench.scale_adapter`'s; this module
only schedules (threads) and reports.

Commands (``{"cmd": ...}``): ``cold`` (a share of the cold start's burst of handshakes at the primary's gate,
``concurrency`` at once; then the hosted launchers' first contact), ``launch`` (the launchers start and tick),
``form`` (every live hosted process joins generation ``generation``: one thread each), ``watch`` (full-tier
detectors, beat-tier beats, population beats start), ``reset`` (the per-address totals start again), ``counters``
(what was measured since ``since``), ``status`` (store epochs, cut-offs, fenced), ``exit``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from tools.bench import scale_adapter as cp
from tools.bench.scale_count import Counter

logger = logging.getLogger(__name__)


class Host:
    """The simulated processes and launchers of one worker (see the module docstring)."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.spec = cp.LaunchSpec.from_json(plan["spec"])
        self.addresses: dict[str, Counter] = {}
        self._addr_lock = threading.Lock()
        cp.instrument_clients(self._record)
        self.refusals = cp.count_tunnel_refusals()
        self.full = [cp.ProcessClient(self.spec, p, full=True) for p in plan.get("full", [])]
        self.beat = [cp.ProcessClient(self.spec, p, full=False) for p in plan.get("beat", [])]
        self.groups = [cp.PopulationGroup(self.spec, g) for g in plan.get("groups", []) if g]
        self.launchers = [cp.LauncherClient(self.spec, n, full=True) for n in plan.get("launchers_full", [])]
        self.launchers += [cp.LauncherClient(self.spec, n, full=False) for n in plan.get("launchers_beat", [])]
        self.stop = threading.Event()
        self.errors: dict[str, int] = {}
        self.late_beats = 0
        self.group_beats = 0
        self._watching = False
        self._launched = False

    # -- bookkeeping -----------------------------------------------------------------------------------------------

    def _record(self, address: tuple[str, int], method: str, keys: int, nbytes: int) -> None:
        name = f"{address[0]}:{address[1]}"
        with self._addr_lock:
            c = self.addresses.get(name)
            if c is None:
                c = self.addresses[name] = Counter()
        c.record(method, keys, nbytes)

    def _error(self, where: str, e: BaseException) -> None:
        self.errors[where] = self.errors.get(where, 0) + 1
        if self.errors[where] <= 3:
            logger.warning("%s: %s: %s", where, type(e).__name__, e)

    def _processes(self) -> list[Any]:
        return [*self.full, *self.beat]

    # -- commands ------------------------------------------------------------------------------------------------

    def cold(self, handshakes: int, concurrency: int, within_s: float) -> dict[str, Any]:
        """A share of the cold start's burst: ``handshakes`` first connections to the primary's gate, ``concurrency``
        at once (a wave's connections stay open until the wave is in, then close); then the hosted launchers' first
        contact, as ``Launcher.run`` makes it."""
        token = cp.launch_token(self.spec)
        done: list[cp.Handshake] = []
        t0 = time.monotonic()
        step = max(1, concurrency)
        for i in range(0, handshakes, step):
            n = min(step, handshakes - i)
            with ThreadPoolExecutor(max_workers=n) as pool:
                wave = list(pool.map(lambda _: cp.gate_handshake(self.spec, token, within_s=within_s), range(n)))
            done.extend(wave)
            for h in wave:
                if h.sock is not None:
                    h.sock.close()
        burst_s = time.monotonic() - t0
        time.sleep(1.0)  # the closed connections' pumps end at the gate before the launchers connect
        t1 = time.monotonic()
        with ThreadPoolExecutor(max_workers=max(1, min(64, len(self.launchers)))) as pool:
            list(pool.map(self._first_contact, self.launchers))
        waits = sorted(h.seconds for h in done)
        return {"handshakes": len(done), "admitted": sum(1 for h in done if h.sock is not None),
                "refused": sum(h.refused for h in done), "timeouts": sum(h.timeouts for h in done),
                "seconds": burst_s, "waves": math.ceil(handshakes / step) if handshakes else 0,
                "wait_p50_s": waits[len(waits) // 2] if waits else None, "wait_max_s": waits[-1] if waits else None,
                "launchers": len(self.launchers), "launchers_s": time.monotonic() - t1,
                "tunnel_refusals": self.refusals.no_handshake, "errors": dict(self.errors)}

    def _first_contact(self, lc: cp.LauncherClient) -> None:
        try:
            lc.first_contact()
        except Exception as e:  # noqa: BLE001 - counted and said
            self._error("launcher first contact", e)

    def launch(self) -> dict[str, Any]:
        """Each launcher starts attempt 0 and ticks on a thread of its own (a launcher is one loop)."""
        if not self._launched:
            self._launched = True
            for lc in self.launchers:
                try:
                    lc.start()
                except Exception as e:  # noqa: BLE001 - counted and said
                    self._error("launcher start", e)
                threading.Thread(target=self._tick_loop, args=(lc,), name=f"scale-launcher-{lc.node}",
                                 daemon=True).start()
        return {"launchers": len(self.launchers)}

    def _tick_loop(self, lc: cp.LauncherClient) -> None:
        while not self.stop.is_set():
            try:
                lc.tick()
            except Exception as e:  # noqa: BLE001 - a launcher keeps looping, as the real one does
                self._error("launcher tick", e)
            self.stop.wait(max(0.005, lc.next_in()))

    def form(self, generation: int, dead: Sequence[int], quorum_of: Sequence[int], timeout_s: float,
             adopt: bool = False) -> dict[str, Any]:
        """Every live hosted process joins ``generation``'s real barrier (first writing ``proc`` and ``ready`` for
        generation 0), one thread each; returns when all did or ``timeout_s`` passed. ``adopt``: the harness wrote
        the outcome already; the population takes it without joining (only the full and beat tiers join)."""
        gone = set(dead)
        expected = set(range(self.spec.processes)) - gone
        last = frozenset(quorum_of)
        done: list[float] = []
        lock = threading.Lock()

        def one(process: int, join: Callable[[], float], identify: Optional[Callable[[], None]]) -> None:
            try:
                if identify is not None and generation == 0:
                    identify()
                t = join()
                with lock:
                    done.append(t)
            except Exception as e:  # noqa: BLE001 - counted and said (a process declared dead meanwhile is fenced)
                self._error(f"join {generation}", e)
                if cp.fenced(e):
                    with lock:
                        fenced.append(process)

        fenced: list[int] = []
        jobs: list[tuple[int, Callable[[], float], Optional[Callable[[], None]]]] = []
        for pc in self._processes():
            if pc.process not in gone and pc.fenced_at is None:
                jobs.append((pc.process, lambda pc=pc: pc.join(generation, expected, last, timeout_s), pc.identify))
        for g in self.groups:
            g.live -= gone
            if adopt:
                g.generation = generation
                continue
            for p in sorted(g.live):
                jobs.append((p, lambda g=g, p=p: g.join(p, generation, expected, last, timeout_s),
                             lambda g=g, p=p: g.identify(p)))
        threads = [threading.Thread(target=one, args=job, name="scale-join", daemon=True) for job in jobs]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s + 5
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return {"joined": len(done), "expected": len(jobs), "last_unix": max(done, default=None),
                "fenced": sorted(fenced),
                "first_unix": min(done, default=None),
                "errors": dict(self.errors)}

    def watch(self) -> dict[str, Any]:
        """Start the detectors and beats (once; after a later generation formed, nothing more to start)."""
        for pc in self._processes():
            if pc.fenced_at is None:
                pc.watch()
        if not self._watching:
            self._watching = True
            for g in self.groups:
                threading.Thread(target=self._beat_loop, args=(g,), name="scale-population", daemon=True).start()
        return {"full": len(self.full), "beat": len(self.beat), "groups": len(self.groups)}

    def _beat_loop(self, group: cp.PopulationGroup) -> None:
        """The group's heartbeats every ``interval_s`` at a fixed rate (a beat that comes late is counted)."""
        interval = self.spec.interval_s
        due = time.monotonic()
        while not self.stop.is_set() and group.lost is None:
            try:
                group.beat()
                group.beats += 1
                self.group_beats += 1
            except Exception as e:  # noqa: BLE001 - no store: the group is cut off, as its processes would be
                group.lost = f"{type(e).__name__}: {e}"
                self._error("population beat", e)
                return
            due += interval
            now = time.monotonic()
            if now > due:
                self.late_beats += 1
                due = now
            self.stop.wait(due - now)

    def reset(self) -> dict[str, Any]:
        """The per-address totals start again (the steady window)."""
        with self._addr_lock:
            self.addresses = {}
        return {"unix": time.time()}

    def counters(self, since: float) -> dict[str, Any]:
        """What was measured since ``since`` (unix): each full-tier process's rounds, each full launcher's ticks and
        beats, every store address's totals (since the last ``reset``), the population's beats."""
        full = []
        for pc in self.full:
            rounds = [[r.tally.ops, r.tally.keys, r.tally.bytes, r.seconds, r.start] for r in pc.rounds
                      if r.start >= since]
            first = pc.first_round
            full.append({"process": pc.process, "rounds": rounds, "main": pc.main_counter.snapshot().as_dict(),
                         "first_round": None if first is None else [first.tally.ops, first.tally.keys,
                                                                    first.tally.bytes, first.seconds],
                         "cut_off_rounds": len(pc.cut_off_at), "by_method": pc.counter.methods()})
        launchers = [{"node": lc.node,
                      "ticks": [[t.ops, t.keys, t.bytes] for s, t in lc.tallies.ticks if s >= since],
                      "beats": [[t.ops, t.keys, t.bytes] for s, t in lc.tallies.beats if s >= since],
                      "methods": lc.counter.methods()}
                     for lc in self.launchers if lc.full]
        with self._addr_lock:
            addresses = {a: c.snapshot().as_dict() for a, c in self.addresses.items()}
        return {"full": full, "beat_main": [pc.main_counter.snapshot().as_dict() for pc in self.beat],
                "groups": len(self.groups), "groups_beating": sum(1 for g in self.groups if g.beats > 0),
                "launchers": launchers, "addresses": addresses, "group_beats": self.group_beats,
                "late_beats": self.late_beats, "errors": dict(self.errors)}

    def status(self) -> dict[str, Any]:
        """Where every client of this worker stands: its store epoch, when it moved, cut-offs and fences."""
        clients = [(pc.epoch, pc.moves) for pc in self._processes() if pc.fenced_at is None]
        clients += [(g.epoch, g.moves) for g in self.groups if g.lost is None or g.moves]
        clients += [(lc.epoch, lc.moves) for lc in self.launchers]
        moves = [m[0] for _, m in clients if m]
        return {"clients": len(clients), "moved": sum(1 for e, _ in clients if e > 0),
                "first_move": min(moves, default=None), "last_move": max(moves, default=None),
                "cut_offs": sum(len(lc.cut_offs) for lc in self.launchers),
                "groups_lost": sum(1 for g in self.groups if g.lost is not None),
                "fenced": [pc.process for pc in self._processes() if pc.fenced_at is not None],
                "cut_off_at": sorted(t for pc in self.full for t in pc.cut_off_at)[:2000],
                "errors": dict(self.errors)}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One command's reply (see the module docstring)."""
        name = cmd.get("cmd")
        if name == "cold":
            return self.cold(int(cmd["handshakes"]), int(cmd["concurrency"]), float(cmd["within_s"]))
        if name == "launch":
            return self.launch()
        if name == "form":
            return self.form(int(cmd["generation"]), cmd.get("dead", []), cmd.get("quorum_of", []),
                             float(cmd["timeout_s"]), bool(cmd.get("adopt", False)))
        if name == "watch":
            return self.watch()
        if name == "reset":
            return self.reset()
        if name == "counters":
            return self.counters(float(cmd.get("since", 0.0)))
        if name == "status":
            return self.status()
        if name == "ping":
            return {"pid": os.getpid()}
        raise ValueError(f"unknown command {name!r}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    plan = json.loads(Path(args[0]).read_text())
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # replies only; stray prints of torch go to stderr
    os.dup2(2, 1)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "error")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s scale worker {plan.get('name', '?')} (pid {os.getpid()}): %(message)s")
    host = Host(plan)
    proto.write(json.dumps({"ok": True, "ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") == "exit":
            host.stop.set()
            proto.write(json.dumps({"ok": True, "id": cmd.get("id")}) + "\n")
            break
        try:
            reply = {"ok": True, "id": cmd.get("id"), **host.handle(cmd)}
        except Exception as e:  # noqa: BLE001 - the coordinator says it
            logger.exception("command %s", cmd.get("cmd"))
            reply = {"ok": False, "id": cmd.get("id"), "error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(reply) + "\n")
    proto.flush()
    os._exit(0)  # store clients may still be inside torch's client (a store that is gone): no finalizing


if __name__ == "__main__":
    sys.exit(main())
