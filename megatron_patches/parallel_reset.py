"""Drop megatron-core's process-wide parallel state between in-process generations.

``initialize_model_parallel`` refuses to run twice ("data parallel group is already initialized"), NeMo's data
sampler refuses a second num-microbatches calculator, and an elastic shrink needs another number of micro-batches per
rank: after a failed generation's groups were aborted, :func:`reset_parallel_state` destroys both (measured safe after
the abort on megatron-core 0.15 and 0.16, ``../shared/notes/cpu-stack.md``). Nothing is patched: these are
megatron-core's own public destroy functions, called where a process outlives its groups. Without megatron-core
imported it does nothing.
"""

from __future__ import annotations

import sys

__all__ = ["reset_parallel_state"]


def reset_parallel_state() -> bool:
    """Destroy megatron-core's parallel state and num-microbatches calculator; False when megatron-core was never
    imported (nothing to reset, and importing it here would cost seconds)."""
    if "megatron.core.parallel_state" not in sys.modules:
        return False
    try:
        from megatron.core import num_microbatches_calculator, parallel_state
    except ImportError:
        return False
    parallel_state.destroy_model_parallel()
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    return True
