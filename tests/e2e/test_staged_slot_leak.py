"""No staged slot outlives its hot spare: an idle spare stages a full own slot in its node's ``/dev/shm`` store
(``<store>/<user>/<job>/staged-<pid>.own.slot``, :func:`~neighbor_ckpt.snapshot.store.stage_own_slot`) and, once
SIGKILLed, runs no clean-up of its own; its launcher removes the file when it sees the spare exit, and every launcher
removes what its processes staged when it exits itself. Real in-process launch (tests/e2e/inprocess_launch.py), real
SIGKILL."""

from __future__ import annotations

import re
from pathlib import Path

from tests.e2e.inprocess_launch import assert_no_orphans, launch_inprocess

ACTIVE = 4


def test_an_idle_spare_sigkilled_leaves_no_staged_slot(tmp_path: Path) -> None:
    res = launch_inprocess(tmp_path, STEPS=6, FAULT="none", KILL_IDLE_SPARE_AT_STEP=2, KILL_IDLE_SPARE_WHEN_STAGED=1)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert (res.out / f"fault.spare{ACTIVE}.json").exists(), res.log[-8000:]
    # the spare had staged its slot when it was killed, and its launcher removed that file
    assert re.search(r"removed \S+/staged-\d+\.own\.slot, staged by process \d+, which exited", res.log), \
        res.log[-8000:]
    left = sorted(str(p) for p in (tmp_path / "store").rglob("staged-*"))
    assert left == [], left
