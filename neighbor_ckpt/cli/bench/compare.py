"""Side-by-side benchmark: the step time of a megatron-core GPT checkpointed every iteration, per method.

One job (``torch.multiprocessing`` spawn, gloo, file init on localhost; ``--world`` ranks, 4 by default) trains
the GPT of ``recipes/mcore_gpt_plain_loop.py`` (mcore ``GPTModel`` with the local layer spec, mcore
``DistributedDataParallel``, ``get_megatron_optimizer`` with the distributed optimizer, an
``OptimizerParamScheduler``, ``get_forward_backward_func()``; the model-building lines are copied from the
recipe) and times every training step while one of these checkpoints after every optimizer step:

``base``
    no checkpointing (the baseline every ratio is taken to);
``neighbor``
    ``NeighborCheckpointer`` + ``MegatronOptimizerAdapter`` + ``megatron_patches.install_hooks``, exactly as the
    recipe does (``snapshot(step, user_state=...)`` after the step; the wait point before the grad sync);
``dcp_async``
    ``torch.distributed.checkpoint.async_save`` of model weights + this rank's optimizer shard (the same tensors
    the neighbor snapshot holds, under a per-rank key) + scheduler, thread executor, on a dedicated gloo group;
    the previous future is waited for before the next save, as a user would;
``mcore_async``
    megatron-core ``dist_checkpointing.save`` of ``model.sharded_state_dict()`` + the distributed optimizer's
    ``sharded_state_dict`` (``dp_reshardable``), the ``torch_dist`` strategy wrapped in
    ``FullyParallelSaveStrategyWrapper`` over the DP group (Megatron-LM's defaults), ``async_sharded_save=True``
    with an ``AsyncCallsQueue`` (a forked writer process per save), the previous save finalized first. If the
    async path cannot run here it falls back to the synchronous save and says why;
``lightning_save``
    what ``ModelCheckpoint(every_n_train_steps=1)`` costs under a ZeRO-style strategy: the optimizer state is
    consolidated on rank 0 (``DistributedOptimizer.get_parameter_state_dp_zero()``, a gather over the DP
    group), then rank 0 writes a Lightning-format checkpoint dict with Lightning's own
    ``TorchCheckpointIO.save_checkpoint`` (``torch.save`` into a buffer, then one atomic file write). No
    ``Trainer`` runs: the model is a megatron-core model trained by a plain loop;
``nvrx_local`` / ``nvrx_local_repl``
    NVIDIA resiliency-ext local checkpointing: ``LocalCheckpointManager`` of an ``MCoreTensorAwareStateDict``
    (``fully_parallel`` over the DP group), ``save(..., is_async=True)`` scheduled on NVRx's
    ``AsyncCallsQueue`` with a forked writer per save (its default persistent writer hangs on this request: see
    :class:`NvrxLocal`); ``_repl`` adds ``CliqueReplicationStrategy`` (factor 2,
    jump 1: every rank's checkpoint is also stored by one peer, like the neighbor replica). Any failure on CPU
    is caught and printed as one line.

All checkpoints go to ``/dev/shm`` (``--store-dir``). Variants share one model and optimizer and run in
*blocks* of consecutive steps, interleaved round by round (the order rotates every round), so machine noise
hits all of them alike. A variant's first block starts with ``--warmup`` untimed steps; every later block with
one untimed step (the first save of a block has no previous save to wait for). After a block the variant is
drained (untimed), so no background work leaks into another variant's block. A step is ``forward_backward +
optimizer.step + scheduler.step + the checkpoint call`` and ends with an all-reduce of a failure flag (a
barrier, the same for every variant); its time is the slowest rank's.

Then the scaling figures: the same for ``base``, ``neighbor`` and the best alternative of the main table at
hidden sizes x2 and x4 (about 4x and 16x the parameters; x1 is the main table), and the per-rank unique bytes
of the checkpoint razor at DP = 1 / 2 / 4 from :func:`neighbor_ckpt.planning.planner.plan_job` (checked against the
bytes the live ``NeighborCheckpointer`` planned at DP = ``--world``).

``--projection`` prints the GPU projection instead (planner tables of the 8B / 70B / 175B job files, goodput of
per-iteration neighbor checkpointing vs a 30-minute disk checkpoint); ``--from-json`` takes the measured ratios
from an earlier run's ``--json``.

``--device cuda`` runs the same benchmark on GPUs: one rank per GPU (``--world`` defaults to every visible GPU,
1 is allowed), NCCL as the default process group (the benchmark's dedicated groups, DCP's and neighbor_ckpt's,
stay gloo), a GPU-sized model (``GPU_SHAPE``) in bf16 with fp32 main params in the distributed optimizer, and a
shorter protocol (``CUDA_PROTOCOL``) so that a run fits a 10-minute call; every timed step ends with a
synchronization of the training stream before the host clock is read. See :class:`Trainer` for the bf16 lines.

Run ``python -m neighbor_ckpt.cli.bench.compare`` (``--quick`` for a shorter run; ``neighbor-ckpt bench --compare``).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import math
import os
import platform
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

MiB = 2**20

VARIANTS = ("base", "neighbor", "dcp_async", "mcore_async", "lightning_save", "nvrx_local", "nvrx_local_repl",
            "neighbor_local", "neighbor_nosum")
ALTERNATIVES = ("dcp_async", "mcore_async", "lightning_save", "nvrx_local", "nvrx_local_repl")
DIAGNOSTICS = ("neighbor_local", "neighbor_nosum")
"""neighbor_ckpt with one part switched off, to show where its overhead goes (never a candidate 'alternative')."""
DESCRIPTIONS = {
    "base": "no checkpointing",
    "neighbor": "neighbor_ckpt snapshot (own slot + ring replica, shm)",
    "dcp_async": "torch DCP async_save (thread), /dev/shm",
    "mcore_async": "mcore dist_checkpointing.save torch_dist async, /dev/shm",
    "mcore_sync": "mcore dist_checkpointing.save torch_dist SYNC, /dev/shm",
    "lightning_save": "Lightning TorchCheckpointIO.save_checkpoint, rank 0, /dev/shm",
    "nvrx_local": "NVRx LocalCheckpointManager async, /dev/shm",
    "nvrx_local_repl": "NVRx local + CliqueReplication x2, /dev/shm",
    "neighbor_local": "diagnostic: neighbor_ckpt, transport off (own slot only)",
    "neighbor_nosum": "diagnostic: neighbor_ckpt, store.checksum none",
}

# The recipe's shape (recipes/mcore_gpt_plain_loop.py): SEQ, VOCAB, HIDDEN, HEADS, LAYERS = 32, 128, 64, 4, 2.
SEQ, VOCAB, HIDDEN, HEADS, LAYERS = 32, 128, 64, 4, 2

# Model and protocol defaults per --device (a flag given on the command line always wins).
SHAPE_KEYS = ("hidden", "layers", "heads", "seq", "vocab", "micro_batches", "micro_batch_size")
CPU_SHAPE = {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "seq": SEQ, "vocab": VOCAB, "micro_batches": 2,
             "micro_batch_size": 2}
GPU_SHAPE = {"hidden": 1024, "layers": 16, "heads": 16, "seq": 2048, "vocab": 32768, "micro_batches": 4,
             "micro_batch_size": 4}
"""--device cuda: a GPT of about 270 M params (12 B/param of unique state: 3.2 GB per snapshot at DP = 1)."""
CPU_PROTOCOL = {"steps": 20, "quick_steps": 8, "warmup": 3, "block": 5, "scales": "2,4", "quick_scales": "2"}
CUDA_PROTOCOL = {"steps": 8, "quick_steps": 4, "warmup": 2, "block": 4, "scales": "", "quick_scales": ""}
"""--device cuda: short enough for a 10-minute call with model building (11 steps per variant: on one H100 the default
variants took about 7.5 min at 13 steps each, lightning_save's 19 s per step half of it); scaling runs only with
--scales."""


# ==========================================================================================================
# worker side
# ==========================================================================================================


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
            num_layers=layers, hidden_size=hidden, num_attention_heads=heads, attention_dropout=0.1,
            hidden_dropout=0.1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            pipeline_dtype=torch.float32, use_cpu_initialization=True, gradient_accumulation_fusion=False,
            masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
            persist_layer_norm=False, apply_rope_fusion=False), **tc_gpu})
        model = wrap(GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                              max_sequence_length=seq, pre_process=True, post_process=True).cuda())
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=4096,
                                                   overlap_grad_reduce=False, overlap_param_gather=False, **ddp_gpu)
        self.ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01, clip_grad=1.0,
                            use_distributed_optimizer=True, **opt_gpu), [self.ddp])
        config.no_sync_func = self.ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        self.mbs, self.n_mb = mbs, n_mb
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.global_batch = mbs * n_mb * self.dp_size
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=3 * self.global_batch,
            lr_decay_steps=max(total_steps, 10) * self.global_batch, lr_decay_style="cosine", start_wd=0.01,
            end_wd=0.01, wd_incr_steps=1, wd_incr_style="constant")
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


def _dir_bytes(path: Path) -> int:
    total = 0
    if path.is_file():
        return path.stat().st_size
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            pass
    return total


class Variant:
    """One way of checkpointing every step. Methods run on every rank."""

    name = "?"
    mode_note = ""

    def __init__(self, tr: Trainer, root: Path, rank: int, world: int, tag: str) -> None:
        self.tr, self.root, self.rank, self.world, self.tag = tr, root / tag, rank, world, tag
        self.root.mkdir(parents=True, exist_ok=True)
        self.extra: dict[str, list[float]] = {}
        self.bytes_per_save: int | None = None  # this rank's, measured at the end of a block

    def setup(self) -> None: ...

    def start_block(self) -> None: ...

    def save(self, step: int) -> None: ...

    def end_block(self) -> None: ...

    def after_step(self) -> None:
        """Untimed, after every step's end (all ranks have passed the step's barrier)."""

    def close(self) -> None: ...

    @property
    def cuda(self) -> bool:
        return getattr(self.tr, "device", "cpu") == "cuda"

    def _note(self, key: str, value: float) -> None:
        self.extra.setdefault(key, []).append(value)


class Base(Variant):
    name = "base"

    def end_block(self) -> None:
        self.bytes_per_save = 0


class Neighbor(Variant):
    name = "neighbor"
    overrides: dict[str, Any] = {}

    def setup(self) -> None:
        from megatron_patches import mcore_groups
        from neighbor_ckpt import NeighborCheckpointer, NeighborCkptConfig
        from neighbor_ckpt.adapters.megatron import MegatronOptimizerAdapter

        groups = mcore_groups()
        doc: dict[str, Any] = {
            "job_id": f"bench-compare-{self.tag}-{os.getppid()}",
            "store": {"dir": str(self.root)},
            "report": {"status_every_n_steps": 0, "log_metrics": False, "timeline": False, "progress": "none"},
        }
        for section, values in self.overrides.items():
            doc.setdefault(section, {}).update(values)
        cfg = NeighborCkptConfig.from_dict(doc)
        self.ckpt = NeighborCheckpointer(cfg, adapter=MegatronOptimizerAdapter([self.tr.ddp], self.tr.optimizer),
                                         dp_group=groups.dp_group, model_parallel_coord=groups.coord,
                                         handle_sigterm=False)
        self.ckpt.recover()  # fresh start: one all-gather, nothing found
        # Time spent by the training thread at the wait point(s): a wrapper on the instance, installed before
        # install_hooks captures ckpt.wait (begin_optimizer_step calls self.wait() too).
        inner_wait = self.ckpt.wait
        self._wait_s = 0.0

        def timed_wait() -> None:
            t0 = time.perf_counter()
            inner_wait()
            self._wait_s += time.perf_counter() - t0

        self.ckpt.wait = timed_wait  # type: ignore[method-assign]
        self.hooks = None

    def start_block(self) -> None:
        from megatron_patches import install_hooks

        self.hooks = install_hooks(self.ckpt, self.tr.optimizer)
        self._wait_s = 0.0

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        self.ckpt.snapshot(step, user_state=self.tr.user_state())
        self._note("snapshot_call_s", time.perf_counter() - t0)
        self._note("wait_s", self._wait_s)  # the waits inside this step (before grad sync + optimizer step)
        self._wait_s = 0.0
        eng = self.ckpt.engine
        if eng is not None and eng.stats.iteration >= 0:  # the previous snapshot (it is complete by now)
            self._note("bg_copy_s", eng.stats.stage_seconds)
            self._note("bg_commit_s", eng.stats.commit_seconds)
            self._note("bg_stream_s", eng.stats.stream_seconds)

    def end_block(self) -> None:
        eng = self.ckpt.engine
        if eng is not None:
            eng.drain()
            # own + replica held (the replica only where there is a ring: DP > 1 and transport on)
            copies = 2 if self.ckpt.transport is not None else 1
            self.bytes_per_save = copies * (eng.stats.unique_bytes + eng.stats.extras_bytes)
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None

    @property
    def unique_bytes(self) -> int:
        return self.ckpt.plan.unique_bytes if self.ckpt.plan is not None else 0

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()
        self.ckpt.close(success=True)


class NeighborLocal(Neighbor):
    name = "neighbor_local"
    overrides = {"transport": {"enabled": False}}


class NeighborNoSum(Neighbor):
    name = "neighbor_nosum"
    overrides = {"store": {"checksum": "none"}}


def _optimizer_shard(tr: Trainer, rank: int) -> dict[str, Any]:
    """This rank's unique optimizer tensors (fp32 main-param shard + Adam moments), as the neighbor adapter sees
    them, under per-rank keys. The adapter's ``model/`` weight entries are left out: the weights are already under the
    state dict's ``model`` key, and per-rank copies of them would make DCP write the weights once more per DP rank.
    (The CPU figures of BENCHMARKS.md dated 2026-11-22 were measured before this fix and the one in
    :class:`DcpAsync`: DCP then saved the weights once per rank extra and no Adam moments.)"""
    from neighbor_ckpt.adapters.megatron import MegatronOptimizerAdapter
    from neighbor_ckpt.snapshot.razor import StateKind

    named = [(m, t) for m, t in MegatronOptimizerAdapter([tr.ddp], tr.optimizer).named_tensors()
             if m.kind != StateKind.WEIGHT]
    return {f"rank{rank}/{m.name}": t for m, t in named}


class DcpAsync(Variant):
    name = "dcp_async"

    def setup(self) -> None:
        import torch
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
        self.model_sd = {k: v for k, v in self.tr.ddp.module.state_dict().items() if isinstance(v, torch.Tensor)}
        # Taken at the first save (an untimed warm-up step), once the optimizer has stepped: Adam's moments do not
        # exist before its first step, and a shard taken here would hold the main params only.
        self.optim: dict[str, Any] | None = None
        self.future: Any = None
        self.n = 0

    def _wait(self) -> None:
        if self.future is not None:
            t0 = time.perf_counter()
            self.future.result()
            self._note("wait_s", time.perf_counter() - t0)
            self.future = None

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        self._wait()
        if self.optim is None:
            self.optim = _optimizer_shard(self.tr, self.rank)
        self.n += 1
        path = self.root / f"ckpt{self.n % 2}"
        sd = {"model": self.model_sd, "optimizer": self.optim, "scheduler": self.tr.scheduler.state_dict(),
              "iteration": step}
        t0 = time.perf_counter()
        self.future = dcp.async_save(sd, checkpoint_id=str(path), process_group=self.group)
        self._note("call_s", time.perf_counter() - t0)
        self._last = path

    def end_block(self) -> None:
        self._wait()
        if self.rank == 0:
            self.bytes_per_save = _dir_bytes(self._last)
        else:
            self.bytes_per_save = 0

    def close(self) -> None:
        self._wait()


def _mcore_sharded_state_dict(tr: Trainer, step: int) -> dict[str, Any]:
    model_sd = tr.ddp.module.sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": tr.optimizer.sharded_state_dict(model_sd, is_loading=False,
                                                     metadata={"distrib_optim_sharding_type": "dp_reshardable"}),
        "opt_param_scheduler": tr.scheduler.state_dict(),
        "iteration": step,
    }


class McoreAsync(Variant):
    name = "mcore_async"

    def setup(self) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        self.async_ok = True
        self.strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1),
                                                         self.tr.dp_group, do_cache_distribution=True)
        self.queue = AsyncCallsQueue(persistent=False)
        self.n = 0
        self.dirs: list[Path] = []

    def set_sync(self, why: str) -> None:
        self.async_ok = False
        self.name = "mcore_sync"
        self.mode_note = why

    def _wait(self) -> None:
        if self.async_ok and self.queue.get_num_unfinalized_calls():
            t0 = time.perf_counter()
            self.queue.maybe_finalize_async_calls(blocking=True)
            self._note("wait_s", time.perf_counter() - t0)

    def save(self, step: int) -> None:
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        self._wait()
        self.n += 1
        path = self.root / f"iter_{self.n:07d}"
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()  # Megatron-LM: rank 0 creates the directory, everybody waits (ensure_directory_exists)
        t0 = time.perf_counter()
        sd = _mcore_sharded_state_dict(self.tr, step)
        req = dist_checkpointing.save(sd, str(path), self.strategy, async_sharded_save=self.async_ok)
        if self.async_ok:
            self.queue.schedule_async_request(req)
        self._note("call_s", time.perf_counter() - t0)
        self.dirs.append(path)

    def after_step(self) -> None:
        # --device cuda: a checkpoint is GBs in /dev/shm (host memory); keep the last two (the one being written and
        # the one before it, finalized by this step's save) instead of a whole block's. Untimed; rank 0 only: every
        # rank finalized the older saves before this step's barrier.
        if self.cuda and self.rank == 0 and len(self.dirs) > 2:
            for d in self.dirs[:-2]:
                shutil.rmtree(d, ignore_errors=True)
            self.dirs = self.dirs[-2:]

    def end_block(self) -> None:
        import torch.distributed as dist

        self._wait()
        dist.barrier()
        if self.rank == 0 and self.dirs:
            self.bytes_per_save = _dir_bytes(self.dirs[-1])
            for d in self.dirs[:-1]:
                shutil.rmtree(d, ignore_errors=True)
            self.dirs = self.dirs[-1:]
        else:
            self.bytes_per_save = 0

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self.queue.close()


class LightningSave(Variant):
    name = "lightning_save"

    def setup(self) -> None:
        import lightning
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        self.io = TorchCheckpointIO()
        self.version = lightning.__version__
        self.path = self.root / "last.ckpt"

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        # ZeRO-style consolidation (Lightning's strategy.optimizer_state() under ZeroRedundancyOptimizer;
        # Megatron's legacy torch format): every DP rank takes part, rank 0 receives the full state.
        param_state = [o.get_parameter_state_dp_zero()
                       for o in getattr(self.tr.optimizer, "chained_optimizers", [self.tr.optimizer])]
        self._note("gather_s", time.perf_counter() - t0)
        if self.rank == 0:
            t1 = time.perf_counter()
            checkpoint = {
                "epoch": 0, "global_step": step + 1, "pytorch-lightning_version": self.version,
                "state_dict": self.tr.ddp.module.state_dict(),
                "loops": {}, "callbacks": {},
                "optimizer_states": [{"optimizer": self.tr.optimizer.state_dict(), "param_state": param_state}],
                "lr_schedulers": [self.tr.scheduler.state_dict()],
                "hyper_parameters": {"consumed_samples": self.tr.consumed},
            }
            self.io.save_checkpoint(checkpoint, self.path)
            self._note("write_s", time.perf_counter() - t1)

    def end_block(self) -> None:
        self.bytes_per_save = _dir_bytes(self.path) if self.rank == 0 and self.path.exists() else 0


class NvrxLocal(Variant):
    name = "nvrx_local"
    replicate = False

    def setup(self) -> None:
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

        repl = (CliqueReplicationStrategy.from_replication_params(replication_jump=1, replication_factor=2)
                if self.replicate else None)
        self.tasd_cls = MCoreTensorAwareStateDict
        self.manager = LocalCheckpointManager(str(self.root), session_id="bench", repl_strategy=repl)
        # NVRx 0.4.1's default persistent writer process hangs here: PersistentAsyncCaller puts the whole
        # AsyncRequest on a multiprocessing queue, and LocalCheckpointManager.save's finalize_fns hold a local
        # closure that cannot be pickled; the queue's feeder thread drops the item and the trainer waits for a
        # completion that never comes. A forked writer per save (TemporalAsyncCaller) works:
        self.queue = AsyncCallsQueue(persistent=False)
        self.cached: Any = None

    def _wait(self) -> None:
        if self.queue.get_num_unfinalized_calls():
            t0 = time.perf_counter()
            self.queue.maybe_finalize_async_calls(blocking=True)
            self._note("wait_s", time.perf_counter() - t0)

    def save(self, step: int) -> None:
        self._wait()
        t0 = time.perf_counter()
        sd = _mcore_sharded_state_dict(self.tr, step)
        tasd, self.cached = self.tasd_cls.from_state_dict(sd, algo="fully_parallel",
                                                          parallelization_group=self.tr.dp_group,
                                                          cached_metadata=self.cached)
        req = self.manager.save(tasd, step, is_async=True)
        self.queue.schedule_async_request(req)
        self._note("call_s", time.perf_counter() - t0)

    def end_block(self) -> None:
        self._wait()
        self.bytes_per_save = _dir_bytes(self.manager.local_ckpt_dir)

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self.queue.close()


class NvrxLocalRepl(NvrxLocal):
    name = "nvrx_local_repl"
    replicate = True


CLASSES: dict[str, type[Variant]] = {"base": Base, "neighbor": Neighbor, "dcp_async": DcpAsync,
                                     "mcore_async": McoreAsync, "lightning_save": LightningSave,
                                     "nvrx_local": NvrxLocal, "nvrx_local_repl": NvrxLocalRepl,
                                     "neighbor_local": NeighborLocal, "neighbor_nosum": NeighborNoSum}


_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_by_thread() -> dict[str, float]:
    """CPU seconds used so far: this process (``process``, reaped children included) and each Python thread by
    name (numbers folded: ``ThreadPoolExecutor-0_0`` -> ``ThreadPoolExecutor``); ``other`` = threads that are
    not Python threads (gloo's, torch's)."""
    import threading

    t = os.times()
    out: dict[str, float] = {"process": t.user + t.system + t.children_user + t.children_system}
    named = 0.0
    for th in threading.enumerate():
        tid = th.native_id
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / _CLK
        except (OSError, IndexError, ValueError):
            continue
        name = "main" if th is threading.main_thread() else th.name.split("-")[0] if th.name.startswith(
            ("ThreadPoolExecutor", "Thread")) else th.name
        out[name] = out.get(name, 0.0) + cpu
        named += cpu
    out["other"] = t.user + t.system - named
    return out


def _release_host_memory() -> None:
    """--device cuda, after a block (untimed, outside its CPU accounting): hand host memory the finished variant freed
    back to the OS, so GB-sized staging copies do not pile up across variants: the CUDA caching host allocator's
    pinned blocks (mcore's and NVRx's non-blocking D2H copies land there) and glibc's free heap. The next block's
    first step, untimed, pins again what it needs."""
    import torch

    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None:
        empty_host_cache()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text[:300]


class Runner:
    """Interleaved blocks of variants on one model, every rank in lock step."""

    def __init__(self, tr: Trainer, variants: dict[str, Variant], cfg: dict[str, Any], label: str) -> None:
        self.tr, self.variants, self.cfg, self.label = tr, variants, cfg, label
        self.times: dict[str, list[float]] = {k: [] for k in variants}  # this rank's timed steps
        self.blocks: dict[str, list[int]] = {k: [] for k in variants}  # round index of each timed step
        self.failed: dict[str, str] = {}
        self.cpu: dict[str, dict[str, float]] = {k: {} for k in variants}  # CPU s over the timed steps, by thread
        self.step_no = 0
        self.cuda = cfg.get("device", "cpu") == "cuda"
        self.roots = [v.root for v in variants.values()]

    def _agree(self, err: str | None) -> str | None:
        """Collective: the first rank's error, or None when every rank succeeded."""
        import torch.distributed as dist

        errs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
        bad = [(r, e) for r, e in enumerate(errs) if e]
        return None if not bad else f"rank {bad[0][0]}: {bad[0][1]}"

    def setup(self) -> None:
        for name in list(self.variants):
            err = None
            try:
                self.variants[name].setup()
            except Exception as e:  # noqa: BLE001
                err = _one_line(e)
                if self.cfg["verbose"]:
                    traceback.print_exc()
            err = self._agree(err)
            if err:
                self.failed[name] = f"setup failed: {err}"
                del self.variants[name]
                for per_variant in (self.times, self.blocks, self.cpu):
                    per_variant.pop(name, None)

    def block(self, name: str, untimed: int, timed: int, rnd: int) -> str | None:
        import torch
        import torch.distributed as dist

        v = self.variants[name]
        # Under NCCL the default group's collectives need CUDA tensors; the flag lives on this rank's GPU.
        flag = torch.zeros(1, device="cuda") if self.cuda else torch.zeros(1)
        err: str | None = None
        try:
            v.start_block()
        except Exception as e:  # noqa: BLE001
            err = _one_line(e)
        flag[0] = 1.0 if err else 0.0
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag[0]:
            return self._agree(err) or "failed on another rank"
        cpu0: dict[str, float] = {}
        for k in range(untimed + timed):
            if k == untimed:
                cpu0 = _cpu_by_thread()
            t0 = time.perf_counter()
            try:
                self.tr.step()
                v.save(self.step_no)
            except Exception as e:  # noqa: BLE001
                err = _one_line(e)
                if self.cfg["verbose"]:
                    traceback.print_exc()
            self.step_no += 1
            flag[0] = 1.0 if err else 0.0
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the step's end: a barrier with a failure flag
            if self.cuda:
                # GPU work is asynchronous: the step ends when the training stream (the step's kernels, then the
                # flag's all-reduce) is done. Only this stream: a device-wide torch.cuda.synchronize() would also
                # wait for copies a method runs on its own side stream (neighbor_ckpt's D2H staging) and charge its
                # background work to the step.
                torch.cuda.current_stream().synchronize()
            dt = time.perf_counter() - t0
            if flag[0]:
                return self._agree(err) or "failed on another rank"
            if k >= untimed:
                self.times[name].append(dt)
                self.blocks[name].append(rnd)
            v.after_step()
        cpu1 = _cpu_by_thread()
        acc = self.cpu[name]
        for key in set(cpu0) | set(cpu1):
            acc[key] = acc.get(key, 0.0) + cpu1.get(key, 0.0) - cpu0.get(key, 0.0)
        try:
            v.end_block()
        except Exception as e:  # noqa: BLE001
            err = _one_line(e)
        err = self._agree(err)
        gc.collect()
        if self.cuda:
            _release_host_memory()
        return err

    def run(self, steps: int, block: int, warmup: int, on_fail: Callable[[str, str], bool] | None = None) -> None:
        rounds = math.ceil(steps / block)
        for rnd in range(rounds):
            names = list(self.variants)
            k = rnd % len(names) if names else 0
            order = names[k:] + names[:k]
            if rnd % 2:
                order.reverse()
            for name in order:
                if name not in self.variants:
                    continue
                timed = min(block, steps - len(self.times[name]))
                if timed <= 0:
                    continue
                untimed = warmup if rnd == 0 else 1
                err = self.block(name, untimed, timed, rnd)
                while err and rnd == 0 and on_fail is not None and on_fail(name, err):
                    self.times[name].clear()
                    self.blocks[name].clear()
                    self.cpu[name].clear()
                    err = self.block(name, untimed, timed, rnd)
                if err:
                    self.failed[name] = err
                    v = self.variants.pop(name)
                    self.times.pop(name, None)
                    try:
                        v.close()
                    except Exception:  # noqa: BLE001
                        pass
            if self.cfg["verbose"] and int(os.environ.get("RANK", "0")) == 0:
                print(f"[compare] {self.label}: round {rnd + 1}/{rounds} done", flush=True)

    def close(self) -> None:
        for name, v in list(self.variants.items()):
            try:
                v.close()
            except Exception as e:  # noqa: BLE001
                self.failed.setdefault(name, f"close failed: {_one_line(e)}")
        if self.cuda:
            # GB-sized checkpoints in /dev/shm are host memory: free them before another model is built. Every
            # rank has closed (finalized its writes) before rank 0 removes the shared directories.
            import torch.distributed as dist

            dist.barrier()
            if dist.get_rank() == 0:
                for root in self.roots:
                    shutil.rmtree(root, ignore_errors=True)
            dist.barrier()

    def results(self) -> dict[str, Any]:
        """Collective: per-variant per-step times (max over ranks), extras from every rank."""
        import torch.distributed as dist

        mine = {"times": self.times, "blocks": self.blocks, "cpu": self.cpu,
                "extra": {k: v.extra for k, v in self.variants.items()},
                "bytes": {k: v.bytes_per_save for k, v in self.variants.items()}}
        allr: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(allr, mine)
        out: dict[str, Any] = {"variants": {}, "failed": dict(self.failed)}
        for name in self.times:
            per_rank = [r["times"][name] for r in allr]
            n = min(len(x) for x in per_rank)
            v = self.variants[name]
            out["variants"][name] = {
                "step_s": [max(x[i] for x in per_rank) for i in range(n)],
                "round": allr[0]["blocks"][name][:n],
                "label": v.name, "note": v.mode_note,
                "bytes_per_save_job": sum(r["bytes"][name] or 0 for r in allr),
                # CPU per timed step, by thread, averaged over ranks (ms of one core)
                "cpu_ms_per_step": {k: 1e3 * statistics.mean(r["cpu"][name].get(k, 0.0) for r in allr) / max(n, 1)
                                    for k in sorted(set().union(*(r["cpu"][name] for r in allr)))},
                "extra_median": {k: statistics.median([statistics.median(r["extra"][name][k]) for r in allr
                                                       if r["extra"][name].get(k)] or [float("nan")])
                                 for k in allr[0]["extra"][name]},
                "extra_max_rank_median": {k: max([statistics.median(r["extra"][name][k]) for r in allr
                                                  if r["extra"][name].get(k)] or [float("nan")])
                                          for k in allr[0]["extra"][name]},
            }
        return out


def _fused_adam_without_te() -> str:
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


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]), GLOO_SOCKET_IFNAME="lo")
    faulthandler.dump_traceback_later(cfg["timeout_s"], exit=True)
    logging.basicConfig(level=logging.WARNING if cfg["verbose"] else logging.ERROR,
                        format=f"[rank{rank}] %(name)s %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(cfg["threads"])
    import torch.distributed as dist

    from megatron_patches import enable_cpu

    device = cfg.get("device", "cpu")
    if device == "cuda":
        torch.cuda.set_device(rank)  # one GPU per rank; before NCCL and before any CUDA tensor
    elif not torch.cuda.is_available():
        enable_cpu()
    from megatron.core import parallel_state

    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{cfg['init_file']}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=cfg["pg_timeout_s"]))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    root = Path(cfg["root"])
    result: dict[str, Any] = {"world": world}
    if device == "cuda":
        result["device"] = "cuda"
        result["optimizer"] = _fused_adam_without_te()
    t_start = time.perf_counter()
    total_steps = 4 * (cfg["steps"] + cfg["warmup"] + 4) * len(cfg["variants"])

    def build(hidden: int) -> Trainer:
        return Trainer(hidden=hidden, layers=cfg["layers"], heads=cfg["heads"], seq=cfg["seq"], vocab=cfg["vocab"],
                       mbs=cfg["micro_batch_size"], n_mb=cfg["micro_batches"], total_steps=total_steps,
                       device=device)

    # -- main comparison -------------------------------------------------------------------------------------
    tr = build(cfg["hidden"])
    if device == "cuda" and cfg["verbose"] and rank == 0:
        print(f"[compare] model built: {tr.params:,} params in {time.perf_counter() - t_start:.1f} s; GPU memory "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)
    variants = {n: CLASSES[n](tr, root, rank, world, f"main-{n}") for n in cfg["variants"]}
    runner = Runner(tr, variants, cfg, "main")
    runner.setup()

    def mcore_fallback(name: str, err: str) -> bool:
        v = runner.variants.get(name)
        if isinstance(v, McoreAsync) and v.async_ok:
            v.set_sync(f"async save failed on {device.upper()} ({err}); ran the synchronous save")
            return True
        return False

    runner.run(cfg["steps"], cfg["block"], cfg["warmup"], on_fail=mcore_fallback)
    neighbor_unique = [0]
    if "neighbor" in runner.variants:
        nb = runner.variants["neighbor"]
        assert isinstance(nb, Neighbor)  # noqa: S101
        neighbor_unique = [nb.unique_bytes]
        del nb
    main = runner.results()
    uniq: list[Any] = [None] * world
    dist.all_gather_object(uniq, neighbor_unique[0])
    main["neighbor_unique_bytes_per_rank"] = uniq
    main["params"] = tr.params
    main["hidden"] = tr.hidden
    main["elapsed_s"] = time.perf_counter() - t_start
    runner.close()
    result["main"] = main
    if device == "cuda":  # a scaling run builds a bigger model on the same GPU: free this one first
        runner.variants.clear()
        del tr, variants, runner
        gc.collect()
        torch.cuda.empty_cache()

    # -- scaling: base, neighbor and the best alternative at 4x / 16x parameters ---------------------------
    best = _best_alternative(main)
    result["best_alternative"] = best
    result["scaling"] = []
    for mult in cfg["scale_hidden"]:
        t1 = time.perf_counter()
        hidden = cfg["hidden"] * mult
        trs = build(hidden)
        names = ["base", "neighbor"] + ([best] if best and cfg["scale_with_best"] else [])
        vs = {n: CLASSES[n](trs, root, rank, world, f"x{mult}-{n}") for n in names}
        sr = Runner(trs, vs, cfg, f"hidden x{mult}")
        sr.setup()
        mv = sr.variants.get("mcore_async")
        if isinstance(mv, McoreAsync) and main["variants"].get("mcore_async", {}).get("label") == "mcore_sync":
            mv.set_sync(main["variants"]["mcore_async"]["note"])
        sr.run(cfg["scale_steps"], cfg["block"], cfg["warmup"], on_fail=None)
        nu = [0]
        if "neighbor" in sr.variants:
            nbv = sr.variants["neighbor"]
            assert isinstance(nbv, Neighbor)  # noqa: S101
            nu = [nbv.unique_bytes]
        res = sr.results()
        uq: list[Any] = [None] * world
        dist.all_gather_object(uq, nu[0])
        res.update(hidden=hidden, params=trs.params, neighbor_unique_bytes_per_rank=uq,
                   elapsed_s=time.perf_counter() - t1)
        sr.close()
        result["scaling"].append(res)
        del trs, sr, vs
        gc.collect()
    result["elapsed_s"] = time.perf_counter() - t_start
    dist.barrier()
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(result, default=str))
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def _profile_worker(rank: int, cfg: dict[str, Any]) -> None:
    """One rank (DP = 1, no transport): cProfile of the training thread's ``NeighborCheckpointer.snapshot()``."""
    import cProfile
    import io
    import pstats

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    logging.basicConfig(level=logging.ERROR)
    import torch

    torch.set_num_threads(cfg["threads"])
    import torch.distributed as dist

    from megatron_patches import enable_cpu

    if not torch.cuda.is_available():
        enable_cpu()
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{cfg['init_file']}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tr = Trainer(hidden=cfg["hidden"], layers=cfg["layers"], heads=cfg["heads"], seq=cfg["seq"], vocab=cfg["vocab"],
                 mbs=cfg["micro_batch_size"], n_mb=cfg["micro_batches"], total_steps=10_000)
    v = Neighbor(tr, Path(cfg["root"]), 0, 1, "profile")
    v.setup()
    v.start_block()
    n = cfg["steps"]
    for i in range(3):
        tr.step()
        v.save(i)
    plain = 0.0
    for i in range(3, 3 + n):
        tr.step()
        t0 = time.perf_counter()
        v.save(i)
        plain += time.perf_counter() - t0
    prof = cProfile.Profile()
    for i in range(3 + n, 3 + 2 * n):
        tr.step()
        prof.enable()
        v.save(i)
        prof.disable()
    v.end_block()
    v.close()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(22)
    print(f"NeighborCheckpointer.snapshot() on the training thread: {1e3 * plain / n:.2f} ms per call (mean of {n}, "
          f"no profiler; hidden {cfg['hidden']}, DP=1, no transport). cProfile of {n} more calls:", flush=True)
    print(text.getvalue(), flush=True)
    dist.destroy_process_group()


def _best_alternative(main: dict[str, Any]) -> str | None:
    """The alternative with the lowest median step time (from gathered data: the same on every rank)."""
    cands = {k: statistics.median(v["step_s"]) for k, v in main["variants"].items()
             if k in ALTERNATIVES and v["step_s"]}
    return min(cands, key=lambda k: cands[k]) if cands else None


# ==========================================================================================================
# parent side: statistics and tables
# ==========================================================================================================


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _boot_ci(a: Sequence[float], b: Sequence[float], fn: Callable[[float, float], float], n: int = 2000,
             seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of ``fn(median(a), median(b))`` (steps resampled independently)."""
    if not a or not b:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    vals = []
    for _ in range(n):
        ma = statistics.median(rng.choices(a, k=len(a)))
        mb = statistics.median(rng.choices(b, k=len(b)))
        vals.append(fn(ma, mb))
    vals.sort()
    return vals[int(0.025 * n)], vals[int(0.975 * n) - 1]


def _fmt_bytes(n: float | None) -> str:
    if n is None or n != n:
        return "-"
    for unit, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= s:
            return f"{n / s:.2f} {unit}"
    return f"{int(n)} B"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = ["| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                       for i, (c, w) in enumerate(zip(r, widths))) + " |")
    return "\n".join(lines)


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios, overheads and the 10x verdict of one run's JSON."""
    main = res["main"]
    vs = main["variants"]
    base = vs.get("base", {}).get("step_s", [])
    mb = _median(base)
    rows = {}
    for name, v in vs.items():
        s = v["step_s"]
        m = _median(s)
        lo, hi = _boot_ci(s, base, lambda x, y: x - y) if name != "base" else (0.0, 0.0)
        # Paired by round: median over rounds of (median of the variant's block - median of base's block).
        by_round: dict[int, list[float]] = {}
        for t, r in zip(s, v["round"]):
            by_round.setdefault(r, []).append(t)
        base_round: dict[int, list[float]] = {}
        for t, r in zip(base, vs.get("base", {}).get("round", [])):
            base_round.setdefault(r, []).append(t)
        paired = [_median(by_round[r]) - _median(base_round[r]) for r in by_round if r in base_round]
        rows[name] = {"label": v["label"], "note": v.get("note", ""), "median_s": m, "n": len(s),
                      "ratio": m / mb if mb else float("nan"), "overhead_s": m - mb, "overhead_ci": (lo, hi),
                      "paired_overhead_s": _median(paired), "bytes_per_save_job": v.get("bytes_per_save_job"),
                      "min_s": min(s) if s else float("nan"), "max_s": max(s) if s else float("nan"),
                      "extra": v.get("extra_median", {}), "extra_max": v.get("extra_max_rank_median", {}),
                      "cpu": v.get("cpu_ms_per_step", {})}
    alts = {k: r for k, r in rows.items() if k in ALTERNATIVES}
    best = min(alts, key=lambda k: alts[k]["overhead_s"]) if alts else None
    verdict: dict[str, Any] = {"best": best}
    if best and "neighbor" in rows:
        on, ob = rows["neighbor"]["overhead_s"], alts[best]["overhead_s"]
        verdict["neighbor_overhead_s"] = on
        verdict["best_overhead_s"] = ob
        # ob <= 0: the best alternative costs nothing measurable; no ratio can be claimed (nan).
        verdict["ratio"] = float("nan") if ob <= 0 else ob / on if on > 0 else math.inf
        nb_steps, best_steps = vs["neighbor"]["step_s"], vs[best]["step_s"]
        verdict["ratio_ci"] = _boot_ci(best_steps, nb_steps,
                                       lambda x, y: (x - mb) / (y - mb) if y - mb > 0 else math.inf, seed=1)
        verdict["met"] = verdict["ratio"] >= 10
        pn, pb = rows["neighbor"]["paired_overhead_s"], alts[best]["paired_overhead_s"]
        verdict["paired_ratio"] = float("nan") if pb <= 0 else pb / pn if pn > 0 else math.inf
    return {"rows": rows, "base_s": mb, "verdict": verdict}


def _cpu_cell(cpu_ms: float | None, base_ms: float, name: str) -> str:
    if cpu_ms is None or cpu_ms != cpu_ms:
        return "-"
    return f"{cpu_ms:.0f}" if name == "base" else f"{cpu_ms:.0f} ({cpu_ms - base_ms:+.0f})"


def _ms(x: float) -> str:
    return "-" if x != x else f"{1e3 * x:.1f}"


def d2h_line(res: dict[str, Any], hardware: str = "h100") -> str | None:
    """--device cuda: neighbor_ckpt's measured D2H staging bandwidth (unique bytes per rank / median background copy
    time) next to the bandwidth the planner assumes for ``hardware``; None for CPU runs or without the data."""
    from neighbor_ckpt.planning.planner import HARDWARE

    main = res["main"]
    nb = main["variants"].get("neighbor")
    if res.get("device") != "cuda" or not nb:
        return None
    copy_s = nb.get("extra_median", {}).get("bg_copy_s")
    uniq = [u for u in main.get("neighbor_unique_bytes_per_rank", []) if u]
    if not copy_s or copy_s != copy_s or copy_s <= 0 or not uniq:
        return None
    ub = statistics.median(uniq)
    assumed = HARDWARE[hardware].pcie_gbytes_per_s
    return (f"* neighbor_ckpt D2H staging: {_fmt_bytes(ub)} of unique state per rank into its page-locked /dev/shm "
            f"slot in {_ms(copy_s)} ms (median over steps, median over ranks; engine stats.stage_seconds: the "
            f"side-stream copy, including any wait for the step's last kernels) = {ub / copy_s / 1e9:.1f} GB/s per "
            f"GPU; the planner assumes "
            f"{assumed:g} GB/s (neighbor_ckpt.planning.planner.HARDWARE['{hardware}'].pcie_gbytes_per_s)")


def render(res: dict[str, Any], info: dict[str, Any], args: argparse.Namespace) -> str:
    out: list[str] = []
    main = res["main"]
    s = summarize(res)
    rows, verdict = s["rows"], s["verdict"]
    cuda = res.get("device") == "cuda"
    if cuda:
        out.append(f"neighbor_ckpt side-by-side benchmark | {res['world']} x {info.get('gpu_name', 'GPU?')} of "
                   f"{info.get('gpu_count', '?')} (driver {info.get('gpu_driver', '?')}, {info.get('gpu_pcie', '?')}) | "
                   f"torch {info['torch']}, CUDA {info.get('torch_cuda')}, NCCL {info.get('nccl', '?')}, python "
                   f"{info.get('python', '?')} | {info['nproc']} CPU(s) {info['cpu_model']} | {res['world']} NCCL "
                   f"rank(s), one GPU and {args.threads} intra-op thread(s) each | store {info['store_root']}")
        out.append(f"model: mcore GPT, {args.layers} layers, hidden {main['hidden']}, heads {args.heads}, seq "
                   f"{args.seq}, vocab {args.vocab}: {main['params']:,} params, bf16 with fp32 main params; "
                   f"distributed optimizer over DP={res['world']}; {args.micro_batches} micro-batches x "
                   f"{args.micro_batch_size} per rank per step")
    else:
        out.append(f"neighbor_ckpt side-by-side benchmark | {info['nproc']} CPU(s) {info['cpu_model']} | torch "
                   f"{info['torch']} | {res['world']} gloo ranks, {args.threads} intra-op thread(s) each | store "
                   f"{info['store_root']}")
        out.append(f"model: mcore GPT, {args.layers} layers, hidden {main['hidden']}, heads {args.heads}, seq "
                   f"{args.seq}, vocab {args.vocab}: {main['params']:,} params; distributed optimizer over "
                   f"DP={res['world']}; {args.micro_batches} micro-batches x {args.micro_batch_size} per rank per step")
    out.append(f"protocol: {args.steps} timed steps per variant in blocks of {args.block}, interleaved; "
               f"{args.warmup} warm-up steps in each variant's first block, 1 untimed step in later blocks; "
               f"step time = slowest rank" + ("; a step ends when the training stream is synchronized" if cuda
                                             else ""))
    out.append("")
    hdr = ["variant", "what", "median step ms", "x base", "overhead ms (95% CI)", "paired ovh ms",
           "ovh / neighbor ovh", "state per save (job)", "CPU ms/step/rank"]
    base_cpu = rows.get("base", {}).get("cpu", {}).get("process", float("nan"))
    table = []
    on = rows.get("neighbor", {}).get("overhead_s", float("nan"))
    order = [v for v in VARIANTS if v in rows]
    for name in order:
        r = rows[name]
        lo, hi = r["overhead_ci"]
        ci = "" if name == "base" else f" ({_ms(lo)}..{_ms(hi)})"
        rel = "-" if name in ("base",) or on != on or on <= 0 else f"{r['overhead_s'] / on:.1f}x"
        label = r["label"]
        table.append([label, DESCRIPTIONS.get(label, ""), _ms(r["median_s"]), f"{r['ratio']:.3f}",
                      ("0" if name == "base" else _ms(r["overhead_s"])) + ci,
                      "-" if name == "base" else _ms(r["paired_overhead_s"]), rel,
                      _fmt_bytes(r["bytes_per_save_job"]), _cpu_cell(r["cpu"].get("process"), base_cpu, name)])
    out.append(_table(hdr, table))
    out.append("")
    for name, why in main["failed"].items():
        out.append(f"* {name}: could not run here: {why}")
    for name in order:
        if rows[name]["note"]:
            out.append(f"* {rows[name]['label']}: {rows[name]['note']}")
    if "ratio" in verdict:
        b = verdict["best"]
        lo, hi = verdict["ratio_ci"]
        status = "MET" if verdict["met"] else "MISSED"
        if verdict["ratio"] != verdict["ratio"]:
            status = "INCONCLUSIVE (the best alternative's overhead is within noise)"
        out.append(f"* target 'neighbor_ckpt step overhead >= 10x lower than the best alternative': best alternative "
                   f"= {rows[b]['label']} (overhead {_ms(verdict['best_overhead_s'])} ms/step), neighbor_ckpt "
                   f"{_ms(verdict['neighbor_overhead_s'])} ms/step -> {verdict['ratio']:.1f}x lower (95% CI "
                   f"{lo:.1f}..{hi:.1f}; paired by round {verdict['paired_ratio']:.1f}x): {status}")
    bc, bs = rows.get("base", {}).get("cpu", {}).get("process"), rows.get("base", {}).get("median_s")
    if bc and bs and not cuda:
        util = bc * 1e-3 * res["world"] / (info["nproc"] * bs)
        out.append(f"* CPU budget: a base step costs {bc:.0f} ms of CPU per rank; {res['world']} ranks on "
                   f"{info['nproc']} core(s) keep them {100 * util:.0f}% busy during the median step. Work a "
                   f"checkpoint method does 'in the background' has no idle core to hide in here: its extra CPU shows "
                   f"up in the step time.")
    nbx = rows.get("neighbor", {}).get("extra", {})
    if nbx:
        out.append("* neighbor_ckpt per step (median over steps, median over ranks): training thread in snapshot() "
                   f"{_ms(nbx.get('snapshot_call_s', float('nan')))} ms, at the wait points "
                   f"{_ms(nbx.get('wait_s', float('nan')))} ms; background thread: copy "
                   f"{_ms(nbx.get('bg_copy_s', float('nan')))} ms, commit (extras + xxh3 + header) "
                   f"{_ms(nbx.get('bg_commit_s', float('nan')))} ms, stream + ack "
                   f"{_ms(nbx.get('bg_stream_s', float('nan')))} ms")
    d2h = d2h_line(res)
    if d2h:
        out.append(d2h)
    if res.get("optimizer"):
        out.append(f"* optimizer: {res['optimizer']}, distributed (fp32 main params and moments sharded over DP)")
    for name in order:
        cpu = rows[name]["cpu"]
        if cpu and name in ("base", "neighbor", *DIAGNOSTICS):
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if k != "process")
            out.append(f"* {rows[name]['label']} CPU ms per step per rank by thread: {parts}")
    for name in order:
        ex = rows[name]["extra"]
        if name not in ("base", "neighbor") and ex:
            parts = ", ".join(f"{k.removesuffix('_s')} {_ms(v)} ms" for k, v in ex.items())
            out.append(f"* {rows[name]['label']} per step (median): {parts}")
    uniq = [u for u in main.get("neighbor_unique_bytes_per_rank", []) if u]
    out.append("")

    # -- scaling -------------------------------------------------------------------------------------------
    from neighbor_ckpt.planning.planner import HARDWARE, ModelShape, Parallelism, plan_job

    def shape(hidden: int) -> Any:
        return ModelShape(num_layers=args.layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                          num_attention_heads=args.heads, vocab_size=args.vocab, seq_length=args.seq,
                          share_embeddings_and_output_weights=False)  # GPTModel's default: untied

    scal = [{"hidden": main["hidden"], "params": main["params"], "rows": rows, "best": verdict.get("best"),
             "uniq": main.get("neighbor_unique_bytes_per_rank", [])}]
    for sr in res.get("scaling", []):
        ss = summarize({"main": sr})
        scal.append({"hidden": sr["hidden"], "params": sr["params"], "rows": ss["rows"],
                     "best": ss["verdict"].get("best"),
                     "uniq": sr.get("neighbor_unique_bytes_per_rank", []), "failed": sr.get("failed", {})})
    p0 = scal[0]["params"]
    hdr = ["params", "hidden", "unique/rank DP=1", "DP=2", "DP=4", f"live plan DP={res['world']}",
           "base ms", "neighbor ovh ms (95% CI)", "neighbor ovh %", "neighbor +CPU ms/rank", "best alt",
           "best alt ovh ms", "ratio"]
    table = []
    for sc in scal:
        pl = {d: plan_job(shape(sc["hidden"]), Parallelism(dp=d), HARDWARE["cpu"], extras_bytes=0).classes[0]
              for d in (1, 2, 4)}
        r = sc["rows"]
        base_s = r.get("base", {}).get("median_s", float("nan"))
        nb = r.get("neighbor", {})
        alt = [sc["best"]] if sc["best"] else []
        alt_ovh = r[alt[0]]["overhead_s"] if alt else float("nan")
        no = nb.get("overhead_s", float("nan"))
        nlo, nhi = nb.get("overhead_ci", (float("nan"), float("nan")))
        ncpu = nb.get("cpu", {}).get("process", float("nan")) - r.get("base", {}).get("cpu", {}).get("process",
                                                                                                     float("nan"))
        live = max(sc["uniq"]) if sc["uniq"] else None
        table.append([f"{sc['params']:,} ({sc['params'] / p0:.1f}x)", str(sc["hidden"]),
                      _fmt_bytes(pl[1].unique_payload_bytes), _fmt_bytes(pl[2].unique_payload_bytes),
                      _fmt_bytes(pl[4].unique_payload_bytes), _fmt_bytes(live), _ms(base_s),
                      f"{_ms(no)} ({_ms(nlo)}..{_ms(nhi)})", f"{100 * no / base_s:.1f}%" if base_s == base_s else "-",
                      "-" if ncpu != ncpu else f"{ncpu:+.1f}",
                      r[alt[0]]["label"] if alt else "-", _ms(alt_ovh),
                      ("-" if not alt or alt_ovh <= 0 else f"{alt_ovh / no:.1f}x" if no > 0 else "inf")])
        if sc["params"] != plan_job(shape(sc["hidden"]), Parallelism(dp=1), HARDWARE["cpu"]).classes[0].params_per_rank:
            out.append(f"* note: planner counts {pl[1].params_per_rank:,} params for hidden {sc['hidden']}, the live "
                       f"model has {sc['params']:,}")
        for name, why in sc.get("failed", {}).items():
            out.append(f"* scaling hidden {sc['hidden']}: {name} could not run: {why}")
    out.append("Scaling (unique/rank: 12 B/param/DP from neighbor_ckpt.planning.planner.plan_job, payload only; live plan: "
               "NeighborCheckpointer.plan.unique_bytes, max over ranks, incl. mcore's bucket padding):")
    out.append(_table(hdr, table))
    out.append("")
    out.append(f"total benchmark time {res.get('wall_s', float('nan')):.0f} s "
               f"(workers {res.get('elapsed_s', 0):.0f} s); "
               f"other processes used {info.get('other_cpu_frac', float('nan')) * 100:.0f}% of the CPUs; "
               f"/proc/loadavg at start {info.get('loadavg_start')}"
               + ("  WARNING: the machine was busy, figures are skewed" if info.get("other_cpu_frac", 0) > 0.05
                  else ""))
    return "\n".join(out)


# ==========================================================================================================
# GPU projection
# ==========================================================================================================


def projection(measured: dict[str, Any] | None = None, *, gpus: int = 1024, gpu_mtbf_hours: float = 80_000.0,
               gpus_per_node: int = 8) -> str:
    """Planner tables of the full-size job files and goodput of per-iteration neighbor checkpoints vs a 30-minute
    disk checkpoint on ``gpus`` H100s (``measured``: a run's JSON, for the measured overhead ratios)."""
    from neighbor_ckpt.planning.jobspec import load_job
    from neighbor_ckpt.planning.planner import (goodput_loss, loss_breakdown, optimal_interval, p_recovery, p_unrecoverable,
                                       ring_nodes_for)

    out: list[str] = []
    repo = Path(__file__).resolve().parents[3]
    for name in ("llama3_8b", "llama3_70b", "gpt3_175b"):
        job = load_job(repo / "configs" / f"{name}.yaml")
        out.append(f"$ neighbor-ckpt plan configs/{name}.yaml")
        out.append(job.plan().format_table())
        out.append("")

    nodes = gpus // gpus_per_node
    node_mtbf_s = gpu_mtbf_hours / gpus_per_node * 3600
    job = load_job(repo / "configs" / "llama3_70b.yaml", [f"trainer.num_nodes={nodes}"])
    plan = job.plan()
    t_it = max(c.compute_seconds for c in plan.classes)
    p = job.parallelism
    ring = ring_nodes_for(tp=p.tensor, cp=p.context, dp=job.data_parallel, gpus_per_node=gpus_per_node)
    members = job.data_parallel * p.context
    # Measured ratios (this machine): the best alternative's step-time ratio, neighbor_ckpt's, at the largest model
    # of the run (the one least dominated by per-save fixed costs).
    best_ratio = nb_ratio = nb_thread_s = None
    best_name, where = "-", ""
    if measured is not None:
        sections = [measured["main"], *measured.get("scaling", [])]
        sec = max(sections, key=lambda x: x.get("params", 0))
        s = summarize({"main": sec})
        where = f"hidden {sec.get('hidden')}, {sec.get('params', 0):,} params"
        b = s["verdict"].get("best")
        if b:
            best_ratio, best_name = s["rows"][b]["ratio"], s["rows"][b]["label"]
        if "neighbor" in s["rows"]:
            nb_ratio = s["rows"]["neighbor"]["ratio"]
            ex = s["rows"]["neighbor"]["extra"]
            nb_thread_s = ex.get("snapshot_call_s", 0.0) + ex.get("wait_s", 0.0)
    out.append(f"Goodput on {gpus} H100s ({nodes} nodes x {gpus_per_node}), per-GPU MTBF {gpu_mtbf_hours:,.0f} h -> "
               f"node MTBF {gpu_mtbf_hours / gpus_per_node:,.0f} h, job MTBF {gpu_mtbf_hours / gpus:.1f} h; iteration "
               f"time {t_it:.1f} s = the planner's compute time of configs/llama3_70b.yaml at "
               f"trainer.num_nodes={nodes} (tp {p.tensor} x pp {p.pipeline} x cp {p.context} x dp "
               f"{job.data_parallel}).")
    rows = []

    def add(label: str, interval: float, overhead: float, mttr: float) -> None:
        lb = loss_breakdown(interval_s=interval, overhead_s=overhead, mttr_s=mttr, node_mtbf_s=node_mtbf_s,
                            nodes=nodes)
        tot = goodput_loss(interval_s=interval, overhead_s=overhead, mttr_s=mttr, node_mtbf_s=node_mtbf_s,
                           nodes=nodes)
        rows.append([label, f"{interval:,.1f}", f"{overhead:.3g}", f"{mttr:.0f}", f"{100 * lb.checkpoint:.3f}%",
                     f"{100 * lb.rollback:.3f}%", f"{100 * lb.restart:.3f}%", f"{100 * tot:.2f}%",
                     f"{100 * (1 - tot):.2f}%"])

    for frac in (0.001, 0.01):
        add(f"neighbor_ckpt every iteration, overhead {100 * frac:g}% of a step (assumed)", t_it, frac * t_it, 60)
    if nb_thread_s is not None:
        add(f"neighbor_ckpt every iteration, training-thread cost only ({1e3 * nb_thread_s:.1f} ms: snapshot() + "
            f"wait point, measured here)", t_it, nb_thread_s, 60)
    if nb_ratio is not None:
        add(f"neighbor_ckpt every iteration, overhead {100 * (nb_ratio - 1):.1f}% (measured here, {where})", t_it,
            max(0.0, nb_ratio - 1) * t_it, 60)
    if best_ratio is not None:
        k0 = max(0.0, best_ratio - 1) * t_it
        add(f"disk every 30 min, blocking {100 * (best_ratio - 1):.0f}% of a step ({best_name}, measured here)", 1800,
            k0, 900)
        t_star = optimal_interval(overhead_s=k0, node_mtbf_s=node_mtbf_s, nodes=nodes)
        if t_star > 0:
            add(f"disk at Young's optimum t*={t_star / 60:.1f} min, same blocking", t_star, k0, 900)
    for k0 in (10.0, 60.0):
        add(f"disk every 30 min, blocking {k0:.0f} s per save", 1800, k0, 900)
        t_star = optimal_interval(overhead_s=k0, node_mtbf_s=node_mtbf_s, nodes=nodes)
        add(f"disk at Young's optimum t*={t_star / 60:.1f} min, blocking {k0:.0f} s", t_star, k0, 900)
    out.append(_table(["scenario", "interval s", "overhead s/ckpt", "MTTR s", "ckpt loss", "rollback loss",
                       "restart loss", "total loss", "goodput"], rows))
    # Break-even: the per-iteration overhead fraction at which neighbor_ckpt loses as much as the disk checkpoint.
    nb_fixed = loss_breakdown(interval_s=t_it, overhead_s=0.0, mttr_s=60, node_mtbf_s=node_mtbf_s, nodes=nodes)
    for k0 in ([max(0.0, best_ratio - 1) * t_it] if best_ratio is not None else []) + [10.0, 60.0]:
        t_star = optimal_interval(overhead_s=k0, node_mtbf_s=node_mtbf_s, nodes=nodes)
        disk = goodput_loss(interval_s=max(t_star, t_it), overhead_s=k0, mttr_s=900, node_mtbf_s=node_mtbf_s,
                            nodes=nodes)
        out.append(f"* against a disk checkpoint blocking {k0:.3g} s at its optimal interval (loss {100 * disk:.2f}%), "
                   f"per-iteration neighbor checkpointing wins while its overhead stays below "
                   f"{100 * (disk - nb_fixed.rollback - nb_fixed.restart):.2f}% of a step")
    out.append("")
    out.append(f"In-memory state lost (falls back to the disk checkpoint) when k of the {nodes} nodes fail at once; "
               f"DP rings of {members} members (dp x cp) over {ring} nodes each "
               f"(ring_nodes_for(tp={p.tensor}, cp={p.context}, dp={job.data_parallel}, "
               f"gpus_per_node={gpus_per_node})):")
    prow = [[str(k), f"{p_unrecoverable(nodes, members, k, ring_nodes=ring):.3g}"] for k in (1, 2, 3, 4)]
    out.append(_table(["k simultaneous node failures", "p_unrecoverable"], prow))
    for hours in (3.0, 12.0):
        pr = p_recovery(nodes, members, hours=hours, gpu_mtbf_hours=gpu_mtbf_hours, ring_nodes=ring,
                        gpus_per_node=gpus_per_node)
        out.append(f"p_recovery({hours:g} h) = {pr:.6f}: probability that the node failures of a {hours:g} h window, "
                   f"taken as simultaneous (FFTrainer eq. 5, the windows of its Table 6), are all recoverable from "
                   f"host memory")
    return "\n".join(out)


# ==========================================================================================================
# entry point
# ==========================================================================================================


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gpu_info() -> dict[str, Any]:
    """Which card(s), driver, CUDA and NCCL a --device cuda run used (best effort: a missing field is left out)."""
    import subprocess

    import torch

    out: dict[str, Any] = {"torch_cuda": torch.version.cuda, "gpu_count": torch.cuda.device_count()}
    try:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu_name=props.name, gpu_memory_bytes=int(props.total_memory),
                   gpu_capability=f"{props.major}.{props.minor}")
    except Exception as e:  # noqa: BLE001
        out["gpu_error"] = _one_line(e)
    try:
        out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001
        pass
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=False)
        lines = [line.strip() for line in q.stdout.splitlines() if line.strip()]
        out["nvidia_smi"] = lines
        fields = [f.strip() for f in lines[0].split(",")] if lines else []
        if len(fields) == 4:
            out.update(gpu_driver=fields[1], gpu_pcie=f"PCIe Gen{fields[2]} x{fields[3]}")
    except Exception:  # noqa: BLE001
        pass
    return out


def _machine(store_root: Path, device: str = "cpu") -> dict[str, Any]:
    import torch

    from neighbor_ckpt.cli.bench.micro import machine_info

    info = machine_info(store_root)
    info["python"] = platform.python_version()
    info["torch"] = torch.__version__
    if device == "cuda":
        info["device"] = "cuda"
        info.update(_gpu_info())
    return info


def resolve_args(args: argparse.Namespace, gpu_count: int = 0) -> None:
    """Fill the defaults that depend on ``--device`` (shape, protocol, world) into ``args`` in place; raise
    ``ValueError`` with the reason when the combination is invalid. ``gpu_count``: GPUs visible (cuda mode)."""
    cuda = args.device == "cuda"
    shape, proto = (GPU_SHAPE, CUDA_PROTOCOL) if cuda else (CPU_SHAPE, CPU_PROTOCOL)
    for key in SHAPE_KEYS:
        if getattr(args, key) is None:
            setattr(args, key, shape[key])
    if args.steps is None:
        args.steps = proto["quick_steps"] if args.quick else proto["steps"]
    if args.warmup is None:
        args.warmup = proto["warmup"]
    if args.block is None:
        args.block = proto["block"]
    if args.scale_steps is None:
        args.scale_steps = args.steps
    if args.scales is None:
        args.scales = proto["quick_scales"] if args.quick else proto["scales"]
    if args.world is None:
        args.world = gpu_count if cuda else 4
    if cuda:
        if gpu_count < 1:
            raise ValueError("--device cuda: no CUDA device is visible")
        if not 1 <= args.world <= gpu_count:
            raise ValueError(f"--device cuda: --world must be 1..{gpu_count} (one rank per visible GPU)")
        if args.steps < 1 or args.block < 1 or args.warmup < 1:
            raise ValueError("--steps >= 1, --block >= 1, --warmup >= 1")
    elif args.world < 2 or args.steps < 1 or args.block < 1 or args.warmup < 1:
        raise ValueError("--world >= 2, --steps >= 1, --block >= 1, --warmup >= 1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="neighbor-ckpt bench --compare", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: gloo ranks on CPU tensors (default); cuda: one NCCL rank per GPU, bf16 model of "
                         "GPU_SHAPE, the CUDA_PROTOCOL defaults below")
    ap.add_argument("--quick", action="store_true", help="8 timed steps per variant, no 16x model")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks (default 4; cuda: every visible GPU, 1 allowed; DP = world)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per variant (default 20, --quick 8; cuda 8, --quick 4)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps in each variant's first block (default 3; cuda 2)")
    ap.add_argument("--block", type=int, default=None, help="timed steps per block (default 5; cuda 4)")
    ap.add_argument("--scale-steps", type=int, default=None, help="timed steps per variant in the scaling runs "
                                                                  "(default: --steps)")
    ap.add_argument("--scales", default=None, help="hidden-size multipliers of the scaling runs, comma-separated "
                                                   "(default '2,4' = about 4x and 16x the parameters; --quick '2'; "
                                                   "cuda: none)")
    ap.add_argument("--no-scale-best", dest="scale_with_best", action="store_false",
                    help="scaling runs: base and neighbor only")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--hidden", type=int, default=None, help=f"default {HIDDEN}; cuda {GPU_SHAPE['hidden']}")
    ap.add_argument("--layers", type=int, default=None, help=f"default {LAYERS}; cuda {GPU_SHAPE['layers']}")
    ap.add_argument("--heads", type=int, default=None, help=f"default {HEADS}; cuda {GPU_SHAPE['heads']}")
    ap.add_argument("--seq", type=int, default=None, help=f"default {SEQ}; cuda {GPU_SHAPE['seq']}")
    ap.add_argument("--vocab", type=int, default=None, help=f"default {VOCAB}; cuda {GPU_SHAPE['vocab']}")
    ap.add_argument("--micro-batches", type=int, default=None,
                    help=f"per rank per step (default 2; cuda {GPU_SHAPE['micro_batches']})")
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help=f"sequences per micro-batch (default 2; cuda {GPU_SHAPE['micro_batch_size']})")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    ap.add_argument("--store-dir", default="/dev/shm", help="where every checkpoint goes (default /dev/shm)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before the whole run is abandoned")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the raw results to PATH")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="first wait up to S seconds for other processes to use < 10%% of the CPUs")
    ap.add_argument("--verbose", action="store_true", help="progress lines, library logs and tracebacks")
    ap.add_argument("--profile-snapshot", action="store_true",
                    help="cProfile the training thread's snapshot() call (one rank, DP=1, CPU only) and exit")
    ap.add_argument("--projection", action="store_true", help="print the GPU projection (planner + goodput) only")
    ap.add_argument("--from-json", metavar="PATH", default=None,
                    help="with --projection: take the measured ratios from an earlier --json; without: re-render it")
    args = ap.parse_args(argv)

    if args.projection:
        measured = json.loads(Path(args.from_json).read_text()) if args.from_json else None
        print(projection(measured))
        return 0
    gpu_count = 0
    if args.device == "cuda":
        import torch

        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if args.profile_snapshot:
            ap.error("--profile-snapshot runs on CPU only")
    try:
        resolve_args(args, gpu_count)
    except ValueError as e:
        ap.error(str(e))
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or "base" not in variants:
        ap.error(f"--variants: unknown {bad}" if bad else "--variants must include base")
    scales = [int(x) for x in args.scales.split(",") if x.strip()]

    base_dir = Path(args.store_dir)
    base_dir.mkdir(parents=True, exist_ok=True)
    if args.profile_snapshot:
        import torch.multiprocessing as mp

        root = Path(tempfile.mkdtemp(prefix="neighbor_ckpt_compare-", dir=base_dir))
        try:
            cfg = {"root": str(root), "init_file": str(root / "pg_init"), "port": _free_port(), "threads": args.threads,
                   "hidden": args.hidden, "layers": args.layers, "heads": args.heads, "seq": args.seq,
                   "vocab": args.vocab, "micro_batches": args.micro_batches,
                   "micro_batch_size": args.micro_batch_size, "steps": max(args.steps, 20)}
            mp.start_processes(_profile_worker, args=(cfg,), nprocs=1, join=True, start_method="spawn")
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    info = _machine(base_dir, args.device)
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        # The run's own shape and protocol (and device), not this command line's defaults.
        for key in (*SHAPE_KEYS, "device", "steps", "block", "warmup", "threads"):
            if key in res.get("args", {}):
                setattr(args, key, res["args"][key])
        print(render(res, res.get("machine", info), args))
        return 0

    from neighbor_ckpt.cli.bench.micro import cpu_sample, foreign_load, wait_until_quiet

    if args.wait_quiet > 0:
        wait_until_quiet(args.wait_quiet, info["nproc"] or 1, poll_s=2.0)
    root = Path(tempfile.mkdtemp(prefix="neighbor_ckpt_compare-", dir=base_dir))
    t0 = time.perf_counter()
    cpu0 = cpu_sample()
    rc = 0
    try:
        cfg = {
            "root": str(root), "init_file": str(root / "pg_init"), "out": str(root / "result.json"),
            "port": _free_port(), "timeout_s": args.timeout, "pg_timeout_s": 300, "verbose": args.verbose,
            "threads": args.threads, "variants": variants, "steps": args.steps, "warmup": args.warmup,
            "block": args.block, "scale_steps": args.scale_steps, "scale_hidden": scales,
            "scale_with_best": args.scale_with_best, "hidden": args.hidden, "layers": args.layers,
            "heads": args.heads, "seq": args.seq, "vocab": args.vocab, "micro_batches": args.micro_batches,
            "micro_batch_size": args.micro_batch_size, "device": args.device,
        }
        import torch.multiprocessing as mp

        ctx = mp.start_processes(_worker, args=(args.world, cfg), nprocs=args.world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + args.timeout + 30
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"benchmark did not finish within {args.timeout:.0f} s")
        res = json.loads(Path(cfg["out"]).read_text())
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"neighbor-ckpt bench --compare: failed: {_one_line(e)}", file=sys.stderr)
        rc = 2
        res = None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if res is None:
        return rc
    fl = foreign_load(cpu0, cpu_sample(), info["nproc"] or 1)
    info.update(other_cpu_frac=fl["other_cpu_frac"], steal_frac=fl["steal_frac"])
    res["wall_s"] = time.perf_counter() - t0
    res["machine"] = info
    res["args"] = vars(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    print(render(res, info, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
