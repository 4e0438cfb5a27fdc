"""Process hygiene for the harnesses that launch whole jobs (the fault campaign, the end-to-end tests).

torchrun starts every worker in a session of its own, so killing the launcher's process group at the end of a run
does not reach what the workers started (megatron-core's ``multiprocessing`` Manager servers, NeMo's checkpoint
writers), and a worker that was killed leaves those running, ~200 MB each. A harness marks a run with an
environment variable every descendant inherits, and stops whatever still carries it afterwards.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

__all__ = ["RUN_TAG_ENV", "new_run_tag", "kill_tagged"]

RUN_TAG_ENV = "NEIGHBOR_CKPT_HARNESS_RUN"


def new_run_tag() -> str:
    return uuid.uuid4().hex


def kill_tagged(tag: str) -> int:
    """SIGKILL every process (of this user) whose environment has ``RUN_TAG_ENV=tag``; returns how many."""
    needle = f"{RUN_TAG_ENV}={tag}".encode()
    me, killed = os.getpid(), 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):
            continue
    return killed
