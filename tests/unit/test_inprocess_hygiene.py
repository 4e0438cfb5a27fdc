"""neighbor_ckpt.inprocess.hygiene: the comparison on made-up states, and the check on this process (a leaked
thread fails it, a clean state passes)."""

from __future__ import annotations

import threading

import pytest

from neighbor_ckpt.inprocess.hygiene import (HygieneBaseline, ProcessState, check, compare, rss_allowance)

MiB = 1 << 20


def _state(*threads: str, rss_mib: float = 1000, cuda: int | None = None) -> ProcessState:
    return ProcessState(tuple(sorted(threads)), int(rss_mib * MiB), cuda)


def test_same_threads_and_small_growth_are_clean() -> None:
    base = _state("MainThread", "neighbor_ckpt-monitor")
    res = compare(base, _state("MainThread", "neighbor_ckpt-monitor", rss_mib=1040), generations_done=1)
    assert res.ok and res.problems == () and res.rss_growth_bytes == 40 * MiB
    assert "process clean" in res.summary()


def test_a_leaked_or_vanished_thread_fails_unless_its_prefix_is_allowed() -> None:
    base = _state("MainThread", "Thread-1 (feeder)")
    now = _state("MainThread", "Thread-7 (gloo_ring)", "neighbor_ckpt-abort-watchdog")
    res = compare(base, now, generations_done=1, allowed_prefixes=("neighbor_ckpt-",))
    assert not res.ok
    assert res.extra_threads == ("Thread-7 (gloo_ring)",) and res.missing_threads == ("Thread-1 (feeder)",)
    assert "threads left running: Thread-7 (gloo_ring)" in res.summary()
    # names are a multiset: a second thread of the same name is a leak too
    twice = compare(_state("MainThread", "w"), _state("MainThread", "w", "w"), generations_done=1)
    assert twice.extra_threads == ("w",)


def test_resident_memory_may_grow_50_mib_over_five_generations() -> None:
    """Up to 50 MiB in total over the first five failed generations (whenever it happens), then 10 MiB more per
    generation: a steady leak above 10 MiB per failure is caught within five."""
    assert [rss_allowance(g) // MiB for g in (0, 1, 5, 6, 10)] == [50, 50, 50, 60, 100]
    base = _state("MainThread")
    assert compare(base, _state("MainThread", rss_mib=1050), generations_done=1).ok  # a one-off growth
    res = compare(base, _state("MainThread", rss_mib=1051), generations_done=1)
    assert not res.ok and "resident memory grew 51.0 MiB, more than the 50.0 MiB allowed" in res.summary()
    leak = [compare(base, _state("MainThread", rss_mib=1000 + 12 * g), generations_done=g).ok for g in range(1, 8)]
    assert leak == [True, True, True, True, False, False, False]  # 12 MiB per failure: out at the fifth
    assert compare(base, _state("MainThread", rss_mib=900), generations_done=3).ok  # shrinking is fine
    assert not compare(base, _state("MainThread", rss_mib=1030), generations_done=1, rss_limit_bytes=20 * MiB).ok


def test_cuda_memory_must_be_back_to_the_baseline() -> None:
    base = _state("MainThread", cuda=4096)
    assert compare(base, _state("MainThread", cuda=4096), generations_done=1).ok
    res = compare(base, _state("MainThread", cuda=4096 + 3 * MiB), generations_done=1)
    assert not res.ok and res.cuda_growth_bytes == 3 * MiB and "CUDA memory still allocated: 3.0 MiB" in res.summary()
    assert compare(base, _state("MainThread", cuda=4096 + 100), generations_done=1, cuda_slack_bytes=100).ok
    assert compare(_state("MainThread"), _state("MainThread"), generations_done=1).cuda_growth_bytes == 0


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="rss_window >= 1"):
        compare(_state(), _state(), generations_done=1, rss_window=0)
    with pytest.raises(ValueError):
        compare(_state(), _state(), generations_done=-1)


def test_check_on_this_process_fails_on_a_leaked_thread_and_passes_once_it_is_gone() -> None:
    baseline = HygieneBaseline.capture()
    assert threading.current_thread().name in baseline.thread_names and baseline.rss_bytes > 0
    assert check(baseline, 1).ok
    stop = threading.Event()
    leaked = threading.Thread(target=stop.wait, name="leaked-by-generation-0", daemon=True)
    leaked.start()
    try:
        res = check(baseline, 1)
        assert not res.ok and res.extra_threads == ("leaked-by-generation-0",)
        assert check(baseline, 1, allowed_prefixes=("leaked-",)).ok
    finally:
        stop.set()
        leaked.join(120)
    assert check(baseline, 1).ok
