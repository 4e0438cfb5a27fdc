"""Lightning DDP worker: tiny model with dropout + StepLR, map-style data, NeighborCheckpoint, optional SIGKILL.

Run under torchrun. Environment: OUT_DIR, TEST_STORE_BASE, STEPS, PL_PACKAGE (lightning|pytorch_lightning),
KILL_*, WIPE_RANKS, INSURANCE_EVERY, OPTIM (adam|zero), DISK_EVERY (a Lightning ModelCheckpoint every N steps,
and a restarted attempt calls ``fit(ckpt_path="last")``, as a user resuming from disk would), ACCELERATOR and
DEVICES (the Trainer's, default cpu and 4: ``--nproc-per-node`` must match DEVICES).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (TinyNet, append_jsonl, attempt, fingerprint, flip_byte_in_newest_own_slot,  # noqa: E402
                    make_dataset, maybe_kill, optimizer_tensors, setup_store_env, write_json)

from neighbor_ckpt import NeighborCheckpoint, NeighborCkptConfig  # noqa: E402
from neighbor_ckpt.errors import NeighborCkptError  # noqa: E402

pl = importlib.import_module("lightning.pytorch" if os.environ.get("PL_PACKAGE", "lightning") == "lightning"
                             else "pytorch_lightning")
OUT = Path(os.environ["OUT_DIR"])
RANK = int(os.environ["RANK"])


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyNet()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        append_jsonl(OUT / f"losses.rank{RANK}.jsonl", {"step": self.trainer.global_step, "loss": loss.item().hex(),
                                                        "attempt": attempt(), "x0": x[0, 0].item().hex()})
        maybe_kill(self.trainer.global_step, "forward", RANK)
        return loss

    def on_after_backward(self) -> None:
        maybe_kill(self.trainer.global_step, "backward", RANK)

    def configure_optimizers(self):
        if os.environ.get("OPTIM", "adam") == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(make_dataset(), batch_size=8, shuffle=True)


class KillAfterStep(pl.Callback):
    """Placed before NeighborCheckpoint: kills after the optimizer step, before that step's snapshot."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        maybe_kill(trainer.global_step - 1, "after_step", RANK)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format=f"[rank{RANK}] %(name)s %(levelname)s %(message)s")
    setup_store_env(RANK)
    if attempt() > 0 and os.environ.get("FLIP_RANK") == str(RANK):
        flip_byte_in_newest_own_slot(RANK)
    torch.manual_seed(100 + RANK)
    every = int(os.environ.get("INSURANCE_EVERY", "0"))
    cfg = NeighborCkptConfig.from_dict({
        "job_id": os.environ.get("JOB_ID", "lightning"),
        "store": {"cleanup_on_success": False},
        "insurance": {"every_n_steps": every, "dirpath": str(OUT / "insurance") if every else None},
    })
    cb = NeighborCheckpoint(cfg)
    callbacks = [KillAfterStep(), cb]
    disk_every = int(os.environ.get("DISK_EVERY", "0"))
    if disk_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=str(OUT / "disk"), every_n_train_steps=disk_every,
                                                      save_last=True, save_top_k=-1))
    trainer = pl.Trainer(accelerator=os.environ.get("ACCELERATOR", "cpu"), devices=int(os.environ.get("DEVICES", "4")),
                         strategy="ddp", max_steps=int(os.environ.get("STEPS", "12")),
                         callbacks=callbacks, logger=False, enable_checkpointing=bool(disk_every),
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(OUT / "root"))
    model = Module()
    try:
        trainer.fit(model, ckpt_path="last" if disk_every and attempt() > 0 else None)
    except NeighborCkptError as e:
        write_json(OUT / f"error.rank{RANK}.json", {"type": type(e).__name__, "message": str(e)})
        raise
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
                                                "optim": fingerprint(state), "global_step": trainer.global_step,
                                                "lr": opt.param_groups[0]["lr"]})


if __name__ == "__main__":
    main()
