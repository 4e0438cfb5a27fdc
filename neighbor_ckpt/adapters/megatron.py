"""Adapter for megatron-core model chunks and optimizers (distributed or not).

Under megatron-core's ``DistributedOptimizer`` a rank's unique state is exactly its shard of the fp32
main params and the Adam moments of that shard (12 bytes per local param / DP), plus per-group
hyper-parameters (lr, step), the loss scaler and mcore's RNG tracker streams: that is all this adapter
snapshots. Model weights are
*regenerable*: at restore time every rank copies its main-param shard into the param buffer and the
buffer is all-gathered over the DP group, so no weight byte is ever snapshotted or backed up.

Without the distributed optimizer (``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer``) every
tensor is replicated across DP ranks: the razor makes weights, main params and optimizer state *lazy*
(written once, at failure time, by the survivors) when DP > 1.

The tensors handed to the engine are the live ones (main-param shards are views into mcore's contiguous
param buffer under fp32 params): the engine resolves them once, so reading them allocates nothing per
iteration. All megatron-core internals are read through :mod:`megatron_patches.optimizer_state`.

Module buffers are classified by :func:`~neighbor_ckpt.adapters.base.classify_buffers`: a changing one (the MoE
router's ``expert_bias``, updated from token counts every step; BatchNorm statistics) is staged by every rank every
iteration and loaded on every rank (the distributed optimizer's regeneration rebuilds parameters only); a constant
one (RoPE frequencies, non-persistent scratch such as ``local_tokens_per_expert``) is left as the model built it.

Mixture of experts with expert parallelism: mcore marks expert-parallel params ``allreduce = False`` and shards their
fp32 main params and moments over the expert-data-parallel group (a separate buffer and optimizer of the chained
optimizer). Each rank's shard of both is its own unique state, snapshotted and ringed like the dense one; weights
regenerate through mcore's own param all-gather, which uses each buffer's group. The replicated optimizer is refused
with EP: its lazy backups come from a dense-DP peer, which holds other experts.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from neighbor_ckpt.adapters.base import StateAdapter, buffer_tensors, classify_buffers, load_buffers
from neighbor_ckpt.errors import SnapshotMismatchError, TopologyError
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta

logger = logging.getLogger(__name__)

__all__ = ["MegatronOptimizerAdapter"]


def _unwrap_optimizer(optimizer: Any) -> Any:
    """NeMo wraps the mcore optimizer (``McoreDistributedOptimizer.mcore_optimizer``)."""
    return getattr(optimizer, "mcore_optimizer", optimizer)


class MegatronOptimizerAdapter(StateAdapter):
    """megatron-core model chunks + a megatron-core optimizer (as built by ``get_megatron_optimizer``).

    Args:
        model_chunks: the model chunks the optimizer was built for (mcore ``DistributedDataParallel``
            wrappers; one per virtual pipeline stage), or a single module.
        optimizer: a ``MegatronOptimizer`` (``DistributedOptimizer``, ``ChainedOptimizer``, ...) or NeMo's
            wrapper around one.
    """

    def __init__(self, model_chunks: nn.Module | Sequence[nn.Module], optimizer: Any) -> None:
        from megatron_patches import optimizer_state as ms
        from megatron_patches import rng as mrng

        self._ms = ms
        self._rng = mrng
        self.chunks: list[nn.Module] = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
        self.optimizer = _unwrap_optimizer(optimizer)
        self.parts = ms.optimizer_parts(self.optimizer)
        kinds = {ms.is_distributed(p) for p in self.parts}
        if len(kinds) != 1:
            raise TypeError("a ChainedOptimizer mixing distributed and non-distributed optimizers is not supported")
        self.distributed_optimizer = kinds.pop()
        self.expert_params = [n for c in self.chunks for n, p in c.named_parameters()
                              if getattr(p, "allreduce", True) is False]
        """Expert-parallel params (mcore's ``allreduce = False``): sharded over the expert-data-parallel group."""
        if self.expert_params and not self.distributed_optimizer:
            raise TopologyError(
                f"{len(self.expert_params)} expert-parallel params (e.g. {self.expert_params[0]}) under a replicated "
                "optimizer: neighbor_ckpt backs replicated state up lazily from a data-parallel peer, and with expert "
                "parallelism that peer holds other experts. Use the distributed optimizer "
                "(use_distributed_optimizer=True), which neighbor_ckpt snapshots exactly for experts too.")
        self._names: dict[int, str] = {}
        for ci, chunk in enumerate(self.chunks):
            for name, p in chunk.named_parameters():
                self._names.setdefault(id(p), f"{ci}.{name}")
        self._states = [ms.param_states(p) for p in self.parts]
        self.buffers = [b for ci, chunk in enumerate(self.chunks) for b in classify_buffers(chunk, prefix=f"{ci}.")]
        """Every module buffer of every chunk with its kind, classified once."""
        covered = {id(s.model_param) for states in self._states for s in states}
        if self.distributed_optimizer:
            # Under the distributed optimizer a rank only steps the params its shard touches; the others are
            # stepped elsewhere. Params nobody steps (frozen) would not be regenerated: say so once.
            frozen = [n for c in self.chunks for n, p in c.named_parameters() if not p.requires_grad]
            if frozen:
                logger.warning("frozen params are not in any optimizer shard and are not snapshotted; they must be "
                               "re-created identically on restart: %s", frozen[:5])
        else:
            missing = [n for pid, n in self._names.items() if pid not in covered]
            if missing:
                logger.warning("params not stepped by the optimizer are carried as weights only: %s", missing[:5])

    def _name(self, p: torch.Tensor) -> str:
        try:
            return self._names[id(p)]
        except KeyError:
            raise TypeError("the optimizer steps a parameter that is not in the given model chunks; pass every "
                            "model chunk the optimizer was built for") from None

    # -- StateAdapter ----------------------------------------------------------------------------------

    def named_tensors(self) -> list[tuple[TensorMeta, torch.Tensor]]:
        out: list[tuple[TensorMeta, torch.Tensor]] = []
        for ci, chunk in enumerate(self.chunks):
            for name, p in chunk.named_parameters():
                if self._names[id(p)] == f"{ci}.{name}":  # tied weights: once
                    t = p.detach()
                    out.append((TensorMeta.of(f"model/{ci}.{name}", StateKind.WEIGHT, t), t))
        for part, states in zip(self.parts, self._states):
            inner_state = part.optimizer.state
            for s in states:
                name = self._name(s.model_param)
                if s.main_param is not None:
                    t = s.main_param.detach()
                    out.append((TensorMeta.of(f"main/{name}", StateKind.MAIN_PARAM, t), t))
                for key, v in inner_state.get(s.stepped, {}).items():
                    if isinstance(v, torch.Tensor):
                        out.append((TensorMeta.of(f"optim/{name}/{key}", StateKind.OPTIMIZER, v), v))
        out += buffer_tensors(self.buffers)
        return out

    def layout_key(self) -> Any:
        """The shard ranges in mcore's buffers: a snapshot taken with another DP size, bucket size or param
        order has other ranges and is refused."""
        return [self._ms.shard_layout(p, self._names) for p in self.parts]

    def materialize(self) -> None:
        for part in self.parts:
            self._ms.materialize_state(part)

    def dp_shards(self) -> dict[str, tuple[int, int, int]] | None:
        """The fp32 main-param shard and each moment of it are slices of the flattened param: ``(param numel, start,
        end)`` from mcore's shard ranges (elastic resharding cuts the same params for another DP size). None with
        expert parallelism: an expert's local name is the same on every EP rank while the expert is another one, and
        its shards live in the expert-data-parallel group; resharding those is not supported."""
        if self.expert_params:
            return None
        out: dict[str, tuple[int, int, int]] = {}
        for part, states in zip(self.parts, self._states):
            spans = self._ms.shard_spans(part)
            inner_state = part.optimizer.state
            for s in states:
                span = spans.get(id(s.model_param))
                if span is None:
                    continue
                name = self._name(s.model_param)
                n = span[2] - span[1]
                if s.main_param is not None and s.main_param.numel() == n:
                    out[f"main/{name}"] = span
                for key, v in inner_state.get(s.stepped, {}).items():
                    if isinstance(v, torch.Tensor) and v.numel() == n and v.dim() > 0:
                        out[f"optim/{name}/{key}"] = span
        return out

    def capture_extras(self) -> dict[str, Any]:
        groups = [[{k: v for k, v in g.items() if k != "params"} for g in part.optimizer.param_groups]
                  for part in self.parts]
        scalars: dict[str, dict[str, Any]] = {}
        for part, states in zip(self.parts, self._states):
            for s in states:
                st = part.optimizer.state.get(s.stepped, {})
                plain = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
                if plain:
                    scalars[self._name(s.model_param)] = plain
        scalers = []
        for part in self.parts:
            gs = self._ms.grad_scaler_of(part)
            scalers.append(None if gs is None else gs.state_dict())
        return {"param_groups": groups, "scalars": scalars, "grad_scalers": scalers,
                "rng_tracker": self._rng.tracker_states()}

    def load(self, tensors: Mapping[str, torch.Tensor], extras: Mapping[str, Any]) -> None:
        if len(extras["param_groups"]) != len(self.parts):
            raise SnapshotMismatchError(f"snapshot has {len(extras['param_groups'])} optimizers, this job "
                                        f"{len(self.parts)}")
        self.materialize()
        with torch.no_grad():
            if not self.distributed_optimizer:
                for ci, chunk in enumerate(self.chunks):
                    for name, p in chunk.named_parameters():
                        key = f"model/{ci}.{name}"
                        if key in tensors:
                            p.detach().copy_(tensors[key])
            for part, states in zip(self.parts, self._states):
                for s in states:
                    name = self._name(s.model_param)
                    if s.main_param is not None:
                        s.main_param.detach().copy_(_need(tensors, f"main/{name}"))
                    st = part.optimizer.state[s.stepped]
                    for key, v in st.items():
                        if isinstance(v, torch.Tensor):
                            v.copy_(_need(tensors, f"optim/{name}/{key}"))
                    st.update(extras["scalars"].get(name, {}))
        load_buffers(self.buffers, tensors)
        for part, groups in zip(self.parts, extras["param_groups"]):
            if len(groups) != len(part.optimizer.param_groups):
                raise SnapshotMismatchError("snapshot has another number of optimizer param groups")
            for live, saved in zip(part.optimizer.param_groups, groups):
                live.update(saved)
        for part, saved in zip(self.parts, extras["grad_scalers"]):
            gs = self._ms.grad_scaler_of(part)
            if gs is not None and saved is not None:
                gs.load_state_dict(saved)
        self._rng.set_tracker_states(extras.get("rng_tracker", {}))

    def regenerate(self, dp_group: dist.ProcessGroup | None) -> None:
        """Distributed optimizer: weights <- main-param shards, then param all-gather over the DP group."""
        if self.distributed_optimizer:
            self._ms.regenerate_weights(self.optimizer, self.chunks)


def _need(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise SnapshotMismatchError(f"restored state lacks {key!r}: the snapshot was taken with another model or "
                                    f"optimizer") from None
