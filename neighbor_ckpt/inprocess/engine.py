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

import gc
import logging
import os
import re
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional

import torch.distributed as dist

from neighbor_ckpt.config import DetectorConfig, InprocessConfig, NeighborCkptConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.inprocess import protocol
from neighbor_ckpt.inprocess.abort import GenerationAborted, SocketBaseline, clear_pending
from neighbor_ckpt.inprocess.assignment import Assignment, GiveUp, initial_assignment, next_assignment
from neighbor_ckpt.inprocess.completion import completed
from neighbor_ckpt.inprocess.engine_state import Attempt, EngineState
from neighbor_ckpt.inprocess.failover_replay import ReplayFacts, replay
from neighbor_ckpt.inprocess.generation_abort import GenerationAbort
from neighbor_ckpt.inprocess.generation import (BarrierTimeout, Fault, Fenced, GenerationFailure, GenerationStore,
                                                Members, QuorumLost, gate, quorum_set)
from neighbor_ckpt.inprocess.holdings import holdings_of, local_holdings
from neighbor_ckpt.inprocess.hygiene import HygieneGuard
from neighbor_ckpt.inprocess.identity import ProcessIdentity
from neighbor_ckpt.inprocess.monitor import IDLE_TAG, FailureListener, Monitor, Tag
from neighbor_ckpt.inprocess.peer_listeners import PeerListeners
from neighbor_ckpt.inprocess.quorum import LeaseGuard, MajorityLease, cut_off, cut_off_lease_s, guard_times
from neighbor_ckpt.inprocess.spare_slot import SPARE_SLOT_THREAD, SpareSlot
from neighbor_ckpt.inprocess.store_auth import TUNNEL_THREAD
from neighbor_ckpt.inprocess.store_clients import StoreClients, open_stores
from neighbor_ckpt.inprocess.stores import CLIENT_THREAD, StoreAddresses, StoreSet, StoresLost
from neighbor_ckpt.recovery.attempt import AttemptInfo
from neighbor_ckpt.recovery.reshard import ElasticPolicy
from neighbor_ckpt.runtime.procs import flush_logs, stall_report

__all__ = ["InprocessRecovery", "FALLBACK_EXIT_CODE"]

logger = logging.getLogger(__name__)

FALLBACK_EXIT_CODE = protocol.EXIT_FALLBACK
"""Exit status of every process when in-process recovery gives up (EX_TEMPFAIL): the launchers restart the job."""

PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
                       r"remote process exited|NCCL communicator was aborted", re.IGNORECASE)
"""What a collective raises when a peer process died (gloo's, NCCL's words)."""

LIFETIME_THREADS = ("neighbor_ckpt-inprocess-monitor", "neighbor_ckpt-inprocess-listener",
                    "neighbor_ckpt-inprocess-lease", CLIENT_THREAD,
                    TUNNEL_THREAD, "neighbor_ckpt-abort-watchdog", SPARE_SLOT_THREAD, "neighbor-ckpt-prefault-",
                    "TMonitor", "tqdm_monitor")
"""Threads that may outlive a generation: the engine's own (a spare's slot preparation included), tqdm's
progress-bar monitor (one per process, started by
the first progress bar; tqdm 4.70 names it ``tqdm_monitor``, older releases ``TMonitor``: a Megatron-Bridge survivor
failed the hygiene check on it)."""


class InprocessRecovery:
    """Our in-process recovery engine for one process (see the module docstring).

    Built from its parts, torchtitan's way: the configuration first, then the runtime objects.
    :meth:`from_config` reads them from the job file and the environment our launcher set, and is what a recipe
    calls.

    Args:
        config: the ``neighbor_ckpt.inprocess`` section (max restarts, barrier and abort timeouts, hygiene).
        identity: who this process is in the launch (:meth:`ProcessIdentity.from_env`).
        stores: the launch's stores and their failover (:func:`open_stores`).
        detector: the ``neighbor_ckpt.detector`` section (its timers drive the monitor).
        elastic: the world sizes the job may shrink to when no spare is left (None: give up instead).
        snapshots: the whole configuration (:meth:`from_config` passes it): with it, a hot spare prepares its own
            slot while it idles, where the host stores are (None: it does not).

    The configuration is checked where it is read (:class:`~neighbor_ckpt.config.NeighborCkptConfig`: the detector
    must be on with in-process recovery), the launch where it is read (:meth:`ProcessIdentity.from_env`).
    """

    def __init__(self, config: InprocessConfig, *, identity: ProcessIdentity, stores: StoreSet,
                 detector: Optional[DetectorConfig] = None, elastic: Optional[ElasticPolicy] = None,
                 snapshots: Optional[NeighborCkptConfig] = None) -> None:
        self.config = config
        self.detector = detector or DetectorConfig()
        self.identity = identity
        self.stores = stores
        """The launch's stores (primary and standbys) and the failover between them
        (:mod:`neighbor_ckpt.inprocess.stores`)."""
        self.stores.on_failover(self._on_store_failover)
        self.elastic = elastic
        self.snapshots = snapshots
        """The whole configuration, when given (:meth:`from_config`): where the host stores are, for the slot a hot
        spare prepares while it idles."""
        self.state = EngineState(process=identity.process)
        """The generations as this process knows them, shared with the collaborators below."""
        self.clients = StoreClients(stores, prefix=identity.prefix, connect_timeout_s=config.barrier_timeout_s)
        self.listeners = PeerListeners(self.state)
        self.aborts = GenerationAbort(self.state, listeners=self.listeners, clients=self.clients,
                                      store_ports=frozenset(p for _, p in identity.stores.addresses),
                                      abort_timeout_s=config.abort_timeout_s, stuck_after_s=self.detector.timeout_s)
        self.hygiene = HygieneGuard(allowed_prefixes=LIFETIME_THREADS,
                                    rss_limit_bytes=int(config.hygiene_rss_growth_mib * 2**20),
                                    reabort=self.aborts.reabort_after_finalize)
        self.spare_slot = None if snapshots is None else SpareSlot(
            snapshots, ranks=identity.active_world_size, launch_store=stores.torch_address,
            idle=lambda: self.state.current is None, name=self.state.name)
        self.gave_up: Optional[str] = None
        self._cleanups: list[Callable[[], None]] = []
        self._main_gens: Optional[GenerationStore] = None
        self._arm_lease: Callable[[], None] = lambda: None
        """Arms the cut-off lease when this process's first generation formed (set by :meth:`run`)."""
        self._monitor_gens: Optional[GenerationStore] = None
        self._listener: Optional[FailureListener] = None
        self._main_tid: Optional[int] = None
        self._progress_source: Optional[Callable[[], Tag]] = None
        self._attempt_info: Optional[AttemptInfo] = None
        self._was_active = False

    @classmethod
    def from_config(cls, config: "NeighborCkptConfig | InprocessConfig", *, model_parallel: int = 1,
                    batch_micro_batches: Optional[int] = None, ranks: Optional[int] = None,
                    store: Optional[str] = None, identity: Optional[ProcessIdentity] = None) -> "InprocessRecovery":
        """Built from the ``neighbor_ckpt.inprocess`` section and, given the whole configuration, its ``detector``
        and ``elastic`` sections (with ``model_parallel`` = TP x PP x CP and ``batch_micro_batches`` = global batch
        / micro-batch size of the job: the world sizes it may shrink to), for the process our launcher started
        (``identity``: read from the environment when None; ``store``: a recipe's ``--inprocess-store``, which wins
        over the launcher's). ``ranks``: the job's ranks, checked against the launch's active processes.

        Raises:
            ConfigError: the section is not enabled (the caller should run without the engine), the process was not
                started by our launcher, or the job file's spares or ranks are not the launch's.
        """
        whole = config if isinstance(config, NeighborCkptConfig) else None
        section = config.inprocess if isinstance(config, NeighborCkptConfig) else config
        if not section.enabled:
            raise ConfigError("neighbor_ckpt.inprocess.enabled is false: run the training function without "
                              "InprocessRecovery (or set neighbor_ckpt.inprocess.enabled=true)")
        identity = identity or ProcessIdentity.from_env(store=store)
        identity.require_spares(section.spares)
        if ranks is not None:
            identity.require_ranks(ranks)
        detector = whole.detector if whole is not None else DetectorConfig()
        elastic = None
        if whole is not None and whole.elastic.enabled:
            elastic = ElasticPolicy(model_parallel=model_parallel, min_data_parallel=whole.elastic.min_data_parallel,
                                    batch_micro_batches=batch_micro_batches)
        return cls(section, identity=identity, stores=open_stores(identity, detector=detector, inprocess=section),
                   detector=detector, elastic=elastic, snapshots=whole)

    # -- who this process is -----------------------------------------------------------------------------------

    @property
    def process(self) -> int:
        """The process index (stable for the process's life)."""
        return self.identity.process

    @property
    def initial_rank(self) -> int:
        """The rank this process was started as (its process index)."""
        return self.identity.process

    @property
    def world_size(self) -> int:
        """Processes of the launch, spares included."""
        return self.identity.processes

    @property
    def spares(self) -> int:
        return self.identity.spares

    @property
    def active_world_size(self) -> int:
        """The ranks of generation 0."""
        return self.identity.active_world_size

    @property
    def run_id(self) -> str:
        return self.identity.run_id

    @property
    def launch(self) -> int:
        """The launcher-level restart count."""
        return self.identity.launch

    @property
    def store_list(self) -> StoreAddresses:
        return self.identity.stores

    @property
    def current(self) -> Optional[Attempt]:
        """The attempt running now (None outside the training function)."""
        return self.state.current

    @property
    def events(self) -> list[dict[str, Any]]:
        """``{"iteration", "name", "unix"}`` of this process's generations (see :class:`EngineState`)."""
        return self.state.events

    @property
    def failures(self) -> list[GenerationFailure]:
        """The failures of the generations this process was part of, as recorded in the store."""
        return self.state.failures

    # -- the store ---------------------------------------------------------------------------------------------

    @property
    def store_host(self) -> str:
        """The current store's host (it changes with a failover)."""
        return self.stores.address()[0]

    @property
    def store_port(self) -> int:
        return self.stores.address()[1]

    def app_store(self) -> Any:
        """This process's client of the launch's store, under ``app/`` (for the application's own keys; the current
        store: ask again after a failover)."""
        return dist.PrefixStore("app/", self.clients.torch_client("app"))

    # -- events ------------------------------------------------------------------------------------------------

    def event(self, name: str, when: Optional[float] = None) -> float:
        """Record event ``name`` of the current generation (now, or at ``when``) for the recovery timeline."""
        return self.state.event(name, when)

    def idle_spares(self) -> list[int]:
        """The processes up now and given no rank in the current generation (hot spares, replacements that joined
        late included), as the store says: who can take the next lost rank. Any thread; one store round trip."""
        gens = GenerationStore(self.clients.view("main"), process=self.process)
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
        self.listeners.publish(self.clients.view("main"))
        self.event("pg_ready")

    def process_group_store(self) -> Any:
        """The store for this generation's default process group (frameworks that create the group themselves,
        e.g. NeMo's ``MegatronStrategy.store``)."""
        att = self._need_attempt()
        return dist.PrefixStore(protocol.key("gen", att.iteration, "pg") + "/", self.clients.torch_client("pg"))

    def on_restart(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` if this attempt fails, after the abort freed every blocked collective and before the
        next generation (last registered first). Errors are logged, not raised."""
        with self.state.lock:
            self._cleanups.append(cleanup)

    def watch_progress(self, source: Callable[[], Tag]) -> None:
        """The training thread's progress tag for the monitor (the checkpointer registers its own, once the
        framework's process groups exist: they are published now for the peers' aborts)."""
        self._progress_source = source
        self.listeners.publish(self.clients.view("main"))

    def mark_progress(self) -> None:
        """This attempt completed a training step (call once, after its first completed step)."""
        att = self._need_attempt()
        self.state.progressed.add(att.iteration)
        GenerationStore(self.clients.view("main"), process=self.process).mark_progress(att.iteration)
        self.listeners.publish(self.clients.view("main"))  # every group of the step exists now
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

    def _monitor_view(self) -> tuple[int, frozenset[int], Optional[Mapping[int, int]], bool]:
        a = self.state.assignment
        return self.state.generation, self.state.members, None if a is None else a.ranks, self.state.inside

    def _progress(self) -> Tag:
        src = self._progress_source
        if src is None or not self.state.inside:
            return IDLE_TAG
        try:
            return src()
        except Exception:  # noqa: BLE001 - a checkpointer being torn down
            return IDLE_TAG

    def _on_failure(self, failed: GenerationFailure) -> None:
        """Listener thread: the current generation failed. An active process aborts its groups and, if the training
        thread does not leave the training function on its own, raises into it (:mod:`~neighbor_ckpt.inprocess.
        generation_abort`)."""
        self.state.add_failure(failed)
        logger.warning("%s: generation %d failed (%s by %s): %s", self.state.name(), failed.generation, failed.kind,
                       failed.by, failed.reason)
        if self.state.inside and failed.generation == self.state.generation:
            self.aborts.free_training_thread(failed.generation, report_death=self._listener.gens.report_death)

    # -- a store failover ---------------------------------------------------------------------------------------

    def _on_store_failover(self, old: int, new: int, why: str) -> None:
        """The store moved (:meth:`StoreSet.lost` or ``follow_newer``, on the thread that saw it): write again, from
        this process's memory, what the new store must know (:mod:`~neighbor_ckpt.inprocess.failover_replay`), and
        listen for failures on the new store (the old listener may be blocked on the lost one)."""
        self.event("store_failover")
        st = self.state
        dead: dict[int, str] = {}
        for gens in (self._main_gens, self._monitor_gens, getattr(self._listener, "gens", None)):
            if gens is not None:
                dead.update(gens.seen_dead)
        g = st.generation
        known = st.failures_of(g)
        mine = self.listeners.mine
        facts = ReplayFacts(
            record=self.identity.record(), dead=dead, generation=g, members=st.members_record,
            assignment=st.assignment, progressed=g in st.progressed,
            finished_world_size=st.assignment.world_size if st.finished == g and st.assignment is not None else None,
            failure=known[0] if known else None, inside=st.inside,
            listeners=mine[1] if mine is not None and mine[0] == g else None, joining=st.joining)
        replay(GenerationStore(self.clients.view("failover"), process=self.process), facts, by=st.name(), why=why,
               new_store=self.store_list.describe(new))
        if self._listener is not None:
            self._listener = self._listener.successor(
                GenerationStore(self.clients.view(f"listener{new}"), process=self.process))
            self._listener.start()

    # -- the run loop ------------------------------------------------------------------------------------------

    def run(self, fn: Callable[[Attempt], Any]) -> Any:
        """Call ``fn(attempt)`` in generation after generation until the job completes. Returns ``fn``'s value
        (None on a spare never used); raises ``SystemExit(FALLBACK_EXIT_CODE)`` after one log line when in-process
        recovery gives up, ``SystemExit(EXIT_FENCED)`` when this process was declared dead; leaves with
        :data:`~neighbor_ckpt.inprocess.protocol.EXIT_CUT_OFF` (``os._exit``: nothing more is written) when it is
        cut off from the majority (no quorum, no promoted store, or its lease ran out:
        :mod:`~neighbor_ckpt.inprocess.quorum`)."""
        if completed(self.identity.complete_file, self.identity.run_id):
            return None  # the job completed before this process started (a late replacement): no store to ask
        self._main_tid = self.aborts.main_tid = threading.get_ident()
        main = self._main_gens = GenerationStore(self.clients.view("main"), process=self.process)
        self._monitor_gens = GenerationStore(self.clients.view("monitor"), process=self.process)
        first = main.current() if self.identity.is_replacement else 0
        self._listener = FailureListener(GenerationStore(self.clients.view("listener"), process=self.process),
                                         on_failure=self._on_failure, first=first)
        lease = MajorityLease(cut_off_lease_s(self.detector.timeout_s, self.detector.interval_s),
                              me=self.process, now=time.monotonic())
        monitor = Monitor(self._monitor_gens, state=self._monitor_view,
                          progress=self._progress, listener=self._listener,
                          interval_s=self.detector.interval_s, timeout_s=self.detector.timeout_s,
                          hang_timeout_s=self.detector.hang_timeout_s, stores=self.stores,
                          every_round=lambda: self.listeners.remember(self.clients.view("monitor")), lease=lease)
        doubt_s, grace_s = guard_times(self.stores, self.detector.timeout_s)
        guard = LeaseGuard(lease, answered_at=lambda: monitor.answered_at, epoch=lambda: self.stores.epoch,
                           name=self.state.name(), done=lambda: self.stores.over, lock=monitor.lease_lock,
                           doubt_s=doubt_s, grace_s=grace_s,
                           last_look=GenerationStore(self.stores.once("lease", self.identity.prefix),
                                                     process=self.process).complete)

        def arm_lease() -> None:
            with monitor.lease_lock:
                lease.arm(time.monotonic())

        self._arm_lease = arm_lease
        main.store.set(protocol.key("proc", self.process), self.identity.record())
        # Everything alive now (modules, the imports' objects) lives as long as the process: exempt it from
        # collection, so a generation's clean-up collects only what the generation made.
        gc.collect()
        gc.freeze()
        self.hygiene.capture()
        main.announce_ready()
        self._listener.start()
        monitor.start()
        guard.start()
        self.stores.start_following()
        try:
            return self._loop(fn, main)
        except Fenced as e:
            logger.error("%s: %s: exiting with status %d", self.state.name(), e, protocol.EXIT_FENCED)
            raise SystemExit(protocol.EXIT_FENCED) from None
        except (QuorumLost, StoresLost) as e:  # no majority, no promoted store: the others may go on without it
            cut_off(self.state.name(), str(e))
            raise  # not reached (os._exit)
        except _GiveUp as e:
            self.gave_up = e.reason
            main.give_up(e.reason)
            logger.error("neighbor_ckpt: in-process recovery gives up on process %d (%s): exiting with status %d so "
                         "the launcher restarts the job; recover() then resumes from the host stores",
                         self.process, e.reason, FALLBACK_EXIT_CODE)
            raise SystemExit(FALLBACK_EXIT_CODE) from None
        finally:
            guard.close()
            monitor.stop()
            self.stores.close()

    def _loop(self, fn: Callable[[Attempt], Any], main: GenerationStore) -> Any:
        assignment = initial_assignment(self.world_size, self.spares)
        expected: set[int] = set(range(self.world_size))
        generation = 0
        if self.identity.is_replacement:  # started by a launcher after generation 0: a spare from the next generation
            generation, assignment, expected = self._join_late(main)
            if generation < 0:
                return None  # the job completed meanwhile
        while True:
            reason = main.gave_up()
            if reason is not None:
                raise _GiveUp(f"another process gave up: {reason}")
            # every generation needs a majority of the last one's members that may still run (the first: of every
            # process of the launch): a minority cut off from the others (with the store, or a standby) must not go
            # on beside them, at start-up too
            last = quorum_set(generation, processes=self.world_size, last=self.state.members)
            if generation > 0:
                self._publish_holdings(main, generation)
            self.state.joining = generation
            try:
                members = main.join(generation, expected=expected, timeout_s=self.config.barrier_timeout_s,
                                    quorum_of=last)
            except BarrierTimeout as e:
                raise _GiveUp(str(e)) from None
            finally:
                self.state.joining = None
            self._arm_lease()  # formed: every member arrived and beats, the lease runs from here
            st = self.state
            st.generation, st.members, st.members_record = generation, members.members, members
            self.event("initialize")
            if generation > 0:
                assignment = self._next(main, assignment, members)
            self.state.assignment = assignment
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
            self.state.generation, self.state.members = g, members.members | {self.process}
            self.state.members_record = members
            logger.info("%s: started during generation %d: a spare from generation %d on", self.state.name(), g, g + 1)
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
            logger.warning("%s: could not say which snapshots this node holds: %s", self.state.name(), e)
            return
        main.publish_holdings(generation, held)

    def _next(self, main: GenerationStore, prev: Assignment, members: Members) -> Assignment:
        """The gate (identical on every process: the same canonical members, the same rules), then the ranks."""
        g = members.generation
        why = gate(members, max_restarts=self.config.max_restarts)
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
        logger.info("%s: generation %d: %s", self.state.name(), g, nxt.describe())
        return nxt

    def _idle(self, main: GenerationStore, generation: int) -> Any:
        """An idle spare: wait for the job to complete (None) or the generation to fail (:data:`_FAILED`); meanwhile
        its own slot is prepared for whichever rank it takes (:mod:`~neighbor_ckpt.inprocess.spare_slot`)."""
        self.event("idle")
        if self.spare_slot is not None:
            self.spare_slot.start()
        failed = main.wait_outcome(generation, self._listener.event(generation))
        return None if failed is None else _FAILED

    def _attempt(self, fn: Callable[[Attempt], Any], main: GenerationStore, generation: int,
                 assignment: Assignment, rank: int) -> Any:
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(assignment.world_size)
        att = Attempt(iteration=generation, rank=rank, world_size=assignment.world_size,
                      initial_rank=self.process, assignment=assignment)
        spare = self.process >= self.active_world_size
        self._attempt_info = self._make_attempt_info(main, generation, activated_spare=spare and not self._was_active)
        self._was_active = True
        if self._attempt_info.activated_spare:
            logger.info("neighbor_ckpt: hot spare (process %d) takes rank %d's place in generation %d", self.process,
                        rank, generation)
        self.listeners.baseline = SocketBaseline.capture()
        self.state.current = att
        self.event("enter")
        ok, result, error = False, None, None
        self.state.inside = True
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
            self.state.inside = False
            clear_pending(self._main_tid)
            self.state.current = None
        if ok:
            self.state.finished = generation
            main.finished(generation, assignment.world_size)
            failed = main.wait_outcome(generation, self._listener.event(generation))
            if failed is None:
                self._close_success()
                return result
        else:
            # A collective that lost its peer (a killed process: its launcher's report is on its way) does not make
            # this process the one at fault: the record then names nobody.
            lost_peer = PEER_LOST.search(error) is not None
            if not lost_peer and not self.state.failures_of(generation):
                # this process's own failure, the first sign of it: the fault is now (a lost peer's is its witness's;
                # an exception after the generation's failure is the abort's)
                main.record_fault(generation, Fault(time.time(), f"exception on {self.state.name()}"))
            why = ("a collective lost a peer: " if lost_peer else "") + error
            record = main.fail(generation, kind="exception", ranks=() if lost_peer else (self.process,),
                               reason=f"{self.state.name()}: {why}")
            if record.kind == "exception" and main.won(record):
                logger.error("%s: generation %d failed here: %s", self.state.name(), generation, error)
        with stall_report(f"{self.state.name()}: the clean-up of generation {generation}",
                          self.config.abort_timeout_s, logger, then=lambda: self.aborts.cleanup_stuck(generation)):
            self.aborts.abort(generation)  # free the peers (if the monitor has not yet)
            self._finalize()
        self._check_hygiene(generation)
        return _FAILED

    def _make_attempt_info(self, main: GenerationStore, generation: int, *, activated_spare: bool) -> AttemptInfo:
        """The attempt for the checkpointer: after a failure, when its fault happened (the earliest witness, read
        from the store), when this process noticed it and when its abort ended (the recovery timeline's events)."""
        if generation == 0:
            return AttemptInfo(launch=self.launch, inprocess=0, activated_spare=activated_spare,
                               progress_sink=self.watch_progress)
        prev = self.state.events_of(generation - 1)
        starts = [e["unix"] for e in prev if e["name"] == "abort_start"]
        ends = [e["unix"] for e in prev if e["name"] == "abort_end"]
        failed = [f.unix for f in self.state.failures_of(generation - 1)]
        noticed = min(starts) if starts else (min(failed) if failed else None)
        try:
            faults = main.faults(generation - 1)
        except Exception as e:  # noqa: BLE001 - the timeline then starts at the newest snapshot, as it says
            logger.warning("%s: when generation %d's fault happened is unknown: %s", self.state.name(),
                           generation - 1, e)
            faults = []
        fault = faults[0] if faults else None

        def lookup() -> tuple[float, str] | None:  # on the training thread, later in the recovery
            found = GenerationStore(self.clients.view("main"), process=self.process).faults(generation - 1)
            return (found[0].unix, found[0].what) if found else None

        return AttemptInfo(launch=self.launch, inprocess=generation, activated_spare=activated_spare,
                           failure_noticed_unix=noticed, abort_end_unix=max(ends) if ends else None,
                           fault_unix=None if fault is None else fault.unix,
                           fault_what=None if fault is None else fault.what, fault_lookup=lookup,
                           progress_sink=self.watch_progress)

    def _finalize(self) -> None:
        """After a failed attempt: its clean-ups (last first), megatron-core's parallel state, the process group."""
        with self.state.lock:
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
        with self.state.lock:
            self._cleanups = []
        self._progress_source = None

    def _check_hygiene(self, generation: int) -> None:
        """A process that leaks threads or memory across generations exits (its launcher brings a new one back as a
        spare): :class:`~neighbor_ckpt.inprocess.hygiene.HygieneGuard`."""
        result = self.hygiene.is_clean(generation, name=self.state.name())
        if not result.ok:
            logger.error("%s: not clean after generation %d (%s): exiting with status %d; the launcher starts a new "
                         "process in its place, which joins as a spare", self.state.name(), generation,
                         result.summary(), protocol.EXIT_HYGIENE)
            flush_logs()
            os._exit(protocol.EXIT_HYGIENE)


class _GiveUp(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_FAILED = object()
"""An attempt (or a spare's wait) ended with its generation's failure: go to the next generation."""
