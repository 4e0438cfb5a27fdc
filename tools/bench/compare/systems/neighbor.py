"""``neighbor`` (and its diagnostics ``neighbor_local``, ``neighbor_nosum``): neighbor_ckpt as the recipe uses it."""

from __future__ import annotations

import os
import time
from typing import Any

from tools.bench.compare.systems.variant import Variant


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
