"""Kills only of processes carrying the job's run tag (issue 53, item 6): the in-process launcher's recorded pid
(:func:`neighbor_ckpt.inprocess.launcher_children.recorded_pid_to_kill`), the check itself
(:mod:`neighbor_ckpt.runtime.procs`), and where a launch gives its processes the tag (the in-process launcher's
children, ``neighbor-ckpt launch``'s torchrun and Slurm script). The restart path's detector:
tests/unit/test_detector.py (one process) and tests/multiproc/test_run_tag_kills.py (another Unix user forging the
record).

Each process here is a ``sleep`` of this user, recorded with its true node and start time (what anyone can copy from
``/proc``); only its environment differs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

RUN_TAG = "NEIGHBOR_CKPT_HARNESS_RUN"
""":data:`neighbor_ckpt.runtime.procs.RUN_TAG_ENV`, spelled out (the first test runs on a checkout without it)."""


def _sleeper(tag: str | None, extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != RUN_TAG}
    env.update(extra or {})
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


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def _record(pid: int, node: str = "node1") -> bytes:
    from neighbor_ckpt.runtime.procs import process_start

    return json.dumps({"pid": pid, "node": node, "start": process_start(pid)}).encode()


@pytest.mark.parametrize("theirs", ["launch-a", None, "launch-b"], ids=["this-launch", "no-tag", "another-launch"])
def test_a_recorded_pid_is_chosen_only_when_it_carries_this_launchs_run_tag(
        theirs: str | None, procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from neighbor_ckpt.inprocess.launcher_children import recorded_pid_to_kill

    monkeypatch.setenv(RUN_TAG, "launch-a")  # the launcher's: its launch drew it
    p = _sleeper(theirs)
    procs.append(p)
    with caplog.at_level("WARNING", logger="neighbor_ckpt.inprocess.launcher_children"):
        chosen = recorded_pid_to_kill(_record(p.pid), node="node1", child=1)
    if theirs == "launch-a":
        assert chosen == p.pid
    else:
        assert chosen is None, "a process of this user that this launch did not start"
        lines = [r.getMessage() for r in caplog.records if f"({p.pid})" in r.getMessage()]
        assert len(lines) == 1 and "run tag" in lines[0], lines


def test_a_launcher_without_a_tag_checks_the_one_it_gave_its_children(
        procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher started without a tag draws one (once) and gives it to every child (:func:`child_env`): a child is
    chosen, a process of the user without it is not; an explicit ``tag`` is what is compared."""
    from neighbor_ckpt.inprocess.launcher_children import recorded_pid_to_kill
    from neighbor_ckpt.inprocess.launcher_plan import child_env, parse_args
    from neighbor_ckpt.runtime import procs as procs_mod

    monkeypatch.delenv(RUN_TAG, raising=False)
    monkeypatch.setattr(procs_mod, "_LAUNCH_TAG", None)
    plan = parse_args(["--store", "127.0.0.1:29650", "--run-id", "job-1", "--node", "node1", "--first", "0",
                       "--count", "2", "--processes", "2", "--spares", "0", "--max-restarts", "0", "--", "t.py"])
    env = child_env(plan, index=0, local_rank=0, attempt=0, launcher_pid=os.getpid())
    tag = env[RUN_TAG]
    assert len(tag) == 32 and child_env(plan, index=1, local_rank=1, attempt=0, launcher_pid=1)[RUN_TAG] == tag
    assert RUN_TAG not in os.environ, "the launcher's own environment is left as it is"
    child, stranger = _sleeper(tag), _sleeper(None, {"NEIGHBOR_CKPT_INPROCESS_RUN": "job-1"})  # the run id is no tag
    procs += [child, stranger]
    assert recorded_pid_to_kill(_record(child.pid), node="node1", child=1) == child.pid
    assert recorded_pid_to_kill(_record(stranger.pid), node="node1", child=1) is None
    assert recorded_pid_to_kill(_record(child.pid), node="node1", child=1, tag="another") is None


def test_the_check_reads_the_process_environment(procs: list[subprocess.Popen[bytes]]) -> None:
    from neighbor_ckpt.runtime.procs import process_environ, tag_refusal

    tagged, untagged, other = _sleeper("launch-a"), _sleeper(None), _sleeper("launch-b")
    procs += [tagged, untagged, other]
    assert process_environ(tagged.pid)[RUN_TAG] == "launch-a"  # type: ignore[index]
    assert tag_refusal(tagged.pid, "launch-a") is None
    assert "carries no run tag" in (tag_refusal(untagged.pid, "launch-a") or "")
    assert "another run tag" in (tag_refusal(other.pid, "launch-a") or "")
    assert "no run tag" in (tag_refusal(tagged.pid, None) or ""), "no tag of its own: nothing is the job's"
    assert "no run tag" in (tag_refusal(tagged.pid, "") or "")
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert process_environ(gone.pid) is None and "cannot be read" in (tag_refusal(gone.pid, "launch-a") or "")


def test_a_signal_goes_only_to_the_tagged_process_that_started_when_recorded(
        procs: list[subprocess.Popen[bytes]]) -> None:
    from neighbor_ckpt.runtime.procs import process_start, signal_job_process

    tagged, untagged = _sleeper("launch-a"), _sleeper(None)
    procs += [tagged, untagged]
    start = process_start(tagged.pid)
    assert "another start time" in (signal_job_process(tagged.pid, signal.SIGKILL, start=(start or 0) - 0.01,
                                                        tag="launch-a") or "")
    assert "another start time" in (signal_job_process(tagged.pid, signal.SIGKILL, start=None, tag="launch-a") or "")
    assert "no run tag" in (signal_job_process(untagged.pid, signal.SIGKILL, start=process_start(untagged.pid),
                                               tag="launch-a") or "")
    assert tagged.poll() is None and untagged.poll() is None
    assert signal_job_process(tagged.pid, signal.SIGKILL, start=start, tag="launch-a") is None
    assert tagged.wait(120) == -signal.SIGKILL
    assert signal_job_process(tagged.pid, signal.SIGKILL, start=start, tag="launch-a") is not None, "reaped: gone"


def test_a_launch_keeps_the_tag_it_was_given_and_draws_one_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from neighbor_ckpt.runtime.procs import launch_run_tag, run_tag, with_run_tag

    assert with_run_tag({RUN_TAG: "outer", "A": "1"}) == {RUN_TAG: "outer", "A": "1"}
    drawn = [with_run_tag({"A": "1"})[RUN_TAG], with_run_tag({RUN_TAG: ""})[RUN_TAG]]
    assert all(len(t) == 32 for t in drawn) and drawn[0] != drawn[1], "fresh per launch"
    monkeypatch.setenv(RUN_TAG, "mine")
    assert run_tag() == "mine" == launch_run_tag()
    monkeypatch.delenv(RUN_TAG)
    assert run_tag() is None and launch_run_tag() == launch_run_tag() and len(launch_run_tag()) == 32


def test_neighbor_ckpt_launch_gives_torchrun_and_the_slurm_script_a_run_tag(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun hands its environment to every worker: ``neighbor-ckpt launch`` starts it with a tag (the one its
    own environment has, else a fresh one); the Slurm script draws one per submission unless one is exported."""
    from neighbor_ckpt.cli import launch

    calls: list[dict[str, str]] = []
    monkeypatch.setattr(launch.subprocess, "call", lambda cmd, **kw: calls.append(kw["env"]) or 0)
    monkeypatch.delenv(RUN_TAG, raising=False)
    plan = launch.plan_launch("gpt_tiny_cpu", run_dir=tmp_path / "run")
    assert not plan.inprocess and plan.job.trainer.num_nodes == 1
    assert launch.run_local(plan) == 0 and launch.run_local(plan) == 0
    assert len(calls[0][RUN_TAG]) == 32 and calls[0][RUN_TAG] != calls[1][RUN_TAG]
    assert RUN_TAG not in os.environ
    monkeypatch.setenv(RUN_TAG, "harness")
    assert launch.run_local(plan) == 0 and calls[2][RUN_TAG] == "harness"
    script = launch.slurm_script(plan)
    line = next(ln for ln in script.splitlines() if ln.startswith(f"export {RUN_TAG}="))
    assert script.index(line) < script.index("torch.distributed.run") and f"${{{RUN_TAG}:-$(" in line
