"""What an in-process engine keeps and writes about itself apart from running generations: its gloo listeners and
its peers' (for the abort), what it writes again to a new store after a failover, and the slot a hot spare prepares
while it idles. A mixin of :class:`~neighbor_ckpt.inprocess.engine.InprocessRecovery` (its attributes are the
engine's), kept apart by concern."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.inprocess import protocol
from neighbor_ckpt.inprocess.generation import GenerationFailure, GenerationStore

__all__ = ["EngineMemory", "PEER_READS_AFTER_PROGRESS", "proc_info"]

logger = logging.getLogger("neighbor_ckpt.inprocess.engine")

PEER_READS_AFTER_PROGRESS = 3
"""Monitor rounds after this process's first completed step of a generation in which it reads its peers' gloo
listeners again (they publish the last of them at their own first step)."""


class EngineMemory:
    """The engine's listeners, failover re-registration and spare slot (see the module docstring)."""

    def _publish_listeners(self) -> None:
        """This generation's gloo listeners, for the peers' aborts (``gen/<g>/listen/<p>``)."""
        from neighbor_ckpt.inprocess.abort import format_endpoints, new_listeners

        if self._sockets is None or self.current is None:
            return
        text = format_endpoints(new_listeners(self._sockets))
        self._my_listeners = (self.current.iteration, text)
        try:
            self._store("main").set(protocol.key("gen", self.current.iteration, "listen", self.process), text)
        except Exception as e:  # noqa: BLE001 - the peers then free this process's connections later (the kill)
            logger.warning("%s: could not publish this generation's gloo listeners: %s", self._name(), e)

    def _peer_listeners(self, generation: int, store: Any = None) -> frozenset[Any]:
        """The gloo listeners the other members published for ``generation``, with those read earlier by
        :meth:`_remember_peer_listeners` (the store they were published in may be lost)."""
        from neighbor_ckpt.inprocess.abort import parse_endpoints

        if store is None:
            store = self._store("main" if threading.get_ident() == self._main_tid else "listener")
        keys = [protocol.key("gen", generation, "listen", q) for q in sorted(self._members) if q != self.process]
        present = [k for k in keys if store.check([k])]
        out: set[Any] = set(self._peer_cache.get(generation, (0, frozenset()))[1])
        for raw in (store.multi_get(present) if present else []):
            out |= parse_endpoints(raw.decode(errors="replace") if isinstance(raw, bytes) else raw)
        return frozenset(out)

    def _remember_peer_listeners(self) -> None:
        """Monitor thread, every round of an attempt until a few rounds after its first completed step: keep the
        peers' listeners of the current generation in memory, so that an abort after a store failover still reaches
        their side of each connection (the new store has only what the survivors wrote there again). Read again each
        round: a peer publishes more listeners as its groups appear (the snapshot transport's at its first step)."""
        g = self._generation
        reads, _ = self._peer_cache.get(g, (0, frozenset()))
        if not self._inside or reads >= PEER_READS_AFTER_PROGRESS:
            return
        store = self._store("monitor")
        found = self._peer_listeners(g, store)
        self._peer_cache[g] = (reads + (g in self._progressed), found)

    def _on_store_failover(self, old: int, new: int, why: str) -> None:
        """The store moved (:meth:`StoreSet.lost` or ``follow_newer``, on the thread that saw it): write again, from
        this process's memory, what the new store must know for the next generation to form (see
        :mod:`neighbor_ckpt.inprocess.stores`), record the current generation's failure (kind ``store``) unless it
        has one, and listen for failures on the new store (the old listener may be blocked on the lost one)."""
        self.event("store_failover")
        gens = GenerationStore(self._store("failover"), process=self.process)
        s = gens.store
        s.set(protocol.key("proc", self.process), proc_info())
        gens.announce_ready()
        dead: dict[int, str] = {}
        for g in (self._main_gens, self._monitor_gens, getattr(self._listener, "gens", None)):
            if g is not None:
                dead.update(g.seen_dead)
        if dead:
            s.append("dead", "".join(f"{p}:{r.replace(';', ',')};" for p, r in sorted(dead.items())))
        g = self._generation
        if self._members_record is not None:
            s.compare_set(protocol.key("gen", g, "members"), "", self._members_record.to_json())
        if self._assignment is not None:
            gens.publish_assignment(g, self._assignment)
        if g in self._progressed:
            gens.mark_progress(g)
        if gens.current() < g:
            s.set("gen", str(g))
        known = [f for f in self.failures if f.generation == g]
        if self._finished == g and self._assignment is not None:
            gens.finished(g, self._assignment.world_size)  # the job may be complete: the others write theirs too
        if known:
            s.compare_set(protocol.key("gen", g, "failed"), "", known[0].to_json())
        elif self._inside:
            # Only a rank still in the training function fails the generation: when every rank had returned (the
            # job done as the store went), their `finished` entries complete the job on the new store instead.
            record = GenerationFailure(generation=g, by=self._name(), kind="store", ranks=(), unix=time.time(),
                                       reason=f"{why}; the next generation forms on {self.store_list.describe(new)}")
            s.compare_set(protocol.key("gen", g, "failed"), "", record.to_json())
        if self._my_listeners is not None and self._my_listeners[0] == g:
            s.set(protocol.key("gen", g, "listen", self.process), self._my_listeners[1])
        if self._joining is not None:
            s.append(protocol.key("gen", self._joining, "arrived"), f"{self.process},")
        if self._listener is not None:
            self._listener = self._listener.successor(
                GenerationStore(self._store(f"listener{new}"), process=self.process))
            self._listener.start()

    def _prepare_spare_slot(self) -> None:
        """Once per process, on a thread of its own: wait until every active rank of the job has published its own
        slot's capacities (at its first snapshot, :class:`~neighbor_ckpt.runtime.launch_store.SlotCapacities`), then
        stage a slot as large as the largest (:func:`~neighbor_ckpt.snapshot.store.stage_own_slot`): an activated
        spare's pull then lands in memory already there instead of a file made during the recovery. Best effort;
        nothing when the snapshots are off."""
        cfg = self.snapshots
        if self._spare_slot_started or cfg is None or not cfg.enabled:
            return
        self._spare_slot_started = True
        threading.Thread(target=self._stage_spare_slot, args=(cfg,), name="neighbor_ckpt-spare-slot",
                         daemon=True).start()

    def _stage_spare_slot(self, cfg: NeighborCkptConfig) -> None:
        from neighbor_ckpt.runtime.launch_store import SlotCapacities, open_launch_store
        from neighbor_ckpt.snapshot.store import stage_own_slot

        try:
            job_id, root = cfg.resolved_job_id(), cfg.resolved_store_dir()
            # where the ranks publish: the launch's store below every prefix (the ranks reach it through their
            # default group's store; an idle spare has none)
            client = open_launch_store(timeout_s=30.0, fallback=self.stores.torch_address())
            if client is None:
                return
            caps = SlotCapacities(job_id=job_id, generation=0, store=client)
            found: dict[int, tuple[int, int, int]] = {}
            while self.current is None:  # idle: an activated spare stops looking (its checkpointer prepares)
                for r in range(self.active_world_size):
                    if r not in found:
                        got = caps.lookup(r)
                        if got is None:
                            break  # not every rank has snapshotted yet
                        found[r] = got
                if len(found) == self.active_world_size:
                    if self.current is None:  # the largest any rank needs: cut to the rank taken at activation
                        h, p, e = (max(c[i] for c in found.values()) for i in range(3))
                        stage_own_slot(root, job_id, header_cap=h, payload_cap=p, extras_cap=e)
                    return
                time.sleep(0.2)  # one store read per wait: for the next rank that has not published yet
        except Exception as e:  # noqa: BLE001 - best effort: the slot is then made at activation
            logger.info("%s: no slot prepared while idle: %s", self._name(), e)



def proc_info() -> str:
    from neighbor_ckpt.runtime.procs import process_start

    return json.dumps({"pid": os.getpid(), "node": os.environ.get("NEIGHBOR_CKPT_NODE_ID", socket.gethostname()),
                       "start": process_start(os.getpid())})
