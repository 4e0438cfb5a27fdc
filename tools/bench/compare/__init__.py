"""Side-by-side benchmark: the step time of a megatron-core GPT checkpointed every iteration, per method.

One job (``torch.multiprocessing`` spawn, gloo, file init on localhost; ``--world`` ranks, 4 by default) trains
the GPT of ``recipes/mcore_gpt_plain_loop.py`` (mcore ``GPTModel`` with the local layer spec, mcore
``DistributedDataParallel``, ``get_megatron_optimizer`` with the distributed optimizer, an
``OptimizerParamScheduler``, ``get_forward_backward_func()``; :mod:`.gpt` says why its model-building lines are a
checked copy of the recipe's) and times every training step while one of these checkpoints after every optimizer step:

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

Run ``python -m tools.bench.compare`` (``--quick`` for a shorter run; ``python -m tools.bench --compare``).

Modules: :mod:`.systems` (one module per compared system behind :class:`~.systems.variant.Variant`), :mod:`.gpt`
(the model), :mod:`.runner` (interleaved blocks, the step clock, CPU accounting) and :mod:`.worker` (the rank
processes): the harness; :mod:`.stats` (medians, bootstrap, the verdict), :mod:`.tables` (rendering),
:mod:`.projection` (``--projection``), :mod:`.cli` (the options).
"""

from __future__ import annotations

from tools.bench.compare.cli import main

__all__ = ["main"]  # the entry point (tools/bench/__main__.py); everything else is imported from its module
