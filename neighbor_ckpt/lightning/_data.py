"""Resuming the data position of a map-style dataset mid-epoch.

Lightning restarts an epoch's sampler from its first index. After a restore we wrap the training
DataLoader's sampler for one epoch so that it skips the indices of the batches already consumed:
nothing is skipped that was not trained on, nothing is repeated. Only indices are skipped (no sample is
loaded); the callback puts the original sampler back when the epoch ends.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import torch

logger = logging.getLogger(__name__)

__all__ = ["SkipFirst", "install_skip", "uninstall_skip"]


class SkipFirst:
    """Sampler wrapper that drops the first ``skip`` indices of its next iteration only."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        it = iter(self.inner)
        skip, self.skip = self.skip, 0
        for _ in range(skip):
            next(it, None)
        yield from it

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # during copy/pickle, before __init__ ran
            raise AttributeError(name)
        return getattr(self.inner, name)


def install_skip(dataloader: Any, batches: int) -> bool:
    """Make the next iteration of ``dataloader`` start after ``batches`` batches. False if unsupported."""
    bs = getattr(dataloader, "batch_sampler", None)
    if batches <= 0:
        return True
    if isinstance(getattr(dataloader, "dataset", None), torch.utils.data.IterableDataset):
        logger.warning("cannot resume the data position of an IterableDataset (implement state_dict / "
                       "load_state_dict on the loader); the epoch restarts from its first sample")
        return False
    if bs is None or not hasattr(bs, "sampler") or not hasattr(bs, "batch_size"):
        logger.warning("cannot resume the data position of %s (no BatchSampler); the epoch restarts from its "
                       "first batch", type(dataloader).__name__)
        return False
    bs.sampler = SkipFirst(bs.sampler, batches * bs.batch_size)
    return True


def uninstall_skip(dataloader: Any) -> None:
    bs = getattr(dataloader, "batch_sampler", None)
    if bs is not None and isinstance(getattr(bs, "sampler", None), SkipFirst):
        bs.sampler = bs.sampler.inner
