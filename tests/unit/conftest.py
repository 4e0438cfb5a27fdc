"""Fixtures of the one-process tests."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture()
def group(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()
