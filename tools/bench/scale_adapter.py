"""The scale harness's one binding to a control plane: today's, :mod:`neighbor_ckpt.inprocess`.

Everything the harness (:mod:`tools.bench.scale`, :mod:`tools.bench.scale_worker`) does to the control plane goes
through this module: the store hosts' command line, the clients of a simulated process, a group of simulated
processes, a node's launcher, the cold-start connections, the instrumentation of the store clients, what is real and
what is simulated, and where the code that grows with the job lives. A rebuilt control plane gets a module with the
same names (``ProcessClient``, ``PopulationGroup``, ``LauncherClient``, ``WatchClient``, ``gate_handshake``,
``launch_token``, ``HANDSHAKES_PER_PROCESS``, ``HANDSHAKES_PER_LAUNCHER``, ``instrument_clients``,
``count_tunnel_refusals``, ``store_host_command``, ``make_token_file``, ``timing``, ``fenced``, ``NAME``, ``REAL``,
``SIMULATED``, ``CONNECTIONS_TODAY``, ``code_refs``) and the harness runs again unchanged.

Private names of today's code used here (and nowhere else in the harness): ``Launcher._att``, ``_beat``,
``_reap``, ``_flush``, ``_watch_store``, ``_kill_listed``, ``_roll_call``, ``_grow_back``, ``_later``, ``_call``,
``_rendezvous``, ``_lease`` (its ``look`` and ``stop`` replaced per instance), ``_beats``, ``_beat_at`` and
``launcher._Attempt`` (a node's launcher is driven one tick at a time without child processes; its StoreSet's
``view`` is wrapped per instance to count its keys), and ``Monitor.round`` wrapped per instance (to count each
round's keys).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from tools.bench.scale_count import Counter, Tally, counting, measure

__all__ = ["NAME", "REAL", "SIMULATED", "CONNECTIONS_TODAY", "LaunchSpec", "ProcessClient", "PopulationGroup",
           "LauncherClient", "WatchClient", "gate_handshake", "launch_token", "HANDSHAKES_PER_PROCESS",
           "HANDSHAKES_PER_LAUNCHER", "instrument_clients", "count_tunnel_refusals",
           "store_host_command", "make_token_file", "code_refs", "node_name", "timing", "Handshake", "fenced"]

logger = logging.getLogger(__name__)

NAME = "neighbor_ckpt.inprocess"
"""The control plane this adapter drives."""

REAL = [
    "the primary store host process (python -m neighbor_ckpt.inprocess.store_host --token-file): its gate "
    "(store_auth.Gate: token handshake, handshake slots per peer user, one event-loop thread for every connection) "
    "and its sealed "
    "TCPStore (TCP-MD5 on loopback)",
    "the standby store hosts (the same command), up to 3, in the launch's store list",
    "the store token file (store_auth.new_token_file) and every client's tunnel (store_auth.Tunnel)",
    "every store client: stores.StoreSet / StoreView / BoundedClient (bounded operations, the second try, the "
    "failover with the launchers' votes, follow_newer)",
    "the generation barrier (generation.GenerationStore.join, its 10 ms polling) for every simulated process, and "
    "proc/<p>, ready, the assignment as the engine writes them",
    "the detector of the full-tier processes: monitor.Monitor rounds on a thread of their own (heartbeat, dead, "
    "failure, _look_at_majority feeding quorum.MajorityLease, _silent_peer with the node's launcher beat, the hang "
    "clock), monitor.FailureListener blocked on gen/<g>/failed, StoreSet.start_following",
    "Monitor.beat of the beat-tier processes (the victims), each on its own StoreSet",
    "one launcher.Launcher object per node, with its StoreSet (voter), LauncherLease, RollCall and "
    "RestartRendezvous: full-tier launchers run a whole tick (_reap, _flush, _beat with LauncherLease.look, "
    "_watch_store, _kill_listed, _roll_call, _grow_back) every poll_s; the others run _beat (lhb/<node>) every beat_s",
    "the kills: SIGKILL of the OS process hosting a node (its launcher and its 8 processes), SIGSTOP of the OS process "
    "hosting one process, SIGKILL of the primary store host",
]
"""What of today's control plane the harness runs as it is."""

SIMULATED = [
    "training processes: threads in a few worker OS processes; none trains, none has process groups (no torch "
    "pg/app store client, no gloo listeners, no reach probe)",
    "population processes (all but ~14 per size): their heartbeats hb/<p> are written in Monitor.beat's format, one "
    "multi_set per group of processes sharing one StoreSet per interval (the store sees the same keys, in fewer "
    "operations and connections); they do not read: their reads are those of a full-tier process, measured on the "
    "full tier and multiplied by the number of processes (the processes are symmetric)",
    "connections: a population group shares one StoreSet (a connection per role) for its processes; a full- or "
    "beat-tier process has its own, as today; the cold start is a burst of the handshakes every process (3) and "
    "every launcher (2) makes at its start, each as a tunnel makes it (store_auth.prove on a new connection, again "
    "after a backoff when the gate closes it unanswered), from threads of the workers (--cold-cap at once), held "
    "open until the wave is in",
    "the failure push of population processes (one FailureListener connection per process, idle in a wait) is not "
    "run; the engine's failover replay is not run (moves are recorded)",
    "launchers have no child processes (a process's exit is never reported by its launcher; a lost node is found by "
    "the monitors alone, as when a node dies whole); their lease guard threads are not started (an expired lease is "
    "counted, not acted on) and a cut-off is recorded instead of os._exit",
    "each worker OS process has one tunnel per store for all its simulated clients (today: one per training "
    "process); the cold start's burst does not go through the tunnels (a tunnel admits its connections one at a "
    "time, looking each up among its process's descriptors: with hundreds of simulated clients per OS process that "
    "is the harness's bottleneck, not the gate's)",
    "no spares: generation 1 (after the SIGSTOPped process is declared dead) forms with the survivors and no "
    "assignment is published for it",
]
"""What the harness simulates, and how."""

CONNECTIONS_TODAY = {
    "process": {"primary": ["main", "monitor", "listener (blocked in a wait)", "pg (torch's TCPStore client of the "
                            "generation's process groups)"],
                "standby 1": ["probe1 (StoreSet.follow_newer every 2 s)"]},
    "launcher": {"primary": ["launcher"], "standby 1": ["probe1 (StoreSet.follow_newer every 2 s)"]},
    "store host threads per connection": 0,
}
"""The store connections today's code holds, per process and per launcher (stores.py, store_clients.py, engine.py)."""

TAG = (1, 1, "step")
"""The progress tag every simulated process reports (a training thread inside a step; never stalls long enough for
``detector.hang_timeout_s``)."""


def node_name(index: int) -> str:
    return f"node{index}"


@dataclass(frozen=True)
class LaunchSpec:
    """One simulated launch (plain data: it travels to the workers as JSON)."""

    run_id: str
    stores: tuple[tuple[str, int], ...]
    token_file: str
    nodes: int
    per_node: int
    timeout_s: float
    interval_s: float

    @property
    def processes(self) -> int:
        return self.nodes * self.per_node

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "stores": [list(a) for a in self.stores], "token_file": self.token_file,
                "nodes": self.nodes, "per_node": self.per_node, "timeout_s": self.timeout_s,
                "interval_s": self.interval_s}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LaunchSpec":
        return cls(run_id=d["run_id"], stores=tuple((str(h), int(p)) for h, p in d["stores"]),
                   token_file=d["token_file"], nodes=int(d["nodes"]), per_node=int(d["per_node"]),
                   timeout_s=float(d["timeout_s"]), interval_s=float(d["interval_s"]))


# -- the coordinator's side ------------------------------------------------------------------------------------------

def store_host_command(port: int, ready: Path, token_file: Path) -> list[str]:
    """A store host of the launch (gate, sealed store), as a launcher starts one; it exits with this process (the
    coordinator), as a store host does with its launcher."""
    return [sys.executable, "-m", "neighbor_ckpt.inprocess.store_host", "--host", "127.0.0.1", "--port", str(port),
            "--parent", str(os.getpid()), "--ready", str(ready), "--token-file", str(token_file)]


def make_token_file(directory: Path) -> Path:
    """The launch's store token file in ``directory`` (mode 0600), as a launch makes it."""
    from neighbor_ckpt.inprocess.store_auth import TOKEN_FILE, new_token_file

    return new_token_file(directory / TOKEN_FILE)


def timing(spec: LaunchSpec) -> dict[str, float]:
    """The control plane's periods that follow from ``timeout_s`` and ``interval_s`` (for the document)."""
    from neighbor_ckpt.config import DetectorConfig
    from neighbor_ckpt.inprocess.launcher_plan import parse_args
    from neighbor_ckpt.inprocess.stores import FOLLOW_EVERY_S, store_timeout_for

    plan = parse_args(_launcher_argv(spec, 0))
    return {"store_timeout_s": store_timeout_for(spec.timeout_s), "launcher_beat_s": plan.beat_s,
            "launcher_poll_s": plan.poll_s, "follow_every_s": FOLLOW_EVERY_S,
            "hang_timeout_s": DetectorConfig().hang_timeout_s or 0.0, "join_poll_s": _join_poll_s()}


def _join_poll_s() -> float:
    from neighbor_ckpt.inprocess.generation import GenerationStore

    return float(inspect.signature(GenerationStore.join).parameters["poll_s"].default)


class WatchClient:
    """The harness's own look at the current store (not counted as any process's): who is declared dead, which
    generation failed how."""

    def __init__(self, spec: LaunchSpec) -> None:
        from neighbor_ckpt.inprocess.generation import GenerationStore
        from neighbor_ckpt.inprocess.protocol import launch_prefix
        from neighbor_ckpt.inprocess.store_auth import read_token
        from neighbor_ckpt.inprocess.stores import StoreAddresses, StoreSet, store_timeout_for

        self.stores = StoreSet(StoreAddresses(spec.stores), run_id=spec.run_id,
                               timeout_s=store_timeout_for(spec.timeout_s), connect_timeout_s=60.0,
                               name="scale harness", token=read_token(Path(spec.token_file)))
        self.gens = GenerationStore(self.stores.view("harness", launch_prefix(spec.run_id, 0)), process=-1)

    def dead(self) -> dict[int, str]:
        """The processes declared dead, with why."""
        return self.gens.dead()

    def failure(self, generation: int) -> Optional[dict[str, Any]]:
        """Why ``generation`` failed (the record that stands), None while it has not."""
        f = self.gens.failure(generation)
        return None if f is None else {"by": f.by, "kind": f.kind, "ranks": list(f.ranks), "unix": f.unix}

    def arrived(self, generation: int) -> int:
        """How many processes arrived at ``generation``'s barrier."""
        from neighbor_ckpt.inprocess.generation import parse_list
        from neighbor_ckpt.inprocess.protocol import key

        raw = self.gens.store.get(key("gen", generation, "arrived")) if self.gens.store.check(
            [key("gen", generation, "arrived")]) else None
        return len(set(parse_list(raw)))

    def settle(self, generation: int, members: list[int]) -> bool:
        """Write ``generation``'s outcome as its barrier would (first ``compare_set`` wins, then ``gen``): for a
        barrier that did not form within the harness's bound. False when the barrier's own outcome stood already."""
        from neighbor_ckpt.inprocess.generation import Members
        from neighbor_ckpt.inprocess.protocol import key

        mine = Members(generation=generation, members=frozenset(members), progressed=True, hangs=0).to_json()
        stood = self.gens.store.compare_set(key("gen", generation, "members"), "", mine)
        won = (stood.decode() if isinstance(stood, bytes) else stood) == mine
        if won:
            self.gens.store.set("gen", str(generation))
        return won

    def close(self) -> None:
        self.stores.settle()
        self.stores.close()


def code_refs() -> dict[str, str]:
    """``path:line`` of the code whose cost grows with the job, in the tree this run imports."""
    from neighbor_ckpt.inprocess import (generation, launcher, monitor, peer_listeners, quorum, reachability,
                                         store_auth, stores)

    targets = {
        "monitor._look_at_majority": monitor.Monitor._look_at_majority,
        "monitor._read": monitor.Monitor._read,
        "monitor._node_of": monitor.Monitor._node_of,
        "monitor._silent_peer": monitor.Monitor._silent_peer,
        "monitor._hang": monitor.Monitor._hang,
        "quorum.MajorityLease.observe": quorum.MajorityLease.observe,
        "quorum.LauncherLease.look": quorum.LauncherLease.look,
        "quorum.LauncherLease._rebase": quorum.LauncherLease._rebase,
        "generation.GenerationStore.join": generation.GenerationStore.join,
        "generation.GenerationStore.dead": generation.GenerationStore.dead,
        "peer_listeners.PeerListeners.peers": peer_listeners.PeerListeners.peers,
        "reachability.probe": reachability.probe,
        "launcher.Launcher._watch_store": launcher.Launcher._watch_store,
        "launcher.Launcher._beat": launcher.Launcher._beat,
        "stores.StoreSet.follow_newer": stores.StoreSet.follow_newer,
        "stores.StoreSet._promotion": stores.StoreSet._promotion,
        "store_auth.Gate._admit": store_auth.Gate._admit,
        "store_auth._splice": store_auth._splice,
        "store_auth.MAX_HANDSHAKES": None,
    }
    out: dict[str, str] = {}
    root = Path(monitor.__file__).resolve().parents[2]
    for name, fn in targets.items():
        if fn is None:
            path = Path(store_auth.__file__)
            line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.startswith("MAX_HANDSHAKES"))
        else:
            path, line = Path(inspect.getsourcefile(fn) or ""), inspect.getsourcelines(fn)[1]
        out[name] = f"{path.resolve().relative_to(root).as_posix()}:{line}"
    return out


# -- the workers' side: instrumentation ------------------------------------------------------------------------------

def instrument_clients(record: Callable[[tuple[str, int], str, int, int], None]) -> None:
    """Count every store operation this OS process completes, by store address: ``record(address, method, keys,
    bytes)`` (wraps :meth:`BoundedClient.call` in this process; the library is not edited)."""
    from neighbor_ckpt.inprocess.stores import BoundedClient

    original = BoundedClient.call

    def call(self: Any, method: str, *args: Any) -> Any:
        result = original(self, method, *args)
        keys, nbytes = measure(method, args, result)
        record(tuple(self.address), method, keys, nbytes)
        return result

    BoundedClient.call = call  # type: ignore[method-assign]


class _TunnelLog(logging.Handler):
    """Counts this process's tunnels' failed handshakes (a gate that closed the connection unanswered: its handshake
    slots were full) and failed connects."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.no_handshake = 0
        self.no_connect = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        if msg.startswith("store tunnel: %s:%d: no handshake"):
            self.no_handshake += 1
        elif msg == "store tunnel: %s:%d: %s":
            self.no_connect += 1


def count_tunnel_refusals() -> _TunnelLog:
    """A handler on today's tunnel logger that counts refused handshakes (``.no_handshake``) from now on."""
    log = logging.getLogger("neighbor_ckpt.inprocess.store_auth")
    handler = _TunnelLog()
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    for h in logging.getLogger().handlers:  # the root's handlers keep their own level (the debug lines stay out)
        if h.level == logging.NOTSET:
            h.setLevel(logging.DEBUG if os.environ.get("SCALE_DEBUG") else logging.INFO)
    return handler


# -- the workers' side: simulated processes --------------------------------------------------------------------------

def _identity(spec: LaunchSpec, process: int) -> Any:
    from neighbor_ckpt.inprocess.identity import ProcessIdentity
    from neighbor_ckpt.inprocess.stores import StoreAddresses

    return ProcessIdentity(process=process, processes=spec.processes, spares=0, stores=StoreAddresses(spec.stores),
                           run_id=spec.run_id, token_file=Path(spec.token_file),
                           node=node_name(process // spec.per_node))


def _configs(spec: LaunchSpec) -> tuple[Any, Any]:
    from neighbor_ckpt.config import DetectorConfig, InprocessConfig

    detector = DetectorConfig()
    detector.interval_s, detector.timeout_s = spec.interval_s, spec.timeout_s
    return detector, InprocessConfig()


def _open(spec: LaunchSpec, process: int) -> tuple[Any, Any]:
    """(identity, StoreSet) of a process, as the engine opens them (store_clients.open_stores)."""
    from neighbor_ckpt.inprocess.store_clients import open_stores

    identity = _identity(spec, process)
    detector, inprocess = _configs(spec)
    return identity, open_stores(identity, detector=detector, inprocess=inprocess)


def _view(stores: Any, role: str, prefix: str, counter: Counter) -> Any:
    from neighbor_ckpt.inprocess.stores import StoreView

    return StoreView(counting(lambda method, *args: stores.op(role, method, *args), counter), prefix)


def launch_token(spec: LaunchSpec) -> bytes:
    """The launch's token, read as a client reads it."""
    from neighbor_ckpt.inprocess.store_auth import read_token

    return read_token(Path(spec.token_file))


@dataclass
class Handshake:
    """One client's first connection to the primary's gate: the socket (None: never admitted within the bound), how
    often the gate closed it unanswered (its handshake slots were full), how often the handshake timed out, and how
    long it took until admitted."""

    sock: Optional[socket.socket]
    refused: int
    timeouts: int
    seconds: float


def gate_handshake(spec: LaunchSpec, token: bytes, *, within_s: float) -> Handshake:
    """A client's first connection to the primary's gate, as a process's tunnel makes it (``store_auth.prove`` on a
    new connection); a connection the gate closes unanswered or does not answer is made again after a short backoff
    (0.1 s, x1.5 each time, at most 1 s: torch's client connects again when its tunnel closes on it), until admitted
    or ``within_s`` passed. The socket is left open (the gate has spliced it to the store)."""
    import random

    from neighbor_ckpt.inprocess.store_auth import HANDSHAKE_TIMEOUT_S, prove
    from neighbor_ckpt.inprocess.store_handshake import Refused

    t0 = time.monotonic()
    refused = timeouts = 0
    backoff = 0.1
    while time.monotonic() - t0 < within_s:
        try:
            sock = socket.create_connection(spec.stores[0], timeout=HANDSHAKE_TIMEOUT_S)
        except OSError:
            refused += 1
        else:
            try:
                prove(sock, token)
                sock.settimeout(None)
                return Handshake(sock, refused, timeouts, time.monotonic() - t0)
            except Refused:
                sock.close()
                raise
            except socket.timeout:
                timeouts += 1
                sock.close()
            except OSError:
                refused += 1
                sock.close()
        time.sleep(backoff * random.uniform(0.5, 1.0))
        backoff = min(1.0, backoff * 1.5)
    return Handshake(None, refused, timeouts, time.monotonic() - t0)


HANDSHAKES_PER_PROCESS = 3
"""A process's connections to the primary at its start (main, monitor, listener; the process groups' torch client
comes later, at the first generation's groups)."""
HANDSHAKES_PER_LAUNCHER = 2
"""A launcher's at its start: ``roll_call.reach_any`` proves the token on a connection it closes, then its own
connection."""


@dataclass
class _State:
    """A simulated process's generation, as its engine would hold it."""

    generation: int = 0
    members: frozenset[int] = frozenset()
    ranks: Optional[dict[int, int]] = None

    def view(self) -> tuple[int, frozenset[int], Optional[dict[int, int]], bool]:
        return self.generation, self.members, self.ranks, True


@dataclass
class Round:
    """One detector round of a full-tier process: what it cost and when it ran."""

    tally: Tally
    start: float
    seconds: float


class ProcessClient:
    """One simulated process with its own StoreSet, as the engine opens it. ``full``: a real detector (Monitor thread,
    FailureListener, follower); else its Monitor only beats, every ``interval_s`` (the victims: the store sees them
    beat as processes do)."""

    def __init__(self, spec: LaunchSpec, process: int, *, full: bool) -> None:
        from neighbor_ckpt.inprocess.generation import GenerationStore

        self.spec, self.process, self.full = spec, process, full
        self.identity, self.stores = _open(spec, process)
        self.counter, self.main_counter = Counter(), Counter()
        """The detector thread's traffic, and the main thread's (barrier, records)."""
        self.main = GenerationStore(_view(self.stores, "main", self.identity.prefix, self.main_counter),
                                    process=process)
        self.gens = GenerationStore(_view(self.stores, "monitor", self.identity.prefix, self.counter),
                                    process=process)
        self.state = _State()
        self.rounds: list[Round] = []
        self.first_round: Optional[Round] = None
        self.cut_off_at: list[float] = []
        """When (unix) a round ended after which today's lease guard (quorum.LeaseGuard.check) would have cut this
        process off."""
        self.fenced_at: Optional[float] = None
        self.failures: list[dict[str, Any]] = []
        self.moves: list[float] = []
        self.stores.on_failover(lambda old, new, why: self.moves.append(time.time()))
        self.monitor: Any = None
        self._stop = threading.Event()

    @property
    def epoch(self) -> int:
        return int(self.stores.epoch)

    def identify(self) -> None:
        """What the engine writes before its first barrier: ``proc/<p>``, then ``ready``."""
        from neighbor_ckpt.inprocess.protocol import key

        self.main.store.set(key("proc", self.process), self.identity.record())
        self.main.announce_ready()

    def join(self, generation: int, expected: set[int], quorum_of: frozenset[int], timeout_s: float) -> float:
        """The real barrier; the engine's reads around it. Returns when this process had the outcome (unix); a
        process declared dead meanwhile raises (:func:`fenced` says so) and is closed, as the engine exits."""
        self.main.gave_up()
        try:
            members = self.main.join(generation, expected=expected, timeout_s=timeout_s, quorum_of=quorum_of)
        except BaseException as e:
            if fenced(e):
                self._fenced(0)
            raise
        _publish_assignment(self.main, generation, members.members, self.spec.processes, self.process)
        self.main.failure(generation)
        done = time.time()
        self.state.members, self.state.ranks = members.members, {p: p for p in members.members}
        self.state.generation = generation
        return done

    def watch(self) -> None:
        """Start the detector (full) or the beat (beat tier), once."""
        if self.monitor is not None:
            return
        from neighbor_ckpt.inprocess.generation import GenerationStore
        from neighbor_ckpt.inprocess.monitor import FailureListener, Monitor
        from neighbor_ckpt.inprocess.quorum import LeaseGuard, MajorityLease, cut_off_lease_s, guard_times

        detector, _ = _configs(self.spec)
        listener = FailureListener(GenerationStore(_view(self.stores, "listener", self.identity.prefix, Counter()),
                                                   process=self.process),
                                   on_failure=lambda f: self.failures.append({"generation": f.generation,
                                                                              "kind": f.kind, "unix": time.time()}),
                                   first=self.state.generation)
        lease = MajorityLease(cut_off_lease_s(detector.timeout_s, detector.interval_s), me=self.process,
                              now=time.monotonic())
        self.monitor = Monitor(self.gens, state=self.state.view, progress=lambda: TAG, listener=listener,
                               interval_s=detector.interval_s, timeout_s=detector.timeout_s,
                               hang_timeout_s=detector.hang_timeout_s, exit=self._fenced, stores=self.stores,
                               lease=lease)
        if not self.full:
            threading.Thread(target=self._beat_loop, name=f"scale-beat-{self.process}", daemon=True).start()
            return
        doubt_s, grace_s = guard_times(self.stores, detector.timeout_s)
        monitor = self.monitor
        guard = LeaseGuard(lease, answered_at=lambda: monitor.answered_at, epoch=lambda: self.stores.epoch,
                           name=f"process {self.process}", doubt_s=doubt_s, grace_s=grace_s,
                           lock=monitor.lease_lock)  # never started: asked after each round instead
        self._count_rounds(monitor, guard)
        listener.start()
        self.monitor.start()
        self.stores.start_following()

    def _count_rounds(self, monitor: Any, guard: Any) -> None:
        original = monitor.round

        def counted() -> None:
            before, start = self.counter.snapshot(), time.time()
            original()
            one = Round(self.counter.snapshot().minus(before), start, time.time() - start)
            if self.first_round is None:
                self.first_round = one
            else:
                self.rounds.append(one)
            if guard.check(time.monotonic()) is not None:
                self.cut_off_at.append(time.time())

        monitor.round = counted  # per instance: Monitor._run calls self.round()

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.spec.interval_s):
            try:
                self.monitor.beat()
            except Exception as e:  # noqa: BLE001 - the store moved or went away: the next beat tries again
                logger.debug("process %d: beat: %s", self.process, e)

    def _fenced(self, code: int) -> None:
        self.fenced_at = time.time()
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self.monitor is not None:
            self.monitor.stop()


def fenced(e: BaseException) -> bool:
    """Whether ``e`` says the process was declared dead (it exits, as the engine does)."""
    from neighbor_ckpt.inprocess.generation import Fenced

    return isinstance(e, Fenced)


def _publish_assignment(gens: Any, generation: int, members: frozenset[int], processes: int, me: int) -> None:
    """Generation 0's ranks, by its lowest member (as the engine does); none later (the harness has no spares)."""
    from neighbor_ckpt.inprocess.assignment import initial_assignment

    if generation == 0 and me == min(members):
        gens.publish_assignment(0, initial_assignment(processes, 0))


class PopulationGroup:
    """Simulated processes that share one StoreSet: each joins the real barrier through a GenerationStore of its own;
    their heartbeats are written together, one ``multi_set`` per interval, in ``Monitor.beat``'s format."""

    def __init__(self, spec: LaunchSpec, processes: list[int]) -> None:
        self.spec, self.processes = spec, list(processes)
        self.identity, self.stores = _open(spec, self.processes[0])
        self.counter = Counter()
        self.generation = 0
        self.live = set(self.processes)
        self._beat = 0
        self.beats = 0
        """Beats written (by the worker's beat loop)."""
        self.moves: list[float] = []
        self.lost: Optional[str] = None
        self.stores.on_failover(lambda old, new, why: self.moves.append(time.time()))

    @property
    def epoch(self) -> int:
        return int(self.stores.epoch)

    def _gens(self, process: int) -> Any:
        from neighbor_ckpt.inprocess.generation import GenerationStore

        return GenerationStore(_view(self.stores, "main", self.identity.prefix, self.counter), process=process)

    def identify(self, process: int) -> None:
        """``proc/<p>`` and ``ready`` of one of the group's processes, as the engine writes them."""
        from neighbor_ckpt.inprocess.protocol import key

        gens = self._gens(process)
        gens.store.set(key("proc", process), _identity(self.spec, process).record())
        gens.announce_ready()

    def join(self, process: int, generation: int, expected: set[int], quorum_of: frozenset[int],
             timeout_s: float) -> float:
        """One of the group's processes through the real barrier (its own GenerationStore, the group's
        connection); when it had the outcome (unix)."""
        gens = self._gens(process)
        gens.gave_up()
        try:
            members = gens.join(generation, expected=expected, timeout_s=timeout_s, quorum_of=quorum_of)
        except BaseException as e:
            if fenced(e):
                self.live.discard(process)  # it exits: it beats no more
            raise
        _publish_assignment(gens, generation, members.members, self.spec.processes, process)
        gens.failure(generation)
        self.generation = generation
        return time.time()

    def beat(self) -> None:
        """Every live process's heartbeat, in one operation."""
        from neighbor_ckpt.inprocess.protocol import key

        self._beat += 1
        procs = sorted(self.live)
        text = f"{self._beat} {self.generation} {TAG[0]} {TAG[1]} {TAG[2]}"
        view = _view(self.stores, "main", self.identity.prefix, self.counter)  # its joins' connection: no new one
        view.multi_set([key("hb", p) for p in procs], [text] * len(procs))


# -- the workers' side: launchers ------------------------------------------------------------------------------------

def _launcher_argv(spec: LaunchSpec, node: int) -> list[str]:
    return ["--store", ",".join(f"{h}:{p}" for h, p in spec.stores), "--run-id", spec.run_id,
            "--node", node_name(node), "--first", str(node * spec.per_node), "--count", str(spec.per_node),
            "--processes", str(spec.processes), "--nodes", str(spec.nodes), "--detector-timeout",
            str(spec.timeout_s), "--token-file", spec.token_file, "--", "simulated"]


@dataclass
class LauncherTallies:
    """A full-tier launcher's traffic: per tick without its beat, and per beat (set + lease look)."""

    ticks: list[tuple[float, Tally]] = field(default_factory=list)
    """(unix, tally) of each tick, its beat left out."""
    beats: list[tuple[float, Tally]] = field(default_factory=list)
    """(unix, tally) of each beat."""


class LauncherClient:
    """One node's real :class:`~neighbor_ckpt.inprocess.launcher.Launcher`, driven one tick at a time without child
    processes. ``full``: every tick of its loop; else only its beat (``lhb/<node>``, the lease look left out)."""

    def __init__(self, spec: LaunchSpec, node: int, *, full: bool) -> None:
        from neighbor_ckpt.inprocess import launcher as launcher_mod
        from neighbor_ckpt.inprocess.launcher_plan import parse_args
        from neighbor_ckpt.inprocess.stores import StoreView

        self.spec, self.node, self.full = spec, node, full
        self.plan = parse_args(_launcher_argv(spec, node))
        self.launcher = launcher_mod.Launcher(self.plan, env={})
        self.counter = Counter()
        self.tallies = LauncherTallies()
        self.cut_offs: list[str] = []
        self.moves: list[float] = []
        stores = self.launcher.stores
        counter = self.counter
        stores.view = lambda name, prefix: StoreView(  # type: ignore[method-assign]
            counting(lambda method, *args: stores.op(name, method, *args), counter), prefix)
        stores.on_failover(lambda old, new, why: self.moves.append(time.time()))
        self.launcher._lease.stop = self.cut_offs.append  # never os._exit in the harness: recorded
        if not full:
            self.launcher._lease.look = lambda *args, **kw: None
        self.att = launcher_mod._Attempt(number=0)
        self.launcher._att = self.att

    @property
    def epoch(self) -> int:
        return int(self.launcher.stores.epoch)

    @property
    def beat_s(self) -> float:
        return float(self.plan.beat_s)

    @property
    def poll_s(self) -> float:
        return float(self.plan.poll_s)

    def first_contact(self) -> None:
        """What ``Launcher.run`` does before its loop: reach a store (a connect and a handshake), then its first two
        operations on its own connection."""
        from neighbor_ckpt.inprocess.generation import parse_dead
        from neighbor_ckpt.inprocess.roll_call import reach_any

        L = self.launcher
        reach_any(self.plan.stores, self.plan.reach_s, token=L.stores.token)
        L._call(0, lambda s: s.check(["processes"]))
        L._call(0, lambda s: parse_dead(s.get("dead") if s.check(["dead"]) else None))

    def start(self) -> None:
        """The start of attempt 0 (``Launcher._run_attempt`` before its loop): ``processes``, ``nodes`` and this
        launcher's record (its processes are the node's simulated ones)."""
        from neighbor_ckpt.inprocess.protocol import key

        L, n = self.launcher, self.spec.processes
        L._later(0, lambda s: s.compare_set("processes", "", str(n)))
        L._rendezvous.announce(0)
        info = json.dumps({"pid": os.getpid(), "processes": list(self.plan.indices)})
        L._later(0, lambda s: s.set(key("launcher", self.plan.node), info))

    def tick(self) -> None:
        """One pass of the launcher's loop (full tier), its beat counted apart; or its beat alone."""
        L, att = self.launcher, self.att
        if not self.full:
            L._beat(0)
            return
        start, t0 = time.time(), self.counter.snapshot()
        L._reap(att)
        L._flush()
        b0, beats = self.counter.snapshot(), L._beats
        L._beat(0)
        b1 = self.counter.snapshot()
        L._watch_store(att)
        L._kill_listed(att)
        L._roll_call(att)
        L._grow_back(att)
        t1 = self.counter.snapshot()
        if L._beats > beats:
            self.tallies.beats.append((start, b1.minus(b0)))
        self.tallies.ticks.append((start, t1.minus(t0).minus(b1.minus(b0))))

    def next_in(self) -> float:
        """Seconds until this launcher's next tick is due."""
        if self.full:
            return self.poll_s
        return max(0.0, self.launcher._beat_at + self.beat_s - time.monotonic())
