"""No staged slot outlives its hot spare: an idle spare stages a full own slot in its node's ``/dev/shm`` store
(``<store>/<user>/<job>/staged-<pid>.own.slot``, :func:`~neighbor_ckpt.snapshot.store.stage_own_slot`) and, once
SIGKILLed, runs no clean-up of its own; its launcher removes the file when it sees the spare exit, and every launcher
removes what its processes staged when it exits itself. Real in-process launch (tests/e2e/inprocess_launch.py), real
SIGKILL."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import RunResult, assert_same_training
from tests.e2e.inprocess_launch import assert_no_orphans, failures, launch_inprocess, launcher_exits
from tests.e2e.test_inprocess_recovery import ACTIVE, by_process

pytestmark = [pytest.mark.e2e,
              pytest.mark.cold]  # a warm fork's own pid names its staged file, not its launcher's child's


def test_an_idle_spare_sigkilled_is_reported_leaves_no_staged_slot_and_the_job_goes_on_untouched(
        inprocess_baseline: RunResult, tmp_path: Path) -> None:
    """The hot spare (process 4) SIGKILLed while idle, once it staged its slot, after rank 0's step 2. Its launcher
    reports the death; an idle spare's death fails no generation: the four active ranks train on in generation 0,
    bit for bit, and the log says the spare was lost."""
    res = launch_inprocess(tmp_path, STEPS=10, FAULT="none", KILL_IDLE_SPARE_AT_STEP=2, KILL_IDLE_SPARE_WHEN_STAGED=1)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert (res.out / f"fault.spare{ACTIVE}.json").exists(), res.log[-8000:]
    assert_same_training(inprocess_baseline, res, nranks=ACTIVE)
    assert re.search(rf"idle spare\(s\) \[{ACTIVE}\] lost \(.*\): the job goes on without them", res.log), \
        res.log[-8000:]
    assert not failures(res), f"no generation failed: {failures(res)}"
    procs = by_process(res)
    assert sorted(procs) == list(range(ACTIVE)) and all([a["iteration"] for a in procs[p]] == [0] for p in procs)
    assert "in-process recovery gives up" not in res.log
    assert set(launcher_exits(res).values()) == {0}, launcher_exits(res)
    # the spare had staged its slot when it was killed, and its launcher removed that file
    assert re.search(r"removed \S+/staged-\d+\.own\.slot, staged by process \d+, which exited", res.log), \
        res.log[-8000:]
    left = sorted(str(p) for p in (tmp_path / "store").rglob("staged-*"))
    assert left == [], left
