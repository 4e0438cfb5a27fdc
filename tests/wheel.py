"""Build the project's wheel from a copy of this checkout (never in the checkout itself: an in-tree build writes
``build/`` and the egg-info there, under other runs' feet) and read what it holds."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "neighbor_ckpt", "megatron_patches", "tools", "recipes",
           "configs")
"""What the build sees of the checkout: the packaging files, the library, and what must stay out of the wheel
(``tools``; ``recipes`` and ``configs``, links into the package, copied as links)."""


def build_wheel(work: Path) -> Path:
    """Build the wheel with this interpreter's setuptools (no build isolation, no index) from a copy of the checkout
    under ``work``; returns its path."""
    src = work / "src"
    src.mkdir(parents=True)
    for name in SOURCES:
        path = REPO / name
        if path.is_symlink() or path.is_file():
            shutil.copy2(path, src / name, follow_symlinks=False)
        elif path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    dist = work / "dist"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--disable-pip-version-check", "-w", str(dist), str(src)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"pip wheel failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    (wheel,) = dist.glob("neighbor_ckpt-*.whl")
    return wheel


def wheel_names(wheel: Path) -> list[str]:
    """Every file name in the wheel."""
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def tool_names(names: list[str]) -> list[str]:
    """The names in ``names`` that are benchmark, campaign or other ``tools`` modules."""
    return [n for n in names if n.startswith("tools/") or "/bench/" in n or "campaign" in n.rsplit("/", 1)[-1]]
