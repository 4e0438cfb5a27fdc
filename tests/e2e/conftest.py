"""Fixtures of the end-to-end tests: ``slurm_cluster``, a real single-node Slurm for the whole session
(tests/e2e/slurm_cluster.py), started the first time a test asks for it."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.e2e.slurm_cluster import SlurmCluster, install


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
