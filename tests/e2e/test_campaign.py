"""The fault campaign's CI subset: the damaged-snapshot kinds through ``neighbor-ckpt campaign`` itself (each a
real torchrun job of the mcore recipe, SIGKILL, restart, comparison with the failure-free run). The other kinds run
in CI as dedicated tests: kill in forward / optimizer step with a replaced store (test_mcore_recovery.py, NeMo and
Lightning suites), hangs (test_mcore_recovery.py::test_hung_rank_*), a bit flip under Lightning."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from neighbor_ckpt.bench import campaign

pytestmark = pytest.mark.e2e
pytest.importorskip("megatron.core")


def test_campaign_of_damaged_snapshots_resumes_exactly_every_time(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The killed rank restarts to find its newest own snapshot bit-flipped, cut short, or with a garbled header:
    each is refused with a typed error, the replica on its successor is used instead, and the job resumes bit for
    bit."""
    rc = campaign.main(["--faults", "3", "--seed", "3", "--steps", "6", "--out", str(tmp_path),
                        "--kinds", "kill-bitflip,kill-truncate,kill-bad-header"])
    out = capsys.readouterr().out
    outcomes = [json.loads(line) for line in (tmp_path / "outcomes.jsonl").read_text().splitlines()]
    assert rc == 0, out
    assert [o["case"]["kind"] for o in outcomes] == ["kill-bitflip", "kill-truncate", "kill-bad-header"]
    assert all(o["result"] == "exact" for o in outcomes), outcomes
    assert "| all | 3 | 3 | 0 | 0 |" in out
    for o in outcomes:
        c = o["case"]
        log = (tmp_path / f"case{c['index']:04d}-{c['kind']}-r{c['rank']}-s{c['step']}" / "torchrun.log").read_text()
        assert "chaos:" in log, f"{c['kind']}: the damage was not done"
        assert re.search(rf"rank {c['rank']}: (own slot \d is not usable|ignoring unusable slot file)", log), \
            f"{c['kind']}: the damage was not noticed"
        assert f"rank {c['rank']}: neighbor_ckpt restored iteration" in log and "from the replica on its successor" in log
