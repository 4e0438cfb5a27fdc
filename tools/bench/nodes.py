"""``python -m tools.bench --nodes [--quick | --grid 4x1,4x2,...] [--repeat 1] [--results FILE]``: how in-process
recovery grows with ranks per node and with the number of processes, in one run.

Each point of the grid is ``W`` ranks laid out as simulated nodes of ``K`` ranks each (``WxK``; one of our
launchers per node with its own host store directory and store host, as ``neighbor-ckpt launch`` starts a job with
``trainer.num_nodes: W/K`` and ``trainer.devices: K`` on one machine), plus one spare node of ``K`` hot spares, so
that a lost node is covered whole. Each point is launched twice, with the plain megatron-core recipe
(``recipes/mcore_gpt_plain_loop.py``, distributed optimizer) in its in-process mode:

* ``rank``: one rank SIGKILLed alone in the optimizer step of ``--fault-step`` (its launcher sees the exit and
  reports it): the job's last rank (``--rank-victim last``, the default; :func:`victim_rank` says why) or node 1's
  first (``first``);
* ``node``: node 1 lost whole in the same step (``fault_injection.target: node``: its ranks SIGKILL its launcher, its
  processes and store host die with it; nobody reports an exit, the next node's monitor finds the node silent).

Per launch, from the fault as the recipe recorded it just before the kill (``faults.jsonl``, earliest line):
detection (the last lost process declared dead: the decision the next generation waits for, read from the launch's
store every 20 ms by this tool, :class:`DeathWatch`), when the first survivor noticed a failure (the timeline's
``failure_noticed``: usually a collective that lost its peer, well before anyone knows who is lost) and the MTTR
(the end of the first step completed after the recovery), and the recovery timeline's own ``detect`` phase and MTTR
(whose start is the fault as its earliest witness saw it: ``detect_from``). The summary gives the ratios that
matter: a lost node's detection at ``K`` ranks per node against the 1-rank-per-node figure of the same world (one
detector period, ``timeout_s`` + ``interval_s``, is what a node costs; before nodes were one decision, a node of
``K`` ranks cost ``K`` periods), and how detection and MTTR grow with the number of processes at the same ``K``.

A benchmark, not a test: it asserts nothing about time. Timing on a loaded machine is noisy; the figures of one run
compare with each other only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from neighbor_ckpt.cli.launch import simulated_nodes
from neighbor_ckpt.recipes import RECIPES_DIR

REPO = Path(__file__).resolve().parents[2]
RECIPE = RECIPES_DIR / "mcore_gpt_plain_loop.py"
FAULTS = ("rank", "node")
LOST_NODE = 1
"""The node that is lost (``node: 1``; node 0 hosts the store in use, whose loss is another benchmark's)."""

GRID_FULL = "4x1,4x2,8x1,8x2,8x4,16x1,16x2"
"""Ranks per node 1, 2 and 4 at 8 ranks (and 1, 2 at 4 and 16); 4, 8 and 16 ranks at 1 and at 2 per node."""
GRID_QUICK = "4x1,4x2"


@dataclass(frozen=True)
class Point:
    """One layout: ``world`` ranks on nodes of ``per_node`` ranks each, and one spare node of ``per_node`` spares."""

    world: int
    per_node: int

    @property
    def spares(self) -> int:
        return self.per_node

    @property
    def nodes(self) -> int:
        """Nodes in all, the spare node included (:func:`~neighbor_ckpt.cli.launch.simulated_nodes`)."""
        return len(simulated_nodes(self.world, self.spares, self.per_node))

    @property
    def processes(self) -> int:
        return self.world + self.spares

    @property
    def name(self) -> str:
        return f"{self.world}x{self.per_node}"


VICTIMS = ("last", "first")


def victim_rank(point: Point, victim: str = "last") -> int:
    """The rank the ``rank`` fault kills: ``last``, the job's last rank; ``first``, node 1's first rank.

    A hot spare on the spare node that takes one rank of a node of several ranks changes the nodes' rank counts, and
    with them the ``cross_node`` ring that the next generation computes (:func:`neighbor_ckpt.snapshot.topology.
    ring_order` deals ranks from the largest node first): with three nodes of ranks or more, replacing node 1's first
    rank moves that rank's ring successor, and at this commit the recovery looks for its replica on the new successor
    instead of the one that holds it, finds none and gives up (seen at 8x2: ``replica on rank 5 lost``, the replica
    being on rank 6). Replacing the job's last rank leaves the ring as it was, whatever the layout."""
    if victim == "last":
        return point.world - 1
    if victim == "first":
        return LOST_NODE * point.per_node
    raise ValueError(f"rank victim {victim!r}: expected one of {VICTIMS}")


def parse_grid(spec: str) -> tuple[Point, ...]:
    """``"4x1,4x2,8x4"`` -> the points, in that order (duplicates dropped).

    Raises:
        ValueError: a point that is not ``WxK``, or whose ranks do not fill at least two whole nodes (a lost node's
            state lives on the ring successor's node: with one node of ranks there is none)."""
    out: list[Point] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)x(\d+)", item)
        if m is None:
            raise ValueError(f"grid point {item!r}: expected WORLDxRANKS_PER_NODE, for example 8x2")
        p = Point(int(m.group(1)), int(m.group(2)))
        if p.per_node < 1 or p.world % p.per_node or p.world // p.per_node < 2:
            raise ValueError(f"grid point {item!r}: {p.world} ranks must fill at least two whole nodes of "
                             f"{p.per_node} (node {LOST_NODE} is lost; its ranks' replicas live on another node)")
        if p not in out:
            out.append(p)
    if not out:
        raise ValueError("empty grid")
    return tuple(out)


def fault_spec(point: Point, fault: str, step: int, victim: str = "last") -> dict[str, Any]:
    """The ``fault_injection.faults`` entry of one launch (SIGKILL in the optimizer step of ``step``)."""
    if fault == "rank":
        return {"target": "rank", "rank": victim_rank(point, victim), "step": step, "phase": "optimizer",
                "signal": "SIGKILL"}
    if fault == "node":
        return {"target": "node", "node": LOST_NODE, "step": step, "phase": "optimizer", "signal": "SIGKILL"}
    raise ValueError(f"fault {fault!r}: expected one of {FAULTS}")


def lost_processes(point: Point, fault: str, victim: str = "last") -> tuple[int, ...]:
    """The processes the fault kills (processes are numbered as ranks before any recovery)."""
    if fault == "rank":
        return (victim_rank(point, victim),)
    first = LOST_NODE * point.per_node
    return tuple(range(first, first + point.per_node))


def job_config(path: Path, *, point: Point, fault: str, step: int, interval_s: float, timeout_s: float,
               report_dir: Path, victim: str = "last") -> Path:
    """The recipe's ``--config`` file: the detector, in-process recovery with the spare node's spares, where the
    timeline goes, and the fault."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "neighbor_ckpt:\n"
        f"  detector:\n    interval_s: {interval_s}\n    timeout_s: {timeout_s}\n"
        "  store:\n    cleanup_on_success: true\n"
        f"  inprocess:\n    enabled: true\n    spares: {point.spares}\n"
        f"  report:\n    dir: {json.dumps(str(report_dir))}\n"
        f"  fault_injection:\n    enabled: true\n    faults: {json.dumps([fault_spec(point, fault, step, victim)])}\n")
    return path


# -- one launch -------------------------------------------------------------------------------------------------------


class DeathWatch:
    """Reads the launch's primary store every ``poll_s`` (through the store token's tunnel, as a process would) and
    notes when each process first appears in the ``dead`` list (:func:`~neighbor_ckpt.inprocess.generation.parse_dead`)
    and when generation 0's failure was recorded: the decision a recovery waits for, seen from outside. It connects
    once ``ready`` exists (rank 0's first loss record: the store is up) and stops reading once every one of ``lost``
    is declared and the failure recorded; a connection that fails is tried again."""

    def __init__(self, stores: str, token_file: Path, run_id: str, *, ready: Path, lost: Sequence[int],
                 poll_s: float = 0.02) -> None:
        host, _, port = stores.split(",")[0].rpartition(":")
        self.remote, self.token_file, self.run_id, self.poll_s = (host, int(port)), token_file, run_id, poll_s
        self.ready, self.lost = ready, frozenset(lost)
        self.dead_unix: dict[int, float] = {}
        self.dead_why: dict[int, str] = {}
        self.failed_unix: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-death-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _connect(self) -> Any:
        from datetime import timedelta

        import torch.distributed as dist

        from neighbor_ckpt.inprocess.protocol import launch_prefix
        from neighbor_ckpt.inprocess.store_auth import read_token, tunnel_address

        host, port = tunnel_address(self.remote, read_token(self.token_file))
        base = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, use_libuv=True,
                             timeout=timedelta(seconds=5))
        return dist.PrefixStore(launch_prefix(self.run_id, 0), base)

    def _run(self) -> None:
        from neighbor_ckpt.inprocess.generation import parse_dead

        store = None
        while not self._stop.wait(self.poll_s if store is not None else 0.5):
            if self.failed_unix is not None and self.lost <= self.dead_unix.keys():
                return
            if not self.ready.exists():
                continue
            try:
                if store is None:
                    store = self._connect()
                now = time.time()
                if store.check(["dead"]):
                    for p, why in parse_dead(store.get("dead")).items():
                        if p not in self.dead_unix:
                            self.dead_unix[p], self.dead_why[p] = now, why
                if self.failed_unix is None and store.check(["gen/0/failed"]):
                    self.failed_unix = now
            except Exception:  # noqa: BLE001 - not up yet, or gone at the end: try again
                store = None

    def to_json(self) -> dict[str, Any]:
        return {"dead_unix": {str(p): t for p, t in sorted(self.dead_unix.items())},
                "dead_why": {str(p): w for p, w in sorted(self.dead_why.items())},
                "gen0_failed_unix": self.failed_unix}


_NODE_LOST_RE = re.compile(r"node (\S+) is lost: .*?declaring its process\(es\) \[([\d, ]*)\] dead together")


def measure(out: Path, log: str, watch: dict[str, Any] | None = None,
            lost: Sequence[int] = ()) -> dict[str, Any]:
    """One launch's figures (pure over its files): the fault's time (``faults.jsonl``: the earliest line; the
    recipe writes it just before the kill); from it ``noticed_s`` (the earliest survivor noticed a failure: the
    timeline's ``failure_noticed``, often a collective that lost its peer), ``detect_s`` (the last of the ``lost``
    processes declared dead: ``watch``, :meth:`DeathWatch.to_json`; the decision the next generation waits for) and
    ``mttr_s`` (the end of the first step after the recovery); the first in-process recovery timeline's detect phase,
    MTTR, ``detect_from`` and spare ranks; the processes the log says a lost node's decision named."""
    res: dict[str, Any] = {"fault_unix": None, "noticed_s": None, "detect_s": None, "mttr_s": None,
                           "timeline_detect_s": None, "timeline_mttr_s": None, "detect_from": None,
                           "spare_ranks": None, "mode": None}
    lines = out / "faults.jsonl"
    if lines.exists():
        stamps = [json.loads(x)["unix"] for x in lines.read_text().splitlines() if x.strip()]
        res["fault_unix"] = min(stamps) if stamps else None
    found = sorted(out.rglob("recovery_timeline.attempt0.1.json"))
    if found:
        tl = json.loads(found[0].read_text())
        ev = tl.get("events_unix") or {}
        res.update(timeline_detect_s=(tl.get("phases_s") or {}).get("detect"), timeline_mttr_s=tl.get("mttr_s"),
                   detect_from=tl.get("detect_from"), spare_ranks=sorted(tl.get("spare_ranks") or []),
                   mode=tl.get("mode"))
        t0 = res["fault_unix"]
        if t0 is not None and ev.get("failure_noticed") is not None:
            res["noticed_s"] = ev["failure_noticed"] - t0
        if t0 is not None and ev.get("first_step_end") is not None:
            res["mttr_s"] = ev["first_step_end"] - t0
    declared = (watch or {}).get("dead_unix") or {}
    if res["fault_unix"] is not None and lost and all(str(p) in declared for p in lost):
        res["detect_s"] = max(declared[str(p)] for p in lost) - res["fault_unix"]
    res["declared_dead"] = {p: (watch or {}).get("dead_why", {}).get(p) for p in sorted(declared, key=int)}
    decisions = [(m.group(1), [int(p) for p in m.group(2).split(",") if p.strip()])
                 for m in _NODE_LOST_RE.finditer(log)]
    res["node_decisions"] = sorted({(n, tuple(p)) for n, p in decisions})
    return res


def run_one(point: Point, fault: str, *, root: Path, steps: int, step: int, interval_s: float, timeout_s: float,
            launch_timeout_s: float, victim: str = "last") -> dict[str, Any]:
    """Launch ``point`` with ``fault`` (our per-node launchers, :func:`~neighbor_ckpt.cli.launch.inprocess_commands`)
    and measure it; the host stores are removed afterwards, the record and log kept under ``root``."""
    from neighbor_ckpt.cli.launch import free_ports, inprocess_commands, run_inprocess
    from neighbor_ckpt.runtime.procs import RUN_TAG_ENV, kill_tagged, new_run_tag

    out = root / f"{point.name}-{fault}"
    shutil.rmtree(out, ignore_errors=True)
    store = root / "store" / f"{point.name}-{fault}"
    shutil.rmtree(store, ignore_errors=True)
    job_id = f"bench-nodes-{point.name}-{fault}-{os.getpid()}"
    config = job_config(out / "nckpt.yaml", point=point, fault=fault, step=step, interval_s=interval_s,
                        timeout_s=timeout_s, report_dir=out / "reports", victim=victim)
    program = [str(RECIPE), "--steps", str(steps), "--out", str(out), "--job-id", job_id, "--config", str(config)]
    procs = inprocess_commands(program, active=point.world, spares=point.spares, max_restarts=0, run_id=job_id,
                               store_port=free_ports(point.nodes), store_root=store,
                               detector_timeout_s=timeout_s, devices=point.per_node)
    tag = new_run_tag()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="error", **{RUN_TAG_ENV: tag})
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x)
    load = os.getloadavg()[0]
    lost = lost_processes(point, fault, victim)
    watch = DeathWatch(procs.stores, procs.token_file, job_id, ready=out / "losses.rank0.jsonl", lost=lost)
    t = time.time()
    with open(out / "launch.log", "w") as f:
        watch.start()
        try:
            rc = run_inprocess(procs, env=env, timeout=launch_timeout_s, stdout=f, stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            rc = -999
        finally:
            watch.stop()
    kill_tagged(tag)
    shutil.rmtree(store, ignore_errors=True)
    row = {"point": point.name, "world": point.world, "per_node": point.per_node, "nodes": point.nodes,
           "processes": point.processes, "fault": fault, "lost": list(lost), "exit": rc,
           "wall_s": round(time.time() - t, 1),
           "loadavg_1m_before": round(load, 2), "out": str(out)}
    row.update(measure(out, (out / "launch.log").read_text(errors="replace"), watch.to_json(), lost))
    return row


# -- summary ----------------------------------------------------------------------------------------------------------


def _median(xs: Sequence[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return statistics.median(ys) if ys else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


METRICS = ("detect_s", "noticed_s", "mttr_s", "timeline_detect_s", "timeline_mttr_s")


def summarize(rows: Sequence[dict[str, Any]], *, period_s: float) -> dict[str, Any]:
    """Medians per (point, fault) over the launches that finished, and the ratios (pure):

    * ``node_vs_one_per_node``: per world with a 1-rank-per-node point, for each ``K`` > 1: a lost node's detection
      (from the fault) at ``K`` over and minus the 1-rank-per-node figure, whether the excess is within one detector
      period ``period_s`` (``timeout_s`` + ``interval_s``), and the ``K`` periods a node cost when its ranks were found
      one after another;
    * ``growth``: per fault and ranks per node with two worlds or more: detection and MTTR at each world over those
      of the smallest world."""
    cells: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["world"], r["per_node"], r["fault"]), []).append(r)
    points = []
    for (world, per_node, fault), rs in sorted(cells.items()):
        ok = [r for r in rs if r["exit"] == 0 and r.get("mttr_s") is not None]
        points.append({"world": world, "per_node": per_node, "fault": fault, "processes": rs[0]["processes"],
                       "nodes": rs[0]["nodes"], "launches": len(rs), "measured": len(ok),
                       **{m: _median([r.get(m) for r in ok]) for m in METRICS}})
    at = {(p["world"], p["per_node"], p["fault"]): p for p in points}
    vs_one = []
    for (world, per_node, fault), p in sorted(at.items()):
        one = at.get((world, 1, "node"))
        if fault != "node" or per_node == 1 or one is None:
            continue
        a, b = p["detect_s"], one["detect_s"]
        excess = None if a is None or b is None else a - b
        vs_one.append({"world": world, "per_node": per_node, "detect_s": a, "one_per_node_detect_s": b,
                       "ratio": _ratio(a, b), "excess_s": excess,
                       "within_one_period": None if excess is None else excess <= period_s,
                       "one_rank_at_a_time_s": per_node * period_s})
    growth = []
    for fault in FAULTS:
        for per_node in sorted({k for (_, k, f) in at if f == fault}):
            worlds = sorted(w for (w, k, f) in at if f == fault and k == per_node)
            if len(worlds) < 2:
                continue
            base = at[(worlds[0], per_node, fault)]
            for w in worlds:
                p = at[(w, per_node, fault)]
                growth.append({"fault": fault, "per_node": per_node, "world": w, "processes": p["processes"],
                               "base_world": worlds[0], "detect_ratio": _ratio(p["detect_s"], base["detect_s"]),
                               "mttr_ratio": _ratio(p["mttr_s"], base["mttr_s"])})
    return {"detector_period_s": period_s, "points": points, "node_vs_one_per_node": vs_one, "growth": growth}


def _f(x: float | None, width: int = 6, digits: int = 2) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{digits}f}"


def report(summary: dict[str, Any]) -> str:
    """The table and the ratios, as text."""
    lines = [f"in-process recovery by layout; medians; seconds from the fault (detector period "
             f"{summary['detector_period_s']:g} s). detect: the lost process(es) declared dead; notice: the first "
             "survivor noticed a failure; tl.: the recovery timeline's own (from the fault as its witness saw it)",
             f"{'world':>5} {'/node':>5} {'nodes':>5} {'procs':>5} {'fault':>5} {'n':>3} {'detect':>6} "
             f"{'notice':>6} {'MTTR':>6} {'tl.det':>6} {'tl.MTTR':>7}"]
    for p in summary["points"]:
        lines.append(f"{p['world']:5d} {p['per_node']:5d} {p['nodes']:5d} {p['processes']:5d} {p['fault']:>5} "
                     f"{p['measured']:>3} {_f(p['detect_s'])} {_f(p['noticed_s'])} {_f(p['mttr_s'])} "
                     f"{_f(p['timeline_detect_s'])} {_f(p['timeline_mttr_s'], 7)}")
    if summary["node_vs_one_per_node"]:
        lines.append("a lost node's detection vs 1 rank per node (same world):")
        for v in summary["node_vs_one_per_node"]:
            within = {True: "within one period", False: "MORE than one period", None: "unknown"}[v["within_one_period"]]
            lines.append(f"  world {v['world']}, {v['per_node']} per node: {_f(v['detect_s'], 0)} s vs "
                         f"{_f(v['one_per_node_detect_s'], 0)} s: x{_f(v['ratio'], 0)}, "
                         f"{'-' if v['excess_s'] is None else format(v['excess_s'], '+.2f')} s "
                         f"({within}; one rank at a time would be ~{v['one_rank_at_a_time_s']:g} s)")
    if summary["growth"]:
        lines.append("growth with the number of ranks (same ranks per node; vs the smallest world):")
        for g in summary["growth"]:
            lines.append(f"  {g['fault']:>4}, {g['per_node']} per node, world {g['world']:2d} ({g['processes']} "
                         f"processes): detect x{_f(g['detect_ratio'], 0)}, MTTR x{_f(g['mttr_ratio'], 0)}")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench --nodes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", default=None, help=f"points WORLDxRANKS_PER_NODE (default {GRID_FULL})")
    ap.add_argument("--quick", action="store_true", help=f"the small grid {GRID_QUICK}")
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of rank,node")
    ap.add_argument("--rank-victim", choices=VICTIMS, default="last",
                    help="the rank fault kills the job's last rank (default) or node 1's first (see victim_rank)")
    ap.add_argument("--repeat", type=int, default=1, help="launches per point and fault (medians)")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--fault-step", type=int, default=4)
    ap.add_argument("--detector-timeout", type=float, default=3.0, help="detector.timeout_s (the campaign's)")
    ap.add_argument("--detector-interval", type=float, default=0.5, help="detector.interval_s (the campaign's)")
    ap.add_argument("--launch-timeout", type=float, default=None, help="seconds per launch (default 300 + 30/process)")
    ap.add_argument("--out", type=Path, default=None, help="keep the launches' records here (default: a temp dir)")
    ap.add_argument("--results", type=Path, default=None,
                    help="JSON results (default benchmarks/results/nodes_cpu_<date>.json)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        points = parse_grid(args.grid or (GRID_QUICK if args.quick else GRID_FULL))
    except ValueError as e:
        ap.error(str(e))
    faults = tuple(f for f in args.faults.split(",") if f)
    if not faults or set(faults) - set(FAULTS):
        ap.error(f"--faults: choose from {', '.join(FAULTS)}")
    if not 0 < args.fault_step < args.steps - 1:
        ap.error("--fault-step must leave a step before it (a snapshot to restore) and one after it")
    root = args.out or Path(tempfile.mkdtemp(prefix="nckpt-bench-nodes-"))
    results = args.results or REPO / "benchmarks" / "results" / f"nodes_cpu_{time.strftime('%Y-%m-%d')}.json"
    period = args.detector_timeout + args.detector_interval
    from tools.bench.machine import machine_info

    doc: dict[str, Any] = {"machine": machine_info(root), "commit": _commit(),
                           "settings": {"grid": [p.name for p in points], "faults": list(faults),
                                        "repeat": args.repeat, "steps": args.steps, "fault_step": args.fault_step,
                                        "detector_timeout_s": args.detector_timeout,
                                        "detector_interval_s": args.detector_interval, "lost_node": LOST_NODE,
                                        "rank_victim": args.rank_victim,
                                        "recipe": "recipes/mcore_gpt_plain_loop.py (in process, distributed "
                                                  "optimizer)"},
                           "rows": []}
    t_all = time.time()
    for i in range(args.repeat):
        for p in points:
            for fault in faults:  # alternate the faults per point: a machine that gets busier hurts both alike
                row = run_one(p, fault, root=root / f"r{i}", steps=args.steps, step=args.fault_step,
                              interval_s=args.detector_interval, timeout_s=args.detector_timeout,
                              launch_timeout_s=args.launch_timeout or 300 + 30 * p.processes,
                              victim=args.rank_victim)
                row["repeat"] = i
                doc["rows"].append(row)
                print(f"{p.name} ({p.nodes} nodes, {p.processes} processes) {fault}: exit {row['exit']}, detect "
                      f"{_f(row['detect_s'], 0)} s, MTTR {_f(row['mttr_s'], 0)} s (timeline "
                      f"{_f(row['timeline_mttr_s'], 0)} s, detect from {row['detect_from']}); {row['wall_s']:.0f} s, "
                      f"load {row['loadavg_1m_before']}",
                      flush=True)
                doc["summary"] = summarize(doc["rows"], period_s=period)
                results.parent.mkdir(parents=True, exist_ok=True)
                results.write_text(json.dumps(doc, indent=1) + "\n")  # after each launch: a stopped run keeps its rows
    doc["wall_s"] = round(time.time() - t_all, 1)
    doc["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    doc["summary"] = summarize(doc["rows"], period_s=period)
    results.write_text(json.dumps(doc, indent=1) + "\n")
    print(report(doc["summary"]))
    print(f"wrote {results}")
    return 0 if all(r["exit"] == 0 for r in doc["rows"]) else 1


def _commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=REPO, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
