"""Benchmarks of neighbor_ckpt. ``python -m neighbor_ckpt.cli.bench.micro --help`` (or ``scripts/bench``)."""
