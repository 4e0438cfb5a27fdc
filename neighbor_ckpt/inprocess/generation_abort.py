"""Aborting a failed generation inside a live process: free the training thread, or declare the process dead.

When a generation fails, every active process shuts down the sockets of that generation's process groups (once per
generation: :mod:`neighbor_ckpt.inprocess.abort` does the socket work), which frees a training thread blocked in a
collective; a thread in Python code, or in a C call the sockets do not free, gets an exception raised into it. Still
inside a second later, the abort widens to every connection the attempt opened but the stores' (a wait on the pair to
a peer cut off by the network, whose listeners this process never read, is freed by nothing else: no RST comes). A
training thread still inside after that, or a clean-up that does not return, means the process cannot take part in
the next generation: it declares itself dead (one line saying where the thread is), its launcher kills it and a
spare takes its rank.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from neighbor_ckpt.inprocess.abort import GenerationAborted, abort_gloo, abort_nccl, interrupt_thread
from neighbor_ckpt.inprocess.engine_state import EngineState
from neighbor_ckpt.inprocess.generation import GenerationStore
from neighbor_ckpt.inprocess.peer_listeners import PeerListeners
from neighbor_ckpt.inprocess.store_auth import tunnel_ports
from neighbor_ckpt.inprocess.store_clients import StoreClients

__all__ = ["GenerationAbort", "REINTERRUPT_S", "ABORT_GRACE_S"]

logger = logging.getLogger(__name__)

REINTERRUPT_S = 1.0
"""How long the exception raised into the training thread may take to get it out of the training function before
it is raised again."""

ABORT_GRACE_S = 0.1
"""After the socket abort, how long the training thread may take to leave a freed collective on its own before an
exception is raised into it (a thread in Python code, or in a C call the sockets do not free)."""


class GenerationAbort:
    """One process's abort of its failed generations (see the module docstring).

    Args:
        state: the engine's state (whether the training thread is inside, in which generation; the events).
        listeners: this process's and its peers' gloo listeners.
        clients: the store views (``main``, ``listener``, ``stall``).
        store_ports: the launch's store ports (their connections stay up).
        abort_timeout_s: ``inprocess.abort_timeout_s`` (NCCL's abort, the clean-up's watch).
        stuck_after_s: how long the training thread may stay inside after the abort before the process declares
            itself dead (at least twice :data:`REINTERRUPT_S`, else ``detector.timeout_s``).
    """

    def __init__(self, state: EngineState, *, listeners: PeerListeners, clients: StoreClients,
                 store_ports: frozenset[int], abort_timeout_s: float, stuck_after_s: float) -> None:
        self.state, self.listeners, self.clients = state, listeners, clients
        self.store_ports, self.abort_timeout_s = store_ports, abort_timeout_s
        self.stuck_after_s = max(2 * REINTERRUPT_S, stuck_after_s)
        self.main_tid: Optional[int] = None
        """The training thread (the one that calls the training function)."""
        self._aborted: set[int] = set()

    def free_training_thread(self, generation: int, *, report_death: Callable[..., Any]) -> None:
        """Listener thread, ``generation`` failed while the training thread is inside: abort the generation's
        groups, then raise into the training thread until it leaves; still inside after :attr:`stuck_after_s`:
        ``report_death`` declares this process dead (the listener's own store connection)."""
        st = self.state
        self.abort(generation)
        deadline = time.monotonic() + ABORT_GRACE_S
        while st.inside and time.monotonic() < deadline:
            time.sleep(0.005)
        # Still inside: in Python code, or in a C call the sockets do not free. Raise into it; again only if a handler
        # of the training function swallowed it (a bare ``except BaseException``). Still inside after a round: the
        # escalation, every connection of the attempt (a wait on the pair to a peer cut off by the network, whose
        # listeners this process never read: no RST ever comes), before the process is declared dead.
        stuck_at = time.monotonic() + self.stuck_after_s
        rounds = 0
        while st.inside and generation == st.generation and self.main_tid is not None:
            if rounds == 1:
                logger.warning("%s: the training thread is still inside %.1f s after generation %d's abort: shutting "
                               "down every connection of the attempt but the live stores' (a peer cut off never "
                               "closes its side)", st.name(), REINTERRUPT_S, generation)
                self.abort_gloo(generation, wide=True)
            rounds += 1
            if time.monotonic() > stuck_at:
                reason = (f"{st.name()}: the training thread is still inside the training function "
                          f"{self.stuck_after_s:g} s after generation {generation}'s abort (stuck in a C call)")
                logger.error("%s: declaring this process dead; its launcher replaces it; where it is: %s", reason,
                             self.where(self.main_tid))
                report_death((st.process,), kind="hung", reason=reason)
                return
            interrupt_thread(self.main_tid, GenerationAborted)
            deadline = time.monotonic() + REINTERRUPT_S
            while st.inside and time.monotonic() < deadline:
                time.sleep(0.01)

    def where(self, thread_id: int) -> str:
        """Where a stuck thread is (its innermost Python frames) and the attempt's connections still in the process's
        fd table: what an operator needs to tell a collective from a store wait."""
        frame = sys._current_frames().get(thread_id)
        stack = " <- ".join(f"{f.name} ({Path(f.filename).name}:{f.lineno})"
                            for f in reversed(traceback.extract_stack(frame)[-6:])) if frame else "gone"
        base = self.listeners.baseline
        left = [] if base is None else [f"{s.laddr.host}:{s.laddr.port}->{s.raddr.host}:{s.raddr.port}"
                                        for s in base.new() if not s.listening and s.laddr and s.raddr]
        return f"{stack}; connections of the attempt in its fd table: {', '.join(left) or 'none'}"

    def cleanup_stuck(self, generation: int) -> None:
        """The failed attempt's abort and clean-up have not returned after ``inprocess.abort_timeout_s`` (a thread
        that blocks the clean-up on a connection the abort did not reach): this process declares itself dead, so the
        next generation forms without it (a spare takes its rank) instead of waiting for it until
        ``inprocess.barrier_timeout_s`` ends the job. Its launcher kills it. On the watching thread, with a store
        connection of its own (the others may be inside a blocking wait)."""
        st = self.state
        reason = (f"{st.name()}: the clean-up of generation {generation} has not returned after "
                  f"{self.abort_timeout_s:g} s (inprocess.abort_timeout_s)")
        logger.error("%s: declaring this process dead; its launcher replaces it", reason)
        try:
            GenerationStore(self.clients.view("stall"), process=st.process).report_death(
                (st.process,), kind="hung", reason=reason)
        except Exception as e:  # noqa: BLE001 - the barrier timeout then ends the job, as before
            logger.error("%s: could not declare this process dead: %s", st.name(), e)

    def reabort_after_finalize(self, generation: int) -> None:
        """A thread of the failed ``generation`` still runs after its groups were destroyed (the hygiene check's
        second look): the wide abort, every connection of the attempt but the live stores'. Its groups are gone, so
        nothing of the next generation rides on them; a thread blocked on a peer cut off by the network (no RST ever
        comes), on a connection whose listener this process never read (the snapshot stream's group: its receive
        thread waits on the ring predecessor) is freed only so. The campaign's case 128 saw such a thread make the
        hygiene check replace a healthy process."""
        self.abort_gloo(generation, wide=True)

    def abort(self, generation: int) -> None:
        """Shut down the sockets of this generation's process groups (once per generation)."""
        with self.state.lock:
            if generation in self._aborted:
                return
            self._aborted.add(generation)
        self.state.event("abort_start")
        try:
            self.abort_gloo(generation)
            abort_nccl(timeout_s=self.abort_timeout_s)
        except Exception as e:  # noqa: BLE001 - the finalisation destroys the groups anyway
            logger.warning("%s: abort of generation %d: %s: %s", self.state.name(), generation, type(e).__name__, e)
        self.state.event("abort_end")

    def abort_gloo(self, generation: int, *, wide: bool = False) -> None:
        """Shut down this process's side of ``generation``'s gloo connections: those it accepted, and those to the
        peers' listeners it knows (read again each time: a peer that moved to a new store late publishes late);
        ``wide``: every connection the attempt opened but those of the current store and the later ones
        (:func:`~neighbor_ckpt.inprocess.abort.abort_gloo`): a store this process moved away from is lost to it, and
        a thread blocked on it (a group's rendezvous on a store cut off) is freed too."""
        if self.listeners.baseline is None:
            return
        try:
            store = self.clients.view("main" if threading.get_ident() == self.main_tid else "listener")
            peers = self.listeners.peers(generation, store)
        except Exception as e:  # noqa: BLE001 - our accepted side is still closed; the kill does the rest
            logger.warning("%s: peers' listeners unreadable: %s", self.state.name(), e)
            peers = frozenset()
        keep = set(self.store_ports) | tunnel_ports()
        if wide:
            stores = self.clients.stores
            live = [stores.addresses[k] for k in range(stores.epoch, len(stores.addresses))]
            keep = {p for _, p in live} | tunnel_ports(live)
        abort_gloo(self.listeners.baseline, keep_ports=keep, peer_listeners=peers, wide=wide)
