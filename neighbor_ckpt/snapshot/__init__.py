"""What is saved every iteration, and where it goes.

``razor`` (tensor metadata + topology -> a frozen :class:`ShardPlan`: what is unique, what is regenerable, what is
backed up lazily), ``topology`` (ranks, DP groups, the ring), ``codec`` and ``rng`` (the small per-rank state as
bytes, never pickle), ``store`` (shared-memory slots: header, checksum, commit marker, the store's footprint),
``engine`` (the background copy into a slot and the wait point), ``transport`` (the neighbor-ring interface and its
gloo implementation), ``damage`` (deliberate slot damage for campaigns and tests).

May import: :mod:`neighbor_ckpt.errors`, :mod:`neighbor_ckpt.config`, :mod:`neighbor_ckpt.runtime` (failpoints,
process facts).
Nothing here knows about recovery, Lightning, NeMo or megatron-core.
"""
