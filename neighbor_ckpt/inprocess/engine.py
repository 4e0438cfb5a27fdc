"""The in-process engine: call the training function again, in the same process, after every contained failure.

Usage (one process per rank and per spare, started by our launcher, :mod:`neighbor_ckpt.inprocess.launcher`)::

    inproc = InprocessRecovery.from_config(cfg)          # cfg.inprocess.enabled; store address from the launcher

    def train(attempt: Attempt) -> None:                  # called again after every contained failure
        inproc.init_process_group()                       # a new gloo group for this generation
        ...build parallel state, model, optimizer...
        ckpt = NeighborCheckpointer(cfg, ..., attempt=inproc.attempt_info())
        inproc.on_restart(lambda: ckpt.close(success=False))   # runs after the abort; host slots stay
        result = ckpt.recover()
        for step in range(result.next_step, steps):
            ...
            inproc.mark_progress()                        # after the first completed step of this attempt

    inproc.run(train)   # returns on success (None on a spare never used); SystemExit(75) when it gives up

**One generation** (:mod:`neighbor_ckpt.inprocess.generation`): every live process joins a barrier in the store, the
barrier's canonical member list gives every process its rank through a pure function
(:func:`~neighbor_ckpt.inprocess.assignment.next_assignment`: survivors keep their numbers, spares fill lost ranks,
elastic shrink when none is left), and the active ranks call the training function with ``RANK``/``WORLD_SIZE`` set
to their assignment; the idle spares wait. The process group of generation ``g`` lives under ``gen/<g>/pg/`` in the
store: a stale process can never join a newer generation's group.

**A failure** is recorded once per generation in the store (``gen/<g>/failed``), by whoever sees it first: a launcher
whose process exited, the training thread that raised, or a process's monitor thread (a silent peer, a stuck rank:
:mod:`neighbor_ckpt.inprocess.monitor`). Every process's monitor is woken by the store, and in each active process it
aborts: the sockets of our own process groups are shut down (the user's own connections and the store's stay up:
:mod:`neighbor_ckpt.inprocess.abort`), which frees a training thread blocked in a collective; a training thread that
is not blocked gets an exception raised into it. The training thread unwinds to :meth:`InprocessRecovery.run`, which
runs the attempt's clean-ups (last registered first), drops megatron-core's parallel state and the process group,
checks the process's hygiene (:mod:`neighbor_ckpt.inprocess.hygiene`: a process that leaks exits and its launcher
brings a new one back as a spare), and joins the next generation.

**Fallback** to the launcher's restart path (every process exits with :data:`FALLBACK_EXIT_CODE`, announced in one
log line; ``recover()`` then resumes from the host stores): no spare left to fill a lost rank (and no elastic size
fits), the previous generation failed before completing a step (a failure during recovery), a second hang with every
rank's tag equal, more than ``inprocess.max_restarts`` generations, a barrier that does not form within
``inprocess.barrier_timeout_s``.

**Attempts.** The launcher's restart count does not change across generations; :meth:`InprocessRecovery.attempt_info`
gives the checkpointer an :class:`~neighbor_ckpt.recovery.attempt.AttemptInfo` (restart count + generation, spare
activation, the abort times for the recovery timeline, whose ``mode`` is then ``"in-process"``) and a way to hand
its progress tag to the monitor.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch.distributed as dist

from neighbor_ckpt.config import DetectorConfig, InprocessConfig, NeighborCkptConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.inprocess import protocol
from neighbor_ckpt.inprocess.assignment import Assignment, GiveUp, initial_assignment, next_assignment
from neighbor_ckpt.inprocess.completion import completed
from neighbor_ckpt.inprocess.generation import (BarrierTimeout, Fenced, GenerationFailure, GenerationStore, Members,
                                                QuorumLost, gate)
from neighbor_ckpt.inprocess.engine_memory import EngineMemory, proc_info
from neighbor_ckpt.inprocess.holdings import holdings_of, local_holdings
from neighbor_ckpt.inprocess.monitor import IDLE_TAG, FailureListener, Monitor, Tag
from neighbor_ckpt.inprocess.store_auth import TUNNEL_THREAD, read_token, tunnel_ports
from neighbor_ckpt.inprocess.stores import CLIENT_THREAD, StoreAddresses, StoreSet, StoresLost
from neighbor_ckpt.recovery.attempt import AttemptInfo, launcher_restart_count
from neighbor_ckpt.recovery.reshard import ElasticPolicy
from neighbor_ckpt.runtime.procs import flush_logs, stall_report

__all__ = ["InprocessRecovery", "Attempt", "FALLBACK_EXIT_CODE"]

logger = logging.getLogger(__name__)

FALLBACK_EXIT_CODE = protocol.EXIT_FALLBACK
"""Exit status of every process when in-process recovery gives up (EX_TEMPFAIL): the launchers restart the job."""

PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
                       r"remote process exited|NCCL communicator was aborted", re.IGNORECASE)
"""What a collective raises when a peer process died (gloo's, NCCL's words)."""

HYGIENE_TRIES = 4
"""Looks at the process's threads after a failed generation, 0.5 s apart, before it is declared not clean."""

STORE_TIMEOUT_MIN_S = 3.0
"""The least time a store operation may go unanswered before the store counts as lost (twice
``detector.timeout_s`` when that is longer)."""

LIFETIME_THREADS = ("neighbor_ckpt-inprocess-monitor", "neighbor_ckpt-inprocess-listener", CLIENT_THREAD,
                    TUNNEL_THREAD, "neighbor_ckpt-abort-watchdog", "neighbor_ckpt-spare-slot", "neighbor-ckpt-prefault-",
                    "TMonitor", "tqdm_monitor")
"""Threads that may outlive a generation: the engine's own (a spare's slot preparation included), tqdm's
progress-bar monitor (one per process, started by
the first progress bar; tqdm 4.70 names it ``tqdm_monitor``, older releases ``TMonitor``: a Megatron-Bridge survivor
failed the hygiene check on it)."""

REINTERRUPT_S = 1.0
"""How long the exception raised into the training thread may take to get it out of the training function before
it is raised again."""

ABORT_GRACE_S = 0.1
"""After the socket abort, how long the training thread may take to leave a freed collective on its own before an
exception is raised into it (a thread in Python code, or in a C call the sockets do not free)."""


@dataclass
class Attempt:
    """One call of the training function (generation ``iteration``; 0: the first)."""

    iteration: int
    rank: int
    """This generation's rank (survivors keep theirs, a spare gets the lost one)."""
    world_size: int
    initial_rank: int
    """The process index (the rank this process was started as; a spare's is >= the active world size)."""
    assignment: Assignment = field(repr=False, default=None)  # type: ignore[assignment]


class InprocessRecovery(EngineMemory):
    """Our in-process recovery engine for one process (see the module docstring).

    Args:
        spares: hot spare processes of the launch (the launcher's ``NEIGHBOR_CKPT_INPROCESS_SPARES`` when None).
        store: the launch's store as ``HOST:PORT`` (a recipe's ``--inprocess-store``), or
        store_host, store_port: the same apart (the launcher's ``NEIGHBOR_CKPT_INPROCESS_STORE`` when neither).
        world_size: processes of the launch (``WORLD_SIZE`` as the launcher set it when None).
        run_id: the launch's store namespace (the launcher's ``NEIGHBOR_CKPT_INPROCESS_RUN`` when None).
        detector: the ``neighbor_ckpt.detector`` section (its timers drive the monitor).
        inprocess: the ``neighbor_ckpt.inprocess`` section (max restarts, barrier and abort timeouts, hygiene).
        elastic: the world sizes the job may shrink to when no spare is left (None: give up instead).
        snapshots: the whole configuration (:meth:`from_config` passes it): with it, a hot spare prepares its own
            slot while it idles, where the host stores are (None: it does not).

    Raises:
        ConfigError: not started by our launcher (plain torchrun), the old timer variable is set, or the detector
            is off.
    """

    def __init__(self, *, spares: Optional[int] = None, store: Optional[str] = None, store_host: Optional[str] = None,
                 store_port: Optional[int] = None, world_size: Optional[int] = None, run_id: Optional[str] = None,
                 detector: Optional[DetectorConfig] = None, inprocess: Optional[InprocessConfig] = None,
                 elastic: Optional[ElasticPolicy] = None, snapshots: Optional[NeighborCkptConfig] = None) -> None:
        env = os.environ
        _refuse_legacy_env(env)
        if protocol.ENV_LAUNCHER not in env:
            raise ConfigError(
                "neighbor_ckpt.inprocess.enabled: in-process recovery needs our launcher, which keeps the surviving "
                "processes alive and starts the spares: run the job with `neighbor-ckpt launch CONFIG` (one machine) "
                "or `neighbor-ckpt launch CONFIG --slurm FILE` (a cluster), not plain torchrun, which stops every "
                "worker of a node when one exits. Or set neighbor_ckpt.inprocess.enabled=false for the restart path")
        self.detector = detector or DetectorConfig()
        self.config = inprocess or InprocessConfig(enabled=True)
        if not self.detector.enabled:
            raise ConfigError("neighbor_ckpt.detector.enabled: false with neighbor_ckpt.inprocess.enabled: the "
                              "detector is what notices a dead, stopped or stuck rank in process; turn it on")
        if store is None and store_host is not None and store_port is not None:
            store = f"{store_host}:{store_port}"
        what = "--inprocess-store" if store is not None else f"{protocol.ENV_STORE} (our launcher sets it)"
        self.store_list = StoreAddresses.parse(store if store is not None else env.get(protocol.ENV_STORE, ""), what)
        self.world_size = int(world_size if world_size is not None else env.get(protocol.ENV_PROCESSES, "1"))
        if spares is None:
            spares = int(env.get(protocol.ENV_SPARES, "0"))
        elif protocol.ENV_SPARES in env and int(env[protocol.ENV_SPARES]) != spares:
            raise ConfigError(f"neighbor_ckpt.inprocess.spares is {spares} but the launcher started "
                              f"{env[protocol.ENV_SPARES]} spare(s): launch the job with the same job file")
        if not 0 <= spares < self.world_size:
            raise ConfigError(f"neighbor_ckpt.inprocess.spares: {spares} spare(s) for {self.world_size} process(es): "
                              f"needs 0 <= spares < processes")
        self.spares = spares
        self.active_world_size = self.world_size - spares
        self.run_id = run_id or env.get(protocol.ENV_RUN_ID) or env.get("NEIGHBOR_CKPT_JOB_ID") or "job"
        self.launch = launcher_restart_count()
        self.prefix = protocol.launch_prefix(self.run_id, self.launch)
        self.stores = StoreSet(self.store_list, run_id=self.run_id, epoch=int(env.get(protocol.ENV_STORE_EPOCH, "0")),
                               timeout_s=max(2 * self.detector.timeout_s, STORE_TIMEOUT_MIN_S),
                               connect_timeout_s=self._barrier_timeout(),
                               name=f"process {env.get(protocol.ENV_PROCESS, '0')}",
                               token=read_token(Path(env[protocol.ENV_STORE_TOKEN]))
                               if env.get(protocol.ENV_STORE_TOKEN) else None)
        """The launch's stores (primary and standbys) and the failover between them
        (:mod:`neighbor_ckpt.inprocess.stores`)."""
        self.stores.on_failover(self._on_store_failover)
        self.elastic = elastic
        self.initial_rank = int(env.get(protocol.ENV_PROCESS, "0"))
        self.process = self.initial_rank
        self.current: Optional[Attempt] = None
        self.events: list[dict[str, Any]] = []
        """``{"iteration", "name", "unix"}``: abort_start/abort_end/finalize_end (this process's abort of a failed
        generation), initialize, enter, and whatever the training function records with :meth:`event`."""
        self.gave_up: Optional[str] = None
        self.failures: list[GenerationFailure] = []
        """The failures of the generations this process was part of, as recorded in the store."""
        self._lock = threading.Lock()
        self._cleanups: list[Callable[[], None]] = []
        self._stores: dict[str, Any] = {}
        self._raw: dict[tuple[str, int], Any] = {}
        self._main_gens: Optional[GenerationStore] = None
        self._members_record: Optional[Members] = None
        self._progressed: set[int] = set()
        self._joining: Optional[int] = None
        self._finished: Optional[int] = None
        self._my_listeners: Optional[tuple[int, str]] = None
        self._peer_cache: dict[int, tuple[int, frozenset[Any]]] = {}
        self._generation = 0
        self._members: frozenset[int] = frozenset()
        self._assignment: Optional[Assignment] = None
        self._inside = False
        self._main_tid: Optional[int] = None
        self._progress_source: Optional[Callable[[], Tag]] = None
        self._aborted: set[int] = set()
        self._sockets: Any = None
        self._attempt_info: Optional[AttemptInfo] = None
        self._was_active = False
        self._hygiene: Any = None
        self._monitor_gens: Optional[GenerationStore] = None
        self._rss_reference: Optional[tuple[int, int]] = None
        self._listener: Any = None
        self.snapshots = snapshots
        """The whole configuration, when given (:meth:`from_config`): where the host stores are, for the slot a hot
        spare prepares while it idles."""
        self._spare_slot_started = False

    @classmethod
    def from_config(cls, config: "NeighborCkptConfig | InprocessConfig", *, model_parallel: int = 1,
                    batch_micro_batches: Optional[int] = None, **kwargs: Any) -> "InprocessRecovery":
        """Built from the ``neighbor_ckpt.inprocess`` section and, given the whole configuration, its ``detector``
        and ``elastic`` sections (with ``model_parallel`` = TP x PP x CP and ``batch_micro_batches`` = global batch
        / micro-batch size of the job: the world sizes it may shrink to); ``kwargs`` as for the constructor.

        Raises :class:`ConfigError` when the section is not enabled (the caller should run without the engine)."""
        section = config.inprocess if isinstance(config, NeighborCkptConfig) else config
        if not section.enabled:
            raise ConfigError("neighbor_ckpt.inprocess.enabled is false: run the training function without "
                              "InprocessRecovery (or set neighbor_ckpt.inprocess.enabled=true)")
        if isinstance(config, NeighborCkptConfig):
            kwargs.setdefault("detector", config.detector)
            kwargs.setdefault("snapshots", config)
            if config.elastic.enabled and "elastic" not in kwargs:
                kwargs["elastic"] = ElasticPolicy(model_parallel=model_parallel,
                                                  min_data_parallel=config.elastic.min_data_parallel,
                                                  batch_micro_batches=batch_micro_batches)
        kwargs.setdefault("spares", section.spares)
        return cls(inprocess=section, **kwargs)

    # -- the store ---------------------------------------------------------------------------------------------

    @property
    def store_host(self) -> str:
        """The current store's host (it changes with a failover)."""
        return self.stores.address()[0]

    @property
    def store_port(self) -> int:
        return self.stores.address()[1]

    def _store(self, name: str) -> Any:
        """The store for thread ``name`` (``main``, ``monitor``, ``listener``, ``stall``: one client per thread that
        may block), under the launch prefix: every operation bounded and failed over
        (:class:`~neighbor_ckpt.inprocess.stores.StoreSet`)."""
        if name not in self._stores:
            self._stores[name] = self.stores.view(name, self.prefix)
        return self._stores[name]

    def _raw_store(self, name: str) -> Any:
        """A torch store client of the current store under the launch prefix, for what torch itself drives (the
        process groups' rendezvous, the application's keys): a new one after a failover."""
        key_ = (name, self.stores.epoch)
        if key_ not in self._raw:
            host, port = self.stores.torch_address()
            base = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, use_libuv=True,
                                 timeout=timedelta(seconds=self._barrier_timeout()))
            self._raw[key_] = dist.PrefixStore(self.prefix, base)
        return self._raw[key_]

    def _barrier_timeout(self) -> float:
        return float(getattr(self.config, "barrier_timeout_s", 300.0))

    def app_store(self) -> Any:
        """This process's client of the launch's store, under ``app/`` (for the application's own keys; the current
        store: ask again after a failover)."""
        return dist.PrefixStore("app/", self._raw_store("app"))

    # -- events ------------------------------------------------------------------------------------------------

    def event(self, name: str, when: Optional[float] = None) -> float:
        t = time.time() if when is None else when
        with self._lock:
            self.events.append({"iteration": self._generation, "name": name, "unix": t})
        return t

    def idle_spares(self) -> list[int]:
        """The processes up now and given no rank in the current generation (hot spares, replacements that joined
        late included), as the store says: who can take the next lost rank. Any thread; one store round trip."""
        gens = GenerationStore(self._store("main"), process=self.process)
        g = gens.current()
        assigned = gens.assignment(g)
        busy = set(assigned.ranks) if assigned is not None else set()
        return sorted(set(gens.ready()) - set(gens.dead()) - busy)

    # -- inside an attempt -------------------------------------------------------------------------------------

    def init_process_group(self, *, backend: str = "gloo", timeout: timedelta = timedelta(seconds=120)) -> None:
        """The default process group of this generation, over ``gen/<g>/pg/`` of the launch's store."""
        att = self._need_attempt()
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized at the start of an in-process attempt")
        dist.init_process_group(backend, store=self.process_group_store(), rank=att.rank,
                                world_size=att.world_size, timeout=timeout)
        self._publish_listeners()
        self.event("pg_ready")

    def process_group_store(self) -> Any:
        """The store for this generation's default process group (frameworks that create the group themselves,
        e.g. NeMo's ``MegatronStrategy.store``)."""
        att = self._need_attempt()
        return dist.PrefixStore(protocol.key("gen", att.iteration, "pg") + "/", self._raw_store("pg"))

    def on_restart(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` if this attempt fails, after the abort freed every blocked collective and before the
        next generation (last registered first). Errors are logged, not raised."""
        with self._lock:
            self._cleanups.append(cleanup)

    def watch_progress(self, source: Callable[[], Tag]) -> None:
        """The training thread's progress tag for the monitor (the checkpointer registers its own, once the
        framework's process groups exist: they are published now for the peers' aborts)."""
        self._progress_source = source
        self._publish_listeners()

    def mark_progress(self) -> None:
        """This attempt completed a training step (call once, after its first completed step)."""
        att = self._need_attempt()
        self._progressed.add(att.iteration)
        GenerationStore(self._store("main"), process=self.process).mark_progress(att.iteration)
        self._publish_listeners()  # every group of the step exists now
        self.event("first_step_end")

    def attempt_info(self) -> AttemptInfo:
        """This attempt for :class:`~neighbor_ckpt.NeighborCheckpointer` (``attempt=``)."""
        self._need_attempt()
        assert self._attempt_info is not None  # noqa: S101 - set with the attempt
        return self._attempt_info

    def _need_attempt(self) -> Attempt:
        if self.current is None:
            raise RuntimeError("InprocessRecovery: only inside the function given to run()")
        return self.current

    # -- the monitor's side ------------------------------------------------------------------------------------

    def _state(self) -> tuple[int, frozenset[int], Optional[Mapping[int, int]], bool]:
        a = self._assignment
        return self._generation, self._members, None if a is None else a.ranks, self._inside

    def _progress(self) -> Tag:
        src = self._progress_source
        if src is None or not self._inside:
            return IDLE_TAG
        try:
            return src()
        except Exception:  # noqa: BLE001 - a checkpointer being torn down
            return IDLE_TAG

    def _on_failure(self, failed: GenerationFailure) -> None:
        """Listener thread: the current generation failed. An active process aborts its groups and, if the training
        thread does not leave the training function on its own, raises into it."""
        with self._lock:
            self.failures.append(failed)
        logger.warning("%s: generation %d failed (%s by %s): %s", self._name(), failed.generation, failed.kind,
                       failed.by, failed.reason)
        if self._inside and failed.generation == self._generation:
            self._abort(failed.generation)
            from neighbor_ckpt.inprocess.abort import GenerationAborted, interrupt_thread

            deadline = time.monotonic() + ABORT_GRACE_S
            while self._inside and time.monotonic() < deadline:
                time.sleep(0.005)
            # Still inside: in Python code, or in a C call the sockets do not free. Raise into it; again only if a
            # handler of the training function swallowed it (a bare ``except BaseException``).
            stuck_at = time.monotonic() + max(2 * REINTERRUPT_S, self.detector.timeout_s)
            while self._inside and failed.generation == self._generation and self._main_tid is not None:
                if time.monotonic() > stuck_at:
                    self._stuck(failed.generation)
                    return
                interrupt_thread(self._main_tid, GenerationAborted)
                deadline = time.monotonic() + REINTERRUPT_S
                while self._inside and time.monotonic() < deadline:
                    time.sleep(0.01)

    def _stuck(self, generation: int) -> None:
        """The training thread did not leave the training function after the abort and the raised exception: it
        is stuck in a C call (or swallows every exception). This process declares itself dead; its launcher kills
        it and a spare takes its rank in the next generation."""
        reason = (f"{self._name()}: the training thread is still inside the training function "
                  f"{max(2 * REINTERRUPT_S, self.detector.timeout_s):g} s after generation {generation}'s abort "
                  "(stuck in a C call)")
        logger.error("%s: declaring this process dead; its launcher replaces it", reason)
        self._listener.gens.report_death((self.process,), kind="hung", reason=reason)  # on the listener's thread

    def _abort_timeout(self) -> float:
        return float(getattr(self.config, "abort_timeout_s", 60.0))

    def _cleanup_stuck(self, generation: int) -> None:
        """The failed attempt's abort and clean-up have not returned after ``inprocess.abort_timeout_s`` (a thread
        that blocks the clean-up on a connection the abort did not reach): this process declares itself dead, so the
        next generation forms without it (a spare takes its rank) instead of waiting for it until
        ``inprocess.barrier_timeout_s`` ends the job. Its launcher kills it. On the watching thread, with a store
        connection of its own (the others may be inside a blocking wait)."""
        reason = (f"{self._name()}: the clean-up of generation {generation} has not returned after "
                  f"{self._abort_timeout():g} s (inprocess.abort_timeout_s)")
        logger.error("%s: declaring this process dead; its launcher replaces it", reason)
        try:
            GenerationStore(self._store("stall"), process=self.process).report_death(
                (self.process,), kind="hung", reason=reason)
        except Exception as e:  # noqa: BLE001 - the barrier timeout then ends the job, as before
            logger.error("%s: could not declare this process dead: %s", self._name(), e)

    def _abort(self, generation: int) -> None:
        """Shut down the sockets of this generation's process groups (once per generation)."""
        with self._lock:
            if generation in self._aborted:
                return
            self._aborted.add(generation)
        from neighbor_ckpt.inprocess.abort import abort_nccl

        self.event("abort_start")
        try:
            self._abort_gloo(generation)
            abort_nccl(timeout_s=self._abort_timeout())
        except Exception as e:  # noqa: BLE001 - the finalisation destroys the groups anyway
            logger.warning("%s: abort of generation %d: %s: %s", self._name(), generation, type(e).__name__, e)
        self.event("abort_end")

    def _abort_gloo(self, generation: int) -> None:
        """Shut down this process's side of ``generation``'s gloo connections: those it accepted, and those to the
        peers' listeners it knows (read again each time: a peer that moved to a new store late publishes late)."""
        from neighbor_ckpt.inprocess.abort import abort_gloo

        if self._sockets is None:
            return
        try:
            peers = self._peer_listeners(generation)
        except Exception as e:  # noqa: BLE001 - our accepted side is still closed; the kill does the rest
            logger.warning("%s: peers' listeners unreadable: %s", self._name(), e)
            peers = frozenset()
        abort_gloo(self._sockets, keep_ports={p for _, p in self.store_list.addresses} | tunnel_ports(),
                   peer_listeners=peers)

    def _name(self) -> str:
        a = self._assignment
        r = None if a is None else a.rank_of(self.process)
        return f"process {self.process}" + ("" if r is None else f" (rank {r})")

    # -- the run loop ------------------------------------------------------------------------------------------

    def run(self, fn: Callable[[Attempt], Any]) -> Any:
        """Call ``fn(attempt)`` in generation after generation until the job completes. Returns ``fn``'s value
        (None on a spare never used); raises ``SystemExit(FALLBACK_EXIT_CODE)`` after one log line when in-process
        recovery gives up, ``SystemExit(EXIT_FENCED)`` when this process was declared dead."""
        from neighbor_ckpt.inprocess.hygiene import ProcessState

        if completed():  # the job completed before this process started (a late replacement): no store to ask
            return None
        self._main_tid = threading.get_ident()
        main = self._main_gens = GenerationStore(self._store("main"), process=self.process)
        self._monitor_gens = GenerationStore(self._store("monitor"), process=self.process)
        first = main.current() if self.process >= self.world_size else 0
        self._listener = FailureListener(GenerationStore(self._store("listener"), process=self.process),
                                         on_failure=self._on_failure, first=first)
        monitor = Monitor(self._monitor_gens, state=self._state,
                          progress=self._progress, listener=self._listener,
                          interval_s=self.detector.interval_s, timeout_s=self.detector.timeout_s,
                          hang_timeout_s=self.detector.hang_timeout_s, stores=self.stores,
                          every_round=self._remember_peer_listeners)
        main.store.set(protocol.key("proc", self.process), proc_info())
        # Everything alive now (modules, the imports' objects) lives as long as the process: exempt it from
        # collection, so a generation's clean-up collects only what the generation made.
        gc.collect()
        gc.freeze()
        self._hygiene = ProcessState.capture()
        main.announce_ready()
        self._listener.start()
        monitor.start()
        self.stores.start_following()
        try:
            return self._loop(fn, main)
        except Fenced as e:
            logger.error("%s: %s: exiting with status %d", self._name(), e, protocol.EXIT_FENCED)
            raise SystemExit(protocol.EXIT_FENCED) from None
        except StoresLost as e:
            self.gave_up = str(e)
            logger.error("neighbor_ckpt: %s: exiting with status %d", e, FALLBACK_EXIT_CODE)
            raise SystemExit(FALLBACK_EXIT_CODE) from None
        except _GiveUp as e:
            self.gave_up = e.reason
            main.give_up(e.reason)
            logger.error("neighbor_ckpt: in-process recovery gives up on process %d (%s): exiting with status %d so "
                         "the launcher restarts the job; recover() then resumes from the host stores",
                         self.process, e.reason, FALLBACK_EXIT_CODE)
            raise SystemExit(FALLBACK_EXIT_CODE) from None
        finally:
            monitor.stop()
            self.stores.close()

    def _loop(self, fn: Callable[[Attempt], Any], main: GenerationStore) -> Any:
        assignment = initial_assignment(self.world_size, self.spares)
        expected: set[int] = set(range(self.world_size))
        generation = 0
        formed_on = self.stores.epoch
        if self.process >= self.world_size:  # a replacement started by a launcher: a spare from the next generation
            generation, assignment, expected = self._join_late(main)
            if generation < 0:
                return None  # the job completed meanwhile
        while True:
            reason = main.gave_up()
            if reason is not None:
                raise _GiveUp(f"another process gave up: {reason}")
            # after a store failover, the next generation needs a majority of the last one's members that may still
            # run: a minority cut off with a standby of its own must not go on beside the others
            last = self._members if self.stores.epoch != formed_on else frozenset()
            if generation > 0:
                self._publish_holdings(main, generation)
            self._joining = generation
            try:
                members = main.join(generation, expected=expected, timeout_s=self._barrier_timeout(), quorum_of=last)
            except (BarrierTimeout, QuorumLost) as e:
                raise _GiveUp(str(e)) from None
            finally:
                self._joining = None
            formed_on = self.stores.epoch
            self._generation, self._members, self._members_record = generation, members.members, members
            self.event("initialize")
            if generation > 0:
                assignment = self._next(main, assignment, members)
            self._assignment = assignment
            if self.process == min(members.members):
                main.publish_assignment(generation, assignment)
            rank = assignment.rank_of(self.process)
            if rank is None:
                outcome = self._idle(main, generation)
            else:
                outcome = self._attempt(fn, main, generation, assignment, rank)
            if outcome is not _FAILED:
                return outcome
            expected = (set(members.members) | set(main.ready())) - main.dead().keys()
            generation += 1

    def _join_late(self, main: GenerationStore) -> tuple[int, Assignment, set[int]]:
        """A process that starts after generation 0 formed (a replacement): wait, idle, until the current generation
        ends; returns the next generation, the current one's assignment and who the next one waits for
        (generation -1: the job completed)."""
        while True:
            reason = main.gave_up()  # a give-up at a generation's gate publishes no assignment: do not wait for it
            if reason is not None:
                raise _GiveUp(f"another process gave up: {reason}")
            g = main.current()
            members, assignment = main.members(g), main.assignment(g)
            if members is None or assignment is None:
                time.sleep(0.05)
                continue
            self._generation, self._members = g, members.members | {self.process}
            self._members_record = members
            logger.info("%s: started during generation %d: a spare from generation %d on", self._name(), g, g + 1)
            if main.wait_outcome(g, self._listener.event(g)) is None:
                return -1, assignment, set()
            return g + 1, assignment, (set(members.members) | set(main.ready())) - main.dead().keys()

    def _publish_holdings(self, main: GenerationStore, generation: int) -> None:
        """With elastic shrink: which snapshots this node holds, for the choice of the survivors a shrink keeps."""
        cfg = self.snapshots
        if self.elastic is None or cfg is None or not cfg.enabled:
            return
        try:
            held = local_holdings(cfg.resolved_store_dir(), cfg.resolved_job_id())
        except Exception as e:  # noqa: BLE001 - best effort: without it a shrink keeps the survivors in rank order
            logger.warning("%s: could not say which snapshots this node holds: %s", self._name(), e)
            return
        main.publish_holdings(generation, held)

    def _next(self, main: GenerationStore, prev: Assignment, members: Members) -> Assignment:
        """The gate (identical on every process: the same canonical members, the same rules), then the ranks."""
        g = members.generation
        why = gate(members, max_restarts=getattr(self.config, "max_restarts", None))
        if why is not None:
            raise _GiveUp(why)
        held = None
        lost = [p for p in prev.ranks if p not in members.members]
        if self.elastic is not None and len(lost) > len(members.members - set(prev.ranks)):  # no spare for each: shrink
            held = holdings_of(main.holdings(g, members.members), world_size=prev.world_size)
        nxt = next_assignment(prev, members.members, elastic=self.elastic, holdings=held)
        if isinstance(nxt, GiveUp):
            raise _GiveUp(nxt.reason)
        if nxt.shrunk_from is not None:
            logger.warning("neighbor_ckpt: no hot spare left: continuing on %d of %d ranks (elastic)",
                           nxt.world_size, nxt.shrunk_from)
        logger.info("%s: generation %d: %s", self._name(), g, nxt.describe())
        return nxt

    def _idle(self, main: GenerationStore, generation: int) -> Any:
        """An idle spare: wait for the job to complete (None) or the generation to fail (:data:`_FAILED`); meanwhile
        its own slot is prepared for whichever rank it takes (:meth:`_prepare_spare_slot`)."""
        self.event("idle")
        self._prepare_spare_slot()
        failed = main.wait_outcome(generation, self._listener.event(generation))
        return None if failed is None else _FAILED

    def _attempt(self, fn: Callable[[Attempt], Any], main: GenerationStore, generation: int,
                 assignment: Assignment, rank: int) -> Any:
        from neighbor_ckpt.inprocess.abort import GenerationAborted, SocketBaseline, clear_pending

        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(assignment.world_size)
        att = Attempt(iteration=generation, rank=rank, world_size=assignment.world_size,
                      initial_rank=self.process, assignment=assignment)
        spare = self.process >= self.active_world_size
        self._attempt_info = self._make_attempt_info(generation, activated_spare=spare and not self._was_active)
        self._was_active = True
        if self._attempt_info.activated_spare:
            logger.info("neighbor_ckpt: hot spare (process %d) takes rank %d's place in generation %d", self.process,
                        rank, generation)
        self._sockets = SocketBaseline.capture()
        self.current = att
        self.event("enter")
        ok, result, error = False, None, None
        self._inside = True
        try:
            # A failure recorded before this thread got inside was not raised into it: look once, now that the
            # monitor would (one of the two sees it).
            earlier = main.failure(generation)
            if earlier is not None:
                raise GenerationAborted(f"generation {generation} failed before it started here: {earlier.reason}")
            result = fn(att)
            ok = True
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - every failure of an attempt is handled here
            # Only its text is kept: the exception's traceback holds the failed generation's frames, and they its
            # model, optimizer and tensors, which the clean-up must free (the hygiene check measures it).
            error = f"{type(e).__name__}: {e}"
        finally:
            self._inside = False
            clear_pending(self._main_tid)
            self.current = None
        if ok:
            self._finished = generation
            main.finished(generation, assignment.world_size)
            failed = main.wait_outcome(generation, self._listener.event(generation))
            if failed is None:
                self._close_success()
                return result
        else:
            # A collective that lost its peer (a killed process: its launcher's report is on its way) does not make
            # this process the one at fault: the record then names nobody.
            lost_peer = PEER_LOST.search(error) is not None
            record = main.fail(generation, kind="exception", ranks=() if lost_peer else (self.process,),
                               reason=f"{self._name()}: " + ("a collective lost a peer: " if lost_peer else "") + error)
            if record.kind == "exception" and main.won(record):
                logger.error("%s: generation %d failed here: %s", self._name(), generation, error)
        with stall_report(f"{self._name()}: the clean-up of generation {generation}", self._abort_timeout(), logger,
                          then=lambda: self._cleanup_stuck(generation)):
            self._abort(generation)  # free the peers (if the monitor has not yet)
            self._finalize()
        self._check_hygiene(generation)
        return _FAILED

    def _make_attempt_info(self, generation: int, *, activated_spare: bool) -> AttemptInfo:
        with self._lock:
            prev = [e for e in self.events if e["iteration"] == generation - 1]
        starts = [e["unix"] for e in prev if e["name"] == "abort_start"]
        ends = [e["unix"] for e in prev if e["name"] == "abort_end"]
        failed = [f.unix for f in self.failures if f.generation == generation - 1]
        noticed = min(starts) if starts else (min(failed) if failed else None)
        return AttemptInfo(launch=self.launch, inprocess=generation, activated_spare=activated_spare,
                           failure_noticed_unix=noticed if generation > 0 else None,
                           abort_end_unix=max(ends) if ends and generation > 0 else None,
                           progress_sink=self.watch_progress)

    def _finalize(self) -> None:
        """After a failed attempt: its clean-ups (last first), megatron-core's parallel state, the process group."""
        with self._lock:
            fns, self._cleanups = self._cleanups, []
        for fn in reversed(fns):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a clean-up must not stop the others
                logger.warning("in-process restart: clean-up %r failed: %s", fn, e)
        self._progress_source = None
        from megatron_patches.parallel_reset import reset_parallel_state

        try:
            reset_parallel_state()
        except Exception as e:  # noqa: BLE001 - judged by the hygiene check
            logger.warning("in-process restart: megatron-core parallel state: %s", e)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 - an aborted group may refuse a clean destroy
                logger.warning("in-process restart: destroy_process_group: %s", e)
        gc.collect()
        self.event("finalize_end")

    def _close_success(self) -> None:
        with self._lock:
            self._cleanups = []
        self._progress_source = None

    def _check_hygiene(self, generation: int) -> None:
        """Off the training path (between the finalisation and the next barrier): a process that leaks threads or
        memory across generations exits and is replaced. Thread names are compared with those before generation 0;
        resident memory with the process after the first failed generation (the growth over the next five at most
        ``inprocess.hygiene_rss_growth_mib``). Threads that finish on their own (a timeline picture being drawn)
        get a moment to do so."""
        from neighbor_ckpt.inprocess.hygiene import check

        from neighbor_ckpt.inprocess.hygiene import ProcessState

        limit = int(float(getattr(self.config, "hygiene_rss_growth_mib", 50.0)) * 2**20)
        if self._rss_reference is None:
            # Resident memory is measured from the first failed generation on: generation 0 builds what stays for
            # the process's life (the host slots' mappings, allocator arenas, lazily imported modules).
            self._rss_reference = (generation, ProcessState.capture().rss_bytes)
        first, rss = self._rss_reference
        baseline = dataclasses.replace(self._hygiene, rss_bytes=rss)
        for attempt in range(HYGIENE_TRIES):
            result = check(baseline, max(1, generation - first), allowed_prefixes=LIFETIME_THREADS,
                           rss_limit_bytes=limit)
            if result.ok or not result.extra_threads or attempt == HYGIENE_TRIES - 1:
                break
            time.sleep(0.5)
            try:  # a thread of the failed generation may still wait on a peer whose listener this abort missed
                self._abort_gloo(generation)
            except Exception as e:  # noqa: BLE001 - the look below decides
                logger.warning("%s: repeated abort of generation %d: %s", self._name(), generation, e)
        if not result.ok:
            logger.error("%s: not clean after generation %d (%s): exiting with status %d; the launcher starts a new "
                         "process in its place, which joins as a spare", self._name(), generation, result.summary(),
                         protocol.EXIT_HYGIENE)
            flush_logs()
            os._exit(protocol.EXIT_HYGIENE)


class _GiveUp(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_FAILED = object()
"""An attempt (or a spare's wait) ended with its generation's failure: go to the next generation."""


def parse_store_address(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 hosts in brackets or bare, the port after the last colon); ConfigError naming ``what``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"in-process recovery: {what} is {text!r}, not HOST:PORT")
    return host.strip("[]"), int(port)


def _refuse_legacy_env(env: Mapping[str, str]) -> None:
    try:
        from neighbor_ckpt.config import refuse_legacy_timer_env
    except ImportError:  # the config module's refusal lands with the new keys
        if env.get("NEIGHBOR_CKPT_INPROCESS_TIMERS"):
            raise ConfigError("NEIGHBOR_CKPT_INPROCESS_TIMERS is no longer read: set neighbor_ckpt.detector.* and "
                              "neighbor_ckpt.inprocess.* in the job file") from None
        return
    refuse_legacy_timer_env(env)
