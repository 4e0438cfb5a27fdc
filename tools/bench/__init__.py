"""Benchmarks of neighbor_ckpt (a tool of the checkout, not part of the package).

* ``python -m tools.bench [...]`` (``scripts/bench``): the micro-benchmark (:mod:`tools.bench.micro`);
* ``python -m tools.bench --compare [...]``: step time with neighbor_ckpt vs torch DCP, mcore dist_checkpointing,
  Lightning and NVRx local checkpointing (:mod:`tools.bench.compare`, docs/benchmarks.md);
* ``python -m tools.bench --nemo-step [...]``: a NeMo run's step time with and without neighbor_ckpt, and the
  machine's floor (:mod:`tools.bench.nemo_step`);
* ``python -m tools.bench.plots``: the figures of docs/benchmarks.md.
"""
