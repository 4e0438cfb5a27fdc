"""Fixtures of the end-to-end tests: ``slurm_cluster``, a real single-node Slurm for the whole session
(tests/e2e/slurm_cluster.py), started the first time a test asks for it; ``inprocess_baseline``, the failure-free
in-process launch the in-process tests of several files compare with (computed once per session)."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.conftest import RunResult, warm_workers
from tests.e2e.inprocess_launch import assert_no_orphans, failures, launch_inprocess
from tests.e2e.slurm_cluster import SlurmCluster, install


@pytest.fixture(scope="session")
def inprocess_baseline(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The test worker (tests/workers/train_mcore_inprocess.py) in process, 4 ranks + 1 hot spare, 10 steps, no
    fault: what test_inprocess_recovery.py, test_store_failover.py and test_staged_slot_leak.py compare with."""
    with warm_workers():
        res = launch_inprocess(tmp_path_factory.mktemp("inproc-base"), STEPS=10, FAULT="none")
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    assert failures(res) == [], f"a failure-free run detected a failure: {failures(res)}"
    return res


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """munged + slurmctld + slurmd on this machine (node ``hostname -s``, partition ``debug``), stopped at the end
    of the session; the packages are installed first when missing (``scripts/setup --slurm-only``), and the tests
    that need it are skipped only when that cannot be done."""
    why = install()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
