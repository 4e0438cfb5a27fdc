"""The interface every compared system implements, and what the systems share."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tools.bench.compare.gpt import Trainer


class Variant:
    """One way of checkpointing every step. Methods run on every rank.

    The harness (:class:`~tools.bench.compare.runner.Runner`) calls, on every rank in lock step:

    1) ``setup()`` once, after the model is built (a failure on any rank drops the variant, with the reason);
    2) per block of consecutive steps: ``start_block()``, then for every step ``save(step)`` right after the
       optimizer and scheduler steps (timed: the checkpoint's cost on the training step) and ``after_step()``
       after the step's closing barrier (untimed), then ``end_block()`` (untimed: drain the background work and
       measure ``bytes_per_save``, so nothing leaks into another variant's block);
    3) ``close()`` once, at the end (finalize every pending save).

    ``_note(key, seconds)`` records a per-step figure (``extra``) that the tables print as a median.
    """

    name = "?"
    mode_note = ""
    requires: tuple[str, ...] = ()
    """Top-level packages the system needs beyond the benchmark's own (torch, megatron-core); when one is not
    installed the variant is skipped with one line, before any rank starts (:func:`~tools.bench.compare.systems.
    runnable`)."""

    def __init__(self, tr: Trainer, root: Path, rank: int, world: int, tag: str) -> None:
        self.tr, self.root, self.rank, self.world, self.tag = tr, root / tag, rank, world, tag
        self.root.mkdir(parents=True, exist_ok=True)
        self.extra: dict[str, list[float]] = {}
        self.bytes_per_save: int | None = None  # this rank's, measured at the end of a block

    def setup(self) -> None: ...

    def start_block(self) -> None: ...

    def save(self, step: int) -> None: ...

    def end_block(self) -> None: ...

    def after_step(self) -> None:
        """Untimed, after every step's end (all ranks have passed the step's barrier)."""

    def close(self) -> None: ...

    @property
    def cuda(self) -> bool:
        return getattr(self.tr, "device", "cpu") == "cuda"

    def _note(self, key: str, value: float) -> None:
        self.extra.setdefault(key, []).append(value)
