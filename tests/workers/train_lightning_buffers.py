"""Lightning worker whose model carries module buffers that every forward updates: BatchNorm running statistics
(not used by the training-mode forward: only the final state sees them) and a running-mean centering layer whose
buffer the forward uses (every loss after a wrong restore differs). Optional SIGKILL.

Run under torchrun. Environment: OUT_DIR, TEST_STORE_BASE, STEPS, KILL_*, WIPE_RANKS, OPTIM (adam|zero), DEVICES
(default 4: ``--nproc-per-node`` must match). With DEVICES=1 the one rank is DP = 1: everything is unique.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import (append_jsonl, attempt, fingerprint, make_dataset, maybe_kill, optimizer_tensors,  # noqa: E402
                    setup_store_env, write_json)

from neighbor_ckpt import NeighborCheckpoint, NeighborCkptConfig  # noqa: E402

OUT = Path(os.environ["OUT_DIR"])
RANK = int(os.environ["RANK"])


class RunningCenter(nn.Module):
    """Subtracts a running mean of its input that every training forward updates in place (a persistent buffer,
    like BatchNorm's, but one the output depends on)."""

    def __init__(self, d: int, momentum: float = 0.3) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(1 - self.momentum).add_(x.mean(0), alpha=self.momentum)
                self.calls.add_(1)
        return x - self.mean


class BufferNet(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.center = RunningCenter(d_in)
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.bn = nn.BatchNorm1d(d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ReLU before BatchNorm: BatchNorm right after a linear layer would cancel the centering's shift, and the
        # loss would not depend on its buffer.
        return self.fc2(self.bn(torch.relu(self.fc1(self.center(x)))))


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = BufferNet()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        append_jsonl(OUT / f"losses.rank{RANK}.jsonl", {"step": self.trainer.global_step, "loss": loss.item().hex(),
                                                        "attempt": attempt()})
        maybe_kill(self.trainer.global_step, "forward", RANK)
        return loss

    def configure_optimizers(self):
        if os.environ.get("OPTIM", "adam") == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(make_dataset(), batch_size=8, shuffle=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format=f"[rank{RANK}] %(name)s %(levelname)s %(message)s")
    setup_store_env(RANK)
    torch.manual_seed(100 + RANK)
    cfg = NeighborCkptConfig.from_dict({"job_id": "lightning-buffers", "store": {"cleanup_on_success": False}})
    cb = NeighborCheckpoint(cfg)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("DEVICES", "4")), strategy="ddp",
                         max_steps=int(os.environ.get("STEPS", "12")), callbacks=[cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(OUT / "root"))
    model = Module()
    trainer.fit(model)
    rec = cb.last_recovery
    if rec is not None:
        write_json(OUT / f"report.rank{RANK}.attempt{attempt()}.json",
                   {**rec.report.to_dict(), "iteration": rec.iteration})
    opt = trainer.optimizers[0]
    if hasattr(opt, "consolidate_state_dict"):
        opt.consolidate_state_dict(to=0)
        state = optimizer_tensors(opt) if RANK == 0 else {}
    else:
        state = optimizer_tensors(opt)
    write_json(OUT / f"final.rank{RANK}.json", {"params": fingerprint(dict(model.named_parameters())),
                                                "buffers": fingerprint(dict(model.named_buffers())),
                                                "optim": fingerprint(state), "global_step": trainer.global_step})


if __name__ == "__main__":
    main()
