"""Bit-exact DDP across restarts: pin the gradient bucket layout before the first step.

``DistributedDataParallel`` reduces gradients in buckets. It starts with a layout in parameter order
and, after its first iteration, rebuilds the buckets once in the order gradients became ready. A
restarted process therefore reduces its first step with a different layout than the uninterrupted run
did at that step, and since a ring all-reduce sums each element in an order that depends on its position
in the bucket, that step differs in the last bits.

:func:`pin_bucket_layout` performs DDP's one-time rebuild up front, in parameter order, so every run
(fresh or restored) uses the same layout from step 0 and DDP never rebuilds again. It uses two
reducer methods that DDP itself calls (``_push_all_rebuilt_params``, ``_rebuild_buckets``); when they
are missing the function says so and changes nothing.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["pin_bucket_layout"]


def pin_bucket_layout(ddp: Any) -> bool:
    """Pin ``ddp``'s bucket layout before its first forward. Returns True if the layout is now fixed.

    Call it right after wrapping the model, in every run: a restarted run must use the layout the
    uninterrupted run used.
    """
    reducer = getattr(ddp, "reducer", None)
    if reducer is None:
        return False
    if getattr(ddp, "_has_rebuilt_buckets", False):
        return True
    push = getattr(reducer, "_push_all_rebuilt_params", None)
    rebuild = getattr(reducer, "_rebuild_buckets", None)
    if push is None or rebuild is None:
        logger.warning("this torch version's DDP reducer cannot pin its bucket layout; the first step after a "
                       "restart may differ from an uninterrupted run in the last bits")
        return False
    push()
    if rebuild():
        ddp._has_rebuilt_buckets = True
    return True
