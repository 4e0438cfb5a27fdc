"""What people see: the status line, metrics to the trainer's loggers, recovery progress, the recovery timeline.

``status`` (status line, metrics, progress per recovery phase), ``timeline`` (per-rank events of a failure and a
recovery, gathered into one timeline JSON and PNG).

May import (the rule: :data:`neighbor_ckpt.layers.LAYERS`, checked by ``tests/unit/test_layers.py``):
:mod:`neighbor_ckpt.recovery` (the attempt), :mod:`neighbor_ckpt.snapshot` (slot commit times),
:mod:`neighbor_ckpt.runtime` (process facts),
:mod:`neighbor_ckpt.validation`, :mod:`neighbor_ckpt.config`, :mod:`neighbor_ckpt.errors`.
"""
