"""A hand-written megatron-core training loop (Megatron-LM / Megatron-Bridge style) with neighbor_ckpt.

An mcore ``GPTModel`` wrapped in mcore ``DistributedDataParallel``, built with ``get_megatron_optimizer``
(distributed optimizer by default), trained through ``get_forward_backward_func()`` with an
``OptimizerParamScheduler``; every iteration is snapshotted with the plain-loop API::

    torchrun --nproc-per-node 4 --max-restarts 2 recipes/mcore_gpt_plain_loop.py --steps 20 --out runs/mcore

What neighbor_ckpt adds to the loop is marked ``# neighbor_ckpt`` below: a handful of lines. On a machine without
CUDA the recipe calls ``megatron_patches.enable_cpu()`` first (gloo, CPU tensors; for smoke runs and tests).

Options: ``--tp``/``--pp`` (model parallelism; DP = world / (TP x PP)), ``--no-dist-opt`` (replicated
optimizer: the lazy-backup path), ``--steps``, ``--out DIR`` (per-rank losses, recovery report, plan and
final fingerprints as JSON), ``--insurance-every N`` (a megatron-core distributed checkpoint every N steps,
loaded only when no in-memory version is complete), ``--config FILE`` (a YAML file whose ``neighbor_ckpt:`` section configures the
checkpointer). Fault injection for demos and tests, first attempt only: ``--kill RANK[,RANK]:STEP`` signals those
ranks, ``--kill-phase`` says where in the step: ``forward``, ``backward`` (when the first gradient is computed),
``optimizer`` (inside the optimizer step, after the wait point; the default), ``copy`` (the snapshot of STEP half
copied into its slot) or ``stream`` (that snapshot half streamed to the ring successor); ``--kill-signal
SIGKILL|SIGSTOP|block`` whether it dies, hangs, or its training thread blocks in a C call while its heartbeat goes
on (``<out>/fault.json`` records when). ``--hold RANK[,RANK]:STEP`` (in process, first attempt only): those ranks'
training threads hold just before the optimizer step of STEP (its step tag, their next progress mark), in Python, in
short sleeps that the in-process abort interrupts, while the other ranks go on into that step and block in its first
collective: the other ranks are one progress mark ahead (``<out>/fault.hold.rank<R>.json`` records when; combine it
with a ``partition`` fault of the ``--config`` file in the optimizer phase of STEP). On the restart, ``--replace-store``
gives the victims empty host stores (replaced nodes), ``--damage bitflip|truncate|header`` damages their newest own
snapshot (``--damage-seed``: a random bit), and ``--kill-recovery RANK`` SIGKILLs that rank while it loads the
restored state (needs ``--max-restarts 2``); ``--misplace-data-on-restart`` makes a restarted attempt read other
samples (the data check must stop it). ``--nodes N`` lays the ranks out as N "nodes" of consecutive ranks
(``NEIGHBOR_CKPT_NODE_ID``), so the ring puts every replica on another node. See :mod:`neighbor_ckpt.runtime.failpoints` and :mod:`neighbor_ckpt.snapshot.damage`.
Several faults in one launch: the ``--config`` file's ``neighbor_ckpt.fault_injection`` section (the one the NeMo and
Bridge recipes read: the one-fault keys or a ``faults`` list; phases forward, backward, optimizer), instead of
``--kill``; in process, each fault fires in whichever generation first runs its step (``faults.jsonl``: a line each).

**In-process recovery** (``neighbor_ckpt.inprocess.enabled: true`` in the ``--config`` file, ``spares: N``): the loop
runs under :class:`neighbor_ckpt.inprocess.InprocessRecovery` (our engine); after a failure the surviving
processes call :func:`train` again (a new process group, parallel state, model and optimizer; the host slots stay), a
hot spare takes a lost rank's place. Launch ``active + spares`` processes with our launcher, one per node
(:mod:`neighbor_ckpt.inprocess.launcher`, which also tells the processes where the store host is; or pass
``--inprocess-store HOST:PORT``); ``--kill`` then injects its fault in the first in-process attempt only.

:func:`build_gpt` is the model, DDP, optimizer and scheduler of this recipe (the test workers and the benchmark
comparison, ``tools/bench/compare``, build theirs with it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SEQ, VOCAB, HIDDEN, HEADS, LAYERS = 32, 128, 64, 4, 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1, help="attention and hidden dropout")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="samples per step, kept whatever the data-parallel size (default: the --config file's "
                         "trainer.global_batch_size; else, with neighbor_ckpt.elastic off, micro-batch size x "
                         "micro-batches x the data-parallel size, which cannot change then); required with "
                         "neighbor_ckpt.elastic")
    ap.add_argument("--no-dist-opt", dest="dist_opt", action="store_false",
                    help="replicated optimizer state (megatron's Float16/FP32 optimizer) instead of the distributed one")
    ap.add_argument("--overlap", action="store_true", help="overlap grad reduce-scatter and param all-gather")
    ap.add_argument("--job-id", default=None, help="host-store namespace (default: the launcher's run id)")
    ap.add_argument("--out", type=Path, default=None, help="write per-rank losses, report, plan and final state here")
    ap.add_argument("--kill", default=None, metavar="RANK[,RANK]:STEP",
                    help="signal these ranks at STEP (first attempt only)")
    ap.add_argument("--kill-phase", choices=("forward", "backward", "optimizer", "copy", "stream"), default="optimizer")
    ap.add_argument("--kill-signal", choices=("SIGKILL", "SIGSTOP", "block"), default="SIGKILL",
                    help="SIGKILL: the rank dies; SIGSTOP: it hangs, heartbeat included; block: its training thread "
                         "blocks in a C call while its other threads (the heartbeat) go on")
    ap.add_argument("--hold", default=None, metavar="RANK[,RANK]:STEP",
                    help="in process, first attempt: these ranks' training threads hold (interruptible sleeps) just "
                         "before the optimizer step of STEP, until the generation is aborted: the other ranks get one "
                         "more progress mark")
    ap.add_argument("--kill-permanent", action="store_true",
                    help="the victim's node is gone: its launcher agent (the parent process) is killed with it")
    ap.add_argument("--replace-store", action="store_true", help="the killed rank restarts with an empty host store")
    ap.add_argument("--damage", choices=("bitflip", "truncate", "header"), default=None,
                    help="on the restart, damage the killed rank's newest own snapshot")
    ap.add_argument("--damage-seed", type=int, default=None, help="bitflip: a random bit drawn from this seed")
    ap.add_argument("--misplace-data-on-restart", action="store_true",
                    help="fault injection: a restarted attempt reads its samples one micro-batch further on than it "
                         "should (a loader that does not resume its position): the data check stops it")
    ap.add_argument("--kill-recovery", type=int, default=None, metavar="RANK",
                    help="on the first restart, SIGKILL this rank while it loads the restored state")
    ap.add_argument("--nodes", type=int, default=None, help="lay the ranks out as N nodes (fault tests on one machine)")
    ap.add_argument("--insurance-every", type=int, default=0,
                    help="megatron-core distributed checkpoint every N steps: the insurance (0: none)")
    ap.add_argument("--insurance-dir", type=Path, default=None, help="where insurance checkpoints go (default: --out)")
    ap.add_argument("--config", type=Path, default=None, help="YAML file with a neighbor_ckpt: section")
    ap.add_argument("--inprocess-store", default=os.environ.get("NEIGHBOR_CKPT_INPROCESS_STORE"),
                    metavar="HOST:PORT[,HOST:PORT...]",
                    help="in-process recovery: the stores, primary first (default: NEIGHBOR_CKPT_INPROCESS_STORE)")
    ap.add_argument("--kill-idle-spare-after", type=int, default=None, metavar="STEP",
                    help="in process: a hot spare still idle once rank 0 logged STEP SIGKILLs itself (first launch)")
    return ap.parse_args(argv)


class GPT:
    """What :func:`build_gpt` returns: the mcore DDP model, its optimizer and scheduler, and the batch layout."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def build_gpt(*, tp: int = 1, pp: int = 1, dist_opt: bool = True, overlap: bool = False, steps: int,
              micro_batch_size: int = 2, micro_batches: int = 2, global_batch: int | None = None,
              dropout: float = 0.1, hidden: int = HIDDEN, layers: int = LAYERS, heads: int = HEADS, seq: int = SEQ,
              vocab: int = VOCAB, bf16: bool = False, cpu_init: bool = True, init_parallel: bool = True) -> GPT:
    """The recipe's tiny GPT on the initialized process group: megatron-core parallel state, seeds, ``GPTModel`` in
    mcore ``DistributedDataParallel``, ``get_megatron_optimizer`` and the ``OptimizerParamScheduler``.

    ``global_batch`` (samples per step) fixes the global batch whatever the data-parallel size: each rank trains
    ``global_batch / (micro_batch_size x DP)`` micro-batches (megatron-core's num-microbatches rule; what keeps an
    elastic shrink on the same trajectory). None: ``micro_batches`` per rank, the global batch follows DP.

    What the recipe's own loop leaves at their defaults, for the benchmarks that train this model (``tools/bench``):
    the shape (``hidden``, ``layers``, ``heads``, ``seq``, ``vocab``; the loop's batches use the module's ``SEQ`` and
    ``VOCAB``); ``bf16``: Megatron-LM's ``--bf16`` (bf16 params and activations, fp32 main params and Adam moments in
    the distributed optimizer, gradients reduced in fp32, the model wrapped in mcore's ``Float16Module`` as
    Megatron-LM's ``get_model`` does); ``cpu_init``: False initializes the weights on the GPU (Megatron-LM's
    default; the initial values then differ from a CPU init); ``init_parallel``: False when the caller has initialized megatron-core's
    parallel state already (with these ``tp`` and ``pp``), e.g. to build a second model in the same process."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    if init_parallel:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)

    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, attention_dropout=dropout,
        hidden_dropout=dropout,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
        use_cpu_initialization=cpu_init, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        **({"bf16": True, "params_dtype": dtype} if bf16 else {}))
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=seq, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage()).cuda()
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)  # casts the LayerNorms the local spec builds in fp32, fp32 outputs
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, bucket_size=4096,
                                               overlap_grad_reduce=overlap,
                                               overlap_param_gather=overlap and dist_opt,
                                               **({"grad_reduce_in_fp32": True} if bf16 else {}))
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01,
                                                       clip_grad=1.0, use_distributed_optimizer=dist_opt,
                                                       **({"bf16": True, "params_dtype": dtype} if bf16 else {})),
                                       [ddp_model])
    config.no_sync_func = ddp_model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    mbs, n_mb = micro_batch_size, micro_batches
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    if global_batch is None:
        global_batch = mbs * n_mb * dp_size
    else:
        from neighbor_ckpt.recovery.reshard import micro_batches_per_rank

        n_mb = micro_batches_per_rank(global_batch, mbs, dp_size)  # ConfigError when DP does not divide it
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4,
                                        lr_warmup_steps=3 * global_batch, lr_decay_steps=steps * global_batch,
                                        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=1,
                                        wd_incr_style="constant")
    return GPT(config=config, model=ddp_model, optimizer=optimizer, scheduler=scheduler, dp_rank=dp_rank,
               dp_size=dp_size, global_batch=global_batch, mbs=mbs, n_mb=n_mb,
               dp_group=parallel_state.get_data_parallel_group(), hidden=hidden, layers=layers, heads=heads,
               seq=seq, vocab=vocab)


SAMPLE_SEED = 1_000_003


def sample_batches(gpt: GPT, consumed: int) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches of the step that starts at ``consumed`` samples: a miniature of Megatron's pretraining
    sampler. The step's global batch is samples ``consumed .. consumed + global_batch``; micro-batch ``m`` of DP rank
    ``r`` holds samples ``consumed + (m x DP + r) x mbs + [0, mbs)``, and each sample's tokens are drawn from its own
    index. So the global batch is the same samples for any data-parallel size (an elastic shrink redistributes them)."""
    mbs, dp = gpt.mbs, gpt.dp_size
    for m in range(gpt.n_mb):
        first = consumed + (m * dp + gpt.dp_rank) * mbs
        tokens = torch.stack([torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(
            SAMPLE_SEED + i)) for i in range(first, first + mbs)])
        yield {"tokens": tokens[:, :-1].cuda(), "labels": tokens[:, 1:].cuda(),
               "position_ids": torch.arange(SEQ).unsqueeze(0).expand(mbs, SEQ).cuda()}


def step_samples(gpt: GPT, consumed: int) -> list[int]:
    """The sample indices this rank trains in the step that starts at ``consumed`` (what :func:`sample_batches`
    draws; recorded with each step's loss so a test can check the global batch on the samples themselves)."""
    return [consumed + (m * gpt.dp_size + gpt.dp_rank) * gpt.mbs + i for m in range(gpt.n_mb) for i in range(gpt.mbs)]


def global_loss(gpt: GPT, losses: list[dict[str, torch.Tensor]]) -> float | None:
    """The step's loss over the global batch: this rank's mean over its micro-batches, averaged over the DP group
    (every rank trains as many samples). None on a pipeline stage without the loss."""
    if not losses:
        return None
    mean = torch.stack([d["lm loss"] for d in losses]).mean().reshape(1).float()
    dist.all_reduce(mean, group=gpt.dp_group)
    return float(mean.item() / gpt.dp_size)


def fingerprints(gpt: GPT) -> dict[str, Any]:
    """The final state as ``final.rank<r>.json`` holds it (the end-to-end tests compare these with ``==``)."""
    inner = [part.optimizer for part in getattr(gpt.optimizer, "chained_optimizers", [gpt.optimizer])]
    return {
        "params": _sha(dict(gpt.model.module.named_parameters())),
        "optim": _sha({f"{i}.{j}.{k}": v for i, o in enumerate(inner) for j, st in enumerate(o.state.values())
                       for k, v in st.items() if isinstance(v, torch.Tensor)}),
        "scheduler": gpt.scheduler.state_dict()["num_steps"],
        "param_groups": [[float(g["lr"]).hex(), g.get("step")] for o in inner for g in o.param_groups],
    }


def _sha(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:24]
            for k, t in sorted(tensors.items())}


class Recorder:
    """Per-rank JSON output for demos and tests (nothing is written without ``--out``)."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)

    def loss(self, step: int, loss: float | None, *, consumed: int | None = None,
             samples: list[int] | None = None, generation: int = 0) -> None:
        if self.out is not None:
            with open(self.out / f"losses.rank{RANK}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": None if loss is None else loss.hex(),
                                    "attempt": ATTEMPT, "generation": generation, "consumed_samples": consumed,
                                    **({} if samples is None else {"samples": samples})}) + "\n")

    def json(self, name: str, obj: Any) -> None:
        if self.out is not None:
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
            os.replace(tmp, self.out / name)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[rank{RANK}] %(name)s %(levelname)s %(message)s")
    if not torch.cuda.is_available():
        from megatron_patches import enable_cpu

        enable_cpu(nemo=False)  # a plain mcore loop: no NeMo to patch (and no 5 s import of it per process)

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    # build_gpt's imports, now: a hot spare must have them done before it takes a lost rank's place
    import megatron.core.distributed, megatron.core.models.gpt.gpt_layer_specs  # noqa: E401,F401
    import megatron.core.optimizer, megatron.core.optimizer_param_scheduler  # noqa: E401,F401
    import megatron.core.transformer  # noqa: F401

    from megatron_patches import install_hooks, mcore_groups
    from neighbor_ckpt import NeighborCheckpointer, NeighborCkptConfig, prepare_torchrun_restart
    from neighbor_ckpt.adapters.megatron import MegatronOptimizerAdapter
    from neighbor_ckpt.inprocess.identity import node_index
    from neighbor_ckpt.recovery.replacement_slot import prepare_replacement_slot

    rec = Recorder(args.out)
    victims, kill_step = _parse_kill(args.kill)
    holders, hold_step = _parse_kill(args.hold)
    nc_config = NeighborCkptConfig.from_yaml(args.config) if args.config else NeighborCkptConfig()
    planned = planned_faults(nc_config, args)  # the --config file's fault_injection section (several faults)
    global_batch = job_global_batch(args, nc_config)
    if args.job_id:
        nc_config.job_id = args.job_id
    inproc = None
    if nc_config.inprocess.enabled:  # neighbor_ckpt: in-process recovery (see the module docstring)
        from neighbor_ckpt.inprocess import InprocessRecovery

        inproc = InprocessRecovery.from_config(nc_config, store=args.inprocess_store,
                                               model_parallel=args.tp * args.pp,
                                               batch_micro_batches=global_batch // args.micro_batch_size)

    def train(att: Any = None) -> None:
        """One attempt: everything that holds a process group is built here (again, after an in-process restart)."""
        global RANK
        first_attempt = ATTEMPT == 0 and (att is None or att.iteration == 0)
        if args.nodes:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            os.environ["NEIGHBOR_CKPT_NODE_ID"] = f"node{RANK * args.nodes // world}"
        if inproc is not None:
            RANK = att.rank  # the engine's: a hot spare takes the lost rank's number
            inproc.init_process_group()  # neighbor_ckpt: a new group per in-process attempt
        else:
            prepare_torchrun_restart()  # neighbor_ckpt: a fresh rendezvous store per torchrun attempt
            prepare_replacement_slot(nc_config)  # neighbor_ckpt: a replaced node's receive slot, before the model
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        gpt = build_gpt(tp=args.tp, pp=args.pp, dist_opt=args.dist_opt, overlap=args.overlap, steps=args.steps,
                        micro_batch_size=args.micro_batch_size, global_batch=global_batch, dropout=args.dropout)
        ddp_model, optimizer, scheduler = gpt.model, gpt.optimizer, gpt.scheduler
        mbs, n_mb = gpt.mbs, gpt.n_mb

        # neighbor_ckpt: the state adapter, mcore's DP group, step tags + training-traffic signal, recovery.
        groups = mcore_groups()
        if RANK in victims and ATTEMPT == 1:
            _damage_own_store(nc_config, args)
        if planned and ATTEMPT == 1 and inproc is None and RANK in nc_config.fault_injection.replaced_ranks():
            _empty_own_store(nc_config)
        generation = att.iteration if att is not None else 0
        resumed_at: list[int] = []  # the step this attempt resumed at (after recover())

        def due(phase: str, at: int) -> list[Any]:
            """The --config file's faults that fire now (each once: FaultSpec.fires)."""
            hosts = (inproc is not None and os.environ.get("NEIGHBOR_CKPT_INPROCESS_STORE_HOSTED")
                     == str(inproc.stores.epoch))
            fire = [f for f in planned if resumed_at and f.fires(rank=RANK, step=at, phase=phase, launch=ATTEMPT,
                                                                 generation=generation, start_step=resumed_at[0],
                                                                 hosts_store=hosts, node=node_index())]
            if fire and generation > 0 and nc_config.inprocess.grow_back:
                _wait_for_a_spare(inproc)
            return fire
        insurance = None
        if args.insurance_every:
            from megatron_patches.distopt_load import fix_fp32_distopt_load

            fix_fp32_distopt_load()  # mcore 0.15 cannot load a DistributedOptimizer checkpoint into fp32 params else
            insurance = Insurance(args.insurance_dir or args.out / "insurance", args.insurance_every, ddp_model,
                                  optimizer)
        ckpt = NeighborCheckpointer(nc_config, insurance=insurance.load if insurance else None,
                                    adapter=MegatronOptimizerAdapter([ddp_model], optimizer),
                                    dp_group=groups.dp_group, model_parallel_coord=groups.coord,
                                    attempt=inproc.attempt_info() if inproc is not None else None,
                                    global_batch=global_batch, micro_batch_size=mbs)
        if inproc is not None:  # a failed attempt: closed after the abort, host slots kept
            inproc.on_restart(lambda: ckpt.close(success=False))
        if RANK in victims and first_attempt and args.kill_phase == "optimizer":
            _kill_inside_optimizer_step(optimizer, ckpt, kill_step, lambda: fault(rec, args, "optimizer"))  # before
            # install_hooks: runs inside its step tag
        if planned:
            _inside_optimizer_step(optimizer, ckpt, lambda at: [planned_fault(rec, f, "optimizer")
                                                                for f in due("optimizer", at)])
        if RANK == args.kill_recovery and ATTEMPT == 1:
            from neighbor_ckpt.runtime import failpoints

            failpoints.arm("recovery.load", lambda: fault(rec, args, "recovery", signal_name="SIGKILL"))
        hooks = install_hooks(ckpt, optimizer)
        if inproc is not None:
            inproc.on_restart(hooks.remove)
        result = ckpt.recover()
        consumed = 0
        if result.restored:
            state = (result.user_state if result.report.outcome == "restored"
                     else insurance.state)  # type: ignore[union-attr]
            scheduler.load_state_dict(state["scheduler"])
            consumed = state["consumed_samples"]
        rec.json(f"report.rank{RANK}.attempt{ckpt.attempt.label}.json", result.report.to_dict())
        resumed_at.append(result.next_step)

        def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):  # noqa: ANN202
            batch = next(data_iterator)
            armed = RANK in victims and step == kill_step and first_attempt
            if armed and args.kill_phase == "forward":
                fault(rec, args, "forward")
            for f in due("forward", step):
                planned_fault(rec, f, "forward")
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            if armed and args.kill_phase == "backward" and output.requires_grad:
                output.register_hook(lambda grad: fault(rec, args, "backward"))
            for f in due("backward", step) if output.requires_grad else ():
                output.register_hook(lambda grad, f=f: planned_fault(rec, f, "backward"))

            def loss_func(output_tensor: torch.Tensor):  # noqa: ANN202
                loss = output_tensor.float().mean()
                return loss, {"lm loss": loss.detach().clone()}  # mcore divides the loss in place

            return output, loss_func

        forward_backward = get_forward_backward_func()
        misplaced = mbs if args.misplace_data_on_restart and ATTEMPT >= 1 else 0  # fault injection: other samples
        try:
            for step in range(result.next_step, args.steps):
                ddp_model.zero_grad_buffer()
                optimizer.zero_grad()
                losses = forward_backward(forward_step_func=forward_step,
                                          data_iterator=sample_batches(gpt, consumed + misplaced),
                                          model=[ddp_model], num_microbatches=n_mb, seq_length=SEQ,
                                          micro_batch_size=mbs, decoder_seq_length=SEQ, forward_only=False)
                rec.loss(step, global_loss(gpt, losses), consumed=consumed,
                         samples=step_samples(gpt, consumed + misplaced), generation=generation)
                if RANK in holders and step == hold_step and first_attempt:
                    hold(rec, step)  # fault injection: before this step's tag, until the in-process abort
                ok, _, _ = optimizer.step()
                if not ok:
                    raise RuntimeError(f"optimizer step {step} was skipped (non-finite gradients)")
                scheduler.step(increment=global_batch)
                consumed += global_batch
                if RANK in victims and step == kill_step and first_attempt and args.kill_phase in ("copy", "stream"):
                    from neighbor_ckpt.runtime import failpoints

                    failpoints.arm(f"snapshot.{args.kill_phase}", lambda: fault(rec, args, args.kill_phase))
                ckpt.snapshot(step, user_state={"scheduler": scheduler.state_dict(),  # neighbor_ckpt
                                                "consumed_samples": consumed})
                if inproc is not None and step == result.next_step:
                    inproc.mark_progress()  # neighbor_ckpt: this in-process attempt completed a step
                if insurance is not None:
                    insurance.maybe_save(step, {"scheduler": scheduler.state_dict(), "consumed_samples": consumed})
        except BaseException as e:  # an in-process abort arrives as a BaseException (GenerationAborted)
            ckpt.on_failure(f"{type(e).__name__}: {e}")
            raise
        hooks.remove()
        plan, engine = ckpt.plan, ckpt.engine
        ckpt.close(success=True)  # drains the engine: its stats are final
        rec.json(f"final.rank{RANK}.json", fingerprints(gpt))
        rec.json(f"plan.rank{RANK}.json", {
            "coord": list(groups.coord), "dp_size": groups.dp_size,
            "local_params": sum(p.numel() for p in ddp_model.module.parameters()),
            "plan": None if plan is None else {
                "unique_bytes": plan.unique_bytes, "lazy_bytes": plan.lazy_bytes,
                "extras_bytes": engine.stats.extras_bytes if engine is not None else None,
                "unique": [[p.meta.name, p.meta.kind.value, p.meta.nbytes] for p in plan.unique],
                "unique_tensor_bytes": sum(p.meta.nbytes for p in plan.unique),
                "regenerable": [m.name for m in plan.regenerable]},
        })
        if inproc is not None:
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

    if inproc is None:
        train()
    else:
        if args.kill_idle_spare_after is not None and ATTEMPT == 0 and inproc.process >= inproc.active_world_size:
            _kill_when_still_idle(inproc, rec, args.kill_idle_spare_after)
        inproc.run(train)  # returns on success (also on a spare never used); exit 75 when it gives up


class Insurance:
    """The persistent insurance checkpoint: megatron-core ``dist_checkpointing`` every N steps (Megatron-LM's
    ``--save``), loaded by neighbor_ckpt only when no complete in-memory version exists."""

    def __init__(self, root: Path, every: int, model: Any, optimizer: Any) -> None:
        self.root, self.every, self.model, self.optimizer = Path(root), every, model, optimizer
        self.state: dict[str, Any] | None = None

    def _sharded(self, is_loading: bool) -> dict[str, Any]:
        model_sd = self.model.module.sharded_state_dict()
        return {"model": model_sd, "optimizer": self.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}

    def maybe_save(self, step: int, user: dict[str, Any]) -> None:
        from megatron.core import dist_checkpointing

        if (step + 1) % self.every:
            return
        path = self.root / f"iter_{step:07d}"
        if RANK == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save({**self._sharded(False), "user": json.dumps(user), "iteration": step}, str(path))
        dist.barrier()
        if RANK == 0:
            (path / "complete").touch()

    def load(self) -> int | None:
        from megatron.core import dist_checkpointing

        done = sorted(d for d in self.root.glob("iter_*") if (d / "complete").exists())
        if not done:
            return None
        loaded = dist_checkpointing.load(self._sharded(True), str(done[-1]))
        self.model.module.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.state = json.loads(loaded["user"])
        return int(loaded["iteration"])


def job_global_batch(args: argparse.Namespace, nc_config: Any) -> int:
    """The job's global batch (samples per step), the same in every layout: ``--global-batch``, else the ``--config``
    file's ``trainer.global_batch_size`` (a job file). Without either, and only with ``neighbor_ckpt.elastic`` off
    (the data-parallel size cannot change then: a snapshot of another layout is refused), micro-batch size x
    micro-batches x the data-parallel size of the job's ranks (hot spares excluded). With elastic on, a size derived
    from this launch's world would change at a restart on fewer ranks, silently: refused.

    Raises:
        ConfigError: elastic is on and no global batch is given."""
    from neighbor_ckpt.errors import ConfigError

    if args.global_batch is not None:
        return int(args.global_batch)
    if args.config is not None:
        import yaml

        doc = yaml.safe_load(Path(args.config).read_text()) or {}
        trainer = doc.get("trainer") if isinstance(doc, dict) else None
        if isinstance(trainer, dict) and trainer.get("global_batch_size") is not None:
            return int(trainer["global_batch_size"])
    if nc_config.enabled and nc_config.elastic.enabled:
        raise ConfigError("neighbor_ckpt.elastic.enabled needs the job's global batch, kept in every layout: give "
                          "--global-batch N (or trainer.global_batch_size in the --config file); derived from this "
                          "launch's world size it would change at a restart on fewer ranks")
    active = int(os.environ.get("WORLD_SIZE", "1")) - (nc_config.inprocess.spares if nc_config.inprocess.enabled else 0)
    return args.micro_batch_size * args.micro_batches * max(1, active // (args.tp * args.pp))


def _parse_kill(spec: str | None) -> tuple[frozenset[int], int]:
    """``RANK[,RANK...]:STEP`` -> (ranks, step); no fault: (empty, -1)."""
    if not spec:
        return frozenset(), -1
    ranks, step = spec.split(":")
    return frozenset(int(r) for r in ranks.split(",")), int(step)


def fault(rec: Recorder, args: argparse.Namespace, phase: str, signal_name: str | None = None) -> None:
    """Fault injection: record when (``fault.json``; ``fault.recovery.json`` for a kill during recovery), then
    SIGKILL (dies) or SIGSTOP (hangs) this process, or block the calling thread in a C call (``block``: the GIL
    released, the process's other threads go on)."""
    victims, step = _parse_kill(args.kill)
    sig = signal_name or args.kill_signal
    name = "fault.recovery.json" if phase == "recovery" else \
        "fault.json" if not victims or RANK == min(victims) else f"fault.rank{RANK}.json"
    rec.json(name, {"rank": RANK, "step": step, "phase": phase, "signal": sig, "unix": time.time()})
    logging.getLogger(__name__).warning("fault injection: %s of rank %d in the %s phase", sig, RANK, phase)
    for h in logging.getLogger().handlers:
        h.flush()
    if args.kill_permanent and sig == "SIGKILL" and phase != "recovery":
        from neighbor_ckpt.runtime.failpoints import lose_node

        lose_node()
    if sig == "block":
        import ctypes

        ctypes.CDLL(None).sleep(3600)
        return
    os.kill(os.getpid(), getattr(signal, sig))


HOLD_TICK_S = 0.05
"""``--hold``: the length of each sleep of a holding training thread (the abort's exception lands between two)."""


def hold(rec: Recorder, step: int) -> None:
    """Fault injection (``--hold``): the training thread holds here for good, in Python (sleeps of
    :data:`HOLD_TICK_S`), so that the in-process abort's :class:`~neighbor_ckpt.inprocess.abort.GenerationAborted`,
    raised at the next bytecode, ends it; unlike ``--kill-signal block``, whose C call no abort frees. Records when
    (``fault.hold.rank<R>.json``, with the pid for the launch's orphan check). Its progress tag stands still meanwhile:
    the ranks that do not hold get the step's next progress mark (the optimizer step's tag) and block in its first
    collective."""
    rec.json(f"fault.hold.rank{RANK}.json", {"rank": RANK, "step": step, "phase": "hold", "unix": time.time(),
                                              "pid": os.getpid()})
    logging.getLogger(__name__).warning("fault injection: rank %d holds before the optimizer step of step %d, until "
                                        "the generation is aborted", RANK, step)
    for h in logging.getLogger().handlers:
        h.flush()
    while True:
        time.sleep(HOLD_TICK_S)


def planned_faults(config: Any, args: argparse.Namespace) -> tuple[Any, ...]:
    """The faults the ``--config`` file's ``neighbor_ckpt.fault_injection`` plans (the one-fault keys or a ``faults``
    list; none when it is off), the same section the NeMo and Bridge recipes read.

    Raises:
        ConfigError: a fault this recipe cannot inject (``target: store_node`` without in-process recovery, ``node``
            outside a launch of simulated nodes, a phase other than forward, backward or optimizer), or faults planned
            both there and with ``--kill``."""
    from neighbor_ckpt.errors import ConfigError
    from neighbor_ckpt.glue.faults import partition_possible
    from neighbor_ckpt.inprocess.identity import node_index

    planned = config.fault_injection.refuse_unsupported(where=" by recipes/mcore_gpt_plain_loop.py",
                                                        store_node=config.inprocess.enabled,
                                                        node=config.inprocess.enabled or node_index() is not None,
                                                        hung_node=config.inprocess.enabled,
                                                        partition=config.inprocess.enabled and partition_possible())
    if planned and args.kill:
        raise ConfigError("faults planned twice: --kill and neighbor_ckpt.fault_injection in the --config file; use "
                          "one of them (the config's faults list for several faults in one launch)")
    return planned


def planned_fault(rec: Recorder, fault: Any, phase: str) -> None:
    """Inject one planned fault (a :class:`~neighbor_ckpt.fault_config.FaultSpec`) into this process now: record it
    (``faults.jsonl``, a line each; ``fault.json`` for the first), lose the node if ``permanent``, send the signal."""
    entry = {"rank": RANK, "step": fault.step, "phase": phase, "signal": fault.signal, "unix": time.time(),
             "pid": os.getpid(), "target": fault.target, **({"node": fault.node} if fault.target == "node" else {})}
    if rec.out is not None:
        with open(rec.out / "faults.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
        if not (rec.out / "fault.json").exists():
            rec.json("fault.json", entry)
    logging.getLogger(__name__).warning("fault injection: %s", fault.describe())
    for h in logging.getLogger().handlers:
        h.flush()
    if fault.target == "partition":  # the network between nodes is cut (healed later, if planned); this rank trains on
        from neighbor_ckpt.glue.faults import fire

        return fire(fault, RANK, phase)
    if fault.target == "store_node":
        _lose_store_node(fault.signal)
        if fault.signal == "SIGSTOP":
            return  # only the store host is stopped; this rank trains on
    if fault.target == "node" or (fault.permanent and fault.signal == "SIGKILL"):  # the node whole: its launcher
        from neighbor_ckpt.runtime.failpoints import lose_node

        lose_node(getattr(signal, fault.signal))
    os.kill(os.getpid(), getattr(signal, fault.signal))


def _wait_for_a_spare(inproc: Any, timeout_s: float = 300.0) -> None:
    """A fault after the first recovery under ``inprocess.grow_back``: wait until a spare is up (the replacement the
    launcher starts once the recovered generation completed a step: its imports take seconds), so that the fault
    tests the grown-back spare, not its start-up."""
    deadline = time.monotonic() + timeout_s
    while not inproc.idle_spares() and time.monotonic() < deadline:
        time.sleep(0.1)
    logging.getLogger(__name__).warning("fault injection: idle spares before the fault: %s", inproc.idle_spares())


def _kill_when_still_idle(inproc: Any, rec: Any, step: int) -> None:
    """``--kill-idle-spare-after STEP``: this hot spare SIGKILLs itself once rank 0 has logged ``step``, if it is
    still idle then (a spare lost while idle: its launcher reports it, the job goes on)."""
    import threading

    def watch() -> None:
        losses = None if rec.out is None else rec.out / "losses.rank0.jsonl"
        while inproc.current is None:
            lines = losses.read_text().splitlines() if losses is not None and losses.exists() else []
            if any(line.endswith("}") and json.loads(line)["step"] >= step for line in lines):
                entry = {"process": inproc.process, "step": step, "unix": time.time(), "pid": os.getpid(),
                         "signal": "SIGKILL", "idle_spare": True}
                if rec.out is not None:
                    rec.json("fault.json", entry)
                logging.getLogger(__name__).warning("fault injection: SIGKILL of idle spare process %d after rank 0's "
                                                    "step %d", inproc.process, step)
                for h in logging.getLogger().handlers:
                    h.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)

    threading.Thread(target=watch, name="neighbor_ckpt-fault-idle-spare", daemon=True).start()


def _lose_store_node(sig: str) -> None:
    """``target: store_node``: SIGKILL of this node's launcher (the store host it runs dies with it; this rank is
    killed next by the caller), or SIGSTOP of the store host alone."""
    from neighbor_ckpt.inprocess import protocol

    pid = int(os.environ[protocol.ENV_LAUNCHER] if sig == "SIGKILL" else os.environ[protocol.ENV_STORE_HOST_PID])
    logging.getLogger(__name__).warning("fault injection: %s of %s (pid %d), which runs store %s", sig,
                                        "this node's launcher" if sig == "SIGKILL" else "the store host", pid,
                                        os.environ.get(protocol.ENV_STORE_HOSTED))
    for h in logging.getLogger().handlers:
        h.flush()
    os.kill(pid, getattr(signal, sig))


def _empty_own_store(config: Any) -> None:
    """A replaced node: this rank's host memory is empty, every store generation (elastic layouts) of the job."""
    import shutil

    from neighbor_ckpt.snapshot.store import rank_dir, store_generations

    root, job = config.resolved_store_dir(), config.resolved_job_id()
    for gen in store_generations(root, job) or [0]:
        shutil.rmtree(rank_dir(root, job, RANK, gen), ignore_errors=True)


def _damage_own_store(config: Any, args: argparse.Namespace) -> None:
    """Fault injection on the first restart of the killed rank: a replaced node, or a damaged newest snapshot."""
    from neighbor_ckpt.snapshot.damage import damage_newest_slot
    from neighbor_ckpt.snapshot.store import rank_dir

    own = rank_dir(config.resolved_store_dir(), config.resolved_job_id(), RANK)
    if args.replace_store:
        _empty_own_store(config)
    if args.damage:
        import random

        damage_newest_slot(own, args.damage,
                           rng=None if args.damage_seed is None else random.Random(args.damage_seed * 31 + RANK))


def _inside_optimizer_step(optimizer: Any, ckpt: Any, call: Any) -> None:
    """Fault injection: ``call(step)`` once this rank is inside each optimizer step (after the step tag)."""
    from megatron_patches.step_tags import tag_optimizer_steps

    tag_optimizer_steps(optimizer, on_enter=lambda: call(0 if ckpt.last_iteration is None
                                                         else ckpt.last_iteration + 1), on_exit=lambda: None)


def _kill_inside_optimizer_step(optimizer: Any, ckpt: Any, at_step: int, kill: Any) -> None:
    """Fault injection: signal this rank once it is inside optimizer step ``at_step`` (after the step tag)."""
    _inside_optimizer_step(optimizer, ckpt, lambda at: kill() if at == at_step else None)


if __name__ == "__main__":
    main()
