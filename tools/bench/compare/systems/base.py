"""``base``: no checkpointing, the baseline every ratio is taken to."""

from __future__ import annotations

from tools.bench.compare.systems.variant import Variant


class Base(Variant):
    name = "base"

    def end_block(self) -> None:
        self.bytes_per_save = 0
