"""Capture and restore every RNG a training step may draw from (python, numpy, torch CPU and CUDA)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    version, words, gauss_next = random.getstate()
    state: dict[str, Any] = {
        # Mersenne Twister: 624 state words + the position, all < 2**32; one array instead of a 625-int tuple
        # keeps the snapshot call on the training thread short (the codec walks tuples element by element).
        "python": {"version": version, "words": np.asarray(words, dtype=np.uint32), "gauss_next": gauss_next},
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    if isinstance(py, dict):
        py = (py["version"], tuple(int(w) for w in py["words"]), py["gauss_next"])
    random.setstate(py)
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
