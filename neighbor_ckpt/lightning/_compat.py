"""Lightning ships as two packages with separate class hierarchies: ``lightning.pytorch`` (used by NeMo)
and ``pytorch_lightning``. A callback must be an instance of the ``Callback`` of the package the trainer
comes from, so ours derives from every one that is installed."""

from __future__ import annotations

import importlib

__all__ = ["callback_bases", "lightning_modules"]


def lightning_modules() -> list[object]:
    mods = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            continue
    return mods


def callback_bases() -> tuple[type, ...]:
    bases = tuple(m.Callback for m in lightning_modules())  # type: ignore[attr-defined]
    if not bases:
        raise ImportError("neighbor_ckpt's Lightning callback needs `lightning` or `pytorch_lightning`: "
                          "pip install 'neighbor-ckpt[lightning]'")
    return bases
