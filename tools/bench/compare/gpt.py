"""The GPT every variant trains: recipes/mcore_gpt_plain_loop.py's model, optimizer and scheduler, with the shape and
the --device cuda lines as parameters.

Why this is a copy of the recipe's lines and not an import of them: the recipe builds its model inline in ``main()``
(it is the example a user reads, top to bottom), so there is no builder to import; ``recipes/`` is not installed with
the package (setup.cfg excludes it), while ``neighbor-ckpt bench --compare`` must run from an installed package; and the
benchmark needs what the recipe has no switch for (hidden size and depth for the scaling runs, bf16 on GPUs). So the
copy is kept in this one place, and ``tests/unit/test_bench_compare.py`` reads the recipe's source and fails when its
shape or any literal setting of its ``TransformerConfig``, ``DistributedDataParallelConfig``, ``OptimizerConfig`` or
``OptimizerParamScheduler`` differs from the ``RECIPE_*`` values below.
"""

from __future__ import annotations

from typing import Any

# The recipe's shape (recipes/mcore_gpt_plain_loop.py): SEQ, VOCAB, HIDDEN, HEADS, LAYERS = 32, 128, 64, 4, 2.
SEQ, VOCAB, HIDDEN, HEADS, LAYERS = 32, 128, 64, 4, 2
RECIPE_TRANSFORMER = dict(use_cpu_initialization=True,
                          gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                          bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
                          apply_rope_fusion=False)
"""The literal settings of the recipe's ``TransformerConfig`` (the shape and the parallel sizes are set apart)."""
RECIPE_DROPOUT = 0.1
"""The recipe's default attention and hidden dropout (``build_gpt(dropout=...)``)."""
RECIPE_DDP = dict(bucket_size=4096)
"""The literal settings of the recipe's ``DistributedDataParallelConfig``."""
RECIPE_OPTIMIZER = dict(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01, clip_grad=1.0)
"""The literal settings of the recipe's ``OptimizerConfig``."""
RECIPE_SCHEDULER = dict(init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                        wd_incr_steps=1, wd_incr_style="constant")
"""The literal settings of the recipe's ``OptimizerParamScheduler``."""

# Model defaults per --device (a flag given on the command line always wins; the protocol's are in cli.py).
SHAPE_KEYS = ("hidden", "layers", "heads", "seq", "vocab", "micro_batches", "micro_batch_size")
CPU_SHAPE = {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "seq": SEQ, "vocab": VOCAB, "micro_batches": 2,
             "micro_batch_size": 2}
GPU_SHAPE = {"hidden": 1024, "layers": 16, "heads": 16, "seq": 2048, "vocab": 32768, "micro_batches": 4,
             "micro_batch_size": 4}
"""--device cuda: a GPT of about 270 M params (12 B/param of unique state: 3.2 GB per snapshot at DP = 1)."""


class Trainer:
    """One model + optimizer + scheduler, built as recipes/mcore_gpt_plain_loop.py builds them."""

    def __init__(self, *, hidden: int, layers: int, heads: int, seq: int, vocab: int, mbs: int, n_mb: int,
                 total_steps: int, device: str = "cpu") -> None:
        import torch
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer import TransformerConfig

        self.hidden, self.layers, self.seq, self.vocab = hidden, layers, seq, vocab
        self.device = device
        torch.manual_seed(1234)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        # ==== --device cuda: every difference from the recipe's lines below is here (Megatron-LM's --bf16) ====
        # bf16 params and activations (TransformerConfig.bf16 / params_dtype / pipeline_dtype), fp32 main params
        # and Adam moments in the distributed optimizer (OptimizerConfig.bf16), gradients reduced in fp32
        # (Megatron-LM forces accumulate_allreduce_grads_in_fp32 under --bf16), the model wrapped in mcore's
        # Float16Module as Megatron-LM's get_model does (casts the LayerNorms the local spec builds in fp32, returns
        # fp32 outputs), and weights initialized on the GPU (use_cpu_initialization=False, Megatron-LM's default:
        # mcore's CPU init of ~270 M params on one torch thread would take a good part of a 10-minute call; the
        # values differ from a CPU init, which does not matter for timing). The local layer spec stays: no
        # Transformer Engine is needed.
        tc_gpu: dict[str, Any] = {}
        opt_gpu: dict[str, Any] = {}
        ddp_gpu: dict[str, Any] = {}
        if device == "cuda":
            tc_gpu = {"bf16": True, "params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16,
                      "use_cpu_initialization": False}
            opt_gpu = {"bf16": True, "params_dtype": torch.bfloat16}
            ddp_gpu = {"grad_reduce_in_fp32": True}

        def wrap(model: Any) -> Any:
            if device != "cuda":
                return model
            from megatron.core.transformer.module import Float16Module

            return Float16Module(model.config, model)
        # ==== end of the --device cuda differences ====
        # --- from recipes/mcore_gpt_plain_loop.py (tp = pp = 1, distributed optimizer, no overlap) ---
        config = TransformerConfig(**{**dict(
            num_layers=layers, hidden_size=hidden, num_attention_heads=heads, tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1, pipeline_dtype=torch.float32, attention_dropout=RECIPE_DROPOUT,
            hidden_dropout=RECIPE_DROPOUT, **RECIPE_TRANSFORMER), **tc_gpu})
        model = wrap(GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                              max_sequence_length=seq, pre_process=True, post_process=True).cuda())
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False,
                                                   overlap_param_gather=False, **RECIPE_DDP, **ddp_gpu)
        self.ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(use_distributed_optimizer=True, **RECIPE_OPTIMIZER, **opt_gpu), [self.ddp])
        config.no_sync_func = self.ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        self.mbs, self.n_mb = mbs, n_mb
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.global_batch = mbs * n_mb * self.dp_size
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, lr_warmup_steps=3 * self.global_batch,
            lr_decay_steps=max(total_steps, 10) * self.global_batch, **RECIPE_SCHEDULER)
        # --- end of the recipe's lines ---
        self.forward_backward = get_forward_backward_func()
        self.consumed = 0
        self.params = sum(p.numel() for p in self.ddp.module.parameters())

    def batches(self) -> Any:
        import torch

        g = torch.Generator().manual_seed(self.consumed * 7919 + self.dp_rank)
        for _ in range(self.n_mb):
            tokens = torch.randint(0, self.vocab, (self.mbs, self.seq + 1), generator=g)
            batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                     "position_ids": torch.arange(self.seq).unsqueeze(0).expand(self.mbs, self.seq)}
            if self.device == "cuda":  # the same tokens (CPU generator), on this rank's GPU
                batch = {k: v.cuda() for k, v in batch.items()}
            yield batch

    def step(self) -> None:
        def forward_step(data_iterator: Any, model: Any) -> Any:
            batch = next(data_iterator)
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

            def loss_func(output_tensor: Any) -> Any:
                loss = output_tensor.float().mean()
                return loss, {"lm loss": loss.detach()}

            return output, loss_func

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.forward_backward(forward_step_func=forward_step, data_iterator=self.batches(), model=[self.ddp],
                              num_microbatches=self.n_mb, seq_length=self.seq, micro_batch_size=self.mbs,
                              decoder_seq_length=self.seq, forward_only=False)
        ok, _, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("optimizer step skipped (non-finite gradients)")
        self.scheduler.step(increment=self.global_batch)
        self.consumed += self.global_batch

    def user_state(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "consumed_samples": self.consumed}


def fused_adam_without_te() -> str:
    """--device cuda: make mcore's Adam the FusedAdam a GPU run of Megatron-LM uses; returns what runs.

    Without Transformer Engine or apex (the benchmark's GPU machine) megatron-core falls back to torch's AdamW, with
    which mcore_async and nvrx_local cannot save; :func:`megatron_patches.fused_adam.use_fused_adam_semantics` then
    gives it apex FusedAdam's semantics in unfused torch ops (slower than a fused kernel, the same in every
    variant). Call before ``get_megatron_optimizer``."""
    import megatron.core.optimizer as mo

    from megatron_patches.fused_adam import use_fused_adam_semantics

    if use_fused_adam_semantics() is None:
        return f"{mo.Adam.__module__}.{mo.Adam.__qualname__}"
    return ("megatron_patches.cpu.FusedAdamSemanticsAdam (apex FusedAdam semantics in unfused torch ops: neither "
            "Transformer Engine nor apex is installed)")
