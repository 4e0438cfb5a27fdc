"""``runtime.procs.stall_report``: a block that takes too long names where every thread is, once, then calls the
caller's way out; a block that returns in time says nothing."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from neighbor_ckpt.runtime.procs import stall_report

log = logging.getLogger("test-stall")


def _blocked_here(release: threading.Event) -> None:
    release.wait(120)


def test_a_block_that_overruns_logs_every_threads_stack_then_calls_then(caplog: pytest.LogCaptureFixture) -> None:
    release, called = threading.Event(), threading.Event()
    other = threading.Thread(target=_blocked_here, args=(release,), name="the-other-thread", daemon=True)
    other.start()
    with caplog.at_level(logging.WARNING, logger="test-stall"):
        with stall_report("the clean-up", 0.05, log, then=called.set):
            assert called.wait(120), "then() runs after the report, while the block still runs"
    release.set()
    other.join()
    (rec,) = [r for r in caplog.records if "has taken more than" in r.getMessage()]
    text = rec.getMessage()
    assert text.startswith("the clean-up has taken more than 0.05 s")
    assert "--- thread the-other-thread" in text and "in _blocked_here" in text
    assert "--- thread MainThread" in text


def test_a_block_that_returns_in_time_reports_nothing(caplog: pytest.LogCaptureFixture) -> None:
    called = []
    with caplog.at_level(logging.WARNING, logger="test-stall"):
        with stall_report("quick", 5.0, log, then=lambda: called.append(1)):
            time.sleep(0.01)
    assert not caplog.records and not called
    assert not [t for t in threading.enumerate() if t.name == "neighbor_ckpt-stall-report"], "the watcher ended"
