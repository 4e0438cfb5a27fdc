"""Test worker: a hand-written megatron-core loop (GPTModel, mcore DDP, distributed optimizer,
``get_forward_backward_func``) whose micro-batches come from a real ``DataLoader``, for the data-position check.

Environment: OUT_DIR, TEST_STORE_BASE (see ``common.setup_store_env``), STEPS, KILL_RANK, KILL_STEP (SIGKILL inside
that optimizer step, first attempt only), NCKPT_CONFIG (a YAML file with a neighbor_ckpt: section), and LOADER:

* ``reshuffle``: what a user writes first (Megatron-LM's ``examples/run_simple_mcore_train_loop.py``):
  ``DataLoader(dataset, shuffle=True)``, its iterator created after ``recover()``. Its shuffle seed comes from the
  global RNG, which ``recover()`` restored, and it starts at the beginning of an epoch: after a restart every step
  gets other batches;
* ``stateful``: docs/data-position.md: torchdata's ``StatefulDataLoader`` with its own generators,
  its ``state_dict()`` in every snapshot's ``user_state``, loaded after ``recover()``: the exact batches.

With OBSERVE=1 (default) the data iterator handed to ``forward_backward_func`` is wrapped by
``install_hooks(...).observe``; with OBSERVE=0 nothing is wrapped by hand: ``install_hooks`` alone feeds the check
(``megatron_patches.data_iter`` observes what megatron-core's forward-backward function draws). TP, PP: tensor and
pipeline parallel sizes (default 1; the data-parallel rank picks the data, so tensor-parallel peers read the same);
N_MB: micro-batches per step (default 2). Writes per rank: ``losses.rank<R>.jsonl``, ``final.rank<R>.json``,
``error.rank<R>.json`` (the exception that stopped the rank, if any).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import append_jsonl, attempt, setup_store_env, write_json  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
SEQ, VOCAB, HIDDEN, HEADS, LAYERS = 32, 128, 64, 4, 2
MBS, N_MB = 2, int(os.environ.get("N_MB", "2"))
TP, PP = int(os.environ.get("TP", "1")), int(os.environ.get("PP", "1"))
SAMPLES_PER_RANK = 24  # 6 steps per epoch: the kill at step 5 is mid-epoch, and the resumed run crosses an epoch boundary


class TokenDataset(torch.utils.data.Dataset):
    """Fixed random token sequences, a different slice per DP rank."""

    def __init__(self, dp_rank: int) -> None:
        g = torch.Generator().manual_seed(4321 + dp_rank)
        self.data = torch.randint(0, VOCAB, (SAMPLES_PER_RANK, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.data[i, :-1], "labels": self.data[i, 1:]}


def make_loader(kind: str, dp_rank: int) -> Any:
    ds = TokenDataset(dp_rank)
    if kind == "reshuffle":
        return torch.utils.data.DataLoader(ds, batch_size=MBS, shuffle=True, drop_last=True)
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import RandomSampler

        return StatefulDataLoader(ds, batch_size=MBS, drop_last=True,
                                  sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(77 + dp_rank)),
                                  generator=torch.Generator().manual_seed(99 + dp_rank))
    raise SystemExit(f"LOADER must be reshuffle or stateful, not {kind!r}")


def forever(loader: Any) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        yield from loader


def sha(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:24]
            for k, t in sorted(tensors.items())}


def main() -> None:
    setup_store_env(RANK)
    env = os.environ
    out = Path(env["OUT_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    steps, loader_kind = int(env.get("STEPS", "8")), env.get("LOADER", "stateful")
    kill_rank, kill_step = int(env.get("KILL_RANK", "-1")), int(env.get("KILL_STEP", "-1"))
    logging.basicConfig(level=logging.INFO, format=f"[rank{RANK}] %(name)s %(levelname)s %(message)s")
    from megatron_patches import enable_cpu

    enable_cpu(nemo=False)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from megatron_patches import install_hooks, mcore_groups
    from megatron_patches.step_tags import tag_optimizer_steps
    from neighbor_ckpt import NeighborCheckpointer, NeighborCkptConfig, prepare_torchrun_restart
    from neighbor_ckpt.adapters.megatron import MegatronOptimizerAdapter

    prepare_torchrun_restart()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, attention_dropout=0.1, hidden_dropout=0.1,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    ddp_model = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=True, bucket_size=4096))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01,
                                                       clip_grad=1.0, use_distributed_optimizer=True), [ddp_model])
    config.no_sync_func = ddp_model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    global_batch = MBS * N_MB * dp_size
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4,
                                        lr_warmup_steps=2 * global_batch, lr_decay_steps=steps * global_batch,
                                        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=1,
                                        wd_incr_style="constant")

    groups = mcore_groups()
    nc_config = NeighborCkptConfig.from_yaml(env["NCKPT_CONFIG"]) if env.get("NCKPT_CONFIG") else NeighborCkptConfig()
    ckpt = NeighborCheckpointer(nc_config, adapter=MegatronOptimizerAdapter([ddp_model], optimizer),
                                dp_group=groups.dp_group, model_parallel_coord=groups.coord)
    if RANK == kill_rank and attempt() == 0:
        def maybe_kill() -> None:
            if ckpt.last_iteration is not None and ckpt.last_iteration + 1 == kill_step:
                logging.getLogger(__name__).warning("fault injection: SIGKILL of rank %d in optimizer step %d",
                                                    RANK, kill_step)
                os.kill(os.getpid(), signal.SIGKILL)

        tag_optimizer_steps(optimizer, on_enter=maybe_kill, on_exit=lambda: None)
    hooks = install_hooks(ckpt, optimizer)
    result = ckpt.recover()
    # What the user writes after recover(): the loader is built (and, for "reshuffle", its iterator created) now.
    loader = make_loader(loader_kind, dp_rank)
    if result.restored:
        scheduler.load_state_dict(result.user_state["scheduler"])
        if loader_kind == "stateful":
            loader.load_state_dict(result.user_state["loader"])
    data: Any = forever(loader)
    if env.get("OBSERVE", "1") == "1":
        data = hooks.observe(data)  # by hand; with OBSERVE=0 install_hooks alone feeds the data check

    def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):  # noqa: ANN202
        batch = next(data_iterator)
        pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
        output = model(batch["tokens"], pos, None, labels=batch["labels"])

        def loss_func(output_tensor: torch.Tensor):  # noqa: ANN202
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    forward_backward = get_forward_backward_func()
    try:
        for step in range(result.next_step, steps):
            ddp_model.zero_grad_buffer()
            optimizer.zero_grad()
            losses = forward_backward(forward_step_func=forward_step, data_iterator=data, model=[ddp_model],
                                      num_microbatches=N_MB, seq_length=SEQ, micro_batch_size=MBS,
                                      decoder_seq_length=SEQ, forward_only=False)
            # the losses exist on the last pipeline stage only
            loss = float(torch.stack([d["lm loss"] for d in losses]).mean()) if losses else float("nan")
            append_jsonl(out / f"losses.rank{RANK}.jsonl", {"step": step, "loss": loss.hex(), "attempt": attempt()})
            ok, _, _ = optimizer.step()
            if not ok:
                raise RuntimeError(f"optimizer step {step} was skipped")
            scheduler.step(increment=global_batch)
            user: dict[str, Any] = {"scheduler": scheduler.state_dict()}
            if loader_kind == "stateful":
                user["loader"] = loader.state_dict()
            ckpt.snapshot(step, user_state=user)
    except Exception as e:
        write_json(out / f"error.rank{RANK}.json", {"type": type(e).__name__, "message": str(e),
                                                    "attempt": attempt()})
        ckpt.on_failure(f"{type(e).__name__}: {e}")
        raise
    hooks.remove()
    ckpt.close(success=True)
    inner = [part.optimizer for part in getattr(optimizer, "chained_optimizers", [optimizer])]
    write_json(out / f"final.rank{RANK}.json", {
        "params": sha(dict(ddp_model.module.named_parameters())),
        "optim": sha({f"{i}.{j}.{k}": v for i, o in enumerate(inner) for j, st in enumerate(o.state.values())
                      for k, v in st.items() if isinstance(v, torch.Tensor)}),
        "scheduler": scheduler.state_dict()["num_steps"],
    })
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
