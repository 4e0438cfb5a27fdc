"""Benchmarks of neighbor_ckpt. ``python -m neighbor_ckpt.bench.micro --help`` (or ``scripts/bench``)."""
