"""Who the others cannot reach, when every rank is stuck alike: the blame for a cut of the ranks' network.

When the ranks' connections between nodes are cut while the store stays reachable (a link of the data network down,
``fault_injection.traffic: ranks``), every rank blocks in the same collective, with the same progress tag, and keeps
beating: the hang detector finds no laggard (:func:`~neighbor_ckpt.inprocess.monitor.laggards`). Before it declares
``hang_all`` (the same ranks re-form, and meet the same cut), each stuck process probes its peers' gloo listeners
(``gen/<g>/listen/<p>``: a TCP connect, which the peer's kernel answers even when the peer is busy; gloo drops such a
connection), on threads of the monitor's own (its heartbeat goes on meanwhile), and reports whom it could not reach
(``gen/<g>/reach/<p>``). A process that more than half of the
generation's ranks cannot reach is blamed (:func:`unreachable_by_majority`, pure): declared dead and replaced, as a
lost node. The side cut off sees the same reports, so everyone reaches the same decision; two halves that cannot
reach each other blame nobody (no majority), and the generation fails with ``hang_all`` as before.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
from typing import Any, Iterable, Mapping, Optional

from neighbor_ckpt.inprocess.abort import Endpoint, parse_endpoints
from neighbor_ckpt.inprocess.protocol import key

__all__ = ["unreachable_by_majority", "probe", "format_report", "parse_report", "ReachProbe", "PROBE_THREAD"]

PROBE_THREAD = "neighbor_ckpt-inprocess-monitor.reach"
"""The probes' thread names: under the monitor's prefix, so the hygiene check counts them among the engine's own."""

_UNREACHABLE = {errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN}


def unreachable_by_majority(reports: Mapping[int, frozenset[int]], active: Iterable[int]) -> tuple[int, ...]:
    """The active processes that more than half of the active processes could not reach (pure). ``reports``:
    process -> the processes it could not reach (only the processes that reported). Empty until more than half of
    the active processes reported."""
    procs = sorted(set(active))
    if 2 * len([p for p in reports if p in procs]) <= len(procs):
        return ()
    counts = {p: sum(1 for q, lost in reports.items() if q in procs and q != p and p in lost) for p in procs}
    return tuple(p for p in procs if 2 * counts[p] > len(procs))


def probe(endpoints: Mapping[int, Iterable[Endpoint]], timeout_s: float) -> frozenset[int]:
    """The processes none of whose ``endpoints`` this process can connect to within ``timeout_s`` for a network
    reason (a timeout, no route). A refused connection is an answer: the peer's host is reachable. Every endpoint at
    once, so the whole probe takes ``timeout_s`` at most."""
    answered: set[int] = set()
    lock = threading.Lock()

    def one(p: int, ep: Endpoint) -> None:
        try:
            with socket.create_connection((ep.host, ep.port), timeout=timeout_s):
                pass
        except socket.timeout:
            return
        except OSError as e:
            if e.errno in _UNREACHABLE:
                return
        with lock:  # connected, refused, reset: the host answered
            answered.add(p)

    targets = {p: sorted(set(eps)) for p, eps in endpoints.items()}
    threads = [threading.Thread(target=one, args=(p, ep), name=f"{PROBE_THREAD}-{p}", daemon=True)
               for p, eps in targets.items() for ep in eps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4 + 1)
    return frozenset(p for p, eps in targets.items() if eps and p not in answered)


def _remote(host: str) -> bool:
    """Whether ``host`` names another host than this one's loopback (an unparsable name counts as remote)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return True
    return not (ip.is_loopback or ip.is_unspecified)


def format_report(lost: Iterable[int]) -> str:
    return ",".join(str(p) for p in sorted(lost)) or "-"


def parse_report(raw: bytes | str) -> frozenset[int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    return frozenset(int(p) for p in text.split(",") if p.strip().isdigit())


class ReachProbe:
    """A monitor's probe of one stalled generation: probe once, report, then read the others' reports each round.

    Args:
        store: the generation store's view (``gen/<g>/listen/<p>``, ``gen/<g>/reach/<p>``).
        process: this process.
        timeout_s: the connect timeout of a probe.
    """

    def __init__(self, store: Any, process: int, timeout_s: float) -> None:
        self.store, self.process, self.timeout_s = store, process, timeout_s
        self._started: Optional[int] = None
        self._reported: Optional[int] = None
        self._result: dict[int, frozenset[int]] = {}

    def _get(self, k: str) -> Optional[bytes]:
        return self.store.get(k) if self.store.check([k]) else None

    def blame(self, gen: int, active: Iterable[int]) -> tuple[tuple[int, ...], bool]:
        """Start this generation's probe (once; on a thread, this call does not wait for it), report its result
        once it is there (from the caller's thread: the store connection is the caller's); then the processes a
        majority cannot reach (empty: nobody, or not enough reports yet) and whether every active process reported."""
        procs = sorted(set(active))
        if self._started != gen:
            endpoints: dict[int, frozenset[Endpoint]] = {}
            for p in procs:
                raw = self._get(key("gen", gen, "listen", p)) if p != self.process else None
                if raw:
                    try:  # a loopback listener is reached from here on this host, not the peer's: not probed
                        endpoints[p] = frozenset(e for e in parse_endpoints(raw.decode()) if _remote(e.host))
                    except ValueError:
                        pass
            self._started = gen

            def run() -> None:
                self._result[gen] = probe(endpoints, self.timeout_s)

            threading.Thread(target=run, name=PROBE_THREAD, daemon=True).start()
        if self._reported != gen and gen in self._result:
            self.store.set(key("gen", gen, "reach", self.process), format_report(self._result.pop(gen)))
            self._reported = gen
        reports = {}
        for p in procs:
            raw = self._get(key("gen", gen, "reach", p))
            if raw is not None:
                reports[p] = parse_report(raw)
        return unreachable_by_majority(reports, procs), set(reports) >= set(procs)
