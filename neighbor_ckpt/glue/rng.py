"""The RNG states a framework callback carries in its training state, and applies once after a restore.

A snapshot's training state holds the RNG states of the step just completed (:func:`capture`: python, numpy, torch
CPU and CUDA). After a restore they are not applied at once but right before the first resumed step
(:class:`PendingRng`): what the framework does in between (building a data loader's iterator draws from the torch RNG)
must not see them, exactly as in the uninterrupted run.
"""

from __future__ import annotations

from typing import Any

from neighbor_ckpt.snapshot.rng import capture_rng, restore_rng

__all__ = ["capture", "PendingRng"]


def capture() -> dict[str, Any]:
    """The RNG states of this process now (python, numpy, torch CPU and, once initialised, CUDA)."""
    return capture_rng()


class PendingRng:
    """RNG states to apply once, at the framework's next hook before the first resumed step."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def keep(self, state: dict[str, Any] | None) -> None:
        """Apply ``state`` (a training state's ``"rng"``; None: nothing) at the next :meth:`apply`."""
        self.state = state

    def keep_current(self) -> None:
        """Apply the RNG states of now at the next :meth:`apply` (what a framework's own checkpoint load left: set
        again after the framework drew from them)."""
        self.state = capture_rng()

    def apply(self) -> None:
        """Set the kept states, once (nothing when none is kept)."""
        if self.state is not None:
            restore_rng(self.state)
            self.state = None
