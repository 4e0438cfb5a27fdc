"""The wheel, installed outside the checkout (non-editable, ``pip install --target``), runs ``neighbor-ckpt launch`` of
a shipped tiny job file named by its bare name: a few NeMo steps on 2 CPU ranks under torchrun, from the installed
package and the installed recipe, never the checkout's (whose editable install is in this virtualenv too). The
wheel holds no benchmark or campaign module. Workers start cold: the warm zygote holds the checkout's modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from neighbor_ckpt.cli.launch import WORKER_PREFIX_ENV
from tests.conftest import RunResult, run_logged
from tests.warm.client import SOCKET_ENV as WARM_SOCKET_ENV
from tests.wheel import REPO, build_wheel, tool_names, wheel_names

pytestmark = [pytest.mark.e2e, pytest.mark.cold]
pytest.importorskip("nemo.collections.llm")

STEPS = 3
RANKS = 2


def _installed(tmp: Path) -> Path:
    wheel = build_wheel(tmp / "build")
    assert not tool_names(wheel_names(wheel)), tool_names(wheel_names(wheel))
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
                    "--target", str(site), str(wheel)], check=True, capture_output=True, timeout=600)
    return site


def _env(site: Path, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (WORKER_PREFIX_ENV, WARM_SOCKET_ENV, "PYTHONPATH")}
    env.update(PYTHONPATH=str(site), NEIGHBOR_CKPT_STORE_DIR=str(tmp / "store"), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    return env


def test_an_installed_wheel_launches_a_shipped_config_by_name_with_its_own_recipe(tmp_path: Path) -> None:
    site = _installed(tmp_path)
    assert not (site / "tools").exists() and (site / "bin" / "neighbor-ckpt").is_file()
    work = tmp_path / "elsewhere"  # cwd and everything the run writes: outside the checkout
    work.mkdir()
    env = _env(site, tmp_path)
    where = subprocess.run([sys.executable, "-c", "import neighbor_ckpt, megatron_patches, neighbor_ckpt.recipes as r; "
                            "print(neighbor_ckpt.__file__); print(megatron_patches.__file__); print(r.RECIPES_DIR)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert len(where) == 3 and all(Path(p).resolve().is_relative_to(site.resolve()) for p in where), where
    assert not any(Path(p).resolve().is_relative_to(REPO) for p in where), "the checkout's editable install won"

    # every worker's command line, recorded by a prefix the launcher runs each worker under
    argv_log = tmp_path / "workers.argv"
    prefix = tmp_path / "record_argv.sh"
    prefix.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {argv_log}\nexec "$@"\n')
    prefix.chmod(0o755)
    env[WORKER_PREFIX_ENV] = str(prefix)
    run_dir = work / "run"
    cmd = [str(site / "bin" / "neighbor-ckpt"), "launch", "gpt_tiny_cpu", f"trainer.max_steps={STEPS}",
           f"trainer.devices={RANKS}", "--run-dir", str(run_dir), "--record"]
    res = run_logged(cmd, work, run_dir / "record", timeout=900, env=env)
    assert res.returncode == 0, res.log[-6000:]

    recipe = site.resolve() / "neighbor_ckpt" / "recipes" / "nemo_pretrain.py"
    assert f"recipe {recipe};" in res.log, res.log[:2000]
    workers = argv_log.read_text().splitlines()
    assert len(workers) == RANKS, workers  # no restart
    for line in workers:
        assert f" {recipe} --config {run_dir / 'config.yaml'} " in f"{line} ", line
        assert f"{REPO}/neighbor_ckpt" not in line and f"{REPO}/recipes" not in line, line
    assert "name: gpt_tiny_cpu" in (run_dir / "config.yaml").read_text()
    losses = RunResult(0, run_dir / "record", res.log).losses()
    assert sorted(losses) == list(range(RANKS))
    assert all(sorted(steps) == list(range(STEPS)) for steps in losses.values()), losses
