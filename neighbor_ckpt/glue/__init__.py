"""Framework glue that is not tied to one framework: the insurance, resume and data-position policy that a training
framework's callback follows (the Lightning / NeMo 2 callback in :mod:`neighbor_ckpt.lightning`, the Megatron-Bridge
callback beside it).

* :class:`~neighbor_ckpt.glue.session.Session`: builds the checkpointer, runs the recovery and says what the
  framework does next (:class:`~neighbor_ckpt.glue.session.Resume`: the training state to apply, the data position,
  whether the framework's own checkpoint is the insurance and loads itself); snapshots once per optimizer step;
  carries the callback's state inside the framework's checkpoints.
* :mod:`~neighbor_ckpt.glue.insurance`: our own insurance checkpoints (names, when one is due, which are kept), which
  iteration a framework checkpoint holds, and which wins when an in-memory version and a framework checkpoint are
  both there (the newer iteration, announced).
* :func:`~neighbor_ckpt.glue.setup.set_up_callback`: the set-up every framework callback does when it is built
  (the configuration checked, torchrun's restart and a replaced node's slot prepared).
* :mod:`~neighbor_ckpt.glue.adapters`: the state adapter for the framework's optimizer; :mod:`~neighbor_ckpt.glue.rng`:
  the RNG states a training state carries and applies once; :mod:`~neighbor_ckpt.glue.faults`: what fault injection
  does to a process.

The framework callback keeps only its plumbing: its hooks, reading and writing the framework's objects. It reaches the
library through this package, the checkpointer, :mod:`neighbor_ckpt.inprocess` and ``megatron_patches`` only.

May import: :mod:`neighbor_ckpt.checkpointer` and everything below it. Never :mod:`neighbor_ckpt.lightning`,
``bridge``, ``inprocess`` or ``cli``, nor a training framework (Lightning, NeMo, Megatron-Bridge, megatron-core).
"""

# No public API (README shows none): import from the modules of glue/.
__all__: list[str] = []
