"""The worker processes, one per rank (spawned by :mod:`.cli`): build the model, run the variants through
:class:`~.runner.Runner`, then the scaling runs; and the one-rank profiler of ``snapshot()``."""

from __future__ import annotations

import faulthandler
import gc
import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from tools.bench.compare.gpt import Trainer, fused_adam_without_te
from tools.bench.compare.runner import Runner
from tools.bench.compare.stats import best_alternative
from tools.bench.compare.systems import CLASSES
from tools.bench.compare.systems.mcore_dist import McoreAsync
from tools.bench.compare.systems.neighbor import Neighbor


def train_worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
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

    # env://: rank 0 hosts the job's TCPStore at MASTER_PORT, as under torchrun, so neighbor_ckpt's failure detector
    # (a heartbeat thread, part of what a user's step pays) and its launch store are there as in production.
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="env://",
                            rank=rank, world_size=world, timeout=timedelta(seconds=cfg["pg_timeout_s"]))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    root = Path(cfg["root"])
    result: dict[str, Any] = {"world": world}
    if device == "cuda":
        result["device"] = "cuda"
        result["optimizer"] = fused_adam_without_te()
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
    best = best_alternative(main)
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


def profile_worker(rank: int, cfg: dict[str, Any]) -> None:
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
