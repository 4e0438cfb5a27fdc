"""The failure detector: its pure decisions with an injected clock, and its thread against a real c10d TCPStore in
one process (the peers are keys this test writes, the way other ranks' threads would)."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.runtime.detector import (EXIT_FAILURE_DETECTED, PAUSED, Failure, FailureDetector, ProgressClock, Watch,
                                    local_ranks_from_env, os_instance, watched_ranks)
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.runtime.procs import process_start
from tests.conftest import free_port

# -- pure decisions -----------------------------------------------------------------------------------------


def test_watch_declares_a_rank_silent_only_after_its_beat_stops_changing_for_the_timeout() -> None:
    w = Watch((1, 2), timeout_s=3.0, now=0.0)
    for t in range(0, 10):
        w.observe(1, f"{t} 0 4 forward", float(t))  # rank 1 beats every second
        w.observe(2, "7 0 4 forward", float(t))  # rank 2 is stuck on beat 7 since t=0
        silent = dict(w.silent(float(t)))
        assert 1 not in silent
        assert (2 in silent) == (t > 3), (t, silent)
    assert dict(w.silent(9.0))[2] == pytest.approx(9.0)


def test_watch_counts_a_never_seen_rank_from_its_own_start_and_stops_watching_a_finished_one() -> None:
    w = Watch((3,), timeout_s=2.0, now=10.0)
    w.observe(3, None, 11.0)
    assert w.silent(12.0) == []
    assert [r for r, _ in w.silent(12.5)] == [3]
    w.observe(3, "done", 13.0)
    assert w.silent(100.0) == [] and w.done == {3}


def test_progress_clock_is_armed_by_the_first_iteration_and_stopped_while_paused() -> None:
    c = ProgressClock(5.0)
    c.observe((1, None, "startup"), 0.0)
    assert c.stalled(100.0) is None, "model build and recovery are not steps"
    c.observe((2, 0, "done"), 100.0)
    assert c.stalled(104.0) is None and c.stalled(106.0) == pytest.approx(6.0)
    c.observe((3, 0, "forward"), 106.0)
    assert c.stalled(110.0) is None
    c.observe((4, 0, PAUSED), 110.0)
    assert c.stalled(1000.0) is None, "validation does not count"
    assert ProgressClock(None).stalled(1e9) is None


@pytest.mark.parametrize(("rank", "world", "local", "expected"), [
    (0, 4, (0, 1, 2, 3), (1, 2, 3)),
    (0, 8, (0, 1, 2, 3), (1, 2, 3, 7)),  # predecessor 7 is on the other node
    (5, 8, (4, 5, 6, 7), (4, 6, 7)),
    (0, 1, (0,), ()),
])
def test_every_rank_watches_its_ring_predecessor_and_its_node(rank: int, world: int, local: tuple[int, ...],
                                                              expected: tuple[int, ...]) -> None:
    assert watched_ranks(rank, world, local) == expected


def test_every_rank_is_watched_by_someone_on_any_layout() -> None:
    for world in (2, 3, 8, 16):
        for per_node in (1, 2, 4, 8):
            watchers: set[int] = set()
            for rank in range(world):
                first = rank - rank % per_node
                local = tuple(r for r in range(first, first + per_node) if r < world)
                watchers.update(watched_ranks(rank, world, local))
            assert watchers == set(range(world)), (world, per_node)


def test_local_ranks_come_from_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_ranks_from_env(5, 8) == (4, 5, 6, 7)
    monkeypatch.delenv("LOCAL_RANK")
    assert local_ranks_from_env(5, 8) == (5,)


@pytest.mark.parametrize(("section", "message"), [
    ({"timeout_s": 1.0, "interval_s": 1.0}, "must exceed detector.interval_s"),
    ({"interval_s": 0}, "neighbor_ckpt.detector.interval_s"),
    ({"hang_timeout_s": -1}, "neighbor_ckpt.detector.hang_timeout_s"),
    ({"timeout": 3}, "neighbor_ckpt.detector.timeout"),
])
def test_bad_detector_settings_are_one_line_config_errors(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        NeighborCkptConfig.from_dict({"detector": section})


# -- the thread against a real TCPStore --------------------------------------------------------------------------


class _Exit(Exception):
    pass


class Harness:
    """Rank 1 of a 4-rank "job" whose other ranks are keys written by the test."""

    def __init__(self, *, hang_timeout_s: float | None = None) -> None:
        self.server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=5))
        self.client = dist.TCPStore("127.0.0.1", self.server.port, is_master=False, timeout=timedelta(seconds=2))
        self.tag: tuple[int, int | None, str] = (0, None, "startup")
        self.failures: list[Failure] = []
        self.exits: list[int] = []
        self.exited = threading.Event()
        for r in (0, 2, 3):
            self.beat(r, 0)
        self.det = FailureDetector(self.client, prefix="neighbor_ckpt/job/0", rank=1, world_size=4,
                                   local_ranks=(0, 1, 2, 3), node=os_instance(), progress=lambda: self.tag,
                                   on_failure=self.failures.append, interval_s=0.1, timeout_s=0.6,
                                   hang_timeout_s=hang_timeout_s, exit=self._exit)

    def _exit(self, code: int) -> None:
        self.exits.append(code)
        self.exited.set()

    def beat(self, rank: int, n: int) -> None:
        self.server.set(f"neighbor_ckpt/job/0/hb/{rank}", f"{n} 0 3 forward")

    def run_peers(self, beating: tuple[int, ...], seconds: float) -> None:
        end, n = time.monotonic() + seconds, 1
        while time.monotonic() < end and not self.exited.is_set():
            for r in beating:
                self.beat(r, n)
            n += 1
            time.sleep(0.05)

    def beat_until_exit(self, beating: tuple[int, ...], limit_s: float = 120.0) -> None:
        """Beat for ``beating`` until the detector exits (it must, within ``limit_s``: a generous bound)."""
        self.run_peers(beating, limit_s)
        assert self.exited.is_set(), f"the detector did not act within {limit_s:.0f} s"


@pytest.fixture(autouse=True)
def _stop_detectors(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    """Every harness's detector is stopped after its test (it owns the process's SIGTERM wake-up fd)."""
    made: list[Harness] = []
    original = Harness.__init__

    def init(self: Harness, **kw: object) -> None:
        original(self, **kw)
        made.append(self)

    monkeypatch.setattr(Harness, "__init__", init)
    yield
    for h in made:
        h.det.stop(done=False)


def test_detector_acts_once_when_a_watched_rank_goes_silent() -> None:
    h = Harness()
    h.det.start()
    h.run_peers((0, 2, 3), 1.0)
    assert h.exits == [] and h.failures == [], "beating peers are not a failure"
    h.beat_until_exit((0, 3))  # rank 2 stops (SIGSTOP)
    (f,) = h.failures
    assert (f.kind, f.ranks) == ("silent", (2,)) and h.exits == [EXIT_FAILURE_DETECTED]
    rec = json.loads(h.server.get("neighbor_ckpt/job/0/failed/1"))
    assert rec == {"by": 1, "kind": "silent", "ranks": [2], "reason": f.reason}, "announced to every rank"
    info = json.loads(h.server.get("neighbor_ckpt/job/0/info/1"))
    assert info["pid"] == os.getpid()


def test_detector_follows_a_failure_another_rank_announced() -> None:
    h = Harness()
    h.det.start()
    h.server.set("neighbor_ckpt/job/0/failed/1", json.dumps({"by": 3, "kind": "silent", "ranks": [7],
                                                            "reason": "rank(s) [7] sent no heartbeat"}))
    h.server.add("neighbor_ckpt/job/0/failed_n", 1)
    h.beat_until_exit((0, 2, 3))
    (f,) = h.failures
    assert (f.kind, f.ranks) == ("reported", (7,)) and "rank 3: rank(s) [7]" in f.reason


def test_detector_leaves_when_its_own_progress_stops_during_training() -> None:
    h = Harness(hang_timeout_s=0.5)
    h.tag = (5, 3, "backward")
    h.det.start()
    h.beat_until_exit((0, 2, 3))
    (f,) = h.failures
    assert f.kind == "hung" and f.ranks == () and "iteration 3 (backward)" in f.reason


def test_detector_declares_the_store_failed_when_it_stops_answering() -> None:
    h = Harness()
    h.det.start()
    h.run_peers((0, 2, 3), 0.5)
    del h.server  # the store host dies (rank 0 under torchrun restarts, the agent otherwise)
    assert h.exited.wait(120), "the detector did not declare the store failed within 120 s"
    (f,) = h.failures
    assert f.kind == "store" and "did not answer" in f.reason


def test_a_finished_rank_is_not_a_failure_and_stop_publishes_done() -> None:
    h = Harness()
    h.det.start()
    h.server.set("neighbor_ckpt/job/0/hb/2", "done")
    h.run_peers((0, 3), 2.0)
    h.det.stop(done=True)
    assert h.failures == [] and h.exits == []
    assert h.server.get("neighbor_ckpt/job/0/hb/1") == b"done"


def test_sigterm_wakes_the_detector_thread_which_backs_up_and_leaves_the_exit_to_the_launcher() -> None:
    """The launcher's SIGTERM reaches the detector thread through the wake-up fd even when the main thread cannot
    run Python (here it sleeps in C); the thread writes the backup at once and does not exit the process."""
    import signal

    h = Harness()
    seen: list[int] = []
    prev = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        h.det.start()  # on the main thread: owns the wake-up fd
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 120
        while not h.failures:
            assert time.monotonic() < deadline, "the detector thread did not wake up for the SIGTERM within 120 s"
            time.sleep(0.05)
        (f,) = h.failures
        assert f.kind == "sigterm" and h.exits == []
        assert seen == [signal.SIGTERM], "the Python handler still runs"
        h.det.stop(done=False)
        assert signal.set_wakeup_fd(-1) == -1, "stop() gave the wake-up fd back"
    finally:
        signal.signal(signal.SIGTERM, prev)


RUN_TAG = "NEIGHBOR_CKPT_HARNESS_RUN"
"""The run tag's variable (:data:`neighbor_ckpt.runtime.procs.RUN_TAG_ENV`), spelled out: the tests below run on a
checkout without the tag check too, and fail there."""


def _sleeper(tag: str | None) -> "subprocess.Popen[bytes]":
    """A process of this user (``sleep``) whose environment carries run tag ``tag`` (None: none)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != RUN_TAG}
    if tag is not None:
        env[RUN_TAG] = tag
    return _started(subprocess.Popen(["sleep", "120"], env=env))


def _started(p: "subprocess.Popen[bytes]") -> "subprocess.Popen[bytes]":
    """``p`` once its ``exec`` is through (``Popen`` may return before the kernel has set the new environment up, and
    ``/proc/<pid>/environ`` reads empty meanwhile)."""
    import time as _time

    for _ in range(3000):
        with open(f"/proc/{p.pid}/environ", "rb") as f:
            if f.read():
                return p
        _time.sleep(0.01)
    raise AssertionError(f"process {p.pid} did not get through exec")


@pytest.mark.parametrize("same_process", [True, False])
def test_a_failed_rank_of_this_node_is_killed_only_while_its_pid_names_the_process_it_published(
        same_process: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    monkeypatch.setenv(RUN_TAG, "launch-a")
    proc = _sleeper("launch-a")
    try:
        start = process_start(proc.pid)
        h = Harness()
        h.server.set("neighbor_ckpt/job/0/info/2", json.dumps(
            {"pid": proc.pid, "node": os_instance(), "start": start if same_process else start - 0.01}))
        h.det._kill_if_local(2)
        if same_process:
            assert proc.wait(120) == -signal.SIGKILL
        else:
            time.sleep(0.2)
            assert proc.poll() is None, "a reused pid is another process"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("theirs", ["launch-a", None, "launch-b"], ids=["this-launch", "no-tag", "another-launch"])
def test_a_recorded_process_is_killed_only_when_it_carries_this_launchs_run_tag(
        theirs: str | None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The ``info`` record names a process of this node, of this user, with its true start time (all a forger can
    copy from ``/proc``): it is SIGKILLed only when its environment carries the detector's run tag; one without
    (a process of the user that is not part of the job) or with another launch's is left alone, with a line."""
    import signal

    monkeypatch.setenv(RUN_TAG, "launch-a")
    proc = _sleeper(theirs)
    try:
        h = Harness()
        h.server.set("neighbor_ckpt/job/0/info/2", json.dumps(
            {"pid": proc.pid, "node": os_instance(), "start": process_start(proc.pid)}))
        with caplog.at_level("WARNING", logger="neighbor_ckpt.runtime.detector"):
            h.det._kill_if_local(2)
        if theirs == "launch-a":
            assert proc.wait(120) == -signal.SIGKILL
        else:
            assert proc.poll() is None, "the detector returned: a kill would have been sent by now"
            lines = [r.getMessage() for r in caplog.records if f"pid {proc.pid}" in r.getMessage()]
            assert len(lines) == 1 and "not signalled" in lines[0] and "run tag" in lines[0], lines
    finally:
        proc.kill()
        proc.wait()


def test_a_detector_without_a_run_tag_kills_no_recorded_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun started by hand without a tag: the detector cannot tell the job's processes, so it signals none
    (torchrun stops the failed worker with its group), even one that carries some tag."""
    monkeypatch.delenv(RUN_TAG, raising=False)
    procs = [_sleeper(None), _sleeper("launch-a")]
    try:
        h = Harness()
        for rank, proc in zip((2, 3), procs):
            h.server.set(f"neighbor_ckpt/job/0/info/{rank}", json.dumps(
                {"pid": proc.pid, "node": os_instance(), "start": process_start(proc.pid)}))
            h.det._kill_if_local(rank)
        assert [p.poll() for p in procs] == [None, None]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
