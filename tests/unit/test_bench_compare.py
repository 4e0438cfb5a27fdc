"""`neighbor_ckpt.bench.compare`: the arithmetic and the tables, without launching ranks."""

from __future__ import annotations

import argparse
import math

from neighbor_ckpt.bench import compare


def _variant(times: list[float], label: str) -> dict:
    return {"step_s": times, "round": [i // 5 for i in range(len(times))], "label": label, "note": "",
            "bytes_per_save_job": 1000, "extra_median": {}, "extra_max_rank_median": {}}


def _result() -> dict:
    base = [0.100 + 0.001 * (i % 3) for i in range(10)]
    main = {
        "variants": {
            "base": _variant(base, "base"),
            "neighbor": _variant([t + 0.002 for t in base], "neighbor"),
            "dcp_async": _variant([t + 0.050 for t in base], "dcp_async"),
            "lightning_save": _variant([t + 0.030 for t in base], "lightning_save"),
            "neighbor_local": _variant([t + 0.001 for t in base], "neighbor_local"),
        },
        "failed": {"nvrx_local": "setup failed: rank 0: RuntimeError: no CUDA"},
        "neighbor_unique_bytes_per_rank": [355584] * 4, "params": 118528, "hidden": 64,
    }
    return {"world": 4, "main": main, "scaling": []}


def test_summary_takes_the_best_alternative_and_checks_the_10x_target() -> None:
    s = compare.summarize(_result())
    v = s["verdict"]
    assert v["best"] == "lightning_save"  # diagnostics are never a candidate
    assert math.isclose(v["neighbor_overhead_s"], 0.002, abs_tol=1e-9)
    assert math.isclose(v["ratio"], 15.0, rel_tol=1e-6)
    assert v["met"]
    assert math.isclose(s["rows"]["dcp_async"]["ratio"], s["rows"]["dcp_async"]["median_s"] / s["base_s"])


def test_render_prints_one_table_and_the_reason_a_variant_could_not_run() -> None:
    args = argparse.Namespace(threads=1, layers=2, heads=4, seq=32, vocab=128, micro_batches=2,
                              micro_batch_size=2, steps=10, block=5, warmup=3)
    info = {"nproc": 2, "cpu_model": "test", "torch": "x", "store_root": "/dev/shm", "other_cpu_frac": 0.0}
    text = compare.render(_result(), info, args)
    assert "| lightning_save" in text and "| neighbor_local" in text
    assert "nvrx_local: could not run here: setup failed" in text
    assert "15.0x lower" in text and "MET" in text
    assert "347.25 KiB" in text  # planner's 12 B/param/DP at DP=4 for the recipe's GPT (untied embeddings)


def test_projection_has_the_planner_tables_and_goodput() -> None:
    text = compare.projection(None)
    for name in ("llama3_8b", "llama3_70b", "gpt3_175b"):
        assert f"neighbor-ckpt plan configs/{name}.yaml" in text
    assert "Goodput on 1024 H100s" in text and "p_unrecoverable" in text
