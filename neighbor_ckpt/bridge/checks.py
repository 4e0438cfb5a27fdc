"""What the Megatron-Bridge callback refuses, by name, before anything is built (pure: reads the ConfigContainer)."""

from __future__ import annotations

from typing import Any

from neighbor_ckpt.errors import ConfigError

__all__ = ["ALLOWED_OPTIMIZERS", "check_bridge_config"]

ALLOWED_OPTIMIZERS = frozenset({"adam"})
"""``cfg.optimizer.optimizer`` values whose state the Megatron adapter knows (Adam's ``exp_avg`` / ``exp_avg_sq`` per
main-param shard; ``adam`` is megatron-core's Adam and AdamW, by ``weight_decay``). Anything else (sgd, muon, lion,
layer-wise optimizers, ...) keeps state the snapshot would silently miss."""


def check_bridge_config(cfg: Any) -> None:
    """Refuse a Megatron-Bridge configuration that neighbor checkpointing cannot restore exactly.

    Raises:
        ConfigError: naming the option, for: Bridge's in-process restart (``inprocess_restart.enabled``: it aborts and
            re-enters ``pretrain`` with its own store and reloads its disk checkpoint over ours; ours is
            :mod:`neighbor_ckpt.bridge.inprocess`, and the two cannot both run), Bridge's NVRx local checkpointing
            (``checkpoint.non_persistent_ckpt_type: local``, or ``in_memory``: loaded by Bridge before our restore, so
            the two would restore over each other; Bridge's persistent checkpoint stays the insurance), a full CUDA
            graph around ``forward_backward`` (``model.cuda_graph_impl: local`` with ``full_iteration`` in
            ``cuda_graph_scope``: the step tags and the wait point cannot run inside a captured graph), Megatron FSDP
            or torch FSDP2
            (``dist.use_megatron_fsdp`` / ``dist.use_torch_fsdp2``: parameters are not in megatron-core's DDP buffers
            the adapter reads) and an optimizer outside :data:`ALLOWED_OPTIMIZERS`.
    """
    problems: list[str] = []
    inproc = getattr(cfg, "inprocess_restart", None)
    if inproc is not None and getattr(inproc, "enabled", False):
        problems.append("inprocess_restart.enabled: Megatron-Bridge's in-process restart (nvidia-resiliency-ext's "
                        "deprecated wrapper around _pretrain, which reloads the disk checkpoint) would restore over "
                        "neighbor checkpointing's; turn it off and use ours: neighbor_ckpt.inprocess.enabled "
                        "under `neighbor-ckpt launch` (hot spares, pretrain called again in the surviving processes: "
                        "neighbor_ckpt.bridge.inprocess), or the restart path (torchrun --max-restarts; the snapshots "
                        "restore it)")
    ckpt_type = getattr(getattr(cfg, "checkpoint", None), "non_persistent_ckpt_type", None)
    if ckpt_type in ("local", "in_memory"):
        problems.append(f"checkpoint.non_persistent_ckpt_type: {ckpt_type!r}: Megatron-Bridge's local checkpointing "
                        "(nvidia-resiliency-ext's LocalCheckpointManager) restores over neighbor checkpointing's "
                        "in-memory version; leave it unset (or 'global') and keep checkpoint.save as the insurance")
    model = getattr(cfg, "model", None)
    impl = getattr(model, "cuda_graph_impl", "none")
    scope = getattr(model, "cuda_graph_scope", None)
    scopes = scope if isinstance(scope, (list, tuple)) else [scope]
    if impl == "local" and any("full_iteration" in str(getattr(s, "name", s)) for s in scopes):
        problems.append("model.cuda_graph_impl: local with cuda_graph_scope full_iteration: a full CUDA graph around "
                        "forward_backward leaves no place for the wait point and step tags; use per-layer graphs "
                        "(cuda_graph_scope attn/mlp) or none")
    dist_cfg = getattr(cfg, "dist", None)
    for key in ("use_megatron_fsdp", "use_torch_fsdp2"):
        if getattr(dist_cfg, key, False):
            problems.append(f"dist.{key}: FSDP keeps parameters outside megatron-core's DDP buffers, which the "
                            "snapshot reads; use megatron-core DDP with the distributed optimizer")
    opt = getattr(getattr(cfg, "optimizer", None), "optimizer", "adam")
    if opt not in ALLOWED_OPTIMIZERS:
        problems.append(f"optimizer.optimizer: {opt!r} is not supported (its state is not Adam's, which the snapshot "
                        f"holds); supported: {', '.join(sorted(ALLOWED_OPTIMIZERS))}")
    if len(problems) == 1:
        raise ConfigError(f"NeighborCheckpoint cannot run with this Megatron-Bridge configuration: {problems[0]}")
    if problems:
        raise ConfigError("NeighborCheckpoint cannot run with this Megatron-Bridge configuration:\n  - "
                          + "\n  - ".join(problems))
