"""``python -m tools.bench --reform [--rounds 8] [--launches 3] [--config gpt_tiny_cpu] [--out FILE]``: where an
in-process re-form's time goes, with the store gate on and off in one run.

Two parts, each paired (the modes alternate, ``A B B A ...``, so a machine that gets busier hurts both alike):

* **groups** (``--rounds``): ``--world`` processes re-form ``--rounds`` times on each of two store hosts
  (``python -m neighbor_ckpt.inprocess.store_host``), one open and one behind its gate (``--token-file``: every
  store operation through this process's tunnel and the host's gate). A round is what a re-form does to the groups
  and nothing else: ``init_process_group`` (gloo) on the generation's store prefix, megatron-core's
  ``initialize_model_parallel`` with NeMo's arguments (gloo twins of the data-parallel groups included), the first
  all-reduce on the data-parallel group, and the groups destroyed. Per round the slowest rank's time of each part;
  the store operations of one round are counted once, apart (a counting store in Python between torch and the
  client), and the new groups this rank is a member of.
* **launch** (``--launches``, 0: none): the NeMo recipe's in-process kill (``--config``, 4 ranks + 1 hot spare,
  rank 1 SIGKILLed in the optimizer step of step 5), launched ``--launches`` times with the gate and as many without
  (the launchers get no token file: no gate, no tunnel), alternating. Per launch: the MTTR (the kill to the end of
  the first step after it on the slowest rank, as ``neighbor-ckpt demo`` measures it), the recovery timeline's phases
  and, from the probe (``tools/bench/reform_probe``, put on the workers' ``PYTHONPATH``), when the slowest process
  reached each milestone of the re-form and how long each part took on each process.

Medians over rounds / launches; every sample is kept in ``--out``. Timing on a loaded machine is noisy: compare the
modes of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[2]
PROBE_DIR = Path(__file__).resolve().parent / "reform_probe"
MODES = ("gated", "open")
GROUP_MODES = (*MODES, "gated-lazy")
"""The groups part also runs ``gated-lazy``: the gate on, and megatron-core's groups made with gloo's lazy connection
(``TORCH_GLOO_LAZY_INIT=1`` around ``initialize_model_parallel`` only: the default group stays eager)."""
GROUP_PARTS = ("init_process_group", "initialize_model_parallel", "first_all_reduce", "destroy")

# -- groups -----------------------------------------------------------------------------------------------------------


def _counting_store(inner: Any) -> Any:
    """A ``torch.distributed.Store`` in Python that forwards to ``inner`` and counts every operation (gloo's and
    torch's calls from C++ come through it)."""
    import torch.distributed as dist

    class Counting(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, int] = {}

        def _n(self, op: str) -> None:
            self.ops[op] = self.ops.get(op, 0) + 1

        def set(self, key, value):  # noqa: ANN001, ANN201
            self._n("set")
            return inner.set(key, value)

        def get(self, key):  # noqa: ANN001, ANN201
            self._n("get")
            return inner.get(key)

        def add(self, key, value):  # noqa: ANN001, ANN201
            self._n("add")
            return inner.add(key, value)

        def compare_set(self, key, expected, desired):  # noqa: ANN001, ANN201
            self._n("compare_set")
            return inner.compare_set(key, expected, desired)

        def check(self, keys):  # noqa: ANN001, ANN201
            self._n("check")
            return inner.check(keys)

        def wait(self, keys, timeout=None):  # noqa: ANN001, ANN201
            self._n("wait")
            return inner.wait(keys) if timeout is None else inner.wait(keys, timeout)

        def multi_get(self, keys):  # noqa: ANN001, ANN201
            self._n("multi_get")
            return inner.multi_get(keys)

        def multi_set(self, keys, values):  # noqa: ANN001, ANN201
            self._n("multi_set")
            return inner.multi_set(keys, values)

        def delete_key(self, key):  # noqa: ANN001, ANN201
            self._n("delete_key")
            return inner.delete_key(key)

        def num_keys(self):  # noqa: ANN201
            self._n("num_keys")
            return inner.num_keys()

        def set_timeout(self, timeout):  # noqa: ANN001, ANN201
            return inner.set_timeout(timeout)

        @property
        def timeout(self):  # noqa: ANN201
            return inner.timeout

    return Counting()


def _one_round(store: Any, rank: int, world: int, lazy: bool = False) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    created: list[int] = []
    new_group = dist.new_group

    def counting_new_group(*args: Any, **kwargs: Any) -> Any:
        g = new_group(*args, **kwargs)
        ranks = kwargs.get("ranks", args[0] if args else None)
        if ranks is not None and rank in ranks:
            created.append(len(ranks))
        return g

    t = [time.time()]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    t.append(time.time())
    dist.new_group = counting_new_group
    if lazy:
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:  # NeMo 2.7.3's call (nemo/lightning/_strategy_lib.py) for TP = PP = CP = EP = 1
        ps.initialize_model_parallel(order="tp-cp-ep-dp-pp", create_gloo_process_groups=True)
    finally:
        dist.new_group = new_group
        os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
    t.append(time.time())
    x = torch.ones(8)
    dist.all_reduce(x, group=ps.get_data_parallel_group())
    t.append(time.time())
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    t.append(time.time())
    return {"s": {p: t[i + 1] - t[i] for i, p in enumerate(GROUP_PARTS)}, "member_groups": created}


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron_patches import enable_cpu

    enable_cpu()
    from neighbor_ckpt.inprocess.store_auth import read_token, tunnel_address

    token = read_token(Path(args.token_file))
    remote = {"open": ("127.0.0.1", args.open_port), "gated": ("127.0.0.1", args.gated_port)}
    clients = {m: dist.TCPStore(*(tunnel_address(remote[m], token) if m == "gated" else remote[m]), is_master=False,
                                wait_for_workers=False, use_libuv=True, timeout=timedelta(seconds=120))
               for m in MODES}
    sync = clients["open"]

    def barrier(name: str) -> None:
        sync.add(f"sync/{name}", 1)
        while int(sync.add(f"sync/{name}", 0)) < args.world:
            time.sleep(0.002)

    out: list[dict[str, Any]] = []
    barrier("count")  # one round through a counting store (untimed: the counting costs Python calls)
    counting = _counting_store(clients["gated"])
    rec = _one_round(dist.PrefixStore("bench/count/pg/", counting), args.rank, args.world)
    out.append({"round": -1, "mode": "count", "rank": args.rank, "store_ops": counting.ops, **rec})
    for r in range(args.rounds):
        for mode in (GROUP_MODES if r % 2 == 0 else GROUP_MODES[::-1]):
            barrier(f"{r}/{mode}")
            client = clients[mode.split("-")[0]]
            rec = _one_round(dist.PrefixStore(f"bench/gen/{r}/{mode}/pg/", client), args.rank, args.world,
                             lazy=mode.endswith("-lazy"))
            out.append({"round": r, "mode": mode, "rank": args.rank, **rec})
    Path(args.out).write_text(json.dumps(out))
    return 0


def _host(tmp: Path, name: str, token_file: Path | None) -> tuple[subprocess.Popen, int]:
    from tools.bench.store_gate import _host as start

    return start(tmp, name, token_file)


def run_groups(rounds: int, world: int) -> dict[str, Any]:
    """The groups part (see the module docstring)."""
    from neighbor_ckpt.inprocess.store_auth import new_token_file

    with tempfile.TemporaryDirectory(prefix="nckpt-reform-") as d:
        tmp = Path(d)
        token_file = new_token_file(tmp / "store.token")
        hosts = [_host(tmp, "open", None), _host(tmp, "gated", token_file)]
        try:
            env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "error", "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
            workers = [subprocess.Popen([sys.executable, "-m", "tools.bench.reform", "--worker", "--rank", str(r),
                                         "--world", str(world), "--rounds", str(rounds), "--open-port",
                                         str(hosts[0][1]), "--gated-port", str(hosts[1][1]), "--token-file",
                                         str(token_file), "--worker-out", str(tmp / f"w{r}.json")], cwd=REPO, env=env)
                       for r in range(world)]
            codes = [w.wait(timeout=1800) for w in workers]
            if any(codes):
                raise RuntimeError(f"a groups worker failed: exit statuses {codes}")
            recs = [x for r in range(world) for x in json.loads((tmp / f"w{r}.json").read_text())]
        finally:
            for p, _ in hosts:
                p.kill()
                p.wait()
    return summarize_groups(recs, world)


def summarize_groups(recs: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """Per mode and part: the median over rounds of the slowest rank's seconds (round 0 left out: first calls)."""
    out: dict[str, Any] = {"world": world, "modes": {}}
    for mode in sorted({x["mode"] for x in recs} - {"count"}, key=lambda m: (m not in MODES, m)):
        rounds: dict[int, list[dict[str, Any]]] = {}
        for x in recs:
            if x["mode"] == mode and x["round"] > 0:
                rounds.setdefault(x["round"], []).append(x)
        slowest = {p: [max(y["s"][p] for y in v) for _, v in sorted(rounds.items())] for p in GROUP_PARTS}
        total = [sum(max(y["s"][p] for y in v) for p in GROUP_PARTS[:3]) for _, v in sorted(rounds.items())]
        out["modes"][mode] = {"median_s": {p: statistics.median(s) for p, s in slowest.items() if s},
                              "median_reform_s": statistics.median(total) if total else None,
                              "samples_s": slowest}
    count = [x for x in recs if x["mode"] == "count"]
    if count:
        out["store_ops_per_rank"] = {str(x["rank"]): x["store_ops"] for x in count}
        out["member_groups_per_rank"] = {str(x["rank"]): x["member_groups"] for x in count}
        out["groups_created_per_rank"] = len(count[0]["member_groups"])
    return out


# -- launch -----------------------------------------------------------------------------------------------------------

MILESTONES = ("abort_end", "finalize_end", "initialize", "built", "torch.init_process_group",
              "mcore.initialize_model_parallel", "pg_ready", "nemo.strategy.setup", "ckpt.__init__", "recovered",
              "first_step_end")
"""The re-form's milestones, in order: engine events (``events.initial<i>.json``) and the ends of probe spans."""

SPANS = ("engine.finalize", "engine.barrier", "lightning.Trainer.__init__", "torch.init_process_group",
         "mcore.initialize_model_parallel", "torch.new_group", "nemo.strategy.setup", "mcore.get_megatron_optimizer",
         "ckpt.__init__", "ckpt.recover", "ckpt.callback.on_fit_start")


def _launch_once(config: str, overrides: Sequence[str], run_dir: Path, mode: str, probe_out: Path,
                 timeout: float) -> int:
    from neighbor_ckpt.cli import launch

    plan = launch.plan_launch(config, list(overrides), run_dir=run_dir, record=True)
    launch.write_run_dir(plan)
    procs = launch.inprocess_processes(plan, store_port=launch.free_ports(plan.processes),
                                       store_root=run_dir / "store")
    if mode == "open":  # no token file: the store hosts open no gate, the processes no tunnel
        agents = []
        for cmd, extra in procs.agents:
            cmd = list(cmd)
            i = cmd.index("--token-file")
            agents.append((tuple(cmd[:i] + cmd[i + 2:]), extra))
        procs = launch.InprocessProcesses(stores=procs.stores, agents=tuple(agents), token_file=procs.token_file)
    probe_out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NEIGHBOR_CKPT_REFORM_PROBE": str(probe_out), "TORCH_CPP_LOG_LEVEL": "error",
           "PYTHONPATH": os.pathsep.join([str(PROBE_DIR), str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(run_dir / "torchrun.log", "w") as log:
        return launch.run_inprocess(procs, env=env, timeout=timeout, stdout=log, stderr=subprocess.STDOUT)


def analyse_launch(run_dir: Path, probe_out: Path) -> dict[str, Any]:
    """One launch's MTTR, timeline phases, milestones (seconds from the kill to the slowest process) and each span's
    seconds per process (pure over the files)."""
    from neighbor_ckpt.cli.demo import measured_mttr

    record = run_dir / "record"
    t0 = json.loads((record / "fault.json").read_text())["unix"]
    res: dict[str, Any] = {"mttr_s": measured_mttr(record)}
    timelines = sorted(run_dir.rglob("recovery_timeline*.json"))
    if timelines:
        tl = json.loads(timelines[0].read_text())
        res["timeline_phases_s"] = tl.get("phases_s")
        res["timeline_mttr_s"] = tl.get("mttr_s")
    marks: dict[str, list[float]] = {}
    for p in record.glob("events.initial*.json"):
        if ".launch" in p.name:
            continue
        for e in json.loads(p.read_text())["events"]:
            it = 0 if e["name"] in ("abort_end", "finalize_end") else 1
            if e["name"] in MILESTONES and e["iteration"] == it and e["unix"] >= t0:
                marks.setdefault(e["name"], []).append(e["unix"] - t0)
    spans: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for p in probe_out.glob("probe.*.json"):
        d = json.loads(p.read_text())
        who = str(d.get("process"))
        for label, a, b, _thread in d["spans"]:
            spans.setdefault(label, {}).setdefault(who, 0.0)
            spans[label][who] += b - a
            counts.setdefault(label, {}).setdefault(who, 0)
            counts[label][who] += 1
            if label in MILESTONES and b >= t0:
                marks.setdefault(label, []).append(b - t0)
    res["milestones_s"] = {m: max(marks[m]) for m in MILESTONES if m in marks}
    res["spans_s"] = spans
    res["span_calls"] = counts
    return res


def run_launches(n: int, config: str, overrides: Sequence[str], root: Path, timeout: float) -> dict[str, Any]:
    """The launch part: ``n`` launches per mode, alternating (see the module docstring)."""
    order = [MODES[(i // 2 + i) % 2] for i in range(2 * n)]  # gated, open, open, gated, gated, open, ...
    runs: list[dict[str, Any]] = []
    for i, mode in enumerate(order):
        run_dir, probe_out = root / f"launch{i}-{mode}", root / f"launch{i}-{mode}-probe"
        t = time.time()
        rc = _launch_once(config, overrides, run_dir, mode, probe_out, timeout)
        entry: dict[str, Any] = {"index": i, "mode": mode, "exit": rc, "wall_s": time.time() - t,
                                 "run_dir": str(run_dir)}
        if rc == 0:
            try:
                entry.update(analyse_launch(run_dir, probe_out))
            except (OSError, ValueError, KeyError) as e:
                entry["error"] = f"{type(e).__name__}: {e}"
        runs.append(entry)
        print(f"launch {i} ({mode}): exit {rc}, MTTR {entry.get('mttr_s')}", flush=True)
    return {"runs": runs, "modes": {m: summarize_launches([r for r in runs if r["mode"] == m]) for m in MODES}}


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize_launches(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the launches of one mode: MTTR, timeline phases, milestones, each span's slowest process."""
    ok = [r for r in runs if r.get("mttr_s") is not None]
    phases = sorted({p for r in ok for p in (r.get("timeline_phases_s") or {})})
    return {
        "launches": len(runs), "measured": len(ok),
        "mttr_s": _median([r["mttr_s"] for r in ok]),
        "timeline_phases_s": {p: _median([(r.get("timeline_phases_s") or {}).get(p) for r in ok]) for p in phases},
        "milestones_s": {m: _median([r["milestones_s"].get(m) for r in ok]) for m in MILESTONES},
        "spans_slowest_s": {s: _median([max(r["spans_s"][s].values()) if s in r["spans_s"] else None for r in ok])
                            for s in SPANS},
    }


# -- main -------------------------------------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    return "    -" if x is None else f"{x:5.3f}"


def print_report(res: dict[str, Any]) -> None:
    g = res.get("groups")
    if g:
        print(f"\ngroups: {g['world']} ranks, median of the slowest rank per round (s)")
        print(f"{'mode':6} " + " ".join(f"{p:>26}" for p in GROUP_PARTS) + f" {'re-form':>8}")
        for mode, m in g["modes"].items():
            print(f"{mode:6} " + " ".join(f"{_fmt(m['median_s'].get(p)):>26}" for p in GROUP_PARTS)
                  + f" {_fmt(m['median_reform_s']):>8}")
        if "store_ops_per_rank" in g:
            print(f"store operations of one round, per rank: {g['store_ops_per_rank']}")
            print(f"groups this rank is a member of: {g['groups_created_per_rank']} (sizes of rank 0's: "
                  f"{g['member_groups_per_rank'].get('0')})")
    la = res.get("launch")
    if la:
        print("\nlaunch: medians (s); milestones: from the kill to the slowest process")
        print(f"{'':34} " + " ".join(f"{m:>8}" for m in MODES))
        rows = [("MTTR", {m: la["modes"][m]["mttr_s"] for m in MODES})]
        rows += [(f"phase {p}", {m: la["modes"][m]["timeline_phases_s"].get(p) for m in MODES})
                 for p in la["modes"][MODES[0]]["timeline_phases_s"]]
        rows += [(f"at {k}", {m: la["modes"][m]["milestones_s"].get(k) for m in MODES}) for k in MILESTONES]
        rows += [(f"span {k}", {m: la["modes"][m]["spans_slowest_s"].get(k) for m in MODES}) for k in SPANS]
        for name, vals in rows:
            print(f"{name:34} " + " ".join(f"{_fmt(vals[m]):>8}" for m in MODES))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench --reform", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="re-forms of the groups part per mode (0: skip it)")
    ap.add_argument("--world", type=int, default=4, help="ranks of the groups part (default 4)")
    ap.add_argument("--launches", type=int, default=0, help="NeMo launches per mode (default 0: none; ~2 min each here)")
    ap.add_argument("--config", default="gpt_tiny_cpu", help="the launch part's job file (default gpt_tiny_cpu)")
    ap.add_argument("--launch-timeout", type=float, default=900.0)
    ap.add_argument("--keep", type=Path, default=None, help="keep the launches' run directories here")
    ap.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    ap.add_argument("overrides", nargs="*", help="more key.path=value for the launches")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for a in ("--rank", "--open-port", "--gated-port"):
        ap.add_argument(a, type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--token-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.worker:
        args.out = args.worker_out
        return _worker(args)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "error")
    res: dict[str, Any] = {}
    if args.rounds > 0:
        res["groups"] = run_groups(args.rounds, args.world)
    if args.launches > 0:
        overrides = ["trainer.max_steps=8", "neighbor_ckpt.fault_injection.enabled=true",
                     "neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=1", *args.overrides]
        root = args.keep or Path(tempfile.mkdtemp(prefix="nckpt-reform-launch-"))
        res["launch"] = run_launches(args.launches, args.config, overrides, root, args.launch_timeout)
        res["launch"]["overrides"] = overrides
    from tools.bench.machine import machine_info

    res["machine"] = machine_info(Path(tempfile.gettempdir()))
    res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                   cwd=REPO).stdout.strip()
    print_report(res)
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
