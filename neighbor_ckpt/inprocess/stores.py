"""The launch's stores: one per node (the first is the primary, the others hot standbys), and the failover between
them.

Every launcher runs a store host on its node (:mod:`neighbor_ckpt.inprocess.store_host`, a child of the launcher
that dies with it); every process and launcher holds the ordered list of their addresses
(:data:`~neighbor_ckpt.inprocess.protocol.ENV_STORE`, ``host:port,host:port,...``). The list index is the store
*epoch*: everyone starts on store 0, and an epoch only ever increases.

**Failover.** An operation that does not answer (a refused or reset connection: the node is gone; or no reply
within ``timeout_s``: the host is stopped or cut off) is tried once more on a new connection; when that fails too,
the store is lost for this client. A *launcher* (a voter: ``voter``, one of ``voters`` nodes) then votes to promote
the next store of the list that answers (``vote/<k>`` there, :func:`vote_key`); the vote that makes a majority of
the nodes promotes it (``compare_set`` of :func:`epoch_key` to its index), so at most one side of a partition can
promote a store. A launcher that sees no majority within :attr:`StoreSet.promotion_wait_s`, and a *process* (which
never promotes) that finds no promoted store within it, raise :class:`NoPromotedStore`: the client is cut off from
the majority (:mod:`~neighbor_ckpt.inprocess.quorum`). A client that moves hands the change to its ``on_failover``
callbacks, which write again what the new store must know (the engine: generation, membership, progress; a
launcher: its processes and counters; facts only, never a suspicion: see
:mod:`~neighbor_ckpt.inprocess.failover_replay`) and record the current generation's failure (kind ``store``).

**Fencing.** A client follows the highest promoted store it can see: :meth:`StoreSet.follow_newer` (on a thread of
its own in every process and launcher, every :data:`FOLLOW_EVERY_S`) looks at the next stores of the list and moves
to one that was promoted, so a client that was stopped, or cut off, while the others moved on never acts on the
stale store again; a launcher whose own store host lost its epoch stops it. Nothing is ever moved back to a lower epoch.

**Bounded operations.** torch's TCPStore client does not apply its timeout to a connection the server accepted but
never answers (a SIGSTOPped host: the kernel completes the handshake): ``check``, ``get`` and even the constructor
block until the host resumes (measured on torch 2.13). Every operation of :class:`BoundedClient` therefore runs on
the client's own worker thread and is waited for at most ``timeout_s``; a client whose operation did not return is
abandoned with its thread (daemon, named ``neighbor_ckpt-store-client``, blocked until the host resumes or its
connection is reset).

**Writes are idempotent.** An operation whose reply did not come may have been applied (only the reply was lost), and
it is sent again: once more on a new connection, or on the next store, where the failover callbacks have written the
same facts again meanwhile. So no write through a :class:`StoreSet` may count twice when applied twice: the engine's
lists are sets of process ids (``dead``, ``ready``, ``arrived``, ``finished``), first-``compare_set``-wins records, or
plain ``set``; the launchers' counts are sets or claims by a write id (:mod:`~neighbor_ckpt.inprocess.launch_counts`);
``add`` is only ever used to read (``add(key, 0)``).

**Exiting.** A daemon thread that comes back from torch's client while the interpreter finalizes is ended inside a
C++ frame that may not be unwound: ``terminate called without an active exception``, SIGABRT (reproduced here: a
client whose connection attempt times out ~0.1 s after ``sys.exit`` aborts the process one time in five; CI saw a
launcher end with -6 so). A replaced or abandoned client is therefore *retired* (its worker ends after the operation
in flight), and :func:`quiesce` waits, bounded, until no worker is inside torch's client any more; whoever owns
the process's exit (the launcher's ``main``) leaves through :func:`leave`: ``os._exit`` when one still is (a host
stopped for good).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional, Sequence

from neighbor_ckpt.errors import ConfigError, NeighborCkptError

__all__ = ["StoreAddresses", "StoreUnreachable", "StoresLost", "NoPromotedStore", "BoundedClient", "StoreSet",
           "StoreView", "epoch_key", "vote_key", "quiesce", "leave", "store_timeout_for", "CLIENT_THREAD",
           "STORE_TIMEOUT_MIN_S"]

logger = logging.getLogger(__name__)

CLIENT_THREAD = "neighbor_ckpt-store-client"
"""The name (prefix) of a :class:`BoundedClient`'s worker thread (and of the follower,
:meth:`StoreSet.start_following`)."""

FOLLOW_EVERY_S = 2.0
"""How often a process or launcher looks whether a store after its own was promoted (fencing after a failover)."""


STORE_TIMEOUT_MIN_S = 3.0
"""The store timeout's floor (:func:`store_timeout_for`): a store operation on a loaded machine can take a second."""


def store_timeout_for(detector_timeout_s: float) -> float:
    """How long a store operation may go unanswered before the store counts as lost, for a job whose
    ``detector.timeout_s`` is ``detector_timeout_s``: twice it, at least :data:`STORE_TIMEOUT_MIN_S`. The processes'
    engine and the launchers use this one rule, so a stall one of them sees is never shorter than what the others
    allow (docs/timeouts.md)."""
    return max(2.0 * detector_timeout_s, STORE_TIMEOUT_MIN_S)


_LIVE: "set[BoundedClient]" = set()
"""Every client whose worker thread still runs (guarded by ``_LIVE_LOCK``)."""
_LIVE_LOCK = threading.Lock()


def quiesce(timeout_s: float, clients: Optional[Sequence["BoundedClient"]] = None) -> list[str]:
    """Retire ``clients`` (default: every client of this process) and wait, at most ``timeout_s``, until none of
    their workers is inside torch's client (a ``wait`` with no bound, the failure listener's, is not waited for).
    Returns what is still inside (``"<thread> (<method>)"``): the caller must then not let the interpreter finalize
    (module docstring)."""
    end = time.monotonic() + timeout_s
    if clients is None:
        with _LIVE_LOCK:
            clients = list(_LIVE)
    for c in clients:
        c.retire()
    while True:
        busy = [c.busy_with() for c in clients]
        busy = [b for b in busy if b is not None]
        if not busy or time.monotonic() >= end:
            return busy
        time.sleep(0.05)


def leave(code: int) -> int:
    """``code``, for the process to exit with normally, when no worker of this process is inside torch's client
    (:func:`quiesce` at once: the clients were closed already); else flush the log and the standard streams and
    leave now with ``os._exit(code)``, without finalizing the interpreter (see *Exiting* in the module docstring)."""
    inside = quiesce(0.0)
    if not inside:
        return code
    logger.warning("exiting %d without finalizing the interpreter: %s still inside torch's store client (a store "
                   "host that does not answer)", code, ", ".join(inside))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StoreUnreachable(NeighborCkptError):
    """One store did not answer (refused, reset, or no reply within the timeout)."""


class StoresLost(NeighborCkptError):
    """No store of the list answers: the job cannot go on in process."""


class NoPromotedStore(StoresLost):
    """The store was lost and no store of the list was promoted by a majority of the launchers in time: this client
    is cut off from the majority."""


def vote_key(run_id: str, index: int) -> str:
    """The launchers' votes to promote store ``index`` (``"<node>,"`` each), on that store, beside the epoch key."""
    return f"neighbor_ckpt/inprocess/{run_id}/vote/{index}"


def epoch_key(run_id: str) -> str:
    """The key a store is promoted with (its own index as value), outside every launch attempt's prefix."""
    return f"neighbor_ckpt/inprocess/{run_id}/epoch"


@dataclass(frozen=True)
class StoreAddresses:
    """The ordered store list of a launch (pure)."""

    addresses: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        if not self.addresses:
            raise ConfigError("in-process recovery: the store list is empty")

    @classmethod
    def parse(cls, text: str, what: str) -> "StoreAddresses":
        """``host:port[,host:port...]`` (IPv6 hosts in brackets or bare, the port after the last colon);
        ConfigError naming ``what``."""
        out = []
        for part in (p.strip() for p in text.split(",")):
            host, sep, port = part.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(f"in-process recovery: {what} is {text!r}, not HOST:PORT[,HOST:PORT...]")
            out.append((host.strip("[]"), int(port)))
        return cls(tuple(out))

    def format(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.addresses)

    def __len__(self) -> int:
        return len(self.addresses)

    def __getitem__(self, index: int) -> tuple[str, int]:
        return self.addresses[index]

    def describe(self, index: int) -> str:
        host, port = self.addresses[index]
        return f"store {index} ({host}:{port})"


class BoundedClient:
    """A TCPStore client whose every operation returns, or raises :class:`StoreUnreachable`, within ``timeout_s``
    (see the module docstring). Keys are raw (no prefix). Thread-safe: operations are serialised on its worker."""

    def __init__(self, address: tuple[str, int], *, timeout_s: float, connect_timeout_s: Optional[float] = None,
                 name: str = "", token: Optional[bytes] = None) -> None:
        self.address, self.timeout_s, self.token = address, timeout_s, token
        self.connect_timeout_s = connect_timeout_s if connect_timeout_s is not None else timeout_s
        self.broken: Optional[str] = None
        self._store: Any = None
        self._jobs: "queue.Queue[Optional[tuple[str, Callable[[], Any], list[Any], threading.Event]]]" = queue.Queue()
        self._lock = threading.Lock()
        self._in: Optional[str] = None
        """The method the worker is running now (None: idle)."""
        self._thread = threading.Thread(target=self._work, name=f"{CLIENT_THREAD}-{name}", daemon=True)
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._thread.start()

    def _work(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                method, fn, box, done = job
                self._in = method
                try:
                    box.append((True, fn()))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    box.append((False, e))
                finally:
                    self._in = None
                done.set()
        finally:
            self._store = None  # torch's client is destroyed here, on this thread, not at the interpreter's exit
            with _LIVE_LOCK:
                _LIVE.discard(self)

    def retire(self) -> None:
        """No more operations: the worker ends after the one in flight (if any). Idempotent."""
        self.broken = self.broken or "retired"
        self._jobs.put(None)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def busy_with(self) -> Optional[str]:
        """``"<thread> (<method>)"`` while the worker is inside torch's client (not counting an unbounded ``wait``),
        else None."""
        method = self._in
        if method is None or method == "wait" or not self.alive():
            return None
        return f"{self._thread.name} ({method})"

    def _connect(self) -> Any:
        import torch.distributed as dist

        from neighbor_ckpt.inprocess.store_auth import tunnel_address

        host, port = tunnel_address(self.address, self.token)
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              use_libuv=True, timeout=timedelta(seconds=self.connect_timeout_s))
        store.set_timeout(timedelta(seconds=self.timeout_s))
        return store

    def call(self, method: str, *args: Any) -> Any:
        if self.broken is not None:
            raise StoreUnreachable(self.broken)

        def run() -> Any:
            if self._store is None:
                self._store = self._connect()
            return getattr(self._store, method)(*args)

        box: list[Any] = []
        done = threading.Event()
        limit = self.timeout_s if self._store is not None else self.connect_timeout_s + self.timeout_s
        if method == "wait":
            limit = float("inf")
        with self._lock:
            # busy from now on, not only once the worker runs it: a worker that a loaded machine has not scheduled
            # yet when the caller gives up would otherwise enter torch's client during the interpreter's exit
            self._in = method
            self._jobs.put((method, run, box, done))
            done.wait(None if limit == float("inf") else limit)
        if not box:
            self.broken = f"{self.address[0]}:{self.address[1]}: no answer to {method} within {limit:g} s"
            self.retire()
            raise StoreUnreachable(self.broken)
        ok, value = box[0]
        if ok:
            return value
        if _key_timeout(value):  # the store answered: the key is not there (a `get` that waited for it)
            raise value
        if isinstance(value, RuntimeError):  # torch's DistNetworkError / DistStoreError: the store is not there
            first = str(value).splitlines()[0] if str(value) else type(value).__name__
            self.broken = f"{self.address[0]}:{self.address[1]}: {first}"
            self.retire()
            raise StoreUnreachable(self.broken) from None
        raise value


def _key_timeout(e: BaseException) -> bool:
    """torch's answer to a ``get`` or ``wait`` whose key did not appear in time (the store itself answered)."""
    import torch.distributed as dist

    return isinstance(e, dist.DistStoreError) and "wait timeout" in str(e)


class StoreView:
    """The store operations :class:`~neighbor_ckpt.inprocess.generation.GenerationStore` and the launcher use
    (``get``, ``set``, ``check``, ``compare_set``, ``add``, ``append``, ``multi_get``, ``multi_set``,
    ``delete_key``, ``wait``), with every key under ``prefix``, each sent through ``op(method, *args)``."""

    def __init__(self, op: Callable[..., Any], prefix: str) -> None:
        self._op, self.prefix = op, (prefix.rstrip("/") + "/" if prefix else "")

    def _k(self, key: str) -> str:
        return self.prefix + key

    def get(self, key: str) -> bytes:
        return self._op("get", self._k(key))

    def set(self, key: str, value: str | bytes) -> None:
        self._op("set", self._k(key), value)

    def check(self, keys: Sequence[str]) -> bool:
        return self._op("check", [self._k(k) for k in keys])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._op("compare_set", self._k(key), expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self._op("add", self._k(key), amount)

    def append(self, key: str, value: str | bytes) -> None:
        self._op("append", self._k(key), value)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._op("multi_get", [self._k(k) for k in keys])

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._op("multi_set", [self._k(k) for k in keys], list(values))

    def delete_key(self, key: str) -> bool:
        return self._op("delete_key", self._k(key))

    def wait(self, keys: Sequence[str], timeout: timedelta) -> None:
        self._op("wait", [self._k(k) for k in keys], timeout)


class StoreSet:
    """One process's (or launcher's) clients of the launch's stores, on the current epoch (see the module docstring).

    Args:
        addresses: the store list.
        run_id: the launch's run id (the epoch key).
        epoch: the store to start on (a replacement started after a failover gets its launcher's).
        timeout_s: how long an operation may go unanswered before the store counts as lost.
        connect_timeout_s: patience for the first connection of this process (the primary may still be starting).
        name: who this is, for the log (``process 3``, ``launcher:node1``).
        token: the launch's store token (:mod:`~neighbor_ckpt.inprocess.store_auth`; None: the stores have no
            gate).
        voter: this launcher's node (it votes to promote a store); None: a process (it never promotes).
        voters: how many nodes (launchers) vote: a promotion needs more than half of them.
    """

    def __init__(self, addresses: StoreAddresses, *, run_id: str, epoch: int = 0, timeout_s: float = 5.0,
                 connect_timeout_s: float = 120.0, name: str = "", token: Optional[bytes] = None,
                 voter: Optional[str] = None, voters: int = 1) -> None:
        if not 0 <= epoch < len(addresses):
            raise ConfigError(f"in-process recovery: store epoch {epoch} is not an index of the {len(addresses)} "
                              "store(s)")
        self.addresses, self.run_id, self.timeout_s = addresses, run_id, timeout_s
        self.connect_timeout_s, self.name, self.token = connect_timeout_s, name or "this process", token
        self.epoch = epoch
        self.voter, self.voters = voter, voters
        self._clients: dict[str, BoundedClient] = {}
        self._made: list[BoundedClient] = []
        """Every client this set made, replaced ones too (their workers may still be inside torch's client)."""
        self._lock = threading.RLock()
        self._answered = False
        self._unreached: set[int] = set()
        self._follower: Optional[threading.Thread] = None
        self._closed = False
        self._settled = False
        self._callbacks: list[Callable[[int, int, str], None]] = []
        self.history: list[tuple[int, int, str, float]] = []
        """``(old epoch, new epoch, why, unix)`` of every move."""

    @property
    def move_bound_s(self) -> float:
        """How long a live process may take to reach a store the others promoted: an operation in flight on the
        lost store is given up after ``timeout_s``, and the follower looks for a promoted store every
        :data:`FOLLOW_EVERY_S`. Its heartbeat may lapse that long on the new store without the process being dead."""
        return self.timeout_s + FOLLOW_EVERY_S

    @property
    def promotion_wait_s(self) -> float:
        """How long a client that lost its store waits for a promoted one (a launcher: for the majority's votes):
        the other launchers lose the store within two of their operations' timeouts of this one (an operation and
        its second try), a connection to the next store takes one more, and a follower looks every
        :data:`FOLLOW_EVERY_S`."""
        return 3 * self.timeout_s + FOLLOW_EVERY_S

    # -- clients ------------------------------------------------------------------------------------------------

    def unreached(self, epochs: Iterable[int]) -> None:
        """No TCP connection to these stores completed at start-up while a later one accepted (the network to them
        is cut, or their host is gone: a host still starting refuses, it does not time out): their first operation
        gets the store timeout, not ``connect_timeout_s``, so that the failover to a promoted store comes within
        the failover's own bounds instead of minutes later."""
        with self._lock:
            self._unreached.update(epochs)

    def on_failover(self, fn: Callable[[int, int, str], None]) -> None:
        """``fn(old_epoch, new_epoch, why)`` after every move, on the moving thread, under the set's lock."""
        self._callbacks.append(fn)

    def address(self) -> tuple[str, int]:
        return self.addresses[self.epoch]

    def torch_address(self) -> tuple[str, int]:
        """Where a torch store client of the current store connects: through this process's tunnel when the launch
        has a token (:mod:`~neighbor_ckpt.inprocess.store_auth`)."""
        from neighbor_ckpt.inprocess.store_auth import tunnel_address

        return tunnel_address(self.address(), self.token)

    def _client(self, name: str, epoch: int) -> BoundedClient:
        with self._lock:
            c = self._clients.get(name)
            if c is None or c.broken is not None or c.address != self.addresses[epoch]:
                if c is not None:
                    c.retire()
                patience = self.timeout_s if self._answered or epoch in self._unreached else self.connect_timeout_s
                c = self._clients[name] = BoundedClient(self.addresses[epoch], timeout_s=self.timeout_s,
                                                        connect_timeout_s=patience, name=name, token=self.token)
                self._made = [m for m in self._made if m.alive()] + [c]
            return c

    def op(self, name: str, method: str, *args: Any) -> Any:
        """``method(*args)`` on the current store through client ``name`` (one per thread that may block); on a
        store that does not answer: once more on a new connection, then the failover, then again on the new
        store. Raises :class:`StoresLost` when no store of the list answers."""
        tried_again = False
        while True:
            if self._closed:
                raise StoresLost(f"{self.name}: the store clients are closed (the job completed)")
            epoch = self.epoch
            try:
                value = self._client(name, epoch).call(method, *args)
                self._answered = True
                return value
            except StoreUnreachable as e:
                if epoch != self.epoch:
                    continue  # another thread moved meanwhile
                if self._settled:  # the job is over: no more tries, no more moves
                    raise StoresLost(f"{self.name}: {self.addresses.describe(epoch)} does not answer ({e}); the "
                                     "job completed, so no other store is tried") from None
                if not tried_again:
                    tried_again = True
                    continue
                self.lost(epoch, str(e))
                tried_again = False

    def once(self, name: str, prefix: str) -> StoreView:
        """A view whose every operation goes to the current store once, through a client of its own: no second try,
        no failover; :class:`StoreUnreachable` when it does not answer within the timeout (a look that must end:
        the lease's last look before a cut-off)."""
        def op(method: str, *args: Any) -> Any:
            c = BoundedClient(self.address(), timeout_s=self.timeout_s, name=name, token=self.token)
            self._made.append(c)
            try:
                return c.call(method, *args)
            finally:
                c.retire()

        return StoreView(op, prefix)

    def view(self, name: str, prefix: str) -> StoreView:
        return StoreView(lambda method, *args: self.op(name, method, *args), prefix)

    # -- moving -------------------------------------------------------------------------------------------------

    def lost(self, epoch: int, why: str) -> int:
        """Store ``epoch`` does not answer: move to the next store promoted by a majority of the launchers (a
        launcher votes for the next one that answers first; nothing when another thread moved already). Returns
        the epoch now current; raises :class:`NoPromotedStore` when none is promoted within
        :attr:`promotion_wait_s` (and two looks at each later store: one that does not answer costs its timeout, and
        the first may come in the failover's rush), :class:`StoresLost` when no later store answers at all; stays on
        store ``epoch`` (returns it) when it answers again by then and no later store was promoted."""
        with self._lock:
            if self.epoch != epoch:
                return self.epoch
            logger.error("%s: %s does not answer (%s): failing over", self.name, self.addresses.describe(epoch), why)
            if epoch + 1 >= len(self.addresses):
                raise StoresLost(f"{self.name}: no store of the {len(self.addresses)} answers (the last: "
                                 f"{self.addresses.describe(epoch)}): the job cannot go on in process")
            deadline = time.monotonic() + self.promotion_wait_s
            voted: set[int] = set()
            answered = False
            looks = 0
            while True:
                for k in range(epoch + 1, len(self.addresses)):
                    try:
                        promoted = self._promotion(k, vote=k not in voted and not voted)
                    except StoreUnreachable as e:
                        logger.debug("%s: %s does not answer (%s)", self.name, self.addresses.describe(k), e)
                        continue
                    answered = True
                    if self.voter is not None:
                        voted.add(k)
                    if promoted is not None:
                        self._move(epoch, k, f"{self.addresses.describe(epoch)} lost: {why}", promoted=promoted)
                        return k
                    break  # the first store that answers is the one voted for and waited on
                looks += 1
                if time.monotonic() > deadline and looks >= 2:  # a store slow in the failover's rush: a second look
                    break
                time.sleep(min(0.2, self.timeout_s))
            if self._answers(epoch):  # a slow moment of its own (its tunnel, a loaded machine), not a lost store
                logger.warning("%s: %s answers again and no later store was promoted: staying on it", self.name,
                               self.addresses.describe(epoch))
                return epoch
            if not answered:
                raise StoresLost(f"{self.name}: no store of the {len(self.addresses)} answers (the last: "
                                 f"{self.addresses.describe(len(self.addresses) - 1)}): the job cannot go on in "
                                 "process")
            raise NoPromotedStore(f"{self.name}: {self.addresses.describe(epoch)} lost and no later store promoted by "
                                  f"a majority of the {self.voters} launcher(s) within {self.promotion_wait_s:.0f} s")

    def _answers(self, k: int) -> bool:
        """Whether store ``k`` answers one operation now (through a client of its own)."""
        c = BoundedClient(self.addresses[k], timeout_s=self.timeout_s, name=f"recheck{k}", token=self.token)
        self._made.append(c)
        try:
            c.call("check", [epoch_key(self.run_id)])
            return True
        except StoreUnreachable:
            return False
        finally:
            c.retire()

    def _promotion(self, k: int, *, vote: bool) -> Optional[bool]:
        """One look at store ``k`` (through a client of its own): None while it is not promoted; True when this
        client promoted it now (its vote made the majority), False when it was promoted already. A voter votes
        first when ``vote``."""
        c = BoundedClient(self.addresses[k], timeout_s=self.timeout_s, name=f"promote{k}", token=self.token)
        self._made.append(c)
        try:
            if c.call("check", [epoch_key(self.run_id)]):
                return False
            if self.voter is None:
                return None
            if vote:
                c.call("append", vote_key(self.run_id, k), f"{self.voter},")
            ballot = vote_key(self.run_id, k)  # a get of a key nobody wrote waits out the timeout: look first
            raw = c.call("get", ballot) if c.call("check", [ballot]) else b""
            votes = {v for v in raw.decode(errors="replace").split(",") if v}
            if len(votes) <= self.voters // 2:
                return None
            stood = c.call("compare_set", epoch_key(self.run_id), "", str(k))
            return stood.decode(errors="replace") == str(k)
        finally:
            c.retire()

    def follow_newer(self) -> Optional[int]:
        """Move to the next store of the list when it was promoted (fencing: see the module docstring); the new
        epoch, or None. Looks at the stores after the current one, up to the first that answers."""
        if self._closed or self._settled:
            return None
        epoch = self.epoch
        for k in range(epoch + 1, len(self.addresses)):
            try:
                promoted = self._client(f"probe{k}", k).call("check", [epoch_key(self.run_id)])
            except StoreUnreachable:
                continue
            if not promoted:
                return None
            with self._lock:
                if self.epoch != epoch:
                    return None
                self._move(epoch, k, f"{self.addresses.describe(k)} was promoted while this process was on "
                                     f"{self.addresses.describe(epoch)}", promoted=False)
            return k
        return None

    def start_following(self, every_s: float = FOLLOW_EVERY_S) -> None:
        """Call :meth:`follow_newer` every ``every_s`` on a thread of its own (a look at a lost standby waits for
        its timeout: never on a thread that must keep beating)."""
        if self._follower is not None or len(self.addresses) < 2:
            return

        def run() -> None:
            while not (self._closed or self._settled):
                time.sleep(every_s)
                if self._closed or self._settled:
                    return
                try:
                    self.follow_newer()
                except Exception as e:  # noqa: BLE001 - a look only; the next one comes
                    logger.debug("%s: looking for a newer store: %s", self.name, e)

        self._follower = threading.Thread(target=run, name=f"{CLIENT_THREAD}-follower", daemon=True)
        self._follower.start()

    @property
    def over(self) -> bool:
        """The job completed (:meth:`settle`) or the clients are closed: no more moves."""
        return self._settled or self._closed

    def settle(self) -> None:
        """The job completed: stay on the current store (no follower, no failover; an operation the store no longer
        answers raises :class:`StoresLost`), while what is left to write can still be written."""
        self._settled = True

    def close(self) -> list[str]:
        """No more store traffic from this process (the job completed): stop the follower, retire every client and
        wait for the operations in flight (at most about twice the timeout), so that the process does not exit while
        one of its threads is inside torch's client (see *Exiting* in the module docstring). A thread blocked in a
        ``wait`` (the failure listener) is left as it is. Returns :func:`quiesce`'s answer: what is still inside."""
        self._closed = True
        follower = self._follower
        if follower is not None and follower is not threading.current_thread():
            follower.join(timeout=2 * self.timeout_s + 1)
        with self._lock:
            made, self._made = self._made, []
        return quiesce(2 * self.timeout_s + 1, made)

    def _move(self, old: int, new: int, why: str, *, promoted: bool) -> None:
        self.epoch = new
        for c in self._clients.values():
            c.broken = c.broken or "replaced by the failover"
            c.retire()
        self._clients.clear()
        self.history.append((old, new, why, time.time()))
        logger.warning("%s: store epoch %d -> %d: now on %s%s (%s)", self.name, old, new,
                       self.addresses.describe(new), ", promoted it" if promoted else "", why)
        for fn in list(self._callbacks):
            fn(old, new, why)
