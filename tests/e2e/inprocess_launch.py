"""The end-to-end tests' in-process launch: what ``neighbor-ckpt launch`` starts for an in-process job (the store host
and one of our launchers per simulated node ``node<i>``, :func:`neighbor_ckpt.cli.launch.inprocess_commands`), run
through :func:`neighbor_ckpt.cli.launch.run_inprocess` by a small runner (``python -m tests.e2e.inprocess_launch
SPEC.json``) under :func:`tests.conftest.run_logged` (own process group, output in ``tmp/torchrun.log``, timeout).

**No process of a launch may outlive it.** Before the runner returns (so before ``run_logged``'s clean-up kills
whatever is left), it looks for every process the launch ever had and finds still running a few seconds after the
launch returned:

* the store host and the launchers (``run_inprocess`` starts them: the runner records each ``Popen``);
* every descendant of the runner seen while the launch ran (a scan every 0.1 s: the launchers' processes, what
  those started), each identified by its pid and :func:`~neighbor_ckpt.runtime.procs.process_start`;
* every pid the workers recorded in ``OUT_DIR`` (``attempt.*.json``, ``events.*.json``, ``fault*.json``: a worker
  forked from the warm zygote is no descendant of its launcher), with its start time where recorded;
* every process whose environment carries the run's tag (``NEIGHBOR_CKPT_HARNESS_RUN``, inherited by all of them).

Those still alive (zombies do not count) are written to ``OUT_DIR/orphans.json`` (empty list: none), SIGKILLed, and
named in the log; :func:`assert_no_orphans` is what every in-process test asserts.

The runner prints one line per launcher (``launcher node<i> (pid P) exited R``) and for the store host; its exit
status is :func:`~neighbor_ckpt.cli.launch.launch_status` of the launchers' (124 when the launch timed out).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.conftest import WORKERS, RunResult, free_port, job_env, run_logged

GONE_WITHIN_S = 5.0
"""How long after the launch returned its processes get to be gone before they count as orphans."""

WORKER = WORKERS / "train_mcore_inprocess.py"


def launch_inprocess(tmp: Path, *, active: int = 4, spares: int = 1, timeout: float = 600, max_restarts: int = 0,
                     program: str | list[str] | None = None, grow_back: bool = False, detector_timeout_s: float = 2.0,
                     steal_store: int | None = None, hold_store: int | None = None, devices: int = 1,
                     elastic_launchers: bool | None = None, unreachable_node: int | None = None,
                     simulate_network: bool = False, cut_at_start: tuple[int, ...] = (), **env: Any) -> RunResult:
    """Launch ``program`` (default: the test worker ``tests/workers/train_mcore_inprocess.py``; a string is split
    as a shell would) in process: ``active`` ranks + ``spares`` hot spares, one simulated node (its own launcher and
    host store ``tmp/store/node<i>``) per process, ``max_restarts`` launcher-level restarts when in-process recovery
    gives up, ``grow_back``: the launchers' ``--grow-back``, ``detector_timeout_s``: the launchers'
    ``--detector-timeout`` (the test worker's ``detector.timeout_s``). ``steal_store``: the runner takes that store's
    port (binds and listens on it for the whole launch) between its choice and the launch's bind; ``hold_store``: the
    same, and the launchers' store hosts bind their ports themselves (as on a cluster), so that store's host cannot.
    ``unreachable_node``: that node's launcher gets a store list of ports nobody listens on (bound by the runner for
    the whole launch, never listening: refused), so it reaches no store.
    ``env``: the workers' environment on top of :func:`tests.conftest.job_env`'s (``SPARES`` and a job id
    fixed for the launch are set here). ``devices``: processes per simulated node (the spares on spare nodes of their
    own, :func:`neighbor_ckpt.cli.launch.simulated_nodes`; 1: a node per process). ``elastic_launchers``: the
    launchers' ``--elastic`` (default: as the workers' ``ELASTIC``). ``simulate_network``: each node in a network
    namespace of its own (``launch.simulate_network``, :mod:`neighbor_ckpt.runtime.netns`; root). ``cut_at_start``:
    with ``simulate_network``, these nodes are cut off the others (all traffic, for good) before any launcher starts,
    so that the start-up's roll call happens across the cut. The workers start warm or cold as ``tests/conftest.py``
    decided for this test. Returns the :class:`RunResult` (``out``: ``tmp/out``, ``orphans.json`` in it)."""
    out = tmp / "out"
    tmp.mkdir(parents=True, exist_ok=True)
    full_env = job_env(tmp, out, {"SPARES": spares, "NEIGHBOR_CKPT_JOB_ID": f"inproc-{tmp.name}",
                                  "TORCH_CPP_LOG_LEVEL": "error", **env})
    if program is None:
        argv = [str(WORKER)]
    else:
        argv = shlex.split(program) if isinstance(program, str) else list(program)
    spec = {"program": argv, "active": active, "spares": spares, "max_restarts": max_restarts, "grow_back": grow_back,
            "run_id": f"inproc-{tmp.name}", "store_root": str(tmp / "store"), "ready": str(tmp / "store_host.ready"),
            "out": str(out), "timeout": timeout, "detector_timeout_s": detector_timeout_s,
            "steal_store": steal_store, "hold_store": hold_store, "devices": devices,
            "unreachable_node": unreachable_node, "simulate_network": simulate_network,
            "cut_at_start": list(cut_at_start),
            "elastic": env.get("ELASTIC") == 1 or env.get("ELASTIC") == "1" if elastic_launchers is None
            else elastic_launchers}
    spec_path = tmp / "launch.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "tests.e2e.inprocess_launch", str(spec_path)]
    # the runner's own clean-up (the launchers' grace, the orphan check) on top of the launch's timeout
    return run_logged(cmd, tmp, out, timeout=timeout + 90, env=full_env)


def launch_config(config: str, tmp: Path, *overrides: str, timeout: float = 900, **env: Any) -> RunResult:
    """``neighbor-ckpt launch configs/<config> OVERRIDES --run-dir tmp/run --record`` with in-process recovery on
    (what :func:`tests.conftest.run_launch` runs, planned by the same functions: ``plan_launch``,
    ``inprocess_processes``), through this module's runner, so that no process outliving the launch goes unnoticed.
    Host stores under ``tmp/store``."""
    from tests.conftest import REPO

    run_dir = tmp / "run"
    out = run_dir / "record"
    tmp.mkdir(parents=True, exist_ok=True)
    full_env = job_env(tmp, out, {"NEIGHBOR_CKPT_STORE_DIR": tmp / "store", **env})
    spec = {"config": str(REPO / "configs" / config), "overrides": list(overrides), "run_dir": str(run_dir),
            "ready": str(run_dir / "store_host.ready"), "out": str(out), "timeout": timeout}
    spec_path = tmp / "launch.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    return run_logged([sys.executable, "-m", "tests.e2e.inprocess_launch", str(spec_path)], tmp, out,
                      timeout=timeout + 90, env=full_env)


# --- what the tests read ---------------------------------------------------------------------------------------------


def load(p: Path) -> Any:
    return json.loads(p.read_text())


def attempts(res: RunResult, *, launch: int = 0) -> list[dict[str, Any]]:
    """The worker's ``attempt.initial<i>.iter<k>[.launch<n>].json`` records of launcher-level attempt ``launch``."""
    files = sorted(res.out.glob("attempt.initial*.iter*.json"))
    if launch:
        return [load(p) for p in files if p.name.endswith(f".launch{launch}.json")]
    return [load(p) for p in files if ".launch" not in p.name]


def timeline(res: RunResult, attempt: str) -> dict[str, Any]:
    return load(res.out / "reports" / f"recovery_timeline.attempt{attempt}.json")


def orphans(res: RunResult) -> list[dict[str, Any]]:
    return load(res.out / "orphans.json")


def assert_no_orphans(res: RunResult) -> None:
    """No process of the launch outlived it (the runner's check; ``orphans.json`` must exist: the runner ran it)."""
    path = res.out / "orphans.json"
    assert path.exists(), f"the runner did not check for orphans (no {path}): {res.log[-4000:]}"
    left = load(path)
    assert left == [], f"processes of the launch outlived it: {left}"


def launcher_exits(res: RunResult) -> dict[str, int]:
    """``node<i>`` -> the exit status of its launcher (``Popen.returncode``: -9 for SIGKILL)."""
    import re

    return {m.group(1): int(m.group(2)) for m in
            re.finditer(r"^launcher (\S+) \(pid \d+\) exited (-?\d+)$", res.log, flags=re.M)}


def failures(res: RunResult) -> list[tuple[int, str, str]]:
    """Every ``generation G failed (KIND by WHO)`` line of the workers, deduplicated: (G, KIND, WHO)."""
    import re

    found = re.findall(r"generation (\d+) failed \((\w+) by ([^)]+)\)", res.log)
    return sorted({(int(g), k, w) for g, k, w in found})


# --- the runner ------------------------------------------------------------------------------------------------------


class _Tracker:
    """Every process the launch had: the ``Popen`` objects of ``run_inprocess`` and the runner's descendants."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen] = []
        self.seen: dict[tuple[int, float | None], dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._scan_loop, name="orphan-scan", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.scan()

    def _scan_loop(self) -> None:
        while not self._stop.wait(0.1):
            self.scan()

    def scan(self) -> None:
        import psutil

        from neighbor_ckpt.runtime.procs import process_start

        try:
            kids = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        for p in kids:
            start = process_start(p.pid)
            if start is None or (p.pid, start) in self.seen:
                continue
            try:
                cmd = " ".join(p.cmdline())[:300]
            except psutil.Error:
                cmd = "?"
            self.seen[(p.pid, start)] = {"pid": p.pid, "start": start, "cmdline": cmd, "source": "descendant"}


def _recorded(out: Path) -> dict[tuple[int, float | None], dict[str, Any]]:
    """The pids the workers wrote in ``out`` (with their start times where written)."""
    found: dict[tuple[int, float | None], dict[str, Any]] = {}
    for pattern in ("attempt.*.json", "events.*.json", "fault*.json"):
        for p in out.glob(pattern):
            try:
                rec = json.loads(p.read_text())
                pid = int(rec["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            start = rec.get("pid_start")
            found.setdefault((pid, start), {"pid": pid, "start": start, "cmdline": "", "source": p.name})
    return found


def _tagged() -> dict[tuple[int, float | None], dict[str, Any]]:
    """Every process (of this user) that carries this run's tag, but this runner."""
    import psutil

    from neighbor_ckpt.runtime.procs import RUN_TAG_ENV, process_start

    tag = os.environ.get(RUN_TAG_ENV)
    found: dict[tuple[int, float | None], dict[str, Any]] = {}
    if not tag:
        return found
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(RUN_TAG_ENV) != tag:
                continue
            cmd = " ".join(proc.cmdline())[:300]
        except psutil.Error:
            continue
        start = process_start(proc.pid)
        found[(proc.pid, start)] = {"pid": proc.pid, "start": start, "cmdline": cmd, "source": "run tag"}
    return found


def _alive(pid: int, start: float | None) -> bool:
    """``pid`` runs (not a zombie) and, where ``start`` is known, is the process that started then."""
    import psutil

    from neighbor_ckpt.runtime.procs import process_start

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.Error:
        return False
    return start is None or process_start(pid) == start


def find_orphans(tracker: _Tracker, out: Path, *, within_s: float = GONE_WITHIN_S) -> list[dict[str, Any]]:
    """The launch's processes still running ``within_s`` seconds from now (polled: gone earlier is fine)."""
    deadline = time.monotonic() + within_s
    while True:
        known = {**tracker.seen, **_recorded(out), **_tagged()}
        for p in tracker.popens:
            known.setdefault((p.pid, None), {"pid": p.pid, "start": None, "cmdline": " ".join(map(str, p.args))[:300],
                                             "source": "launch"})
        left = [info for (pid, start), info in known.items() if pid != os.getpid() and _alive(pid, start)]
        # the same pid seen with and without a start time counts once
        uniq = {info["pid"]: info for info in left}
        if not uniq or time.monotonic() > deadline:
            return sorted(uniq.values(), key=lambda i: i["pid"])
        time.sleep(0.1)


def _run(spec: dict[str, Any]) -> int:
    """Run the launch ``spec`` describes; with a simulated network (the job file's ``launch.simulate_network``, or the
    spec's ``simulate_network``) inside it, as ``neighbor-ckpt launch`` does."""
    import contextlib

    from neighbor_ckpt.cli.launch import plan_launch, simulated_nodes
    from neighbor_ckpt.runtime.netns import simulated_network

    if "config" in spec:
        plan = plan_launch(spec["config"], spec["overrides"], run_dir=Path(spec["run_dir"]), record=True)
        nodes, simulate = len(plan.simulated_nodes), plan.job.launch.simulate_network
    else:
        plan = None
        nodes = len(simulated_nodes(spec["active"], spec["spares"], int(spec.get("devices", 1))))
        simulate = bool(spec.get("simulate_network"))
    with contextlib.ExitStack() as stack:
        network = stack.enter_context(simulated_network(nodes)) if simulate else None
        return _run_in(spec, plan, network)


def _run_in(spec: dict[str, Any], plan: Any, network: Any) -> int:
    from neighbor_ckpt.cli.launch import free_ports, inprocess_commands, run_inprocess, simulated_nodes

    tracker = _Tracker()
    real_popen = subprocess.Popen

    class _Recorded(real_popen):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            tracker.popens.append(self)

    out = Path(spec["out"])
    if plan is not None:  # a job file, as `neighbor-ckpt launch CONFIG OVERRIDES --record` plans it
        from neighbor_ckpt.cli.launch import inprocess_processes, write_run_dir
        from neighbor_ckpt.config import expand_store_dir

        write_run_dir(plan)
        root = expand_store_dir(os.environ.get("NEIGHBOR_CKPT_STORE_DIR") or plan.job.neighbor_ckpt.store.dir)
        procs = inprocess_processes(plan, store_port=free_ports(len(plan.simulated_nodes)), store_root=root,
                                    network=network)
    else:
        devices = int(spec.get("devices", 1))
        ports = free_ports(len(simulated_nodes(spec["active"], spec["spares"], devices)))
        procs = inprocess_commands(spec["program"], active=spec["active"], spares=spec["spares"],
                                   max_restarts=spec["max_restarts"], run_id=spec["run_id"], store_port=ports,
                                   store_root=Path(spec["store_root"]), grow_back=bool(spec.get("grow_back")),
                                   detector_timeout_s=spec.get("detector_timeout_s"), devices=devices,
                                   elastic=bool(spec.get("elastic")), network=network)
    taken = spec.get("steal_store")
    if taken is None:
        taken = spec.get("hold_store")
    thief = None
    if taken is not None:  # another process takes that store's port after its choice, for the whole launch
        thief = socket.socket()
        thief.bind(("127.0.0.1", int(procs.stores.split(",")[taken].rpartition(":")[2])))
        thief.listen()
        print(f"inprocess_launch: port {thief.getsockname()[1]} of store {taken} taken by the runner", flush=True)
    closed: list[socket.socket] = []
    lonely = spec.get("unreachable_node")
    if lonely is not None:  # that launcher's own store list: ports bound here, never listening (refused)
        for _ in procs.stores.split(","):
            closed.append(socket.socket())
            closed[-1].bind(("127.0.0.1", 0))
        cmd, extra = procs.agents[lonely]
        end = list(cmd).index("--")
        wrong = ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in closed)
        agents = list(procs.agents)
        agents[lonely] = ((*cmd[:end], "--store", wrong, *cmd[end:]), extra)  # the last --store counts
        procs = dataclasses.replace(procs, agents=tuple(agents))
        print(f"inprocess_launch: node {lonely}'s launcher gets stores nobody listens on: {wrong}", flush=True)
    cut = [int(n) for n in spec.get("cut_at_start") or ()]
    if cut:  # before any launcher starts: the roll call is held across the cut
        from neighbor_ckpt.runtime import netns
        from neighbor_ckpt.runtime.network_plan import PLAN_ENV

        if network is None:
            raise RuntimeError("inprocess_launch: cut_at_start needs simulate_network")
        netns.cut(cut, "all", env={PLAN_ENV: str(network[1])})
        print(f"inprocess_launch: node(s) {cut} cut off before the launchers start (unix {time.time():.3f})",
              flush=True)
    out.mkdir(parents=True, exist_ok=True)
    tracker.start()
    subprocess.Popen = _Recorded  # type: ignore[misc] - this process runs nothing else
    t0 = time.monotonic()
    try:
        rc = run_inprocess(procs, timeout=float(spec["timeout"]), bind_ports=spec.get("hold_store") is None)
    except subprocess.TimeoutExpired:
        print(f"inprocess_launch: the launch timed out after {spec['timeout']} s", flush=True)
        rc = 124
    finally:
        subprocess.Popen = real_popen  # type: ignore[misc]
        if network is not None:  # as the launch's end removes it (its heal timers too), before the orphan check
            from neighbor_ckpt.runtime.netns import teardown

            teardown(network[0])
        tracker.stop()
        if thief is not None:
            thief.close()
        for s in closed:
            s.close()
    print(f"inprocess_launch: the launch returned {rc} after {time.monotonic() - t0:.1f} s", flush=True)
    agents = tracker.popens
    for (cmd, _extra), p in zip(procs.agents, agents):
        node = cmd[list(cmd).index("--node") + 1]
        print(f"launcher {node} (pid {p.pid}) exited {p.returncode}", flush=True)
    left = find_orphans(tracker, out)
    (out / "orphans.json").write_text(json.dumps(left, indent=1))
    for info in left:
        print(f"inprocess_launch: ORPHAN: pid {info['pid']} ({info['source']}) still runs {GONE_WITHIN_S:.0f} s "
              f"after the launch returned: {info['cmdline']}", flush=True)
        try:
            os.kill(info["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    return rc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m tests.e2e.inprocess_launch SPEC.json")
    return _run(json.loads(Path(args[0]).read_text()))


if __name__ == "__main__":
    sys.exit(main())
