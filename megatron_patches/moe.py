"""megatron-core 0.15 mixture-of-experts on CPU-only torch with gloo: the patches :func:`megatron_patches.enable_cpu`
adds for MoE layers. **Smoke runs and tests only** (like the rest of :mod:`megatron_patches.cpu`).

Each patch is one named entry of :data:`PATCHES` (module, attribute, replacement, why). ``enable_cpu`` applies them
with its own table after :func:`~megatron_patches._versions.check_versions` has accepted megatron-core 0.15.x, and
``CpuPatch.disable`` restores every one of them exactly. Importing this module imports no megatron code.

1. ``moe_utils.te_general_gemm`` (NameError in the router). ``megatron/core/transformer/moe/moe_utils.py`` binds
   ``te_general_gemm`` only inside its ``try: import transformer_engine`` block, and its ``except ImportError`` sets
   ``HAVE_TE = False`` without defining the name; ``RouterGatingLinearFunction.forward/backward`` then test
   ``te_general_gemm is not None`` and raise ``NameError`` on every router call without Transformer Engine. The
   patch defines the name as ``None``: the function's own plain ``torch.mm`` / ``torch.addmm`` branch runs.
2. ``token_dispatcher.maybe_move_tensor_to_cpu`` (gloo refuses the alltoall dispatcher's ``all_to_all_single``:
   "incompatible function arguments"). ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` turns the
   all-to-all split sizes into numpy arrays with ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which only acts
   ``if tensor.is_cuda``: on CPU the splits stay torch tensors and reach
   ``ProcessGroup.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)``, whose binding
   takes sequences of Python ints and rejects a tensor. The replacement does what the GPU path yields, a numpy copy
   of a CPU tensor when ``as_numpy``, and defers to the original otherwise.
3. ``torch.autograd.function.BackwardCFunction.apply`` ("Cannot access accelerator device" in the backward pass
   of the alltoall dispatcher, and of the allgather dispatcher with the sigmoid router). megatron-core's custom
   autograd functions allocate with ``device=torch.cuda.current_device()`` in their backward too:
   ``tensor_parallel/mappings.py:_AllToAll.backward`` calls ``_AllToAll.apply`` (whose forward does
   ``input.new_empty(..., device=torch.cuda.current_device())``), ``_ReduceScatterToSequenceParallelRegion.backward``
   calls ``_gather_along_first_dim`` (``torch.empty(..., device=torch.cuda.current_device())``). The autograd
   engine runs backward functions with an empty torch-function mode stack, so the thread's
   :class:`~megatron_patches.device_mode.CudaToCpuMode` never sees those calls. The replacement runs each custom
   function's backward (``BackwardCFunction.apply``, the method the engine looks up by name) under a
   ``CudaToCpuMode`` of its own: the backward pass then places tensors as the forward pass does. Dense models never met this because no
   custom backward of theirs allocates on a device.
4. ``router.Router.reset_parameters`` (every loss NaN, and losses that differ from run to run, with the allgather
   dispatcher and the sigmoid router as with any other). ``Router.__init__`` creates the router's bias (whenever
   ``add_bias_linear``, mcore's default) with ``torch.empty`` and ``reset_parameters`` initializes only the weight:
   the bias is whatever the allocator returned (on CPU: values up to 1e34, different on every run and rank). A bug of
   megatron-core 0.15 on any device; a GPU's fresh memory merely tends to be zeros. The replacement zeroes the bias
   after the original initialization, as every other megatron-core linear layer's bias is (when
   ``config.perform_initialization``).
5. ``layers.reduce_from_tensor_model_parallel_region`` ("Output 0 of _ReduceFromModelParallelRegion is a view and is
   being modified inplace", SequentialMLP with expert biases and no expert parallelism, any router). An expert's
   ``MLP.forward`` adds its fc2 bias in place (``output += output_bias.unsqueeze(0) * per_token_scale...``). Its
   fc2 (``RowParallelLinear``) all-reduces its output through the ``_ReduceFromModelParallelRegion`` autograd
   function unless ``explicit_expert_comm`` (EP > 1 or expert TP > 1); with a group of one, that function returns its
   input as is, which autograd marks as a view that must not be modified in place. The replacement skips the
   autograd function when the group has one rank (its forward and backward are both the identity then) and calls the
   original otherwise. A bug of the local (non-Transformer-Engine) layers on any device.
6. ``torch_norm.WrappedTorchNorm.__new__`` ("sequence parallel not supported by torch LayerNorm", any model with
   tensor and sequence parallelism on the local layers, which MoE under TP needs: ``MoELayer`` refuses to train with
   TP > 1 and no sequence parallelism). Under sequence parallelism a norm sees only its rank's part of the sequence,
   so the gradients of its weight and bias must be all-reduced over the TP group, which megatron-core's
   ``finalize_model_grads`` does for every parameter marked ``sequence_parallel`` (Transformer Engine's and apex's
   norms mark theirs; ``torch.nn.LayerNorm`` has no such flag, hence the refusal). The replacement builds the torch
   norm as the original does for a config without sequence parallelism and marks its parameters
   ``sequence_parallel``, as megatron-core's own ``FusedLayerNorm`` does.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from megatron_patches.device_mode import CudaToCpuMode

__all__ = ["MoePatch", "PATCHES"]

_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


class MoePatch(NamedTuple):
    """One replaced (or defined) attribute."""

    module: str
    name: str
    replacement: Callable[[], Any]
    """Builds the new value at enable time (imports megatron only then)."""
    why: str
    missing_ok: bool = False
    """The attribute may be absent before the patch (the patch defines it; disable removes it again)."""


def _dtoh_numpy() -> Callable[..., Any]:
    from megatron.core.transformer.moe import moe_utils

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().numpy().copy()  # what .to("cpu").numpy() of a device tensor gives: a copy
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _backward_in_device_mode() -> Callable[..., Any]:
    from torch.autograd.function import BackwardCFunction

    original = BackwardCFunction.__dict__["apply"]

    def apply(self: Any, *args: Any) -> Any:
        with CudaToCpuMode():
            return original(self, *args)

    return apply


def _router_bias_zeroed() -> Callable[..., Any]:
    from megatron.core.transformer.moe.router import Router

    original = Router.__dict__["reset_parameters"]

    def reset_parameters(self: Any) -> None:
        original(self)
        if self.bias is not None and self.config.perform_initialization:
            with torch.no_grad():
                self.bias.zero_()

    return reset_parameters


def _reduce_skips_a_group_of_one() -> Callable[..., Any]:
    from megatron.core.tensor_parallel import layers

    original = layers.reduce_from_tensor_model_parallel_region

    def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
        if group is not None and group.size() == 1:
            return input_  # what _ReduceFromModelParallelRegion computes (both ways), without marking a view
        return original(input_, group=group)

    return reduce_from_tensor_model_parallel_region


def _torch_norm_sequence_parallel() -> Any:
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__dict__["__new__"].__func__

    def __new__(cls: Any, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)  # not dataclasses.replace: __post_init__ again fails in 0.15 (no 'import warnings')
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True  # finalize_model_grads all-reduces these grads over the TP group
        return norm

    return staticmethod(__new__)


PATCHES: tuple[MoePatch, ...] = (
    MoePatch(_MOE_UTILS, "te_general_gemm", lambda: None,
             "moe_utils binds it only when Transformer Engine imports; the router tests 'is not None' (1.)",
             missing_ok=True),
    MoePatch(_DISPATCHER, "maybe_move_tensor_to_cpu", _dtoh_numpy,
             "the alltoall dispatcher's split sizes must be numpy/int sequences for ProcessGroup.all_to_all_single "
             "(2.)"),
    MoePatch("torch.autograd.function", "BackwardCFunction.apply", _backward_in_device_mode,
             "custom backward functions (mappings._AllToAll, _ReduceScatterToSequenceParallelRegion) allocate on "
             "torch.cuda.current_device(); the autograd engine runs them without the thread's modes (3.)"),
    MoePatch("megatron.core.transformer.moe.router", "Router.reset_parameters", _router_bias_zeroed,
             "the router bias is torch.empty and never initialized: garbage, NaN losses, no determinism (4.)"),
    MoePatch("megatron.core.tensor_parallel.layers", "reduce_from_tensor_model_parallel_region",
             _reduce_skips_a_group_of_one,
             "a TP group of one returns fc2's output as a view; the expert MLP adds its bias to it in place (5.)"),
    MoePatch("megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__", _torch_norm_sequence_parallel,
             "torch norms refuse sequence parallelism, which MoE under TP requires; marked params are all-reduced "
             "over TP like FusedLayerNorm's (6.)"),
)
"""The MoE patches, in the order :func:`~megatron_patches.cpu.enable_cpu` applies them."""
