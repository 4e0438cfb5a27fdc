"""Tier 2: the per-node launcher (neighbor_ckpt.inprocess.launcher) with toy processes and a real store host.

Two or three launchers (one per simulated node) run a toy program written to the test's directory (no torch, no
engine): it records its environment, then exits with the status the test planned for it, or waits until the test
writes ``stop.<attempt>`` and exits with the status written there. The test plays the engine's part in the store
(``complete``, ``dead``) and checks what the launchers write there and what they do with their processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import psutil
import pytest

from neighbor_ckpt.inprocess import protocol
from tests.conftest import free_port

pytestmark = pytest.mark.multiproc

RUN = "toy"
TOY = r'''
import json, os, sys, time
from pathlib import Path

out = Path(sys.argv[1])
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
keep = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
        "NEIGHBOR_CKPT_NODE_ID", "NEIGHBOR_CKPT_STORE_DIR", "TORCH_CPP_LOG_LEVEL")
env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("NEIGHBOR_CKPT_INPROCESS_")}
tmp = out / f"env.{rank}.{attempt}.json.tmp"
start = open("/proc/self/stat").read().rpartition(")")[2].split()[19]  # pids are reused: (pid, start) is one
tmp.write_text(json.dumps({"env": env, "pid": os.getpid(), "ppid": os.getppid(), "start": start}))
os.replace(tmp, out / f"env.{rank}.{attempt}.json")
plan = json.loads((out / "plan.json").read_text()) if (out / "plan.json").exists() else {}
code = plan.get(f"{rank}.{attempt}")
if code is not None:
    sys.exit(code)
stops = (out / f"stop.{attempt}", out / f"stop.{rank}.{attempt}")
while not any(p.exists() for p in stops):
    time.sleep(0.02)
sys.exit(int(next(p for p in stops if p.exists()).read_text() or 0))
'''


def _wait(what: str, cond: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def _gone(pid: int, start: Optional[str] = None) -> bool:
    """``pid`` has exited (a zombie counts), or is another process now (``start``: its recorded start time)."""
    try:
        if start is not None and Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19] != start:
            return True
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, OSError):
        return True


@dataclass
class Launch:
    """A store host, the launchers of one launch, the toy's directory; a client of the store for the test."""

    tmp: Path
    port: int
    store_host: subprocess.Popen
    launchers: dict[str, subprocess.Popen]
    client: Any

    def store(self, attempt: int = 0) -> Any:
        import torch.distributed as dist

        return dist.PrefixStore(protocol.launch_prefix(RUN, attempt), self.client)

    def get(self, k: str, attempt: int = 0) -> Optional[str]:
        s = self.store(attempt)
        return s.get(k).decode() if s.check([k]) else None

    def ids(self, k: str, attempt: int = 0) -> set[int]:
        """A list of process indices (``exited``), as a set."""
        return {int(x) for x in (self.get(k, attempt) or "").split(",") if x.strip()}

    def nodes(self, k: str, attempt: int = 0) -> set[str]:
        """A list of node ids (``nodes``, ``joined``), as a set."""
        return {x for x in (self.get(k, attempt) or "").split(",") if x.strip()}

    def env(self, rank: int, attempt: int = 0, timeout: float = 60.0) -> dict[str, Any]:
        p = self.tmp / f"env.{rank}.{attempt}.json"
        _wait(f"process {rank} of attempt {attempt} to start", p.exists, timeout)
        return json.loads(p.read_text())

    def stop(self, attempt: int, code: int) -> None:
        (self.tmp / f"stop.{attempt}").write_text(str(code))

    def complete(self, attempt: int = 0) -> None:
        self.store(attempt).set("complete", "0")
        self.stop(attempt, 0)

    def wait(self, node: str, timeout: float = 60.0) -> int:
        try:
            return self.launchers[node].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher {node} still runs after {timeout:.0f} s:\n{self.logs()}") from None

    def logs(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                         for p in sorted(self.tmp.glob("launcher.*.log")))


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Launch]]:
    """``launch({"node0": (first, count), ...}, processes=N, ...)``: a store host and one launcher per node."""
    started: list[Launch] = []

    def start(nodes: dict[str, tuple[int, int]], *, processes: int, spares: int = 1, max_restarts: int = 0,
              plan: Optional[dict[str, int]] = None, extra: tuple[str, ...] = (),
              standby: Optional[int] = None, node_extra: Optional[dict[str, tuple[str, ...]]] = None) -> Launch:
        import torch.distributed as dist

        (tmp_path / "toy.py").write_text(TOY)
        if plan:
            (tmp_path / "plan.json").write_text(json.dumps(plan))
        port, ready = free_port(), tmp_path / "store.ready"
        host = subprocess.Popen([sys.executable, "-m", "neighbor_ckpt.inprocess.store_host", "--host", "127.0.0.1",
                                 "--port", str(port), "--ready", str(ready), "--parent", str(os.getpid())],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait("the store host", ready.exists)
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, use_libuv=True)
        launchers = {}
        stores = f"127.0.0.1:{port}" + ("" if standby is None else f",127.0.0.1:{standby}")
        for node, (first, count) in nodes.items():
            mine = (node_extra or {}).get(node, ())
            cmd = [sys.executable, "-m", "neighbor_ckpt.inprocess.launcher", "--store", stores, *mine,
                   "--run-id", RUN, "--node", node, "--first", str(first), "--count", str(count),
                   "--processes", str(processes), "--spares", str(spares), "--max-restarts", str(max_restarts),
                   "--nodes", str(len(nodes)), "--store-root", str(tmp_path / "shm"), "--grace", "3",
                   "--fallback-grace", "10", "--complete-grace", "10", "--rendezvous-timeout", "60",
                   "--detector-timeout", "2", *extra,  # the CPU job files' detector.timeout_s
                   "--", str(tmp_path / "toy.py"), str(tmp_path)]
            with open(tmp_path / f"launcher.{node}.log", "w") as log:
                launchers[node] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        started.append(Launch(tmp_path, port, host, launchers, client))
        return started[-1]

    yield start
    for run in started:
        for p in run.launchers.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in run.tmp.glob("env.*.json"):  # no toy process may outlive its launcher
            rec = json.loads(f.read_text())
            pid = rec["pid"]
            if not _gone(pid, rec["start"]):
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"toy process {pid} ({f.name}) outlived its launcher")
        run.store_host.terminate()
        run.store_host.wait()


def test_each_process_gets_its_environment_and_every_launcher_exits_0_once_complete(launch) -> None:
    run = launch({"node0": (0, 2), "node1": (2, 1)}, processes=3, spares=1)
    pids = {n: p.pid for n, p in run.launchers.items()}
    for rank, (node, local) in {0: ("node0", 0), 1: ("node0", 1), 2: ("node1", 0)}.items():
        got = run.env(rank)
        env = got["env"]
        assert got["ppid"] == pids[node]
        assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
            "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": "2" if node == "node0" else "1"}
        assert env[protocol.ENV_STORE] == f"127.0.0.1:{run.port}" and env[protocol.ENV_RUN_ID] == RUN
        assert env[protocol.ENV_LAUNCHER] == str(pids[node]) and env[protocol.ENV_SPARES] == "1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["NEIGHBOR_CKPT_NODE_ID"] == node
        assert env["NEIGHBOR_CKPT_STORE_DIR"] == str(run.tmp / "shm" / node)
        assert env["TORCH_CPP_LOG_LEVEL"] == "error" and protocol.ENV_REPLACES not in env
    _wait("both launchers' reports", lambda: run.get("launcher/node0") and run.get("launcher/node1"))
    assert json.loads(run.get("launcher/node0")) == {"pid": pids["node0"], "processes": [0, 1]}
    assert run.get("processes") == "3" and run.nodes("nodes") == {"node0", "node1"}
    run.complete()
    assert [run.wait(n) for n in ("node0", "node1")] == [0, 0], run.logs()
    assert run.ids("exited") == {0, 1, 2} and run.get("dead") is None


def test_a_killed_process_is_declared_dead_and_fails_the_current_generation(launch) -> None:
    run = launch({"node0": (0, 1), "node1": (1, 1), "node2": (2, 1)}, processes=3)
    victim = run.env(1)["pid"]
    run.env(0), run.env(2)
    run.store().set("gen", "2")  # the engine's current generation
    os.kill(victim, signal.SIGKILL)
    dead = _wait("the dead entry", lambda: run.get("dead"))
    assert dead == "1:exited: killed by signal 9 (SIGKILL);"
    failed = json.loads(_wait("gen/2/failed", lambda: run.get("gen/2/failed")))
    assert failed["by"] == "launcher:node1" and failed["kind"] == "exited" and failed["ranks"] == [1]
    assert failed["reason"] == "killed by signal 9 (SIGKILL)" and abs(failed["unix"] - time.time()) < 30
    assert run.launchers["node1"].poll() is None, "a launcher whose process died waits for the job to complete"
    run.complete()
    assert [run.wait(n) for n in ("node0", "node1", "node2")] == [0, 0, 0], run.logs()


def test_a_process_listed_dead_is_sigkilled_by_its_launcher_even_when_stopped(launch) -> None:
    run = launch({"node0": (0, 1), "node1": (1, 1)}, processes=2)
    victim = run.env(1)
    run.env(0)
    os.kill(victim["pid"], signal.SIGSTOP)  # a detector found it silent
    run.store().append("dead", "1:silent: no heartbeat for 2.0 s;")
    _wait("the stopped process to be killed", lambda: _gone(victim["pid"], victim["start"]), timeout=120)
    # its launcher saw it exit: declared already, no failure written; its exit is a fact now (gone for sure: the
    # quorum of the next generation no longer counts it)
    _wait("the exit written as a fact", lambda: "1:exited:" in (run.get("dead") or ""))
    assert run.get("dead") == "1:silent: no heartbeat for 2.0 s;1:exited: killed by signal 9 (SIGKILL);"
    assert run.get("gen/0/failed") is None
    assert "listed dead (silent: no heartbeat for 2.0 s): SIGKILL" in (run.tmp / "launcher.node1.log").read_text()
    run.complete()
    assert [run.wait(n) for n in ("node0", "node1")] == [0, 0], run.logs()


def test_a_process_stopped_for_the_detector_timeout_is_sigkilled_and_declared_by_its_launcher_from_the_kernel(
        launch) -> None:
    """Liveness from the kernel: node1's launcher vouches its process running in its beat, then sees it stopped
    (state T, nobody listed it dead) and says so; after ``--detector-timeout`` (2 s) it SIGKILLs it and declares it
    dead as a fact (``exited``), which fails the current generation."""
    run = launch({"node0": (0, 1), "node1": (1, 1)}, processes=2)
    victim = run.env(1)
    run.env(0)
    _wait("node1's beat vouching process 1", lambda: re.fullmatch(r"\d+ run=1 held=", run.get("lhb/node1") or ""))
    os.kill(victim["pid"], signal.SIGSTOP)
    _wait("node1's beat saying it is stopped", lambda: re.fullmatch(r"\d+ run= held=1:T:[0-9.]+",
                                                                    run.get("lhb/node1") or ""))
    _wait("the stopped process to be killed", lambda: _gone(victim["pid"], victim["start"]), timeout=120)
    dead = _wait("the exit written", lambda: "killed by signal 9" in (run.get("dead") or "") and run.get("dead"))
    assert re.fullmatch(r"1:exited: stopped \(state T\) for [0-9.]+ s in the kernel: SIGKILLed by its launcher;"
                        r"1:exited: killed by signal 9 \(SIGKILL\);", dead), dead
    failed = json.loads(_wait("gen/0/failed", lambda: run.get("gen/0/failed")))
    assert failed["by"] == "launcher:node1" and failed["kind"] == "exited" and failed["ranks"] == [1], failed
    assert re.fullmatch(r"\d+ run=0 held=", run.get("lhb/node0") or ""), "node0's process runs on"
    run.complete()
    assert [run.wait(n) for n in ("node0", "node1")] == [0, 0], run.logs()


def test_sigkill_of_a_launcher_takes_its_processes_with_it_and_sigterm_stops_them(launch) -> None:
    # three nodes: two launchers of three are a majority (with two, the one left would stop, cut off)
    run = launch({"node0": (0, 2), "node1": (2, 1), "node2": (3, 1)}, processes=4)
    lost = [run.env(r) for r in (0, 1)]
    other = run.env(2)
    run.launchers["node0"].kill()  # the node is lost
    assert run.wait("node0") == -signal.SIGKILL
    _wait("node0's processes to die with it", lambda: all(_gone(p["pid"], p["start"]) for p in lost), timeout=120)
    run.launchers["node1"].terminate()
    assert run.wait("node1") == 128 + signal.SIGTERM, run.logs()
    assert _gone(other["pid"], other["start"])
    assert "stopped by SIGTERM" in (run.tmp / "launcher.node1.log").read_text()
    third = run.env(3)
    run.launchers["node2"].terminate()  # alone of three by now: it may have stopped itself, cut off
    assert run.wait("node2") in (128 + signal.SIGTERM, protocol.EXIT_CUT_OFF), run.logs()
    _wait("node2's process to go", lambda: _gone(third["pid"], third["start"]))


def test_a_launcher_left_without_a_majority_of_the_launchers_stops_its_processes_then_itself(launch) -> None:
    """Two nodes: node0's launcher is SIGKILLed (from node1, a lost node and a cut look the same): node1's
    launcher, one of two, says it is cut off from the majority once, SIGKILLs its process and exits 79."""
    run = launch({"node0": (0, 1), "node1": (1, 1)}, processes=2)
    run.env(0)
    other = run.env(1)
    _wait("node0's beat", lambda: run.get("lhb/node0"))
    beat = lambda: int((run.get("lhb/node1") or "0").split(" ", 1)[0])  # noqa: E731 - the counter, then its processes
    seen = _wait("node1's beat", beat)
    _wait("two looks of node1 since", lambda: beat() >= seen + 2)  # it saw node0 beat
    run.launchers["node0"].kill()
    assert run.wait("node0") == -signal.SIGKILL
    assert run.wait("node1", timeout=120) == protocol.EXIT_CUT_OFF, run.logs()
    assert _gone(other["pid"], other["start"])
    assert (run.tmp / "launcher.node1.log").read_text().count("cut off from the majority") == 1, run.logs()


def test_a_process_that_exits_77_is_replaced_by_a_new_process_index(launch) -> None:
    run = launch({"node0": (0, 1), "node1": (1, 2)}, processes=3, plan={"2.0": protocol.EXIT_HYGIENE})
    run.env(0), run.env(1)
    new = run.env(3)  # index N + 0: the first index handed out beyond the launch's
    assert new["env"]["RANK"] == "3" and new["env"][protocol.ENV_REPLACES] == "2"
    assert new["env"]["LOCAL_RANK"] == "1" and new["env"]["WORLD_SIZE"] == "3"
    assert new["ppid"] == run.launchers["node1"].pid
    assert run.get("processes") == "4"
    assert run.get("dead") == "2:exited: exited with status 77 (hygiene: replaced);"
    _wait("the report with the replacement",
          lambda: json.loads(run.get("launcher/node1") or "{}").get("processes") == [1, 3])
    run.complete()
    assert [run.wait(n) for n in ("node0", "node1")] == [0, 0], run.logs()
    assert run.ids("exited") == {0, 1, 2, 3}


def test_when_every_process_exits_75_the_launchers_restart_the_job_once(launch) -> None:
    run = launch({"node0": (0, 1), "node1": (1, 1)}, processes=2, max_restarts=1)
    first = {r: run.env(r)["pid"] for r in (0, 1)}
    run.stop(0, protocol.EXIT_FALLBACK)
    for r in (0, 1):
        again = run.env(r, attempt=1)
        assert again["env"]["TORCHELASTIC_RESTART_COUNT"] == "1" and again["pid"] != first[r]
    assert run.get("giveup").startswith("process ") and run.nodes("joined", attempt=1) == {"node0", "node1"}
    assert run.get("processes", attempt=1) == "2"
    run.complete(attempt=1)
    assert [run.wait(n) for n in ("node0", "node1")] == [0, 0], run.logs()


def test_a_give_up_with_no_restart_left_ends_every_launcher_with_75(launch) -> None:
    run = launch({"node0": (0, 1), "node1": (1, 1)}, processes=2, max_restarts=0)
    run.env(0), run.env(1)
    run.store().compare_set("giveup", "", "no spare left")  # the engine gave up; its processes exit 75
    run.stop(0, protocol.EXIT_FALLBACK)
    assert [run.wait(n) for n in ("node0", "node1")] == [75, 75], run.logs()
    assert "gave up (no spare left) and the launcher-level restarts are used up" in run.logs()


def test_when_no_process_is_left_before_complete_the_launchers_give_up(launch) -> None:
    run = launch({"node0": (0, 1), "node1": (1, 1)}, processes=2, plan={"0.0": 3, "1.0": 4})
    assert [run.wait(n) for n in ("node0", "node1")] == [75, 75], run.logs()
    assert run.get("giveup") == "every process of the launch exited before the job completed"
    assert run.get("dead") in ("0:exited: exited with status 3;1:exited: exited with status 4;",
                               "1:exited: exited with status 4;0:exited: exited with status 3;")


def test_a_launcher_whose_store_is_gone_stops_its_processes_and_says_so(launch) -> None:
    run = launch({"node0": (0, 1)}, processes=2, extra=("--store-grace", "2"))
    toy = run.env(0)
    run.store_host.kill()
    assert run.wait("node0") == 69, run.logs()
    assert _gone(toy["pid"], toy["start"])
    assert "has not answered for 2 s: stopping this node's 1 process(es)" in run.logs()


def test_once_complete_a_process_that_never_joined_is_stopped_and_no_replacement_starts(launch,
                                                                                         tmp_path: Path) -> None:
    """Process 0 is in generation 0; process 1 (a replacement still starting, say) never joined one. Once the job
    completes, node0's launcher writes the completion marker and, ``--detector-timeout`` later, stops process 1
    instead of waiting ``--complete-grace`` for it."""
    marker = tmp_path / f"complete.{RUN}"
    run = launch({"node0": (0, 2)}, processes=2, extra=("--detector-timeout", "1", "--complete-file", str(marker),
                                                         "--complete-grace", "600"))
    assert run.env(0)["env"][protocol.ENV_COMPLETE_FILE] == str(marker)
    late = run.env(1)
    run.store().set("gen/0/members", json.dumps({"members": [0], "progressed": True, "hangs": 0}))
    run.store().set("gen", "0")
    run.store().set("complete", "0")
    (run.tmp / "stop.0.0").write_text("0")  # process 0 returns, as a rank does once the job completed
    assert run.wait("node0") == 0, run.logs()
    assert marker.read_text().strip() == RUN and oct(marker.stat().st_mode & 0o777) == "0o600"
    assert _gone(late["pid"], late["start"])
    log = run.logs()
    assert "process(es) [1] of this node never joined a generation" in log
    assert re.search(r"process 1 \(pid \d+\) has not joined a generation [\d.]+ s after the job completed: "
                     r"stopping it", log), log
    assert "still run after" not in log, "no wait of --complete-grace"


# A store host that cannot listen, and a launcher that reaches no store: test_launch_ports.py (end to end, the spare
# taking the rank from the start, bit for bit).


def test_a_launcher_cut_off_while_the_store_moved_is_not_waited_for_by_the_restart(launch, tmp_path: Path) -> None:
    """Three launchers; node2's is SIGSTOPped (as if cut off: it writes nothing more, anywhere) and store 0's host
    dies: node0 and node1 promote the standby (2 of 3 votes) and write their part there, node2 never does. Every
    process then gives up (75): the restart's rendezvous on the standby goes on without node2, never seen there (lost
    after ``detector.timeout_s`` + the store timeout, not ``--rendezvous-timeout``), a majority of the launchers
    joined, and node2's process is declared dead in attempt 1 (the spare covers its rank)."""
    import torch.distributed as dist

    from neighbor_ckpt.inprocess.generation import parse_dead
    from neighbor_ckpt.inprocess.restart_rendezvous import parse_nodes

    standby, ready = free_port(), tmp_path / "standby.ready"
    host = subprocess.Popen([sys.executable, "-m", "neighbor_ckpt.inprocess.store_host", "--host", "127.0.0.1",
                             "--port", str(standby), "--ready", str(ready), "--parent", str(os.getpid())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait("the standby store host", ready.exists)
        run = launch({"node0": (0, 1), "node1": (1, 1), "node2": (2, 1)}, processes=3, spares=1, max_restarts=1,
                     standby=standby, extra=("--rendezvous-timeout", "600"))
        for r in range(3):
            run.env(r)
        os.kill(run.launchers["node2"].pid, signal.SIGSTOP)
        run.store_host.kill()
        run.store_host.wait()
        client = dist.TCPStore("127.0.0.1", standby, is_master=False, wait_for_workers=False, use_libuv=True)
        moved = dist.PrefixStore(protocol.launch_prefix(RUN, 0), client)
        _wait("node0 and node1 on the standby", lambda: set(parse_nodes(
            moved.get("nodes") if moved.check(["nodes"]) else None)) == {"node0", "node1"}, timeout=120)
        run.stop(0, protocol.EXIT_FALLBACK)
        for r in (0, 1):
            assert run.env(r, attempt=1, timeout=120)["env"]["TORCHELASTIC_RESTART_COUNT"] == "1", run.logs()
        again = dist.PrefixStore(protocol.launch_prefix(RUN, 1), client)
        _wait("process 2 declared dead in attempt 1", lambda: again.check(["dead"]) and 2 in parse_dead(
            again.get("dead")))
        assert set(parse_nodes(again.get("joined"))) == {"node0", "node1"}
        again.set("complete", "0")
        run.stop(1, 0)
        assert [run.wait(n, timeout=120) for n in ("node0", "node1")] == [0, 0], run.logs()
        assert "lost for good" in run.logs() and "joined within" not in run.logs(), run.logs()
    finally:
        host.kill()
        host.wait()
