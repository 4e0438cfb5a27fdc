"""``mcore_async`` (``mcore_sync`` when the async path cannot run): megatron-core ``dist_checkpointing.save``."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.bench.compare.systems.variant import Variant
from neighbor_ckpt.runtime.procs import dir_bytes

if TYPE_CHECKING:
    from tools.bench.compare.gpt import Trainer


def mcore_sharded_state_dict(tr: Trainer, step: int) -> dict[str, Any]:
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
        sd = mcore_sharded_state_dict(self.tr, step)
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
            self.bytes_per_save = dir_bytes(self.dirs[-1])
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
