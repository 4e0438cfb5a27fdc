"""Micro-benchmark of the neighbor_ckpt data path, with every figure given as a ratio to a plain baseline.

One run prints one table:

1. **Staging vs memcpy.** :class:`~neighbor_ckpt.snapshot.engine.SnapshotEngine` on one rank, no transport. The copy
   into the slot (``stats.stage_seconds``) and the whole local commit (copy + extras + xxh3 + header +
   marker) are timed separately, and compared with a plain copy of the same tensors into pre-allocated,
   pre-faulted memory. Four copies are timed (``torch.Tensor.copy_`` and ``numpy.copyto``, into anonymous
   memory and into a ``/dev/shm`` mapping) and the fastest is the baseline. xxh3 throughput is shown too.
2. **Streaming vs raw gloo.** W processes (spawn, gloo, file init on localhost) in a ring. Each rank
   streams its newest committed own slot to its successor with :meth:`GlooRingTransport.send` (which
   returns after the successor's acknowledgement), all ranks at once. The baseline sends the same messages
   (16 x int64 meta, the image in the same segments and chunks, an 8-byte ack) with ``dist.send`` /
   ``dist.recv`` between pre-faulted anonymous tensors, over a second gloo group. A rank's time ends when
   its own send is acknowledged and its predecessor's image has fully landed; an iteration's time is the
   slowest rank's. The two variants alternate, iteration by iteration.
3. **Host memory vs unique bytes.** After the streaming run, ``HostStore.host_bytes()`` of a rank
   (2 own + 2 replica slots written by the real engine + transport) over ``plan.unique_bytes``.
4. **Restore vs raw transfer.** After the streaming run (the transport closed, as before a recovery), every
   rank "restarts" (a new :class:`HostStore` on the surviving files) and all ranks run
   :func:`~neighbor_ckpt.recovery.flow.run_recovery` on the transport's group, as
   :meth:`NeighborCheckpointer.recover` does, then copy the returned views into pre-allocated live tensors
   (what an adapter's ``load`` does). Two cases, each alternating round by round with its baseline:
   *lost store* (rank 0's store directory is deleted, a replaced node: inventory, all-gather, reconciliation,
   pull of the replica from its successor over gloo, checksum verification, load) timed on rank 0 against a
   raw ``dist.send``/``dist.recv`` of the same bytes in the same chunks between the same two ranks into a
   pre-faulted buffer plus a ``torch.copy_`` into the live tensors, target ``restore <= 1.5x raw``; and *local*
   (every store survived: own slot, verified, into the live tensors; slowest rank) against a ``torch.copy_``
   of the same bytes from a /dev/shm mapping, informational (a checksum pass alone costs about half a copy).
   The notes give the ``RecoveryReport.phases`` breakdown. ``--no-restore`` skips this.
5. **Input fingerprint vs snapshot().** The data-position check's per-step cost on the training thread
   (:meth:`NeighborCheckpointer.observe_input`: xxh3-64 of a micro-batch's token ids + the input record) against
   :meth:`NeighborCheckpointer.snapshot`'s training-thread time, in one process with a real checkpointer (target
   ``<= 0.01x``). ``--no-fingerprint`` skips this.
6. **Hot path.** What a snapshot costs per step besides copying bytes, one rank, no transport, for the tiny GPT's
   state (159 tensors) and a 1,000-tensor state: ``snapshot()`` on the training thread, and the engine thread's
   work until the commit minus its copy (slot choice, extras, checksums, header JSON, marker). Informational (no
   target); ``--hotpath-iters 0`` skips it. :mod:`.hotpath` also runs alone, for A/B runs against another tree.

Every timing is a median over ``--iters`` iterations after warm-up (first-touch page faults of a fresh
``/dev/shm`` file are not steady state). Stores go under ``$NEIGHBOR_CKPT_STORE_DIR`` (default
``/dev/shm``) and are removed at the end.

Run ``scripts/bench`` (or ``python -m tools.bench.micro``) with ``--mib``, ``--iters``, ``--world``,
``--json PATH``.

One module per concern: :mod:`.staging` (1), :mod:`.streaming` (2 + 3), :mod:`.restore` (4), :mod:`.fingerprint`
(5), :mod:`.hotpath` (6), :mod:`.report` (the table), :mod:`.cli` (the options and the order); :mod:`.common` holds
what they share.
"""

from __future__ import annotations

from tools.bench.micro.cli import main

__all__ = ["main"]  # the entry point (tools/bench/__main__.py); everything else is imported from its module
