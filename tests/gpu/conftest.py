"""Fixtures of the GPU tier (``-m gpu``; every test here is skipped with "needs CUDA" on a machine without it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import torch

CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs CUDA: torch.cuda.is_available() is False on this machine")
"""Every module of this tier: ``pytestmark = [pytest.mark.gpu, CUDA_ONLY]``."""


@contextlib.contextmanager
def _shm_tempdir(fallback: Path) -> Iterator[Path]:
    base = Path("/dev/shm")
    if not (base.is_dir() and os.access(base, os.W_OK)):
        yield fallback
        return
    d = Path(tempfile.mkdtemp(prefix="nckpt-gpu-test-", dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A private, empty directory on /dev/shm (tmpfs, where real host stores live: page-locking a slot of a
    disk-backed file may be refused by the kernel), removed afterwards; ``tmp_path`` where /dev/shm is unusable."""
    with _shm_tempdir(tmp_path) as d:
        yield d


@pytest.fixture(scope="module")
def shm_module_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """:func:`shm_dir` shared by a module (for its baseline runs)."""
    with _shm_tempdir(tmp_path_factory.mktemp("store")) as d:
        yield d


def on_tmpfs(path: Path) -> bool:
    """Whether ``path`` is under /dev/shm (registration with CUDA is expected to succeed there)."""
    return Path(path).resolve().is_relative_to(Path("/dev/shm").resolve())
