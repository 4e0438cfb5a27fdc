"""The GPT every variant trains: the model, optimizer and scheduler of the recipe
``neighbor_ckpt/recipes/mcore_gpt_plain_loop.py`` (``recipes/`` in the checkout), built by the recipe's own
:func:`~neighbor_ckpt.recipes.mcore_gpt_plain_loop.build_gpt`, with the shape and the --device cuda precision
(Megatron-LM's --bf16) as its parameters; the data and the training step are the benchmark's.
"""

from __future__ import annotations

from typing import Any

from neighbor_ckpt.recipes.mcore_gpt_plain_loop import HEADS, HIDDEN, LAYERS, SEQ, VOCAB, build_gpt

# Model defaults per --device (a flag given on the command line always wins; the protocol's are in cli.py).
SHAPE_KEYS = ("hidden", "layers", "heads", "seq", "vocab", "micro_batches", "micro_batch_size")
CPU_SHAPE = {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "seq": SEQ, "vocab": VOCAB, "micro_batches": 2,
             "micro_batch_size": 2}
"""The recipe's own shape and batch (its defaults)."""
GPU_SHAPE = {"hidden": 1024, "layers": 16, "heads": 16, "seq": 2048, "vocab": 32768, "micro_batches": 4,
             "micro_batch_size": 4}
"""--device cuda: a GPT of about 270 M params (12 B/param of unique state: 3.2 GB per snapshot at DP = 1)."""


class Trainer:
    """One model + optimizer + scheduler from the recipe's :func:`build_gpt` (TP = PP = 1, distributed optimizer,
    no overlap), on the parallel state the worker initialized, and the benchmark's training step.

    ``--device cuda``: ``build_gpt(bf16=True, cpu_init=False)``, Megatron-LM's --bf16 (bf16 params and activations,
    fp32 main params and Adam moments in the distributed optimizer, gradients reduced in fp32, mcore's
    ``Float16Module``) with the weights initialized on the GPU (mcore's CPU init of ~270 M params on one torch thread
    would take a good part of a 10-minute call; the values differ from a CPU init, which does not matter for timing).
    The local layer spec stays: no Transformer Engine is needed."""

    def __init__(self, *, hidden: int, layers: int, heads: int, seq: int, vocab: int, mbs: int, n_mb: int,
                 total_steps: int, device: str = "cpu") -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.hidden, self.layers, self.seq, self.vocab = hidden, layers, seq, vocab
        self.device = device
        cuda = device == "cuda"
        gpt = build_gpt(steps=max(total_steps, 10), micro_batch_size=mbs, micro_batches=n_mb, hidden=hidden,
                        layers=layers, heads=heads, seq=seq, vocab=vocab, bf16=cuda, cpu_init=not cuda,
                        init_parallel=False)
        self.ddp, self.optimizer, self.scheduler = gpt.model, gpt.optimizer, gpt.scheduler
        self.mbs, self.n_mb = gpt.mbs, gpt.n_mb
        self.dp_rank, self.dp_size, self.dp_group = gpt.dp_rank, gpt.dp_size, gpt.dp_group
        self.global_batch = gpt.global_batch
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
