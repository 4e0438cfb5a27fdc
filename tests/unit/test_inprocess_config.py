"""In-process recovery's configuration: the ``neighbor_ckpt.inprocess`` timers, the one detector of both modes (its
rules across sections), the refusal of the old NVRx timer variable, and the timers of the shipped CPU job files."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import textwrap
from pathlib import Path

import pytest
import yaml

import neighbor_ckpt.config as config_module
from neighbor_ckpt.config import (LEGACY_TIMER_KEYS, LEGACY_TIMERS_ENV, DetectorConfig, InprocessConfig,
                                  NeighborCkptConfig, refuse_legacy_timer_env)
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.planning.jobspec import load_job

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
INPROC = ["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=1"]

NEW_KEYS = ("neighbor_ckpt.detector.interval_s", "neighbor_ckpt.detector.timeout_s",
            "neighbor_ckpt.detector.hang_timeout_s", "neighbor_ckpt.inprocess.barrier_timeout_s",
            "neighbor_ckpt.inprocess.abort_timeout_s")

OLD_WRAPPER_TIMERS = ("monitor_thread_interval", "monitor_process_interval", "progress_watchdog_interval",
                      "heartbeat_interval", "heartbeat_timeout", "soft_timeout", "hard_timeout", "barrier_timeout",
                      "completion_timeout", "last_call_wait", "termination_grace_time")
"""The fields of the NVRx wrapper's ``InprocessTimers`` (``neighbor_ckpt/inprocess/wrapper.py`` before our engine replaced it)."""


@pytest.fixture(autouse=True)
def no_legacy_env(monkeypatch):
    monkeypatch.delenv(LEGACY_TIMERS_ENV, raising=False)


def problems(build) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        build()
    return str(ei.value).splitlines()


# -- the inprocess section's keys -------------------------------------------------------------------------------------


def test_inprocess_defaults_are_the_gpu_cluster_ones():
    c = InprocessConfig()
    assert (c.enabled, c.spares) == (False, 0)
    assert c.max_restarts == 10
    assert c.barrier_timeout_s == 300.0
    assert c.abort_timeout_s == 60.0
    assert c.hygiene_rss_growth_mib == 50.0
    assert NeighborCkptConfig().inprocess == c


def test_inprocess_keys_are_read_from_a_yaml_section_and_round_trip(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(textwrap.dedent("""\
        neighbor_ckpt:
          inprocess:
            enabled: true
            spares: 2
            max_restarts: null
            barrier_timeout_s: 90
            abort_timeout_s: 5
            hygiene_rss_growth_mib: 20
        """))
    c = NeighborCkptConfig.from_yaml(p)
    assert c.inprocess == InprocessConfig(enabled=True, spares=2, max_restarts=None, barrier_timeout_s=90.0,
                                          abort_timeout_s=5.0, hygiene_rss_growth_mib=20.0)
    assert type(c.inprocess.barrier_timeout_s) is float
    assert NeighborCkptConfig.from_dict(c.to_dict()) == c


def test_max_restarts_null_means_unbounded_and_is_accepted():
    assert InprocessConfig(max_restarts=None).max_restarts is None


@pytest.mark.parametrize("key,value,message", [
    ("max_restarts", 0, "0 must be >= 1 (or null for unbounded; to never recover in process, set "
                        "inprocess.enabled: false)"),
    ("max_restarts", -3, "-3 must be >= 1"),
    ("spares", -1, "-1 must be >= 0"),
    ("barrier_timeout_s", 0, "0.0 must be a positive finite number"),
    ("barrier_timeout_s", -5.0, "-5.0 must be a positive finite number"),
    ("barrier_timeout_s", math.inf, "inf must be a positive finite number"),
    ("abort_timeout_s", 0, "0.0 must be a positive finite number"),
    ("abort_timeout_s", math.nan, "nan must be a positive finite number"),
    ("hygiene_rss_growth_mib", 0, "0.0 must be a positive finite number"),
    ("hygiene_rss_growth_mib", -1, "-1.0 must be a positive finite number"),
])
def test_out_of_range_inprocess_values_are_refused_with_their_key_path(key, value, message):
    lines = problems(lambda: NeighborCkptConfig.from_dict({"inprocess": {key: value}}))
    assert lines[0].startswith(f"neighbor_ckpt.inprocess.{key}: {message}"), lines


@pytest.mark.parametrize("key,value,what", [
    ("max_restarts", 2.5, "expected an integer, got 2.5"),
    ("max_restarts", True, "expected an integer, got True"),
    ("barrier_timeout_s", "60", "expected a number, got '60'"),
    ("abort_timeout_s", None, "expected a number, got None"),
    ("hygiene_rss_growth_mib", "50MiB", "expected a number, got '50MiB'"),
])
def test_inprocess_values_of_the_wrong_type_are_refused_once(key, value, what):
    assert problems(lambda: InprocessConfig(**{key: value})) == [f"neighbor_ckpt.inprocess.{key}: {what}"]


def test_an_unknown_inprocess_key_lists_the_new_ones():
    lines = problems(lambda: NeighborCkptConfig.from_dict({"inprocess": {"soft_timeout": 5}}))
    assert lines == ["neighbor_ckpt.inprocess.soft_timeout: unknown key (allowed keys of neighbor_ckpt.inprocess: "
                     "abort_timeout_s, barrier_timeout_s, enabled, grow_back, hygiene_rss_growth_mib, max_restarts, "
                     "spares)"]


def test_the_barrier_must_outlast_the_abort_watchdog():
    lines = problems(lambda: InprocessConfig(barrier_timeout_s=30, abort_timeout_s=30))
    assert lines == ["neighbor_ckpt.inprocess.barrier_timeout_s: 30.0 must exceed inprocess.abort_timeout_s (30.0): a "
                     "process whose abort hangs is ended only after abort_timeout_s, and the next generation's "
                     "barrier must still be waiting when it is declared dead"]
    assert InprocessConfig(barrier_timeout_s=31, abort_timeout_s=30).barrier_timeout_s == 31.0


def test_the_barrier_rule_waits_for_the_keys_it_reads():
    assert problems(lambda: InprocessConfig(barrier_timeout_s=10, abort_timeout_s=0)) == [
        "neighbor_ckpt.inprocess.abort_timeout_s: 0.0 must be a positive finite number"]


# -- one detector for both modes: the rules across sections ----------------------------------------------------------


def test_in_process_recovery_without_the_detector_is_refused_because_it_is_what_notices_failures():
    for build in (lambda: NeighborCkptConfig(inprocess={"enabled": True}, detector={"enabled": False}),
                  lambda: NeighborCkptConfig.from_dict({"inprocess": {"enabled": True},
                                                        "detector": {"enabled": False}})):
        lines = problems(build)
        assert len(lines) == 1, lines
        assert lines[0].startswith("neighbor_ckpt.detector.enabled: false is refused with in-process recovery "
                                   "(inprocess.enabled: true): the detector is what notices failures in process")
        assert "turn the detector on, or in-process recovery off" in lines[0]


def test_the_restart_path_may_still_turn_the_detector_off():
    c = NeighborCkptConfig(detector={"enabled": False, "hang_timeout_s": None})
    assert not c.detector.enabled and not c.inprocess.enabled


def test_in_process_recovery_without_a_hang_timeout_is_refused_because_a_stuck_rank_would_never_be_noticed():
    lines = problems(lambda: NeighborCkptConfig(inprocess={"enabled": True}, detector={"hang_timeout_s": None}))
    assert len(lines) == 1, lines
    assert lines[0].startswith("neighbor_ckpt.detector.hang_timeout_s: null (off) is refused with in-process "
                               "recovery (inprocess.enabled: true): a stuck rank")
    assert "would never be noticed" in lines[0]


def test_the_restart_path_may_turn_the_hang_clock_off():
    assert NeighborCkptConfig(detector={"hang_timeout_s": None}).detector.hang_timeout_s is None


def test_in_process_the_barrier_must_outlast_the_detectors_silence_timeout():
    lines = problems(lambda: NeighborCkptConfig(inprocess={"enabled": True, "barrier_timeout_s": 4,
                                                           "abort_timeout_s": 1},
                                                detector={"timeout_s": 5}))
    assert lines == ["neighbor_ckpt.inprocess.barrier_timeout_s: 4.0 must exceed detector.timeout_s (5.0): a process "
                     "that falls silent before a generation's barrier is declared dead only after detector.timeout_s, "
                     "and the barrier must still be waiting then"]
    # the restart path has no generation barrier: the same values pass with in-process recovery off
    NeighborCkptConfig(inprocess={"barrier_timeout_s": 4, "abort_timeout_s": 1}, detector={"timeout_s": 5})


def test_a_rule_across_sections_does_not_repeat_a_sections_own_problem():
    """A detector timeout out of range is one line; the barrier rule that reads it does not run."""
    assert problems(lambda: NeighborCkptConfig(inprocess={"enabled": True}, detector={"timeout_s": 0})) == [
        "neighbor_ckpt.detector.timeout_s: 0.0 must be > 0"]


def test_every_in_process_problem_is_reported_at_once():
    lines = problems(lambda: NeighborCkptConfig.from_dict({
        "inprocess": {"enabled": True, "max_restarts": 0, "abort_timeout_s": -1},
        "detector": {"enabled": False}}))
    assert [line.split(":")[0] for line in lines] == ["neighbor_ckpt.inprocess.max_restarts",
                                                      "neighbor_ckpt.inprocess.abort_timeout_s",
                                                      "neighbor_ckpt.detector.enabled"]


def test_a_job_file_reports_the_detector_rule_under_its_own_key_path():
    lines = problems(lambda: load_job(REPO / "configs/gpt_tiny_cpu.yaml",
                                      [*INPROC, "neighbor_ckpt.detector.enabled=false"]))
    assert len(lines) == 1 and lines[0].startswith(
        "config.neighbor_ckpt.detector.enabled: false is refused with in-process recovery"), lines


# -- the old NVRx timer variable ------------------------------------------------------------------------------------


def test_without_the_old_timer_variable_nothing_is_refused():
    refuse_legacy_timer_env({})
    refuse_legacy_timer_env({"NEIGHBOR_CKPT_STORE_DIR": "/x"})
    refuse_legacy_timer_env()  # os.environ, which the fixture cleaned


def test_the_old_timer_variable_is_refused_naming_every_new_key_and_mapping_the_old_names():
    with pytest.raises(ConfigError) as ei:
        refuse_legacy_timer_env({LEGACY_TIMERS_ENV: "soft_timeout=10"})
    msg = str(ei.value)
    assert len(msg.splitlines()) == 1  # one problem, one line
    assert msg.startswith(f"{LEGACY_TIMERS_ENV}='soft_timeout=10' is set, and no longer read")
    for k in NEW_KEYS:
        assert k in msg
    for old, new in [("soft_timeout", "detector.hang_timeout_s"), ("hard_timeout", "detector.hang_timeout_s"),
                     ("heartbeat_timeout", "detector.timeout_s"), ("heartbeat_interval", "detector.interval_s"),
                     ("barrier_timeout", "inprocess.barrier_timeout_s")]:
        assert f"{old} -> {new}" in msg
    assert msg.endswith(f"unset {LEGACY_TIMERS_ENV}")


def test_an_empty_old_timer_variable_overrides_nothing_and_is_let_through():
    refuse_legacy_timer_env({LEGACY_TIMERS_ENV: ""})
    refuse_legacy_timer_env({LEGACY_TIMERS_ENV: "  "})
    with pytest.raises(ConfigError, match="no longer read"):
        refuse_legacy_timer_env({LEGACY_TIMERS_ENV: "bogus"})  # set to anything: refused, even a name never known


def test_the_refusal_translates_the_values_it_was_given_into_overrides():
    with pytest.raises(ConfigError) as ei:
        refuse_legacy_timer_env({LEGACY_TIMERS_ENV: " soft_timeout=10, hard_timeout=15 ,barrier_timeout=30,"
                                                    "last_call_wait=1,bogus=2"})
    msg = str(ei.value)
    assert ("for this value: neighbor_ckpt.detector.hang_timeout_s=10 "
            "neighbor_ckpt.inprocess.barrier_timeout_s=30)") in msg  # soft_timeout named first wins; no bogus


def test_the_refusal_reads_the_process_environment_by_default(monkeypatch):
    monkeypatch.setenv(LEGACY_TIMERS_ENV, "heartbeat_timeout=5")
    with pytest.raises(ConfigError, match="neighbor_ckpt.detector.timeout_s=5"):
        refuse_legacy_timer_env()


def test_every_timer_of_the_old_wrapper_is_mapped_to_a_key_or_said_to_be_gone():
    assert set(LEGACY_TIMER_KEYS) == set(OLD_WRAPPER_TIMERS)
    keys = {f"neighbor_ckpt.{s}.{f.name}" for s, cls in (("detector", DetectorConfig), ("inprocess", InprocessConfig))
            for f in dataclasses.fields(cls)}
    assert {new for new in LEGACY_TIMER_KEYS.values() if new is not None} <= keys


def test_an_enabled_inprocess_section_is_refused_while_the_old_variable_is_set(monkeypatch):
    monkeypatch.setenv(LEGACY_TIMERS_ENV, "soft_timeout=10")
    lines = problems(lambda: NeighborCkptConfig(inprocess={"enabled": True}))
    assert len(lines) == 1 and lines[0].startswith(
        f"neighbor_ckpt.inprocess.enabled: {LEGACY_TIMERS_ENV}='soft_timeout=10' is set, and no longer read"), lines
    lines = problems(lambda: load_job(REPO / "configs/gpt_tiny_cpu.yaml", INPROC))
    assert len(lines) == 1 and lines[0].startswith("config.neighbor_ckpt.inprocess.enabled: "), lines


def test_the_old_variable_does_not_hide_the_other_in_process_problems(monkeypatch):
    monkeypatch.setenv(LEGACY_TIMERS_ENV, "soft_timeout=10")
    lines = problems(lambda: NeighborCkptConfig(inprocess={"enabled": True}, detector={"enabled": False}))
    assert [line.split(":")[0] for line in lines] == ["neighbor_ckpt.inprocess.enabled",
                                                      "neighbor_ckpt.detector.enabled"]


def test_the_old_variable_does_not_concern_the_restart_path(monkeypatch):
    monkeypatch.setenv(LEGACY_TIMERS_ENV, "soft_timeout=10")
    assert not NeighborCkptConfig().inprocess.enabled
    assert not load_job(REPO / "configs/gpt_tiny_cpu.yaml").neighbor_ckpt.inprocess.enabled


def test_the_refusal_is_exported():
    assert {"refuse_legacy_timer_env", "LEGACY_TIMERS_ENV", "LEGACY_TIMER_KEYS"} <= set(config_module.__all__)


# -- the shipped job files --------------------------------------------------------------------------------------------


def _cpu_inprocess_configs() -> list[Path]:
    """Shipped job files meant for the CPU machines that can run in process (Bridge: restart path only)."""
    out = []
    for p in CONFIGS:
        doc = yaml.safe_load(p.read_text())
        if doc["trainer"]["accelerator"] == "cpu" and doc.get("framework", "nemo") == "nemo":
            out.append(p)
    return out


def test_the_cpu_job_files_that_run_in_process_are_found():
    assert {p.stem for p in _cpu_inprocess_configs()} == {"gpt_tiny_cpu", "llama_tiny_cpu"}


@pytest.mark.parametrize("path", _cpu_inprocess_configs(), ids=lambda p: p.stem)
def test_cpu_job_files_set_tight_in_process_timers_that_validate_with_in_process_on(path):
    job = load_job(path, INPROC)
    det, inp = job.neighbor_ckpt.detector, job.neighbor_ckpt.inprocess
    assert inp.enabled and inp.spares == 1 and det.enabled
    assert 0.2 <= det.interval_s <= 0.25
    assert det.timeout_s <= 3.0 and det.timeout_s >= 4 * det.interval_s  # a few missed heartbeats, no fewer
    # a CPU step of the tiny model and a snapshot's ring transfer take 50-150 ms: at least 10x the slowest, and a
    # hang still recovered within seconds
    assert det.hang_timeout_s is not None and 1.5 <= det.hang_timeout_s <= 5.0
    assert inp.barrier_timeout_s <= 120 and inp.abort_timeout_s < inp.barrier_timeout_s
    assert not load_job(path).neighbor_ckpt.inprocess.enabled  # off unless asked for


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_job_file_validates_with_in_process_recovery_on(path):
    job = load_job(path, INPROC)
    assert job.neighbor_ckpt.inprocess.enabled and job.neighbor_ckpt.detector.enabled


@pytest.mark.parametrize("name", ["llama3_8b", "llama3_70b", "gpt3_175b", "mixtral_8x7b"])
def test_gpu_job_files_keep_the_gpu_cluster_defaults(name):
    nc = load_job(REPO / "configs" / f"{name}.yaml").neighbor_ckpt
    assert nc.inprocess == InprocessConfig() and nc.detector == DetectorConfig()


def test_the_cpu_job_file_documents_how_to_turn_in_process_on():
    for name in ("gpt_tiny_cpu", "llama_tiny_cpu"):
        head = (REPO / "configs" / f"{name}.yaml").read_text().split("\nname:")[0]
        assert "neighbor_ckpt.inprocess.enabled=true neighbor_ckpt.inprocess.spares=1" in head


# -- documentation -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [InprocessConfig, DetectorConfig], ids=lambda c: c.__name__)
def test_every_in_process_and_detector_key_has_a_docstring(cls):
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    documented = {stmt.target.id for stmt, nxt in zip(body, body[1:])
                  if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                  and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                  and isinstance(nxt.value.value, str) and len(nxt.value.value) > 30}
    assert documented == {f.name for f in dataclasses.fields(cls)}


def test_the_docstrings_say_what_happens_in_process_on_our_own_engine():
    def words(text: str) -> str:
        return " ".join(text.split())

    assert "our own engine" in words(InprocessConfig.__doc__) and "must be on" in words(InprocessConfig.__doc__)
    assert "both recovery modes" in words(DetectorConfig.__doc__)
    src = inspect.getsource(DetectorConfig)
    for key in ("interval_s", "timeout_s", "hang_timeout_s", "kill_local"):
        doc = words(src.split(f"    {key}:")[1].split('"""')[1])
        assert "In process" in doc or "in process" in doc, key
