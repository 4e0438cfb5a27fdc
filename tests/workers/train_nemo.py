"""NeMo 2 worker: ``llm.GPTModel`` (2 layers, hidden 64, dropout on) trained by ``nl.Trainer`` with
``MegatronStrategy`` and the ``NeighborCheckpoint`` callback, on CPU gloo ranks (``megatron_patches.enable_cpu``).

Environment: OUT_DIR, TEST_STORE_BASE, WIPE_RANKS (see ``common.setup_store_env``), STEPS, TP, PP, DIST_OPT (1|0),
KILL_RANK, KILL_STEP, KILL_PHASE (first attempt only; ``optimizer``: SIGKILL inside that optimizer step, after
the gradient collectives; ``forward``: at the start of that step), EP (expert parallel size; > 0 makes every layer's
MLP a mixture of 4 experts, top-2, SequentialMLP, alltoall dispatcher, the aux-loss-free sigmoid router with its
``expert_bias``, as ``train_mcore_moe.py``; with TP > 1 sequence parallel too), ETP (expert tensor parallel size;
default: TP).
Writes per rank: losses.rank<r>.jsonl (``reduced_train_loss`` of every step), report/final JSON (with ``expert_bias``
under MoE).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import append_jsonl, attempt, setup_store_env, write_json  # noqa: E402

RANK = int(os.environ["RANK"])
SEQ, VOCAB = 32, 128


def main() -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("HANG_TIMEOUT", "360")), exit=True)
    logging.basicConfig(level=logging.INFO, format=f"[rank{RANK}] %(name)s %(levelname)s %(message)s")
    setup_store_env(RANK)
    from megatron_patches import enable_cpu

    enable_cpu()

    import hashlib

    import lightning.pytorch as pl
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer
    from nemo.lightning.pytorch.optim import CosineAnnealingScheduler

    from neighbor_ckpt import NeighborCheckpoint, NeighborCkptConfig

    out = Path(os.environ["OUT_DIR"])
    steps = int(os.environ.get("STEPS", "8"))
    tp, pp = int(os.environ.get("TP", "1")), int(os.environ.get("PP", "1"))
    dist_opt = os.environ.get("DIST_OPT", "1") == "1"
    kill_step = int(os.environ["KILL_STEP"]) if os.environ.get("KILL_RANK") == str(RANK) and attempt() == 0 else None
    kill_phase = os.environ.get("KILL_PHASE", "optimizer")
    ep = int(os.environ.get("EP", "0"))
    moe = (dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96, moe_grouped_gemm=False,
                moe_token_dispatcher_type="alltoall", moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
                moe_router_load_balancing_type="none", expert_model_parallel_size=ep)
           if ep else {})

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
    from nemo_pretrain import mock_data_module  # the recipe's CPU fix of NeMo's MockDataModule

    CpuMockData = mock_data_module(cpu=True)

    class Record(pl.Callback):
        """Losses as NeMo reports them, and the SIGKILL."""

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if kill_step == trainer.global_step and kill_phase == "forward":
                os.kill(os.getpid(), signal.SIGKILL)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if kill_step == trainer.global_step and kill_phase == "optimizer":
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = trainer.callback_metrics.get("reduced_train_loss")
            append_jsonl(out / f"losses.rank{RANK}.jsonl",
                         {"step": trainer.global_step - 1, "attempt": attempt(),
                          "loss": None if loss is None else float(loss).hex()})

    config = llm.GPTConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=SEQ,
                           hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02,
                           transformer_layer_spec=get_gpt_layer_local_spec(num_experts=moe.get("num_moe_experts"),
                                                                           moe_grouped_gemm=False),
                           gradient_accumulation_fusion=False,
                           masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                           persist_layer_norm=False, apply_rope_fusion=False, cross_entropy_loss_fusion=False,
                           share_embeddings_and_output_weights=True, make_vocab_size_divisible_by=128, **moe)
    tokenizer = NullTokenizer(vocab_size=VOCAB)
    opt = nl.MegatronOptimizerModule(
        config=OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0, bf16=False, fp16=False,
                               use_distributed_optimizer=dist_opt),
        lr_scheduler=CosineAnnealingScheduler(max_steps=steps, warmup_steps=2, min_lr=1e-4))
    model = llm.GPTModel(config, tokenizer=tokenizer, optim=opt)
    data = CpuMockData(seq_length=SEQ, tokenizer=tokenizer, micro_batch_size=2, global_batch_size=8,
                       num_workers=0, pin_memory=False, num_train_samples=10_000)
    etp = int(os.environ.get("ETP", "0")) or None
    strategy = nl.MegatronStrategy(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        expert_model_parallel_size=max(ep, 1), expert_tensor_parallel_size=etp,
        sequence_parallel=bool(ep) and tp > 1,  # megatron-core requires it for MoE under tensor parallelism
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, bucket_size=4096),
        ckpt_async_save=False)
    disk_every = int(os.environ.get("DISK_EVERY", "0"))
    ckpt_cb = NeighborCheckpoint(NeighborCkptConfig.from_dict({"job_id": "nemo", "store": {"cleanup_on_success": False},
                                                                "data_check": os.environ.get("DATA_CHECK", "error")}))
    trainer = nl.Trainer(devices=4, num_nodes=1, accelerator="cpu", strategy=strategy, max_steps=steps,
                         callbacks=[ckpt_cb, Record()], log_every_n_steps=1, enable_progress_bar=False,
                         logger=False, enable_checkpointing=bool(disk_every), num_sanity_val_steps=0, limit_val_batches=0,
                         val_check_interval=None, plugins=nl.MegatronMixedPrecision(precision="32"))
    if disk_every:
        # NeMo's insurance: ModelCheckpoint through NeMoLogger, AutoResume on a restart (what llm.train sets up).
        ckpt = nl.ModelCheckpoint(every_n_train_steps=disk_every, save_last=True, save_top_k=-1,
                                  save_optim_on_train_end=False, always_save_context=False)
        nemo_logger = nl.NeMoLogger(log_dir=str(out / "nemo"), name="tiny", use_datetime_version=False, ckpt=ckpt)
        nemo_logger.setup(trainer, resume_if_exists=True)
        nl.AutoResume(resume_if_exists=True, resume_ignore_no_checkpoint=True).setup(trainer, model)
        from nemo.lightning.callback_group import CallbackGroup

        CallbackGroup.get_instance().update_config(nemo_version="v2", trainer=trainer, data=data)  # as llm.train
    trainer.fit(model, data)

    cb = next(c for c in trainer.callbacks if isinstance(c, NeighborCheckpoint))  # nl.Trainer copies callbacks
    if cb.last_recovery is not None:
        write_json(out / f"report.rank{RANK}.attempt{attempt()}.json",
                   {**cb.last_recovery.report.to_dict(), "iteration": cb.last_recovery.iteration})

    def sha(t: torch.Tensor) -> str:
        return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:24]

    mcore_opt = trainer.strategy.optimizers[0].mcore_optimizer
    inner = [p.optimizer for p in getattr(mcore_opt, "chained_optimizers", [mcore_opt])]
    write_json(out / f"final.rank{RANK}.json", {
        "params": {n: sha(p) for n, p in trainer.lightning_module.named_parameters()},
        "optim": {f"{i}.{j}.{k}": sha(v) for i, o in enumerate(inner) for j, st in enumerate(o.state.values())
                  for k, v in st.items() if isinstance(v, torch.Tensor)},
        "param_groups": [[float(g["lr"]).hex(), g.get("step")] for o in inner for g in o.param_groups],
        "global_step": trainer.global_step,
        "expert_bias": {n: [float(x).hex() for x in b.tolist()] for n, b in
                        sorted(trainer.lightning_module.named_buffers()) if n.endswith("expert_bias")},
    })
    faulthandler.dump_traceback_later(90, exit=True)  # a hang at interpreter exit prints every thread's stack


if __name__ == "__main__":
    main()
