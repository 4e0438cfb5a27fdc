"""The ``neighbor-ckpt`` command and the tools around it.

``main`` (argument parsing: plan, launch, inspect, demo, bench, campaign), ``launch`` (a job file -> torchrun or a
Slurm script), ``demo``, ``campaign`` (randomized fault campaigns), ``bench/`` (micro benchmarks of the data path
and the side-by-side comparison with other checkpointing systems, one module per system).

The top layer: may import everything in :mod:`neighbor_ckpt`; nothing in the library imports it.
"""
