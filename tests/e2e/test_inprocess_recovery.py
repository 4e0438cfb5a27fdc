"""End to end, in-process recovery with a hot spare (issue 17, plain megatron-core loop).

4 active ranks + 1 hot spare, DP 4, DistributedOptimizer, one NVRx ``ft_launcher`` agent per simulated node with
``--ft-restart-policy min-healthy`` (the other agents' workers keep running when one dies), the TCP store in a
process of its own. Rank 1 is SIGKILLed (or raises, or is SIGSTOPped) inside the optimizer step of step 5: the
survivors stay the same processes, the spare becomes rank 1 and pulls rank 1's state from its ring successor, and the
training is bit for bit the failure-free one. What in-process recovery cannot contain (no spare left: two ranks lost
with one spare, or any loss without one) is announced, every rank exits 75 and ft_launcher's restart recovers, bit
for bit. The MTTR (fault to the end of the first step completed after it, on the slowest rank) and its phases are
printed.

NVRx's timers can be overridden with ``NEIGHBOR_CKPT_INPROCESS_TIMERS`` (e.g. ``soft_timeout=10,hard_timeout=15``)
when a loaded machine gives false soft timeouts."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from neighbor_ckpt.cli.launch import worker_program
from neighbor_ckpt.inprocess.wrapper import TIMERS_ENV
from tests.conftest import WORKERS, RunResult, assert_same_training, free_port, job_env, run_logged

pytestmark = pytest.mark.e2e

ACTIVE, SPARES = 4, 1
PHASES = ("abort_end", "finalize_end", "initialize", "enter", "pg_ready", "built", "ckpt_ready",
          "recovered", "first_step_end")


def launch_inprocess(tmp: Path, *, active: int = ACTIVE, spares: int = SPARES, timeout: float = 1200,
                     max_restarts: int = 0, min_nodes: int | None = None, program: str | None = None,
                     **env: Any) -> RunResult:
    """The store host, then one ``ft_launcher`` agent per simulated node (``NODE_NAME=node<i>``, its own host store
    root), as a launch script on a cluster would start them (one per node); exit status: the worst agent's.
    ``program``: what the agents run (default: the test worker)."""
    nodes = active + spares
    out = tmp / "out"
    tmp.mkdir(parents=True, exist_ok=True)
    store_port = free_port()
    py = shlex.quote(sys.executable)
    ft = shlex.quote(str(Path(sys.executable).with_name("ft_launcher")))
    extra: dict[str, Any] = {TIMERS_ENV: os.environ[TIMERS_ENV]} if os.environ.get(TIMERS_ENV) else {}
    full_env = job_env(tmp, out, {"STORE_HOST": "127.0.0.1", "STORE_PORT": store_port, "SPARES": spares,
                                  "NEIGHBOR_CKPT_INPROCESS_STORE": f"127.0.0.1:{store_port}",
                                  "NEIGHBOR_CKPT_JOB_ID": f"inproc-{tmp.name}", "TORCH_CPP_LOG_LEVEL": "error",
                                  **extra, **env})
    options, argv = worker_program(shlex.split(program) if program else [str(WORKERS / "train_mcore_inprocess.py")],
                                   env=full_env)  # warm or cold, as tests.conftest decided for this test
    worker = " ".join(shlex.quote(a) for a in [*options, *argv])
    ready = tmp / "store.ready"
    stores = shlex.quote(str(tmp / "store"))  # one host store root per simulated node (the worker sets the same)
    agents = "\n".join(
        f"NODE_NAME=node{i} NEIGHBOR_CKPT_NODE_ID=node{i} NEIGHBOR_CKPT_STORE_DIR={stores}/node{i} "
        f"{ft} --nnodes={min_nodes or active}:{nodes} --nproc-per-node=1 --rdzv-backend=c10d "
        f"--rdzv-endpoint=127.0.0.1:{store_port} --rdzv-conf=is_host=false --rdzv-id=inproc "
        f"--max-restarts={max_restarts} --monitor-interval=0.2 "
        f"--ft-restart-policy=min-healthy {worker} > {shlex.quote(str(tmp / f'agent{i}.log'))} 2>&1 &\n"
        f"pids+=($!)" for i in range(nodes))
    script = f"""
{py} -m neighbor_ckpt.inprocess.store_host --host 127.0.0.1 --port {store_port} --parent $$ --ready {ready} &
store=$!
for _ in $(seq 200); do [ -f {ready} ] && break; sleep 0.05; done
pids=()
{agents}
rc=0
for p in "${{pids[@]}}"; do wait $p; r=$?; echo "agent $p exited $r"; [ $r -gt $rc ] && rc=$r; done
kill $store
for i in $(seq 0 {nodes - 1}); do echo "===== agent $i"; cat {shlex.quote(str(tmp))}/agent$i.log; done
exit $rc
"""
    return run_logged(["bash", "-c", script], tmp, out, timeout=timeout, env=full_env)


def _load(p: Path) -> Any:
    return json.loads(p.read_text())


def attempts(res: RunResult) -> list[dict[str, Any]]:
    return [_load(p) for p in sorted(res.out.glob("attempt.initial*.iter*.json")) if ".launch" not in p.name]


def mttr(res: RunResult) -> dict[str, float]:
    """Fault -> end of the first completed step after it (slowest rank), and the phases in between: for each
    phase, the latest time any rank of the recovering attempt reached it, minus the fault time."""
    fault = _load(res.out / "fault.json")["unix"]
    rec = [a for a in attempts(res) if a["iteration"] >= 1 and "first_step_end" in a["times"]]
    events = [_load(p) for p in res.out.glob("events.initial*.json") if ".launch" not in p.name]
    marks: dict[str, float] = {}
    for name in ("abort_end", "finalize_end", "initialize"):
        ts = [e["unix"] for ev in events for e in ev["events"] if e["name"] == name and e["unix"] >= fault]
        if ts:
            # abort/finalize: the failing iteration's, on the survivors; initialize: the recovering iteration's
            marks[name] = max(ts) if name != "initialize" else max(
                e["unix"] for ev in events for e in ev["events"] if e["name"] == name and e["iteration"] == 1)
    for name in ("enter", "pg_ready", "built", "ckpt_ready", "recovered", "first_step_end"):
        marks[name] = max(a["times"][name] for a in rec if a["iteration"] == 1)
    return {k: v - fault for k, v in marks.items()}


def format_mttr(m: dict[str, float]) -> str:
    prev, parts = 0.0, []
    for name in PHASES:
        if name in m:
            parts.append(f"{name} +{m[name] - prev:.2f}s")
            prev = m[name]
    return f"MTTR {m['first_step_end']:.2f}s (fault -> first completed step): " + ", ".join(parts)


def timeline(res: RunResult, attempt: str) -> dict[str, Any]:
    return _load(res.out / "reports" / f"recovery_timeline.attempt{attempt}.json")


def check_inprocess(base: RunResult, res: RunResult, *, kind: str) -> dict[str, float]:
    assert res.returncode == 0, res.log[-8000:]
    fault = _load(res.out / "fault.json")
    assert fault["rank"] == 1 and fault["kind"] == kind
    assert_same_training(base, res, nranks=ACTIVE)
    atts = attempts(res)
    by_proc: dict[int, list[dict[str, Any]]] = {}
    for a in atts:
        by_proc.setdefault(a["initial_rank"], []).append(a)
    # every surviving process kept its pid and its rank through the restart
    for initial in (0, 2, 3):
        its = sorted(by_proc[initial], key=lambda a: a["iteration"])
        assert [a["iteration"] for a in its] == [0, 1], its
        assert len({a["pid"] for a in its}) == 1, f"initial rank {initial} changed process: {its}"
        assert {a["rank"] for a in its} == {initial}, f"initial rank {initial} changed rank: {its}"
    if kind in ("kill", "stop"):
        # the spare (started as rank 4) took rank 1's place in iteration 1, and pulled its state from a peer
        spare = by_proc[ACTIVE]
        assert [(a["iteration"], a["rank"]) for a in spare] == [(1, 1)], spare
        assert [a["iteration"] for a in by_proc[1]] == [0]
        rep = res.report(1, 1)
        assert rep["outcome"] == "restored" and rep["iteration"] == 4 and rep["source"] == "replica", rep
        assert any("prepared in advance" in n for n in rep["notes"]), \
            f"the spare prepares rank 1's receive slot from the layout rank 1 published: {rep}"
    else:
        # an exception: every process stays, rank 1 included; the spare stays idle
        assert ACTIVE not in by_proc
        assert len({a["pid"] for a in by_proc[1]}) == 1 and [a["iteration"] for a in by_proc[1]] == [0, 1]
        assert res.report(1, 1)["outcome"] == "restored"
    for r in range(ACTIVE):
        assert res.report(r, 1)["iteration"] == 4
    # rank 0's recovery timeline: in process, nobody restarted, the spare used for a lost rank only
    tl = timeline(res, "0.1")
    assert tl["mode"] == "in-process" and tl["restarted_ranks"] == [], tl
    assert tl["spare_used"] is (kind != "raise") and tl["spare_ranks"] == ([1] if kind != "raise" else []), tl
    assert list(tl["phases_s"]) == ["detect", "abort", "reform", "reconcile", "transfer", "restore", "first_step"]
    assert (res.out / "reports" / "recovery_timeline.attempt0.1.png").exists(), "PNG drawn before close() returned"
    m = mttr(res)
    print(f"\n[in-process {kind}] {format_mttr(m)}")
    return m


@pytest.fixture(scope="module")
def inprocess_baseline(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    res = launch_inprocess(tmp_path_factory.mktemp("inproc-base"), STEPS=10, FAULT="none")
    assert res.returncode == 0, res.log[-8000:]
    return res


@pytest.mark.quick
def test_inprocess_kill_with_hot_spare_is_bit_exact(inprocess_baseline: RunResult, tmp_path: Path) -> None:
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="kill", KILL_RANK=1, KILL_STEP=5)
    m = check_inprocess(inprocess_baseline, res, kind="kill")
    assert m["first_step_end"] < 10.0


def test_inprocess_exception_recovers_in_place(inprocess_baseline: RunResult, tmp_path: Path) -> None:
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="raise", KILL_RANK=1, KILL_STEP=5)
    check_inprocess(inprocess_baseline, res, kind="raise")


def test_inprocess_hang_is_killed_by_nvrx_and_replaced_by_the_spare(inprocess_baseline: RunResult,
                                                                   tmp_path: Path) -> None:
    """SIGSTOP of rank 1: no Python progress on it; NVRx's monitor process (a process of its own, not stopped)
    records the soft timeout, then kills the rank at the hard timeout; the spare takes rank 1's place."""
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="stop", KILL_RANK=1, KILL_STEP=5)
    check_inprocess(inprocess_baseline, res, kind="stop")
    victim = _load(res.out / "fault.json")["pid"]
    monitor = (res.out / "nvrx" / "nvrx_monitor.rank1.log").read_text(errors="replace")
    assert f"SIGTERM psutil.Process(pid={victim}," in monitor, "NVRx's monitor process did not terminate the victim"


def check_fallback(base: RunResult, res: RunResult, *, why: str, iteration: int = 4) -> None:
    """In-process recovery gave up, announced on every surviving rank; ft_launcher restarted every worker and
    recover() resumed ``iteration`` from the host stores, bit for bit; the timeline of the restart says so."""
    assert res.returncode == 0, res.log[-8000:]
    assert "in-process recovery gives up" in res.log and why in res.log, res.log[-8000:]
    assert "(exitcode: 75)" in res.log, "the survivors leave with the fallback status"
    assert "restarting worker group" in res.log
    assert_same_training(base, res, nranks=ACTIVE)
    for r in range(ACTIVE):
        rep = json.loads((res.out / f"report.rank{r}.attempt0.launch1.json").read_text())
        assert rep["outcome"] == "restored" and rep["iteration"] == iteration, rep
    tl = timeline(res, "1")
    assert tl["mode"] == "restart" and tl["restarted_ranks"] == list(range(ACTIVE)) and tl["spare_used"] is False


def test_inprocess_two_ranks_lost_with_one_spare_fall_back_to_launcher_restart(inprocess_baseline: RunResult,
                                                                               tmp_path: Path) -> None:
    """Two failures in one window (ranks 1 and 2 SIGKILLed in step 5) and one spare: in-process recovery gives up,
    announced (exit 75 on the survivors), and the launcher's restart recovers bit for bit."""
    res = launch_inprocess(tmp_path, min_nodes=ACTIVE - 1, max_restarts=1, STEPS=10, FAULT="kill", KILL_RANK="1,2",
                           KILL_STEP=5)
    check_fallback(inprocess_baseline, res, why="no hot spare left")
    assert sorted(_load(p)["rank"] for p in res.out.glob("fault.rank*.json")) == [1, 2]


def test_inprocess_failure_during_recovery_falls_back_to_launcher_restart(inprocess_baseline: RunResult,
                                                                         tmp_path: Path) -> None:
    """A failure inside the in-process recovery: rank 1 SIGKILLed in step 5, the first of two spares takes its place,
    and rank 2 is SIGKILLed while it loads the restored state (failpoint ``recovery.load``), before the attempt
    completes a step. A spare is still left, but a recovery that failed is not tried again in process: announced,
    every rank exits 75, and the launcher's restart recovers bit for bit. It restores iteration 3, not 4: the
    restore journal says iteration 4 was loaded by an attempt that died before completing a step after it, and such
    a state is never chosen again (it might be what kills the job)."""
    res = launch_inprocess(tmp_path, spares=2, min_nodes=ACTIVE - 1, max_restarts=1, STEPS=10, FAULT="kill",
                           KILL_RANK=1, KILL_STEP=5, RECOVERY_KILL_RANK=2)
    check_fallback(inprocess_baseline, res, why="failed before completing a step", iteration=3)
    assert "failpoint recovery.load reached" in res.log
    assert "iteration(s) [4] were restored by the previous attempt" in res.log


def test_inprocess_without_spare_falls_back_to_launcher_restart(inprocess_baseline: RunResult, tmp_path: Path) -> None:
    """No spare: the survivors give up in-process recovery, announced, and exit; ft_launcher (min 3 nodes, one
    restart) restarts every worker, and recover() resumes from the host stores, bit for bit."""
    res = launch_inprocess(tmp_path, spares=0, min_nodes=ACTIVE - 1, max_restarts=1, STEPS=10, FAULT="kill",
                           KILL_RANK=1, KILL_STEP=5)
    check_fallback(inprocess_baseline, res, why="no hot spare left")


def test_recipe_plain_loop_inprocess_mode_recovers_a_kill_with_the_spare(inprocess_baseline: RunResult,
                                                                        tmp_path: Path) -> None:
    """recipes/mcore_gpt_plain_loop.py with ``neighbor_ckpt.inprocess`` on in its YAML (the same GPT, data and steps
    as the test worker, through build_gpt): a SIGKILL of rank 1 in step 5's optimizer step recovers in process with
    the spare, bit for bit the worker's failure-free run."""
    cfg = tmp_path / "inprocess.yaml"
    cfg.write_text(f"neighbor_ckpt:\n  inprocess:\n    enabled: true\n    spares: {SPARES}\n"
                   f"  report:\n    dir: {tmp_path / 'out' / 'reports'}\n")
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "mcore_gpt_plain_loop.py"
    program = " ".join(shlex.quote(a) for a in (str(recipe), "--steps", "10", "--config", str(cfg), "--out",
                                                 str(tmp_path / "out"), "--kill", "1:5"))
    res = launch_inprocess(tmp_path, program=program)
    assert res.returncode == 0, res.log[-8000:]
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    assert _load(res.out / "fault.json")["rank"] == 1
    rep = _load(res.out / "report.rank1.attempt0.1.json")
    assert rep["outcome"] == "restored" and rep["iteration"] == 4 and rep["source"] == "replica", rep
    tl = timeline(res, "0.1")
    assert (tl["mode"], tl["restarted_ranks"], tl["spare_ranks"]) == ("in-process", [], [1]), tl
    print(f"\n[recipe in-process kill] {tl['mttr_s']:.2f} s: {tl['phases_s']}")


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.e2e.test_inprocess_recovery --runs 3 [--fault kill|raise] [--dir D]``: the MTTR of N kill
    (or exception) runs and its phases, one line per run, then min/median/max per phase."""
    import argparse
    import statistics
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fault", choices=("kill", "raise", "stop"), default="kill")
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="inproc-mttr-"))
    runs = []
    for i in range(args.runs):
        res = launch_inprocess(root / f"run{i}", STEPS=10, FAULT=args.fault, KILL_RANK=1, KILL_STEP=5)
        if res.returncode != 0:
            raise SystemExit(f"run {i} failed (exit {res.returncode}): {root / f'run{i}'}")
        m = mttr(res)
        runs.append(m)
        print(f"run {i}: {format_mttr(m)}", flush=True)
    print(f"{'phase':>16} " + " ".join(f"{'run' + str(i):>7}" for i in range(len(runs))) + "   median")
    for name in PHASES:
        prevs = [max([0.0] + [m[p] for p in PHASES[:PHASES.index(name)] if p in m]) for m in runs]
        d = [m[name] - p for m, p in zip(runs, prevs)]
        print(f"{name:>16} " + " ".join(f"{x:7.3f}" for x in d) + f"  {statistics.median(d):7.3f}")
    tot = [m["first_step_end"] for m in runs]
    print(f"{'MTTR':>16} " + " ".join(f"{x:7.3f}" for x in tot) + f"  {statistics.median(tot):7.3f}")


if __name__ == "__main__":
    main()
