"""In-process recovery with hot spares (issue 17, first slice: the plain megatron-core loop).

The surviving processes of a failure never restart: NVIDIA resiliency-ext's in-process wrapper
(``nvidia_resiliency_ext.inprocess``) aborts their process groups, re-assigns ranks (a hot spare, started with the
job and idle, takes the dead rank's place; survivors keep their rank numbers and so find their own host slots),
and calls the training function again, which rebuilds its process group, megatron-core's parallel state, model and
optimizer, and calls :meth:`~neighbor_ckpt.NeighborCheckpointer.recover` (the spare's store is empty: it pulls the
dead rank's unique state from the ring successor).

* :mod:`neighbor_ckpt.inprocess.wrapper` — :class:`InprocessRecovery`: the NVRx ``Wrapper`` built for this
  (timers, rank assignment, the gloo abort of :mod:`megatron_patches.nvrx_gloo`, the fallback), the per-attempt
  process group, the per-attempt clean-ups, the recovery timeline events;
* :mod:`neighbor_ckpt.inprocess.store_host` — the TCP store in a long-lived process of its own
  (``python -m neighbor_ckpt.inprocess.store_host``): rank 0's death must not take the stores down.

Launch: NVRx ``ft_launcher`` with one agent per node and ``--ft-restart-policy min-healthy`` (other agents' workers
keep running when one worker dies; plain torchrun stops the whole local worker group).

May import: the checkpointer and everything below it, :mod:`megatron_patches`; never :mod:`neighbor_ckpt.cli`.
"""

from neighbor_ckpt.inprocess.wrapper import FALLBACK_EXIT_CODE, InprocessRecovery, InprocessTimers

__all__ = ["InprocessRecovery", "InprocessTimers", "FALLBACK_EXIT_CODE"]
