"""Adapters for plain ``torch.nn.Module`` + ``torch.optim`` training (DDP) and torch's ZeRO-1.

* :class:`TorchOptimizerAdapter`: weights and optimizer state are replicated on every DP rank, so with
  DP > 1 they are *lazy* (backed up at failure time); with DP = 1 they are unique.
* :class:`ZeroOptimizerAdapter`: ``torch.distributed.optim.ZeroRedundancyOptimizer``. Each rank owns a
  partition of the parameters and their optimizer state: that partition is unique and snapshotted every
  iteration; every other weight is *regenerable* (broadcast from its owner at restore time).

Both report module buffers as the razor's buffer kinds (:func:`~neighbor_ckpt.adapters.base.classify_buffers`):
changing ones (BatchNorm statistics) are staged by every rank every iteration and loaded on every rank, constant ones
are left as the model's constructor made them.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from neighbor_ckpt.adapters.base import StateAdapter, buffer_tensors, classify_buffers, load_buffers
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta

logger = logging.getLogger(__name__)

__all__ = ["TorchOptimizerAdapter", "ZeroOptimizerAdapter"]


def _split_optimizer_state(sd: dict[str, Any], prefix: str) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """Split an optimizer state_dict into (named tensors, skeleton with tensor names in their place)."""
    tensors: list[tuple[str, torch.Tensor]] = []
    state_skel: dict[Any, Any] = {}
    for pid, st in sd["state"].items():
        entry: dict[str, Any] = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                name = f"{prefix}/{pid}/{k}"
                tensors.append((name, v))
                entry[k] = {"__tensor_ref__": name}
            else:
                entry[k] = v
        state_skel[pid] = entry
    return tensors, {"state": state_skel, "param_groups": sd["param_groups"]}


def _fill_skeleton(skel: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(skel, dict):
        if set(skel) == {"__tensor_ref__"}:
            return tensors[skel["__tensor_ref__"]].clone()
        return {k: _fill_skeleton(v, tensors) for k, v in skel.items()}
    if isinstance(skel, list):
        return [_fill_skeleton(v, tensors) for v in skel]
    return skel


class TorchOptimizerAdapter(StateAdapter):
    """A model and a (non-sharded) torch optimizer, replicated across DP ranks by DDP."""

    distributed_optimizer = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.buffers = classify_buffers(model)
        """Every module buffer with its kind, classified once (a later ``eval()`` does not change the plan)."""
        self._buffer_ids = {id(b) for _, b, _ in self.buffers}

    def _weights(self) -> dict[str, torch.Tensor]:
        """The model's state_dict entries that are not buffers (parameters, under their state_dict names)."""
        return {k: v for k, v in self.model.state_dict(keep_vars=True).items()
                if isinstance(v, torch.Tensor) and id(v) not in self._buffer_ids}

    def named_tensors(self) -> list[tuple[TensorMeta, torch.Tensor]]:
        out: list[tuple[TensorMeta, torch.Tensor]] = []
        for k, v in self._weights().items():
            t = v.detach()
            out.append((TensorMeta.of(f"model/{k}", StateKind.WEIGHT, t), t))
        out += buffer_tensors(self.buffers)
        tensors, _ = _split_optimizer_state(self.optimizer.state_dict(), "optim")
        for name, t in tensors:
            out.append((TensorMeta.of(name, StateKind.OPTIMIZER, t), t))
        return out

    def capture_extras(self) -> dict[str, Any]:
        _, skel = _split_optimizer_state(self.optimizer.state_dict(), "optim")
        return {"optimizer": skel}

    def load(self, tensors: Mapping[str, torch.Tensor], extras: Mapping[str, Any]) -> None:
        model_sd = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        with torch.no_grad():
            live = self._weights()
            missing = sorted(set(live) - set(model_sd))
            if missing:
                raise KeyError(f"restored state lacks model tensors {missing[:5]}")
            for k, v in live.items():
                v.detach().copy_(model_sd[k])
        load_buffers(self.buffers, tensors)
        self.optimizer.load_state_dict(_fill_skeleton(extras["optimizer"], tensors))


class ZeroOptimizerAdapter(StateAdapter):
    """``ZeroRedundancyOptimizer``: this rank's parameter partition and its optimizer state are unique."""

    distributed_optimizer = True

    def __init__(self, model: nn.Module, optimizer: Any) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            raise TypeError(f"expected a ZeroRedundancyOptimizer, got {type(optimizer).__qualname__}")
        self.model = model
        self.optimizer = optimizer
        self._names = {id(p): n for n, p in model.named_parameters()}
        self.buffers = classify_buffers(model)
        """Every module buffer with its kind, classified once. Changing buffers are not regenerable (ZeRO's
        parameter sync does not carry them): every rank stages and loads its own."""

    def _owned(self) -> list[tuple[str, nn.Parameter]]:
        rank = self.optimizer.rank
        owned = [p for group in self.optimizer._partition_parameters()[rank] for p in group["params"]]
        return [(self._names[id(p)], p) for p in owned]

    def named_tensors(self) -> list[tuple[TensorMeta, torch.Tensor]]:
        out: list[tuple[TensorMeta, torch.Tensor]] = []
        owned_ids = {id(p) for _, p in self._owned()}
        for name, p in self._owned():
            out.append((TensorMeta.of(f"main/{name}", StateKind.MAIN_PARAM, p.detach()), p.detach()))
        for name, p in self.model.named_parameters():
            if id(p) not in owned_ids:
                out.append((TensorMeta.of(f"model/{name}", StateKind.WEIGHT, p.detach()), p.detach()))
        out += buffer_tensors(self.buffers)
        tensors, _ = _split_optimizer_state(self.optimizer.optim.state_dict(), "optim")
        for name, t in tensors:
            out.append((TensorMeta.of(name, StateKind.OPTIMIZER, t), t))
        return out

    def capture_extras(self) -> dict[str, Any]:
        _, skel = _split_optimizer_state(self.optimizer.optim.state_dict(), "optim")
        # ZeRO keeps hyper-parameters (what LR schedulers change) in its outer param_groups and copies them
        # into the local optimizer at every step: they must be restored too.
        outer = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"optimizer": skel, "param_groups": outer}

    def load(self, tensors: Mapping[str, torch.Tensor], extras: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for name, p in self._owned():
                p.detach().copy_(tensors[f"main/{name}"])
        load_buffers(self.buffers, tensors)
        self.optimizer.optim.load_state_dict(_fill_skeleton(extras["optimizer"], tensors))
        for group, saved in zip(self.optimizer.param_groups, extras["param_groups"]):
            group.update(saved)

    def regenerate(self, dp_group: dist.ProcessGroup | None) -> None:
        """Every weight is broadcast from the rank that owns it (ZeRO's own parameter sync)."""
        with torch.no_grad():
            self.optimizer._sync_params()
