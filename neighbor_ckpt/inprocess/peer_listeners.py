"""The gloo listeners of a generation's members: published by each process, read by the others for their abort.

A survivor's abort (:mod:`neighbor_ckpt.inprocess.abort`) shuts down its own side of every connection of the failed
generation's groups, those to its peers' listeners included: a peer that is stopped or stuck never closes its side.
Each process publishes its listeners under ``gen/<g>/listen/<p>`` once its groups exist (again as groups appear: the
snapshot transport's at the first step). The peers' are read from the store at the abort and, until a few monitor
rounds after the first completed step, kept in memory: after a store failover the new store holds only what the
survivors wrote there again.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from neighbor_ckpt.inprocess import protocol
from neighbor_ckpt.inprocess.abort import format_endpoints, new_listeners, parse_endpoints
from neighbor_ckpt.inprocess.engine_state import EngineState

__all__ = ["PeerListeners", "READS_AFTER_PROGRESS"]

logger = logging.getLogger(__name__)

READS_AFTER_PROGRESS = 3
"""Monitor rounds after this process's first completed step of a generation in which it reads its peers' gloo
listeners again (they publish the last of them at their own first step)."""


class PeerListeners:
    """This process's listeners and its peers' (see the module docstring).

    Args:
        state: the engine's state (the generation, its members, whether the training thread is inside).
    """

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self.baseline: Any = None
        """The process's sockets before the current attempt (:class:`~neighbor_ckpt.inprocess.abort.SocketBaseline`):
        what is new since belongs to the attempt's groups. None before the first attempt."""
        self.mine: Optional[tuple[int, str]] = None
        """(generation, text) of what this process published last."""
        self._cache: dict[int, tuple[int, frozenset[Any]]] = {}

    def publish(self, store: Any) -> None:
        """This generation's gloo listeners, for the peers' aborts (``gen/<g>/listen/<p>``)."""
        att = self.state.current
        if self.baseline is None or att is None:
            return
        text = format_endpoints(new_listeners(self.baseline))
        self.mine = (att.iteration, text)
        try:
            store.set(protocol.key("gen", att.iteration, "listen", self.state.process), text)
        except Exception as e:  # noqa: BLE001 - the peers then free this process's connections later (the kill)
            logger.warning("%s: could not publish this generation's gloo listeners: %s", self.state.name(), e)

    def peers(self, generation: int, store: Any) -> frozenset[Any]:
        """The listeners the other members published for ``generation``, with those kept in memory by
        :meth:`remember` (the store they were published in may be lost)."""
        me = self.state.process
        keys = [protocol.key("gen", generation, "listen", q) for q in sorted(self.state.members) if q != me]
        present = [k for k in keys if store.check([k])]
        out: set[Any] = set(self._cache.get(generation, (0, frozenset()))[1])
        for raw in (store.multi_get(present) if present else []):
            out |= parse_endpoints(raw.decode(errors="replace") if isinstance(raw, bytes) else raw)
        return frozenset(out)

    def remember(self, store: Any) -> None:
        """Monitor thread, every round of an attempt until a few rounds after its first completed step: keep the
        peers' listeners of the current generation in memory (read again each round: a peer publishes more as its
        groups appear)."""
        g = self.state.generation
        reads, _ = self._cache.get(g, (0, frozenset()))
        if not self.state.inside or reads >= READS_AFTER_PROGRESS:
            return
        found = self.peers(g, store)
        self._cache[g] = (reads + (g in self.state.progressed), found)
