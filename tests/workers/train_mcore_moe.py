"""Test worker: a tiny megatron-core mixture-of-experts GPT on CPU/gloo (``megatron_patches.enable_cpu()``).

4 experts of FFN 96, top-2, SequentialMLP (no grouped GEMM), the local layer spec, mcore DistributedDataParallel and
the distributed optimizer (``get_megatron_optimizer``: a ChainedOptimizer of the dense and the expert optimizers),
dropout on, snapshotted every iteration by neighbor_ckpt (``NeighborCheckpointer`` with the Megatron adapter, mcore's
DP group, the step hooks) as ``recipes/mcore_gpt_plain_loop.py`` does. Run under ``torchrun --nproc-per-node 4``.

Environment: OUT_DIR (per-rank losses ``losses.rank<r>.jsonl``, ``final.rank<r>.json``, ``report.rank<r>.attempt<a>.json``),
TEST_STORE_BASE and WIPE_RANKS (``common.setup_store_env``), STEPS (8), TP (1), EP (2), ETP (expert tensor parallel
size; default: TP), DISPATCHER (alltoall|allgather),
ROUTER (``bias``: sigmoid scores with an aux-loss-free expert bias, the default; ``aux``: softmax scores with the
load-balancing aux loss), DIST_OPT (1|0), NCKPT (1|0: neighbor_ckpt on, the default), KILL_RANK and KILL_STEP
(SIGKILL that rank at the start of that step, first attempt only).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import setup_store_env  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SEQ, VOCAB, HIDDEN, HEADS, LAYERS, EXPERTS, TOPK, EXPERT_FFN = 32, 128, 64, 4, 2, 4, 2, 96


def build_moe_gpt(*, tp: int, ep: int, dispatcher: str, router: str, dist_opt: bool, steps: int,
                  micro_batch_size: int = 2, micro_batches: int = 2, etp: int | None = None) -> dict[str, Any]:
    """Parallel state, seeds, the MoE ``GPTModel`` in mcore DDP, its optimizer and scheduler."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    routing = (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=1e-2, moe_router_load_balancing_type="none")
               if router == "bias" else
               dict(moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
                    moe_aux_loss_coeff=1e-2))
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, attention_dropout=0.1, hidden_dropout=0.1,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, moe_grouped_gemm=False,
        moe_token_dispatcher_type=dispatcher, **routing, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS,
                                                                                   moe_grouped_gemm=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ).cuda()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, bucket_size=4096)
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01,
                                                       clip_grad=1.0, use_distributed_optimizer=dist_opt),
                                       [ddp_model])
    config.no_sync_func = ddp_model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    global_batch = micro_batch_size * micro_batches * dp_size
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4,
                                        lr_warmup_steps=global_batch, lr_decay_steps=(steps + 1) * global_batch,
                                        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=1,
                                        wd_incr_style="constant")
    return dict(config=config, model=ddp_model, optimizer=optimizer, scheduler=scheduler, dp_rank=dp_rank,
                dp_size=dp_size, global_batch=global_batch, mbs=micro_batch_size, n_mb=micro_batches)


def expert_biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every router's ``expert_bias`` buffer, by module name."""
    return {name: buf for name, buf in model.named_buffers() if name.endswith("expert_bias")}


def _sha(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:24]
            for k, t in sorted(tensors.items())}


def fingerprints(gpt: dict[str, Any]) -> dict[str, Any]:
    inner = [part.optimizer for part in getattr(gpt["optimizer"], "chained_optimizers", [gpt["optimizer"]])]
    module = gpt["model"].module
    return {
        "params": _sha(dict(module.named_parameters())),
        "optim": _sha({f"{i}.{j}.{k}": v for i, o in enumerate(inner) for j, st in enumerate(o.state.values())
                       for k, v in st.items() if isinstance(v, torch.Tensor)}),
        "expert_bias": {k: [float(x).hex() for x in v.tolist()] for k, v in sorted(expert_biases(module).items())},
        "scheduler": gpt["scheduler"].state_dict()["num_steps"],
        "param_groups": [[float(g["lr"]).hex(), g.get("step")] for o in inner for g in o.param_groups],
        "chained": len(inner),
    }


def main() -> None:
    env = os.environ
    logging.basicConfig(level=logging.INFO, format=f"[rank{RANK}] %(name)s %(levelname)s %(message)s")
    from megatron_patches import enable_cpu

    enable_cpu(nemo=False)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_patches import install_hooks, mcore_groups
    from neighbor_ckpt import NeighborCheckpointer, NeighborCkptConfig, prepare_torchrun_restart
    from neighbor_ckpt.adapters.megatron import MegatronOptimizerAdapter

    out = Path(env["OUT_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    steps = int(env.get("STEPS", "8"))
    kill_rank, kill_step = int(env.get("KILL_RANK", "-1")), int(env.get("KILL_STEP", "-1"))
    nckpt = env.get("NCKPT", "1") == "1"
    if nckpt:
        setup_store_env(RANK)
        prepare_torchrun_restart()  # a fresh rendezvous store per torchrun attempt
    dist.init_process_group("gloo")
    gpt = build_moe_gpt(tp=int(env.get("TP", "1")), ep=int(env.get("EP", "2")), etp=int(env.get("ETP", "0")) or None,
                        dispatcher=env.get("DISPATCHER", "alltoall"), router=env.get("ROUTER", "bias"),
                        dist_opt=env.get("DIST_OPT", "1") == "1", steps=steps)
    ddp_model, optimizer, scheduler = gpt["model"], gpt["optimizer"], gpt["scheduler"]
    mbs, n_mb, dp_rank, global_batch = gpt["mbs"], gpt["n_mb"], gpt["dp_rank"], gpt["global_batch"]
    consumed, first_step, ckpt, hooks = 0, 0, None, None
    if nckpt:
        groups = mcore_groups()
        ckpt = NeighborCheckpointer(NeighborCkptConfig(), adapter=MegatronOptimizerAdapter([ddp_model], optimizer),
                                    dp_group=groups.dp_group, model_parallel_coord=groups.coord)
        hooks = install_hooks(ckpt, optimizer)
        result = ckpt.recover()
        if result.restored:
            scheduler.load_state_dict(result.user_state["scheduler"])
            consumed = result.user_state["consumed_samples"]
        first_step = result.next_step
        (out / f"report.rank{RANK}.attempt{ATTEMPT}.json").write_text(
            json.dumps(result.report.to_dict(), indent=1, sort_keys=True))

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(consumed * 7919 + dp_rank)
        for _ in range(n_mb):
            tokens = torch.randint(0, VOCAB, (mbs, SEQ + 1), generator=g)
            yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                   "position_ids": torch.arange(SEQ).unsqueeze(0).expand(mbs, SEQ)}

    def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):  # noqa: ANN202
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(output_tensor: torch.Tensor):  # noqa: ANN202
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    forward_backward = get_forward_backward_func()
    for step in range(first_step, steps):
        if RANK == kill_rank and step == kill_step and ATTEMPT == 0:
            logging.getLogger(__name__).warning("fault injection: SIGKILL of rank %d at step %d", RANK, step)
            os.kill(os.getpid(), signal.SIGKILL)
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=batches(), model=[ddp_model],
                                  num_microbatches=n_mb, seq_length=SEQ, micro_batch_size=mbs,
                                  decoder_seq_length=SEQ, forward_only=False)
        loss = float(torch.stack([d["lm loss"] for d in losses]).mean())
        with open(out / f"losses.rank{RANK}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": loss.hex(), "attempt": ATTEMPT}) + "\n")
        ok, _, _ = optimizer.step()
        if not ok:
            raise RuntimeError(f"optimizer step {step} was skipped (non-finite gradients)")
        scheduler.step(increment=global_batch)
        consumed += global_batch
        if ckpt is not None:
            ckpt.snapshot(step, user_state={"scheduler": scheduler.state_dict(), "consumed_samples": consumed})
    if ckpt is not None:
        hooks.remove()
        plan = ckpt.plan
        ckpt.close(success=True)
        module = ddp_model.module
        (out / f"plan.rank{RANK}.json").write_text(json.dumps({
            "ep_rank": groups.ep_rank, "ep_size": groups.ep_size, "expert_dp_size": groups.expert_dp_size,
            "dp_size": groups.dp_size,
            "expert_params": sum(p.numel() for p in module.parameters() if getattr(p, "allreduce", True) is False),
            "dense_params": sum(p.numel() for p in module.parameters() if getattr(p, "allreduce", True)),
            "unique": [[p.meta.name, p.meta.kind.value, p.disposition.value, p.meta.nbytes] for p in plan.unique],
            "regenerable": [m.name for m in plan.regenerable], "lazy": [p.meta.name for p in plan.lazy]}, indent=1))
    (out / f"final.rank{RANK}.json").write_text(json.dumps(fingerprints(gpt), indent=1, sort_keys=True))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
