"""The framework-agnostic glue (neighbor_ckpt.glue): insurance files, which checkpoint wins, the resume decision,
the data position, and the callback state's format inside a framework checkpoint (release 0.1's, still read)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from neighbor_ckpt.config import InsuranceConfig
from neighbor_ckpt.errors import NeighborCkptError
from neighbor_ckpt.glue.insurance import (InsuranceFiles, checkpoint_consumed_samples, checkpoint_step,
                                          disk_checkpoint_wins, iteration_from_name)
from neighbor_ckpt.glue.session import DataPosition, Session, decide_resume
from neighbor_ckpt.recovery.flow import RecoveryReport
from neighbor_ckpt.recovery.recoverer import RecoveryResult


def test_insurance_files_are_configured_named_due_and_pruned_to_the_newest_two(tmp_path: Path) -> None:
    assert InsuranceFiles.from_config(InsuranceConfig(), tmp_path) is None
    default = InsuranceFiles.from_config(InsuranceConfig(every_n_steps=3), tmp_path)
    assert default is not None and default.directory == tmp_path / "neighbor_ckpt_insurance"
    only_read = InsuranceFiles.from_config(InsuranceConfig(dirpath=str(tmp_path / "ins")), tmp_path / "root")
    assert only_read is not None and only_read.directory == tmp_path / "ins" and not only_read.due(3)
    assert [s for s in range(1, 10) if default.due(s)] == [3, 6, 9]
    assert default.existing() == [] and default.newest() is None  # no directory yet
    default.directory.mkdir()
    for step in (12, 3, 9, 6):
        default.path(step).write_bytes(b"x")
    (default.directory / "other-step99.ckpt").write_bytes(b"x")
    assert [s for s, _ in default.existing()] == [3, 6, 9, 12]
    assert default.newest() == (12, default.directory / "neighbor-insurance-step12.ckpt")
    default.prune()
    assert [s for s, _ in default.existing()] == [9, 12]
    assert (default.directory / "other-step99.ckpt").exists()


def test_a_framework_checkpoints_iteration_comes_from_its_name_or_is_a_typed_error() -> None:
    nemo = "/ckpt/model--reduced_train_loss=1.23-epoch=0-consumed_samples=48.0-last"
    assert checkpoint_step("/ckpt/m-step=99-consumed_samples=800.0") == 99
    assert checkpoint_step("/x/neighbor-insurance-step6.ckpt") == 6
    assert checkpoint_step(nemo) is None and checkpoint_consumed_samples(nemo) == 48
    assert iteration_from_name(nemo, framework="NeMo", steps_for_consumed=lambda c: c // 8) == 6
    with pytest.raises(NeighborCkptError, match=r"^NeMo resumes from /ckpt/last, whose name carries neither step=N.*"
                                                r"Keep \{step\}"):
        iteration_from_name("/ckpt/last", framework="NeMo", hint="Keep {step} in the name")


@pytest.mark.parametrize("path,wins", [("/d/m-step=8", True), ("/d/m-step=7", False), ("/d/m-step=3", False),
                                       ("/d/last.ckpt", False)])
def test_after_an_in_memory_restore_the_newer_iteration_wins_announced(path: str, wins: bool,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert disk_checkpoint_wins(path, 7) is wins
    said = caplog.text
    assert ("is newer than the in-memory version (step 7): it is loaded over it" in said) is wins
    assert (f"skipping the disk restore of {path}: the in-memory version of step 7 is newer" in said) is not wins


def test_a_step_the_framework_knows_overrides_the_name() -> None:
    assert disk_checkpoint_wins("/ckpt/iter_0000009", 7, disk_step=9)
    assert not disk_checkpoint_wins("/ckpt/m-step=9", 7, disk_step=7)


def _result(outcome: str, iteration: int | None, user_state: object = None) -> RecoveryResult:
    return RecoveryResult(RecoveryReport(outcome=outcome, iteration=iteration), iteration, user_state)


def test_the_resume_applies_the_snapshots_state_ours_insurances_or_lets_the_framework_load_its_own() -> None:
    snap, ins = {"batches_in_epoch": 3}, {"batches_in_epoch": 1}
    fresh = decide_resume(_result("fresh", None), insurance_state=ins, framework_insurance=False)
    assert fresh.state is None and not fresh.framework_loads and fresh.data_position is None
    restored = decide_resume(_result("restored", 7, snap), insurance_state=ins, framework_insurance=True)
    assert restored.state is snap and restored.in_memory and restored.data_position == DataPosition(None, 3)
    ours = decide_resume(_result("insurance", 6), insurance_state=ins, framework_insurance=False)
    assert ours.state is ins and not ours.in_memory and not ours.framework_loads
    theirs = decide_resume(_result("insurance", 6), insurance_state=None, framework_insurance=True)
    assert theirs.state is None and theirs.framework_loads
    with pytest.raises(NeighborCkptError, match="restored version carries no Lightning training state"):
        decide_resume(_result("insurance", 6), insurance_state=None, framework_insurance=False)
    with pytest.raises(NeighborCkptError, match="carries no Lightning training state"):
        decide_resume(_result("restored", 7, None), insurance_state=ins, framework_insurance=False)


def test_the_data_position_is_the_consumed_samples_counter_else_the_batches_of_the_epoch() -> None:
    assert DataPosition.of({"batches_in_epoch": 5, "consumed_samples": 40}) == DataPosition(consumed_samples=40)
    assert DataPosition.of({"batches_in_epoch": 5, "consumed_samples": None}) == DataPosition(batches_in_epoch=5)
    with pytest.raises(NeighborCkptError, match="carries no data position"):
        DataPosition.of({"fit_loop": {}})


def test_the_callback_state_keeps_release_0_1s_format_and_reads_it_back() -> None:
    from neighbor_ckpt.config import NeighborCkptConfig

    s = Session(NeighborCkptConfig())
    assert s.checkpoint_state() == {"training_state": None}
    s.last_state = {"fit_loop": {}, "schedulers": [], "rng": {}, "batches_in_epoch": 2}
    assert s.checkpoint_state() == {"training_state": s.last_state}
    release_0_1 = {"training_state": {"fit_loop": {"state_dict": {}}, "schedulers": [{}], "rng": {"torch": None},
                                      "batches_in_epoch": 4}}
    s.load_checkpoint_state(release_0_1)
    ours = decide_resume(_result("insurance", 6), insurance_state=s._loaded_state, framework_insurance=False)
    assert ours.state == release_0_1["training_state"] and ours.data_position == DataPosition(batches_in_epoch=4)
    s.load_checkpoint_state({"training_state": None})  # a checkpoint written before the first snapshot
    assert s._loaded_state is None


def test_own_insurance_loads_the_newest_file_and_keeps_the_state_it_carries(tmp_path: Path) -> None:
    from neighbor_ckpt.config import NeighborCkptConfig

    files = InsuranceFiles(tmp_path, every_n_steps=3)
    s = Session(NeighborCkptConfig())
    assert s.own_insurance(None, lambda p: None) is None and s.insurance is None
    loaded: list[Path] = []

    def load(path: Path) -> None:
        loaded.append(path)
        s.load_checkpoint_state({"training_state": {"batches_in_epoch": int(path.stem.rsplit("step", 1)[1])}})

    loader = s.own_insurance(files, load)
    assert loader is not None and s.insurance is files and s.insurance_due(6) and not s.insurance_due(7)
    assert loader() is None and loaded == []  # nothing written yet
    for step in (3, 6):
        files.path(step).write_bytes(b"x")
    assert loader() == 6 and loaded == [files.path(6)]
    assert s._loaded_state == {"batches_in_epoch": 6}
