"""The micro-benchmark's hot-path section (issue 16) measures what it says, on a few steps."""

from __future__ import annotations

from tools.bench.micro.hotpath import STATES, hotpath_rows


def test_hotpath_times_both_states_as_informational_rows_and_removes_its_stores(tmp_path):
    rows, res = hotpath_rows(tmp_path, 2, warmup=1)
    assert list(res) == list(STATES)
    assert res["tiny GPT (159 tensors)"]["tensors"] == 159 and res["1,000 tensors of 1 KiB"]["tensors"] == 1000
    for r in res.values():
        # no order between the timings: two steps on a loaded machine (the engine once measured under the copy)
        assert r["snapshot_ms"] > 0 and r["engine_ms"] > 0 and r["copy_ms"] > 0 and r["overhead_ms"] >= 0
    assert len(rows) == 2 * len(STATES) and {r.unit for r in rows} == {"us"}
    assert all(r.status == "INFO" for r in rows)
    assert not list(tmp_path.rglob("*.slot")), "the benchmark's stores are removed"
