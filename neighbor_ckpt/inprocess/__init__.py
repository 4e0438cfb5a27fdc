"""In-process recovery with hot spares, on our own engine: the plain megatron-core loop
(``recipes/mcore_gpt_plain_loop.py`` with ``neighbor_ckpt.inprocess.enabled``) and, through
:mod:`neighbor_ckpt.lightning.inprocess`, Lightning / NeMo.

The surviving processes of a failure never restart: they abort their process groups, join the next *generation*
(survivors keep their rank numbers and so find their own host slots; a hot spare, started with the job and idle, takes
a lost rank's number), and call the training function again, which rebuilds its process group, megatron-core's
parallel state, model and optimizer, and calls :meth:`~neighbor_ckpt.NeighborCheckpointer.recover` (the spare's store
is empty: it pulls the lost rank's unique state from the ring successor).

* :mod:`~neighbor_ckpt.inprocess.engine` — :class:`InprocessRecovery`: the run loop, the abort, the fallback; built
  from its collaborators: :mod:`~neighbor_ckpt.inprocess.identity` (who this process is: the one place that reads
  the launch's environment), :mod:`~neighbor_ckpt.inprocess.engine_state` (the generations as this process knows
  them, shared by the parts below), :mod:`~neighbor_ckpt.inprocess.store_clients` (one bounded view per thread),
  :mod:`~neighbor_ckpt.inprocess.peer_listeners` (the gloo listeners for the abort),
  :mod:`~neighbor_ckpt.inprocess.failover_replay` (what a new store must be told),
  :mod:`~neighbor_ckpt.inprocess.spare_slot` (a hot spare's slot, staged while it idles);
* :mod:`~neighbor_ckpt.inprocess.generation` — generations over the store: barrier, failure records, fencing;
* :mod:`~neighbor_ckpt.inprocess.assignment` — the rank assignment, a pure function;
* :mod:`~neighbor_ckpt.inprocess.monitor` — the failure detector's thread in process (heartbeats, silent peers, stuck
  ranks), on the decisions and ``neighbor_ckpt.detector`` timers of :mod:`neighbor_ckpt.runtime.detector`;
* :mod:`~neighbor_ckpt.inprocess.abort` — the scoped abort (our groups' sockets only) and the NCCL abort watchdog;
* :mod:`~neighbor_ckpt.inprocess.hygiene` — is a process clean after a failed generation;
* :mod:`~neighbor_ckpt.inprocess.launcher` — one launcher per node: starts ranks and spares, never kills survivors,
  reports exits, kills the ranks the detector declared dead, restarts the job when in-process recovery gives up;
* :mod:`~neighbor_ckpt.inprocess.store_host` — a store in a process of its own (every launcher runs one);
* :mod:`~neighbor_ckpt.inprocess.stores` — the primary and its standbys, bounded operations, the failover and fencing;
* :mod:`~neighbor_ckpt.inprocess.store_auth` — the per-job token: a gate before each store, a tunnel in each client;
* :mod:`~neighbor_ckpt.inprocess.loopback` — the loopback sockets admit the job only (a sealed store, tunnels for
  their own process);
* :mod:`~neighbor_ckpt.inprocess.protocol` — the keys, environment and exit statuses they share.

May import: the checkpointer and everything below it, :mod:`megatron_patches`; never the framework glue
(:mod:`neighbor_ckpt.glue`, ``lightning``, ``bridge``) nor :mod:`neighbor_ckpt.cli` (the rule:
:data:`neighbor_ckpt.layers.LAYERS`, checked by ``tests/unit/test_layers.py``).
"""

from neighbor_ckpt.inprocess.engine import InprocessRecovery

__all__ = ["InprocessRecovery"]
