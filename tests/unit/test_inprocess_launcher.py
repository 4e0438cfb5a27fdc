"""The per-node launcher's pure decisions (neighbor_ckpt.inprocess.launcher), in one process: its plan from argv,
its processes' environment and command, what it does with an exit status, the ``dead`` list.
The loop itself: tests/multiproc/test_inprocess_launcher.py."""

from __future__ import annotations

import sys

import pytest

from neighbor_ckpt.inprocess import protocol
from neighbor_ckpt.inprocess.generation import parse_dead
from neighbor_ckpt.inprocess.launcher_plan import (Action, child_command, child_env, classify_exit, describe_exit,
                                                   exit_status, parse_args)

BASE = ["--store", "10.0.0.1:29650", "--run-id", "job-1", "--node", "node3", "--first", "3", "--count", "2",
        "--processes", "6", "--spares", "1", "--max-restarts", "2"]


def test_the_plan_of_a_command_line_keeps_the_program_and_its_own_options_apart() -> None:
    plan = parse_args([*BASE, "--store-root", "/dev/shm/nc", "--", "train.py", "--first", "9", "--config", "x"])
    assert (plan.store_host, plan.store_port, plan.run_id, plan.node) == ("10.0.0.1", 29650, "job-1", "node3")
    assert (plan.first, plan.count, plan.processes, plan.spares, plan.max_restarts) == (3, 2, 6, 1, 2)
    assert list(plan.indices) == [3, 4] and plan.store_address == "10.0.0.1:29650"
    assert plan.program == ("train.py", "--first", "9", "--config", "x")  # the program's --first is its own
    assert plan.nodes == 3  # default: ceil(processes / count)
    assert parse_args([*BASE, "--nodes", "5", "--", "t.py"]).nodes == 5
    assert parse_args([*BASE, "t.py", "-v"]).program == ("t.py", "-v")  # `--` may be left out
    assert not plan.grow_back and parse_args([*BASE, "--grow-back", "--", "t.py"]).grow_back
    with pytest.raises(AttributeError):
        plan.node = "other"  # type: ignore[misc]  # frozen


@pytest.mark.parametrize("bad", [
    ["--store", "nohostport"],  # not HOST:PORT
    ["--first", "5"],  # 5, 6 are not processes of 6
    ["--spares", "6"],
    ["--count", "0"],
])
def test_a_command_line_that_is_not_a_launch_is_refused_with_a_usage_error(bad: list[str],
                                                                            capsys: pytest.CaptureFixture) -> None:
    args = list(BASE)
    for i in range(0, len(bad), 2):
        args[args.index(bad[i]) + 1] = bad[i + 1]
    with pytest.raises(SystemExit) as e:
        parse_args([*args, "--", "t.py"])
    assert e.value.code == 2 and "error" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(BASE)  # no program


def test_each_process_gets_its_index_the_launch_and_its_node_in_its_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEIGHBOR_CKPT_HARNESS_RUN", "tag-of-this-launch")
    plan = parse_args([*BASE, "--store-root", "/dev/shm/nc", "--", "t.py"])
    env = child_env(plan, index=4, local_rank=1, attempt=2, launcher_pid=777)
    assert env == {"RANK": "4", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   protocol.ENV_STORE: "10.0.0.1:29650", protocol.ENV_RUN_ID: "job-1", protocol.ENV_LAUNCHER: "777",
                   protocol.ENV_SPARES: "1", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job-1",
                   "NEIGHBOR_CKPT_NODE_ID": "node3", "NEIGHBOR_CKPT_STORE_DIR": "/dev/shm/nc/node3",
                   "TORCH_CPP_LOG_LEVEL": "error", "NEIGHBOR_CKPT_HARNESS_RUN": "tag-of-this-launch"}
    replacement = child_env(parse_args([*BASE, "t.py"]), index=6, local_rank=1, attempt=0, launcher_pid=1,
                            replaces=4)
    assert replacement[protocol.ENV_REPLACES] == "4" and replacement["RANK"] == "6"
    assert "NEIGHBOR_CKPT_STORE_DIR" not in replacement  # without --store-root: the launcher's own, inherited


def test_the_program_runs_under_this_interpreter_unless_it_is_a_whole_command() -> None:
    assert child_command(parse_args([*BASE, "--", "t.py", "-x"])) == [sys.executable, "-u", "t.py", "-x"]
    assert child_command(parse_args([*BASE, "--no-python", "--", "nsys", "python", "t.py"])) == [
        "nsys", "python", "t.py"]


def test_what_the_launcher_does_with_each_exit_status() -> None:
    assert classify_exit(0, False) is Action.NOTHING
    assert classify_exit(protocol.EXIT_FALLBACK, False) is Action.FALLBACK
    assert classify_exit(protocol.EXIT_FENCED, False) is Action.DECLARED
    assert classify_exit(-9, True) is Action.DECLARED  # killed by its launcher because it was listed dead
    assert classify_exit(1, True) is Action.DECLARED  # a detector listed it before it died
    for code in (-9, -15, 1, protocol.EXIT_ABORT_HUNG):
        assert classify_exit(code, False) is Action.DECLARE, code
    assert classify_exit(protocol.EXIT_HYGIENE, False) is Action.REPLACE
    assert classify_exit(protocol.EXIT_HYGIENE, True) is Action.DECLARED  # listed already: a detector's decision


def test_exit_statuses_read_as_a_shell_would_say_them() -> None:
    assert describe_exit(-9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(protocol.EXIT_HYGIENE) == "exited with status 77 (hygiene: replaced)"
    assert [exit_status(c) for c in (0, 3, -9, -15)] == [0, 3, 137, 143]


def test_the_dead_list_parses_to_the_first_reason_of_each_process() -> None:
    assert parse_dead(None) == {} and parse_dead(b"") == {}
    raw = b"3:exited: killed by signal 9 (SIGKILL);5:silent: no heartbeat for 2.1 s;3:hung;garbage;x:y;"
    assert parse_dead(raw) == {3: "exited: killed by signal 9 (SIGKILL)", 5: "silent: no heartbeat for 2.1 s"}


def test_a_launcher_whose_token_file_others_can_read_starts_nothing_and_says_why(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    from neighbor_ckpt.inprocess.launcher import EXIT_LAUNCHER_ERROR, main

    token = tmp_path / "store.token"
    token.write_text("ab" * 32)
    token.chmod(0o644)
    with caplog.at_level("ERROR"):
        assert main([*BASE, "--token-file", str(token), "--", "t.py"]) == EXIT_LAUNCHER_ERROR
    assert "readable by others" in caplog.text and "nothing started" in caplog.text
