"""The fault campaign's ``inproc-other-user`` kind (pure parts): what it draws (``inproc-kill``'s case), the launch
whose store addresses the other user probes, how the probe's output is counted and judged, and the one-line refusal
where the second user cannot be made. The real probe as the other user: tests/unit/test_shared_node.py and
tests/e2e/test_shared_node_sockets.py. The second user's making and removal are run on a stand-in user database
(:class:`_Accounts`), not with useradd."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.unit.campaign_runs import same_training_runs
from tools.campaign.cases import KINDS, SPARES, WORLD, Case, Outcome, draw_cases
from tools.campaign.judge import FOREIGN
from tools.campaign.other_user import (OTHER_USER, PROBE, make_user, refusal, remove_user, second_user,
                                       stores_behind_gates, store_addresses, summarize)
from tools.campaign.runner import inprocess_job, write_config

KIND = "inproc-other-user"
GATE_CHALLENGE = (b"NCKPT-STORE-2\n" + bytes(16)).hex()


def test_the_other_user_kind_comes_last_and_leaves_every_earlier_draw_of_a_seed_as_it_was() -> None:
    assert KINDS[-1] == KIND
    earlier = KINDS[:-1]
    for seed in (7, 149, 2027):
        assert draw_cases(len(earlier), seed, steps=6, kinds=earlier) == draw_cases(len(KINDS), seed, steps=6)[
            :len(earlier)]


def test_an_other_user_case_is_the_in_process_kill_of_a_rank_in_its_optimizer_step(tmp_path: Path) -> None:
    drawn = [c for c in draw_cases(3 * len(KINDS), 5, steps=8) if c.kind == KIND]
    assert len(drawn) == 3
    for c in drawn:
        kill = dataclasses.replace(c, kind="inproc-kill")
        assert c.spec.other_user and not kill.spec.other_user
        assert c.inprocess and c.dist_opt and c.tp == 1 and c.phase == "optimizer" and c.signal == "SIGKILL"
        assert 0 <= c.rank < WORLD and 1 <= c.step <= 6 and c.victims == (c.rank,)
        assert (c.spares, c.devices, c.max_restarts) == (SPARES, 1, 1) and not c.simulate_network
        assert c.planned_faults is None and c.recipe_args() == kill.recipe_args() == [
            "--kill", f"{c.rank}:{c.step}", "--kill-phase", "optimizer", "--kill-signal", "SIGKILL"]
        assert c.flavour == (True, 1, False), "the failure-free run of the other in-process cases"
        assert (c.expected, c.acceptable, c.may_fall_back) == ("exact", ("exact",), False)
    # the launch is inproc-kill's: one launcher and store host per simulated node; the other user probes its stores
    c = drawn[0]
    own = write_config(tmp_path / "nckpt.yaml", base=write_config(tmp_path / "base.yaml"),
                       inprocess_spares=c.spares, report_dir=tmp_path / "reports")
    procs = inprocess_job(tmp_path / "case", c.recipe_args(), job_id="campaign-3", store=tmp_path / "store",
                          config=own, steps=8, store_port=4001, max_restarts=c.max_restarts, spares=c.spares)
    assert len(procs.agents) == WORLD + SPARES
    assert store_addresses(procs.stores) == [["127.0.0.1", 4001 + i] for i in range(WORLD + SPARES)]


def test_the_stores_behind_the_gates_and_their_doors_come_from_the_store_hosts_start_lines() -> None:
    log = ("[node0] neighbor_ckpt store host: listening on 127.0.0.1:4001 (pid 7), a gate before the store on "
           "127.0.0.1:40123 (sealed)\nunrelated\n"
           "[node1] neighbor_ckpt store host: listening on 127.0.0.1:4002 (pid 8), a gate before the store on "
           "127.0.0.1:40456 (open to this node's users)\n")
    assert stores_behind_gates(log) == [["127.0.0.1", 40123], ["127.0.0.2", 40123], ["127.0.0.1", 40456],
                                        ["127.0.0.2", 40456]]
    assert PROBE.name == "store_probe.py" and PROBE.exists()


def _line(target: list, attempt: str, *, connected: bool, received: str = "", unix: float = 1.0) -> str:
    return json.dumps({"target": target, "attempt": attempt, "connected": connected, "received": received,
                       "unix": unix})


REFUSED = [json.dumps({"probe": "started", "pid": 99, "uid": 1001}),
           _line(["127.0.0.1", 4001], "read", connected=True, received=GATE_CHALLENGE),
           _line(["127.0.0.1", 40123], "complete", connected=False),
           _line(["127.0.0.2", 40123], "dead 1 (pid 99)", connected=False),
           _line(["127.0.0.1", 4001], "dead 4 (pid 99)", connected=True, unix=2.5),
           "cut sho",
           json.dumps({"probe": "stopped", "sockets": 3})]


def test_every_attempt_is_counted_and_only_a_closed_never_completed_or_challenged_one_is_a_refusal() -> None:
    s = summarize(REFUSED, uid=1001)
    assert (s["attempts"], s["refused"], s["served"]) == (4, 4, [])
    assert s["by"] == {"asked for the token": 1, "never connected": 2, "unanswered": 1}
    assert s["addresses"] == [["127.0.0.1", 4001], ["127.0.0.1", 40123], ["127.0.0.2", 40123]]
    assert (s["started"], s["stopped"], s["uid"], s["other_uid"]) == (True, True, 1001, 1001)
    answered = json.loads(_line(["127.0.0.1", 40123], "complete", connected=True, received="00"))
    assert refusal(answered) is None, "a store's one-byte answer to CHECK"
    more = json.loads(_line(["127.0.0.1", 4001], "read", connected=True, received=GATE_CHALLENGE + "00"))
    assert refusal(more) is None, "more than the gate's challenge"
    s = summarize([*REFUSED, json.dumps(answered)], uid=1001)
    assert (s["attempts"], s["refused"], len(s["served"])) == (5, 4, 1)


def _run(tmp_path: Path, *, lines: list[str] = REFUSED, alive: bool = True, **extra: object) -> tuple[Case, Path, Path]:
    """A finished other-user case whose training equals its failure-free run's, with the probe's summary."""
    case = Case(index=0, kind=KIND, rank=1, step=3, dist_opt=True, phase="optimizer")
    runs = same_training_runs(tmp_path)
    (runs[1] / "fault.json").write_text(json.dumps({"rank": case.rank, "step": case.step, "unix": 1_700_000_000.0}))
    summary = summarize(lines, uid=1001)
    summary.update(alive_at_end=alive, exit=0, gates=[["127.0.0.1", 4001]], stderr="", **extra)
    (runs[1] / "other_user.json").write_text(json.dumps(summary))
    (runs[1] / "reports").mkdir()
    (runs[1] / "reports" / "recovery_timeline.attempt0.1.json").write_text(json.dumps({
        "attempt": "0.1", "mode": "in-process", "restarted_ranks": [], "spare_ranks": [case.rank], "mttr_s": 2.5,
        "phases_s": {"detect": 0.2}, "detect_from": "the fault: exit of process 1 seen by its launcher",
        "events_unix": {"fault": 1_700_000_000.0}}))
    return case, runs[0], runs[1]


def _log(case: Case) -> str:
    spare = WORLD + case.spares - 1
    return (f"x neighbor_ckpt launcher node{case.rank} (pid 5): process {case.rank} (pid 77) killed by signal 9 "
            "(SIGKILL): declared dead\n"
            f"[rank0] x WARNING process 0 (rank 0): generation 0 failed (exception by process 0): lost a peer\n"
            f"[rank{spare}] x INFO neighbor_ckpt: hot spare (process {spare}) takes rank {case.rank}'s place in "
            "generation 1\n")


def _judge(case: Case, base: Path, run: Path, log: str) -> Outcome:
    from tools.campaign.runner import judge_run

    return judge_run(case, out=run, rc=0, log=log, wall=1.0, base=base, work=run.parent, steps=6,
                     config=run / "nckpt.yaml")


def test_an_other_user_case_is_exact_when_every_attempt_was_refused_and_the_kill_recovered_as_inproc_kill(
        tmp_path: Path) -> None:
    case, base, run = _run(tmp_path)
    o = _judge(case, base, run, _log(case))
    assert o.result == "exact", o
    assert o.detail == ("other user: 4 attempts in 1.5 s on 3 store addresses (1 gates, 1 stores behind them, 1 "
                        "doors), 4 refused (asked for the token 1, never connected 2, unanswered 1); its process alive "
                        "at the end"), o.detail
    assert o.mttr_s == 2.5 and o.detection_s is None, "the kill's recovery, timed as inproc-kill's"


SERVED = [*REFUSED, _line(["127.0.0.1", 40123], "read", connected=True, received="0a00")]


@pytest.mark.parametrize("lines, alive, log, why", [
    (SERVED, True, "", "1 of 5 attempts of the other user were answered"),
    (REFUSED, False, "", "did not live to the end"),
    (REFUSED[:1], True, "", "attempts: 0"),
    ([line.replace('"uid": 1001', '"uid": 0') for line in REFUSED], True, "", "did not run as the other user"),
    (REFUSED, True, f"[rank2] x WARNING process 2: declared dead ({'1:' + FOREIGN})\n", "read an entry"),
    (REFUSED, True, "x launcher node3 (pid 6): process 3 (pid 78) exited with status 76; declared dead already "
                    "(fenced)\n", "processes [1, 3] declared dead"),
    (REFUSED, True, "[rank0] x WARNING process 0 (rank 0): generation 1 failed (silent by process 2): ...\n",
     "generations [0, 1] failed"),
])
def test_an_other_user_case_fails_when_anything_got_through_or_the_job_saw_more_than_the_kill(
        tmp_path: Path, lines: list[str], alive: bool, log: str, why: str) -> None:
    case, base, run = _run(tmp_path, lines=lines, alive=alive)
    assert case.rank == 1, "the victim the log lines above assume"
    o = _judge(case, base, run, _log(case) + log)
    assert o.result == "FAILED" and why in o.detail, o
    assert "other user:" in o.detail, "the attempts are in the notes of a failed case too"


def test_a_case_whose_spare_did_not_take_the_rank_or_a_gate_went_unprobed_or_the_probe_left_nothing_fails(
        tmp_path: Path) -> None:
    case, base, run = _run(tmp_path)
    o = _judge(case, base, run, _log(case).replace("(process 4)", "(process 3)"))
    assert o.result == "FAILED" and "takes rank 1's place" in o.detail, o
    from tools.campaign.runner import judge_run

    o = judge_run(case, out=run, rc=1, log=_log(case), wall=1.0, base=base, work=run.parent, steps=6,
                  config=run / "nckpt.yaml")
    assert o.result == "FAILED" and o.detail.startswith("exit 1: ") and "; other user: 4 attempts" in o.detail, o
    summary = json.loads((run / "other_user.json").read_text())
    (run / "other_user.json").write_text(json.dumps(dict(summary, gates=[["127.0.0.1", 4001], ["127.0.0.1", 4002]])))
    o = _judge(case, base, run, _log(case))
    assert o.result == "FAILED" and "not every gate of the launch" in o.detail, o
    (run / "other_user.json").unlink()
    o = _judge(case, base, run, _log(case))
    assert o.result == "FAILED" and "left no summary" in o.detail, o


def test_the_campaign_refuses_the_other_user_kind_in_one_line_where_no_second_user_can_be_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    from tools.campaign import other_user, runner

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match="needs root.*uid 1000.*leave inproc-other-user out of --kinds"):
        other_user.refuse_impossible()
    rc = runner.main(["--faults", "1", "--kinds", KIND, "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "inproc-other-user kind cannot run here" in err, err
    assert "needs root" in err and not (tmp_path / "c" / "baseline-distopt-tp1").exists(), "nothing ran"


class _Accounts:
    """The system's user and group database as ``useradd``/``userdel``/``groupdel`` change it, without running
    them: a command runner for :mod:`tools.campaign.other_user` (``run``) and its look-ups."""

    def __init__(self, *, users: tuple[str, ...] = (), groups: tuple[str, ...] = (), useradd_rc: int = 0,
                 userdel_rc: int = 0, userdel_keeps_group: bool = False) -> None:
        self.users, self.groups = set(users), set(groups)
        self.useradd_rc, self.userdel_rc, self.keeps_group = useradd_rc, userdel_rc, userdel_keeps_group
        self.calls: list[list[str]] = []

    def run(self, cmd: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(cmd))
        name, rc = cmd[-1], 0
        if cmd[0] == "useradd":
            assert "/usr/sbin/nologin" in cmd and "--no-create-home" in cmd, "no login shell, no home"
            rc = self.useradd_rc
            if rc == 0:
                self.users.add(name)
                self.groups.add(name)  # USERGROUPS_ENAB, the default: a group of its name
        elif cmd[0] == "userdel":
            rc = self.userdel_rc
            if rc == 0:
                self.users.discard(name)
                if not self.keeps_group:
                    self.groups.discard(name)
        elif cmd[0] == "groupdel":
            self.groups.discard(name)
        return subprocess.CompletedProcess(cmd, rc, stdout="", stderr="userdel: user is currently used" if rc else "")

    def held(self, *, runs_ok: bool = True) -> Any:
        """:func:`~tools.campaign.other_user.second_user` on these accounts (root and the tools taken as there)."""
        def runs(_run: object) -> None:
            if not runs_ok:
                raise ValueError("runuser -u nckpt_other did not run as that user")

        return second_user(run=self.run, check=lambda: None, runs=runs,
                           make=functools.partial(make_user, user_exists=self.users.__contains__,
                                                  group_exists=self.groups.__contains__),
                           remove=functools.partial(remove_user, group_exists=self.groups.__contains__))

    def commands(self) -> list[str]:
        return [cmd[0] for cmd in self.calls]


def test_the_campaign_removes_the_second_user_it_made_and_only_that_one() -> None:
    acc = _Accounts()
    with acc.held() as made:
        assert made.user and OTHER_USER in acc.users
    assert acc.commands() == ["useradd", "userdel"] and not acc.users and not acc.groups
    there = _Accounts(users=(OTHER_USER,), groups=(OTHER_USER,))
    with there.held() as made:
        assert not made.user
    assert there.commands() == [] and there.users == {OTHER_USER}, "a user that was there is left as it was"
    meanwhile = _Accounts(useradd_rc=9)  # another run (a test run beside the campaign) made it meanwhile
    with meanwhile.held() as made:
        assert not made.user
    assert meanwhile.commands() == ["useradd"], "that run's to remove"


@pytest.mark.parametrize("how", ["exception", "KeyboardInterrupt", "SIGTERM"])
def test_the_second_user_is_removed_however_the_campaign_ends(how: str) -> None:
    acc = _Accounts()
    before = signal.getsignal(signal.SIGTERM)
    expected = {"exception": RuntimeError, "KeyboardInterrupt": KeyboardInterrupt, "SIGTERM": SystemExit}[how]
    with pytest.raises(expected) as ended:
        with acc.held():
            if how == "SIGTERM":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler runs at the next bytecode: never reached
            raise expected()
    assert acc.commands() == ["useradd", "userdel"] and not acc.users
    if how == "SIGTERM":
        assert ended.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before, "the campaign's SIGTERM disposition is restored"


def test_a_second_user_made_but_unable_to_run_is_removed_and_the_kind_refused() -> None:
    acc = _Accounts()
    with pytest.raises(ValueError, match="did not run as that user"):
        with acc.held(runs_ok=False):
            pytest.fail("the block does not run")
    assert acc.commands() == ["useradd", "userdel"] and not acc.users


def test_a_group_userdel_keeps_goes_too_unless_it_was_there_before(capsys: pytest.CaptureFixture[str]) -> None:
    acc = _Accounts(userdel_keeps_group=True)
    with acc.held():
        pass
    assert acc.commands() == ["useradd", "userdel", "groupdel"] and not acc.groups
    theirs = _Accounts(groups=(OTHER_USER,), userdel_keeps_group=True)
    with theirs.held():
        pass
    assert theirs.commands() == ["useradd", "userdel"] and theirs.groups == {OTHER_USER}
    busy = _Accounts(userdel_rc=8)  # a process of the user still runs (someone else's): nothing is killed
    with pytest.raises(RuntimeError, match="the campaign's own error"):
        with busy.held():
            raise RuntimeError("the campaign's own error")
    err = capsys.readouterr().err
    assert busy.users == {OTHER_USER} and err.count("\n") == 1, err
    assert "userdel nckpt_other failed (userdel: user is currently used)" in err and "remove it by hand" in err


def test_the_campaign_holds_the_second_user_from_before_its_failure_free_runs_to_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m tools.campaign`` with an other-user case: the user is made before anything runs and removed when
    the campaign returns, also when its failure-free run fails or it is interrupted."""
    from tools.campaign import other_user, runner

    for ending in ("baseline failed", "interrupted"):
        acc = _Accounts()
        monkeypatch.setattr(other_user, "second_user", lambda: acc.held())
        seen: list[set[str]] = []

        def torchrun(*_a: object, **_kw: object) -> tuple[int, str]:
            seen.append(set(acc.users))
            if ending == "interrupted":
                raise KeyboardInterrupt
            return 1, ""

        monkeypatch.setattr(runner, "_torchrun", torchrun)
        out = tmp_path / ending.replace(" ", "-")
        if ending == "interrupted":
            with pytest.raises(KeyboardInterrupt):
                runner.main(["--faults", "1", "--kinds", KIND, "--out", str(out)])
        else:
            assert runner.main(["--faults", "1", "--kinds", KIND, "--out", str(out)]) == 1
        assert seen == [{OTHER_USER}], "there while the campaign runs"
        assert acc.commands() == ["useradd", "userdel"] and not acc.users, ending
