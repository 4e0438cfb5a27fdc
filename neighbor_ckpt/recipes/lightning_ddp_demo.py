"""Lightning DDP recipe with NeighborCheckpoint: a tiny model with dropout and an LR schedule on CPU ranks.

Launch under torchrun (restarts enabled)::

    torchrun --nproc-per-node 4 --max-restarts 1 recipes/lightning_ddp_demo.py --out runs/demo

Fault injection for demos (attempt 0 only): ``--kill RANK:STEP`` SIGKILLs that rank in the forward pass of that
step; ``--replace-store RANK`` gives that rank an empty host store on the restart, as a replaced node would have.
Each rank writes ``losses.rank<r>.jsonl``, ``recovery.rank<r>.json`` and ``final.rank<r>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn

from neighbor_ckpt import NeighborCheckpoint, NeighborCkptConfig

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class TinyRegressor(pl.LightningModule):
    def __init__(self, out: Path, kill: tuple[int, int] | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 8))
        self.out, self.kill = out, kill

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        with open(self.out / f"losses.rank{RANK}.jsonl", "a") as f:
            f.write(json.dumps({"step": self.global_step, "loss": loss.item().hex(), "attempt": ATTEMPT,
                                "time": time.time()}) + "\n")
        if self.kill == (RANK, self.global_step) and ATTEMPT == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # a real crash, mid-step
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2048, 32, generator=g)
        y = x @ torch.randn(32, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill", default=None, help="RANK:STEP")
    ap.add_argument("--replace-store", type=int, default=None)
    ap.add_argument("--config", type=Path, default=None, help="YAML file with a neighbor_ckpt: section")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # One store root per rank: each rank plays a node; a replaced node starts with an empty store.
    node = f"node{RANK}" + (f"-replaced{ATTEMPT}" if ATTEMPT and args.replace_store == RANK else "")
    os.environ["NEIGHBOR_CKPT_STORE_DIR"] = str(args.out / "store" / node)
    os.environ["NEIGHBOR_CKPT_NODE_ID"] = f"node{RANK}"
    cfg = NeighborCkptConfig.from_yaml(args.config) if args.config else NeighborCkptConfig()
    cfg.job_id = cfg.job_id or "demo"
    kill = tuple(int(v) for v in args.kill.split(":")) if args.kill else None
    torch.manual_seed(100 + RANK)
    cb = NeighborCheckpoint(cfg)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp",
                         max_steps=args.steps, callbacks=[cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(args.out / "lightning"))
    model = TinyRegressor(args.out, kill)
    t0 = time.time()
    trainer.fit(model)
    rec = cb.last_recovery
    if rec is not None:
        (args.out / f"recovery.rank{RANK}.attempt{ATTEMPT}.json").write_text(json.dumps({
            "started": t0, "outcome": rec.report.outcome, "iteration": rec.iteration, "source": rec.report.source,
            "lazy_from": rec.report.lazy_from, "pulled_bytes": rec.report.pulled_bytes,
            "lazy_bytes": rec.report.lazy_bytes, "phases": rec.report.phases, "summary": rec.report.summary()}))
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    (args.out / f"final.rank{RANK}.json").write_text(json.dumps({"params_sha256": digest.hexdigest()}))


if __name__ == "__main__":
    main()
