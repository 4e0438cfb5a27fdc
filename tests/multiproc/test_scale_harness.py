"""``python -m tools.bench --scale`` at a tiny size (2 nodes of 8 simulated processes): the real store hosts and the
real client code run, and the document has the keys its readers compare (no figure is judged: a benchmark's
timings are not a test's). Also the harness's pure parts: what one store operation weighs, who is who in a layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.scale import RECORD_KEYS, Layout
from tools.bench.scale_count import measure

pytestmark = pytest.mark.multiproc

REPO = Path(__file__).resolve().parents[2]


def test_an_operation_weighs_its_keys_and_payload() -> None:
    assert measure("check", (["a/hb/1", "a/hb/2"],), True) == (2, 13)
    assert measure("multi_get", (["k1", "k2"],), [b"xyz", b"w"]) == (2, 8)
    assert measure("set", ("k", "value"), None) == (1, 6)
    assert measure("compare_set", ("k", "", "new"), b"new") == (1, 7)
    assert measure("multi_set", (["k1", "k2"], ["a", "b"]), None) == (2, 6)


def test_the_layout_keeps_the_victims_apart_from_the_detectors() -> None:
    lay = Layout(nodes=8, per_node=8)
    assert lay.victim_node == 4 and lay.stopped == 19 and lay.node_successor == 40 and lay.stop_successor == 20
    assert not set(lay.full) & lay.victims and {40, 20} <= set(lay.full)
    plans = lay.population_plans(2, 64)
    hosted = {q for p in plans for q in p["full"] + [x for g in p["groups"] for x in g]}
    assert hosted == set(range(64)) - lay.victims, "every process but the victims lives in a population worker"
    assert sorted(n for p in plans for n in p["launchers_full"] + p["launchers_beat"]) == [0, 1, 2, 3, 5, 6, 7]


def test_a_tiny_run_writes_the_document(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    cmd = [sys.executable, "-m", "tools.bench", "--scale", "--sizes", "2", "--window-s", "1", "--workers", "1",
           "--samples", "0", "--quiet-s", "0", "--phases", "cold,form,steady", "--bound-s", "120", "--out", str(out)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    for k in ("timeout_s", "interval_s", "commit", "real", "simulated", "sizes"):
        assert k in doc, k
    assert doc["timeout_s"] == 3.0 and doc["interval_s"] == 0.5
    assert doc["real"] and doc["simulated"] and all(isinstance(x, str) for x in doc["real"] + doc["simulated"])
    (size,) = doc["sizes"]
    assert set(RECORD_KEYS) <= size.keys()
    assert (size["nodes"], size["processes"], size["finished"]) == (2, 16, True), size["why"]
    assert size["keys_per_process_per_beat"] > 0 and size["bytes_per_process_per_beat"] > 0
    assert size["primary_keys_per_beat"] >= 16 * size["keys_per_process_per_beat"]
    assert size["store_host_threads"] > 0 and size["cold_start_refusals"] is not None
    assert size["node_detect_s"] is None and size["failover_s"] is None, "phases not run are left empty"
