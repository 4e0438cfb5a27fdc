"""The set-up every framework callback does when it is built, before the framework creates its process group.

:func:`set_up_callback` is the one place for it (the Lightning / NeMo 2 callback and the Megatron-Bridge callback call
it from their ``__init__``): the configuration is checked, the framework's own refusals run while nothing in the
process has changed yet, and then, when neighbor checkpointing is on, torchrun's restart gets a fresh rendezvous store
(:func:`~neighbor_ckpt.runtime.torchrun.prepare_torchrun_restart`) and a replaced node starts staging its receive slot
while the framework builds the model (:func:`~neighbor_ckpt.recovery.replacement_slot.prepare_replacement_slot`).
"""

from __future__ import annotations

from typing import Callable

from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.recovery.replacement_slot import prepare_replacement_slot
from neighbor_ckpt.runtime.torchrun import prepare_torchrun_restart

__all__ = ["set_up_callback"]


def set_up_callback(config: NeighborCkptConfig | None, *, name: str = "NeighborCheckpoint",
                    refuse: Callable[[NeighborCkptConfig], None] | None = None) -> NeighborCkptConfig:
    """Check ``config`` and prepare this process for a callback ``name``; returns the configuration it runs with.

    In this order: ``config`` is a :class:`NeighborCkptConfig` (None: the defaults); ``refuse(config)``, the
    framework's own refusals, raises before anything is prepared; when ``config.enabled``, torchrun's restart and a
    replaced node's receive slot are prepared (every rank, before the framework's ``init_process_group``).

    Raises:
        ConfigError: ``config`` is something else than a :class:`NeighborCkptConfig` (and what ``refuse`` raises).
    """
    if config is not None and not isinstance(config, NeighborCkptConfig):
        raise ConfigError(f"{name} expects a NeighborCkptConfig, got {type(config).__name__}; "
                          "build one with NeighborCkptConfig.from_yaml(...) or NeighborCkptConfig(...)")
    config = config or NeighborCkptConfig()
    if refuse is not None:
        refuse(config)
    if config.enabled:
        prepare_torchrun_restart()  # must happen before the framework creates its process group
        prepare_replacement_slot(config)  # a replaced node's receive slot, while the model is built
    return config
