"""End to end, liveness from the kernel (:mod:`neighbor_ckpt.inprocess.kernel_liveness`): a launcher vouches for its
processes by what the kernel says of them, not by their Python heartbeat.

The layout of ``test_inprocess_recovery.py`` (4 active ranks + 1 hot spare, a simulated node per process, the plain
megatron-core loop of ``tests/workers/train_mcore_inprocess.py``), compared bit for bit with its failure-free run
(the session's ``inprocess_baseline``). In step 5's optimizer step, rank 1:

* holds the GIL in its main thread for 4 s (``FAULT=gil``), longer than ``detector.timeout_s`` + ``interval_s``
  (2.2 s) and shorter than ``detector.hang_timeout_s`` (10 s here): its heartbeat thread is starved, but its launcher
  vouches it running in the kernel, so nobody declares it; no generation fails, nobody is replaced;
* SIGSTOPs its node's launcher and waits in a C call (``FAULT=stop_launcher``), its heartbeat beating on: a node whose
  launcher is quiet is lost whole (nobody there vouches for its processes, sees their exits or kills them); the spare
  takes rank 1, the stopped launcher is ended once the job completed.

(A SIGSTOPped rank, found by its launcher or its ring successor within ``timeout_s`` + ``interval_s``:
``test_inprocess_recovery.py``.) No wall-clock limit is asserted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import RunResult, assert_same_training
from tests.e2e.inprocess_launch import (assert_no_orphans, attempts, failures, launch_inprocess, launcher_exits,
                                        timeline)

pytestmark = pytest.mark.e2e

ACTIVE = 4
HANG_TIMEOUT = 10
"""``detector.hang_timeout_s`` of these runs: above the GIL's hold and above the time a quiet launcher takes to cost
its node (2 x ``detector.timeout_s`` and a round), so that neither is taken for a hang."""


def test_a_process_whose_heartbeat_thread_is_starved_of_the_gil_is_not_declared_and_the_run_is_bit_exact(
        inprocess_baseline: RunResult, tmp_path: Path) -> None:
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="gil", KILL_RANK=1, KILL_STEP=5, HOLD_GIL_S=4,
                           HANG_TIMEOUT=HANG_TIMEOUT)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    held = re.search(r"rank 1 held the GIL for ([0-9.]+) s", res.log)
    assert held and float(held.group(1)) > 2.0 + 0.2, "the hold must outlast detector.timeout_s + interval_s"
    assert re.search(r"process 1 sent no heartbeat for [0-9.]+ s \(detector.timeout_s 2\), but its launcher vouches "
                     r"it running in the kernel: not declared", res.log), res.log[-8000:]
    assert failures(res) == [], f"no generation may fail: {failures(res)}"
    assert "cut off from the majority" not in res.log, "the starved process must not cut itself off either"
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    gens = {(a["initial_rank"], a["iteration"]) for a in attempts(res)}
    assert gens == {(p, 0) for p in range(ACTIVE)}, f"every rank kept its process, nobody re-formed: {gens}"
    assert set(launcher_exits(res).values()) == {0}, launcher_exits(res)


def test_a_sigstopped_launcher_costs_its_whole_node_and_the_spare_takes_its_rank_bit_exact(
        inprocess_baseline: RunResult, tmp_path: Path) -> None:
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="stop_launcher", KILL_RANK=1, KILL_STEP=5,
                           HANG_TIMEOUT=HANG_TIMEOUT)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert "node node1 is lost: its launcher sent no beat for" in res.log, res.log[-8000:]
    assert "declaring its process(es) [1] dead together" in res.log
    assert {g for g, _, _ in failures(res)} == {0} and ("silent", "process 2") in {(k, w) for _, k, w in failures(res)}
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    procs: dict[int, list] = {}
    for a in attempts(res):
        procs.setdefault(a["initial_rank"], []).append((a["iteration"], a["rank"]))
    assert sorted(procs[ACTIVE]) == [(1, 1)], f"the spare takes rank 1: {procs}"
    assert sorted(procs[1]) == [(0, 1)], procs
    for p in (0, 2, 3):
        assert sorted(procs[p]) == [(0, p), (1, p)], f"process {p} kept its rank: {procs}"
    assert re.search(r"process 1: declared dead by the others \(silent: node node1 is lost", res.log), \
        "the stopped launcher's process, still running, is fenced"
    assert launcher_exits(res)["node1"] == -9, launcher_exits(res)
    assert "is still stopped (its node hung for good): SIGKILL" in res.log
    tl = timeline(res, "0.1")
    assert tl["mode"] == "in-process" and tl["spare_ranks"] == [1], tl
    assert tl["detect_from"].startswith("the fault: last beat of node node1's launcher"), tl["detect_from"]
