"""Megatron-Core / NeMo internals: the only package that patches them (see the Megatron/NeMo issue).

* :mod:`megatron_patches._versions` — the megatron-core / NeMo releases these patches were written against
  (:data:`SUPPORTED`) and :func:`check_versions`, which refuses anything else with a message saying what to pin;
* :mod:`megatron_patches.cpu` — :func:`enable_cpu`: run unmodified megatron-core training code on CPU-only
  torch with gloo, for smoke runs and tests only (refuses on machines with CUDA); :mod:`megatron_patches.moe` — its
  mixture-of-experts entries; :mod:`megatron_patches.device_mode` — the CUDA-to-CPU torch-function mode both use;
* :mod:`megatron_patches.step_tags` — optimizer step-phase tags; :mod:`megatron_patches.traffic` — the
  "training traffic in flight" signal from mcore DDP collectives; :mod:`megatron_patches.hooks` — both at once;
* :mod:`megatron_patches.groups` — the DP group and (TP, PP) coordinate mcore created;
* :mod:`megatron_patches.optimizer_state` / :mod:`megatron_patches.rng` — where mcore optimizers keep each
  rank's state, and mcore's RNG tracker streams (read-only access used by the Megatron adapter);
* :mod:`megatron_patches.distopt_load` — loading a distributed-optimizer checkpoint into an fp32 model under
  ``no_grad`` (NeMo's disk resume, our insurance fallback);
* :mod:`megatron_patches.nemo_telemetry` — NeMo's OneLogger telemetry spans a failed in-process attempt left open,
  stopped before the next attempt (else its ``on_train_start`` refuses to start);
* :mod:`megatron_patches.bridge` — Megatron-Bridge 0.6: its CPU patches (applied by ``enable_cpu(nemo=False)``
  before ``import megatron.bridge``), ``data_init`` (Bridge's own ``on_data_init_start`` event read into what
  :class:`neighbor_ckpt.bridge.NeighborCheckpoint` restores in) and ``on_pretrain_config`` (the configuration check
  at the start of ``pretrain``, before Bridge could wrap it in its own in-process restart);
* :mod:`megatron_patches.fused_adam` — apex FusedAdam's semantics for mcore's Adam on a GPU image without
  Transformer Engine or apex (the GPU benchmark).

``import megatron_patches`` imports neither megatron nor NeMo. Of ours it may import only :mod:`neighbor_ckpt.errors`
(the rule: :data:`neighbor_ckpt.layers.LAYERS`, checked by ``tests/unit/test_layers.py``).
"""

from __future__ import annotations

from typing import Any

# The API README shows; everything else is imported from its module.
from megatron_patches.groups import mcore_groups
from megatron_patches.hooks import install_hooks

__all__ = ["enable_cpu", "mcore_groups", "install_hooks"]


def __getattr__(name: str) -> Any:
    if name == "enable_cpu":
        from megatron_patches.cpu import enable_cpu

        return enable_cpu
    raise AttributeError(f"module 'megatron_patches' has no attribute {name!r}")
