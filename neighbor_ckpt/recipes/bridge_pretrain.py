"""Megatron-Bridge pre-training of a GPT / Llama with neighbor checkpointing, driven by one job file (``framework:
bridge``).

Launch it through the command, which validates the file first and runs torchrun with restarts::

    neighbor-ckpt launch configs/gpt_tiny_bridge_cpu.yaml trainer.max_steps=20 neighbor_ckpt.fault_injection.enabled=true

or directly under torchrun: ``torchrun ... recipes/bridge_pretrain.py --config CONFIG --run-dir DIR``.

What it runs is Megatron-Bridge 0.6's own ``pretrain(cfg, forward_step, callbacks=[...])`` with
:class:`neighbor_ckpt.bridge.NeighborCheckpoint` in the callbacks: the job file's model (the tiny presets:
``gpt_tiny``: LayerNorm, GELU, learned positions; ``llama_tiny``: RMSNorm, SwiGLU, RoPE, GQA; megatron-core's local
layer spec), parallelism, batch, steps and learning rate; mock data; on ``trainer.accelerator: cpu``,
``megatron_patches.enable_cpu(nemo=False)`` first (gloo). ``checkpoint.every_n_train_steps`` > 0 turns on Bridge's own
checkpoint (``<run-dir>/bridge_checkpoints``, saved every N steps, loaded on a restart): the insurance. The full-size
presets feed ``neighbor-ckpt plan`` only here.

With ``neighbor_ckpt.inprocess.enabled`` (``neighbor-ckpt launch`` starts the ranks, the spares, one launcher per
simulated node and the store host): every process imports Bridge first (a spare is hot), then
:func:`neighbor_ckpt.bridge.inprocess.run_pretrain` calls ``pretrain`` again in each generation, with a new
``ConfigContainer`` and the same callback instances, on the generation's process group.

``neighbor_ckpt.fault_injection`` (demos, tests): the planned faults (the one-fault keys or a ``faults`` list), each
SIGKILL / SIGSTOP of its rank once, in the first launch attempt, at the start of its step (``forward``) or inside its
optimizer step (``optimizer``); in process in whichever generation first runs that step (a rank number of that
generation); ``replace_store`` gives the victim an empty host store on a launcher restart.

``--record`` writes, per rank, every step's loss (hex, exact) and consumed samples, the recovery report of each
attempt and fingerprints of the final weights, optimizer shards and Bridge's counters under ``<run-dir>/record/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.planning.jobspec import JobSpec
from neighbor_ckpt.recipes.entry import InprocessJob, start_recipe

logger = logging.getLogger("recipes.bridge_pretrain")

TINY = ("gpt_tiny", "llama_tiny")
_TINY_VOCAB = 128


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _rank() -> int:
    """This process's rank now (in process the engine sets ``RANK`` for every generation)."""
    return int(os.environ.get("RANK", "0"))


def _generation(neighbor: Any) -> int:
    """The in-process generation of the current ``pretrain`` call (0 without in-process recovery)."""
    return int(getattr(neighbor.attempt, "inprocess", 0) or 0)


def build_config(job: JobSpec, run_dir: Path) -> Any:
    """The Megatron-Bridge ``ConfigContainer`` of ``job`` (call after ``enable_cpu(nemo=False)`` on CPU).

    Raises:
        ConfigError: the preset is not one of the tiny ones, or the data is not mock data.
    """
    import torch
    import torch.nn.functional as F
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, DistributedDataParallelConfig,
                                                 DistributedInitConfig, LoggerConfig, MockGPTDatasetConfig,
                                                 OptimizerConfig, RNGConfig, SchedulerConfig, TokenizerConfig,
                                                 TrainingConfig)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if job.model.preset not in TINY:
        raise ConfigError(f"config.model.preset: {job.model.preset!r} under framework: bridge: the Bridge recipe builds "
                          f"the tiny presets ({', '.join(TINY)}); the full-size ones feed `neighbor-ckpt plan` only")
    if job.data.kind != "mock":
        raise ConfigError("config.data.kind: the Bridge recipe trains on mock data only")
    t, par, shape = job.trainer, job.parallelism, job.model_shape()
    dropout = 0.1 if job.model.dropout is None else job.model.dropout
    bf16 = t.precision == "bf16-mixed"
    fp16 = t.precision == "16-mixed"
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    arch: dict[str, Any] = {}
    if job.model.preset == "llama_tiny":
        arch = dict(normalization="RMSNorm", activation_func=F.silu, gated_linear_unit=True,
                    position_embedding_type="rope", add_bias_linear=False, num_query_groups=shape.num_query_groups,
                    share_embeddings_and_output_weights=False)
    model = GPTModelProvider(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, seq_length=shape.seq_length, vocab_size=None,
        make_vocab_size_divisible_by=_TINY_VOCAB, init_method_std=0.02,
        tensor_model_parallel_size=par.tensor, pipeline_model_parallel_size=par.pipeline,
        context_parallel_size=par.context, sequence_parallel=False,
        transformer_layer_spec=get_gpt_layer_local_spec(**({"normalization": "RMSNorm"} if arch else {})),
        bf16=bf16, fp16=fp16, params_dtype=dtype, pipeline_dtype=dtype, attention_softmax_in_fp32=True,
        hidden_dropout=dropout, attention_dropout=dropout, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, cross_entropy_loss_fusion=False, **arch)
    ckpt_dir = str(run_dir / "bridge_checkpoints")
    every = job.checkpoint.every_n_train_steps
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=t.max_steps, global_batch_size=t.global_batch_size,
                             micro_batch_size=t.micro_batch_size, eval_interval=10**9, eval_iters=0,
                             exit_signal_handler=False),
        optimizer=OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.lr / 10, weight_decay=0.01, bf16=bf16,
                                  fp16=fp16, clip_grad=1.0, use_distributed_optimizer=par.distributed_optimizer,
                                  use_precision_aware_optimizer=False),
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=t.warmup_steps, lr_decay_iters=t.max_steps,
                                  start_weight_decay=0.01, end_weight_decay=0.01, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=par.distributed_optimizer,
                                          overlap_grad_reduce=False, overlap_param_gather=False,
                                          grad_reduce_in_fp32=True, check_for_nan_in_grad=True),
        dist=DistributedInitConfig(distributed_backend="gloo" if t.accelerator == "cpu" else "nccl"),
        dataset=MockGPTDatasetConfig(seq_length=shape.seq_length, random_seed=t.seed, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                     dataloader_type="single", num_workers=0),
        logger=LoggerConfig(log_interval=t.log_every_n_steps),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=_TINY_VOCAB),
        checkpoint=CheckpointConfig(save=ckpt_dir if every else None, load=ckpt_dir if every else None,
                                    save_interval=every or None),
        rng=RNGConfig(seed=t.seed),
    )


def callbacks(job: JobSpec, run_dir: Path, *, record: bool) -> list[Any]:
    """``NeighborCheckpoint`` (what a Bridge user adds), plus the fault injector and the recorder when asked. Built
    once per process: in process the same instances serve every generation's ``pretrain``."""
    from megatron.bridge.training.callbacks import Callback

    from neighbor_ckpt import NeighborCkptConfig
    from neighbor_ckpt.bridge import NeighborCheckpoint

    nc_config = NeighborCkptConfig.from_dict(job.neighbor_ckpt.to_dict())
    fi = nc_config.fault_injection
    planned = fi.refuse_unsupported(phases=("forward", "optimizer"), where=" under framework: bridge (the Bridge "
                                    "recipe injects forward and optimizer)")
    if planned and _attempt() > 0 and _rank() in fi.replaced_ranks():
        from neighbor_ckpt.snapshot.store import rank_dir

        d = rank_dir(nc_config.resolved_store_dir(), nc_config.resolved_job_id(), _rank())
        shutil.rmtree(d, ignore_errors=True)
        logger.warning("fault injection: rank %d restarts on a 'replaced node': its host store %s was emptied",
                       _rank(), d)
    neighbor = NeighborCheckpoint(nc_config)
    out = run_dir / "record"
    if record:
        out.mkdir(parents=True, exist_ok=True)

    class Faults(Callback):
        """Fault injection: each planned fault once, in the first launch attempt, in the generation that first runs
        its step (:meth:`neighbor_ckpt.fault_config.FaultSpec.fires`); with ``--record`` when each fired
        (``faults.jsonl``; the first also as ``fault.json``)."""

        def __init__(self) -> None:
            super().__init__()
            self.fired: set[int] = set()  # in this process, across its generations
            self.start_step = 0

        def _due(self, ts: Any, phase: str) -> list[int]:
            return [i for i, f in enumerate(planned) if i not in self.fired and f.fires(
                rank=_rank(), step=ts.step, phase=phase, launch=_attempt(), generation=_generation(neighbor),
                start_step=self.start_step)]

        def _fire(self, i: int, phase: str) -> None:
            self.fired.add(i)
            f = planned[i]
            if record:
                rec = json.dumps({"unix": time.time(), "rank": _rank(), "step": f.step, "phase": phase,
                                  "generation": _generation(neighbor), "fault": i, "pid": os.getpid()})
                with open(out / "faults.jsonl", "a") as fh:
                    fh.write(rec + "\n")
                if not (out / "fault.json").exists():
                    (out / "fault.json").write_text(rec)
            # at INFO: Megatron-Bridge's logging drops WARNING records by default (logger.filter_warnings)
            logger.info("fault injection: %s of rank %d in the %s phase of step %d (fault %d, generation %d)",
                        f.signal, _rank(), phase, f.step, i, _generation(neighbor))
            for h in logging.getLogger().handlers:
                h.flush()
            if f.permanent and f.signal == "SIGKILL":
                from neighbor_ckpt.runtime.failpoints import lose_node

                lose_node()
            os.kill(os.getpid(), getattr(signal, f.signal))

        def on_train_start(self, context: Any) -> None:
            ts = context.state.train_state
            self.start_step = ts.step  # where this generation resumed
            if any(f.phase == "optimizer" for f in planned) and _attempt() == 0:
                from megatron_patches.step_tags import tag_optimizer_steps

                def enter() -> None:
                    for i in self._due(ts, "optimizer"):
                        self._fire(i, "optimizer")

                tag_optimizer_steps(context.optimizer, on_enter=enter, on_exit=lambda: None)

        def on_train_step_start(self, context: Any) -> None:
            for i in self._due(context.state.train_state, "forward"):
                self._fire(i, "forward")

    class Record(Callback):
        """``--record``: losses (on_train_step_end: step i done, Bridge adds the batch to consumed samples after it),
        the recovery report, the final state; per rank of the current generation."""

        def on_train_start(self, context: Any) -> None:
            ckpt, rec = neighbor.checkpointer, neighbor.last_recovery
            if ckpt is not None and rec is not None:
                ts = context.state.train_state
                (out / f"report.rank{_rank()}.attempt{_label(ckpt.attempt)}.json").write_text(json.dumps(
                    {**rec.report.to_dict(), "winner": neighbor.winner, "train_state_step": ts.step,
                     "consumed_train_samples": ts.consumed_train_samples}, indent=1, sort_keys=True))

        def on_train_step_end(self, context: Any) -> None:
            ts = context.state.train_state
            loss = context.loss_dict.get("lm loss") if context.loss_dict else None
            with open(out / f"losses.rank{_rank()}.jsonl", "a") as fh:
                fh.write(json.dumps({"step": ts.step, "attempt": _attempt() + _generation(neighbor),
                                     "loss": None if loss is None else float(loss).hex(),
                                     "consumed_samples": ts.consumed_train_samples + job.trainer.global_batch_size})
                         + "\n")

        def on_train_end(self, context: Any) -> None:
            import torch

            def sha(t: torch.Tensor) -> str:
                c = t.detach().cpu().contiguous()
                return hashlib.sha256(c.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

            ts = context.state.train_state
            params = {f"{i}/{n}": sha(p) for i, m in enumerate(context.model) for n, p in m.named_parameters()}
            shards: dict[str, str] = {}
            for k, opt in enumerate(getattr(context.optimizer, "chained_optimizers", [context.optimizer])):
                for gi, group in enumerate(opt.optimizer.param_groups):
                    for pi, p in enumerate(group["params"]):
                        shards[f"{k}/{gi}/{pi}/param"] = sha(p)
                        for name, v in opt.optimizer.state.get(p, {}).items():
                            if isinstance(v, torch.Tensor):
                                shards[f"{k}/{gi}/{pi}/{name}"] = sha(v)
            (out / f"final.rank{_rank()}.json").write_text(json.dumps(
                {"step": ts.step, "consumed_samples": ts.consumed_train_samples,
                 "flops": float(ts.floating_point_operations_so_far).hex(), "params": params, "optimizer": shards},
                indent=1, sort_keys=True))

    return [neighbor, Faults(), *([Record()] if record else [])]


def _label(attempt: Any) -> str:
    """The attempt in record file names: the launcher's restart count, plus the generation in process
    (``report.rank1.attempt1.json``: restart 1, or generation 1 of the first launch; ``1.2``: both)."""
    launch, gen = int(getattr(attempt, "launch", 0)), int(getattr(attempt, "inprocess", 0))
    return str(launch + gen) if not (launch and gen) else f"{launch}.{gen}"


def main(argv: list[str] | None = None) -> None:
    job, args = start_recipe(argv, description=__doc__.splitlines()[0], nemo=False,
                             run_dir_help="logs, reports and Bridge checkpoints go here",
                             record_help="write per-step losses, reports and final fingerprints",
                             log_format="%(levelname)s %(name)s: %(message)s")
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    if job.neighbor_ckpt.inprocess.enabled:
        main_inprocess(job, args, forward_step)
        return
    if args.inprocess_store:
        raise ConfigError("--inprocess-store without config.neighbor_ckpt.inprocess.enabled")
    cfg = build_config(job, args.run_dir)
    pretrain(cfg, forward_step, callbacks=callbacks(job, args.run_dir, record=args.record))


def main_inprocess(job: JobSpec, args: argparse.Namespace, forward_step: Any) -> None:
    """Bridge's ``pretrain`` under in-process recovery (:func:`neighbor_ckpt.bridge.inprocess.run_pretrain`): a new
    ``ConfigContainer`` per generation, the callbacks built once; exits with the engine's fallback status when
    in-process recovery gives up (the launchers then restart the job)."""
    from neighbor_ckpt.bridge.inprocess import run_pretrain

    engine = InprocessJob(job, args)
    if job.neighbor_ckpt.elastic.enabled:
        raise ConfigError("config.neighbor_ckpt.elastic.enabled under framework: bridge: the Bridge recipe keeps its "
                          "world size in process (a hot spare fills a lost rank); turn elastic off")
    cbs = callbacks(job, args.run_dir, record=args.record)  # once: the same instances in every generation

    def make(attempt: Any) -> Any:
        engine.record_attempt(attempt)
        return build_config(job, args.run_dir)

    with engine.recording_events():
        run_pretrain(engine.inproc, make, forward_step, cbs)


if __name__ == "__main__":
    main()
