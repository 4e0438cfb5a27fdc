"""The transport kinds: ``neighbor_ckpt.transport.kind`` -> the factory that builds that kind's
:class:`~neighbor_ckpt.snapshot.transport.NeighborTransport` (:func:`make_transport`).

The interface (:mod:`neighbor_ckpt.snapshot.transport`) knows no kind; each kind's module knows the interface only;
this module knows both, so nothing imports in a circle. The kinds shipped here are in
:mod:`neighbor_ckpt.snapshot.gloo_transport`. A new kind is registered with :func:`register_transport`, added to
:data:`neighbor_ckpt.config.TRANSPORT_KINDS` (the configuration names the kinds it accepts without importing this
layer) and passes the contract test (``tests/multiproc/test_transport_contract.py``), which runs for every kind
:func:`transport_kinds` lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch.distributed as dist

from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.snapshot.gloo_transport import make_gloo_split_transport, make_gloo_transport
from neighbor_ckpt.snapshot.store import HostStore
from neighbor_ckpt.snapshot.topology import Topology
from neighbor_ckpt.snapshot.transport import NeighborTransport, TrafficGate

if TYPE_CHECKING:
    from neighbor_ckpt.config import TransportConfig

__all__ = ["TransportFactory", "make_transport", "register_transport", "transport_kinds"]


class TransportFactory(Protocol):
    """Builds one kind's transport from :func:`make_transport`'s arguments."""

    def __call__(self, config: TransportConfig, *, topology: Topology, store: HostStore, group: dist.ProcessGroup,
                 gate: TrafficGate | None, on_replica: Callable[[int], None] | None) -> NeighborTransport: ...


_FACTORIES: dict[str, TransportFactory] = {
    "gloo": make_gloo_transport,
    "gloo_split": make_gloo_split_transport,
}


def register_transport(kind: str, factory: TransportFactory) -> None:
    """Register the factory of transport ``kind`` (see the module docstring for what else a kind needs)."""
    _FACTORIES[kind] = factory


def transport_kinds() -> tuple[str, ...]:
    """The registered kinds, sorted."""
    return tuple(sorted(_FACTORIES))


def make_transport(config: TransportConfig, *, topology: Topology, store: HostStore, group: dist.ProcessGroup,
                   gate: TrafficGate | None = None, on_replica: Callable[[int], None] | None = None
                   ) -> NeighborTransport:
    """The transport of kind ``config.kind`` over ``group`` (collective when the kind builds groups of its own: call
    it on every rank at the same point).

    Raises:
        ConfigError: the kind is not registered (the message names the known kinds).
    """
    factory = _FACTORIES.get(config.kind)
    if factory is None:
        raise ConfigError(f"neighbor_ckpt.transport.kind: {config.kind!r} is not a known transport "
                          f"(known kinds: {', '.join(map(repr, transport_kinds()))})")
    return factory(config, topology=topology, store=store, group=group, gate=gate, on_replica=on_replica)
