"""The compared systems, one module each, behind :class:`~tools.bench.compare.systems.variant.Variant`."""

from __future__ import annotations

import importlib.util
from typing import Callable, Sequence

from tools.bench.compare.systems.base import Base
from tools.bench.compare.systems.dcp import DcpAsync
from tools.bench.compare.systems.lightning_write import LightningSave
from tools.bench.compare.systems.mcore_dist import McoreAsync
from tools.bench.compare.systems.neighbor import Neighbor, NeighborLocal, NeighborNoSum
from tools.bench.compare.systems.nvrx import NvrxLocal, NvrxLocalRepl
from tools.bench.compare.systems.variant import Variant

VARIANTS = ("base", "neighbor", "dcp_async", "mcore_async", "lightning_save", "nvrx_local", "nvrx_local_repl",
            "neighbor_local", "neighbor_nosum")
ALTERNATIVES = ("dcp_async", "mcore_async", "lightning_save", "nvrx_local", "nvrx_local_repl")
DIAGNOSTICS = ("neighbor_local", "neighbor_nosum")
"""neighbor_ckpt with one part switched off, to show where its overhead goes (never a candidate 'alternative')."""
DESCRIPTIONS = {
    "base": "no checkpointing",
    "neighbor": "neighbor_ckpt snapshot (own slot + ring replica, shm)",
    "dcp_async": "torch DCP async_save (thread), /dev/shm",
    "mcore_async": "mcore dist_checkpointing.save torch_dist async, /dev/shm",
    "mcore_sync": "mcore dist_checkpointing.save torch_dist SYNC, /dev/shm",
    "lightning_save": "Lightning TorchCheckpointIO.save_checkpoint, rank 0, /dev/shm",
    "nvrx_local": "NVRx LocalCheckpointManager async, /dev/shm",
    "nvrx_local_repl": "NVRx local + CliqueReplication x2, /dev/shm",
    "neighbor_local": "diagnostic: neighbor_ckpt, transport off (own slot only)",
    "neighbor_nosum": "diagnostic: neighbor_ckpt, store.checksum none",
}

CLASSES: dict[str, type[Variant]] = {"base": Base, "neighbor": Neighbor, "dcp_async": DcpAsync,
                                     "mcore_async": McoreAsync, "lightning_save": LightningSave,
                                     "nvrx_local": NvrxLocal, "nvrx_local_repl": NvrxLocalRepl,
                                     "neighbor_local": NeighborLocal, "neighbor_nosum": NeighborNoSum}



def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def runnable(names: Sequence[str], *, installed: Callable[[str], bool] = _installed
             ) -> tuple[list[str], dict[str, str]]:
    """``names`` split into the variants whose packages (:attr:`Variant.requires`) are installed, in order, and the
    others, each with the reason it is skipped (``"needs nvidia_resiliency_ext, not installed"``). ``installed``:
    whether a top-level package can be imported (looked up, not imported)."""
    kept: list[str] = []
    skipped: dict[str, str] = {}
    for name in names:
        missing = [p for p in CLASSES[name].requires if not installed(p)]
        if missing:
            skipped[name] = f"needs {', '.join(missing)}, not installed"
        else:
            kept.append(name)
    return kept, skipped


__all__ = ["ALTERNATIVES", "CLASSES", "DESCRIPTIONS", "DIAGNOSTICS", "VARIANTS", "runnable"]
