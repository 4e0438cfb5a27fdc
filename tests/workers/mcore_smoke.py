"""Smoke worker: an unmodified megatron-core 0.15 training loop on CPU under ``megatron_patches.cpu.enable_cpu()``.

Run with ``torchrun --standalone --nproc-per-node 4 tests/workers/mcore_smoke.py [--tp 2] [--pp 2]``.
Builds a tiny GPTModel (2 layers, hidden 64, 4 heads, vocab 128, seq 32, dropout 0.1), wraps it in mcore
``DistributedDataParallel`` + ``DistributedOptimizer`` (fp32 Adam), trains ``--steps`` steps through
``get_forward_backward_func()`` (so pipeline parallelism goes through the real schedules) and prints, from
rank 0, one JSON line per step (``{"step", "loss"`` as float.hex, ``"grad_norm"``...) and a final line with
sha256 fingerprints of every rank's parameters and optimizer state. Two runs with the same arguments must
print identical lines (except the ``"time_s"`` fields).

Not a pytest file. ``faulthandler.dump_traceback_later`` prints every thread's stack if a rank hangs.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_patches.cpu import enable_cpu  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=int(os.environ.get("TP", "1")))
    ap.add_argument("--pp", type=int, default=int(os.environ.get("PP", "1")))
    ap.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", "10")))
    ap.add_argument("--micro-batches", type=int, default=int(os.environ.get("MICRO_BATCHES", "2")))
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--overlap", action="store_true", default=os.environ.get("OVERLAP") == "1",
                    help="overlap_grad_reduce and overlap_param_gather (NeMo's defaults)")
    ap.add_argument("--hang-timeout", type=float, default=float(os.environ.get("HANG_TIMEOUT", "240")))
    return ap.parse_args()


SEQ, VOCAB, HIDDEN, HEADS, LAYERS = 32, 128, 64, 4, 2


def sha(t) -> str:  # noqa: ANN001
    c = t.detach().contiguous().view(-1)
    return hashlib.sha256(c.view(__import__("torch").uint8).numpy().tobytes()).hexdigest()[:16]


def sha_of(d: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def main() -> None:
    args = parse_args()
    faulthandler.dump_traceback_later(args.hang_timeout, exit=True)
    t_start = time.perf_counter()
    enable_cpu(nemo=False)

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                             pipeline_model_parallel_size=args.pp)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        attention_dropout=0.1, hidden_dropout=0.1,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    model.cuda()  # what a GPU script does; a no-op under enable_cpu()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               overlap_grad_reduce=args.overlap, overlap_param_gather=args.overlap,
                                               bucket_size=4096)
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True, clip_grad=1.0,
                                 bf16=False, fp16=False, weight_decay=0.01)
    optimizer = get_megatron_optimizer(opt_config, [ddp_model])
    config.no_sync_func = ddp_model.no_sync
    config.finalize_model_grads_func = finalize_model_grads

    dp_rank = parallel_state.get_data_parallel_rank()
    mbs, n_mb = args.micro_batch_size, args.micro_batches

    def batches(step: int):
        g = torch.Generator().manual_seed(10_000 * step + dp_rank)
        for _ in range(n_mb):
            tokens = torch.randint(0, VOCAB, (mbs, SEQ + 1), generator=g)
            yield {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "position_ids": torch.arange(SEQ).unsqueeze(0).expand(mbs, SEQ).contiguous(),
                "loss_mask": torch.ones(mbs, SEQ),
            }

    def forward_step(data_iterator, model):  # noqa: ANN001, ANN202
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(output_tensor):  # noqa: ANN001, ANN202
            loss = torch.sum(output_tensor.float().view(-1) * batch["loss_mask"].view(-1)) / batch["loss_mask"].sum()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    fwd_bwd = get_forward_backward_func()
    last_stage = parallel_state.is_pipeline_last_stage()
    n_last = dist.get_world_size() // args.pp
    t_train = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = fwd_bwd(forward_step_func=forward_step, data_iterator=batches(step), model=[ddp_model],
                         num_microbatches=n_mb, seq_length=SEQ, micro_batch_size=mbs, decoder_seq_length=SEQ,
                         forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError(f"optimizer step {step} was skipped")
        local = torch.stack([d["lm loss"] for d in losses]).mean() if last_stage else torch.zeros(())
        total = local.clone().double()
        dist.all_reduce(total)  # losses live on the last pipeline stage
        local_all = [None] * dist.get_world_size()
        dist.all_gather_object(local_all, float(local).hex() if last_stage else None)
        if rank == 0:
            print(json.dumps({"step": step, "loss": float(total / n_last).hex(), "loss_f": float(total / n_last),
                              "grad_norm": float(grad_norm).hex() if grad_norm is not None else None,
                              "rank_losses": local_all, "time_s": round(time.perf_counter() - t0, 3)}),
                  flush=True)

    params = {n: sha(p) for n, p in ddp_model.module.named_parameters()}
    opt_state = {f"{i}.{k}": sha(v) for i, st in enumerate(optimizer.optimizer.state.values()) for k, v in st.items()}
    fp = {"params": sha_of(params), "opt": sha_of(opt_state), "n_opt_tensors": len(opt_state),
          "steps": sorted({g.get("step") for g in optimizer.optimizer.param_groups if g["params"]})}
    fps = [None] * dist.get_world_size()
    dist.all_gather_object(fps, fp)
    if rank == 0:
        print(json.dumps({"final": fps, "train_s": round(time.perf_counter() - t_train, 2),
                          "total_s": round(time.perf_counter() - t_start, 2),
                          "tp": args.tp, "pp": args.pp, "overlap": args.overlap, "dp": parallel_state.get_data_parallel_world_size()}),
              flush=True)
    faulthandler.cancel_dump_traceback_later()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
