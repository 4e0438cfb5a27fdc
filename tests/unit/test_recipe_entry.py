"""The entry the NeMo and Megatron-Bridge recipes share (neighbor_ckpt.recipes.entry): one command line, the job file
loaded and validated before any framework is imported."""

from __future__ import annotations

from pathlib import Path

import pytest

from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.recipes import CONFIGS_DIR
from neighbor_ckpt.recipes.entry import start_recipe

HELP = dict(description="d", run_dir_help="r", record_help="x", log_format="%(message)s")


@pytest.mark.parametrize("nemo", [True, False])
def test_both_recipes_take_the_same_command_line_and_load_the_job_file(tmp_path: Path, nemo: bool) -> None:
    # a GPU job file: nothing is patched for CPU in this process
    job, args = start_recipe(["--config", str(CONFIGS_DIR / "llama3_8b.yaml"), "--run-dir", str(tmp_path),
                              "--record", "--inprocess-store", "h:1"], nemo=nemo, **HELP)
    assert job.trainer.accelerator == "gpu" and job.model.preset == "llama3_8b"
    assert (args.run_dir, args.record, args.inprocess_store) == (tmp_path, True, "h:1")
    _, plain = start_recipe(["--config", str(CONFIGS_DIR / "llama3_8b.yaml"), "--run-dir", str(tmp_path)],
                            nemo=nemo, **HELP)
    assert not plain.record and plain.inprocess_store is None


def test_a_missing_job_file_is_refused_before_any_framework_starts(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        start_recipe(["--run-dir", str(tmp_path)], nemo=True, **HELP)
    with pytest.raises(ConfigError):
        start_recipe(["--config", str(tmp_path / "none.yaml"), "--run-dir", str(tmp_path)], nemo=True, **HELP)
