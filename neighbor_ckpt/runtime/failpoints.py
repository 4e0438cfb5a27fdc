"""Named failpoints inside the library, for fault campaigns, demos and tests.

The library calls :func:`failpoint` at a few places where a failure is hardest to survive: in the
middle of copying a snapshot into its slot (``snapshot.copy``), in the middle of streaming it to the ring successor
(``snapshot.stream``), and while a recovery loads a restored state into the live model (``recovery.load``). A
failpoint does nothing until a test or a campaign :func:`arm` s it with an action (typically a SIGKILL of the
process); unarmed, it costs one dict lookup.


Nothing here is ever armed or called by training code on its own.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Callable

logger = logging.getLogger(__name__)

__all__ = ["FAILPOINTS", "arm", "disarm", "failpoint", "kill_self", "lose_node"]

FAILPOINTS = ("snapshot.copy", "snapshot.stream", "recovery.load")
"""``snapshot.copy``: the engine thread invalidated the oldest own slot and copied the first planned tensor into it
(or, with no tensor to copy, is about to write the small state);
``snapshot.stream``: the first chunk of a committed image went to the ring successor, the rest (and its commit
marker) did not; ``recovery.load``: a restored state was loaded into the live model and optimizer, the weights not
yet regenerated, no step trained on it."""

_armed: dict[str, Callable[[], None]] = {}


def arm(point: str, action: Callable[[], None]) -> None:
    """Run ``action`` (once) the next time the library reaches ``point``."""
    if point not in FAILPOINTS:
        raise ValueError(f"unknown failpoint {point!r}; choose from {', '.join(FAILPOINTS)}")
    _armed[point] = action


def disarm(point: str | None = None) -> None:
    """Disarm ``point`` (every failpoint if None)."""
    if point is None:
        _armed.clear()
    else:
        _armed.pop(point, None)


def failpoint(point: str) -> None:
    """Called by the library at ``point``; runs the armed action, if any, once."""
    action = _armed.pop(point, None) if _armed else None
    if action is not None:
        logger.warning("failpoint %s reached", point)
        for h in logging.getLogger().handlers:
            h.flush()
        action()


def kill_self(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """An action for :func:`arm`: signal this process (SIGKILL: it dies on the spot, from whichever thread)."""
    return lambda: os.kill(os.getpid(), sig)


def lose_node(sig: int = signal.SIGKILL) -> None:
    """Fault injection of a node that is gone for good (``fault_injection.permanent``, ``target: node``): SIGKILL this
    worker's launcher agent (its parent process: a torchrun agent or our in-process launcher), so no restart brings
    this rank back; the caller then kills itself. Under in-process recovery every simulated node has an agent of its
    own; under one torchrun agent for all local workers this takes the whole node down, as losing it would. ``sig``
    SIGSTOP: the node hangs instead (its agent stopped; the caller stops itself)."""
    parent = os.getppid()
    if parent > 1:
        logger.warning("fault injection: the node is gone: %s of this worker's launcher agent (pid %d)",
                       signal.Signals(sig).name, parent)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(parent, sig)
