"""``lightning_save``: what ``ModelCheckpoint(every_n_train_steps=1)`` costs under a ZeRO-style strategy."""

from __future__ import annotations

import time

from tools.bench.compare.systems.variant import Variant
from neighbor_ckpt.runtime.procs import dir_bytes


class LightningSave(Variant):
    name = "lightning_save"
    requires = ("lightning",)

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
        self.bytes_per_save = dir_bytes(self.path) if self.rank == 0 and self.path.exists() else 0
