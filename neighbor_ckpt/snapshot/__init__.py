"""What is saved every iteration, and where it goes.

``razor`` (tensor metadata + topology -> a frozen :class:`ShardPlan`: what is unique, what is regenerable, what is
backed up lazily), ``topology`` (ranks, DP groups, the ring), ``codec`` and ``rng`` (the small per-rank state as
bytes, never pickle), ``slot`` (one shared-memory slot file: header, checksum, commit marker), ``store`` (a rank's
slots, their directories, the store's footprint, the slot a replaced rank prepares before its recovery),
``engine`` (the background copy into a slot and the wait point), ``transport`` (the one interface for every snapshot
byte between ranks: streaming, recovery images, the elastic exchange; its kinds by ``transport.kind``),
``gloo_transport`` (the gloo kinds), ``damage (deliberate slot damage for campaigns and tests).

May import (the rule: :data:`neighbor_ckpt.layers.LAYERS`, checked by ``tests/unit/test_layers.py``):
:mod:`neighbor_ckpt.errors`, :mod:`neighbor_ckpt.validation`, :mod:`neighbor_ckpt.config`,
:mod:`neighbor_ckpt.runtime` (failpoints, process facts).
Nothing here knows about recovery, Lightning, NeMo or megatron-core.
"""
