"""megatron-core's CUDA RNG tracker streams (``tensor_parallel.random``), read and written for snapshots.

Dropout inside ``get_cuda_rng_tracker().fork()`` (attention dropout, tensor-parallel regions) draws from
the tracker's named streams, not from the default CUDA generator: a bit-exact resume must carry them too.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tracker_states", "set_tracker_states"]


def tracker_states() -> dict[str, torch.Tensor]:
    """Copies of every named stream of mcore's RNG tracker (empty if it was never seeded)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {name: state.clone() for name, state in get_cuda_rng_tracker().get_states().items()}


def set_tracker_states(states: dict[str, Any]) -> None:
    """Restore streams captured by :func:`tracker_states` (a no-op for an empty dict)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    if states:
        get_cuda_rng_tracker().set_states({name: torch.as_tensor(s) for name, s in states.items()})
