"""The process around training: what notices a failure and what cleans up after one.

``detector`` (heartbeats and step tags through the c10d store), ``reaper`` (what a killed predecessor process left
behind), ``procs`` (process facts read through psutil; tagged harness processes), ``preflight`` (host memory
before the first slot is allocated), ``torchrun`` (the restart fix for torchrun's agent store), ``launch_identity``
(the job id of a torchrun launch without a run id, made once per launch), ``launch_store`` (the store that outlives
a worker's restarts, and the own-slot capacities a replaced rank prepares its receive slot from), ``failpoints``
(named places where a campaign can kill a process), ``atomic_json`` (the small 0600 JSON files a rank leaves
for the next process, replaced atomically).

The lowest layer beside :mod:`neighbor_ckpt.errors`, :mod:`neighbor_ckpt.validation` and :mod:`neighbor_ckpt.config`:
it may import only those (the rule: :data:`neighbor_ckpt.layers.LAYERS`, checked by ``tests/unit/test_layers.py``).
"""
