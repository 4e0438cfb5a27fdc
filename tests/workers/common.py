"""Shared pieces of the test workers: a tiny model with dropout, data, fingerprints, kill switches."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn


class TinyNet(nn.Module):
    """Two linear layers with dropout, so RNG restoration matters."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 4, p: float = 0.2) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def make_dataset(n: int = 512, d_in: int = 16, d_out: int = 4, seed: int = 1234) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g)
    y = x @ w + 0.1 * torch.randn(n, d_out, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def fingerprint(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of every tensor's bytes: equal fingerprints mean bit-identical tensors."""
    out = {}
    for k, t in sorted(tensors.items()):
        c = t.detach().cpu().contiguous()
        out[k] = hashlib.sha256(c.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() + f":{c.dtype}:{list(c.shape)}"
    return out


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    sd = opt.state_dict()
    out = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{pid}/{k}"] = v
    return out


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def maybe_kill(step: int, phase: str, rank: int) -> None:
    """SIGKILL this process if KILL_RANK/KILL_STEP/KILL_PHASE say so (first attempt only)."""
    if attempt() != 0:
        return
    if os.environ.get("KILL_RANK") is None:
        return
    if int(os.environ["KILL_RANK"]) == rank and int(os.environ["KILL_STEP"]) == step \
            and os.environ.get("KILL_PHASE", "forward") == phase:
        os.kill(os.getpid(), signal.SIGKILL)


def setup_store_env(rank: int) -> None:
    """Each rank gets its own store root (its own "node"). Ranks listed in WIPE_RANKS get an empty one on a
    restart, exactly like a replaced node."""
    base = Path(os.environ["TEST_STORE_BASE"])
    wipe = {int(r) for r in os.environ.get("WIPE_RANKS", "").split(",") if r}
    name = f"node{rank}"
    if attempt() > 0 and rank in wipe:
        name += f"-replaced{attempt()}"
    os.environ["NEIGHBOR_CKPT_STORE_DIR"] = str(base / name)
    os.environ.setdefault("NEIGHBOR_CKPT_NODE_ID", f"node{rank}")


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def append_jsonl(path: Path, obj: Any) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


def flip_byte_in_newest_own_slot(rank: int) -> None:
    """Corrupt one bit of this rank's newest committed own snapshot (payload, else extras): what a bit flip in
    host memory would do. Runs before recovery on a restart."""
    from neighbor_ckpt.snapshot.damage import damage_newest_slot

    (rank_dir,) = Path(os.environ["NEIGHBOR_CKPT_STORE_DIR"]).glob(f"*/*/rank{rank}")
    iteration, path = damage_newest_slot(rank_dir, "bitflip")
    print(f"[test] flipped a bit of {path} (iteration {iteration})", flush=True)
