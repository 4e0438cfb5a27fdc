"""The plain-loop API: per-iteration neighbor checkpointing for hand-written training loops.

Example (Megatron-LM / Megatron-Bridge style loop)::

    ckpt = NeighborCheckpointer(cfg, adapter=TorchOptimizerAdapter(model, opt), dp_group=dp_group)
    result = ckpt.recover()                       # all ranks, before the first step
    for step in range(result.next_step, max_steps):
        loss = model(batch(step)).mean()
        ckpt.wait()                               # before the gradient collectives of this step
        loss.backward()
        with ckpt.optimizer_step():               # step tag: weights are torn inside this block
            opt.step()
        ckpt.snapshot(step, user_state={"consumed": ...})
    ckpt.close()

On a failure, call :meth:`NeighborCheckpointer.on_failure` (the Lightning callback does it for you): the
redundant state is written to the host store by the surviving ranks, then the process exits and the
launcher restarts it; :meth:`recover` on the next attempt restores everything. The failure detector
(:mod:`neighbor_ckpt.runtime.detector`, on by default under ``env://`` rendezvous) notices a dead, stopped or stuck rank
within ``detector.timeout_s``, writes that backup from its own thread (the main thread may be blocked in a
collective) and makes the job restart; the launcher's SIGTERM triggers the same backup.

Reporting (rank 0, see :mod:`neighbor_ckpt.report.status`): a status line every ``report.status_every_n_steps``
snapshots (None: 10), :meth:`NeighborCheckpointer.stats` at any time, and after every recovery the timeline
(:attr:`NeighborCheckpointer.last_timeline`), written to ``report.dir`` or, for a plain loop,
``<store root>/<user>/reports/<job_id>/`` (next to the host store, on the node of rank 0).
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from neighbor_ckpt.adapters.base import StateAdapter
from neighbor_ckpt.config import NeighborCkptConfig, decide_job_id
from neighbor_ckpt.errors import CallOrderError, ConfigError, HostMemoryError, TopologyError
from neighbor_ckpt.recovery.attempt import AttemptInfo
from neighbor_ckpt.recovery.flow import RecoveryReport, Restored
from neighbor_ckpt.recovery.backup import FailureBackup, WeightsTag
from neighbor_ckpt.recovery.datacheck import SNAPSHOT_KEY, DataCheck, parse_mark
from neighbor_ckpt.recovery.elastic import Generations, rank_layout
from neighbor_ckpt.recovery.journal import read_failure_input, take_failure_event
from neighbor_ckpt.recovery.recoverer import InsuranceLoader, Recoverer, RecoveryResult, Reshard
from neighbor_ckpt.recovery.reshard import micro_batches_per_rank
from neighbor_ckpt.report.status import Reporter, SnapshotStats, replica_lag, resolve_status_interval
from neighbor_ckpt.report.timeline import (RankEvents, RecoveryTimeline, gather_rank_events, newest_commit_unix,
                                           process_start_unix, wait_for_renders)
from neighbor_ckpt.runtime import failpoints, reaper
from neighbor_ckpt.runtime.detector import Failure, FailureDetector, connect_store, local_ranks_from_env, os_instance
from neighbor_ckpt.runtime.launch_identity import report_leftovers, resolve_job_id
from neighbor_ckpt.runtime.launch_store import SlotCapacities
from neighbor_ckpt.runtime.preflight import check_host_memory
from neighbor_ckpt.snapshot.engine import SnapshotEngine
from neighbor_ckpt.snapshot.razor import ShardPlan, StateKind, plan_shards
from neighbor_ckpt.snapshot.rng import capture_rng, restore_rng
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore, discard_staged_slots, generation_dir, store_bytes_per_rank
from neighbor_ckpt.snapshot.topology import Topology, discover_topology
from neighbor_ckpt.snapshot.transport import NeighborTransport, TrafficGate
from neighbor_ckpt.snapshot.transport_kinds import make_transport
from neighbor_ckpt.validation import validate

logger = logging.getLogger(__name__)

__all__ = ["NeighborCheckpointer", "Phase", "check_setup", "elastic_cannot_shrink"]


class Phase(str, enum.Enum):
    """Step tags: what the live weights belong to (FlashRecovery's step tags)."""

    IDLE = "idle"
    """Weights belong to the last snapshotted iteration."""
    OPTIMIZER = "optimizer"
    """Inside an optimizer step: weights are torn, no backup may be taken from them."""
    STEPPED = "stepped"
    """The optimizer step finished but its snapshot has not been taken yet: weights belong to last + 1."""


def check_setup(config: NeighborCkptConfig | None, adapter: StateAdapter, *,
                attempt: AttemptInfo | None = None, env: Mapping[str, str] | None = None,
                global_batch: int | None = None, micro_batch_size: int | None = None) -> NeighborCkptConfig:
    """Pure: what :class:`NeighborCheckpointer` checks before any collective, with no process group needed. Returns
    the configuration (the defaults when None), validated again (attributes may have been set after construction).
    ``env``: the launcher's environment (default: this process's), the same on every rank of a launch, so every rank
    decides alike.

    Raises:
        ConfigError: ``config`` is not a :class:`NeighborCkptConfig` or is invalid; ``elastic`` is on with an adapter
            whose optimizer state cannot be re-partitioned for another data-parallel size, or where nothing can
            shrink (:func:`elastic_cannot_shrink`); ``global_batch`` / ``micro_batch_size`` given alone, below 1, or
            not dividing each other.
    """
    if config is not None and not isinstance(config, NeighborCkptConfig):
        raise ConfigError(f"NeighborCheckpointer expects a NeighborCkptConfig, got {type(config).__name__}; "
                          "build one with NeighborCkptConfig(...), .from_dict(...) or .from_yaml(...)")
    config = config or NeighborCkptConfig()
    validate(config, "neighbor_ckpt", types=True)
    if config.elastic.enabled and (not adapter.distributed_optimizer or adapter.dp_shards() is None):
        raise ConfigError(
            f"neighbor_ckpt.elastic.enabled: {type(adapter).__name__} keeps optimizer state that cannot be "
            "re-partitioned for another data-parallel size. Elastic resharding needs megatron-core's distributed "
            "optimizer (use_distributed_optimizer=True, MegatronOptimizerAdapter); turn elastic off otherwise")
    why = elastic_cannot_shrink(config, os.environ if env is None else env)
    if why:
        raise ConfigError(f"neighbor_ckpt.elastic.enabled: {why}")
    if (global_batch is None) != (micro_batch_size is None):
        raise ConfigError("NeighborCheckpointer: give global_batch= and micro_batch_size= together (the global "
                          "batch an elastic reshard keeps, in samples, and the samples per micro-batch), or neither")
    if global_batch is not None and micro_batch_size is not None:
        if global_batch < 1 or micro_batch_size < 1 or global_batch % micro_batch_size:
            raise ConfigError(f"NeighborCheckpointer: global_batch={global_batch} must be a positive multiple of "
                              f"micro_batch_size={micro_batch_size}")
    if attempt is None and config.inprocess.enabled:
        logger.warning("neighbor_ckpt: inprocess.enabled but no attempt= given: pass InprocessRecovery."
                       "attempt_info(), or in-process attempts share one attempt number (failure events, timeline)")
    return config


def elastic_cannot_shrink(config: NeighborCkptConfig, env: Mapping[str, str]) -> str:
    """Pure: why ``elastic.enabled`` can never change the data-parallel size of this job (empty: it can, or it is off).

    The data-parallel size changes in process (``inprocess.enabled``: the survivors go on with fewer ranks), or at a
    restart that comes back with another world size: a multi-node torchrun (``--nnodes MIN:MAX`` re-forms with the
    nodes left), or a later launch that reads this job's snapshots (a job id that outlives the launch:
    ``neighbor_ckpt.job_id``, ``NEIGHBOR_CKPT_JOB_ID``, torchrun's ``--rdzv-id``). Nothing can when a single torchrun
    agent (one node: ``GROUP_WORLD_SIZE`` 1) restarts every rank at the same size and the job id is one neighbor_ckpt
    made for this launch only (torchrun without ``--rdzv-id``): no later launch ever reads these snapshots."""
    if not config.enabled or not config.elastic.enabled or config.inprocess.enabled:
        return ""
    if "TORCHELASTIC_RUN_ID" not in env or env.get("GROUP_WORLD_SIZE", "") != "1":
        return ""
    if decide_job_id(env, config.job_id).source != "launch":
        return ""
    return ("nothing can shrink this job: one torchrun agent restarts every rank with the same world size, no rank "
            "is kept alive after a failure, and its job id is made for this launch only, so no later launch on fewer "
            "ranks reads its snapshots. Set neighbor_ckpt.inprocess.enabled: true and launch with our launcher "
            "(`neighbor-ckpt launch` arranges it) for the survivors to go on with fewer ranks; or name the job "
            "(neighbor_ckpt.job_id, NEIGHBOR_CKPT_JOB_ID or torchrun --rdzv-id) so that a launch on fewer ranks "
            "reshards these snapshots; or turn elastic off")


class NeighborCheckpointer:
    """Per-iteration snapshots of a rank's unique state, neighbor replication and recovery.

    Every rank of the job constructs one (it creates a gloo process group, a collective).

    Args:
        config: the ``neighbor_ckpt`` configuration (defaults if None).
        adapter: reads/writes the model + optimizer state.
        dp_group: this rank's data-parallel group (None: the whole world is one DP group).
        model_parallel_coord: (tp, pp, cp) coordinate of this rank, for the layout identity.
        insurance: loads the last persistent checkpoint when no in-memory version is complete.
        capture_rng_state: carry python/numpy/torch RNG states in every snapshot.
        handle_sigterm: on SIGTERM (what torchrun sends survivors when a rank dies) write the lazy backup,
            then hand the signal on to the previous handler (or the default action).
        attempt: which attempt of the job this is (default: the launcher's restart count alone); under in-process
            recovery :meth:`InprocessRecovery.attempt_info() <neighbor_ckpt.inprocess.InprocessRecovery.attempt_info>`
            gives it, so in-process attempts do not share detector keys, failure events or timeline files.
        global_batch, micro_batch_size: the job's global batch (samples per optimizer step, over every DP rank and
            micro-batch) and micro-batch size, given together. Each rank then trains :attr:`micro_batches` =
            ``global_batch / (micro_batch_size x DP)`` per step in every layout: a data-parallel size that does not
            divide the global batch is refused at construction, before an elastic reshard changes anything, and the
            recovery report says which global batch a reshard keeps. None: the training loop alone decides it.

    Collectives on the snapshot group (:attr:`group`, gloo), one place per phase, in this order on every rank
    (gloo hangs when ranks disagree, so each "whether" below depends only on gathered data or the configuration):

    1. construction (:meth:`_setup_collectives`, after the pure checks of :func:`check_setup`): the group itself
       (``new_group``), then the failure detector agreement (one all-reduce, where the configuration wants a
       detector: :meth:`_agree_on_detector`), then the topology all-gather (:func:`discover_topology`), then the
       store generation all-gather (:class:`~neighbor_ckpt.recovery.elastic.Generations`);
    2. :meth:`recover`: the :class:`~neighbor_ckpt.recovery.recoverer.Recoverer`'s (journal verdict, inventory
       exchange, per round: transfers + restore verdict; or the elastic reshard's), then the timeline gather
       (:meth:`_gather_recovery_events`);
    3. the first :meth:`snapshot`: the preflight verdict (:meth:`_preflight_host_memory`, one all-reduce);
    4. every :meth:`snapshot`: the ring transport's point-to-point streaming, on its own thread (pairs only);
    5. after an elastic reshard, from the second :meth:`snapshot` on until it succeeds: the release verdict
       (:meth:`Generations.maybe_release <neighbor_ckpt.recovery.elastic.Generations.maybe_release>`, one
       all-reduce);
    6. :meth:`close` on success: one barrier.
    """

    def __init__(self, config: NeighborCkptConfig | None = None, *, adapter: StateAdapter,
                 dp_group: dist.ProcessGroup | None = None, model_parallel_coord: tuple[int, ...] = (),
                 insurance: InsuranceLoader | None = None, capture_rng_state: bool = True,
                 handle_sigterm: bool = True, attempt: AttemptInfo | None = None, global_batch: int | None = None,
                 micro_batch_size: int | None = None) -> None:
        # Construction in three steps: the policy checks (pure, check_setup), the collectives every rank runs in the
        # same order (_setup_collectives), then the wiring of plain objects from their results (the rest of __init__).
        self.config = check_setup(config, adapter, attempt=attempt, global_batch=global_batch,
                                  micro_batch_size=micro_batch_size)
        self.attempt = attempt if attempt is not None else AttemptInfo.from_env()
        if not dist.is_available() or not dist.is_initialized():
            raise TopologyError("NeighborCheckpointer needs torch.distributed to be initialized first")
        group_ready = time.time()  # the default process group exists: a marker of the recovery timeline
        self.adapter = adapter
        self.dp_group = dp_group
        self.capture_rng_state = capture_rng_state
        self._tag: tuple[int, int | None, str] = (0, None, "startup")
        self._weights_seq = 0
        self._recovered = False
        self.job_identity = resolve_job_id(self.config)
        """The job id and where it came from (a torchrun launch without a run id gets one of its own)."""
        self._setup_collectives(dp_group=dp_group, model_parallel_coord=model_parallel_coord)
        self.global_batch = global_batch
        """The global batch the job keeps in every layout (None: not given; the training loop decides it)."""
        self.micro_batches: int | None = None
        """Micro-batches per rank per step in this layout (``global_batch / (micro_batch_size x DP)``; None when the
        global batch was not given)."""
        if global_batch is not None and micro_batch_size is not None:
            # Before any reshard: DP size and batch are the same on every rank, so every rank refuses alike.
            self.micro_batches = micro_batches_per_rank(global_batch, micro_batch_size, self.topology.dp_size)
        # -- the wiring: plain objects built from the collectives' results --
        self.store = HostStore(self.config.resolved_store_dir(), job_id=self.job_identity.job_id,
                               rank=self.topology.rank, versions=self.config.store.versions,
                               use_checksum=self.config.store.checksum != "none",
                               generation=self.generations.generation)
        if self.config.store.reap_orphans:
            reaper.reap_previous(self.store.dir, rank=self.topology.rank)
        reaper.record(self.store.dir)
        if self.job_identity.source == "launch":  # an earlier launch's store under this root is never loaded: say so
            report_leftovers(self.store.user_dir, self.store.job_id, self.topology.rank)
        self.slot_capacities = SlotCapacities(job_id=self.job_identity.job_id, generation=self.generations.generation)
        """Own-slot capacities of every rank, in the launch's store (what a replaced rank prepares its slot from)."""
        self._published_capacities: tuple[int, int, int] | None = None
        self._prepare_receive_slot()
        discard_staged_slots()  # staged under another root or job than this store's: its memory back now
        self.datacheck = DataCheck(self.config.data_check if self.config.enabled else "off",
                                   store_dir=self.store.dir, rank=self.topology.rank)
        """The data-position check (``data_check``): input fingerprints, compared after a recovery."""
        self.gate = TrafficGate()
        self.link: NeighborTransport = make_transport(self.config.transport, topology=self.topology,
                                                      store=self.store, group=self.group, gate=self.gate)
        """The transport (``transport.kind``) every snapshot byte between ranks goes through: a recovery's transfers,
        then the streaming (:attr:`transport` once started)."""
        self.recoverer = Recoverer(store=self.store, topology=self.topology, transport=self.link,
                                   insurance=insurance, attempt=self.attempt.ordinal)
        """Decides and runs every recovery outcome; owns the restore journal."""
        self.failure = FailureBackup(store=self.store, topology=self.topology, attempt=self.attempt.record,
                                     enabled=self.config.lazy_backup.enabled, weights=self._weights_tag,
                                     inflight_input=self.datacheck.failure_extras)
        """The failure path: the failure event and the lazy backup, once each."""
        self.plan: ShardPlan | None = None
        self.engine: SnapshotEngine | None = None
        self.transport: NeighborTransport | None = None
        self._phase = Phase.IDLE
        self.last_iteration: int | None = None
        self._restored_input: Any = None  # the restored snapshot's input fingerprint (the data check's)
        self.last_report: RecoveryReport | None = None
        self.last_timeline: RecoveryTimeline | None = None
        """Timeline of the last recovery (rank 0, once the first step after it ended; None elsewhere)."""
        self.reporter = Reporter(
            self.config.report, rank_zero=self.topology.rank == 0, attempt=self.attempt,
            every_n_steps=resolve_status_interval(self.config.report.status_every_n_steps, None),
            report_dir=Path(self.config.report.dir) if self.config.report.dir
            else self.store.user_dir / "reports" / self.store.job_id,
            process_group_ready=group_ready)
        """Status line, metrics and recovery timeline; the Lightning callback attaches the trainer's."""
        if global_batch is not None and micro_batch_size is not None:
            self.reporter.batch = (global_batch, micro_batch_size)
        self._first_snapshot: int | None = None
        self._closed = False
        self._prev_sigterm: Any = None
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.detector is not None:
            # Every rank published its heartbeat before discover_topology's collective: all keys exist now.
            self.detector.cache_local_peers()
            self.detector.start()
        logger.info("rank %d: neighbor_ckpt store %s, DP ring %s (successor %d)", self.topology.rank,
                    self.store.dir, list(self.topology.ring), self.topology.successor)

    def _setup_collectives(self, *, dp_group: dist.ProcessGroup | None, model_parallel_coord: tuple[int, ...]) -> None:
        """Construction's collectives, in the class docstring's order (phase 1), the same on every rank:

        1. the snapshot group itself (``new_group``, on the default group): :attr:`group`;
        2. where the configuration wants a failure detector, whether every rank has one (one all-reduce,
           :meth:`_agree_on_detector`): :attr:`detector`. Each rank's detector publishes its heartbeat before the next
           step's collective, so every heartbeat key exists once it returns;
        3. the topology all-gather (:func:`discover_topology`): :attr:`topology`;
        4. the store generation all-gather (:class:`~neighbor_ckpt.recovery.elastic.Generations`): :attr:`generations`.
        """
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.config.transport.timeout_s))
        self.detector = self._agree_on_detector(self._make_detector())
        """Heartbeat failure detection (None when off, or when the rendezvous store is not reachable by address
        from some rank: it runs on every rank or on none)."""
        self.topology: Topology = discover_topology(world_group=self.group, dp_group=dp_group,
                                                    policy=self.config.ring.policy,
                                                    model_parallel_coord=model_parallel_coord)
        self.generations = Generations(root=self.config.resolved_store_dir(), job_id=self.job_identity.job_id,
                                       topology=self.topology, group=self.group, elastic=self.config.elastic.enabled)
        """The store generation this layout uses, and whether :meth:`recover` reshards into it from the previous one
        (the newest snapshots have another world or data-parallel size and ``elastic`` is on)."""

    def _prepare_receive_slot(self) -> None:
        """A rank whose store holds no own slot (a replaced node, an activated hot spare) will pull its state into
        a new one: start making it now, in the background, with the capacities this rank published before its
        failure (:mod:`neighbor_ckpt.runtime.launch_store`), so its memory is there when the pull starts."""
        if not self.config.enabled or self.store.has_files(ROLE_OWN):
            return
        caps = self.slot_capacities.lookup(self.topology.rank)
        if caps is None:
            return  # a first launch: nothing published yet
        self.store.pull_bounds[ROLE_OWN] = caps  # the image pulled into it may be no larger (HostStore.ensure_pulled)
        if self.store.prefault(ROLE_OWN, header_cap=caps[0], payload_cap=caps[1], extras_cap=caps[2]):
            preparing = self.store.preparing
            if preparing is not None and preparing.staged:
                logger.info("rank %d: neighbor_ckpt: empty host store; taking the own slot prepared %s (%.1f MiB)",
                            self.topology.rank, preparing.staged_when, caps[1] / 2**20)
                return
            logger.info("rank %d: neighbor_ckpt: empty host store; preparing its %.1f MiB own slot in the background "
                        "for the recovery's pull", self.topology.rank, caps[1] / 2**20)

    def _detector_wanted(self) -> bool:
        """Whether the configuration runs the failure detector: the same answer on every rank (the configuration and
        the world size), unlike whether this rank could connect to the rendezvous store."""
        return self.config.detector.enabled and dist.get_world_size() >= 2 and not self.config.inprocess.enabled

    def _agree_on_detector(self, mine: FailureDetector | None) -> FailureDetector | None:
        """Collective where a detector is wanted: keep it only if every rank has one. A rank without one (its
        store connection failed) would never beat, and the others' detectors would take it for a failed rank and
        stop the job; ``close()``'s barrier needs the same answer on every rank too."""
        if not self._detector_wanted():
            return mine
        have = torch.tensor([0 if mine is None else 1], dtype=torch.int64)
        dist.all_reduce(have, op=dist.ReduceOp.MIN, group=self.group)
        if int(have.item()) == 1:
            return mine
        if mine is not None:
            mine.stop(done=False)
            logger.warning("rank %d: neighbor_ckpt: failure detector off on every rank: another rank could not reach "
                           "the rendezvous store (its log says why); hangs are noticed only when collectives time "
                           "out", dist.get_rank())
        return None

    def _make_detector(self) -> FailureDetector | None:
        cfg = self.config.detector
        if not cfg.enabled or dist.get_world_size() < 2:
            return None
        if self.config.inprocess.enabled:
            # In process the engine's monitor thread is the detector (same decisions and timers, for the process's
            # whole life, acting by aborting in place instead of exiting): it gets this checkpointer's progress tag.
            if self.attempt.progress_sink is not None:
                self.attempt.progress_sink(lambda: self._tag)
            return None
        try:
            store = connect_store(cfg.timeout_s)
        except Exception as e:  # noqa: BLE001 - detection is an addition; training goes on without it
            logger.warning("neighbor_ckpt: failure detector off: cannot connect to the rendezvous store: %s", e)
            return None
        if store is None:
            logger.warning("neighbor_ckpt: failure detector off: MASTER_ADDR/MASTER_PORT are not set (a process group "
                           "initialized without env://); hangs are noticed only when collectives time out")
            return None
        rank, world = dist.get_rank(), dist.get_world_size()
        return FailureDetector(
            store, prefix=f"neighbor_ckpt/{self.job_identity.job_id}/{self.attempt.label}", rank=rank,
            world_size=world, local_ranks=local_ranks_from_env(rank, world), node=os_instance(),
            progress=lambda: self._tag, on_failure=self._on_detected, interval_s=cfg.interval_s,
            timeout_s=cfg.timeout_s, hang_timeout_s=cfg.hang_timeout_s, kill_local=cfg.kill_local)

    @property
    def phase(self) -> Phase:
        """Step tag of the live weights (see :class:`Phase`); set by the training thread."""
        return self._phase

    @phase.setter
    def phase(self, value: Phase) -> None:
        self._weights_seq += 1  # a backup taken by the detector thread across this change is discarded
        self._phase = value
        self.mark("done" if value is Phase.IDLE else value.value)

    def mark(self, phase: str) -> None:
        """Progress tag for the failure detector (``forward``, ``backward``, ``paused`` during validation, ...).

        One tuple assignment on the training thread; the step tags and :meth:`snapshot` set theirs."""
        counter, _, _ = self._tag
        self._tag = (counter + 1, self.last_iteration, phase)

    def _on_detected(self, failure: Failure) -> None:
        """Detector thread: back up the redundant state before the process leaves (the main thread may be blocked
        inside a collective with the failed rank)."""
        self.on_failure(f"{failure.kind}: {failure.reason}", background=True)

    # -- identity --------------------------------------------------------------------------------------

    def layout(self) -> str:
        """Identity of the job layout: model tensors, optimizer family, parallel configuration."""
        key = {
            "adapter": type(self.adapter).__name__,
            # Parameters only: optimizer state may not exist yet (torch optimizers create it lazily).
            "model": [(m.name, str(m.dtype), list(m.shape)) for m, _ in self.adapter.named_tensors()
                      if m.kind in (StateKind.WEIGHT, StateKind.MAIN_PARAM)],
            "world_size": self.topology.world_size,
            "dp_ranks": list(self.topology.dp_ranks),
            "coord": list(self.topology.model_parallel_coord),
            "adapter_layout": self.adapter.layout_key(),
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]

    # -- recovery --------------------------------------------------------------------------------------

    def recover(self) -> RecoveryResult:
        """Collective: restore the latest version every rank can restore, or fall back (insurance, fresh start).

        The decision is the :class:`~neighbor_ckpt.recovery.recoverer.Recoverer`'s; this applies it. Collectives on
        the snapshot group, in order: the recoverer's (journal verdict, inventory exchange, per round transfer +
        restore verdict), then the timeline gather (:meth:`_gather_recovery_events`) after a restore or an
        insurance load, when the reporter wants the timeline (the same configuration on every rank)."""
        self.datacheck.refuse_if_stopped()
        started = time.time()
        last_commit = newest_commit_unix(self.store)
        failure_input = parse_mark(read_failure_input(self.failure.events_path))
        self._restored_input = None
        noticed = take_failure_event(self.failure.events_path, not_after=started)
        reshard = None
        if self.generations.reshard_from is not None:
            reshard = Reshard(self.generations.reshard_from, rank_layout(self.adapter, self.topology))
        with self.reporter.progress() as progress:
            result = self.recoverer.recover(layout=self.layout(), load=self._load, on_phase=progress.phase,
                                            reshard=reshard)
        prepared = self.store.prepared
        if prepared is not None and prepared.used:
            when = prepared.staged_when if prepared.staged else "from this rank's construction on"
            result.report.notes.append(f"pulled into a slot prepared in advance ({prepared.seconds:.3f} s in the "
                                       f"background, {when}, from the capacities in the launch's store; the pull "
                                       f"waited {prepared.waited:.3f} s for it)")
        if result.report.resharded and self.micro_batches is not None:
            result.report.notes.append(
                f"global batch {self.global_batch} samples kept: {self.micro_batches} micro-batch(es) of "
                f"{self.global_batch // (self.micro_batches * self.topology.dp_size)} per rank at data-parallel size "
                f"{self.topology.dp_size}")
        self.last_report = result.report
        self._recovered = True
        if result.report.resharded:
            # Another data-parallel size deals the samples to other ranks: the global batch's order-independent sample
            # sum is compared instead, at the end of the replayed step (collective, here and in snapshot()).
            self.datacheck.arm_reshard(result.next_step, group=self.group, old_world=self.generations.info.world_before
                                       or 0, old_generation=generation_dir(self.store.root, self.store.job_id,
                                                                           self.generations.reshard_from or 0),
                                       restored_iteration=result.iteration)
        else:
            self.datacheck.arm(result.next_step, restored=result.restored, restored_iteration=result.iteration,
                               snapshot_input=self._restored_input, failure_input=failure_input)
        if not result.restored:
            return result
        self.last_iteration = result.iteration
        if self.reporter.wants_recovery_events:
            # Same outcome on every rank (the decision is collective), so every rank takes part.
            self._gather_recovery_events(result.report, started=started, last_commit=last_commit, noticed=noticed)
        return result

    def _load(self, restored: Restored) -> None:
        """Apply a validated in-memory version to the live state: tensors, regenerated weights, RNG."""
        extras = restored.extras
        self._restored_input = extras.get(SNAPSHOT_KEY)
        self.adapter.load(restored.tensors, extras["adapter"])
        failpoints.failpoint("recovery.load")
        self.adapter.regenerate(self.dp_group)
        if self.capture_rng_state and "rng" in extras:
            restore_rng(extras["rng"])

    def _prepared_slot_wait(self) -> float | None:
        prepared = self.store.prepared
        return prepared.waited if prepared is not None and prepared.used else None

    def _gather_recovery_events(self, report: RecoveryReport, *, started: float, last_commit: float | None,
                                noticed: float | None) -> None:
        """Collective: every rank's wall-clock events of this recovery to rank 0 (one small all-gather)."""
        ph = report.phases
        reconcile_end = started + ph.get("inventory", 0.0) + ph.get("exchange", 0.0)
        att = self.attempt  # in process: this survivor's abort of the failed attempt, a spare's activation
        known = [t for t in (noticed, att.failure_noticed_unix) if t is not None]
        fault = att.fault() if att.inprocess > 0 else None  # asked again: a witness's record may have come late
        mine = RankEvents(last_snapshot=last_commit, failure_noticed=min(known) if known else None,
                          process_start=process_start_unix(), process_group_ready=self.reporter.process_group_ready,
                          recovery_start=started, reconcile_end=reconcile_end,
                          transfer_end=reconcile_end + ph.get("transfer", 0.0), restore_end=time.time(),
                          abort_end=att.abort_end_unix, activated_spare=1.0 if att.activated_spare else 0.0,
                          prepared_slot_wait=self._prepared_slot_wait(), fault=fault[0] if fault else None)
        per_rank = gather_rank_events(mine, self.group)
        self.reporter.begin_timeline(per_rank, outcome=report.outcome, iteration=report.iteration,
                                     recovery_phases=ph,
                                     data_parallel=(report.data_parallel_before, report.data_parallel_after))

    # -- per iteration ---------------------------------------------------------------------------------

    def _start(self) -> None:
        tensors = self.adapter.named_tensors()
        self.plan = plan_shards([m for m, _ in tensors], dp_size=self.topology.dp_size,
                                distributed_optimizer=self.adapter.distributed_optimizer)
        live = {m.name: t for m, t in tensors}
        self._preflight_host_memory()
        if self.config.transport.enabled and self.topology.dp_size > 1:
            self.transport = self.link
            self.transport.start()
        unique = {p.meta.name for p in self.plan.unique}
        meta = {"world_size": self.topology.world_size, "dp_ranks": list(self.topology.dp_ranks),
                "ring": list(self.topology.ring), "has_lazy": self.plan.has_lazy,
                "unique_bytes": self.plan.unique_bytes, "lazy_bytes": self.plan.lazy_bytes,
                **self.generations.snapshot_meta(self.adapter, unique)}  # what an elastic reshard reads
        self._layout = self.layout()
        self.failure.arm(self.plan, [live[p.meta.name] for p in self.plan.lazy], self._layout)
        self.engine = SnapshotEngine(store=self.store, plan=self.plan,
                                     sources=[live[p.meta.name] for p in self.plan.unique], layout=self._layout,
                                     meta=meta, transport=self.transport,
                                     wait_for_replica=self.config.transport.wait_for_replica,
                                     extras_capacity=None if self.config.store.extras_capacity_mb is None
                                     else int(self.config.store.extras_capacity_mb * 2**20))
        logger.info("rank %d: neighbor_ckpt plan: %d unique tensors (%d bytes), %d regenerable, %d lazy (%d bytes)",
                    self.topology.rank, len(self.plan.unique), self.plan.unique_bytes, len(self.plan.regenerable),
                    len(self.plan.lazy), self.plan.lazy_bytes)

    def _preflight_host_memory(self) -> None:
        """Collective: every rank raises :class:`HostMemoryError` before allocating a slot if the store does not fit
        on any rank's node (a rank that failed alone would leave the others hanging in the next collective)."""
        assert self.plan is not None  # noqa: S101
        ecap = self.config.store.extras_capacity_mb
        chk = check_host_memory(self.store.root, self.store.gen_dir, need_per_rank=store_bytes_per_rank(
            unique_bytes=self.plan.unique_bytes, lazy_bytes=self.plan.lazy_bytes if self.plan.has_lazy else 0,
            versions=self.store.versions, extras_bytes=None if ecap is None else int(ecap * 2**20)))
        failed = torch.tensor([0 if chk.ok else 1], dtype=torch.int64)
        dist.all_reduce(failed, group=self.group)
        if not chk.ok:
            raise HostMemoryError(f"rank {self.topology.rank}: {chk.message()}")
        if int(failed.item()):
            raise HostMemoryError(f"rank {self.topology.rank}: the host store does not fit on the node of "
                                  f"{int(failed.item())} other rank(s); their error gives the numbers")
        logger.debug("rank %d: host-memory preflight: %s", self.topology.rank, chk)

    def observe_input(self, batch: Any) -> None:
        """The data-position check's input: call with each micro-batch of a step (its token ids, or a batch holding
        them: see :func:`~neighbor_ckpt.recovery.datacheck.token_tensor`) before it trains; the first one of each step
        is fingerprinted (xxh3-64, a few microseconds). After a recovery the replayed step's fingerprint is compared
        with the one recorded before the failure: ``data_check: error`` raises
        :class:`~neighbor_ckpt.errors.DataPositionError` on a mismatch, ``warn`` logs, ``off`` does nothing.
        ``megatron_patches.install_hooks(...).observe(data_iterator)`` and the Lightning callback call it for you."""
        self.datacheck.observe(batch)

    def _require_recovered(self, call: str) -> None:
        if not self._recovered:
            raise CallOrderError(
                f"rank {self.topology.rank}: {call} was called before recover(): call ckpt.recover() on every rank "
                "after building the NeighborCheckpointer and before the first training step (it restores the "
                "latest snapshot, or tells you to start fresh); a snapshot taken first would be taken for this "
                "job's latest state at the next recovery")

    def wait(self) -> None:
        """The wait point: call before this step's gradient collectives (``snapshot`` calls it too).

        Raises:
            CallOrderError: before :meth:`recover` (as do :meth:`optimizer_step` and :meth:`snapshot`)."""
        self._require_recovered("wait()")
        if self.engine is not None:
            self.engine.wait()

    def begin_optimizer_step(self) -> None:
        """Step tag: the wait point, then "weights are torn" until :meth:`end_optimizer_step`."""
        self._require_recovered("optimizer_step()")
        self.wait()
        self.phase = Phase.OPTIMIZER

    def end_optimizer_step(self) -> None:
        """Step tag: the optimizer step returned; weights belong to the next iteration."""
        self.phase = Phase.STEPPED

    @contextlib.contextmanager
    def optimizer_step(self) -> Iterator[None]:
        """Tag the optimizer step so a failure inside it never backs up torn weights."""
        self.begin_optimizer_step()
        yield
        self.end_optimizer_step()

    def snapshot(self, iteration: int, user_state: Any = None) -> None:
        """Snapshot the state after optimizer step ``iteration``. Returns at once; the copy runs behind.

        On rank 0 this is also where the status line is due (every ``report.status_every_n_steps``
        iterations, about the previous, completed snapshot) and where the first step after a recovery ends
        (the recovery timeline is written then)."""
        self._require_recovered("snapshot()")
        if not self.config.enabled:
            return
        step_end = time.time() if self.reporter.timeline_pending else None
        if self.engine is None:
            self._start()
            self._first_snapshot = iteration
        assert self.engine is not None  # noqa: S101
        caps = self.engine.own_capacities
        if caps is not None and caps != self._published_capacities:  # once per layout (the first snapshot sizes it)
            self._published_capacities = caps
            self.slot_capacities.publish(self.topology.rank, caps)
        if self.reporter.status_due(iteration):
            self.reporter.emit_status(iteration, self.stats())
        extras: dict[str, Any] = {"adapter": self.adapter.capture_extras(), "user": user_state}
        if self.capture_rng_state:
            extras["rng"] = capture_rng()
        self.datacheck.before_snapshot(iteration)  # after an elastic reshard: the global batch (collective, once)
        seen = self.datacheck.snapshot_extras(iteration)
        if seen is not None:
            extras[SNAPSHOT_KEY] = seen
        self.engine.snapshot(iteration, extras)
        if self.generations.release_pending and self._first_snapshot is not None and iteration > self._first_snapshot:
            es = self.engine.stats
            self.generations.maybe_release(first_snapshot=self._first_snapshot, committed=es.iteration,
                                           replicated=es.replicated_iteration if self.transport is not None else None)
        self.datacheck.step_done(iteration)
        self.recoverer.step_completed()  # a step completed after a restore: that state did not fail
        if self.plan is not None and self.plan.has_lazy:
            # Survivors back up their weights as of their last optimizer step. For a lost rank's state to
            # match them, its snapshot of this iteration must reach the successor before it moves on. Under
            # plain DDP that snapshot is a few KB (RNG, counters), so replicate it synchronously.
            self.engine.drain()
        self.last_iteration = iteration
        self.phase = Phase.IDLE
        if step_end is not None:
            self.last_timeline = self.reporter.finish_timeline(step_end, step=iteration)

    def stats(self) -> SnapshotStats:
        """This rank's snapshot figures now: last snapshot and wait times, bytes, replica lag, streaming.

        Cheap (no collective, a few ``stat`` calls for the host store size); meant for the log interval."""
        eng, tr = self.engine, self.transport
        if eng is None:
            return SnapshotStats(iteration=-1, snapshot_s=0.0, wait_s=0.0,
                                 unique_bytes=self.plan.unique_bytes if self.plan is not None else 0, extras_bytes=0,
                                 replicated_iteration=None, replica_lag=None, streaming=False, stream_bytes=0,
                                 stream_seconds=0.0, host_store_bytes=self.store.host_bytes())
        es = eng.stats
        replicated = es.replicated_iteration if tr is not None and es.replicated_iteration >= 0 else None
        return SnapshotStats(
            iteration=es.iteration, snapshot_s=es.stage_seconds + es.commit_seconds, wait_s=es.wait_seconds,
            unique_bytes=es.unique_bytes, extras_bytes=es.extras_bytes, replicated_iteration=replicated,
            replica_lag=None if tr is None else replica_lag(es.iteration, replicated, self._first_snapshot),
            streaming=tr is not None and tr.healthy, stream_bytes=tr.bytes_sent if tr is not None else 0,
            stream_seconds=tr.send_seconds if tr is not None else 0.0, host_store_bytes=self.store.host_bytes(),
            failures=es.failures)

    # -- failure ---------------------------------------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.on_failure("SIGTERM from the launcher")
        prev = self._prev_sigterm
        signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
        if callable(prev):
            prev(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_failure(self, reason: str = "", *, background: bool = False) -> bool:
        """Write the redundant state (lazy backup) of this rank's DP group; True if written.

        Safe to call from an exception handler or a SIGTERM handler on the main thread, and from the failure
        detector's thread (``background``) while the main thread is blocked in a collective: a backup during which
        the training thread changed the step tag (it may have touched the weights) is discarded. Never raises.
        """
        return self.failure.on_failure(reason, background=background)

    def _weights_tag(self) -> WeightsTag:
        """What the live weights belong to, read at once (the detector's thread calls this too)."""
        seq, phase, last = self._weights_seq, self._phase, self.last_iteration
        if phase is Phase.OPTIMIZER or last is None:
            return WeightsTag(seq, None)
        return WeightsTag(seq, last + (1 if phase is Phase.STEPPED else 0))

    def close(self, *, success: bool = True) -> None:
        """Stop the engine, transport and failure detector; on success, optionally remove the host store.

        ``success=True`` is collective (a barrier): call it on every rank at the end of training; it also waits
        (bounded) for a recovery timeline's picture still being drawn. ``success=False`` does not wait for it (the
        in-process engine closes a failed attempt's checkpointer inside the next recovery); a normal interpreter exit
        does (:func:`~neighbor_ckpt.report.timeline.wait_for_renders`)."""
        if self._closed:
            return
        self._closed = True
        if self.reporter.timeline_pending:  # no training step ran after the restore
            self.last_timeline = self.reporter.finish_timeline(None, step=self.last_iteration)
        if self._prev_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._prev_sigterm)
        if self.engine is not None:
            self.engine.close()
        if self.transport is not None:
            self.transport.close(graceful=success)
        self.datacheck.close()
        if success and (self.config.store.cleanup_on_success or self.detector is not None):
            # Every rank is done: nobody reads a replica any more, and no detector mistakes a finished rank (or
            # rank 0's store going away with it) for a failure.
            dist.barrier(group=self.group)
        if self.detector is not None:
            self.detector.stop(done=success)
        if success:
            self.recoverer.step_completed()  # training ended right after a restore: that state did not fail
        if success and self.config.store.cleanup_on_success:
            self.store.destroy()
            self.generations.release()  # the previous layout's snapshots, if not released yet
        else:
            self.store.close()
        if success:
            wait_for_renders()  # the recovery timeline's PNG, drawn off the training thread
