"""What happens after a failure: inventory -> reconcile (pure) -> transfer -> restore.

``reconcile`` is the pure decision (every rank's versions -> the target iteration and every rank's source);
``flow`` runs it on the snapshot group (inventory, the collectives, the transfers of lost state).

May import: :mod:`neighbor_ckpt.snapshot`, :mod:`neighbor_ckpt.runtime`, :mod:`neighbor_ckpt.errors`,
:mod:`neighbor_ckpt.config`.
"""
