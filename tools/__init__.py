"""Tools of the source checkout, not part of the installed package (setup.cfg packages ``neighbor_ckpt`` and
``megatron_patches`` only): the benchmarks (``python -m tools.bench``, ``scripts/bench``) and the fault campaign
(``python -m tools.campaign``, ``scripts/campaign``). Run them from the checkout's root.

They may import the library (``neighbor_ckpt``, ``megatron_patches``, the shipped recipes in
``neighbor_ckpt.recipes``); nothing in the library imports them.
"""
