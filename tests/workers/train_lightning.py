"""Lightning DDP worker: tiny model with dropout + StepLR, map-style data, NeighborCheckpoint, optional SIGKILL.

Run under torchrun. Environment: OUT_DIR, TEST_STORE_BASE, STEPS, PL_PACKAGE (lightning|pytorch_lightning),
KILL_*, WIPE_RANKS, INSURANCE_EVERY, INSURANCE_AS (``release-0.1``: on a restart, rank 0 first rewrites every
insurance checkpoint in the format the first release wrote, see :func:`as_release_0_1`), OPTIM (adam|zero), DISK_EVERY (a Lightning ModelCheckpoint every N steps,
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


def as_release_0_1(path: Path) -> None:
    """Rewrite a Lightning insurance checkpoint the way neighbor_ckpt 0.1 wrote it (captured from that release's
    ``trainer.save_checkpoint``): Lightning's keys, and under ``callbacks["NeighborCheckpoint"]`` only
    ``{"training_state": {"fit_loop", "schedulers", "rng", "batches_in_epoch"}}`` (the fit loop's state dict with the
    current batch counted as completed, the LR schedulers' state dicts, capture_rng(), batches of the epoch done)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    ts = ckpt["callbacks"]["NeighborCheckpoint"]["training_state"]
    old = {k: ckpt[k] for k in ("epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops",
                                "optimizer_states", "lr_schedulers")}
    old["callbacks"] = {"NeighborCheckpoint": {"training_state": {
        "fit_loop": ts["fit_loop"], "schedulers": ts["schedulers"], "rng": ts["rng"],
        "batches_in_epoch": int(ts["batches_in_epoch"])}}}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(old, tmp)
    os.replace(tmp, path)
    print(f"[test] rewrote {path.name} in release 0.1's format", flush=True)


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
    if every and attempt() > 0 and RANK == 0 and os.environ.get("INSURANCE_AS") == "release-0.1":
        # Before any collective: the other ranks load the insurance only inside the recovery's collectives.
        for path in sorted((OUT / "insurance").glob("neighbor-insurance-step*.ckpt")):
            as_release_0_1(path)
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
