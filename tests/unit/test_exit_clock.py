"""A launcher times its children's exits as the kernel reports them (one process, real child processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from neighbor_ckpt.inprocess.exit_clock import ExitClock

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfds (Linux 5.3, Python 3.9)")


def test_a_killed_child_is_timed_when_it_died_not_when_it_is_reaped() -> None:
    clock = ExitClock()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        clock.watch(child.pid)
        clock.watch(other.pid)
        killed_at = time.time()
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120  # the event checked, with a generous bound (a loaded machine)
        while clock.seen(child.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        seen = clock.seen(child.pid)
        assert seen is not None, "the exit of a killed child was not timed within 120 s"
        time.sleep(0.2)  # reaped well after it died: the time stays the kernel's
        child.wait()
        assert killed_at <= seen <= time.time() - 0.2
        assert clock.seen(other.pid) is None, "a child still running has no exit time"
        assert clock.seen(12345678) is None, "a process never watched has none"
    finally:
        for p in (child, other):
            p.kill()
            p.wait()
        clock.close()
