"""Test worker: a tiny GPT trained by Megatron-Bridge's own ``pretrain(cfg, forward_step, callbacks=[...])``, CPU, gloo.

What a Bridge user's script is, plus ``enable_cpu(nemo=False)`` before ``import megatron.bridge`` and a recording
callback: 2 layers, hidden 64, seq 32, mock data, the distributed optimizer, megatron-core's local layer spec (the
default GPT provider picks Transformer Engine's), dropout on (so the RNG tracker's seeding matters).

Environment: OUT_DIR; STEPS (default 5), TP (1), SEED (1234), DIST_OPT (1|0), TB_DIR (Bridge's logger.tensorboard_dir;
unset: none), BRIDGE_CKPT_EVERY (0: Bridge's own
checkpoint every N steps in OUT_DIR/bridge_checkpoints, loaded on a restart), OTHER_DATA_AFTER_RESTART (1: a restarted
attempt's mock data has another seed). Leaves in OUT_DIR:
``losses.rank{r}.jsonl`` (step, attempt, loss as float.hex, consumed samples after the step: the format
``tests.conftest.RunResult.losses`` reads) and ``final.rank{r}.json`` (sha256 of every final parameter and of the
optimizer's fp32 shard state, the step, consumed and skipped samples and FLOPs counter Bridge reached).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import append_jsonl, attempt, fingerprint, write_json  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def main() -> None:
    from megatron_patches import enable_cpu

    enable_cpu(nemo=False)  # before Bridge is imported: its CPU patches apply as its modules are imported

    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    cfg, record = build()
    pretrain(cfg, forward_step, callbacks=[record])


def build() -> tuple[Any, Any]:
    """The ``ConfigContainer`` of this worker's job (from the environment) and its recording callback (also
    used by ``train_bridge_nckpt.py``). Call after ``enable_cpu(nemo=False)``."""
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, DistributedDataParallelConfig,
                                                 DistributedInitConfig, LoggerConfig, MockGPTDatasetConfig,
                                                 OptimizerConfig, RNGConfig, SchedulerConfig, TokenizerConfig,
                                                 TrainingConfig)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    out = Path(os.environ["OUT_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    ckpt_every = int(os.environ.get("BRIDGE_CKPT_EVERY", "0"))
    ckpt_dir = str(out / "bridge_checkpoints") if ckpt_every else None
    steps, tp = int(os.environ.get("STEPS", "5")), int(os.environ.get("TP", "1"))
    seed, dist_opt = int(os.environ.get("SEED", "1234")), os.environ.get("DIST_OPT", "1") == "1"
    # a restarted attempt that reads other data (the data check's test): the mock dataset's seed changes after a restart
    data_seed = seed + 1 if os.environ.get("OTHER_DATA_AFTER_RESTART") == "1" and attempt() > 0 else seed
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro_batch, seq = 2, 32
    global_batch = micro_batch * (world // tp) * 2  # two micro-batches per data-parallel rank

    class Record(Callback):
        """Losses of every step (on_train_step_end: step i completed, ``train_state.step`` still i) and the final
        state (on_train_end)."""

        def on_train_step_end(self, context: Any) -> None:
            ts = context.state.train_state
            loss = context.loss_dict.get("lm loss") if context.loss_dict else None
            append_jsonl(out / f"losses.rank{RANK}.jsonl", {
                "step": ts.step, "attempt": attempt(),
                "loss": None if loss is None else float(loss).hex(),
                "consumed_samples": ts.consumed_train_samples + global_batch})  # Bridge adds it after this event

        def on_train_end(self, context: Any) -> None:
            ts = context.state.train_state
            params = {f"{i}/{n}": p for i, m in enumerate(context.model) for n, p in m.named_parameters()}
            shards: dict[str, torch.Tensor] = {}
            for k, opt in enumerate(getattr(context.optimizer, "chained_optimizers", [context.optimizer])):
                for gi, group in enumerate(opt.optimizer.param_groups):
                    for pi, p in enumerate(group["params"]):
                        shards[f"{k}/{gi}/{pi}/param"] = p
                        for name, v in opt.optimizer.state.get(p, {}).items():
                            if isinstance(v, torch.Tensor):
                                shards[f"{k}/{gi}/{pi}/{name}"] = v
            write_json(out / f"final.rank{RANK}.json", {
                "step": ts.step, "consumed_samples": ts.consumed_train_samples,
                "skipped_samples": ts.skipped_train_samples, "flops": float(ts.floating_point_operations_so_far).hex(),
                "params": fingerprint(params), "optimizer": fingerprint(shards)})

    model = GPTModelProvider(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=seq,
        vocab_size=None, make_vocab_size_divisible_by=64,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, sequence_parallel=False,
        transformer_layer_spec=get_gpt_layer_local_spec(), bf16=False, fp16=False,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, attention_softmax_in_fp32=True,
        hidden_dropout=0.1, attention_dropout=0.1, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, cross_entropy_loss_fusion=False)
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=steps, global_batch_size=global_batch,
                             micro_batch_size=micro_batch, eval_interval=10_000, eval_iters=0,
                             exit_signal_handler=False),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01, bf16=False,
                                  fp16=False, clip_grad=1.0, use_distributed_optimizer=dist_opt,
                                  use_precision_aware_optimizer=False),
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=1, lr_decay_iters=steps,
                                  start_weight_decay=0.01, end_weight_decay=0.01,
                                  weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, overlap_grad_reduce=False,
                                          overlap_param_gather=False, grad_reduce_in_fp32=True,
                                          check_for_nan_in_grad=True),
        dist=DistributedInitConfig(distributed_backend="gloo"),
        dataset=MockGPTDatasetConfig(seq_length=seq, random_seed=data_seed, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                     dataloader_type="single", num_workers=0),
        logger=LoggerConfig(log_interval=1, tensorboard_dir=os.environ.get("TB_DIR") or None),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=256),
        checkpoint=CheckpointConfig(save=ckpt_dir, load=ckpt_dir, save_interval=ckpt_every or None),
        rng=RNGConfig(seed=seed),
    )
    return cfg, Record()


if __name__ == "__main__":
    main()
