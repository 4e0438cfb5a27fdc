"""What a replaced rank can read before its recovery: the launch's key-value store, and the slot capacities kept there.

A rank whose host store is empty (a replaced node, an activated hot spare) pulls its state from its ring successor
into a new slot file. Making that memory costs about as much as the transfer (tmpfs zeroes each page on its first
touch; docs/benchmarks.md section 6): the checkpointer prepares the slot in the background while the job gets
ready (:meth:`~neighbor_ckpt.snapshot.store.HostStore.prefault`). Its capacities have to be known before the
recovery's exchange says them, so every rank publishes the capacities of its own slots once (:class:`SlotCapacities`)
in a store that outlives its process:

* **under torchrun**, the elastic agent's store: it lives as long as the launch. Workers reach it at MASTER_ADDR /
  MASTER_PORT while ``TORCHELASTIC_USE_AGENT_STORE=True``; :func:`~neighbor_ckpt.runtime.torchrun.
  prepare_torchrun_restart` records its address in :data:`AGENT_STORE_ENV` before it points MASTER_PORT at an
  incarnation's own store, which dies with the incarnation;
* **otherwise**, the default process group's store below its prefixes (in-process recovery's external store, which
  every attempt's group is a prefix of, or a launcher's store).

Best effort throughout: no store, no key or any store error means no preparation (the slot is made when the pull
needs it, as before), never a failed job.

May import: :mod:`neighbor_ckpt.runtime.launch_identity`.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta
from typing import Any, Mapping

from neighbor_ckpt.runtime.launch_identity import agent_store_address

__all__ = ["AGENT_STORE_ENV", "recorded_agent_store", "open_launch_store", "SlotCapacities"]

logger = logging.getLogger(__name__)

AGENT_STORE_ENV = "NEIGHBOR_CKPT_AGENT_STORE"
"""``host:port`` of the torchrun agent's store, kept by ``prepare_torchrun_restart`` when it re-points MASTER_PORT."""


def recorded_agent_store(env: Mapping[str, str] = os.environ) -> tuple[str, int] | None:
    """The agent store address :data:`AGENT_STORE_ENV` holds (None: not set or malformed)."""
    host, sep, port = env.get(AGENT_STORE_ENV, "").rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host, int(port)


def open_launch_store(*, timeout_s: float = 10.0, fallback: tuple[str, int] | None = None) -> Any | None:
    """A client of the store that outlives this process's restarts (see the module docstring); None when there is
    none or it cannot be reached. ``fallback``: the launch store's address when there is no torchrun agent store,
    for a process without a default process group (an in-process hot spare while it idles)."""
    import torch.distributed as dist

    address = recorded_agent_store() or agent_store_address() or fallback
    try:
        if address is not None:
            return dist.TCPStore(address[0], address[1], is_master=False, timeout=timedelta(seconds=timeout_s),
                                 wait_for_workers=False)
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        return store
    except Exception as e:  # noqa: BLE001 - an addition: without it a pulled slot is made when it is needed
        logger.debug("neighbor_ckpt: no launch store for slot capacities: %s", e)
        return None


class SlotCapacities:
    """The capacities (header, payload, extras bytes) of each rank's own slots in one store generation of a job, as
    its ranks published them. ``store``: :func:`open_launch_store`'s, made on first use (None: nothing is kept)."""

    def __init__(self, *, job_id: str, generation: int, store: Any = None, opener: Any = open_launch_store) -> None:
        self.prefix = f"neighbor_ckpt/{job_id}/g{generation}/own_slot"
        self._store = store
        self._opener = opener
        self._opened = store is not None

    def _client(self) -> Any | None:
        if not self._opened:
            self._opened = True
            self._store = self._opener()
        return self._store

    def key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def publish(self, rank: int, capacities: tuple[int, int, int]) -> bool:
        """Keep ``rank``'s own-slot capacities; returns whether they were stored."""
        store = self._client()
        if store is None:
            return False
        try:
            store.set(self.key(rank), json.dumps([int(c) for c in capacities]))
            return True
        except Exception as e:  # noqa: BLE001 - best effort (module docstring)
            logger.debug("rank %d: could not publish its slot capacities: %s", rank, e)
            return False

    def lookup(self, rank: int) -> tuple[int, int, int] | None:
        """The capacities ``rank`` published (None: none, unreadable, or no store)."""
        store = self._client()
        if store is None:
            return None
        try:
            if not store.check([self.key(rank)]):
                return None
            h, p, e = (int(v) for v in json.loads(store.get(self.key(rank))))
        except Exception as exc:  # noqa: BLE001 - best effort (module docstring)
            logger.debug("rank %d: no usable slot capacities in the launch store: %s", rank, exc)
            return None
        return (h, p, e) if min(h, p, e) >= 0 else None
