"""`tools.bench.compare`: the arithmetic and the tables, without launching ranks."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from tools.bench import compare
from tools.bench.compare import cli, gpt, stats, systems, tables
from tools.bench.compare.runner import Runner
from tools.bench.compare.systems.base import Base
from tools.bench.compare.systems.variant import Variant
from tools.bench.compare.projection import projection

REPO = Path(__file__).resolve().parents[2]


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
    s = stats.summarize(_result())
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
    text = tables.render(_result(), info, args)
    assert "| lightning_save" in text and "| neighbor_local" in text
    assert "nvrx_local: could not run here: setup failed" in text
    assert "15.0x lower" in text and "MET" in text
    assert "347.25 KiB" in text  # planner's 12 B/param/DP at DP=4 for the recipe's GPT (untied embeddings)


def test_projection_has_the_planner_tables_and_goodput() -> None:
    text = projection(None)
    for name in ("llama3_8b", "llama3_70b", "gpt3_175b"):
        assert f"neighbor-ckpt plan configs/{name}.yaml" in text
    assert "Goodput on 1024 H100s" in text and "p_unrecoverable" in text


def _args(*argv: str) -> argparse.Namespace:
    """The parser's namespace with nothing given, then ``argv``'s flags (as main() would parse them)."""
    ns = argparse.Namespace(device="cpu", quick=False, world=None, steps=None, warmup=None, block=None,
                            scale_steps=None, scales=None, hidden=None, layers=None, heads=None, seq=None,
                            vocab=None, micro_batches=None, micro_batch_size=None)
    it = iter(argv)
    for flag in it:
        key = flag.lstrip("-").replace("-", "_")
        if key == "quick":
            ns.quick = True
        else:
            val = next(it)
            setattr(ns, key, val if key in ("device", "scales") else int(val))
    return ns


def test_cpu_defaults_are_the_recipe_shape_and_the_old_protocol() -> None:
    a = _args()
    cli.resolve_args(a, gpu_count=0)
    assert (a.world, a.steps, a.warmup, a.block, a.scales, a.scale_steps) == (4, 20, 3, 5, "2,4", 20)
    assert {k: getattr(a, k) for k in gpt.SHAPE_KEYS} == gpt.CPU_SHAPE
    assert (a.hidden, a.layers, a.heads, a.seq, a.vocab) == (64, 2, 4, 32, 128)  # recipes/mcore_gpt_plain_loop.py
    q = _args("--quick")
    cli.resolve_args(q, gpu_count=8)  # GPUs on the machine change nothing in cpu mode
    assert (q.world, q.steps, q.scales) == (4, 8, "2")


def test_cuda_defaults_gpu_shape_short_protocol_one_rank_per_gpu() -> None:
    a = _args("--device", "cuda")
    cli.resolve_args(a, gpu_count=1)
    assert a.world == 1  # every visible GPU; 1 is allowed with cuda
    assert (a.steps, a.warmup, a.block, a.scales) == (8, 2, 4, "")  # no scaling runs unless --scales is given
    assert (a.hidden, a.layers, a.heads, a.seq, a.vocab, a.micro_batch_size, a.micro_batches) == (
        1024, 16, 16, 2048, 32768, 4, 4)
    b = _args("--device", "cuda", "--hidden", "512", "--world", "2", "--scales", "2", "--quick")
    cli.resolve_args(b, gpu_count=8)
    assert (b.hidden, b.layers, b.world, b.scales, b.steps) == (512, 16, 2, "2", 4)  # flags override


def test_world_validation_depends_on_the_device() -> None:
    with pytest.raises(ValueError, match="--world >= 2"):
        cli.resolve_args(_args("--world", "1"), gpu_count=8)  # cpu: a DP ring needs 2 ranks
    with pytest.raises(ValueError, match="no CUDA device"):
        cli.resolve_args(_args("--device", "cuda"), gpu_count=0)
    with pytest.raises(ValueError, match="1..2"):
        cli.resolve_args(_args("--device", "cuda", "--world", "3"), gpu_count=2)
    with pytest.raises(ValueError, match="--steps >= 1"):
        cli.resolve_args(_args("--device", "cuda", "--steps", "0"), gpu_count=1)


def test_gpu_shape_is_about_a_quarter_billion_params_and_3_gb_of_unique_state() -> None:
    from neighbor_ckpt.planning.planner import HARDWARE, ModelShape, Parallelism, plan_job

    g = gpt.GPU_SHAPE
    shape = ModelShape(num_layers=g["layers"], hidden_size=g["hidden"], ffn_hidden_size=4 * g["hidden"],
                       num_attention_heads=g["heads"], vocab_size=g["vocab"], seq_length=g["seq"],
                       share_embeddings_and_output_weights=False)
    c = plan_job(shape, Parallelism(dp=1), HARDWARE["h100"], extras_bytes=0).classes[0]
    assert 0.2e9 < c.params_per_rank < 0.3e9
    assert c.unique_payload_bytes == 12 * c.params_per_rank  # fp32 main param + 2 Adam moments, DP = 1


def test_cpu_render_has_no_gpu_lines_and_cuda_render_names_the_card_and_the_d2h_bandwidth() -> None:
    args = argparse.Namespace(threads=1, layers=2, heads=4, seq=32, vocab=128, micro_batches=2,
                              micro_batch_size=2, steps=10, block=5, warmup=3)
    info = {"nproc": 16, "cpu_model": "test", "torch": "2.11.0+cu130", "store_root": "/dev/shm",
            "other_cpu_frac": 0.0, "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "torch_cuda": "13.0",
            "nccl": "2.27.7", "gpu_driver": "580.159.04", "gpu_pcie": "PCIe Gen5 x16", "python": "3.12.3"}
    res = _result()
    res["main"]["variants"]["neighbor"]["extra_median"] = {"snapshot_call_s": 0.001, "bg_copy_s": 0.1}
    res["main"]["neighbor_unique_bytes_per_rank"] = [3_000_000_000] * 4
    cpu_text = tables.render(res, info, args)
    assert "NCCL" not in cpu_text and "D2H" not in cpu_text and tables.d2h_line(res) is None
    res["device"] = "cuda"
    text = tables.render(res, info, args)
    assert "4 x NVIDIA H100 80GB HBM3" in text and "CUDA 13.0" in text and "PCIe Gen5 x16" in text
    assert "bf16 with fp32 main params" in text and "CPU budget" not in text
    line = tables.d2h_line(res)
    assert line is not None and line in text
    assert "= 30.0 GB/s per GPU" in line and "the planner assumes 50 GB/s" in line
    del res["main"]["variants"]["neighbor"]
    assert tables.d2h_line(res) is None


def test_a_variant_that_fails_setup_is_dropped_from_every_per_variant_table() -> None:
    class Broken(Variant):
        name = "dcp_async"

        def setup(self) -> None:
            raise RuntimeError("no CUDA")

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        tr = argparse.Namespace(device="cpu")
        variants = {"base": Base(tr, Path(d), 0, 1, "base"),  # type: ignore[arg-type]
                    "dcp_async": Broken(tr, Path(d), 0, 1, "dcp")}  # type: ignore[arg-type]
        runner = Runner(tr, variants, {"verbose": False}, "main")  # type: ignore[arg-type]
        runner._agree = lambda err: err  # type: ignore[method-assign]  # one rank, no process group
        runner.setup()
    assert list(runner.variants) == ["base"]
    assert "dcp_async" not in runner.times and "dcp_async" not in runner.blocks and "dcp_async" not in runner.cpu
    assert runner.failed["dcp_async"].startswith("setup failed: RuntimeError: no CUDA")
    assert not runner.cuda and not variants["base"].cuda


def test_the_bench_gpt_is_the_recipes_gpt() -> None:
    """The comparison trains the recipe's model, built by the recipe's own builder (no copy to keep in sync), and its
    CPU defaults are the recipe's shape and batch."""
    import inspect

    from neighbor_ckpt.recipes import mcore_gpt_plain_loop as recipe

    assert gpt.build_gpt is recipe.build_gpt
    assert "build_gpt(" in inspect.getsource(gpt.Trainer.__init__)
    defaults = {k: p.default for k, p in inspect.signature(recipe.build_gpt).parameters.items()}
    assert gpt.CPU_SHAPE == {k: defaults[k] for k in gpt.SHAPE_KEYS}


def test_every_variant_is_one_registered_system_module() -> None:
    assert set(systems.CLASSES) == set(systems.VARIANTS)
    assert set(systems.ALTERNATIVES) | set(systems.DIAGNOSTICS) | {"base", "neighbor"} == set(systems.VARIANTS)
    modules = {cls.__module__.rsplit(".", 1)[1] for cls in systems.CLASSES.values()}
    assert modules == {"base", "neighbor", "dcp", "mcore_dist", "lightning_write", "nvrx"}
    assert all(issubclass(cls, Variant) and cls.name == name for name, cls in systems.CLASSES.items())


def test_help_parses_without_launching_anything(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        compare.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--variants" in out and "--projection" in out


def test_no_bench_module_is_over_800_lines() -> None:
    bench = REPO / "tools" / "bench"
    sizes = {str(p.relative_to(bench)): len(p.read_text().splitlines()) for p in bench.rglob("*.py")}
    assert max(sizes.values()) < 800, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def test_an_alternative_whose_package_is_missing_is_skipped_in_one_line_and_the_run_says_what_it_compares() -> None:
    from tools.bench.compare.cli import plan_line

    names = ["base", "neighbor", "dcp_async", "lightning_save", "nvrx_local", "nvrx_local_repl"]
    kept, skipped = systems.runnable(names, installed=lambda package: package != "nvidia_resiliency_ext")
    assert kept == ["base", "neighbor", "dcp_async", "lightning_save"]
    assert skipped == {"nvrx_local": "needs nvidia_resiliency_ext, not installed",
                       "nvrx_local_repl": "needs nvidia_resiliency_ext, not installed"}
    assert systems.runnable(names, installed=lambda package: True) == (names, {})
    lines = plan_line(kept, skipped).splitlines()
    assert lines == ["tools.bench.compare: skipped nvrx_local: needs nvidia_resiliency_ext, not installed",
                     "tools.bench.compare: skipped nvrx_local_repl: needs nvidia_resiliency_ext, not installed",
                     "tools.bench.compare: comparing base, neighbor, dcp_async, lightning_save "
                     "(alternatives: dcp_async, lightning_save)"]
    assert "Traceback" not in plan_line(kept, skipped)


def test_the_table_lists_a_skipped_alternative_with_its_reason() -> None:
    args = argparse.Namespace(threads=1, layers=2, heads=4, seq=32, vocab=128, micro_batches=2,
                              micro_batch_size=2, steps=10, block=5, warmup=3)
    info = {"nproc": 2, "cpu_model": "test", "torch": "x", "store_root": "/dev/shm", "other_cpu_frac": 0.0}
    res = _result()
    res["main"]["skipped"] = {"nvrx_local_repl": "needs nvidia_resiliency_ext, not installed"}
    assert "* nvrx_local_repl: skipped: needs nvidia_resiliency_ext, not installed" in tables.render(res, info, args)
