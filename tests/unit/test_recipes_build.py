"""Tier 1: every recipe in configs/ builds its NeMo configuration (a nemo_run.Partial of llm.pretrain) with the
neighbor-checkpoint callback attached and the job's parallelism applied. Nothing is trained here; the tiny
recipes train, get killed and recover in tests/e2e/test_recipes.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nemo.collections.llm")
pytest.importorskip("nemo_run")

import fiddle as fdl  # noqa: E402

from neighbor_ckpt import NeighborCheckpoint  # noqa: E402
from neighbor_ckpt.planning.jobspec import load_job  # noqa: E402
from neighbor_ckpt.lightning.faults import FaultInjector  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["gpt_tiny_cpu", "llama_tiny_cpu", "llama3_8b", "llama3_70b", "gpt3_175b"]


def _recipe_module() -> Any:
    spec = importlib.util.spec_from_file_location("nemo_pretrain", REPO / "recipes" / "nemo_pretrain.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _callbacks_of(recipe: Any, cls: type) -> list[Any]:
    return [c for c in recipe.trainer.callbacks if getattr(c, "__fn_or_cls__", None) is cls]


@pytest.mark.parametrize("name", CONFIGS)
def test_recipe_builds_with_the_callback_attached_and_the_job_applied(name: str, tmp_path: Path) -> None:
    job = load_job(REPO / "configs" / f"{name}.yaml")
    recipe = _recipe_module().build_recipe(job, tmp_path)
    from nemo.collections import llm

    assert recipe.__fn_or_cls__ is llm.pretrain
    (cb,) = _callbacks_of(recipe, NeighborCheckpoint)
    built = fdl.build(cb)
    assert isinstance(built, NeighborCheckpoint)
    assert built.config == job.neighbor_ckpt
    assert not _callbacks_of(recipe, FaultInjector)
    s, p = recipe.trainer.strategy, job.parallelism
    assert (s.tensor_model_parallel_size, s.pipeline_model_parallel_size, s.context_parallel_size) == \
        (p.tensor, p.pipeline, p.context)
    assert s.virtual_pipeline_model_parallel_size == p.virtual_pipeline
    assert s.sequence_parallel == p.sequence_parallel
    assert s.ddp.use_distributed_optimizer is recipe.optim.config.use_distributed_optimizer is p.distributed_optimizer
    assert (recipe.trainer.num_nodes, recipe.trainer.devices) == (job.trainer.num_nodes, job.trainer.devices)
    assert recipe.trainer.max_steps == job.trainer.max_steps
    assert (recipe.data.micro_batch_size, recipe.data.global_batch_size) == \
        (job.trainer.micro_batch_size, job.trainer.global_batch_size)
    shape = job.model_shape()
    assert recipe.model.config.num_layers == shape.num_layers and recipe.model.config.hidden_size == shape.hidden_size
    if job.checkpoint.every_n_train_steps:
        assert recipe.log.ckpt.every_n_train_steps == job.checkpoint.every_n_train_steps
        assert recipe.resume is not None, "AutoResume stays: the disk checkpoint is the insurance"


def test_full_size_recipes_start_from_nemos_own_factories(tmp_path: Path) -> None:
    job = load_job(REPO / "configs" / "llama3_70b.yaml")
    recipe = _recipe_module().build_recipe(job, tmp_path)
    from nemo.collections import llm

    assert recipe.model.__fn_or_cls__ is llm.LlamaModel
    assert recipe.model.config.__fn_or_cls__ is llm.Llama3Config70B
    names = {getattr(c, "__fn_or_cls__", type(None)).__name__ for c in recipe.trainer.callbacks}
    assert "TimingCallback" in names, "NeMo's own callbacks are kept"


def test_fault_injection_switch_adds_the_injector_before_the_callback(tmp_path: Path) -> None:
    job = load_job(REPO / "configs" / "gpt_tiny_cpu.yaml", ["neighbor_ckpt.fault_injection.enabled=true"])
    recipe = _recipe_module().build_recipe(job, tmp_path)
    kinds = [c.__fn_or_cls__ for c in recipe.trainer.callbacks]
    assert kinds.index(FaultInjector) < kinds.index(NeighborCheckpoint)


def test_switching_neighbor_ckpt_off_removes_the_callback(tmp_path: Path) -> None:
    job = load_job(REPO / "configs" / "llama3_8b.yaml", ["neighbor_ckpt.enabled=false"])
    recipe = _recipe_module().build_recipe(job, tmp_path)
    assert not _callbacks_of(recipe, NeighborCheckpoint)
