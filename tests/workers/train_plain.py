"""Plain-loop worker (no Lightning): tiny model, DDP or ZeRO, snapshot every step, optional SIGKILL.

Run under torchrun. Environment: OUT_DIR, TEST_STORE_BASE, STEPS, OPTIM (adam|zero), KILL_*, WIPE_RANKS, JOB_ID
(default ``plain``; empty: none configured, the launcher's run id or the launch's own id).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
from common import (TinyNet, append_jsonl, attempt, fingerprint, make_dataset, maybe_kill,  # noqa: E402
                    optimizer_tensors, setup_store_env, write_json)

from neighbor_ckpt import NeighborCkptConfig, prepare_torchrun_restart  # noqa: E402
from neighbor_ckpt.adapters import TorchOptimizerAdapter, pin_bucket_layout  # noqa: E402
from neighbor_ckpt.adapters.torch_optim import ZeroOptimizerAdapter  # noqa: E402
from neighbor_ckpt.checkpointer import NeighborCheckpointer  # noqa: E402
from neighbor_ckpt.errors import NeighborCkptError  # noqa: E402


def main() -> None:
    logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ.get('RANK')}] %(name)s %(levelname)s %(message)s")
    rank = int(os.environ["RANK"])
    setup_store_env(rank)
    prepare_torchrun_restart()  # fresh c10d store per torchrun attempt (before the process group exists)
    dist.init_process_group("gloo")
    out = Path(os.environ["OUT_DIR"])
    steps = int(os.environ.get("STEPS", "12"))
    torch.manual_seed(0)
    model = TinyNet()
    ddp = DDP(model)
    pin_bucket_layout(ddp)
    if os.environ.get("OPTIM", "adam") == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        adapter = ZeroOptimizerAdapter(model, opt)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        adapter = TorchOptimizerAdapter(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    torch.manual_seed(100 + rank)  # per-rank dropout stream

    cfg = NeighborCkptConfig.from_dict({"job_id": os.environ.get("JOB_ID", "plain") or None,  # "": the launcher's
                                        "store": {"cleanup_on_success": False}})
    ckpt = NeighborCheckpointer(cfg, adapter=adapter)
    try:
        result = ckpt.recover()
    except NeighborCkptError as e:
        write_json(out / f"error.rank{rank}.json", {"type": type(e).__name__, "message": str(e)})
        raise
    write_json(out / f"report.rank{rank}.attempt{attempt()}.json",
               {**result.report.to_dict(), "iteration": result.iteration})
    if result.restored:
        sched.load_state_dict(result.user_state["sched"])

    data = make_dataset()
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=7)
    bs = 8
    per_epoch = len(sampler) // bs
    try:
        for step in range(result.next_step, steps):
            epoch, b = divmod(step, per_epoch)
            sampler.set_epoch(epoch)
            idx = list(iter(sampler))[b * bs:(b + 1) * bs]
            x, y = data[idx]
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            # Logged before anything can fail: a step whose snapshot landed is never recomputed.
            append_jsonl(out / f"losses.rank{rank}.jsonl", {"step": step, "loss": loss.item().hex(), "attempt": attempt()})
            maybe_kill(step, "forward", rank)
            ckpt.wait()
            loss.backward()
            maybe_kill(step, "backward", rank)
            with ckpt.optimizer_step():
                opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            ckpt.snapshot(step, user_state={"sched": sched.state_dict()})
            maybe_kill(step, "after_snapshot", rank)
    except Exception as e:
        ckpt.on_failure(f"{type(e).__name__}: {e}")
        raise
    ckpt.close(success=True)
    if hasattr(opt, "consolidate_state_dict"):
        opt.consolidate_state_dict(to=0)
        state = optimizer_tensors(opt) if rank == 0 else {}
    else:
        state = optimizer_tensors(opt)
    write_json(out / f"final.rank{rank}.json", {"params": fingerprint(dict(model.named_parameters())),
                                                "optim": fingerprint(state), "sched": sched.state_dict()["last_epoch"]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
