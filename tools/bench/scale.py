"""``python -m tools.bench --scale [--sizes 8,64,256,1024] [--window-s 10] [--bound-s 1200] [--out FILE]``: the
control plane at the scale users run (nodes of 8 processes, up to 1,024 nodes), measured on one machine.

A benchmark, not a test: it asserts nothing about time. Per size, on a fresh launch:

1. **store hosts**: the primary and up to 3 standbys, each a real ``store_host`` process with its gate, sealed store
   and the launch's token file;
2. **workers**: a few OS processes host the simulated nodes (:mod:`tools.bench.scale_worker`): one hosts a whole node
   (its launcher and its 8 processes: the node that is killed), one hosts one process (the one that is stopped), the
   others the rest; what is real and what is simulated is the adapter's to say (:mod:`tools.bench.scale_adapter`,
   ``REAL`` and ``SIMULATED``, written into the document);
3. **phases** (``--phases``): ``cold`` (the launchers' first contact, then every process's cold-start connections:
   the gate's refusals), ``form`` (every process joins generation 0's real barrier: ``formation_s``), ``steady``
   (the full-tier detectors' rounds counted for ``--window-s``: keys, bytes and operations per process per beat; the
   launchers' ticks and beats; the primary's threads), ``sigstop`` (one process's OS process SIGSTOPped: until the
   others declare it; then generation 1 forms without it), ``node`` (a node's OS process SIGKILLed: until its 8
   processes are declared together), ``failover`` (the primary's host SIGKILLed: until every client is on the
   promoted standby).

A size that does not finish within ``--bound-s`` is recorded with ``"finished": false`` and why, with what was
measured. ``cpu_busy`` is the machine's (``/proc/stat``) over the size's run: wall-clock figures compare only where
it stays below 0.7; above that the harness measured itself. ``primary_keys_per_beat`` is derived from the measured
per-round costs at the code's own periods (every process's detector round per ``interval_s``, every launcher's tick
per ``poll_s`` and beat per ``beat_s``); what the harness itself pushed to the primary is beside it
(``primary_keys_per_beat_driven``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from tools.bench import scale_adapter as cp
from tools.bench.scale_procs import (REPO, CpuClock, Sampler, StoreHosts, Worker, WorkerError, call_all, proc_fds,
                                     proc_memory_mb, proc_threads, sigstop)

logger = logging.getLogger(__name__)

DEFAULT_SIZES = (8, 64, 256, 1024)
PHASES = ("cold", "form", "steady", "sigstop", "node", "failover")
RECORD_KEYS = ("nodes", "processes", "primary_keys_per_beat", "keys_per_process_per_beat",
               "bytes_per_process_per_beat", "store_host_threads", "node_detect_s", "sigstop_detect_s",
               "formation_s", "failover_s", "cold_start_refusals", "cpu_busy")
"""The keys every size's record has (None where not measured)."""


@dataclass(frozen=True)
class Settings:
    """One run's settings (``main``'s options)."""

    per_node: int = 8
    timeout_s: float = 3.0
    interval_s: float = 0.5
    window_s: float = 10.0
    bound_s: float = 1200.0
    form_bound_s: float = 300.0
    workers: int = 2
    cold_cap: int = 1024
    quiet_s: float = 60.0
    reform_max: int = 2048
    """Above this many processes, generation 1 (after the SIGSTOPped process) is written by the harness."""
    memory_floor_mb: float = 2048.0
    """Below this much available memory the size is stopped (its workers killed): other work shares the machine."""
    samples: int = 2
    standbys: int = 3
    groups_per_worker: int = 64
    phases: tuple[str, ...] = PHASES

    def detect_bound_s(self) -> float:
        """How long a detection is waited for: ten detector periods, at least 30 s."""
        return max(30.0, 10 * (self.timeout_s + self.interval_s))


class Bound(Exception):
    """The size's bound was reached."""


# -- the layout of one size --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Who is who at one size: the node killed, the process stopped, their ring successors (full tier, they detect),
    sampled full-tier processes, the full-tier launchers, and how the rest is spread over the population workers."""

    nodes: int
    per_node: int
    samples: int = 2

    @property
    def processes(self) -> int:
        return self.nodes * self.per_node

    @property
    def victim_node(self) -> int:
        return self.nodes // 2

    @property
    def stop_node(self) -> int:
        s = self.nodes // 4
        return s if s != self.victim_node else (self.victim_node + 1) % self.nodes

    @property
    def stopped(self) -> int:
        return self.stop_node * self.per_node + min(3, self.per_node - 1)

    def node_processes(self, node: int) -> list[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    @property
    def victims(self) -> set[int]:
        return {*self.node_processes(self.victim_node), self.stopped}

    @property
    def node_successor(self) -> int:
        return ((self.victim_node + 1) % self.nodes) * self.per_node

    @property
    def stop_successor(self) -> int:
        return (self.stopped + 1) % self.processes

    @property
    def full(self) -> list[int]:
        """The full-tier processes: both successors, then up to ``samples`` others spread over the ring."""
        p = self.processes
        out = [self.node_successor, self.stop_successor]
        for c in (1, p // 3 + 1, 2 * p // 3 + 1, p - 1, p // 2 + 2):
            if len(out) >= 2 + self.samples:
                break
            if 0 <= c < p and c not in out and c not in self.victims:
                out.append(c)
        return [q for q in out if q not in self.victims]

    @property
    def launchers_full(self) -> list[int]:
        """One full-tier launcher (its look reads every node's beat: one is enough to count it)."""
        return [0 if self.victim_node != 0 else self.nodes - 1]

    def population_plans(self, workers: int, groups_per_worker: int) -> list[dict[str, Any]]:
        """The plans of the population workers: nodes dealt out in turn, each worker's nodes grouped for the shared
        StoreSets (at most ``groups_per_worker`` groups each)."""
        nodes = [n for n in range(self.nodes) if n != self.victim_node]
        full, victims = set(self.full), self.victims
        plans = []
        for w in range(workers):
            mine = nodes[w::workers]
            per_group = max(1, math.ceil(len(mine) / groups_per_worker))
            groups = []
            for i in range(0, len(mine), per_group):
                procs = [q for n in mine[i:i + per_group] for q in self.node_processes(n)]
                groups.append([q for q in procs if q not in full and q not in victims])
            owned = {q for n in mine for q in self.node_processes(n)}
            plans.append({"full": sorted(full & owned), "groups": [g for g in groups if g],
                          "launchers_full": [n for n in mine if n in self.launchers_full],
                          "launchers_beat": [n for n in mine if n not in self.launchers_full]})
        return [p for p in plans if p["groups"] or p["full"] or p["launchers_full"] or p["launchers_beat"]]


# -- one size ----------------------------------------------------------------------------------------------------------

def _median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _round(x: Optional[float], nd: int = 3) -> Optional[float]:
    return None if x is None else round(x, nd)


@dataclass
class SizeRun:
    """One size, from its store hosts to its last phase (see the module docstring)."""

    cfg: Settings
    nodes: int
    directory: Path
    rec: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layout = Layout(self.nodes, self.cfg.per_node, self.cfg.samples)
        self.rec = {k: None for k in RECORD_KEYS}
        self.rec.update(nodes=self.nodes, processes=self.layout.processes, finished=True, why=None)
        self.deadline = time.monotonic() + self.cfg.bound_s
        self.workers: dict[str, Worker] = {}
        self.dead_workers: set[str] = set()
        self.phase_starts: list[tuple[str, float]] = []
        self.steady_from = 0.0
        self.last_dead: dict[int, str] = {}
        """``dead`` as the harness last read it on the primary."""
        self.out_of_memory: Optional[str] = None
        """Why the workers were killed, if the machine ran short of memory."""
        self.forced = False
        """Whether the harness had to write a generation's outcome (its barrier did not form in time)."""

    # -- plumbing ----------------------------------------------------------------------------------------------

    def left(self, phase: str) -> float:
        """Seconds left of the size's bound; :class:`Bound` when none is, before ``phase``, or when the machine ran
        short of memory (the workers were killed)."""
        if self.out_of_memory is not None:
            raise Bound(self.out_of_memory)
        left = self.deadline - time.monotonic()
        if left < 1.0:
            raise Bound(f"the size's bound ({self.cfg.bound_s:.0f} s) was reached before phase {phase}")
        return left

    def live(self) -> list[Worker]:
        return [w for n, w in self.workers.items() if n not in self.dead_workers]

    def say(self, text: str) -> None:
        print(f"[{self.nodes} nodes] {text}", flush=True)

    def _spawn(self) -> None:
        """The workers: one for the node that is killed, one for the process that is stopped (each only when its
        phase runs; else they live in the first population worker), the population workers."""
        lay, spec = self.layout, self.spec.to_json()
        node = {"beat": lay.node_processes(lay.victim_node), "launchers_beat": [lay.victim_node]}
        stopped = {"beat": [lay.stopped]}
        pops = lay.population_plans(self.cfg.workers, self.cfg.groups_per_worker)
        plans: dict[str, dict[str, Any]] = {}
        for name, plan in (("node", node), ("sigstop", stopped)):
            if name in self.cfg.phases:
                plans["node" if name == "node" else "stopped"] = plan
            else:
                for k, v in plan.items():
                    pops[0][k] = sorted(pops[0].get(k, []) + v)
        for i, plan in enumerate(pops):
            plans[f"pop{i}"] = plan
        for name, plan in plans.items():
            self.workers[name] = Worker(name, {**plan, "spec": spec}, self.directory)
        for w in self.workers.values():
            self.sampler.watch(w.pid)
            w.ready(self.left("start"))

    # -- the run -----------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """The size's record: store hosts and workers up, the phases in order, everything down again."""
        self.rec["cpu_others_at_start"] = _quiet(self.cfg.quiet_s)
        clock, t0 = CpuClock(), time.monotonic()
        token = cp.make_token_file(self.directory)
        self.hosts = StoreHosts(self.directory, token, 1 + min(self.cfg.standbys, self.nodes - 1))
        sampler = self.sampler = Sampler(self.hosts.primary_pid, floor_mb=self.cfg.memory_floor_mb,
                                         on_low=self._low_memory)
        for p in self.hosts.procs:
            sampler.watch(p.pid)
        self.rec["store_host_threads_idle"] = proc_threads(self.hosts.primary_pid)
        self.spec = cp.LaunchSpec(run_id=f"scale-{self.nodes}", stores=self.hosts.addresses, token_file=str(token),
                                  nodes=self.nodes, per_node=self.cfg.per_node, timeout_s=self.cfg.timeout_s,
                                  interval_s=self.cfg.interval_s)
        self.watch: Optional[cp.WatchClient] = None
        try:
            self._spawn()
            self.watch = cp.WatchClient(self.spec)
            for phase in PHASES:
                if phase in self.cfg.phases:
                    self.say(f"phase {phase}")
                    self.phase_starts.append((phase, time.time()))
                    getattr(self, f"phase_{phase}")()
        except (Bound, WorkerError, RuntimeError) as e:
            why = str(e) if self.rec["why"] is None else f"{self.rec['why']}; then {e}"
            self.rec.update(finished=False, why=why)
            self.say(f"not finished: {e}")
        finally:
            self._false_declarations()
            sampler.sample()
            sampler.close()
            self.rec["store_host_threads_peak"] = sampler.peak_threads
            self.rec["store_host_fds_peak"] = sampler.peak_fds
            for w in self.workers.values():
                w.close()
            if self.watch is not None:
                self.watch.close()
            self.hosts.close()
            wall = time.monotonic() - t0
            self.rec["cpu_busy"], busy_s, irq_s = clock.busy()
            ncpu, mine = len(os.sched_getaffinity(0)), sampler.harness_cpu_s()
            self.rec["cpu_harness"] = round(mine / (wall * ncpu), 3)
            self.rec["cpu_irq"] = round(irq_s / (wall * ncpu), 3)
            self.rec["cpu_others"] = round(max(0.0, busy_s - irq_s - mine) / (wall * ncpu), 3)
            self.rec["wall_s"] = round(wall, 1)
            self.rec["harness_rss_peak_mb"] = round(sampler.rss_peak_mb())
            self.rec["measured_itself"] = self.rec["cpu_busy"] >= 0.7
            self.rec["phases"] = self.phases
        return self.rec

    def _low_memory(self, available_mb: float) -> None:
        """The machine has less than ``--memory-floor`` available: kill the workers now (other work shares the
        machine), and say why in the record."""
        if self.out_of_memory is None:
            self.out_of_memory = (f"stopped: {available_mb:.0f} MB of memory left on the machine (the workers' "
                                  "simulated processes outgrew it)")
            for w in list(self.workers.values()):
                if w.proc.poll() is None:
                    w.proc.kill()

    def phase_cold(self) -> None:
        """The cold start: every process's and every launcher's first handshakes at the primary's gate, as one burst
        (``--cold-cap`` at once, shared out over the population workers); then the launchers' first contact and
        their start."""
        lay = self.layout
        total = cp.HANDSHAKES_PER_PROCESS * lay.processes + cp.HANDSHAKES_PER_LAUNCHER * lay.nodes
        pop = [w for w in self.live() if w.name.startswith("pop")]
        cap = min(total, self.cfg.cold_cap)
        share, extra = divmod(total, len(pop))
        left = self.left("cold")
        calls = [(w, {"cmd": "cold", "handshakes": share + (1 if i < extra else 0),
                      "concurrency": math.ceil(cap / len(pop)), "within_s": left})
                 for i, w in enumerate(pop)]
        got = _parallel(calls, left + 30)
        victims = [w for w in self.live() if not w.name.startswith("pop")]
        got += _parallel([(w, {"cmd": "cold", "handshakes": 0, "concurrency": 1, "within_s": left})
                          for w in victims], self.left("cold"))
        refused = sum(r["refused"] for r in got)
        self.rec["cold_start_refusals"] = refused
        self.rec["cold_start_s"] = _round(max(r["seconds"] for r in got))
        self.rec["cold_start_handshake_timeouts"] = sum(r["timeouts"] for r in got)
        waits = [r["wait_max_s"] for r in got if r["wait_max_s"] is not None]
        self.phases["cold"] = {"handshakes": sum(r["handshakes"] for r in got), "concurrency": cap,
                               "admitted": sum(r["admitted"] for r in got), "refused": refused,
                               "timeouts": sum(r["timeouts"] for r in got),
                               "seconds": _round(max(r["seconds"] for r in got)),
                               "waves": max(r["waves"] for r in got),
                               "wait_max_s": _round(max(waits, default=None)),
                               "wait_p50_s": _round(_median([r["wait_p50_s"] for r in got
                                                             if r["wait_p50_s"] is not None])),
                               "launchers_first_contact_s": _round(max(r["launchers_s"] for r in got)),
                               "tunnel_refusals": sum(r["tunnel_refusals"] for r in got),
                               "errors": _merge(r.get("errors", {}) for r in got)}
        if self.phases["cold"]["admitted"] < total:
            raise Bound(f"the cold start admitted {self.phases['cold']['admitted']} of {total} connections")
        call_all(self.live(), {"cmd": "launch"}, self.left("launch"))

    def _form(self, generation: int, dead: Sequence[int], quorum_of: Sequence[int], *,
              adopt: bool = False) -> dict[str, Any]:
        """Every live process joins ``generation``'s real barrier. When it has not formed within ``--form-bound-s``
        (30 s after a formation the harness had to write already), the harness writes the outcome itself (every
        expected process a member) and the phases go on; the formation is then recorded as not finished.
        ``adopt``: the harness writes the outcome first; the population takes it without joining."""
        bound = min(self.cfg.form_bound_s if not self.forced else 30.0, self.left(f"form {generation}"))
        go = time.time()
        members = sorted(set(range(self.layout.processes)) - set(dead))
        if adopt:
            assert self.watch is not None
            self.watch.settle(generation, members)
        cmd = {"cmd": "form", "generation": generation, "dead": list(dead), "quorum_of": list(quorum_of),
               "timeout_s": bound + self.cfg.form_bound_s, "adopt": adopt}
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["got"] = call_all(self.live(), cmd, 2 * bound + self.cfg.form_bound_s + 60)
            except WorkerError as e:
                box["error"] = e

        t = threading.Thread(target=run, name="scale-form", daemon=True)
        t.start()
        t.join(bound)
        forced = late = None
        if t.is_alive():
            assert self.watch is not None
            arrived = self.watch.arrived(generation)
            at = {"after_s": _round(time.time() - go), "arrived_by_then": arrived, "members": len(members)}
            if self.watch.settle(generation, members):
                self.forced, forced = True, at
                self.say(f"generation {generation} not formed within {bound:.0f} s ({arrived} arrived): written by "
                         "the harness")
            else:  # the barrier formed; its processes were still reading the outcome
                late = at
            t.join(self.left(f"form {generation}"))
        if "error" in box or "got" not in box:
            raise Bound(f"generation {generation}: {box.get('error', 'the workers did not answer')}")
        got = box["got"]
        joined, expected = sum(r["joined"] for r in got), sum(r["expected"] for r in got)
        last = max((r["last_unix"] for r in got if r["last_unix"] is not None), default=None)
        if adopt:
            forced = {"after_s": 0.0, "arrived_by_then": 0, "members": len(members),
                      "why": f"more than {self.cfg.reform_max} processes: the population takes the outcome without "
                             "a barrier (8,192 barrier threads in two OS processes outgrow this machine's memory)"}
        out = {"seconds": None if forced or last is None or joined < expected else _round(last - go),
               "joined": joined, "expected": expected, "harness_wrote_outcome": forced,
               "outcome_still_read_at_bound": late,
               "fenced": sorted(p for r in got for p in r["fenced"]),
               "errors": _merge(r.get("errors", {}) for r in got),
               "per_worker_s": {w.name: None if r["last_unix"] is None else _round(r["last_unix"] - go)
                                for w, r in zip(self.live(), got)},
               "first_joined_s": _round(min((r["first_unix"] for r in got if r["first_unix"]), default=go) - go)}
        if joined == 0:
            raise Bound(f"generation {generation}: none of the {expected} processes had its outcome")
        call_all(self.live(), {"cmd": "watch"}, self.left("watch"))
        return out

    def phase_form(self) -> None:
        """Generation 0 forms among every process (the real barrier)."""
        self.phases["form"] = self._form(0, [], [])
        self.rec["formation_s"] = self.phases["form"]["seconds"]
        if self.forced:
            self.rec["finished"] = False
            self.rec["why"] = (f"generation 0's barrier did not form within {self.cfg.form_bound_s:.0f} s "
                               f"({self.phases['form']['harness_wrote_outcome']['arrived_by_then']} of "
                               f"{self.layout.processes} processes arrived): the harness wrote its outcome to go on")

    def phase_steady(self) -> None:
        """Wait for every full-tier detector's first round, then count a window of rounds, ticks and beats."""
        self.steady_from = time.time()
        first = self._first_rounds()
        call_all(self.live(), {"cmd": "reset"}, self.left("steady"))
        since = time.time()
        while True:
            self.left("steady")
            time.sleep(self.cfg.window_s)
            got = call_all(self.live(), {"cmd": "counters", "since": since}, self.left("steady"))
            rounds = [len(f["rounds"]) for r in got for f in r["full"]]
            if rounds and min(rounds) >= 2:
                break
        window = time.time() - since
        self.rec["store_host_threads"] = proc_threads(self.hosts.primary_pid)
        self.rec["store_host_fds"] = proc_fds(self.hosts.primary_pid)
        self.rec["store_host_rss_mb"] = _round(proc_memory_mb(self.hosts.primary_pid), 1)
        self._steady(got, window, first)

    def _first_rounds(self) -> list[list[float]]:
        """Wait until every full-tier detector has done its first round, every population group has beaten (a
        heartbeat not written yet makes a detector read every key one by one) and the full-tier launcher has beaten
        twice (its first beat after a generation formed reads every member's record too); the first rounds'
        costs."""
        while True:
            got = call_all(self.live(), {"cmd": "counters", "since": self.steady_from}, self.left("steady"))
            firsts = [f["first_round"] for r in got for f in r["full"]]
            if (all(x is not None for x in firsts) and all(r["groups_beating"] == r["groups"] for r in got)
                    and all(len(lc["beats"]) >= 2 for r in got for lc in r["launchers"])):
                return firsts
            time.sleep(1.0)

    def _steady(self, got: list[dict[str, Any]], window: float, firsts: list[list[float]]) -> None:
        """The per-beat figures from a window's counters (module docstring)."""
        t = cp.timing(self.spec)
        per = [[sum(r[i] for r in f["rounds"]) / len(f["rounds"]) for i in range(3)]
               for w in got for f in w["full"] if f["rounds"]]
        ops, keys, nbytes = (_median([p[i] for p in per]) for i in range(3))
        periods = [statistics.median([b[4] - a[4] for a, b in zip(f["rounds"], f["rounds"][1:])])
                   for w in got for f in w["full"] if len(f["rounds"]) > 1]
        tick, beat, beats_seen = self._launcher_costs(got)
        ticks_per, beats_per = self.cfg.interval_s / t["launcher_poll_s"], self.cfg.interval_s / t["launcher_beat_s"]
        lk = lb = None
        if tick is not None and beat is not None:
            lk, lb = ticks_per * tick[1] + beats_per * beat[1], ticks_per * tick[2] + beats_per * beat[2]
        p, n = self.layout.processes, self.nodes
        primary = f"{self.spec.stores[0][0]}:{self.spec.stores[0][1]}"
        driven = sum(w["addresses"].get(primary, {}).get("keys", 0) for w in got)
        self.rec.update(
            keys_per_process_per_beat=_round(keys, 1), bytes_per_process_per_beat=_round(nbytes, 0),
            ops_per_process_per_beat=_round(ops, 1),
            primary_keys_per_beat=None if keys is None or lk is None else round(p * keys + n * lk),
            primary_bytes_per_beat=None if nbytes is None or lb is None else round(p * nbytes + n * lb),
            primary_keys_per_beat_driven=round(driven / (window / self.cfg.interval_s)),
            launcher_keys_per_beat_period=_round(lk, 1), launcher_bytes_per_beat_period=_round(lb, 0),
            launcher_keys_per_tick=None if tick is None else _round(tick[1], 1),
            launcher_keys_per_beat=None if beat is None else _round(beat[1], 1), launcher_beats_counted=beats_seen,
            first_round_keys_per_process=_round(_median([f[1] for f in firsts]), 1),
            first_round_ops_per_process=_round(_median([f[0] for f in firsts]), 1),
            first_round_s=_round(_median([f[3] for f in firsts])),
            formation_keys_per_process=_round(_median([w2["keys"] for w in got for w2 in w["beat_main"]]), 1),
            detector_round_period_s=_round(_median(periods)))
        self.phases["steady"] = {"window_s": _round(window, 1), "full_tier": len(per),
                                 "rounds": sum(len(f["rounds"]) for w in got for f in w["full"]),
                                 "population_beats": sum(w["group_beats"] for w in got),
                                 "population_beats_late": sum(w["late_beats"] for w in got),
                                 "by_method": next((f["by_method"] for w in got for f in w["full"]), {}),
                                 "launcher_methods": next((lc["methods"] for w in got for lc in w["launchers"]),
                                                          {}),
                                 "errors": _merge(w.get("errors", {}) for w in got)}

    def _launcher_costs(self, got: list[dict[str, Any]]) -> tuple[Optional[list[float]], Optional[list[float]], int]:
        """A full-tier launcher's (ops, keys, bytes) per tick and per beat: the medians of the window's (the least
        beat when fewer than 3: the first beat after a generation formed also reads every member's record once,
        ``_rebase``); from every tick and beat since generation 0 formed when the window saw none (a launcher whose
        look at 1,024 nodes outlasts the window; before it formed, not every launcher had announced its node). And
        how many beats were counted."""
        ticks = [t for w in got for lc in w["launchers"] for t in lc["ticks"]]
        beats = [b for w in got for lc in w["launchers"] for b in lc["beats"]]
        if not ticks or not beats:
            every = call_all(self.live(), {"cmd": "counters", "since": self.steady_from}, self.left("steady"))
            ticks = ticks or [t for w in every for lc in w["launchers"] for t in lc["ticks"]]
            beats = beats or [b for w in every for lc in w["launchers"] for b in lc["beats"]]
        tick = [_median([t[i] for t in ticks]) for i in range(3)] if ticks else None
        beat = None
        if beats:
            beat = [_median([b[i] for b in beats]) for i in range(3)] if len(beats) >= 3 else min(
                beats, key=lambda b: b[1])
        return tick, beat, len(beats)

    def _wait_declared(self, victims: set[int], since: float, phase: str) -> Optional[float]:
        """Seconds from ``since`` until ``dead`` lists every one of ``victims`` (the harness looks every 25 ms)."""
        assert self.watch is not None
        end = time.monotonic() + min(self.cfg.detect_bound_s(), self.left(phase))
        while time.monotonic() < end:
            try:
                self.last_dead = self.watch.dead()
                if victims <= self.last_dead.keys():
                    return time.time() - since
            except Exception as e:  # noqa: BLE001 - a slow store: look again
                logger.debug("dead: %s", e)
            time.sleep(0.025)
        return None

    def _decision(self, generation: int, since: float, victims: set[int]) -> Optional[dict[str, Any]]:
        """Generation ``generation``'s failure record (written right after the declaration: looked for 2 s), and
        whether it is the victims' (the first failure of a generation stands: it may be an earlier one's)."""
        assert self.watch is not None
        end = time.monotonic() + 2.0
        while True:
            f = self.watch.failure(generation)
            if f is not None:
                f["after_s"] = round(f["unix"] - since, 3)
                f["names_the_victims"] = victims <= set(f["ranks"])
                return f
            if time.monotonic() > end:
                return None
            time.sleep(0.05)

    def phase_sigstop(self) -> None:
        """SIGSTOP the OS process of one process; after the others declared it, SIGKILL it (its launcher would)
        and form generation 1 without it."""
        w = self.workers["stopped"]
        at = sigstop(w)
        took = self._wait_declared({self.layout.stopped}, at, "sigstop")
        self.rec["sigstop_detect_s"] = _round(took)
        self.phases["sigstop"] = {"process": self.layout.stopped, "seconds": _round(took),
                                  "decision": self._decision(0, at, {self.layout.stopped})}
        w.signal(signal.SIGKILL)
        w.close()
        self.dead_workers.add("stopped")
        if took is None:
            raise Bound(f"process {self.layout.stopped} (SIGSTOPped) was not declared dead within "
                        f"{self.cfg.detect_bound_s():.0f} s")
        assert self.watch is not None
        dead = sorted(self.watch.dead())
        self.phases["form_after_failure"] = self._form(1, dead, list(range(self.layout.processes)),
                                                       adopt=self.layout.processes > self.cfg.reform_max)

    def phase_node(self) -> None:
        """SIGKILL the OS process of one node (its launcher and its processes)."""
        w = self.workers["node"]
        at = w.signal(signal.SIGKILL)
        w.close()
        self.dead_workers.add("node")
        victims = set(self.layout.node_processes(self.layout.victim_node))
        took = self._wait_declared(victims, at, "node")
        self.rec["node_detect_s"] = _round(took)
        self.phases["node"] = {"node": self.layout.victim_node, "seconds": _round(took),
                               "decision": self._decision(1 if "sigstop" in self.cfg.phases else 0, at, victims)}
        if took is None:
            raise Bound(f"node {self.layout.victim_node} (SIGKILLed) was not declared lost within "
                        f"{self.cfg.detect_bound_s():.0f} s")

    def phase_failover(self) -> None:
        """SIGKILL the primary's host; until every live client is on the promoted standby."""
        if len(self.spec.stores) < 2:
            raise Bound("no standby store to fail over to")
        assert self.watch is not None
        self.last_dead = self.watch.dead()
        at = self.hosts.kill_primary()
        end = time.monotonic() + min(120.0, self.left("failover"))
        status: list[dict[str, Any]] = []
        while time.monotonic() < end:
            time.sleep(0.5)
            status = call_all(self.live(), {"cmd": "status"}, max(5.0, end - time.monotonic()))
            if all(s["moved"] == s["clients"] for s in status):
                break
        clients, moved = sum(s["clients"] for s in status), sum(s["moved"] for s in status)
        last = max((s["last_move"] for s in status if s["last_move"] is not None), default=None)
        first = min((s["first_move"] for s in status if s["first_move"] is not None), default=None)
        done = clients > 0 and moved == clients and last is not None
        self.rec["failover_s"] = _round(last - at) if done and last is not None else None
        self.phases["failover"] = {"clients": clients, "moved": moved,
                                   "first_move_s": None if first is None else _round(first - at),
                                   "launcher_cut_offs": sum(s["cut_offs"] for s in status),
                                   "population_groups_lost": sum(s["groups_lost"] for s in status)}
        if not done:
            raise Bound(f"{moved} of {clients} clients were on the promoted standby after the failover's bound")

    def _false_declarations(self) -> None:
        """Processes declared dead that nobody stopped or killed (a harness too slow to beat, or a false alarm)."""
        if self.watch is None:
            return
        dead = self.last_dead
        if "failover" not in {p for p, _ in self.phase_starts}:  # else the primary is gone: its last read stands
            try:
                dead = self.watch.dead()
            except Exception as e:  # noqa: BLE001 - the last read stands
                logger.warning("dead: %s", e)
        self.rec["false_declarations"] = sorted(set(dead) - self.layout.victims)
        try:
            status = call_all(self.live(), {"cmd": "status"}, 30.0)
        except WorkerError:
            return
        by_phase: dict[str, int] = {}
        for t in (t for s in status for t in s["cut_off_at"]):
            phase = next((p for p, start in reversed(self.phase_starts) if start <= t), "start")
            by_phase[phase] = by_phase.get(phase, 0) + 1
        self.rec["cut_off_rounds"] = sum(by_phase.values())
        self.rec["cut_off_rounds_by_phase"] = by_phase


def _quiet(within_s: float) -> float:
    """Wait up to ``within_s`` until other processes use less than a tenth of the CPUs; what they use then (a one
    second sample, 0-1)."""
    from tools.bench.machine import cpu_sample, foreign_load, wait_until_quiet

    ncpu = len(os.sched_getaffinity(0))
    if within_s > 0:
        wait_until_quiet(within_s, ncpu)
    a = cpu_sample()
    time.sleep(1.0)
    return round(foreign_load(a, cpu_sample(), ncpu)["other_cpu_frac"], 3)


def _parallel(calls: list[tuple[Worker, dict[str, Any]]], timeout_s: float) -> list[dict[str, Any]]:
    """Different commands to different workers at once."""
    out: list[dict[str, Any]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(w: Worker, cmd: dict[str, Any]) -> None:
        try:
            r = w.call(cmd, timeout_s)
            with lock:
                out.append(r)
        except WorkerError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=one, args=c, daemon=True) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise WorkerError("; ".join(errors))
    return out


def _mean3(rows: list[list[float]]) -> list[float]:
    return [sum(r[i] for r in rows) / len(rows) for i in range(3)]


def _merge(dicts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + int(v)
    return out


# -- the document ------------------------------------------------------------------------------------------------------

def source_commit(given: Optional[str]) -> tuple[str, str]:
    """(short commit, the control plane's tree state) of the code this run imports."""
    import neighbor_ckpt

    root = Path(neighbor_ckpt.__file__).resolve().parents[1]
    if given:
        return given, f"as given (--commit); the control plane imported from {root}"
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "neighbor_ckpt"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown", f"not a git checkout: {root}"
    return commit, "modified (uncommitted changes under neighbor_ckpt/)" if dirty else "clean"


HARNESS_SIMULATED = [
    "a generation's barrier that has not formed within --form-bound-s is written by the harness (every expected "
    "process a member; the record says so: harness_wrote_outcome), so that the phases after it can run",
    "above --reform-max processes, generation 1 (after the SIGSTOPped process was declared dead) is written by the "
    "harness and only the full and beat tiers join it: a second barrier of 8,192 threads in two OS processes "
    "outgrows this machine's memory",
    "the SIGSTOPped process's launcher does not SIGKILL it: the harness does, once it was declared dead",
]
"""What the coordinator itself simulates, whatever the control plane (beside the adapter's ``SIMULATED``)."""


def document(cfg: Settings, sizes: list[dict[str, Any]], commit: str, tree: str) -> dict[str, Any]:
    """The JSON document of a run: its settings, what is real and simulated, the machine, a record per size."""
    from tools.bench.machine import machine_info

    spec = cp.LaunchSpec(run_id="x", stores=(("127.0.0.1", 1),), token_file="/dev/null", nodes=2,
                         per_node=cfg.per_node, timeout_s=cfg.timeout_s, interval_s=cfg.interval_s)
    return {"benchmark": "scale", "date": datetime.date.today().isoformat(), "commit": commit, "tree": tree,
            "control_plane": cp.NAME, "timeout_s": cfg.timeout_s, "interval_s": cfg.interval_s,
            "timing": cp.timing(spec), "real": cp.REAL, "simulated": cp.SIMULATED + HARNESS_SIMULATED,
            "connections_today": cp.CONNECTIONS_TODAY, "code_refs": cp.code_refs(),
            "harness": {"per_node": cfg.per_node, "window_s": cfg.window_s, "bound_s": cfg.bound_s,
                        "population_workers": cfg.workers, "cold_cap": cfg.cold_cap,
                        "full_tier_samples": cfg.samples, "form_bound_s": cfg.form_bound_s, "quiet_s": cfg.quiet_s,
                        "reform_max": cfg.reform_max, "memory_floor_mb": cfg.memory_floor_mb,
                        "standbys": cfg.standbys, "phases": list(cfg.phases),
                        "groups_per_worker": cfg.groups_per_worker},
            "machine": machine_info(Path(tempfile.gettempdir())), "sizes": sizes}


def _table(sizes: list[dict[str, Any]]) -> str:
    cols = ("nodes", "processes", "primary_keys_per_beat", "keys_per_process_per_beat", "bytes_per_process_per_beat",
            "store_host_threads", "node_detect_s", "sigstop_detect_s", "formation_s", "failover_s",
            "cold_start_refusals", "cpu_busy", "finished")
    lines = [" ".join(f"{c[:14]:>14}" for c in cols)]
    for s in sizes:
        lines.append(" ".join(f"{'-' if s.get(c) is None else str(s.get(c))[:14]:>14}" for c in cols))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench --scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="nodes per size (default 8,64,256,1024)")
    ap.add_argument("--per-node", type=int, default=8, help="processes per node (default 8)")
    ap.add_argument("--timeout-s", type=float, default=3.0, help="detector.timeout_s (default 3)")
    ap.add_argument("--interval-s", type=float, default=0.5, help="detector.interval_s (default 0.5)")
    ap.add_argument("--window-s", type=float, default=10.0, help="the steady window (default 10)")
    ap.add_argument("--bound-s", type=float, default=1200.0, help="a size's bound (default 1200)")
    ap.add_argument("--form-bound-s", type=float, default=300.0,
                    help="a generation's barrier, before the harness writes its outcome to go on (default 300)")
    ap.add_argument("--workers", type=int, default=2, help="population worker processes (default 2)")
    ap.add_argument("--cold-cap", type=int, default=1024, help="cold-start connects in flight at most (default 1024)")
    ap.add_argument("--quiet-s", type=float, default=60.0,
                    help="before each size, wait up to this long for other processes to leave the CPUs (default 60)")
    ap.add_argument("--reform-max", type=int, default=2048,
                    help="above this many processes, generation 1 is written by the harness (default 2048)")
    ap.add_argument("--samples", type=int, default=2, help="full-tier processes beside the successors (default 2)")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"phases to run (default {','.join(PHASES)})")
    ap.add_argument("--commit", default=None, help="the commit the imported control plane is (default: git)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON document (default benchmarks/results/scale_<date>_<commit>.json)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (store and worker logs)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    phases = tuple(p for p in args.phases.split(",") if p)
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"--phases: unknown {sorted(unknown)}; known: {', '.join(PHASES)}")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if any(n < 2 for n in sizes) or args.per_node < 1:
        ap.error("every size needs 2 nodes or more, and --per-node 1 or more")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s scale: %(message)s")
    cfg = Settings(per_node=args.per_node, timeout_s=args.timeout_s, interval_s=args.interval_s,
                   window_s=args.window_s, bound_s=args.bound_s, form_bound_s=args.form_bound_s, workers=args.workers,
                   cold_cap=args.cold_cap, samples=args.samples, phases=phases, quiet_s=args.quiet_s,
                   reform_max=args.reform_max)
    commit, tree = source_commit(args.commit)
    root = Path(tempfile.mkdtemp(prefix="nckpt-scale-"))
    records = []
    try:
        for n in sizes:
            d = root / f"n{n}"
            d.mkdir()
            records.append(SizeRun(cfg, n, d).run())
            print(_table(records[-1:]), flush=True)
    finally:
        if args.keep:
            print(f"run directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    doc = document(cfg, records, commit, tree)
    out = args.out or REPO / "benchmarks" / "results" / f"scale_{doc['date']}_{commit}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(_table(records))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
