"""What happens after a failure: inventory -> reconcile (pure) -> transfer -> restore, and which outcome it ends in.

``reconcile`` is the pure decision (every rank's versions -> the target iteration and every rank's source);
``flow`` runs it on the snapshot group (inventory, the exchange, the transfers of lost state, the restore verdict);
``recoverer`` owns every outcome (:class:`~neighbor_ckpt.recovery.recoverer.Recoverer`: restore, insurance, fresh
start, the startup window, refusing) and issues the recovery collectives in the order its docstring gives;
``journal`` holds what a rank leaves for the next process (the restore journal, the failure event); ``backup`` is
the failure path of a surviving rank (the failure event and the lazy backup of its DP group's redundant state);
``attempt`` names the attempt a record belongs to (the launcher's restart count and the in-process restart).

May import (the rule: :data:`neighbor_ckpt.layers.LAYERS`, checked by ``tests/unit/test_layers.py``):
:mod:`neighbor_ckpt.snapshot`, :mod:`neighbor_ckpt.runtime`, :mod:`neighbor_ckpt.errors`,
:mod:`neighbor_ckpt.validation`, :mod:`neighbor_ckpt.config`.
"""
