"""A finished campaign case's two output directories, for the judges' unit tests."""

from __future__ import annotations

import json
from pathlib import Path


def same_training_runs(tmp_path: Path) -> list[Path]:
    """``tmp_path/base`` (the failure-free run) and ``tmp_path/run`` (the case's), with the same one loss and the
    same final state: a case whose training matched its baseline bit for bit. The caller adds the case's own
    records to ``run`` (its fault, the prober's summary)."""
    runs = []
    for name in ("base", "run"):
        out = tmp_path / name
        out.mkdir(parents=True)
        (out / "losses.rank0.jsonl").write_text(json.dumps({"step": 0, "loss": (2.5).hex(), "attempt": 0}) + "\n")
        (out / "final.rank0.json").write_text(json.dumps({"params": "x"}))
        runs.append(out)
    return runs
