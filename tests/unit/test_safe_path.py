"""The Python children the library starts run without the working directory on ``sys.path``
(:func:`~neighbor_ckpt.runtime.procs.python_module_command`): a file planted in a shared working directory under the
name of a standard module or of ours is not imported by them (issue 53, item 7)."""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from neighbor_ckpt.runtime import procs
from neighbor_ckpt.runtime.procs import python_code_command, python_module_command

REPO = Path(__file__).resolve().parents[2]
LIBRARY = REPO / "neighbor_ckpt"


def _is_sys_executable(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "executable" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def test_every_python_child_of_the_library_is_built_by_the_helper() -> None:
    """``sys.executable`` appears in the library only in the helper, and where a worker runs a script
    (``[..., sys.executable, "-u", SCRIPT, ...]``: the script's own directory comes first on its path, not the
    working directory); never as ``python -m``/``-c``, in a list or in a shell script's text."""
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if path == LIBRARY / "runtime" / "procs.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        allowed = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.List, ast.Tuple)):
                for first, second in zip(node.elts, node.elts[1:]):
                    if _is_sys_executable(first) and isinstance(second, ast.Constant) and second.value == "-u":
                        allowed.add(id(first))
        found += [f"{path.relative_to(REPO)}:{node.lineno}" for node in ast.walk(tree)
                  if _is_sys_executable(node) and id(node) not in allowed]
    assert not found, ("start a Python child through neighbor_ckpt.runtime.procs.python_module_command "
                       f"(or python_code_command), not sys.executable: {found}")


def test_the_helper_runs_the_module_with_safe_path_where_python_has_it() -> None:
    if sys.version_info < (3, 11):
        assert python_module_command("a.b")[1] == "-c" and "-P" not in python_code_command("pass")
        return
    assert python_module_command("a.b", "--x", "1") == [sys.executable, "-P", "-m", "a.b", "--x", "1"]
    assert python_code_command("pass", "y") == [sys.executable, "-P", "-c", "pass", "y"]


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path]:
    """A working directory holding a ``neighbor_ckpt`` package and a ``json`` module of someone else's, each
    leaving a mark when imported."""
    mark = tmp_path / "imported"
    code = f"open({str(mark)!r}, 'a').write(__name__ + '\\n')\n"
    cwd = tmp_path / "shared"
    (cwd / "neighbor_ckpt").mkdir(parents=True)
    (cwd / "neighbor_ckpt" / "__init__.py").write_text(code)
    (cwd / "json.py").write_text(code)
    return cwd, mark


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("safe_path_flag", [
    pytest.param(True, id="-P", marks=pytest.mark.skipif(sys.version_info < (3, 11), reason="-P: Python 3.11")),
    pytest.param(False, id="python3.10-form")])
def test_a_child_imports_neither_a_planted_module_nor_a_planted_package_of_ours(
        planted: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, safe_path_flag: bool) -> None:
    """Both forms of the command (``-P``, and the program Python 3.10 runs instead, which runs on any version) start
    the real module of the installed package, with its arguments, from a working directory that holds impostors."""
    cwd, mark = planted
    monkeypatch.setattr(procs, "SAFE_PATH_FLAG", safe_path_flag)
    ran = _run(python_module_command("neighbor_ckpt.runtime.netns", "--help"), cwd)
    assert ran.returncode == 0 and "usage: python -m neighbor_ckpt.runtime.netns" in ran.stdout, ran.stderr
    code = "import json, sys, neighbor_ckpt; print(sys.argv[1:], neighbor_ckpt.__file__)"
    ran = _run(python_code_command(code, "a", "b"), cwd)
    assert ran.returncode == 0 and ran.stdout.strip() == f"['a', 'b'] {LIBRARY / '__init__.py'}", ran.stderr
    assert not mark.exists(), f"imported from the working directory: {mark.read_text()}"
    if not safe_path_flag:
        main = "import sys; print(sys.argv)"  # -m's argv: the module's file, then its arguments
        (cwd.parent / "mod_argv.py").write_text(main)
        ran = _run(python_module_command("mod_argv", "x"), cwd.parent)
        assert ran.returncode != 0 and "No module named mod_argv" in ran.stderr, "its own directory is not searched"
        monkeypatch.setenv("PYTHONPATH", str(cwd.parent))
        ran = subprocess.run(python_module_command("mod_argv", "x"), cwd=cwd, capture_output=True, text=True,
                             timeout=60)
        assert ran.stdout.strip() == str([str(cwd.parent / "mod_argv.py"), "x"]), ran.stderr


def test_without_the_helper_the_planted_package_would_be_imported(planted: tuple[Path, Path]) -> None:
    """What the helper is for: plain ``python -m`` imports the working directory's ``neighbor_ckpt`` and ``json``."""
    cwd, mark = planted
    _run([sys.executable, "-m", "neighbor_ckpt.runtime.netns", "--help"], cwd)
    assert set(mark.read_text().split()) == {"neighbor_ckpt", "json"}


def test_the_launch_plans_start_their_children_with_safe_path(tmp_path: Path) -> None:
    """The commands the launch planners build (the in-process launchers, torchrun on one node and per simulated
    node, the Slurm scripts' interpreters) all go through the helper."""
    from neighbor_ckpt.cli import launch

    head = python_module_command(launch.LAUNCHER)
    config = REPO / "configs/gpt_tiny_cpu.yaml"
    inproc = launch.plan_launch(config, ["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=1"],
                                run_dir=tmp_path / "a")
    cmds = [list(cmd) for cmd, _ in launch.inprocess_processes(inproc, store_port=29650,
                                                                store_root=tmp_path / "shm").agents]
    assert cmds and all(cmd[:len(head)] == head for cmd in cmds)
    restart = launch.plan_launch(config, run_dir=tmp_path / "b")
    torchrun = python_module_command("torch.distributed.run")
    assert launch.torchrun_command(restart)[:len(torchrun)] == torchrun
    nodes = launch.plan_launch(config, ["trainer.num_nodes=2", "trainer.devices=2"], run_dir=tmp_path / "c")
    agents = launch.torchrun_nodes(nodes, endpoint="127.0.0.1:1", store_root=tmp_path / "store").agents
    assert len(agents) == 2 and all(list(cmd[:len(torchrun)]) == torchrun for cmd, _ in agents)
    script = launch.slurm_script(restart)
    assert f"srun --kill-on-bad-exit=0 {shlex.join(torchrun)} " in script
    assert f"$({shlex.join(python_code_command('import uuid; print(uuid.uuid4().hex)'))})" in script
    script = launch.slurm_script(inproc)
    assert shlex.join(python_module_command("neighbor_ckpt.inprocess.store_auth")) in script
    assert f"exec {shlex.join(head)} " in script
    if sys.version_info >= (3, 11):
        assert f"{shlex.quote(sys.executable)} -P -m torch.distributed.run" in launch.slurm_script(restart)
