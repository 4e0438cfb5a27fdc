"""``dcp_async``: ``torch.distributed.checkpoint.async_save`` of the weights and this rank's optimizer shard."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from tools.bench.compare.systems.variant import Variant
from neighbor_ckpt.runtime.procs import dir_bytes

if TYPE_CHECKING:
    from tools.bench.compare.gpt import Trainer


def _optimizer_shard(tr: Trainer, rank: int) -> dict[str, Any]:
    """This rank's unique optimizer tensors (fp32 main-param shard + Adam moments), as the neighbor adapter sees
    them, under per-rank keys. The adapter's ``model/`` weight entries are left out: the weights are already under the
    state dict's ``model`` key, and per-rank copies of them would make DCP write the weights once more per DP rank.
    (The CPU figures of docs/benchmarks.md dated 2026-11-22 were measured before this fix and the one in
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
            self.bytes_per_save = dir_bytes(self._last)
        else:
            self.bytes_per_save = 0

    def close(self) -> None:
        self._wait()
