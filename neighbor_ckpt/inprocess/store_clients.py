"""One process's clients of the launch's store: one bounded view per thread that may block, and torch's own clients
for what torch drives.

Every key of a launch lives under its prefix (:func:`~neighbor_ckpt.inprocess.protocol.launch_prefix`). The engine's
threads (``main``, ``monitor``, ``listener``, ``stall``, ``failover``) each get a view of
:class:`~neighbor_ckpt.inprocess.stores.StoreSet` of their own (every operation bounded and failed over: one thread
blocked on a lost store never holds another's connection). The process groups' rendezvous and the application's keys
go through torch's ``TCPStore`` instead, on the current store: a new client after every failover.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from neighbor_ckpt.config import DetectorConfig, InprocessConfig
from neighbor_ckpt.inprocess.identity import ProcessIdentity
from neighbor_ckpt.inprocess.store_auth import read_token
from neighbor_ckpt.inprocess.stores import StoreSet, store_timeout_for

__all__ = ["StoreClients", "open_stores"]


class StoreClients:
    """The views and torch clients of one process (see the module docstring).

    Args:
        stores: the launch's stores and their failover.
        prefix: the launch's key prefix.
        connect_timeout_s: how long a torch client waits for a key it reads (``inprocess.barrier_timeout_s``: a
            process group's rendezvous waits for its slowest member).
    """

    def __init__(self, stores: StoreSet, *, prefix: str, connect_timeout_s: float) -> None:
        self.stores, self.prefix, self.connect_timeout_s = stores, prefix, connect_timeout_s
        self._views: dict[str, Any] = {}
        self._raw: dict[tuple[str, int], Any] = {}

    def view(self, name: str) -> Any:
        """The bounded, failed-over view for thread ``name``, under the launch prefix (made once)."""
        if name not in self._views:
            self._views[name] = self.stores.view(name, self.prefix)
        return self._views[name]

    def torch_client(self, name: str) -> Any:
        """A torch store client of the current store under the launch prefix (a new one after a failover)."""
        key = (name, self.stores.epoch)
        if key not in self._raw:
            host, port = self.stores.torch_address()
            base = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, use_libuv=True,
                                 timeout=timedelta(seconds=self.connect_timeout_s))
            self._raw[key] = dist.PrefixStore(self.prefix, base)
        return self._raw[key]


def open_stores(identity: ProcessIdentity, *, detector: DetectorConfig, inprocess: InprocessConfig) -> StoreSet:
    """The launch's stores for process ``identity``: an operation unanswered for
    :func:`~neighbor_ckpt.inprocess.stores.store_timeout_for` ``detector.timeout_s`` (the launchers' rule too) loses
    its store; the first connection may wait ``inprocess.barrier_timeout_s``
    (the primary may still be starting). Connects nothing yet."""
    return StoreSet(identity.stores, run_id=identity.run_id, epoch=identity.store_epoch,
                    timeout_s=store_timeout_for(detector.timeout_s),
                    connect_timeout_s=inprocess.barrier_timeout_s, name=f"process {identity.process}",
                    token=read_token(identity.token_file) if identity.token_file is not None else None)
