"""``nvrx_local`` / ``nvrx_local_repl``: NVIDIA resiliency-ext local checkpointing, without and with replication."""

from __future__ import annotations

import time
from typing import Any

from tools.bench.compare.systems.mcore_dist import mcore_sharded_state_dict
from tools.bench.compare.systems.variant import Variant
from neighbor_ckpt.runtime.procs import dir_bytes


class NvrxLocal(Variant):
    name = "nvrx_local"
    replicate = False
    requires = ("nvidia_resiliency_ext",)

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
        sd = mcore_sharded_state_dict(self.tr, step)
        tasd, self.cached = self.tasd_cls.from_state_dict(sd, algo="fully_parallel",
                                                          parallelization_group=self.tr.dp_group,
                                                          cached_metadata=self.cached)
        req = self.manager.save(tasd, step, is_async=True)
        self.queue.schedule_async_request(req)
        self._note("call_s", time.perf_counter() - t0)

    def end_block(self) -> None:
        self._wait()
        self.bytes_per_save = dir_bytes(self.manager.local_ckpt_dir)

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self.queue.close()


class NvrxLocalRepl(NvrxLocal):
    name = "nvrx_local_repl"
    replicate = True

