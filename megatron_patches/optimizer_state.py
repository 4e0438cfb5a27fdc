"""Where a megatron-core optimizer keeps each rank's state, read without copying anything.

Nothing is patched here: this module only *reads* megatron-core optimizer internals (and, for
:func:`regenerate_weights`, calls two of their methods), so that :mod:`neighbor_ckpt.adapters.megatron`
never has to. Supported: ``DistributedOptimizer``, ``Float16OptimizerWithFloat16Params``,
``FP32Optimizer``, and ``ChainedOptimizer`` of any of them (megatron-core 0.15).

Internals read (megatron/core/optimizer/distrib_optimizer.py, optimizer.py):

* ``DistributedOptimizer.model_param_group_index_map``: model param -> (group index, order) of its fp32
  main-param shard in the inner torch optimizer's ``param_groups``; the shard is this DP rank's slice
  (``shard_fp32_from_float16_groups``, or under fp32 params a view of the param buffer itself);
* ``DistributedOptimizer.model_param_gbuf_map`` / ``gbuf_ranges``: which bucket and which range of the
  contiguous buffer that slice is (part of the layout identity: another DP size or bucket size is refused);
* ``Float16OptimizerWithFloat16Params.float16_groups`` / ``fp32_from_float16_groups``;
* ``FP32Optimizer``: the inner optimizer's params are the model params.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["ParamState", "optimizer_parts", "is_distributed", "param_states", "shard_layout", "shard_spans",
           "grad_scaler_of", "regenerate_weights", "materialize_state"]


@dataclass(frozen=True)
class ParamState:
    """One model parameter and the optimizer state that belongs to it on this rank."""

    model_param: nn.Parameter
    main_param: torch.Tensor | None
    """The fp32 master copy the inner optimizer steps (a DP shard under the distributed optimizer);
    None when the inner optimizer steps the model param itself (fp32 params without a distributed optimizer)."""
    group: int
    """Index into the inner optimizer's ``param_groups``."""
    order: int
    """Position inside that group's ``params``."""

    @property
    def stepped(self) -> torch.Tensor:
        """The tensor the inner optimizer holds state for."""
        return self.model_param if self.main_param is None else self.main_param


def optimizer_parts(optimizer: Any) -> list[Any]:
    """The non-chained megatron optimizers inside ``optimizer`` (itself if it is not a ChainedOptimizer)."""
    parts = getattr(optimizer, "chained_optimizers", None)
    return list(parts) if parts is not None else [optimizer]


def is_distributed(part: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(part, DistributedOptimizer)


def param_states(part: Any) -> list[ParamState]:
    """Every model param this optimizer part steps, with its main param, in the inner optimizer's order."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    out: list[ParamState] = []
    if is_distributed(part):
        groups = part.optimizer.param_groups
        for model_param, (gi, go) in part.model_param_group_index_map.items():
            main = groups[gi]["params"][go]
            out.append(ParamState(model_param, main, gi, go))
    elif isinstance(part, Float16OptimizerWithFloat16Params):
        # The inner groups hold each float16 param's fp32 copy in that param's place, fp32 params as they are.
        model_of = {id(main): model for f16, f32 in zip(part.float16_groups, part.fp32_from_float16_groups)
                    for model, main in zip(f16, f32)}
        for gi, group in enumerate(part.optimizer.param_groups):
            for go, p in enumerate(group["params"]):
                model = model_of.get(id(p))
                out.append(ParamState(p, None, gi, go) if model is None else ParamState(model, p, gi, go))
    elif isinstance(part, FP32Optimizer):
        for gi, group in enumerate(part.optimizer.param_groups):
            for go, p in enumerate(group["params"]):
                out.append(ParamState(p, None, gi, go))
    else:
        raise TypeError(f"unsupported megatron optimizer {type(part).__qualname__}: expected DistributedOptimizer, "
                        f"Float16OptimizerWithFloat16Params, FP32Optimizer or a ChainedOptimizer of them")
    out.sort(key=lambda s: (s.group, s.order))
    return out


def shard_layout(part: Any, names: dict[int, str]) -> list[list[Any]]:
    """Per model param (by name): (buffer index, dtype, bucket, [start, end) of this rank's shard in it)."""
    if not is_distributed(part):
        return []
    out: list[list[Any]] = []
    for s in param_states(part):
        gbuf_index, dtype, bucket = part.model_param_gbuf_map[s.model_param]
        rng = part.gbuf_ranges[gbuf_index][dtype][bucket]["param_map"][s.model_param]["gbuf_world_in_bucket"]
        out.append([names.get(id(s.model_param), "?"), gbuf_index, str(dtype), bucket, rng.start, rng.end])
    return out


def shard_spans(part: Any) -> dict[int, tuple[int, int, int]]:
    """Per model param (by ``id``) this rank's shard holds a slice of: (param numel, start, end), the slice of the
    flattened param in param-local elements (mcore's ``param_map[param]["param"]`` range). Empty when not distributed.
    Another data-parallel size cuts the same params at other places: the elastic reshard maps one onto the other."""
    if not is_distributed(part):
        return {}
    out: dict[int, tuple[int, int, int]] = {}
    for s in param_states(part):
        gbuf_index, dtype, bucket = part.model_param_gbuf_map[s.model_param]
        rng = part.gbuf_ranges[gbuf_index][dtype][bucket]["param_map"][s.model_param]["param"]
        out[id(s.model_param)] = (s.model_param.numel(), int(rng.start), int(rng.end))
    return out


def grad_scaler_of(part: Any) -> Any:
    """The part's ``MegatronGradScaler`` (fp16 loss scaling), or None."""
    return getattr(part, "grad_scaler", None)


def materialize_state(part: Any) -> None:
    """Create the inner optimizer's per-param state if it does not exist yet (torch optimizers create it
    lazily at the first step), so restored tensors can be copied into place. Values are overwritten by the
    caller; the params a dummy step touches are restored or regenerated afterwards."""
    inner = part.optimizer
    if len(inner.state) > 0:
        return
    saved = [(p, p.detach().clone()) for g in inner.param_groups for p in g["params"]]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    for p, _ in saved:
        p.grad = torch.zeros_like(p)
    inner.step()
    for p, before in saved:
        p.grad = None
        with torch.no_grad():
            p.copy_(before)
    for g, h in zip(inner.param_groups, hyper):
        g.update(h)


def regenerate_weights(optimizer: Any, model_chunks: Iterable[nn.Module]) -> None:
    """Rebuild model weights from restored fp32 main params: copy each rank's main-param shard into the
    param buffer, then all-gather the buffer over the DP group (collective, synchronous)."""
    with torch.no_grad():
        for part in optimizer_parts(optimizer):
            part._copy_main_params_to_model_params()
        for chunk in model_chunks:
            chunk.start_param_sync(force_sync=True)
