"""The fault campaign's pure parts: reproducible case drawing, the recipe arguments of each kind, the comparison
and the table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tools.campaign.cases import KINDS, SPARES, WORLD, Case, Outcome, dp_ring, draw_cases
from tools.campaign.judge import compare, compare_fallback, insurance_iteration
from tools.campaign.report import detection, load_outcomes, recovery_mode, results_document, summarize, summary
from tools.campaign.runner import RECIPE, inprocess_job, resume_point, write_config
from neighbor_ckpt.snapshot.topology import build_topology
from neighbor_ckpt.cli.launch import LAUNCHER
from neighbor_ckpt.runtime.procs import python_module_command

LAUNCHER_HEAD = python_module_command(LAUNCHER)
"""How a launcher's command line starts (this interpreter, ``-P -m`` the launcher): its own arguments follow."""


def test_cases_are_reproducible_from_the_seed_and_cover_every_kind_in_turn() -> None:
    a, b = draw_cases(40, 11, steps=8), draw_cases(40, 11, steps=8)
    assert a == b and a != draw_cases(40, 12, steps=8)
    assert [c.kind for c in a[:len(KINDS)]] == list(KINDS)
    assert all(0 <= c.rank < 4 and 1 <= c.step <= 6 for c in a)
    assert {c.dist_opt for c in a} == {True, False} and {c.tp for c in a} == {1, 2}
    assert {c.phase for c in a} >= {"forward", "backward", "optimizer", "copy", "stream"}


def test_each_kind_becomes_the_recipe_flags_that_inject_it() -> None:
    def args(kind: str, dist_opt: bool = True, **kw) -> list[str]:
        phase = {"kill-forward": "forward", "hang": "optimizer", "kill-mid-copy": "copy",
                 "kill-mid-stream": "stream"}.get(kind, "optimizer")
        return Case(index=0, kind=kind, rank=2, step=4, dist_opt=dist_opt, phase=phase, **kw).recipe_args()

    assert args("kill-forward") == ["--kill", "2:4", "--kill-phase", "forward", "--kill-signal", "SIGKILL",
                                    "--nodes", "2"]
    assert args("hang")[3:6] == ["optimizer", "--kill-signal", "SIGSTOP"]
    assert args("kill-mid-copy")[2:4] == ["--kill-phase", "copy"]
    assert args("kill-mid-stream")[2:4] == ["--kill-phase", "stream"]
    assert "--replace-store" in args("kill-replaced-store")
    assert args("kill-truncate")[-2:] == ["--damage", "truncate"]
    assert args("kill-bad-header")[-2:] == ["--damage", "header"]
    assert args("kill-bitflip", damage_seed=9)[-4:] == ["--damage", "bitflip", "--damage-seed", "9"]
    assert args("kill-bitflip", dist_opt=False)[-1] == "--no-dist-opt"
    assert args("kill-in-recovery", recovery_rank=1)[-2:] == ["--kill-recovery", "1"]
    assert args("lose-dp-group", tp=2)[:2] == ["--kill", "0,2:4"] and ["--tp", "2"] == args("lose-dp-group", tp=2)[8:10]


def test_the_campaign_ring_is_the_ring_the_library_builds() -> None:
    for tp in (1, 2):
        for rank in range(4):
            dp = [r for r in range(4) if r % tp == rank % tp]
            topo = build_topology(rank=rank, world_size=4, dp_ranks=dp, nodes=["node0", "node0", "node1", "node1"])
            assert dp_ring(rank, tp=tp) == topo.ring
            assert topo.cross_node_fraction() == 1.0


def test_victims_of_each_kind() -> None:
    def victims(kind: str, rank: int, tp: int = 1) -> tuple[int, ...]:
        return Case(index=0, kind=kind, rank=rank, step=3, dist_opt=True, tp=tp).victims

    assert victims("kill-forward", 3) == (3,)
    assert victims("lose-node", 1) == (0, 1) and victims("lose-node", 2) == (2, 3)
    assert victims("lose-adjacent-pair", 0) == (0, 2)  # ring 0 -> 2 -> 1 -> 3: the successor is on the other node
    assert victims("lose-adjacent-pair", 3) == (0, 3)
    assert victims("lose-dp-group", 3, tp=2) == (1, 3)
    assert victims("lose-dp-group", 2, tp=1) == (0, 1, 2, 3)


def test_only_store_losses_on_both_ends_of_a_ring_edge_or_replicated_state_torn_in_its_step_need_insurance() -> None:
    def needs(kind: str, phase: str, dist_opt: bool = True) -> bool:
        return Case(index=0, kind=kind, rank=0, step=3, dist_opt=dist_opt, phase=phase).needs_insurance

    assert not needs("lose-node", "optimizer") and not needs("kill-mid-copy", "copy")
    assert needs("lose-adjacent-pair", "forward") and needs("lose-dp-group", "forward")
    assert needs("kill-optimizer", "optimizer", dist_opt=False) and needs("kill-mid-copy", "copy", dist_opt=False)
    assert not needs("kill-mid-stream", "stream", dist_opt=False) and not needs("kill-forward", "forward", False)
    recovery_kill = Case(index=0, kind="kill-in-recovery", rank=0, step=3, dist_opt=False, phase="forward",
                         recovery_rank=1)
    assert recovery_kill.needs_insurance  # the only lazy backup is of the iteration that may not be chosen again
    assert not dataclasses.replace(recovery_kill, dist_opt=True).needs_insurance


def test_a_kill_during_recovery_after_a_kill_before_the_wait_point_may_fall_back_and_gets_insurance() -> None:
    # The victim dies in step 4's forward pass, maybe before its snapshot of step 3 committed: then only iteration 2
    # is complete, the restart restores it, the second kill forbids it, and only the insurance is left (CI, 2026-11-26).
    c = Case(index=0, kind="kill-in-recovery", rank=2, step=4, dist_opt=True, phase="forward", recovery_rank=3)
    assert c.may_fall_back and not c.needs_insurance and c.acceptable == ("exact", "fallback")
    table = summarize([Outcome(c, "fallback")])
    row = [x.strip() for x in table.splitlines()[2].split("|")[2:-1]]
    assert row[3:5] == ["1", "0"], "a fallback the timing allows is not unexpected"
    plain = Case(index=1, kind="kill-forward", rank=2, step=4, dist_opt=True, phase="forward")
    assert not plain.may_fall_back and plain.acceptable == ("exact",)


def test_a_kill_during_recovery_gets_a_second_restart_and_an_older_version_to_go_back_to() -> None:
    cases = [c for c in draw_cases(160, 5, steps=6) if c.kind == "kill-in-recovery"]
    assert cases and all(c.max_restarts == 2 and c.recovery_rank is not None and c.step >= 2 for c in cases)


def _write_run(out: Path, losses: dict[int, list[tuple[int, float, int]]], final: dict) -> Path:
    out.mkdir(parents=True)
    for rank, recs in losses.items():
        (out / f"losses.rank{rank}.jsonl").write_text(
            "".join(json.dumps({"step": s, "loss": v.hex(), "attempt": a}) + "\n" for s, v, a in recs))
        (out / f"final.rank{rank}.json").write_text(json.dumps(final))
    return out


def test_compare_accepts_only_identical_losses_recomputations_included_and_identical_finals(tmp_path: Path) -> None:
    base = _write_run(tmp_path / "base", {0: [(0, 2.5, 0), (1, 2.25, 0)]}, {"params": "x"})
    same = _write_run(tmp_path / "same", {0: [(0, 2.5, 0), (1, 2.25, 0), (1, 2.25, 1)]}, {"params": "x"})
    drift = _write_run(tmp_path / "drift", {0: [(0, 2.5, 0), (1, 2.25, 0), (1, 2.2500000000000004, 1)]},
                       {"params": "x"})
    other = _write_run(tmp_path / "other", {0: [(0, 2.5, 0), (1, 2.25, 0)]}, {"params": "y"})
    assert compare(base, same) == ""
    assert "step 1" in compare(base, drift)
    assert "final" in compare(base, other)


def test_a_fallback_is_compared_with_the_first_attempt_of_the_failure_free_run_then_with_its_resumed_run(
        tmp_path: Path) -> None:
    # failure-free: steps 0-3; resumed from insurance 1 (a fresh process replays 2-3 otherwise: other RNG)
    base = _write_run(tmp_path / "base", {0: [(0, 2.5, 0), (1, 2.25, 0), (2, 2.0, 0), (3, 1.75, 0)]}, {"p": "base"})
    resumed = _write_run(tmp_path / "resumed", {0: [(2, 2.125, 1), (3, 1.875, 1)]}, {"p": "resumed"})
    # the fault killed step 3 of attempt 0 (step 2 completed); the fallback to insurance 1 replayed 2 and 3
    good = _write_run(tmp_path / "good", {0: [(0, 2.5, 0), (1, 2.25, 0), (2, 2.0, 0), (2, 2.125, 1), (3, 1.875, 1)]},
                      {"p": "resumed"})
    assert compare_fallback(base, resumed, good, insurance_step=1) == ""
    assert compare(base, good) != "", "the uninterrupted run is not what a fallback replays"
    replay = _write_run(tmp_path / "replay", {0: [(0, 2.5, 0), (1, 2.25, 0), (2, 2.0, 1), (3, 1.875, 1)]},
                        {"p": "resumed"})
    assert "step 2 attempt 1" in compare_fallback(base, resumed, replay, insurance_step=1)
    first = _write_run(tmp_path / "first", {0: [(0, 2.5, 0), (1, 2.2, 0), (2, 2.125, 1), (3, 1.875, 1)]},
                       {"p": "resumed"})
    assert "step 1 attempt 0" in compare_fallback(base, resumed, first, insurance_step=1)
    early = _write_run(tmp_path / "early", {0: [(0, 2.5, 0), (1, 2.25, 1), (2, 2.125, 1), (3, 1.875, 1)]},
                       {"p": "resumed"})
    assert "before insurance 1" in compare_fallback(base, resumed, early, insurance_step=1)
    final = _write_run(tmp_path / "final", {0: [(0, 2.5, 0), (1, 2.25, 0), (2, 2.125, 1), (3, 1.875, 1)]},
                       {"p": "base"})
    assert "final" in compare_fallback(base, resumed, final, insurance_step=1)
    short = _write_run(tmp_path / "short", {0: [(0, 2.5, 0), (1, 2.25, 0), (2, 2.125, 1)]}, {"p": "resumed"})
    assert "did not finish training" in compare_fallback(base, resumed, short, insurance_step=1)


def test_the_insurance_iteration_is_the_one_every_fallback_report_names(tmp_path: Path) -> None:
    def report(rank: int, attempt: int, **rep: object) -> None:
        (tmp_path / f"report.rank{rank}.attempt{attempt}.json").write_text(json.dumps(rep))

    assert insurance_iteration(tmp_path) is None
    report(0, 0, outcome="fresh", iteration=None)
    report(0, 1, outcome="insurance", iteration=3)
    report(1, 1, outcome="insurance", iteration=3)
    assert insurance_iteration(tmp_path) == 3
    report(2, 1, outcome="insurance", iteration=1)
    assert insurance_iteration(tmp_path) is None


def test_table_counts_outcomes_per_kind_and_reports_detection_times() -> None:
    c = [Case(index=i, kind=k, rank=0, step=3, dist_opt=True) for i, k in enumerate(["hang"] * 2 + ["kill-forward"])]
    table = summarize([Outcome(c[0], "exact", detection_s=3.1, mttr_s=20.0), Outcome(c[1], "exact", detection_s=3.3),
                       Outcome(c[2], "FAILED", "exit 1")])
    rows = {line.split("|")[1].strip(): [x.strip() for x in line.split("|")[2:-1]] for line in table.splitlines()[2:]}
    # cases, exact, resized, fallback, (unexpected), stopped, FAILED, detection, MTTR in process / restart / insurance
    assert rows["hang"] == ["2", "2", "0", "0", "0", "0", "0", "3.20 / 3.30", "-", "20.00 / 20.00", "-"]
    assert rows["kill-forward"][:7] == ["1", "0", "0", "0", "0", "0", "1"]
    assert rows["all"][:7] == ["3", "2", "0", "0", "0", "0", "1"]


def test_a_kill_is_detected_in_its_first_recovery_s_detect_phase_where_the_outcome_has_none_of_its_own() -> None:
    kill = Case(index=0, kind="inproc-kill", rank=1, step=3, dist_opt=True)
    node = Case(index=1, kind="inproc-node-lost", rank=1, step=3, dist_opt=True)
    first, second = {"attempt": "0.1", "mttr_s": 0.5, "detection_s": 0.0}, {"attempt": "0.2", "detection_s": 9.0}
    outcomes = [Outcome(kill, "exact", mttr_s=0.5, recoveries=(first, second)),
                Outcome(kill, "exact", mttr_s=0.4, recoveries=({"attempt": "0.1", "detection_s": 0.2},)),
                Outcome(node, "exact", detection_s=0.55, mttr_s=3.5, recoveries=(dict(first, detection_s=0.1),)),
                Outcome(kill, "stopped")]
    assert [detection(o) for o in outcomes] == [0.0, 0.2, 0.55, None]
    rows = {row["kind"]: row for row in summary(outcomes)}
    assert rows["inproc-kill"]["detection_s"] == {"n": 2, "median": 0.1, "max": 0.2}
    assert rows["inproc-node-lost"]["detection_s"] == {"n": 1, "median": 0.55, "max": 0.55}


def test_each_recovery_is_timed_under_its_mode_in_process_restart_or_insurance_with_median_and_max() -> None:
    inproc = Case(index=0, kind="inproc-kill", rank=1, step=3, dist_opt=True)
    restart = Case(index=1, kind="kill-forward", rank=1, step=3, dist_opt=True, phase="forward")
    outcomes = [Outcome(inproc, "exact", mttr_s=0.5), Outcome(inproc, "exact", mttr_s=0.9),
                Outcome(inproc, "exact", mttr_s=0.6),
                Outcome(inproc, "fallback", "in-process recovery gave up (announced); the restart path recovered "
                                        "exactly", mttr_s=12.0),
                Outcome(restart, "exact", mttr_s=10.0),
                Outcome(restart, "fallback", "announced fallback to insurance 2, bit-exact with the failure-free "
                                         "run resumed from it", mttr_s=14.0),
                Outcome(restart, "FAILED", "exit 1", mttr_s=99.0),
                Outcome(Case(index=2, kind="data-misplaced", rank=1, step=3, dist_opt=True), "stopped")]
    assert [recovery_mode(o) for o in outcomes] == ["in-process"] * 3 + ["restart", "restart", "insurance", None, None]
    rows = {row["kind"]: row for row in summary(outcomes)}
    assert rows["inproc-kill"]["mttr_s"] == {"in-process": {"n": 3, "median": 0.6, "max": 0.9},
                                             "restart": {"n": 1, "median": 12.0, "max": 12.0}, "insurance": None}
    assert rows["kill-forward"]["mttr_s"]["insurance"] == {"n": 1, "median": 14.0, "max": 14.0}
    assert rows["all"]["mttr_s"]["restart"] == {"n": 2, "median": 11.0, "max": 12.0}, "a FAILED case is not timed"
    table = {line.split("|")[1].strip(): [x.strip() for x in line.split("|")[2:-1]]
             for line in summarize(outcomes).splitlines()[2:]}
    assert table["inproc-kill"][-3:] == ["0.60 / 0.90", "12.00 / 12.00", "-"]
    assert table["data-misplaced"][5] == "1" and table["data-misplaced"][-3:] == ["-", "-", "-"]


def test_the_results_document_names_the_commit_the_kinds_not_drawn_and_passes_only_a_complete_campaign_without_failures(
        ) -> None:
    cases = draw_cases(3, 1, steps=6)
    settings = {"seed": 1, "faults": 3, "kinds": list(KINDS), "source": "abc1234"}
    done = [Outcome(c, "exact", mttr_s=1.0) for c in cases]
    doc = json.loads(json.dumps(results_document(settings, done, machine={"nproc": 2})))
    assert doc["campaign"]["source"] == "abc1234" and doc["machine"] == {"nproc": 2}
    assert doc["verdict"] == {"faults": 3, "complete": True, "kinds_drawn": list(KINDS[:3]),
                              "kinds_not_drawn": list(KINDS[3:]), "failed_cases": [], "passed": True}
    assert [Case(**o["case"]) for o in doc["outcomes"]] == cases and doc["summary"][-1]["kind"] == "all"
    assert not results_document(settings, done[:2])["verdict"]["passed"], "an unfinished campaign does not pass"
    failed = results_document(settings, [*done[:2], Outcome(cases[2], "FAILED", "exit 1")])["verdict"]
    assert failed["failed_cases"] == [3] and not failed["passed"]


def test_report_tables_a_recorded_campaign_with_its_own_settings_and_runs_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from tools.campaign import runner

    cases = draw_cases(2, 9, steps=6)
    settings = {"seed": 9, "faults": 2, "steps": 6, "kinds": list(KINDS), "detector_timeout_s": 3.0,
                "detector_interval_s": 0.5, "source": "abc1234"}
    (tmp_path / "campaign.json").write_text(json.dumps(settings))
    (tmp_path / "outcomes.jsonl").write_text("".join(json.dumps(dataclasses.asdict(Outcome(c, "exact"))) + "\n"
                                                     for c in cases))
    monkeypatch.setattr(runner, "run_case", lambda *a, **k: pytest.fail("--report ran a case"))
    monkeypatch.setattr(runner, "_torchrun", lambda *a, **k: pytest.fail("--report ran a failure-free run"))
    results = tmp_path / "results" / "campaign.json"
    assert runner.main(["--report", "--out", str(tmp_path), "--seed", "5", "--results", str(results)]) == 0
    out = capsys.readouterr().out
    assert "seed 9, 2 faults" in out and "source abc1234" in out
    assert json.loads(results.read_text())["verdict"]["passed"]
    assert (tmp_path / "table.md").read_text().startswith("| fault | cases |")
    with pytest.raises(SystemExit):
        runner.main(["--report", "--out", str(tmp_path / "nothing")])
    assert "no campaign recorded" in capsys.readouterr().err


def test_a_fallback_where_an_in_memory_version_should_exist_is_counted_as_unexpected() -> None:
    exact_kind = Case(index=0, kind="kill-forward", rank=0, step=3, dist_opt=True, phase="forward")
    pair = Case(index=1, kind="lose-adjacent-pair", rank=0, step=3, dist_opt=True, phase="forward")
    table = summarize([Outcome(exact_kind, "fallback"), Outcome(pair, "fallback")])
    rows = {line.split("|")[1].strip(): [x.strip() for x in line.split("|")[2:-1]] for line in table.splitlines()[2:]}
    assert rows["kill-forward"][3:5] == ["1", "1"] and rows["lose-adjacent-pair"][3:5] == ["1", "0"]


def test_double_faults_come_after_the_first_insurance_checkpoint_and_with_an_older_version_kept() -> None:
    cases = draw_cases(200, 2026, steps=6)
    double = [c for c in cases if c.needs_insurance or c.spec.store != "kept" or c.recovery_rank is not None]
    assert double and all(c.step >= 2 for c in double)
    assert any(c.step == 1 for c in cases if c not in double)


def _stopped_campaign(work: Path, cases: list[Case], settings: dict, done: int) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / "campaign.json").write_text(json.dumps(settings))
    with open(work / "outcomes.jsonl", "w") as f:
        for c in cases[:done]:
            f.write(json.dumps(dataclasses.asdict(Outcome(c, "exact", wall_s=1.0, mttr_s=2.0))) + "\n")


def test_a_resumed_campaign_keeps_the_recorded_outcomes_of_the_same_campaign(tmp_path: Path) -> None:
    cases = draw_cases(10, 3, steps=6)
    settings = {"seed": 3, "faults": 10, "source": "abc123"}
    _stopped_campaign(tmp_path, cases, settings, done=4)
    kept = resume_point(tmp_path, settings, cases)
    assert [o.case for o in kept] == cases[:4] and kept == load_outcomes(tmp_path / "outcomes.jsonl")
    assert all(o.result == "exact" and o.mttr_s == 2.0 for o in kept)


def test_resume_refuses_another_commit_other_options_or_other_cases(tmp_path: Path) -> None:
    cases = draw_cases(10, 3, steps=6)
    settings = {"seed": 3, "faults": 10, "source": "abc123"}
    _stopped_campaign(tmp_path, cases, settings, done=4)
    with pytest.raises(ValueError, match="source was 'abc123', now 'def456'"):
        resume_point(tmp_path, {**settings, "source": "def456"}, cases)
    with pytest.raises(ValueError, match="seed was 3, now 4"):
        resume_point(tmp_path, {**settings, "seed": 4}, cases)
    with pytest.raises(ValueError, match="is not case 0"):
        resume_point(tmp_path, settings, draw_cases(10, 4, steps=6))
    with pytest.raises(ValueError, match="does not exist"):
        resume_point(tmp_path / "elsewhere", settings, cases)


def test_in_process_kinds_strike_a_distributed_optimizer_rank_in_its_optimizer_step_at_tp_1() -> None:
    cases = [c for c in draw_cases(4 * len(KINDS), 5, steps=8) if c.kind in ("inproc-kill", "inproc-hang")]
    assert {c.kind for c in cases} == {"inproc-kill", "inproc-hang"}
    for c in cases:
        # compared with the restart-path cases' failure-free run of that configuration: no baseline of their own
        assert c.flavour == (True, 1, False) and c.phase == "optimizer" and not c.needs_insurance, c
        assert c.signal == ("SIGSTOP" if c.kind == "inproc-hang" else "SIGKILL")
        assert 0 <= c.rank < 4 and c.max_restarts == 1
    kill = Case(index=0, kind="inproc-kill", rank=2, step=4, dist_opt=True, phase="optimizer")
    # no --nodes: in process every launcher is a simulated node of its own (NEIGHBOR_CKPT_NODE_ID)
    assert kill.recipe_args() == ["--kill", "2:4", "--kill-phase", "optimizer", "--kill-signal", "SIGKILL"]
    assert dataclasses.replace(kill, kind="inproc-hang").recipe_args()[-1] == "SIGSTOP"


FIRST_KINDS = ("kill-forward", "kill-backward", "kill-optimizer", "kill-mid-copy", "kill-mid-stream", "kill-in-recovery",
               "hang", "kill-replaced-store", "kill-bitflip", "kill-truncate", "kill-bad-header", "lose-node",
               "lose-adjacent-pair", "lose-dp-group")
"""The kinds of the first campaigns (restart path), whose draws of a seed every later kind must leave as they were."""


def test_adding_kinds_left_the_earlier_draws_of_a_seed_as_they_were() -> None:
    assert KINDS[:len(FIRST_KINDS)] == FIRST_KINDS
    for seed in (7, 149):
        assert draw_cases(len(FIRST_KINDS), seed, steps=6, kinds=FIRST_KINDS) == draw_cases(len(KINDS), seed, steps=6)[
            :len(FIRST_KINDS)]
    assert KINDS[len(FIRST_KINDS):len(FIRST_KINDS) + 2] == ("inproc-kill", "inproc-hang")


def test_two_faults_in_process_plan_the_second_after_the_first_recovery_completed_a_step_with_a_spare_each(
        tmp_path: Path) -> None:
    from neighbor_ckpt.config import NeighborCkptConfig

    cases = [c for c in draw_cases(8 * len(KINDS), 11, steps=8) if c.kind == "inproc-two-faults"]
    assert len(cases) == 8
    for c in cases:
        assert 1 <= c.step < c.second_step <= 6 and 0 <= c.second_rank < WORLD, c
        assert c.spares == 2 and c.expected == "exact" and c.flavour == (True, 1, False)
        assert c.recipe_args() == []  # no --kill: the config's fault_injection.faults injects them
        own = write_config(tmp_path / f"c{c.index}.yaml", base=write_config(tmp_path / "base.yaml"),
                           inprocess_spares=c.spares, faults=c.planned_faults)
        planned = NeighborCkptConfig.from_yaml(own).fault_injection.planned()
        assert [(f.rank, f.step, f.phase, f.signal, f.permanent) for f in planned] == [
            (c.rank, c.step, "optimizer", "SIGKILL", False), (c.second_rank, c.second_step, "optimizer", "SIGKILL",
                                                              False)]


def test_the_store_node_spare_lost_and_grow_back_kinds_plan_what_the_recipe_and_the_launchers_inject(
        tmp_path: Path) -> None:
    """``inproc-store-node`` / ``inproc-store-stop``: a ``store_node`` fault (SIGKILL / SIGSTOP) on node 0, whose rank
    0 it hits; ``inproc-spare-lost``: no rank fault, the idle spare kills itself after the case's step;
    ``inproc-grow-back``: two faults, one spare, ``inprocess.grow_back`` on. Each is expected exact."""
    from neighbor_ckpt.config import NeighborCkptConfig

    cases = {c.kind: c for c in draw_cases(len(KINDS), 7, steps=8)}
    base = write_config(tmp_path / "base.yaml")
    for kind, sig in (("inproc-store-node", "SIGKILL"), ("inproc-store-stop", "SIGSTOP")):
        c = cases[kind]
        assert (c.rank, c.spares, c.expected, c.recipe_args()) == (0, 1, "exact", []), c
        cfg = NeighborCkptConfig.from_yaml(write_config(tmp_path / f"{kind}.yaml", base=base, inprocess_spares=1,
                                                        faults=c.planned_faults))
        assert [(f.target, f.step, f.signal) for f in cfg.fault_injection.planned()] == [("store_node", c.step, sig)]
    lost = cases["inproc-spare-lost"]
    assert lost.planned_faults is None and lost.recipe_args() == ["--kill-idle-spare-after", str(lost.step)]
    grow = cases["inproc-grow-back"]
    assert (grow.spares, grow.expected, len(grow.planned_faults)) == (1, "exact", 2) and grow.step < grow.second_step
    cfg = NeighborCkptConfig.from_yaml(write_config(tmp_path / "grow.yaml", base=base, inprocess_spares=grow.spares,
                                                    faults=grow.planned_faults, grow_back=True))
    assert cfg.inprocess.grow_back and cfg.inprocess.spares == 1


def test_a_shrink_loses_a_node_for_good_without_a_spare_on_a_fixed_global_batch_without_dropout(
        tmp_path: Path) -> None:
    from neighbor_ckpt.config import NeighborCkptConfig

    c = next(c for c in draw_cases(2 * len(KINDS), 3, steps=8) if c.kind == "inproc-shrink")
    assert c.spares == 0 and c.expected == "resized" and c.flavour == (True, 1, True)
    assert c.recipe_args() == c.flavour_args == ["--dropout", "0", "--global-batch", "16"]  # the baseline's too
    cfg = NeighborCkptConfig.from_yaml(write_config(tmp_path / "c.yaml", inprocess_spares=c.spares,
                                                    faults=c.planned_faults, elastic=True))
    assert cfg.elastic.enabled and cfg.inprocess.spares == 0
    assert [(f.rank, f.step, f.permanent) for f in cfg.fault_injection.planned()] == [(c.rank, c.step, True)]


def test_a_stuck_training_thread_in_process_is_blocked_in_a_c_call_under_the_cpu_files_hang_bounds(
        tmp_path: Path) -> None:
    from neighbor_ckpt.config import NeighborCkptConfig

    c = next(c for c in draw_cases(2 * len(KINDS), 3, steps=8) if c.kind == "inproc-stuck")
    assert c.inprocess and c.spares == SPARES and c.expected == "exact" and c.flavour == (True, 1, False)
    assert c.recipe_args() == ["--kill", f"{c.rank}:{c.step}", "--kill-phase", "optimizer", "--kill-signal", "block"]
    cfg = NeighborCkptConfig.from_yaml(write_config(tmp_path / "c.yaml", base=write_config(tmp_path / "base.yaml"),
                                                    inprocess_spares=c.spares, stuck=True))
    assert (cfg.detector.hang_timeout_s, cfg.detector.timeout_s, cfg.inprocess.abort_timeout_s) == (3.0, 3.0, 10.0)


def test_a_restart_on_misplaced_data_must_end_in_the_data_checks_stop() -> None:
    c = next(c for c in draw_cases(2 * len(KINDS), 3, steps=8) if c.kind == "data-misplaced")
    assert not c.inprocess and c.dist_opt and c.expected == "stopped" and not c.needs_insurance
    assert "--misplace-data-on-restart" in c.recipe_args() and c.recipe_args()[:2] == ["--kill", f"{c.rank}:{c.step}"]


def test_a_shrink_is_judged_on_its_samples_exact_before_the_fault_and_close_after(tmp_path: Path) -> None:
    from tools.campaign.judge import compare_resized

    def run(name: str, recs: dict[int, list[tuple[int, int, float, list[int]]]]) -> Path:
        out = tmp_path / name
        out.mkdir()
        for rank, rows in recs.items():
            (out / f"losses.rank{rank}.jsonl").write_text("".join(json.dumps(
                {"step": st, "loss": v.hex(), "attempt": 0, "generation": g, "samples": sm}) + "\n"
                for st, g, v, sm in rows))
        return out

    base = run("base", {0: [(0, 0, 2.5, [0, 1]), (1, 0, 2.25, [4, 5])], 1: [(0, 0, 2.5, [2, 3]), (1, 0, 2.25, [6, 7])]})
    # rank 0's node lost in step 1's optimizer step; generation 1 trains step 1 again on DP 1, every sample
    rank1 = [(0, 0, 2.5, [2, 3]), (1, 0, 2.25, [6, 7])]
    ok = run("ok", {0: [(0, 0, 2.5, [0, 1]), (1, 0, 2.25, [4, 5]), (1, 1, 2.2500001, [4, 5, 6, 7])], 1: rank1})
    assert compare_resized(base, ok, fault_step=1) == ""
    early = run("early", {0: [(0, 0, 2.5000001, [0, 1]), (1, 1, 2.25, [4, 5, 6, 7])], 1: rank1})
    assert "before the shrink" in compare_resized(base, early, fault_step=1)
    far = run("far", {0: [(0, 0, 2.5, [0, 1]), (1, 1, 2.3, [4, 5, 6, 7])], 1: rank1})
    assert "not within" in compare_resized(base, far, fault_step=1)
    lost = run("lost", {0: [(0, 0, 2.5, [0, 1]), (1, 0, 2.25, [4, 5]), (1, 1, 2.25, [4, 5])], 1: rank1})
    assert "global batch" in compare_resized(base, lost, fault_step=1)


def test_an_in_process_case_runs_the_recipe_in_process_mode_under_one_of_our_launchers_per_node(
        tmp_path: Path) -> None:
    from neighbor_ckpt.config import NeighborCkptConfig
    from neighbor_ckpt.inprocess.launcher_plan import parse_args

    base = write_config(tmp_path / "campaign.yaml", interval_s=0.5, timeout_s=3.0)
    own = write_config(tmp_path / "case" / "nckpt.yaml", base=base, inprocess_spares=SPARES,
                       report_dir=tmp_path / "case" / "reports")
    cfg = NeighborCkptConfig.from_yaml(own)
    assert (cfg.inprocess.enabled, cfg.inprocess.spares) == (True, 1) and cfg.detector.timeout_s == 3.0
    assert Path(cfg.report.dir) == tmp_path / "case" / "reports"
    assert not NeighborCkptConfig.from_yaml(base).inprocess.enabled  # the restart-path cases' config is unchanged

    case = Case(index=3, kind="inproc-kill", rank=1, step=2, dist_opt=True, phase="optimizer")
    procs = inprocess_job(tmp_path / "case", case.recipe_args(), job_id="campaign-3", store=tmp_path / "store",
                          config=own, steps=6, store_port=4001, max_restarts=case.max_restarts)
    stores = ",".join(f"127.0.0.1:{4001 + i}" for i in range(WORLD + SPARES))
    assert procs.stores == stores, "one store per simulated node, hosted by its launcher"
    assert len(procs.agents) == WORLD + SPARES
    for i, (cmd, env) in enumerate(procs.agents):
        assert list(cmd[:len(LAUNCHER_HEAD)]) == LAUNCHER_HEAD
        plan = parse_args(cmd[len(LAUNCHER_HEAD):])
        # one simulated node per process: its own launcher, node id and host store
        assert (plan.store_address, plan.run_id, plan.node, plan.host_store) == (stores, "campaign-3", f"node{i}", i)
        assert (plan.first, plan.count, plan.processes, plan.spares, plan.nodes) == (i, 1, WORLD + SPARES, SPARES,
                                                                                     WORLD + SPARES)
        assert plan.max_restarts == case.max_restarts == 1
        assert plan.store_root == str(tmp_path / "store")
        program = list(plan.program[plan.program.index(str(RECIPE)):])
        assert program[program.index("--config") + 1] == str(own)
        assert "--inprocess-store" not in program, "the recipe reads the store list its launcher gives"
        assert program[-len(case.recipe_args()):] == case.recipe_args()
        assert dict(env)["NEIGHBOR_CKPT_NODE_ID"] == f"node{i}"
        assert dict(env)["NEIGHBOR_CKPT_STORE_DIR"] == str(tmp_path / "store" / f"node{i}")


def test_only_runs_the_named_cases_of_the_same_draw_and_rejects_numbers_outside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--only 2,4`` runs cases 2 and 4 exactly as drawn among all ``--faults`` (same rank, step, damage), needs only
    their failure-free configurations, and a resume keeps to that selection."""
    from tools.campaign import runner

    ran: list[Case] = []
    bases: list[list[str]] = []

    def fake_torchrun(out: Path, flags: list[str], **_: object) -> tuple[int, str]:
        bases.append(flags)
        return 0, ""

    def fake_run_case(case: Case, **_: object) -> Outcome:
        ran.append(case)
        return Outcome(case=case, result="exact", detail="", wall_s=1.0)

    monkeypatch.setattr(runner, "_torchrun", fake_torchrun)
    monkeypatch.setattr(runner, "run_case", fake_run_case)
    drawn = draw_cases(6, 5, steps=6)
    assert runner.main(["--faults", "6", "--seed", "5", "--steps", "6", "--only", "4,2", "--out", str(tmp_path)]) == 0
    assert ran == [drawn[1], drawn[3]]
    assert len(bases) == len({c.flavour for c in ran})
    assert json.loads((tmp_path / "campaign.json").read_text())["only"] == [2, 4]
    for bad in ("0", "7", "two"):
        with pytest.raises(SystemExit):
            runner.main(["--faults", "6", "--seed", "5", "--only", bad, "--out", str(tmp_path / "x")])
    assert "--only" in capsys.readouterr().err


def test_at_step_runs_every_drawn_case_at_that_step_and_records_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--at-step 1`` (issue 53's 20 runs of ``inproc-partition-primary`` at step 1): the draw, each case at step 1."""
    from tools.campaign import runner

    ran: list[Case] = []
    monkeypatch.setattr(runner, "_torchrun", lambda out, flags, **_: (0, ""))
    monkeypatch.setattr(runner, "run_case", lambda case, **_: ran.append(case) or Outcome(
        case=case, result="exact", detail="", wall_s=1.0))
    drawn = draw_cases(4, 5, steps=8, kinds=("inproc-partition-primary",))
    assert runner.main(["--faults", "4", "--seed", "5", "--kinds", "inproc-partition-primary", "--at-step", "1",
                        "--out", str(tmp_path)]) == 0
    assert ran == [dataclasses.replace(c, step=1) for c in drawn]
    assert json.loads((tmp_path / "campaign.json").read_text())["at_step"] == 1
    with pytest.raises(SystemExit):
        runner.main(["--faults", "4", "--seed", "5", "--at-step", "7", "--out", str(tmp_path / "x")])
    assert "--at-step" in capsys.readouterr().err


# -- the judge of an in-process case: restart attempts and every recovery ----------------------------------------


def _inprocess_run(tmp_path: Path, *, kind: str = "inproc-kill") -> tuple[Case, Path, Path]:
    """A finished in-process case whose losses and finals equal its failure-free run's (the judge reads files)."""
    case = next(c for c in draw_cases(40, 2027, steps=6) if c.kind == kind)
    base = _write_run(tmp_path / "base", {0: [(0, 2.5, 0), (1, 2.25, 0)]}, {"params": "x"})
    run = _write_run(tmp_path / "run", {0: [(0, 2.5, 0), (1, 2.25, 0)]}, {"params": "x"})
    (run / "fault.json").write_text(json.dumps({"unix": 1_700_000_000.0}))
    if case.planned_faults is not None:
        (run / "faults.jsonl").write_text("".join(json.dumps({"n": i}) + "\n" for i in range(len(case.planned_faults))))
    return case, base, run


def _timeline(run: Path, attempt: object, name: str, *, t0: float, mttr: float, detect: float) -> None:
    (run / "reports").mkdir(exist_ok=True)
    (run / "reports" / name).write_text(json.dumps({
        "attempt": attempt, "mode": "in-process", "mttr_s": mttr, "phases_s": {"detect": detect, "abort": 0.1},
        "events_unix": {"last_snapshot": t0, "failure_noticed": t0 + detect}}))


def _judge(case: Case, base: Path, run: Path, log: str) -> Outcome:
    from tools.campaign.runner import judge_run

    return judge_run(case, out=run, rc=0, log=log, wall=1.0, base=base, work=run.parent, steps=6,
                     config=run / "nckpt.yaml")


def test_a_give_up_line_without_a_restart_attempt_is_not_counted_as_a_restart(tmp_path: Path) -> None:
    from tools.campaign.judge import restart_attempts
    from tools.campaign.runner import GAVE_UP

    case, base, run = _inprocess_run(tmp_path)
    (run / "report.rank0.attempt0.json").write_text("{}")
    (run / "report.rank0.attempt0.1.json").write_text("{}")  # the in-process recovery: no restart
    _timeline(run, "0.1", "recovery_timeline.attempt0.1.json", t0=100.0, mttr=0.5, detect=0.05)
    log = f"[node1] neighbor_ckpt: {GAVE_UP}: the replacement started after the job completed\n"
    assert restart_attempts(run) == []
    o = _judge(case, base, run, log)
    assert o.result == "exact" and "no restart attempt ran" in o.detail and recovery_mode(o) == "in-process"
    # the same line with a restart attempt that ran (its recovery reports): the restart path recovered
    (run / "report.rank1.attempt1.json").write_text("{}")
    assert restart_attempts(run) == [1]
    o = _judge(case, base, run, log)
    assert o.result == "fallback" and recovery_mode(o) == "restart"
    assert _judge(case, base, run, "").result == "exact", "no give-up line: the restart reports alone change nothing"


def test_every_recovery_of_a_case_has_its_mttr_and_detection_in_order_however_its_timelines_are_named(
        tmp_path: Path) -> None:
    case, base, run = _inprocess_run(tmp_path, kind="inproc-two-faults")
    # two recoveries of one launch; names that sort the other way round than the recoveries happened
    _timeline(run, "0.2", "recovery_timeline.attempt0.2.json", t0=200.0, mttr=0.7, detect=0.06)
    _timeline(run, "0.1", "recovery_timeline.attempt0.1.r1.json", t0=100.0, mttr=0.5, detect=0.05)
    (run / "reports" / "recovery_timeline.attempt0.3.json.tmp").write_text("{")  # being written: not a timeline
    o = _judge(case, base, run, "")
    assert o.result == "exact" and o.mttr_s == 0.5
    assert [(r["attempt"], r["mttr_s"], r["detection_s"]) for r in o.recoveries] == [("0.1", 0.5, 0.05),
                                                                                   ("0.2", 0.7, 0.06)]
    from tools.campaign.report import mttrs

    assert mttrs(o) == [0.5, 0.7]
    row = {r["kind"]: r for r in summary([o])}["inproc-two-faults"]
    assert row["mttr_s"]["in-process"] == {"n": 2, "median": 0.6, "max": 0.7}, "both recoveries are timed"
    # kept through the outcomes file, as a resumed campaign or --report reads it
    (tmp_path / "outcomes.jsonl").write_text(json.dumps(dataclasses.asdict(o)) + "\n")
    (back,) = load_outcomes(tmp_path / "outcomes.jsonl")
    assert back == o and mttrs(back) == [0.5, 0.7]


def test_an_outcome_recorded_before_every_recovery_was_kept_still_loads_and_counts_its_one_mttr(tmp_path: Path) -> None:
    case = draw_cases(1, 3, steps=6)[0]
    old = {k: v for k, v in dataclasses.asdict(Outcome(case, "exact", mttr_s=2.0)).items() if k != "recoveries"}
    (tmp_path / "outcomes.jsonl").write_text(json.dumps(old) + "\n")
    (o,) = load_outcomes(tmp_path / "outcomes.jsonl")
    assert o.recoveries == () and summary([o])[-1]["mttr_s"][recovery_mode(o)] == {"n": 1, "median": 2.0, "max": 2.0}


def test_a_restart_path_case_takes_its_mttrs_from_the_log_and_its_hang_detection_from_the_fault(tmp_path: Path) -> None:
    case = next(c for c in draw_cases(40, 2027, steps=6) if c.kind == "hang")
    base = _write_run(tmp_path / "base", {0: [(0, 2.5, 0), (1, 2.25, 0)]}, {"params": "x"})
    run = _write_run(tmp_path / "run", {0: [(0, 2.5, 0), (1, 2.25, 0)]}, {"params": "x"})
    (run / "fault.json").write_text(json.dumps({"unix": 1_700_000_000.0}))
    log = ("[rank0] neighbor_ckpt: detected a failure (silent) at unix 1700000003.25\n"
           "[rank0] neighbor_ckpt: recovery MTTR 9.50 s = ...\n")
    o = _judge(case, base, run, log)
    assert o.result == "exact" and o.detection_s == pytest.approx(3.25) and o.mttr_s == 9.5
    assert [(r["mttr_s"], r["file"]) for r in o.recoveries] == [(9.5, "log")]
    assert o.recoveries[0]["detection_s"] == pytest.approx(3.25)


# -- a whole node of two ranks lost in process -------------------------------------------------------------------------

NODE_KINDS = ("inproc-node-lost", "inproc-node-lost-elastic", "inproc-node-hung")
LAST_KINDS = (*NODE_KINDS, "node-lost-for-good")


def test_the_node_kinds_come_after_the_earlier_kinds_and_leave_every_earlier_draw_of_a_seed_as_it_was() -> None:
    end = KINDS.index(LAST_KINDS[-1]) + 1  # the partition kinds follow them (test_campaign_partitions.py)
    assert KINDS[end - len(LAST_KINDS):end] == LAST_KINDS
    earlier = KINDS[:end - len(LAST_KINDS)]
    for seed in (7, 149, 2027):
        assert draw_cases(3 * len(earlier), seed, steps=6, kinds=earlier)[:len(earlier)] == draw_cases(
            len(KINDS), seed, steps=6)[:len(earlier)]


def test_the_node_kinds_lose_node_1_whole_on_two_nodes_of_two_ranks_with_a_spare_node_or_elastic(
        tmp_path: Path) -> None:
    from neighbor_ckpt.config import NeighborCkptConfig

    drawn = [c for c in draw_cases(4 * len(KINDS), 5, steps=6) if c.kind in NODE_KINDS]
    assert {c.kind for c in drawn} == set(NODE_KINDS)
    base = write_config(tmp_path / "base.yaml")
    for c in drawn:
        shrink = c.kind == "inproc-node-lost-elastic"
        # node 1 is ranks 2 and 3; the spares fill a spare node of 2; under elastic one spare on a third node (two
        # nodes alone are no majority once one is lost)
        assert (c.rank, c.victims, c.devices, c.spares) == (2, (2, 3), 2, 1 if shrink else 2), c
        assert c.inprocess and c.phase == "optimizer" and 1 <= c.step <= 4 and not c.may_fall_back
        assert c.expected == ("resized" if shrink else "exact") and c.flavour == (True, 1, shrink)
        assert c.recipe_args() == c.flavour_args  # the config's fault_injection injects it, not --kill
        cfg = NeighborCkptConfig.from_yaml(write_config(tmp_path / f"{c.index}.yaml", base=base,
                                                        inprocess_spares=c.spares, faults=c.planned_faults,
                                                        elastic=shrink))
        signal = "SIGSTOP" if c.kind == "inproc-node-hung" else "SIGKILL"
        assert [(f.target, f.node, f.step, f.phase, f.signal) for f in cfg.fault_injection.planned()] == [
            ("node", 1, c.step, "optimizer", signal)]
        assert cfg.elastic.enabled == shrink and cfg.inprocess.spares == c.spares


def test_a_node_case_runs_one_launcher_per_node_of_two_processes_and_a_spare_node_of_its_own(tmp_path: Path) -> None:
    from neighbor_ckpt.inprocess.launcher_plan import parse_args

    case = next(c for c in draw_cases(len(KINDS), 7, steps=6) if c.kind == "inproc-node-lost")
    own = write_config(tmp_path / "nckpt.yaml", base=write_config(tmp_path / "base.yaml"),
                       inprocess_spares=case.spares, faults=case.planned_faults)
    procs = inprocess_job(tmp_path / "case", case.recipe_args(), job_id="campaign-7", store=tmp_path / "store",
                          config=own, steps=6, store_port=4001, max_restarts=case.max_restarts, spares=case.spares,
                          devices=case.devices)
    assert procs.stores == "127.0.0.1:4001,127.0.0.1:4002,127.0.0.1:4003", "a store host per node"
    plans = [parse_args(cmd[len(LAUNCHER_HEAD):]) for cmd, _ in procs.agents]
    assert [(p.node, p.first, p.count, p.host_store) for p in plans] == [("node0", 0, 2, 0), ("node1", 2, 2, 1),
                                                                         ("node2", 4, 2, 2)]
    assert {(p.processes, p.spares, p.nodes) for p in plans} == {(WORLD + 2, 2, 3)}
    assert [dict(env)["NEIGHBOR_CKPT_STORE_DIR"] for _, env in procs.agents] == [
        str(tmp_path / "store" / f"node{i}") for i in range(3)]


NODE_LOST_LOG = (
    "[node2] process 4: node node1 is lost: process 3 sent no heartbeat for 3.2 s (detector.timeout_s 3) and its "
    "launcher none for 3.1 s: declaring its process(es) [2, 3] dead together\n"
    "[node0] process 0: generation 0 failed (silent by process 4): node node1 is lost: ...\n"
    "[node2] process 4: generation 0 failed (silent by process 4): node node1 is lost: ...\n")


def _node_run(tmp_path: Path, kind: str, **timeline: object) -> tuple[Case, Path, Path]:
    """A finished node case whose training equals its failure-free run, both of node 1's processes having written the
    node's fault (the second line cut short by the node's death), and rank 0's one recovery timeline."""
    case, base, run = _inprocess_run(tmp_path, kind=kind)
    fault = {"rank": 2, "step": case.step, "phase": "optimizer", "signal": "SIGKILL", "target": "node", "node": 1}
    (run / "faults.jsonl").write_text(json.dumps(fault) + "\n" + json.dumps({**fault, "rank": 3})[:20] + "\n")
    (run / "reports").mkdir()
    (run / "reports" / "recovery_timeline.attempt0.1.json").write_text(json.dumps({
        "attempt": "0.1", "mode": "in-process", "restarted_ranks": [], "spare_ranks": [2, 3],
        "data_parallel_before": None, "data_parallel_after": None, "mttr_s": 3.9,
        "phases_s": {"detect": 3.4, "abort": 0.1}, "detect_from": "the fault: last heartbeat of process 3 seen by "
                                                                  "process 4",
        "events_unix": {"fault": 100.0}, **timeline}))
    return case, base, run


def test_a_lost_node_found_in_one_decision_and_taken_by_the_spare_node_is_exact_with_its_detection(
        tmp_path: Path) -> None:
    case, base, run = _node_run(tmp_path, "inproc-node-lost")
    o = _judge(case, base, run, NODE_LOST_LOG)
    assert (o.result, o.detail) == ("exact", ""), o
    assert o.detection_s == 3.4 and o.mttr_s == 3.9 and recovery_mode(o) == "in-process"
    assert summary([o])[0]["detection_s"] == {"n": 1, "median": 3.4, "max": 3.4}, "the table's detection column"


@pytest.mark.parametrize("log, timeline, why", [
    (NODE_LOST_LOG.replace("[2, 3] dead together", "[2] dead together"), {}, "dead together"),
    (NODE_LOST_LOG + "[node0] process 1: process 2 sent no heartbeat for 3.3 s (detector.timeout_s 3): declaring it "
                     "dead (its launcher kills it)\n", {}, "one after the other"),
    (NODE_LOST_LOG + "[node0] process 0: generation 1 failed (silent by process 0): process 1 ...\n", {},
     "only generation 0"),
    (NODE_LOST_LOG, {"phases_s": {"detect": None, "abort": 0.1}}, "no detection"),
    (NODE_LOST_LOG, {"detect_from": "the newest committed snapshot"}, "no detection"),
    (NODE_LOST_LOG, {"spare_ranks": [2]}, "the spares took ranks [2]"),
    (NODE_LOST_LOG, {"restarted_ranks": [2, 3], "mode": "restart"}, "restarted ranks"),
])
def test_a_lost_node_fails_when_not_found_as_one_failure_or_its_detection_is_not_recorded(
        tmp_path: Path, log: str, timeline: dict, why: str) -> None:
    case, base, run = _node_run(tmp_path, "inproc-node-lost", **timeline)
    o = _judge(case, base, run, log)
    assert o.result == "FAILED" and why in o.detail, o


def test_a_lost_node_under_elastic_must_go_from_dp_4_to_2_and_two_timelines_are_two_failures(tmp_path: Path) -> None:
    from tools.campaign.judge import node_loss

    _, _, run = _node_run(tmp_path, "inproc-node-lost-elastic", spare_ranks=[], data_parallel_before=4,
                          data_parallel_after=2)
    log = NODE_LOST_LOG.replace("process 4", "process 0")
    assert node_loss(log, run, node="node1", processes=(2, 3), spare_node=False) == ""
    assert "spares took" in node_loss(log, run, node="node1", processes=(2, 3), spare_node=True)
    tl = run / "reports" / "recovery_timeline.attempt0.1.json"
    tl.write_text(json.dumps({**json.loads(tl.read_text()), "data_parallel_after": 3}))
    assert "4 -> 3, expected 4 -> 2" in node_loss(log, run, node="node1", processes=(2, 3), spare_node=False)
    (run / "reports" / "recovery_timeline.attempt0.2.json").write_text(tl.read_text())
    assert "2 recovery timelines" in node_loss(log, run, node="node1", processes=(2, 3), spare_node=False)


def test_a_failed_in_process_case_reports_its_failed_generations_its_give_up_and_the_restart_not_made() -> None:
    from tools.campaign.judge import failure_lines

    log = ("[rank1] x WARNING process 1 (rank 1): generation 1 failed (silent by process 4): node node1 is lost: ...\n"
           "[rank0] x ERROR neighbor_ckpt: in-process recovery gives up on process 0 (in-process restart 1 failed "
           "before completing a step): exiting with status 75\n"
           "2026-11-28 00:16:20,629 launcher node0 (pid 1): restart 1: only 2 of 3 launcher(s) joined within 300 s: "
           "not restarting\n"
           "[rank0] x INFO an unrelated line\n")
    hits = failure_lines(log).split(" | ")
    assert len(hits) == 3 and "generation 1 failed (silent" in hits[0] and "gives up" in hits[1], hits
    assert "not restarting" in hits[2]


def test_node_lost_for_good_runs_the_restart_path_on_two_torchrun_nodes_under_elastic(tmp_path: Path) -> None:
    """``node-lost-for-good``: the restart path (no in-process recovery), 2 simulated nodes of 2 ranks, each a torchrun
    agent; node 1 lost whole (its agent and both ranks SIGKILLed) under ``elastic.enabled``: judged as a shrink
    (DP 4 -> 2, within 1e-4, the same samples) against the shrink's failure-free run, the distributed optimizer."""
    from neighbor_ckpt.config import NeighborCkptConfig

    (c,) = [c for c in draw_cases(len(KINDS), 149, steps=6) if c.kind == "node-lost-for-good"]
    assert not c.inprocess and c.dist_opt and c.tp == 1 and (c.victims, c.devices, c.spares) == ((2, 3), 2, 0)
    assert c.expected == "resized" and c.flavour == (True, 1, True) and c.recipe_args() == c.flavour_args
    cfg = NeighborCkptConfig.from_yaml(write_config(tmp_path / "c.yaml", faults=c.planned_faults, elastic=True))
    assert [(f.target, f.node, f.signal) for f in cfg.fault_injection.planned()] == [("node", 1, "SIGKILL")]
    assert cfg.elastic.enabled and not cfg.inprocess.enabled
