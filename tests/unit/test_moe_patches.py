"""megatron_patches.moe: each MoE patch of enable_cpu() fixes what its docstring says, in one process (the 4-rank
training run is tests/e2e/test_moe.py)."""

from __future__ import annotations

import importlib.util
from typing import Iterator

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed")


@pytest.fixture
def shim() -> Iterator[None]:
    from megatron_patches import cpu

    patch = cpu.enable_cpu(nemo=False)
    try:
        yield
    finally:
        patch.disable()


def test_every_moe_patch_is_in_the_cpu_table_and_undone_by_disable() -> None:
    from megatron.core.transformer.moe import moe_utils, router, token_dispatcher
    from torch.autograd.function import BackwardCFunction

    from megatron_patches import cpu, moe

    table = {(a.module, a.name) for a in cpu.PATCHED_ATTRIBUTES}
    assert {(m.module, m.name) for m in moe.PATCHES} <= table
    before = (token_dispatcher.maybe_move_tensor_to_cpu, router.Router.reset_parameters, BackwardCFunction.apply)
    patch = cpu.enable_cpu(nemo=False)
    assert moe_utils.te_general_gemm is None
    patch.disable()
    assert not hasattr(moe_utils, "te_general_gemm")  # defined by the patch, removed again
    assert (token_dispatcher.maybe_move_tensor_to_cpu, router.Router.reset_parameters,
            BackwardCFunction.apply) == before


def test_split_sizes_of_a_cpu_tensor_become_a_numpy_copy(shim: None) -> None:
    from megatron.core.transformer.moe import token_dispatcher

    splits = torch.tensor([64, 91])
    out = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    assert out.tolist() == [64, 91] and not torch.is_tensor(out)
    splits[0] = 0
    assert out.tolist() == [64, 91], "a copy, as the device-to-host copy of the GPU path"
    assert token_dispatcher.maybe_move_tensor_to_cpu(splits) is splits


def test_a_custom_backward_that_allocates_on_cuda_runs_on_cpu(shim: None) -> None:
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
            return x * 2

        @staticmethod
        def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
            return torch.full(g.shape, 2.0, device=torch.cuda.current_device()) * g  # as mcore's mappings do

    x = torch.ones(3, requires_grad=True)
    torch.autograd.backward(Double.apply(x).sum())
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


def test_the_router_bias_starts_at_zero_and_a_tp_group_of_one_returns_no_view(shim: None) -> None:
    from megatron.core.tensor_parallel import layers

    class One:
        def size(self) -> int:
            return 1

    y = torch.ones(2, 3, requires_grad=True) * 1.0
    out = layers.reduce_from_tensor_model_parallel_region(y, group=One())
    assert out is y
    out += 1.0  # the expert MLP's in-place bias add: no "is a view and is being modified inplace"

    from megatron.core.transformer.moe import router

    class Stub:
        config = type("C", (), {"perform_initialization": True, "params_dtype": torch.float32,
                                "sequence_parallel": False, "init_method": staticmethod(torch.nn.init.ones_)})()
        weight = torch.nn.Parameter(torch.empty(4, 8))
        bias = torch.nn.Parameter(torch.full((4,), 1e30))

    stub = Stub()
    router.Router.reset_parameters(stub)
    assert stub.bias.tolist() == [0.0] * 4 and stub.weight.eq(1.0).all()
