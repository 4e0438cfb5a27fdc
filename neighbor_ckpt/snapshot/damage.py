"""Damage to host slots the way real failures do it, for fault campaigns and tests: a bit flip in host memory, a
file cut short (a node that ran out of memory mid-write), a header overwritten by garbage. Recovery must refuse
every one of them with a typed error and fall back to another copy. Nothing here is called by training code.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Literal

from neighbor_ckpt.errors import SnapshotCorruptError, SnapshotMismatchError
from neighbor_ckpt.snapshot.slot import PREAMBLE_BYTES, SlotFile

logger = logging.getLogger(__name__)

__all__ = ["Damage", "DAMAGES", "damage_newest_slot"]

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
    logger.warning("damage: %s of %s (iteration %d)", how, path, iteration)
    return iteration, path
