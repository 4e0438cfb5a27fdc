"""Configuration: defaults, strict YAML/dict parsing with full key paths, env overrides, round trips."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest
import yaml

from neighbor_ckpt.config import (JOB_ID_ENV, STORE_DIR_ENV, DetectorConfig, InprocessConfig, InsuranceConfig,
                                  LazyBackupConfig, NeighborCkptConfig, RingConfig, StoreConfig, TransportConfig)
from neighbor_ckpt.errors import ConfigError, NeighborCkptError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in (STORE_DIR_ENV, JOB_ID_ENV, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)


def write_yaml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(text)
    return p


# -- defaults -------------------------------------------------------------------------------------------------


def test_defaults():
    c = NeighborCkptConfig()
    assert c.enabled is True and c.job_id is None
    assert c.store == StoreConfig(dir="/dev/shm/neighbor_ckpt-{user}", versions=2, checksum="xxh3", extras_capacity_mb=None,
                                  cleanup_on_success=True)
    assert c.ring == RingConfig(policy="cross_node")
    assert c.transport == TransportConfig(enabled=True, chunk_mb=16.0, timeout_s=120.0, wait_for_replica=True,
                                          rate_limit_mb_per_s=0.0)
    assert c.lazy_backup == LazyBackupConfig(enabled=True)
    assert c.insurance == InsuranceConfig(every_n_steps=0, dirpath=None)
    assert c.detector == DetectorConfig(enabled=True, interval_s=1.0, timeout_s=5.0, hang_timeout_s=900.0,
                                        kill_local=True)
    assert c.inprocess == InprocessConfig(enabled=False, spares=0, max_restarts=10, barrier_timeout_s=300.0,
                                          abort_timeout_s=60.0, hygiene_rss_growth_mib=50.0)
    assert c.resolved_store_dir() == Path(f"/dev/shm/neighbor_ckpt-{pwd.getpwuid(os.geteuid()).pw_name}")
    assert c.resolved_job_id() == "default"


def test_sections_are_independent_instances():
    a, b = NeighborCkptConfig(), NeighborCkptConfig()
    assert a.store is not b.store and a == b


def test_fields_are_keyword_only():
    with pytest.raises(TypeError):
        StoreConfig("/tmp")  # type: ignore[misc]


# -- from_dict / from_yaml --------------------------------------------------------------------------------------


def test_from_dict_none_or_empty_gives_the_defaults():
    assert NeighborCkptConfig.from_dict(None) == NeighborCkptConfig()
    assert NeighborCkptConfig.from_dict({}) == NeighborCkptConfig()


def test_from_dict_sets_nested_values():
    c = NeighborCkptConfig.from_dict({"job_id": "run-1", "store": {"dir": "/tmp/x", "versions": 3, "checksum": "none"},
                                      "ring": {"policy": "next"}, "transport": {"chunk_mb": 8, "enabled": False},
                                      "insurance": {"every_n_steps": 100, "dirpath": "/ckpt"}})
    assert c.job_id == "run-1"
    assert (c.store.dir, c.store.versions, c.store.checksum) == ("/tmp/x", 3, "none")
    assert c.ring.policy == "next"
    assert c.transport.chunk_mb == 8.0 and type(c.transport.chunk_mb) is float and not c.transport.enabled
    assert c.transport.timeout_s == 120.0  # untouched keys keep their defaults
    assert c.insurance == InsuranceConfig(every_n_steps=100, dirpath="/ckpt")


def test_a_null_section_gives_that_sections_defaults():
    assert NeighborCkptConfig.from_dict({"transport": None}).transport == TransportConfig()


def test_from_yaml_reads_the_neighbor_ckpt_section(tmp_path):
    p = write_yaml(tmp_path, """
trainer:
  max_steps: 10
neighbor_ckpt:
  job_id: exp42
  store:
    dir: /dev/shm/me
    versions: 4
  transport:
    chunk_mb: 4.5
    rate_limit_mb_per_s: 100
  ring:
    policy: next
""")
    c = NeighborCkptConfig.from_yaml(p)
    assert c.job_id == "exp42" and c.store.dir == "/dev/shm/me" and c.store.versions == 4
    assert c.transport.chunk_mb == 4.5 and c.transport.rate_limit_mb_per_s == 100.0
    assert c.ring.policy == "next"
    assert NeighborCkptConfig.from_yaml(str(p)) == c


def test_from_yaml_without_the_section_or_empty_gives_the_defaults(tmp_path):
    assert NeighborCkptConfig.from_yaml(write_yaml(tmp_path, "trainer: {max_steps: 3}\n")) == NeighborCkptConfig()
    assert NeighborCkptConfig.from_yaml(write_yaml(tmp_path, "")) == NeighborCkptConfig()
    assert NeighborCkptConfig.from_yaml(write_yaml(tmp_path, "neighbor_ckpt:\n")) == NeighborCkptConfig()


def test_from_yaml_with_another_section_name(tmp_path):
    p = write_yaml(tmp_path, "ckpt:\n  store:\n    versions: 3\n")
    assert NeighborCkptConfig.from_yaml(p, section="ckpt").store.versions == 3


def test_from_yaml_rejects_a_non_mapping_document(tmp_path):
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        NeighborCkptConfig.from_yaml(write_yaml(tmp_path, "- a\n- b\n"))


def test_section_that_is_not_a_mapping_is_rejected_with_its_path(tmp_path):
    with pytest.raises(ConfigError, match=r"^neighbor_ckpt: expected a mapping"):
        NeighborCkptConfig.from_yaml(write_yaml(tmp_path, "neighbor_ckpt: 5\n"))
    with pytest.raises(ConfigError, match=r"^neighbor_ckpt\.store: expected a mapping, got list"):
        NeighborCkptConfig.from_dict({"store": ["a"]})


# -- unknown keys ------------------------------------------------------------------------------------------------


def test_unknown_key_is_rejected_with_its_full_path(tmp_path):
    p = write_yaml(tmp_path, "neighbor_ckpt:\n  transport:\n    chunk_mbb: 8\n")
    with pytest.raises(ConfigError) as ei:
        NeighborCkptConfig.from_yaml(p)
    msg = str(ei.value)
    assert msg.startswith("neighbor_ckpt.transport.chunk_mbb: unknown key")
    assert "chunk_mb" in msg and "timeout_s" in msg  # lists the allowed keys


@pytest.mark.parametrize("data,path", [
    ({"stor": {}}, "neighbor_ckpt.stor"),
    ({"store": {"versionz": 2}}, "neighbor_ckpt.store.versionz"),
    ({"ring": {"policy": "next", "mode": "x"}}, "neighbor_ckpt.ring.mode"),
    ({"insurance": {"every": 1}}, "neighbor_ckpt.insurance.every"),
])
def test_unknown_keys_anywhere_name_the_key_path(data, path):
    with pytest.raises(ConfigError, match=f"^{path.replace('.', '[.]')}: unknown key"):
        NeighborCkptConfig.from_dict(data)


def test_a_non_string_yaml_key_is_rejected_as_unknown(tmp_path):
    # YAML 1.1 reads `on:` as the boolean True
    p = write_yaml(tmp_path, "neighbor_ckpt:\n  transport:\n    on: true\n")
    with pytest.raises(ConfigError, match=r"^neighbor_ckpt\.transport\.True: unknown key"):
        NeighborCkptConfig.from_yaml(p)


def test_unknown_keys_of_mixed_types_are_rejected_with_config_error(tmp_path):
    p = write_yaml(tmp_path, "neighbor_ckpt:\n  transport:\n    on: true\n    chunk_mbb: 4\n")
    with pytest.raises(ConfigError, match="unknown key"):
        NeighborCkptConfig.from_yaml(p)


def test_the_old_megabits_looking_key_names_its_new_name(tmp_path):
    p = write_yaml(tmp_path, "neighbor_ckpt:\n  transport:\n    rate_limit_mbps: 100\n")
    with pytest.raises(ConfigError, match=r"^neighbor_ckpt\.transport\.rate_limit_mbps: renamed to rate_limit_mb_per_s"):
        NeighborCkptConfig.from_yaml(p)


# -- every problem at once ----------------------------------------------------------------------------------------


THREE_PROBLEMS = """
neighbor_ckpt:
  store:
    versions: 1
  transport:
    chunk_mbb: 4
  detector:
    interval_s: 2.0
    timeout_s: 1.0
"""


def test_a_yaml_file_with_three_problems_reports_three_lines_with_their_key_paths(tmp_path):
    with pytest.raises(ConfigError) as ei:
        NeighborCkptConfig.from_yaml(write_yaml(tmp_path, THREE_PROBLEMS))
    lines = str(ei.value).splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("neighbor_ckpt.transport.chunk_mbb: unknown key (allowed keys of neighbor_ckpt.transport")
    assert lines[1] == "neighbor_ckpt.store.versions: 1 must be >= 2"
    assert lines[2].startswith("neighbor_ckpt.detector.timeout_s: 1.0 must exceed detector.interval_s (2.0)")


def test_a_dict_with_three_problems_reports_three_lines_with_their_key_paths():
    with pytest.raises(ConfigError) as ei:
        NeighborCkptConfig.from_dict({"enabled": "yes", "transport": {"chunk_mb": 0}, "insurance": {"every": 1}},
                                     path="ckpt")
    assert str(ei.value).splitlines() == [
        "ckpt.enabled: expected true or false, got 'yes'",
        "ckpt.insurance.every: unknown key (allowed keys of ckpt.insurance: dirpath, every_n_steps)",
        "ckpt.transport.chunk_mb: 0.0 must be > 0",
    ]


def test_direct_construction_with_mappings_reports_every_range_problem():
    with pytest.raises(ConfigError) as ei:
        NeighborCkptConfig(store={"versions": 1}, insurance={"every_n_steps": -1},
                           transport={"rate_limit_mb_per_s": -1.0})
    assert str(ei.value).splitlines() == [
        "neighbor_ckpt.store.versions: 1 must be >= 2",
        "neighbor_ckpt.transport.rate_limit_mb_per_s: -1.0 must be >= 0 (0 = unlimited)",
        "neighbor_ckpt.insurance.every_n_steps: -1 must be >= 0 (0 = off)",
    ]


# -- the constructors validate like from_dict (same key paths, same messages) --------------------------------------


def test_constructor_builds_a_nested_section_from_a_mapping():
    c = NeighborCkptConfig(store={"dir": "/x", "versions": 3}, transport={"chunk_mb": 8})
    assert c.store == StoreConfig(dir="/x", versions=3)
    assert c.transport.chunk_mb == 8.0 and type(c.transport.chunk_mb) is float
    assert c == NeighborCkptConfig.from_dict({"store": {"dir": "/x", "versions": 3}, "transport": {"chunk_mb": 8}})


def test_constructor_null_section_gives_its_defaults_as_from_dict_does():
    assert NeighborCkptConfig(transport=None) == NeighborCkptConfig()  # type: ignore[arg-type]


@pytest.mark.parametrize("build,message", [
    (lambda: NeighborCkptConfig(job_id=5), "neighbor_ckpt.job_id: expected a string, got 5"),
    (lambda: NeighborCkptConfig(enabled="yes"), "neighbor_ckpt.enabled: expected true or false, got 'yes'"),
    (lambda: NeighborCkptConfig(store=5),
     "neighbor_ckpt.store: expected a mapping or a StoreConfig, got int (5)"),
    (lambda: NeighborCkptConfig(store={"versions": "3"}), "neighbor_ckpt.store.versions: expected an integer, got '3'"),
    (lambda: NeighborCkptConfig(store={"versions": 1}), "neighbor_ckpt.store.versions: 1 must be >= 2"),
    (lambda: NeighborCkptConfig(store={"dirr": "/x"}),
     "neighbor_ckpt.store.dirr: unknown key (allowed keys of neighbor_ckpt.store: checksum, cleanup_on_success, dir, "
     "extras_capacity_mb, reap_orphans, versions)"),
    (lambda: NeighborCkptConfig(stor={}), "neighbor_ckpt.stor: unknown key (allowed keys of neighbor_ckpt: "
     "data_check, detector, elastic, enabled, fault_injection, inprocess, insurance, job_id, lazy_backup, report, "
     "ring, store, transport)"),
    (lambda: NeighborCkptConfig(data_check="maybe"),
     "neighbor_ckpt.data_check: 'maybe' is not allowed (allowed values: 'error', 'warn', 'off')"),
    (lambda: StoreConfig(versions=1), "neighbor_ckpt.store.versions: 1 must be >= 2"),
    (lambda: StoreConfig(checksum="md5"),
     "neighbor_ckpt.store.checksum: 'md5' is not allowed (allowed values: 'xxh3', 'none')"),
    (lambda: TransportConfig(chunk_mb="16"), "neighbor_ckpt.transport.chunk_mb: expected a number, got '16'"),
    (lambda: TransportConfig(rate_limit_mbps=5),
     "neighbor_ckpt.transport.rate_limit_mbps: renamed to rate_limit_mb_per_s (same value: it always was megabytes, "
     "not megabits, per second)"),
    (lambda: RingConfig(policy="random"),
     "neighbor_ckpt.ring.policy: 'random' is not allowed (allowed values: 'cross_node', 'next')"),
    (lambda: InsuranceConfig(every_n_steps=2.5), "neighbor_ckpt.insurance.every_n_steps: expected an integer, got 2.5"),
    (lambda: LazyBackupConfig(enabled=1), "neighbor_ckpt.lazy_backup.enabled: expected true or false, got 1"),
], ids=["job_id-int", "enabled-str", "section-int", "nested-type", "nested-range", "nested-unknown", "unknown",
        "literal", "section-range", "section-literal", "section-type", "section-renamed", "ring", "insurance",
        "lazy_backup"])
def test_constructors_reject_bad_values_with_the_from_dict_message(build, message):
    with pytest.raises(ConfigError) as ei:
        build()
    assert str(ei.value) == message


def test_constructor_and_from_dict_give_the_same_lines_for_the_same_problems():
    data = {"enabled": "yes", "store": {"versions": 1, "checksum": "md5"}, "detector": {"interval_s": "fast"}}
    with pytest.raises(ConfigError) as from_ctor:
        NeighborCkptConfig(**data)
    with pytest.raises(ConfigError) as from_map:
        NeighborCkptConfig.from_dict(data)
    assert sorted(str(from_ctor.value).splitlines()) == sorted(str(from_map.value).splitlines())
    assert len(str(from_ctor.value).splitlines()) == 4


def test_constructor_accepts_a_path_for_a_string_field(tmp_path):
    assert NeighborCkptConfig(store={"dir": tmp_path}).store.dir == str(tmp_path)
    assert StoreConfig(dir=tmp_path).dir == str(tmp_path)


def test_every_section_constructor_validates():
    """Every section of NeighborCkptConfig checks its own constructor: none accepts an unknown key."""
    import dataclasses

    for f in dataclasses.fields(NeighborCkptConfig):
        value = getattr(NeighborCkptConfig(), f.name)
        if not dataclasses.is_dataclass(value):
            continue
        section = type(value)
        with pytest.raises(ConfigError, match=f"^neighbor_ckpt[.]{f.name}[.]nope: unknown key"):
            section(nope=1)


def test_a_value_of_the_wrong_type_is_not_also_reported_out_of_range():
    with pytest.raises(ConfigError) as ei:
        NeighborCkptConfig.from_dict({"detector": {"interval_s": "fast"}})
    assert str(ei.value) == "neighbor_ckpt.detector.interval_s: expected a number, got 'fast'"


def test_config_error_is_a_value_error_and_a_neighbor_ckpt_error():
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, NeighborCkptError)
    with pytest.raises(ValueError):
        NeighborCkptConfig.from_dict({"nope": 1})


# -- wrong types -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data,path,what", [
    ({"enabled": "yes"}, "neighbor_ckpt.enabled", "expected true or false"),
    ({"enabled": 1}, "neighbor_ckpt.enabled", "expected true or false"),
    ({"store": {"versions": 2.5}}, "neighbor_ckpt.store.versions", "expected an integer"),
    ({"store": {"versions": True}}, "neighbor_ckpt.store.versions", "expected an integer"),
    ({"store": {"versions": "3"}}, "neighbor_ckpt.store.versions", "expected an integer"),
    ({"transport": {"chunk_mb": "16"}}, "neighbor_ckpt.transport.chunk_mb", "expected a number"),
    ({"transport": {"timeout_s": False}}, "neighbor_ckpt.transport.timeout_s", "expected a number"),
    ({"store": {"dir": 5}}, "neighbor_ckpt.store.dir", "expected a string"),
    ({"job_id": 123}, "neighbor_ckpt.job_id", "expected a string"),
    ({"insurance": {"dirpath": ["a"]}}, "neighbor_ckpt.insurance.dirpath", "expected a string"),
])
def test_wrong_types_are_rejected_with_the_key_path(data, path, what):
    with pytest.raises(ConfigError) as ei:
        NeighborCkptConfig.from_dict(data)
    assert str(ei.value).startswith(f"{path}: {what}")


def test_optional_string_accepts_null():
    assert NeighborCkptConfig.from_dict({"job_id": None, "insurance": {"dirpath": None}}) == NeighborCkptConfig()


# -- out of range -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data,path", [
    ({"store": {"versions": 1}}, "neighbor_ckpt.store.versions"),
    ({"store": {"versions": 0}}, "neighbor_ckpt.store.versions"),
    ({"store": {"extras_capacity_mb": 0}}, "neighbor_ckpt.store.extras_capacity_mb"),
    ({"transport": {"chunk_mb": 0}}, "neighbor_ckpt.transport.chunk_mb"),
    ({"transport": {"chunk_mb": -1.0}}, "neighbor_ckpt.transport.chunk_mb"),
    ({"transport": {"timeout_s": 0}}, "neighbor_ckpt.transport.timeout_s"),
    ({"transport": {"rate_limit_mb_per_s": -0.5}}, "neighbor_ckpt.transport.rate_limit_mb_per_s"),
    ({"insurance": {"every_n_steps": -1}}, "neighbor_ckpt.insurance.every_n_steps"),
])
def test_out_of_range_values_are_rejected_with_the_key_path(data, path):
    with pytest.raises(ConfigError, match=f"^{path.replace('.', '[.]')}: .* must be"):
        NeighborCkptConfig.from_dict(data)


def test_out_of_range_values_are_rejected_when_constructing_directly():
    with pytest.raises(ConfigError, match="neighbor_ckpt.store.versions: 1 must be >= 2"):
        NeighborCkptConfig(store=StoreConfig(versions=1))


@pytest.mark.parametrize("value", [0.0, 0, 250])
def test_rate_limit_zero_means_unlimited_and_is_accepted(value):
    assert NeighborCkptConfig.from_dict({"transport": {"rate_limit_mb_per_s": value}}).transport.rate_limit_mb_per_s == value


def test_range_errors_use_the_section_name_they_were_read_from(tmp_path):
    p = write_yaml(tmp_path, "ckpt:\n  store:\n    versions: 1\n")
    with pytest.raises(ConfigError, match=r"^ckpt\.store\.versions"):
        NeighborCkptConfig.from_yaml(p, section="ckpt")


# -- Literal values --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data,path,allowed", [
    ({"store": {"checksum": "md5"}}, "neighbor_ckpt.store.checksum", ["'xxh3'", "'none'"]),
    ({"ring": {"policy": "random"}}, "neighbor_ckpt.ring.policy", ["'cross_node'", "'next'"]),
    ({"ring": {"policy": None}}, "neighbor_ckpt.ring.policy", ["'cross_node'", "'next'"]),
])
def test_literal_values_list_the_allowed_ones(data, path, allowed):
    with pytest.raises(ConfigError) as ei:
        NeighborCkptConfig.from_dict(data)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: ") and "is not allowed" in msg
    for a in allowed:
        assert a in msg


def test_yaml_none_string_is_the_checksum_literal_not_null(tmp_path):
    c = NeighborCkptConfig.from_yaml(write_yaml(tmp_path, "neighbor_ckpt:\n  store:\n    checksum: none\n"))
    assert c.store.checksum == "none"


# -- environment overrides ---------------------------------------------------------------------------------------


def test_store_dir_env_overrides_the_config(monkeypatch, tmp_path):
    c = NeighborCkptConfig.from_dict({"store": {"dir": "/from/config"}})
    assert c.resolved_store_dir() == Path("/from/config")
    monkeypatch.setenv(STORE_DIR_ENV, str(tmp_path))
    assert c.resolved_store_dir() == tmp_path
    monkeypatch.setenv(STORE_DIR_ENV, "")
    assert c.resolved_store_dir() == Path("/from/config")


def test_job_id_env_wins_over_config_and_launcher_ids(monkeypatch):
    c = NeighborCkptConfig.from_dict({"job_id": "from-config"})
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic")
    monkeypatch.setenv("SLURM_JOB_ID", "slurm")
    assert c.resolved_job_id() == "from-config"
    monkeypatch.setenv(JOB_ID_ENV, "from-env")
    assert c.resolved_job_id() == "from-env"


def test_job_id_falls_back_to_torchelastic_then_slurm_then_default(monkeypatch):
    c = NeighborCkptConfig()
    assert c.resolved_job_id() == "default"
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    assert c.resolved_job_id() == "1234"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    assert c.resolved_job_id() == "elastic-7"


@pytest.mark.parametrize("raw,safe", [("a/b c", "a_b_c"), ("../../etc", "_.._etc"), ("..", "default"),
                                      (".hidden", "hidden"), ("ok-1_2.3", "ok-1_2.3")])
def test_job_id_is_made_safe_for_a_directory_name(monkeypatch, raw, safe):
    monkeypatch.setenv(JOB_ID_ENV, raw)
    got = NeighborCkptConfig().resolved_job_id()
    assert got == safe
    assert "/" not in got and got not in ("", ".", "..")


# -- round trip ------------------------------------------------------------------------------------------------------


def test_to_dict_round_trips_through_from_dict():
    c = NeighborCkptConfig.from_dict({"job_id": "j", "store": {"versions": 3, "checksum": "none"},
                                      "ring": {"policy": "next"}, "transport": {"rate_limit_mb_per_s": 5},
                                      "insurance": {"dirpath": "/x", "every_n_steps": 7}})
    d = c.to_dict()
    assert d["store"]["versions"] == 3 and d["ring"] == {"policy": "next"}
    assert NeighborCkptConfig.from_dict(d) == c
    assert NeighborCkptConfig().to_dict() == NeighborCkptConfig.from_dict(NeighborCkptConfig().to_dict()).to_dict()


def test_to_dict_round_trips_through_yaml(tmp_path):
    c = NeighborCkptConfig.from_dict({"store": {"extras_capacity_mb": 8}, "lazy_backup": {"enabled": False}})
    p = write_yaml(tmp_path, yaml.safe_dump({"neighbor_ckpt": c.to_dict()}))
    assert NeighborCkptConfig.from_yaml(p) == c
