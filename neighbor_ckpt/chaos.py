"""Fault injection for fault campaigns, demos and tests: named failpoints inside the library, and damage to host
slots the way real failures do it.

**Failpoints.** The library calls :func:`failpoint` at a few places where a failure is hardest to survive: in the
middle of copying a snapshot into its slot (``snapshot.copy``), in the middle of streaming it to the ring successor
(``snapshot.stream``), and while a recovery loads a restored state into the live model (``recovery.load``). A
failpoint does nothing until a test or a campaign :func:`arm` s it with an action (typically a SIGKILL of the
process); unarmed, it costs one dict lookup.

**Damage.** A bit flip in host memory, a file cut short (a node that ran out of memory mid-write), a header
overwritten by garbage. Recovery must refuse every one of them with a typed error and fall back to another copy.

Nothing here is ever armed or called by training code on its own.
"""

from __future__ import annotations

import logging
import os
import random
import signal
from pathlib import Path
from typing import Callable, Literal

from neighbor_ckpt.errors import SnapshotCorruptError, SnapshotMismatchError
from neighbor_ckpt.store import PREAMBLE_BYTES, SlotFile

logger = logging.getLogger(__name__)

__all__ = ["Damage", "DAMAGES", "FAILPOINTS", "arm", "disarm", "failpoint", "kill_self", "damage_newest_slot"]

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
        logger.warning("chaos: failpoint %s reached", point)
        for h in logging.getLogger().handlers:
            h.flush()
        action()


def kill_self(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """An action for :func:`arm`: signal this process (SIGKILL: it dies on the spot, from whichever thread)."""
    return lambda: os.kill(os.getpid(), sig)

Damage = Literal["bitflip", "truncate", "header"]
DAMAGES: tuple[Damage, ...] = ("bitflip", "truncate", "header")


def _newest(rank_dir: Path, role: str) -> tuple[int, Path] | None:
    found = []
    for path in rank_dir.glob(f"{role}.*.slot"):
        try:
            slot = SlotFile.open(path)
        except (SnapshotCorruptError, SnapshotMismatchError):
            continue
        try:
            found.append((slot.read_header().iteration, path))
        except (SnapshotCorruptError, SnapshotMismatchError):
            pass  # never committed
        finally:
            slot.close()
    return max(found) if found else None


def damage_newest_slot(rank_dir: Path, how: Damage, *, role: str = "own",
                       rng: random.Random | None = None) -> tuple[int, Path] | None:
    """Damage the newest committed ``role`` slot under ``rank_dir``; returns (iteration, path), None if none.

    ``bitflip``: one bit of the payload or extras, which only the checksum can catch (the first bit of the first
    payload byte, else of the last extras byte; with ``rng``, a random bit of a random committed byte);
    ``truncate``: the file cut to half its size; ``header``: 16 bytes of the header JSON overwritten."""
    newest = _newest(Path(rank_dir), role)
    if newest is None:
        return None
    iteration, path = newest
    if how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    else:
        slot = SlotFile.open(path)
        hdr = slot.read_header()
        bit = 0
        if how == "bitflip" and rng is not None:
            k = rng.randrange(hdr.payload_nbytes + hdr.extras_nbytes)
            off = slot.payload_off + k if k < hdr.payload_nbytes else slot.extras_off + k - hdr.payload_nbytes
            bit = rng.randrange(8)
        elif how == "bitflip":
            off = slot.payload_off if hdr.payload_nbytes else slot.extras_off + hdr.extras_nbytes - 1
        else:
            off = PREAMBLE_BYTES + 8
        slot.close()
        with open(path, "r+b") as f:
            f.seek(off)
            old = f.read(16 if how == "header" else 1)
            f.seek(off)
            f.write(b"\xff" * len(old) if how == "header" else bytes([old[0] ^ (1 << bit)]))
        if how == "bitflip":
            how = f"bitflip (byte {off}, bit {bit})"
    logger.warning("chaos: %s of %s (iteration %d)", how, path, iteration)
    return iteration, path
