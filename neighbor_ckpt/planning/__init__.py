"""What ``neighbor-ckpt plan`` and ``launch`` read before any process starts.

``jobspec`` (job files: model, parallelism, trainer, data, checkpoint, hardware, launch, ``neighbor_ckpt``),
``planner`` (bytes, host memory and time per iteration per pipeline-stage class), ``goodput`` (failure model,
goodput and MTTR arithmetic).

May import (the rule: :data:`neighbor_ckpt.layers.LAYERS`, checked by ``tests/unit/test_layers.py``):
:mod:`neighbor_ckpt.snapshot` (the razor's rules and the store's footprint),
:mod:`neighbor_ckpt.config`, :mod:`neighbor_ckpt.validation`, :mod:`neighbor_ckpt.errors`. Pure arithmetic: no
torch.distributed, no processes.
"""
