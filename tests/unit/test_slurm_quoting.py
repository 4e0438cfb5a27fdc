"""The Slurm scripts ``neighbor-ckpt launch --slurm`` writes run the intended command only, whatever shell characters
a job name or run id holds (``;``, ``$()``, backquotes, quotes, spaces): every value of the job file or the command
line is quoted where it lands, and a line break, which no quoting keeps on its line, is refused.

Checked with ``bash -n`` and by running the scripts with a stub ``srun`` (and ``scontrol``) first on PATH: the stub
records the command each ``srun`` line runs; for the in-process script it runs the task script with its ``exec``
recorded instead of done. No file an injected command would make appears."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from neighbor_ckpt.cli import launch
from neighbor_ckpt.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "gpt_tiny_cpu.yaml"
NAME = "job; touch PWNED_NAME $(touch PWNED_SUB) `touch PWNED_BT` 'sq' \"dq\" end"
RUN_ID = "id $(touch PWNED_ID); touch PWNED_ID2 'a' \"b\" `touch PWNED_ID3`"

SRUN = r"""#!/bin/bash
# stub srun: record the command, run a task script with its exec recorded instead of done
printf '%s\0' "$@" > "$STUB_OUT/srun.argv"
last="${@: -1}"
if [ -f "$last" ] && [ "${last##*.}" = sh ]; then
    SLURM_PROCID=0 SLURM_NODEID=0 bash -c 'exec() { printf "%s\0" "$@" > "$STUB_OUT/exec.argv"; }; source "$1"' _ "$last"
fi
"""


def _plan(tmp: Path, *overrides: str) -> launch.LaunchPlan:
    return launch.plan_launch(CONFIG, [f"name={NAME}", f"neighbor_ckpt.job_id={RUN_ID}", *overrides],
                              run_dir=tmp / "run dir; $(touch PWNED_DIR)")


def _run(script: str, tmp: Path) -> tuple[list[str], list[str] | None]:
    """Run ``script`` with the stubs first on PATH, in ``tmp``; (srun's argv, the task's exec argv or None)."""
    stubs = tmp / "stubs"
    stubs.mkdir()
    (stubs / "srun").write_text(SRUN)
    (stubs / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    for f in stubs.iterdir():
        f.chmod(0o755)
    out = tmp / "stub_out"
    out.mkdir()
    path = tmp / "job.sbatch"
    path.write_text(script)
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", STUB_OUT=str(out), SLURM_JOB_NODELIST="localhost",
               PYTHONPATH=str(REPO))
    env.pop("NEIGHBOR_CKPT_STORE_DIR", None)
    proc = subprocess.run(["bash", str(path)], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    srun = (out / "srun.argv").read_text().split("\0")[:-1]
    exec_argv = (out / "exec.argv").read_text().split("\0")[:-1] if (out / "exec.argv").exists() else None
    return srun, exec_argv


def _no_injection(tmp: Path) -> None:
    made = sorted(str(p) for p in tmp.rglob("PWNED*")) + sorted(str(p) for p in Path.cwd().glob("PWNED*"))
    assert made == [], f"an injected command ran: {made}"


def _sbatch_values(script: str) -> list[str]:
    words = []
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            parsed = shlex.split(line[len("#SBATCH "):])
            assert len(parsed) == 1, line
            words.append(parsed[0])
    return words


def test_the_torchrun_script_quotes_the_job_name_and_run_id(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    assert plan.job.name == NAME and plan.run_id == RUN_ID
    script = launch.slurm_script(plan)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert f"--job-name={NAME}" in _sbatch_values(script)
    assert f"--output={plan.run_dir}/slurm-%j.out" in _sbatch_values(script)
    srun, _ = _run(script, tmp_path)
    _no_injection(tmp_path)
    assert f"--rdzv-id={RUN_ID}" in srun, srun
    assert srun[srun.index("--config") + 1] == str(plan.run_dir / "config.yaml"), srun


def test_the_inprocess_script_quotes_the_job_name_run_id_and_store_dir(tmp_path: Path) -> None:
    store = tmp_path / "store $(touch PWNED_STORE) ';x"
    plan = _plan(tmp_path, "neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=1",
                 f"neighbor_ckpt.store.dir={store}")
    script = launch.slurm_script(plan)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert f"--job-name={NAME}" in _sbatch_values(script)
    launch.write_run_dir(plan)
    srun, task = _run(script, tmp_path)
    _no_injection(tmp_path)
    assert task is not None, "the task script ran its launcher line"
    assert task[task.index("--run-id") + 1] == RUN_ID, task
    assert task[task.index("--store-root") + 1] == str(store), task
    assert task[task.index("--token-file") + 1] == str(plan.run_dir / "store.token"), task
    assert task[task.index("--node") + 1] == "node0", task


def test_the_default_store_dir_becomes_the_running_users(tmp_path: Path) -> None:
    plan = launch.plan_launch(CONFIG, ["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=1"],
                              run_dir=tmp_path / "run")
    script = launch.slurm_script(plan)
    assert "STORE_ROOT=/dev/shm/neighbor_ckpt-\"$(id -un)\"" in script, script


@pytest.mark.parametrize("field", ["name", "run_id"])
def test_a_line_break_in_a_value_is_refused(tmp_path: Path, field: str) -> None:
    """A job file can hold one (a quoted YAML string): it would end an #SBATCH line or the task's here-document."""
    plan = launch.plan_launch(CONFIG, [], run_dir=tmp_path / "run")
    if field == "name":
        plan = dataclasses.replace(plan, job=dataclasses.replace(plan.job, name="a\nTASK\ntouch PWNED"))
    else:
        plan = dataclasses.replace(plan, run_id="a\rb")
    with pytest.raises(ConfigError, match="line break") as err:
        launch.slurm_script(plan)
    assert ("name" if field == "name" else "job_id") in str(err.value)
