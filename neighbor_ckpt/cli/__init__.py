"""The ``neighbor-ckpt`` command.

``main`` (argument parsing: plan, launch, inspect, demo), ``launch`` (a job file -> torchrun or a Slurm script; the
recipes and job files it runs ship in :mod:`neighbor_ckpt.recipes`), ``demo``. The benchmarks and the fault campaign
are tools of the checkout (``tools/``), not part of the package.

The top layer: may import everything in :mod:`neighbor_ckpt`; nothing in the library imports it.
"""
