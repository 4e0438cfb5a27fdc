"""NeMo 2 pre-training of GPT and Llama with neighbor checkpointing, driven by one job file from ``configs/``.

Launch it through the command, which validates the file first and runs torchrun with restarts::

    neighbor-ckpt launch configs/llama_tiny_cpu.yaml trainer.max_steps=20
    neighbor-ckpt launch configs/llama3_70b.yaml --slurm job.sbatch      # multi-node: a Slurm batch script

or directly under torchrun: ``torchrun ... recipes/nemo_pretrain.py --config CONFIG --run-dir DIR``.

With ``neighbor_ckpt.inprocess.enabled`` (``neighbor-ckpt launch`` then starts our launcher on every node and a store
host) ``llm.pretrain`` runs under our in-process engine (:mod:`neighbor_ckpt.inprocess`, through
:mod:`neighbor_ckpt.lightning.inprocess`): after a failure the surviving processes build the trainer, strategy
and model again in place and restore from their host slots; a hot spare takes a lost rank's place. Imports happen
once per process, before the first generation (spares included).

:func:`build_recipe` returns a ``nemo_run.Partial`` of ``llm.pretrain``. The full-size models start from NeMo's
own recipe factories (``llm.llama3_8b``, ``llm.llama3_70b``, ``llm.gpt3_175b``) and get the job's parallelism,
batch, steps and checkpointing applied, plus ``NeighborCheckpoint`` in ``trainer.callbacks``; nothing else of
NeMo's tuning changes. The tiny presets (``gpt_tiny``, ``llama_tiny``: RMSNorm, SwiGLU, RoPE, GQA) use
megatron-core's local layer spec and run on CPU ranks (``megatron_patches.enable_cpu``) for smoke runs and
tests. NeMo's ``ModelCheckpoint`` every ``checkpoint.every_n_train_steps`` steps and ``AutoResume`` stay the
insurance: a restart resumes from the newest in-memory version when there is one, else from disk.

``--record`` writes, per rank, every step's ``reduced_train_loss`` (hex, exact) and fingerprints of the final
weights and optimizer state under ``<run-dir>/record/``: what the demo and the tests compare.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from neighbor_ckpt.planning.jobspec import JobSpec
from neighbor_ckpt.recipes.entry import InprocessJob, start_recipe

logger = logging.getLogger("recipes.nemo_pretrain")

_NEMO_FACTORIES = {"llama3_8b": "llama3_8b", "llama3_70b": "llama3_70b", "gpt3_175b": "gpt3_175b"}
_TINY_VOCAB = 128


def _neighbor_callbacks(job: JobSpec, *, inject_faults: bool = True) -> list[Any]:
    import nemo_run as run

    from neighbor_ckpt import NeighborCheckpoint, NeighborCkptConfig
    from neighbor_ckpt.lightning.faults import FaultInjector

    d = job.neighbor_ckpt.to_dict()
    cfg = run.Config(NeighborCkptConfig.from_dict, d)
    cbs = [run.Config(NeighborCheckpoint, config=cfg)]
    if job.neighbor_ckpt.fault_injection.enabled and inject_faults:
        cbs.insert(0, run.Config(FaultInjector, config=cfg))
    return cbs


def _tiny_model(job: JobSpec) -> Any:
    import nemo_run as run
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from nemo.collections import llm

    shape = job.model_shape()
    dropout = 0.1 if job.model.dropout is None else job.model.dropout
    common = dict(num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
                  num_attention_heads=shape.num_attention_heads, seq_length=shape.seq_length,
                  hidden_dropout=dropout, attention_dropout=dropout, init_method_std=0.02,
                  make_vocab_size_divisible_by=_TINY_VOCAB, gradient_accumulation_fusion=False,
                  masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                  persist_layer_norm=False, apply_rope_fusion=False, cross_entropy_loss_fusion=False)
    if job.model.preset == "llama_tiny":
        config = run.Config(llm.Llama3Config8B, **common, num_query_groups=shape.num_query_groups,
                            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                            position_embedding_type="rope", add_bias_linear=False,
                            share_embeddings_and_output_weights=False,
                            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"))
        return run.Config(llm.LlamaModel, config=config)
    config = run.Config(llm.GPTConfig, **common, share_embeddings_and_output_weights=True,
                        transformer_layer_spec=get_gpt_layer_local_spec())
    return run.Config(llm.GPTModel, config=config)


def mock_data_module(cpu: bool) -> Any:
    """NeMo's MockDataModule, or on CPU a subclass that builds the attention mask the local spec needs."""
    from nemo.collections import llm

    if not cpu:
        return llm.MockDataModule

    class CpuMockData(llm.MockDataModule):
        """NeMo 2.7.3's MockDataModule.setup passes ``create_attention_mask`` in the ``seed`` position; without
        Transformer Engine the local attention needs the mask."""

        def setup(self, stage: str = "") -> None:
            from nemo.collections.llm.gpt.data.mock import _MockGPTDataset

            self._train_ds = _MockGPTDataset(self.tokenizer, "train", self.num_train_samples, self.seq_length,
                                             create_attention_mask=True)
            self._validation_ds = self._test_ds = self._train_ds

    return CpuMockData


def _data(job: JobSpec) -> Any:
    import nemo_run as run
    from nemo.collections import llm

    t, seq = job.trainer, job.model_shape().seq_length
    cpu = t.accelerator == "cpu"
    tokenizer = None
    if job.model.preset in ("gpt_tiny", "llama_tiny"):
        from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer

        tokenizer = run.Config(NullTokenizer, vocab_size=_TINY_VOCAB)
    elif job.data.tokenizer:
        from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer

        tokenizer = run.Config(AutoTokenizer, pretrained_model_name=job.data.tokenizer)
    common = dict(seq_length=seq, micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
                  num_workers=0 if cpu else 2, pin_memory=not cpu)
    if job.data.kind == "indexed":
        return run.Config(llm.PreTrainingDataModule, paths=list(job.data.paths or []), tokenizer=tokenizer,
                          seed=t.seed, **common)
    return run.Config(mock_data_module(cpu), tokenizer=tokenizer, num_train_samples=job.data.num_train_samples,
                      **common)


def _tiny_recipe(job: JobSpec, run_dir: Path) -> Any:
    import nemo_run as run
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.lightning.pytorch.optim import CosineAnnealingScheduler

    cpu = job.trainer.accelerator == "cpu"
    strategy = run.Config(nl.MegatronStrategy, pipeline_dtype=torch.float32 if cpu else torch.bfloat16,
                          ddp=run.Config(DistributedDataParallelConfig, bucket_size=4096 if cpu else None),
                          ckpt_async_save=False)
    trainer = run.Config(nl.Trainer, accelerator=job.trainer.accelerator, strategy=strategy, callbacks=[],
                         default_root_dir=str(run_dir),
                         enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0,
                         val_check_interval=None, logger=False,
                         plugins=run.Config(nl.MegatronMixedPrecision, precision=job.trainer.precision))
    optim = run.Config(nl.MegatronOptimizerModule,
                       config=run.Config(OptimizerConfig, optimizer="adam", lr=job.trainer.lr, weight_decay=0.01,
                                         clip_grad=1.0, bf16=job.trainer.precision.startswith("bf16"),
                                         fp16=job.trainer.precision.startswith("16")),
                       lr_scheduler=run.Config(CosineAnnealingScheduler, max_steps=job.trainer.max_steps,
                                               warmup_steps=job.trainer.warmup_steps, min_lr=job.trainer.lr / 10))
    from lightning.pytorch.loggers import CSVLogger

    # metrics (loss, lr, neighbor_ckpt/*) in <run-dir>/nemo/metrics/version_<attempt>/metrics.csv
    log = run.Config(nl.NeMoLogger, name=job.name, log_dir=str(run_dir / "nemo"), use_datetime_version=False,
                     extra_loggers=[run.Config(CSVLogger, save_dir=str(run_dir / "nemo"), name="metrics")])
    resume = run.Config(nl.AutoResume, resume_if_exists=True, resume_ignore_no_checkpoint=True)
    return run.Partial(llm.pretrain, model=_tiny_model(job), data=_data(job), trainer=trainer, log=log,
                       resume=resume, optim=optim)


def _nemo_factory_recipe(job: JobSpec, run_dir: Path) -> Any:
    import importlib

    mod = importlib.import_module(f"nemo.collections.llm.recipes.{_NEMO_FACTORIES[job.model.preset]}")
    return mod.pretrain_recipe(dir=str(run_dir / "nemo"), name=job.name, num_nodes=job.trainer.num_nodes,
                               num_gpus_per_node=job.trainer.devices)


def build_recipe(job: JobSpec, run_dir: Path, *, inject_faults: bool = True) -> Any:
    """The ``nemo_run.Partial`` of ``llm.pretrain`` for ``job``, with the neighbor-checkpoint callback attached
    (and the fault injector when ``neighbor_ckpt.fault_injection`` is enabled, unless ``inject_faults`` is false:
    an in-process generation after the one fault already fired)."""
    import nemo_run as run
    from nemo import lightning as nl

    tiny = job.model.preset in ("gpt_tiny", "llama_tiny")  # a full-size preset on cpu is refused by load_job
    recipe = _tiny_recipe(job, run_dir) if tiny else _nemo_factory_recipe(job, run_dir)
    p, t, ck = job.parallelism, job.trainer, job.checkpoint
    shape = job.model_shape()

    # model size (a resized preset)
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "seq_length"):
        if getattr(job.model, name) is not None:
            setattr(recipe.model.config, name, getattr(shape, name))
    if job.model.dropout is not None:
        recipe.model.config.hidden_dropout = recipe.model.config.attention_dropout = job.model.dropout

    # parallelism
    s = recipe.trainer.strategy
    s.tensor_model_parallel_size, s.pipeline_model_parallel_size = p.tensor, p.pipeline
    s.context_parallel_size, s.sequence_parallel = p.context, p.sequence_parallel
    s.virtual_pipeline_model_parallel_size = p.virtual_pipeline
    s.ddp.use_distributed_optimizer = p.distributed_optimizer
    recipe.optim.config.use_distributed_optimizer = p.distributed_optimizer

    # trainer, data, seed
    tr = recipe.trainer
    tr.devices, tr.num_nodes, tr.max_steps = t.devices, t.num_nodes, t.max_steps
    tr.log_every_n_steps = t.log_every_n_steps
    tr.default_root_dir = str(run_dir)
    recipe.data.micro_batch_size, recipe.data.global_batch_size = t.micro_batch_size, t.global_batch_size
    recipe.data.seq_length = shape.seq_length
    if not tiny:
        recipe.data = _data(job) if job.data.kind == "indexed" else recipe.data
        recipe.optim.config.lr = t.lr
        recipe.optim.lr_scheduler.max_steps = t.max_steps
        recipe.optim.lr_scheduler.warmup_steps = t.warmup_steps

    # insurance: NeMo's persistent checkpoint (+ AutoResume, already in the recipe)
    if ck.every_n_train_steps:
        recipe.log.ckpt = run.Config(nl.ModelCheckpoint, every_n_train_steps=ck.every_n_train_steps,
                                     save_last=True, save_top_k=-1, save_optim_on_train_end=False,
                                     always_save_context=False, dirpath=ck.dir)
        tr.enable_checkpointing = True
        s.ckpt_async_save = ck.async_save and t.accelerator == "gpu"
    elif tiny:
        tr.enable_checkpointing = False
    tr.val_check_interval = None if tiny else tr.val_check_interval

    # neighbor checkpointing
    if job.neighbor_ckpt.enabled:
        tr.callbacks = [*(tr.callbacks or []), *_neighbor_callbacks(job, inject_faults=inject_faults)]
    return recipe


class _Record:
    """``--record``: per-step losses as NeMo reports them and final fingerprints (for the demo and tests)."""

    @staticmethod
    def callback(out: Path, *, attempt: int | None = None, label: str | None = None) -> Any:
        """``attempt``: the number written with each loss (default: the launcher's restart count); ``label``: the
        report file's ``attempt<label>`` (default: ``attempt``)."""
        import lightning.pytorch as pl

        rank = int(os.environ.get("RANK", "0"))
        if attempt is None:
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        label = str(attempt) if label is None else label

        class Record(pl.Callback):
            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                from megatron.core import parallel_state

                loss = trainer.callback_metrics.get("reduced_train_loss")
                sampler = getattr(trainer.datamodule, "data_sampler", None)
                consumed = None if sampler is None else int(sampler.compute_consumed_samples(
                    trainer.global_step - sampler.init_global_step))
                with open(out / f"losses.rank{rank}.jsonl", "a") as f:
                    f.write(json.dumps({"step": trainer.global_step - 1, "attempt": attempt,
                                        "loss": None if loss is None else float(loss).hex(), "pid": os.getpid(),
                                        "unix": time.time(), "consumed_samples": consumed,
                                        "dp": parallel_state.get_data_parallel_world_size()}) + "\n")

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                _Record.final(trainer, out / f"final.rank{rank}.json")
                from neighbor_ckpt import NeighborCheckpoint

                cb = next((c for c in trainer.callbacks if isinstance(c, NeighborCheckpoint)), None)
                if cb is not None and cb.last_recovery is not None:
                    rep = {**cb.last_recovery.report.to_dict(), "iteration": cb.last_recovery.iteration,
                           "summary": cb.last_recovery.report.summary()}
                    (out / f"report.rank{rank}.attempt{label}.json").write_text(json.dumps(rep, indent=1))

        return Record()

    @staticmethod
    def fault_clock(out: Path, job: JobSpec, *, generation: int = 0) -> Any:
        """When the injected faults fire (unix time): ``fault.json`` for the first one, a line of ``faults.jsonl``
        for each. Placed before the fault injector; a fault is stamped where the injector fires it (the same rule,
        :meth:`~neighbor_ckpt.fault_config.FaultSpec.fires`, in in-process generation ``generation``), in its phase's hook
        (``backward``: the start of that step's batch)."""
        import lightning.pytorch as pl

        faults = job.neighbor_ckpt.fault_injection.planned()
        rank = int(os.environ.get("RANK", "0"))
        launch = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        start: list[int] = []
        stamped: set[int] = set()

        def stamp(trainer: Any, hook: str) -> None:
            if not start:
                start.append(trainer.global_step)  # where this generation resumed
            for i, f in enumerate(faults):
                phase = "forward" if f.phase == "backward" else f.phase
                if i in stamped or hook != phase or not f.fires(rank=rank, step=trainer.global_step, phase=f.phase,
                                                                launch=launch, generation=generation,
                                                                start_step=start[0]):
                    continue
                stamped.add(i)
                rec = {"unix": time.time(), "rank": rank, "step": f.step, "phase": f.phase, "signal": f.signal,
                       "pid": os.getpid(), "generation": generation, "fault": i}
                if not (out / "fault.json").exists():
                    (out / "fault.json").write_text(json.dumps(rec))
                with open(out / "faults.jsonl", "a") as fh:
                    fh.write(json.dumps(rec) + "\n")

        class FaultClock(pl.Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
                stamp(trainer, "forward")

            def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
                stamp(trainer, "optimizer")

        return FaultClock()

    @staticmethod
    def final(trainer: Any, path: Path) -> None:
        import torch

        def sha(t: torch.Tensor) -> str:
            raw = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            return hashlib.sha256(raw).hexdigest()[:24]

        mcore_opt = trainer.strategy.optimizers[0].mcore_optimizer
        inner = [o.optimizer for o in getattr(mcore_opt, "chained_optimizers", [mcore_opt])]
        path.write_text(json.dumps({
            "params": {n: sha(p) for n, p in trainer.lightning_module.named_parameters()},
            "optim": {f"{i}.{j}.{k}": sha(v) for i, o in enumerate(inner) for j, st in enumerate(o.state.values())
                      for k, v in st.items() if isinstance(v, torch.Tensor)},
            "global_step": trainer.global_step}, indent=1, sort_keys=True))


def main(argv: list[str] | None = None) -> None:
    job, args = start_recipe(argv, description=__doc__.splitlines()[0], nemo=True,
                             run_dir_help="logs, reports and NeMo checkpoints go here",
                             record_help="write per-step losses and final fingerprints",
                             log_format="%(name)s %(levelname)s %(message)s")
    import fiddle as fdl
    import torch

    if job.neighbor_ckpt.inprocess.enabled:
        main_inprocess(job, args)
        return
    torch.manual_seed(job.trainer.seed)
    recipe = build_recipe(job, args.run_dir)
    world = int(os.environ.get("WORLD_SIZE", job.world_size))
    if world != job.world_size:  # an elastic restart without a lost node (torchrun --nnodes 1:N): fewer nodes
        local = int(os.environ.get("LOCAL_WORLD_SIZE", job.trainer.devices))
        recipe.trainer.devices, recipe.trainer.num_nodes = local, max(1, world // local)
    if args.record:
        out = args.run_dir / "record"
        out.mkdir(parents=True, exist_ok=True)
        fn = fdl.build(recipe)
        fn.keywords["trainer"].callbacks.append(_Record.callback(out))
        if job.neighbor_ckpt.fault_injection.enabled and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            fn.keywords["trainer"].callbacks.insert(0, _Record.fault_clock(out, job))
        fn()
    else:
        fdl.build(recipe)()


def main_inprocess(job: JobSpec, args: argparse.Namespace) -> None:
    """``llm.pretrain`` under in-process recovery: each attempt builds the trainer, strategy and model anew
    (:func:`neighbor_ckpt.lightning.inprocess.run_trainer`); exits with the engine's fallback status when in-process
    recovery gives up (the launchers then restart the job)."""
    import fiddle as fdl
    import torch

    from neighbor_ckpt.lightning import inprocess as lip

    t_start = time.time()
    build_recipe(job, args.run_dir)  # every import the attempts need, now: a spare must be hot when it is activated
    engine = InprocessJob(job, args, started=t_start)
    lip.prepare_process()  # the slowest process's imports: generation 0's barrier waits inprocess.barrier_timeout_s
    t, launch, out = job.trainer, engine.launch, engine.out

    # One planned fault fires in generation 0 and is not injected again: a later generation that resumed before its
    # step (a kill in the backward phase may restore the iteration before) would otherwise fire it once more on the
    # rank's new process. Several: the injector of every generation, which fires each where its step first runs.
    several_faults = len(job.neighbor_ckpt.fault_injection.planned()) > 1

    def make(attempt: Any) -> tuple[Any, Any]:
        torch.manual_seed(job.trainer.seed)  # as main() does before building: the first attempt is the plain run
        inject = attempt.iteration == 0 or several_faults
        recipe = build_recipe(job, args.run_dir, inject_faults=inject)
        if attempt.world_size != job.world_size:  # an elastic shrink: Lightning wants devices x nodes = world size
            nodes = t.num_nodes if attempt.world_size % t.num_nodes == 0 else 1
            recipe.trainer.devices, recipe.trainer.num_nodes = attempt.world_size // nodes, nodes
        fn = fdl.build(recipe)
        trainer = fn.keywords["trainer"]
        if args.record:
            label = str(attempt.iteration) if not launch else f"{launch}.{attempt.iteration}"
            trainer.callbacks.append(_Record.callback(out, attempt=launch + attempt.iteration, label=label))
            if job.neighbor_ckpt.fault_injection.enabled and inject and launch == 0:
                trainer.callbacks.insert(0, _Record.fault_clock(out, job, generation=attempt.iteration))
            engine.record_attempt(attempt)
        return trainer, fn

    with engine.recording_events():
        lip.run_trainer(engine.inproc, make)


if __name__ == "__main__":
    main()
