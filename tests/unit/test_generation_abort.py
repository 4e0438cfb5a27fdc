"""A failed generation's abort in one process (:mod:`neighbor_ckpt.inprocess.generation_abort`): a training thread
blocked on the pair to a peer cut off by the network, whose listeners this process never read (they were published
only on the store it lost), is not freed by the scoped abort; the escalation frees it, so the process is not declared
dead. Plain sockets stand for the gloo pair (the abort only touches sockets opened since its baseline)."""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import pytest

from neighbor_ckpt.inprocess.abort import GenerationAborted, SocketBaseline, clear_pending
from neighbor_ckpt.inprocess.engine_state import EngineState
from neighbor_ckpt.inprocess.generation_abort import GenerationAbort
from neighbor_ckpt.inprocess.peer_listeners import PeerListeners
from neighbor_ckpt.inprocess.stores import StoreAddresses


class _NothingPublished:
    """The store this process moved to: the cut peer's listeners are not there."""

    def check(self, keys: list[str]) -> bool:
        return False


class _Clients:
    def __init__(self, live: tuple[str, int]) -> None:
        self.stores = type("Stores", (), {"addresses": StoreAddresses((("10.0.0.1", 1), live)), "epoch": 1})()

    def view(self, name: str) -> Any:
        return _NothingPublished()


def test_a_training_thread_blocked_on_a_cut_peer_is_freed_by_the_wide_abort_and_not_declared_dead(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    peer = socket.create_server(("127.0.0.1", 0))  # the cut peer's gloo listener (never published here)
    live = socket.create_server(("127.0.0.1", 0))  # the store this process moved to (store 1; store 0 lost)
    state = EngineState(process=3, generation=0, members=frozenset({0, 1, 2, 3}), inside=True)
    listeners = PeerListeners(state)
    listeners.baseline = SocketBaseline.capture()
    to_peer = socket.create_connection(peer.getsockname())
    accepted, _ = peer.accept()
    to_store = socket.create_connection(live.getsockname())
    store_side, _ = live.accept()
    aborts = GenerationAbort(state, listeners=listeners, clients=_Clients(live.getsockname()),  # type: ignore[arg-type]
                             store_ports=frozenset({1, live.getsockname()[1]}), abort_timeout_s=5.0,
                             stuck_after_s=60.0)
    deaths: list[Any] = []
    outcome: list[str] = []
    blocked = threading.Event()

    def train() -> None:
        aborts.main_tid = threading.get_ident()
        try:
            blocked.set()
            to_peer.recv(10)  # the collective's wait on the cut peer's pair: no byte, no FIN, no RST ever comes
            outcome.append("returned")
        except GenerationAborted:
            outcome.append("aborted")
        finally:
            state.inside = False
            clear_pending(threading.get_ident())

    t = threading.Thread(target=train, daemon=True)
    t.start()
    try:
        assert blocked.wait(60)
        aborts.free_training_thread(0, report_death=lambda *a, **k: deaths.append((a, k)))
        t.join(120)
        assert not t.is_alive() and outcome == ["aborted"] and deaths == [], (outcome, deaths)
        assert "shutting down every connection of the attempt" in caplog.text
        to_store.sendall(b"p")
        store_side.settimeout(5)
        assert store_side.recv(1) == b"p", "the live store's connection was shut down"
    finally:
        for s in (to_peer, accepted, to_store, store_side, peer, live):
            s.close()


def test_a_thread_left_after_the_finalisation_blocked_on_a_cut_peer_is_freed_by_the_hygiene_checks_reabort() -> None:
    """Campaign case 128: the training thread had left, but the snapshot stream's receive thread still waited on its
    ring predecessor, cut off by the network, over a connection whose listener this process never read. On 2c061fd
    the hygiene check's re-abort was the scoped one, which does not reach it, and the process was replaced; the
    re-abort after the finalisation is now the wide one (every connection of the attempt but the live stores')."""
    peer = socket.create_server(("127.0.0.1", 0))  # the predecessor's stream listener (never published)
    live = socket.create_server(("127.0.0.1", 0))
    state = EngineState(process=3, generation=0, members=frozenset({0, 1, 2, 3}), inside=False)
    listeners = PeerListeners(state)
    listeners.baseline = SocketBaseline.capture()
    to_peer = socket.create_connection(peer.getsockname())
    accepted, _ = peer.accept()
    to_store = socket.create_connection(live.getsockname())
    store_side, _ = live.accept()
    aborts = GenerationAbort(state, listeners=listeners, clients=_Clients(live.getsockname()),  # type: ignore[arg-type]
                             store_ports=frozenset({1, live.getsockname()[1]}), abort_timeout_s=5.0,
                             stuck_after_s=60.0)
    got: list[bytes] = []
    recv = threading.Thread(target=lambda: got.append(to_peer.recv(10)), name="neighbor_ckpt-recv", daemon=True)
    recv.start()
    aborts.abort_gloo(0)  # the scoped abort: the connection to an unknown listener stays
    recv.join(0.3)
    assert recv.is_alive()
    aborts.reabort_after_finalize(0)
    recv.join(10)
    assert not recv.is_alive() and got == [b""], "freed: the receive returned"
    to_store.sendall(b"x")
    assert store_side.recv(1) == b"x", "the live store's connection is kept"
    for s in (to_peer, accepted, to_store, store_side, peer, live):
        s.close()
