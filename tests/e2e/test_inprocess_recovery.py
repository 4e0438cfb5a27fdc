"""End to end, in-process recovery with hot spares on our own engine (issue 28, plain megatron-core loop).

4 active ranks + 1 hot spare (2 where said), DP 4, DistributedOptimizer, one of our launchers per simulated node and
the store host, as ``neighbor-ckpt launch`` starts them (:mod:`tests.e2e.inprocess_launch`). Rank 1 fails inside the
optimizer step of step 5: SIGKILLed, SIGSTOPped, its training thread blocked in a C call while its heartbeat goes on,
or raising. The survivors stay the same processes; a lost rank's place goes to the spare, which pulls rank 1's state
from its ring successor; the training is bit for bit the failure-free one. Each test asserts which detector path
fired (the workers' ``generation 0 failed (KIND by WHO)`` log lines), the timeline's mode and ranks, and that no
process of the launch outlived it (``orphans.json``); never a wall-clock limit.

What in-process recovery cannot contain (no spare left, a failure during the recovery) is announced, every process
exits 75, and our launchers restart the whole job (``TORCHELASTIC_RESTART_COUNT=1``), which ``recover()`` resumes
bit for bit from the host stores.

``python -m tests.e2e.test_inprocess_recovery --runs 3 --fault kill|raise|stop|block``: the MTTR (fault to the end of
the first step completed after it, on the slowest rank) and its phases, per run and the median (docs/benchmarks.md)."""

from __future__ import annotations

import re
import shlex
import socketserver
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.conftest import RunResult, assert_same_training
from tests.e2e.inprocess_launch import (assert_no_orphans, attempts, failures, launch_inprocess, launcher_exits, load,
                                        timeline)

pytestmark = pytest.mark.e2e

ACTIVE, SPARES = 4, 1
PHASES = ("abort_end", "finalize_end", "initialize", "enter", "pg_ready", "built", "ckpt_ready",
          "recovered", "first_forward_backward", "first_optimizer_step", "first_step_end")


def mttr(res: RunResult) -> dict[str, float]:
    """Fault -> end of the first completed step after it (slowest rank), and the phases in between: for each
    phase, the latest time any process reached it in the recovering generation (abort and finalisation: the
    failed one's, on the survivors), minus the fault time."""
    fault = load(res.out / "fault.json")["unix"]
    rec = [a for a in attempts(res) if a["iteration"] == 1 and "first_step_end" in a["times"]]
    events = [load(p) for p in res.out.glob("events.initial*.json") if ".launch" not in p.name]
    marks: dict[str, float] = {}
    for name in ("abort_end", "finalize_end", "initialize"):
        it = 1 if name == "initialize" else 0
        ts = [e["unix"] for ev in events for e in ev["events"]
              if e["name"] == name and e["iteration"] == it and e["unix"] >= fault]
        if ts:
            marks[name] = max(ts)
    for name in PHASES[PHASES.index("enter"):]:
        if all(name in a["times"] for a in rec):
            marks[name] = max(a["times"][name] for a in rec)
    return {k: v - fault for k, v in marks.items()}


def format_mttr(m: dict[str, float]) -> str:
    prev, parts = 0.0, []
    for name in PHASES:
        if name in m:
            parts.append(f"{name} +{m[name] - prev:.2f}s")
            prev = m[name]
    return f"MTTR {m['first_step_end']:.2f}s (fault -> first completed step): " + ", ".join(parts)


def by_process(res: RunResult, *, launch: int = 0) -> dict[int, list[dict[str, Any]]]:
    """Process index -> its attempt records, by generation."""
    out: dict[int, list[dict[str, Any]]] = {}
    for a in attempts(res, launch=launch):
        out.setdefault(a["initial_rank"], []).append(a)
    return {p: sorted(v, key=lambda a: a["iteration"]) for p, v in out.items()}


def first_failure(res: RunResult, generation: int = 0) -> tuple[str, str]:
    """(kind, by) of ``generation``'s failure record, as every worker logged it (all the same: first writer wins)."""
    found = {(k, w) for g, k, w in failures(res) if g == generation}
    assert len(found) == 1, f"generation {generation} failed {found or 'never'}: {failures(res)}"
    return found.pop()


def assert_survivors_kept(res: RunResult, survivors: tuple[int, ...]) -> None:
    """Every survivor kept its process (pid and start time) and its rank through generation 1."""
    procs = by_process(res)
    for p in survivors:
        its = procs[p]
        assert [a["iteration"] for a in its] == [0, 1], its
        assert len({(a["pid"], a["pid_start"]) for a in its}) == 1, f"process {p} changed: {its}"
        assert {a["rank"] for a in its} == {p}, f"process {p} changed rank: {its}"


def assert_spare_took(res: RunResult, *, spare: int, rank: int, staged: bool = False) -> None:
    """The spare (process ``spare``, idle in generation 0) took ``rank`` in generation 1 and pulled that rank's
    state from a peer into a slot prepared in advance (``staged``: prepared while the spare idled, before it knew
    which rank it would take)."""
    procs = by_process(res)
    assert [(a["iteration"], a["rank"]) for a in procs[spare]] == [(1, rank)], procs.get(spare)
    assert [a["iteration"] for a in procs[rank]] == [0], f"process {rank} was not replaced: {procs[rank]}"
    rep = res.report(rank, 1)
    assert (rep["outcome"], rep["iteration"], rep["source"]) == ("restored", 4, "replica"), rep
    assert any("prepared in advance" in n for n in rep["notes"]), \
        f"the spare prepares rank {rank}'s receive slot from the layout rank {rank} published: {rep}"
    if staged:
        assert any("while this hot spare idled" in n for n in rep["notes"]), rep
    assert f"hot spare (process {spare}) takes rank {rank}'s place in generation 1" in res.log


def check_inprocess(base: RunResult, res: RunResult, *, kind: str) -> dict[str, float]:
    """What every single-failure in-process recovery shows (``kind``: the injected fault)."""
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    fault = load(res.out / "fault.json")
    assert fault["rank"] == 1 and fault["kind"] == kind
    assert_same_training(base, res, nranks=ACTIVE)
    assert_survivors_kept(res, (0, 2, 3))
    if kind == "raise":
        # an exception: every process stays, rank 1 included; the spare stays idle
        procs = by_process(res)
        assert ACTIVE not in procs
        assert_survivors_kept(res, (1,))
        assert res.report(1, 1)["outcome"] == "restored"
    else:
        # a stopped or stuck rank is replaced seconds after step 5: the spare has staged its slot by then
        assert_spare_took(res, spare=ACTIVE, rank=1, staged=kind in ("stop", "block"))
    for r in range(ACTIVE):
        assert res.report(r, 1)["iteration"] == 4
    assert "in-process recovery gives up" not in res.log
    # rank 0's recovery timeline: in process, nobody restarted, the spare used for a lost rank only
    tl = timeline(res, "0.1")
    assert tl["mode"] == "in-process" and tl["restarted_ranks"] == [], tl
    spare_used = kind != "raise"
    assert tl["spare_used"] is spare_used and tl["spare_ranks"] == ([1] if spare_used else []), tl
    assert list(tl["phases_s"]) == ["detect", "abort", "reform", "reconcile", "transfer", "restore", "first_step"]
    assert (res.out / "reports" / "recovery_timeline.attempt0.1.png").exists(), "PNG drawn before close() returned"
    # detect starts at the fault as its earliest witness saw it, never before the fault itself
    witness = {"kill": ("exit of process 1 seen by its launcher",),
               "stop": ("last heartbeat of process 1", "stop of process 1 seen by its launcher"),
               "raise": ("exception on process 1",)}.get(kind, ("",))
    assert tl["detect_from"].startswith(tuple(f"the fault: {w}" for w in witness)), tl["detect_from"]
    # a silent peer's last heartbeat precedes its stop by up to one heartbeat period (0.2 s here, slower under load)
    slack = 1.0 if kind == "stop" else 0.05
    assert tl["events_unix"]["fault"] >= fault["unix"] - slack, (tl["events_unix"], fault)
    # the launchers all finished the job (none was stopped, none restarted the job)
    assert set(launcher_exits(res).values()) == {0}, launcher_exits(res)
    m = mttr(res)
    print(f"\n[in-process {kind}] {format_mttr(m)}; generation 0 failed {first_failure(res)}")
    return m


@pytest.mark.quick
def test_inprocess_kill_with_hot_spare_is_bit_exact(inprocess_baseline: RunResult, tmp_path: Path) -> None:
    """SIGKILL of rank 1 in step 5: its launcher sees the exit and declares it dead (``exited by launcher:node1``);
    a survivor blocked in a collective with rank 1 may see the closed connection a few milliseconds earlier and
    record the generation's failure first (``exception``, gloo's "Connection closed by peer"): both are the dead
    rank's push, and either way the launcher declares process 1 dead and the spare takes its place."""
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="kill", KILL_RANK=1, KILL_STEP=5)
    check_inprocess(inprocess_baseline, res, kind="kill")
    kind, by = first_failure(res)
    assert (kind, by) == ("exited", "launcher:node1") or (
        kind == "exception" and by in {f"process {p}" for p in (0, 2, 3)} and "Connection closed by peer" in res.log
    ), (kind, by)
    # (the pid its launcher names is its child's: a warm worker's client, tests/warm)
    assert re.search(r"process 1 \(pid \d+\) killed by signal 9 \(SIGKILL\): declared dead", res.log)


def test_inprocess_exception_recovers_in_place(inprocess_baseline: RunResult, tmp_path: Path) -> None:
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="raise", KILL_RANK=1, KILL_STEP=5)
    check_inprocess(inprocess_baseline, res, kind="raise")
    assert first_failure(res) == ("exception", "process 1")
    assert "injected fault on rank 1 at step 5" in res.log


def test_inprocess_stopped_rank_is_found_silent_by_our_detector_and_replaced(inprocess_baseline: RunResult,
                                                                            tmp_path: Path) -> None:
    """SIGSTOP of rank 1, found within ``detector.timeout_s`` + ``interval_s`` by whichever comes first: its launcher,
    which has seen it stopped in the kernel (state T) for ``timeout_s``, SIGKILLs it and declares it dead (``exited``:
    a fact), or its ring successor's monitor, which finds its heartbeat silent for ``timeout_s`` and its launcher not
    vouching for it, declares it dead (``silent``) and its launcher SIGKILLs it. The spare takes its place."""
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="stop", KILL_RANK=1, KILL_STEP=5)
    check_inprocess(inprocess_baseline, res, kind="stop")
    found = first_failure(res)
    assert found in {("silent", "process 2"), ("exited", "launcher:node1")}, found
    kernel_kill = re.search(r"process 1 \(pid \d+\) has been stopped \(state T\) for [0-9.]+ s in the kernel "
                            r"\(detector.timeout_s 2\): SIGKILL, declared dead", res.log)
    if found[0] == "silent":
        assert "process 1 sent no heartbeat for" in res.log
        # killed by its launcher, for the declaration or (both at timeout_s, a few ms apart) for its state T
        assert re.search(r"process 1 \(pid \d+\) is listed dead \(silent", res.log) or kernel_kill, \
            "its launcher did not kill it"
    else:
        assert kernel_kill, res.log[-6000:]


def test_inprocess_training_thread_blocked_in_a_c_call_is_replaced_by_the_spare(inprocess_baseline: RunResult,
                                                                                tmp_path: Path) -> None:
    """Rank 1's training thread blocked in a C call (the GIL released) inside step 5's optimizer step, its heartbeat
    beating on: no progress within ``detector.hang_timeout_s``. The detector blames the lagging tag (``hung``) or,
    when every tag is equal (the others wait in the step's collective), aborts every rank (``hang_all``); rank 1's
    training thread does not leave the C call, so the process declares itself dead and its launcher kills it. Either
    way the spare takes rank 1's place."""
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="block", KILL_RANK=1, KILL_STEP=5)
    check_inprocess(inprocess_baseline, res, kind="block")
    kind, _by = first_failure(res)
    assert kind in ("hung", "hang_all"), kind
    if kind == "hung":
        assert "lagging: process 1 (rank 1)" in res.log
    else:
        assert "process 1 (rank 1): the training thread is still inside the training function" in res.log
    assert re.search(r"process 1 \(pid \d+\) is listed dead \((hung|silent)", res.log), "its launcher did not kill it"


# --- the fallbacks: in-process recovery gives up, our launchers restart the job ---------------------------------------


def check_fallback(base: RunResult, res: RunResult, *, why: str, lost: tuple[int, ...], spares: int = SPARES,
                   iteration: int = 4) -> None:
    """In-process recovery gave up, announced with why; every process of the launch but the ``lost`` ones (killed)
    exited 75; our launchers restarted every process with ``TORCHELASTIC_RESTART_COUNT=1`` and recover() resumed
    ``iteration`` from the host stores, bit for bit; the timeline of the restart says so."""
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert "in-process recovery gives up" in res.log and why in res.log, res.log[-8000:]
    codes = {ev["process"]: ev["code"] for ev in (load(p) for p in res.out.glob("events.initial*.json"))
             if ev["launch"] == 0}
    assert codes == {p: 75 for p in range(ACTIVE + spares) if p not in lost}, \
        f"every process still running left with status 75: {codes}"
    assert "restart 1 of 1: waiting for the" in res.log, "the launchers did not restart the job"
    assert set(launcher_exits(res).values()) == {0}, launcher_exits(res)
    assert_same_training(base, res, nranks=ACTIVE)
    restarted = attempts(res, launch=1)
    assert sorted(a["rank"] for a in restarted) == list(range(ACTIVE)), restarted
    for r in range(ACTIVE):
        rep = load(res.out / f"report.rank{r}.attempt0.launch1.json")
        assert rep["outcome"] == "restored" and rep["iteration"] == iteration, rep
    tl = timeline(res, "1")
    assert tl["mode"] == "restart" and tl["restarted_ranks"] == list(range(ACTIVE)) and tl["spare_used"] is False


def test_inprocess_two_ranks_lost_with_one_spare_fall_back_to_launcher_restart(inprocess_baseline: RunResult,
                                                                               tmp_path: Path) -> None:
    """Two failures in one window (ranks 1 and 2 SIGKILLed in step 5) and one spare: in-process recovery gives up,
    announced (exit 75), and the launchers' restart recovers bit for bit. (A launch with no spare at all gives up by
    the same rule, fewer spares than lost ranks: tests/unit/test_inprocess_assignment.py.)"""
    res = launch_inprocess(tmp_path, max_restarts=1, STEPS=10, FAULT="kill", KILL_RANK="1,2", KILL_STEP=5)
    check_fallback(inprocess_baseline, res, why="no hot spare left", lost=(1, 2))
    assert sorted(load(p)["rank"] for p in res.out.glob("fault.rank*.json")) == [1, 2]


def test_inprocess_failure_during_recovery_falls_back_to_launcher_restart(inprocess_baseline: RunResult,
                                                                         tmp_path: Path) -> None:
    """A failure inside the in-process recovery: rank 1 SIGKILLed in step 5, the first of two spares takes its place,
    and rank 2 is SIGKILLed while it loads the restored state (failpoint ``recovery.load``), before the generation
    completes a step. A spare is still left, but a recovery that failed is not tried again in process: announced,
    every process exits 75, and the launchers' restart recovers bit for bit. It restores iteration 3, not 4: the
    restore journal says iteration 4 was loaded by an attempt that died before completing a step after it, and such
    a state is never chosen again (it might be what kills the job)."""
    res = launch_inprocess(tmp_path, spares=2, max_restarts=1, STEPS=10, FAULT="kill", KILL_RANK=1, KILL_STEP=5,
                           RECOVERY_KILL_RANK=2)
    check_fallback(inprocess_baseline, res, why="failed before completing a step", lost=(1, 2), spares=2,
                   iteration=3)
    assert "failpoint recovery.load reached" in res.log
    assert "iteration(s) [4] were restored by the previous attempt" in res.log


# --- the recipe, the user's connections, the hygiene check -------------------------------------------------------------


def test_recipe_plain_loop_inprocess_mode_recovers_a_kill_with_the_spare(inprocess_baseline: RunResult,
                                                                        tmp_path: Path) -> None:
    """recipes/mcore_gpt_plain_loop.py with ``neighbor_ckpt.inprocess`` on in its YAML (the same GPT, data and steps
    as the test worker, through build_gpt; the CPU job files' detector timers): a SIGKILL of rank 1 in step 5's
    optimizer step recovers in process with the spare, bit for bit the worker's failure-free run."""
    cfg = tmp_path / "inprocess.yaml"
    cfg.write_text(f"neighbor_ckpt:\n  inprocess:\n    enabled: true\n    spares: {SPARES}\n"
                   "  detector:\n    interval_s: 0.2\n    timeout_s: 2.0\n    hang_timeout_s: 3.0\n"
                   f"  report:\n    dir: {tmp_path / 'out' / 'reports'}\n")
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "mcore_gpt_plain_loop.py"
    program = " ".join(shlex.quote(a) for a in (str(recipe), "--steps", "10", "--config", str(cfg), "--out",
                                                 str(tmp_path / "out"), "--kill", "1:5"))
    res = launch_inprocess(tmp_path, program=program)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    assert load(res.out / "fault.json")["rank"] == 1
    assert first_failure(res)[0] in ("exited", "exception"), failures(res)
    rep = load(res.out / "report.rank1.attempt0.1.json")
    assert rep["outcome"] == "restored" and rep["iteration"] == 4 and rep["source"] == "replica", rep
    tl = timeline(res, "0.1")
    assert (tl["mode"], tl["restarted_ranks"], tl["spare_ranks"]) == ("in-process", [], [1]), tl
    print(f"\n[recipe in-process kill] {tl['mttr_s']:.2f} s: {tl['phases_s']}")


class _Echo(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        for line in self.rfile:
            self.wfile.write(line)
            self.wfile.flush()


@pytest.fixture
def echo_server() -> Iterator[int]:
    """A threaded TCP echo server on localhost (one connection per worker, kept open); yields its port."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="echo", daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_connection_opened_before_the_failure_still_works_after_the_recovery(
        inprocess_baseline: RunResult, echo_server: int, tmp_path: Path) -> None:
    """Every process opens a TCP connection to the test's echo server before its first generation; rank 1 is
    SIGKILLed in step 5. The scoped abort shuts down only the sockets of the generation's process groups: every
    survivor's line sent through its old connection in generation 1 comes back intact."""
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="kill", KILL_RANK=1, KILL_STEP=5, ECHO_PORT=echo_server)
    check_inprocess(inprocess_baseline, res, kind="kill")
    for p in (0, 2, 3):
        before, after = (load(res.out / f"echo.initial{p}.iter{k}.json") for k in (0, 1))
        assert before["got"] == before["sent"], before
        assert after == {"sent": f"process {p} generation 1\n", "got": f"process {p} generation 1\n"}, after
    spare = load(res.out / f"echo.initial{ACTIVE}.iter1.json")
    assert spare["got"] == spare["sent"], spare


def test_a_process_that_leaks_a_thread_is_replaced_by_a_new_spare(inprocess_baseline: RunResult,
                                                                  tmp_path: Path) -> None:
    """Rank 3 leaks a thread in generation 0 and rank 1 is SIGKILLed in step 5, two spares. After the failed
    generation the hygiene check finds the extra thread on process 3, which exits 77; its launcher starts a
    replacement (a new process index, 6, ``NEIGHBOR_CKPT_INPROCESS_REPLACES=3``, on node3) that joins as a spare;
    the two original spares take ranks 1 and 3 and pull their states from the ring successors (ranks 2 and 0). Bit
    for bit, and the log says why.

    Not rank 2: rank 2 holds rank 1's replica, and with both gone from the next generation (the replacement on
    node2, which has node2's host store, starts after the next generation formed and stays a spare) no copy of
    rank 1's state is reachable: a double loss, which the fallback handles, not this test."""
    res = launch_inprocess(tmp_path, spares=2, STEPS=10, FAULT="kill", KILL_RANK=1, KILL_STEP=5, LEAK_THREAD_RANK=3)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    assert "fault injection: rank 3 leaks a thread" in res.log
    assert "process 3 (rank 3): not clean after generation 0" in res.log and "leaked-by-the-test" in res.log, \
        res.log[-8000:]
    assert re.search(r"process 3 \(pid \d+\) exited with status 77 \(hygiene: replaced\): declared dead; "
                     r"replacement process 6 \(pid \d+\) started, joins as a spare", res.log), res.log[-8000:]
    procs = by_process(res)
    assert_survivors_kept(res, (0, 2))
    assert [a["iteration"] for a in procs[1]] == [0] and [a["iteration"] for a in procs[3]] == [0]
    took = {a["rank"]: p for p in (4, 5) for a in procs.get(p, []) if a["iteration"] == 1}
    assert sorted(took) == [1, 3], procs
    assert 6 not in procs, "the replacement stays an idle spare"
    replacement = load(res.out / "events.initial6.json")
    assert (replacement["replaces"], replacement["node"], replacement["code"]) == ("3", "node3", 0), replacement
    for rank in (1, 3):
        rep = res.report(rank, 1)
        assert (rep["outcome"], rep["iteration"], rep["source"]) == ("restored", 4, "replica"), rep
    tl = timeline(res, "0.1")
    assert (tl["mode"], tl["restarted_ranks"], sorted(tl["spare_ranks"])) == ("in-process", [], [1, 3]), tl
    assert set(launcher_exits(res).values()) == {0}, launcher_exits(res)


def test_a_process_whose_clean_up_blocks_declares_itself_dead_and_the_spare_takes_its_rank(
        inprocess_baseline: RunResult, tmp_path: Path) -> None:
    """Rank 1 raises in step 5 and its clean-up then blocks (a C call that never returns). After
    ``inprocess.abort_timeout_s`` the engine logs every thread's stack, declares the process dead, its launcher kills
    it, and the spare takes rank 1 from its ring successor: the next generation does not wait for it until the barrier
    timeout ends the job. Bit for bit."""
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="raise", KILL_RANK=1, KILL_STEP=5, BLOCK_CLEANUP_RANK=1)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    assert "the clean-up of process 1 blocks in a C call" in res.log
    assert "process 1 (rank 1): the clean-up of generation 0 has taken more than" in res.log, res.log[-8000:]
    assert "in block_in_cleanup" in res.log, "the stack report names the blocked function"
    assert "has not returned after" in res.log and "declaring this process dead" in res.log
    assert_survivors_kept(res, (0, 2, 3))
    assert_spare_took(res, spare=ACTIVE, rank=1)
    assert "in-process recovery gives up" not in res.log
    assert set(launcher_exits(res).values()) == {0}, launcher_exits(res)


def test_grow_back_a_replacement_takes_the_second_lost_rank(inprocess_baseline: RunResult, tmp_path: Path) -> None:
    """Launchers with ``--grow-back``, one hot spare. Rank 1 is SIGKILLed in step 3: the spare (process 4) takes it.
    Once generation 1 has completed a step, node1's launcher starts a replacement (process 5), which joins as a
    spare. Rank 2 is SIGKILLed in step 7 of generation 1, with no original spare left: the replacement takes rank 2
    and pulls its state from rank 3. Bit for bit; nobody restarted the job."""
    # The second fault waits, inside step 7, for the replacement to be up (its imports: seconds on a loaded machine);
    # every rank is blocked meanwhile, which the hang detector would take for a hang after HANG_TIMEOUT (default 3 s)
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="kill", KILL_RANK=1, KILL_STEP=3, KILL2_RANK=2, KILL2_STEP=7,
                           HANG_TIMEOUT=60, grow_back=True)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    assert re.search(r"process 1 \(pid \d+\) .*declared dead; replacement process 5 \(pid \d+\) started, joins as a "
                     r"spare", res.log), res.log[-8000:]
    assert (res.out / "fault2.rank2.json").exists(), res.log[-8000:]
    procs = by_process(res)
    assert [(a["iteration"], a["rank"]) for a in procs[ACTIVE]] == [(1, 1), (2, 1)], procs.get(ACTIVE)
    assert [(a["iteration"], a["rank"]) for a in procs[5]] == [(2, 2)], procs.get(5)
    assert [a["iteration"] for a in procs[1]] == [0] and [a["iteration"] for a in procs[2]] == [0, 1]
    for p in (0, 3):
        assert [a["iteration"] for a in procs[p]] == [0, 1, 2] and len({a["pid"] for a in procs[p]}) == 1
    rep = res.report(2, 2)
    assert (rep["outcome"], rep["iteration"], rep["source"]) == ("restored", 6, "replica"), rep
    assert "in-process recovery gives up" not in res.log
    # two recoveries, two timelines, each from its own fault: the launcher's observed exit of the killed process
    for attempt, fault_file, victim in (("0.1", "fault.json", 1), ("0.2", "fault2.rank2.json", 2)):
        tl, fault = timeline(res, attempt), load(res.out / fault_file)
        assert tl["detect_from"].startswith(f"the fault: exit of process {victim} seen by its launcher"), tl
        assert fault["unix"] - 0.05 <= tl["events_unix"]["fault"] <= tl["events_unix"]["first_step_end"], tl
        assert tl["mttr_s"] == pytest.approx(tl["events_unix"]["first_step_end"] - tl["events_unix"]["fault"]), tl
    assert set(launcher_exits(res).values()) == {0}, launcher_exits(res)


# --- the MTTR tool ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.e2e.test_inprocess_recovery --runs 3 [--fault kill|raise|stop|block] [--dir D]``: the MTTR
    of N runs and its phases, one line per run, then the phases per run and their median."""
    import argparse
    import statistics
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fault", choices=("kill", "raise", "stop", "block"), default="kill")
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
        fails = sorted({(k, w) for g, k, w in failures(res) if g == 0})
        print(f"run {i}: {format_mttr(m)}; generation 0 failed {fails}", flush=True)
    print(f"{'phase':>16} " + " ".join(f"{'run' + str(i):>7}" for i in range(len(runs))) + "   median")
    for name in PHASES:
        if not all(name in m for m in runs):
            continue
        prevs = [max([0.0] + [m[p] for p in PHASES[:PHASES.index(name)] if p in m]) for m in runs]
        d = [m[name] - p for m, p in zip(runs, prevs)]
        print(f"{name:>16} " + " ".join(f"{x:7.3f}" for x in d) + f"  {statistics.median(d):7.3f}")
    tot = [m["first_step_end"] for m in runs]
    print(f"{'MTTR':>16} " + " ".join(f"{x:7.3f}" for x in tot) + f"  {statistics.median(tot):7.3f}")


if __name__ == "__main__":
    main()
