"""Configuration of neighbor_ckpt: one keyword-only dataclass per component.

The YAML form is a ``neighbor_ckpt:`` section that mirrors these dataclasses. Unknown keys, values of the
wrong type and values out of range are rejected before any process group is created: all of them at once, one
line each with its full key path (``neighbor_ckpt.transport.chunk_mb: 0 must be > 0``), in one
:class:`~neighbor_ckpt.errors.ConfigError`. Each section states its value rules in ``_check``
(:mod:`neighbor_ckpt.validation`). The constructors hold to the same rules with the same messages
(:func:`~neighbor_ckpt.validation.checked`): ``NeighborCkptConfig(store={"dir": "/x"})`` builds the section from the
mapping, ``NeighborCkptConfig(job_id=5)`` and ``StoreConfig(versions=1)`` raise.

Environment overrides win over the config (they are how a launcher or a test changes one process):

* ``NEIGHBOR_CKPT_STORE_DIR``: :attr:`StoreConfig.dir`
* ``NEIGHBOR_CKPT_JOB_ID``: :attr:`NeighborCkptConfig.job_id`

``NEIGHBOR_CKPT_INPROCESS_TIMERS`` (the timers of the NVRx wrapper in-process recovery used to run on) is no longer read:
with ``inprocess.enabled`` it is refused, naming the keys that replace it (:func:`refuse_legacy_timer_env`).

``NEIGHBOR_CKPT_LAUNCH_ID`` is set by neighbor_ckpt itself (:mod:`neighbor_ckpt.runtime.launch_identity`): the job id
made for a torchrun launch that has no run id of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

import yaml

from neighbor_ckpt.errors import CallOrderError, ConfigError
from neighbor_ckpt.fault_config import FaultInjectionConfig
from neighbor_ckpt.validation import Problems, checked, from_dict, to_dict

__all__ = [
    "DEFAULT_STORE_DIR", "LEGACY_STORE_DIR", "effective_user", "expand_store_dir",
    "StoreConfig",
    "RingConfig",
    "TransportConfig",
    "LazyBackupConfig",
    "InsuranceConfig",
    "ReportConfig",
    "DetectorConfig",
    "InprocessConfig",
    "ElasticConfig",
    "NeighborCkptConfig",
    "JobIdChoice",
    "decide_job_id",
    "STORE_DIR_ENV",
    "JOB_ID_ENV",
    "LAUNCH_ID_ENV",
    "UNUSABLE_RUN_IDS",
    "TRANSPORT_KINDS",
    "LEGACY_TIMERS_ENV",
    "LEGACY_TIMER_KEYS",
    "refuse_legacy_timer_env",
]

STORE_DIR_ENV = "NEIGHBOR_CKPT_STORE_DIR"
DEFAULT_STORE_DIR = "/dev/shm/neighbor_ckpt-{user}"
"""The default store root: one per user (``{user}`` is the process's user name), made 0700 by its first job, so no
user can create another's root before it (:mod:`neighbor_ckpt.snapshot.userdir`)."""
LEGACY_STORE_DIR = "/dev/shm/neighbor_ckpt"
"""The default store root of earlier releases, shared by all users (``neighbor-ckpt inspect [--cleanup]`` finds it)."""
JOB_ID_ENV = "NEIGHBOR_CKPT_JOB_ID"
LAUNCH_ID_ENV = "NEIGHBOR_CKPT_LAUNCH_ID"
"""Set by :mod:`neighbor_ckpt.runtime.launch_identity` in every worker of a torchrun launch without a run id: the
job id made once for that launch (shared by its restarts through the agent's store)."""

TRANSPORT_KINDS = ("gloo", "gloo_split")
"""The transports ``neighbor_ckpt.transport.kind`` accepts: the kinds registered in
:mod:`neighbor_ckpt.snapshot.transport_kinds` (named here so that validating a config imports no layer above it; a test
keeps the two the same)."""

def effective_user() -> str:
    """The name of this process's effective user (its passwd entry, not ``$USER``), or ``uid<N>`` without one."""
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (KeyError, ImportError):
        return f"uid{os.geteuid()}"


def expand_store_dir(value: str | os.PathLike[str]) -> Path:
    """A ``store.dir`` value as a path: ``{user}`` replaced by :func:`effective_user`."""
    return Path(str(value).replace("{user}", effective_user()))


UNUSABLE_RUN_IDS = frozenset({"", "none"})
"""Values of TORCHELASTIC_RUN_ID that name no launch: plain ``torchrun`` (no ``--rdzv-id``, no ``--standalone``)
sets ``none`` for every launch, so a new launch would share the job id, and the host store, of an old one."""


@checked("neighbor_ckpt.store")
@dataclass(kw_only=True, slots=True)
class StoreConfig:
    """Host store: shared-memory slots that hold this rank's snapshots and its predecessor's replicas."""

    dir: str = DEFAULT_STORE_DIR
    """Root directory of the host store; the job's files go to ``<dir>/<user>/<job_id>/rank<r>/``. ``{user}`` stands
    for the process's user name. Must be on a memory-backed filesystem (``/dev/shm``) for speed; overridden by
    NEIGHBOR_CKPT_STORE_DIR. A root shared by several users must belong to root and be sticky (like ``/tmp``): a root
    that belongs to another user is refused (:class:`~neighbor_ckpt.errors.StoreDirError`)."""

    versions: int = 2
    """Snapshot versions kept per rank, own and replica alike. Two is enough to absorb the one-iteration
    skew a failure can leave between ranks; more only costs host memory."""

    checksum: Literal["xxh3", "none"] = "xxh3"
    """Checksum of every committed slot, verified before any byte is loaded. ``none`` keeps only the
    header and commit-marker checks (torn writes are still caught, bit flips are not)."""

    extras_capacity_mb: float | None = None
    """Room in each slot for small per-rank state (RNG states, loop counters, scheduler, data position).
    None: twice what the first snapshot needs, at least 64 KiB. The slots grow (once, logged) if the small
    state ever outgrows the room."""

    cleanup_on_success: bool = True
    """Remove this job's host store when training finishes without error."""

    reap_orphans: bool = True
    """On a restart, SIGKILL what this rank's previous process left running on this machine: its process group,
    once the process itself is gone (checkpoint writers and ``multiprocessing`` servers of a killed worker, which
    otherwise hold host memory until the node reboots). See :mod:`neighbor_ckpt.runtime.reaper`."""

    def _check(self, p: Problems) -> None:
        p.at_least("versions", self.versions, 2)
        p.above("extras_capacity_mb", self.extras_capacity_mb, 0, " (or null for automatic)", optional=True)


@checked("neighbor_ckpt.ring")
@dataclass(kw_only=True, slots=True)
class RingConfig:
    """Which DP rank holds this rank's replica."""

    policy: Literal["cross_node", "next"] = "cross_node"
    """``cross_node``: the ring successor is on another node whenever the DP group spans nodes, so one node
    loss never takes a snapshot and its replica together. ``next``: the next DP rank."""


@checked("neighbor_ckpt.transport")
@dataclass(kw_only=True, slots=True)
class TransportConfig:
    """How snapshot bytes move between ranks: streaming of each committed snapshot to the ring successor
    (background thread), and the transfers of a recovery and of an elastic reshard
    (:mod:`neighbor_ckpt.snapshot.transport`)."""

    kind: str = "gloo"
    """The transport (one of :data:`TRANSPORT_KINDS`), on the host, point-to-point. ``gloo``: everything over the
    snapshot gloo group. ``gloo_split``: streaming over a gloo group of its own (one more connection per pair of
    ranks), so streamed chunks never queue ahead of the snapshot group's collectives; recovery stays on the snapshot
    group."""

    enabled: bool = True
    """Stream snapshots to the successor. Off: only the local slot exists (a lost node falls back to
    insurance)."""

    chunk_mb: float = 16.0
    """Size of one send; smaller chunks interleave better with training traffic."""

    timeout_s: float = 120.0
    """Timeout of the snapshot process group; a neighbor silent for longer is marked stale."""

    wait_for_replica: bool = True
    """At the wait point before the next iteration's gradient collectives, also wait until the
    successor has acknowledged the previous snapshot. This is what guarantees a common version exists
    after any single-node loss; turn it off only to measure."""

    rate_limit_mb_per_s: float = 0.0
    """Upper bound on snapshot streaming in megabytes (1e6 bytes) per second (0: unlimited)."""

    _renamed: ClassVar[dict[str, str]] = {
        "rate_limit_mbps": "rate_limit_mb_per_s (same value: it always was megabytes, not megabits, per second)"}

    def _check(self, p: Problems) -> None:
        p.one_of("kind", self.kind, TRANSPORT_KINDS)
        p.above("chunk_mb", self.chunk_mb)
        p.above("timeout_s", self.timeout_s)
        p.at_least("rate_limit_mb_per_s", self.rate_limit_mb_per_s, 0, " (0 = unlimited)")


@checked("neighbor_ckpt.lazy_backup")
@dataclass(kw_only=True, slots=True)
class LazyBackupConfig:
    """Redundant state (weights / optimizer state under plain DDP) is written only at failure time."""

    enabled: bool = True
    """On a failure, one live rank per DP group writes the redundant state into its host store."""


@checked("neighbor_ckpt.insurance")
@dataclass(kw_only=True, slots=True)
class InsuranceConfig:
    """Persistent checkpoints, used when no complete in-memory version exists."""

    every_n_steps: int = 0
    """Write a persistent checkpoint every N optimizer steps (0: off; an existing ModelCheckpoint can
    serve instead)."""

    dirpath: str | None = None
    """Directory of insurance checkpoints (None: ``<trainer.default_root_dir>/neighbor_ckpt_insurance``)."""

    def _check(self, p: Problems) -> None:
        p.at_least("every_n_steps", self.every_n_steps, 0, " (0 = off)")


@checked("neighbor_ckpt.report")
@dataclass(kw_only=True, slots=True)
class ReportConfig:
    """What a user sees: status line, metrics to the trainer's loggers, recovery report and timeline."""

    status_every_n_steps: int | None = None
    """Log one neighbor-checkpoint status line (rank 0) every N steps. None: the trainer's
    ``log_every_n_steps`` (10 in a plain loop, which has no log interval to follow); 0: never."""

    log_metrics: bool = True
    """Send snapshot time, bytes, replica lag, stream throughput and recovery phase times to the
    trainer's loggers (TensorBoard, W&B, CSV, ...) at the same interval."""

    timeline: bool = True
    """After every recovery, rank 0 writes the recovery timeline (PNG, with the MTTR breakdown: detect,
    restart, rendezvous, reconcile, transfer, restore, first step) and its JSON next to the logs."""

    dir: str | None = None
    """Where reports go. None: ``<trainer.log_dir or default_root_dir>/neighbor_ckpt_reports`` (Lightning, NeMo),
    ``<store.dir>/<user>/reports/<job_id>`` (plain loop, on rank 0's node)."""

    progress: Literal["auto", "rich", "none"] = "auto"
    """Progress bars for recovery phases (rank 0). ``auto``: rich bars on a terminal, plain log lines
    otherwise."""

    def _check(self, p: Problems) -> None:
        p.at_least("status_every_n_steps", self.status_every_n_steps, 0,
                   " (0 = never, null = the trainer's log interval)", optional=True)


@checked("neighbor_ckpt.detector")
@dataclass(kw_only=True, slots=True)
class DetectorConfig:
    """Failure detection through heartbeats and progress tags (one monitor thread per process). The one detector of
    both recovery modes: on the launcher's restart path it beats in the job's c10d store and a failure makes every
    rank exit for the launcher to restart the job; with in-process recovery (``inprocess.enabled``) it beats in the
    launch's store host (:mod:`neighbor_ckpt.inprocess.protocol`, ``hb/<p>``) and a failure starts the next
    generation: the failed process is declared dead, killed by its launcher and replaced by a hot spare, the others
    stay alive."""

    enabled: bool = True
    """Run the detector. Off (restart path only): a dead rank is noticed when the launcher sees its process exit, a
    hung one when the job's collectives time out (10-30 minutes). Refused with ``inprocess.enabled``: in process the
    detector is what notices a silent or hung rank."""

    interval_s: float = 1.0
    """Heartbeat period: each process publishes its heartbeat and step/phase tag and reads the ones it watches. In
    process every process publishes its own and a failure recorded by any of them reaches every other at once (the
    monitors wait on the generation's failure key); the period bounds how late a silence or a hang is seen."""

    timeout_s: float = 5.0
    """A watched process without a new heartbeat for this long (SIGKILL, SIGSTOP, a lost node) is a failure.
    Detection takes at most about this plus one interval. Restart path (where a c10d store that does not answer for
    this long is a failure too): every rank exits and the launcher restarts the job. In process: the silent process
    is declared dead, its launcher kills it (a stopped one too) and a hot spare takes its rank; the survivors stay
    alive. A process that exits is reported by its launcher at once, without waiting for this."""

    hang_timeout_s: float | None = 900.0
    """A rank whose step/phase tag (forward, backward, optimizer step, snapshot) does not change for this long while
    its heartbeat goes on is stuck, or waits in a collective with a stuck rank. Counted from the first completed
    iteration (of each in-process generation); stopped during validation. Must exceed the longest step plus a
    synchronous persistent checkpoint. Restart path: the job restarts. In process: the rank whose tag lags behind the
    others' is the stuck one: it is declared dead, killed and replaced by a spare; if every tag is equal (no rank to
    blame) the same ranks re-form once, and a second such hang gives up to the launcher's restart path. None: off
    (refused with ``inprocess.enabled``: a stuck rank would never be noticed)."""

    kill_local: bool = True
    """Restart path: SIGKILL a failed rank of this node (a stopped process ignores the launcher's SIGTERM for its whole
    grace period); the launcher then restarts the job at once. In process the failed process's own launcher SIGKILLs
    every process of its node declared dead in the store (a stopped one too), whatever this says."""

    def _check(self, p: Problems) -> None:
        p.above("interval_s", self.interval_s)
        p.above("timeout_s", self.timeout_s)
        p.above("hang_timeout_s", self.hang_timeout_s, 0, " (or null for off)", optional=True)
        if p.ok("interval_s", "timeout_s"):
            p.check(self.timeout_s > self.interval_s, "timeout_s",
                    f"{self.timeout_s!r} must exceed detector.interval_s ({self.interval_s!r}): a rank is declared "
                    "silent only after missing a few heartbeats")


LEASE_TICK_S = 0.1
"""How often an in-process client's cut-off lease is looked at (its guard's period): the slack the lease's
inequality with the majority's decision leaves for it (:func:`neighbor_ckpt.inprocess.quorum.cut_off_lease_s`)."""


@checked("neighbor_ckpt.inprocess")
@dataclass(kw_only=True, slots=True)
class InprocessConfig:
    """In-process recovery (:mod:`neighbor_ckpt.inprocess`, our own engine; NVIDIA's resiliency extension is not
    used): after a failure the surviving processes stay alive, abort and re-form their process groups in a new
    generation and restore from their own host slots; a hot spare takes a lost rank's place and pulls its state from
    the ring successor. Failures are noticed by the one detector of both modes (``neighbor_ckpt.detector``, which must
    be on). When in-process recovery cannot go on (no spare left, a failure before the new generation completed a
    step, more than ``max_restarts``), every process exits and the launcher's restart path recovers, as with this
    section off."""

    enabled: bool = False
    """Recover in process. Needs a launcher that keeps the surviving workers alive when one exits
    (``neighbor-ckpt launch`` arranges it)."""

    spares: int = 0
    """Hot spare processes started with the job, idle until a rank is lost (on top of the job's ranks)."""

    max_restarts: int | None = 10
    """In-process restarts (generations after the first) before giving up to the launcher's restart path. Ten
    absorbs a bad day of a large GPU job in process while a job that fails over and over (a bad node that keeps
    coming back, a bug that fails every generation) still reaches the launcher, which counts its own restarts
    (``launch.max_restarts``). None: unbounded."""

    barrier_timeout_s: float = 300.0
    """How long a generation's barrier waits for the processes expected in it (a process declared dead meanwhile is
    no longer expected); past it, in-process recovery gives up to the launcher's restart path. 300 s: on a GPU
    cluster a replaced process imports torch, megatron-core and the framework and builds its CUDA context before it
    joins, which takes minutes on a slow shared filesystem. Must exceed ``abort_timeout_s`` (a process whose abort
    hangs must be gone and declared dead before the barrier gives up on it) and, in process, ``detector.timeout_s``."""

    abort_timeout_s: float = 60.0
    """NCCL abort watchdog: when aborting this process's process groups after a failure takes longer than this, the
    process exits with ``EXIT_ABORT_HUNG`` (:mod:`neighbor_ckpt.inprocess.protocol`) and its launcher starts a new
    one in its place, which joins as a spare. It also bounds a failed attempt's abort and clean-ups (the ``on_restart``
    functions, the process groups' teardown): past it the process logs every thread's stack and declares itself
    dead, and a spare takes its rank. 60 s: an NCCL communicator abort normally takes well under a second, even with
    kernels pending; one that runs for a minute is stuck in the driver or the network and will not come back."""

    grow_back: bool = False
    """Replace every process that dies on a node whose launcher lives (killed, crashed, declared dead), not only
    those the hygiene check or a hung abort retire: the replacement joins as a hot spare and can take the next lost
    rank, so the job keeps ``spares`` spares through repeated failures. It starts once a generation formed after the
    death has completed a step (its start-up, the imports included, stays off that recovery's path). Off by default:
    a process that dies of its node (a bad GPU, a full disk) dies again, up to the launcher's replacement limit."""

    hygiene_rss_growth_mib: float = 50.0
    """The hygiene check between generations: when this process's resident memory grew by more than this many MiB
    over the last five generations, state leaks across generations (model or optimizer copies held by a reference, a
    cache) and the process exits with ``EXIT_HYGIENE``; its launcher starts a clean one, which joins as a spare. 50
    MiB over five generations: room for the host allocator's and Python's caches to settle, far less than one leaked
    copy of a GPU model's host-side state (a snapshot buffer, an optimizer shard: gigabytes)."""

    def _check(self, p: Problems) -> None:
        p.at_least("spares", self.spares, 0)
        p.at_least("max_restarts", self.max_restarts, 1,
                   " (or null for unbounded; to never recover in process, set inprocess.enabled: false)",
                   optional=True)
        p.positive("barrier_timeout_s", self.barrier_timeout_s)
        p.positive("abort_timeout_s", self.abort_timeout_s)
        p.positive("hygiene_rss_growth_mib", self.hygiene_rss_growth_mib)
        if p.ok("barrier_timeout_s", "abort_timeout_s"):
            p.check(self.barrier_timeout_s > self.abort_timeout_s, "barrier_timeout_s",
                    f"{self.barrier_timeout_s!r} must exceed inprocess.abort_timeout_s ({self.abort_timeout_s!r}): a "
                    "process whose abort hangs is ended only after abort_timeout_s, and the next generation's barrier "
                    "must still be waiting when it is declared dead")
        if self.enabled:
            legacy = _legacy_timer_env_problem(os.environ)
            if legacy is not None:
                p.add("enabled", legacy)


@checked("neighbor_ckpt.elastic")
@dataclass(kw_only=True, slots=True)
class ElasticConfig:
    """Go on with fewer data-parallel ranks when a rank is lost for good and no hot spare is left (ReCoVer's
    constant global batch), and back to more when ranks return: :mod:`neighbor_ckpt.recovery.reshard`. The fp32
    main-param and Adam-moment shards of the old layout (each rank's own slots and the lost ranks' replicas on their
    ring successors) are re-partitioned into the new layout of megatron-core's distributed optimizer, from memory;
    the training loop keeps the global batch by giving each rank more micro-batches."""

    enabled: bool = False
    """Allow the data-parallel size to change at a recovery. Off: a snapshot of another data-parallel size is refused
    like any other layout change, and in-process recovery without a spare gives up (the launcher restarts the job)."""

    min_data_parallel: int = 1
    """Never shrink below this data-parallel size: with fewer ranks the job falls back to the launcher's restart."""

    def _check(self, p: Problems) -> None:
        p.at_least("min_data_parallel", self.min_data_parallel, 1)


@checked("neighbor_ckpt")
@dataclass(kw_only=True, slots=True)
class NeighborCkptConfig:
    """Top-level configuration; the ``neighbor_ckpt:`` section of a YAML file."""

    enabled: bool = True
    """Master switch. Off: the callback / checkpointer does nothing."""

    job_id: str | None = None
    """Namespace of the host store. None: torchrun's run id (TORCHELASTIC_RUN_ID); under a torchrun launch without
    one (``none``: no ``--rdzv-id``, no ``--standalone``) an id made once per launch, shared by its restarts, so a new
    launch never resumes an old one; outside torchrun SLURM_JOB_ID, else ``default``. Snapshots of another job id
    are refused at recovery. Overridden by NEIGHBOR_CKPT_JOB_ID."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """Host store."""

    ring: RingConfig = field(default_factory=RingConfig)
    """Ring successor choice."""

    transport: TransportConfig = field(default_factory=TransportConfig)
    """Streaming to the ring successor."""

    lazy_backup: LazyBackupConfig = field(default_factory=LazyBackupConfig)
    """Failure-time backup of redundant state."""

    insurance: InsuranceConfig = field(default_factory=InsuranceConfig)
    """Persistent fallback checkpoints."""

    report: ReportConfig = field(default_factory=ReportConfig)
    """Status line, metrics, recovery report and timeline."""

    detector: DetectorConfig = field(default_factory=DetectorConfig)
    """Heartbeat failure detection."""

    fault_injection: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)
    """Demo / campaign fault injection (off by default)."""

    inprocess: InprocessConfig = field(default_factory=InprocessConfig)
    """In-process recovery with hot spares (off by default)."""

    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """Continue on fewer (or return to more) data-parallel ranks, resharding from memory (off by default)."""

    data_check: Literal["error", "warn", "off"] = "error"
    """After a recovery, each rank compares a fingerprint of the replayed step's input with the one recorded
    before the failure. error: a mismatch (the data position was not restored) stops the job; warn: it is
    logged; off: no fingerprints."""

    def _check(self, p: Problems) -> None:
        """The rules across sections (after each section's own); each runs only when the keys it reads passed theirs.

        In-process recovery has no failure detection of its own: the detector notices a silent or stuck process and
        starts the next generation, so it must be on, with its hang clock."""
        inp, det = self.inprocess, self.detector  # a value that failed its type check holds its default here
        if not inp.enabled:
            return
        if not p.check(det.enabled, "detector.enabled",
                       "false is refused with in-process recovery (inprocess.enabled: true): the detector is what "
                       "notices failures in process (a stopped or stuck process, a lost node: a launcher sees only "
                       "its own processes exit), and without it the survivors would wait for such a rank until their "
                       "collectives time out; turn the detector on, or in-process recovery off"):
            return
        p.check(det.hang_timeout_s is not None, "detector.hang_timeout_s",
                "null (off) is refused with in-process recovery (inprocess.enabled: true): a stuck rank (its "
                "heartbeat goes on, its step does not) would never be noticed, and every other rank would wait for it "
                "in a collective; set the seconds a step may stand still (more than the longest step plus a "
                "synchronous persistent checkpoint)")
        if p.ok("detector.timeout_s", "detector.interval_s"):
            least = 3 * det.interval_s + 3 * LEASE_TICK_S
            p.check(det.timeout_s >= least, "detector.timeout_s",
                    f"{det.timeout_s!r} is too short for detector.interval_s ({det.interval_s!r}) in process: it must "
                    f"be at least 3 x interval_s + {3 * LEASE_TICK_S:g} s ({least:g}), so that a process cut off from "
                    "the majority provably stops itself before the majority may declare it dead (docs/timeouts.md, "
                    "the cut-off lease); raise timeout_s or lower interval_s")
        if p.ok("detector.timeout_s", "inprocess.barrier_timeout_s"):
            p.check(inp.barrier_timeout_s > det.timeout_s, "inprocess.barrier_timeout_s",
                    f"{inp.barrier_timeout_s!r} must exceed detector.timeout_s ({det.timeout_s!r}): a process that "
                    "falls silent before a generation's barrier is declared dead only after detector.timeout_s, and "
                    "the barrier must still be waiting then")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, *, path: str = "neighbor_ckpt") -> NeighborCkptConfig:
        """Build from a mapping (the content of a ``neighbor_ckpt:`` section); every problem is one line of the
        :class:`ConfigError` raised."""
        return from_dict(cls, data or {}, path)

    @classmethod
    def from_yaml(cls, source: str | os.PathLike[str], *, section: str = "neighbor_ckpt") -> NeighborCkptConfig:
        """Read the ``neighbor_ckpt:`` section of a YAML file (a missing section gives the defaults)."""
        text = Path(source).read_text()
        doc = yaml.safe_load(text) or {}
        if not isinstance(doc, dict):
            raise ConfigError(f"{source}: expected a mapping at the top level")
        return cls.from_dict(doc.get(section), path=section)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (round-trips through :meth:`from_dict`)."""
        return to_dict(self)

    # -- resolved values ----------------------------------------------------------------------

    def resolved_store_dir(self) -> Path:
        """The store root after the environment override, ``{user}`` expanded (:func:`expand_store_dir`)."""
        return expand_store_dir(os.environ.get(STORE_DIR_ENV) or self.store.dir)

    def resolved_job_id(self) -> str:
        """The job namespace after the environment override and launcher defaults (:func:`decide_job_id`).

        Raises:
            CallOrderError: under a torchrun launch without a run id, before this launch's id was made
                (``prepare_torchrun_restart()`` or the ``NeighborCheckpointer`` makes it:
                :func:`neighbor_ckpt.runtime.launch_identity.resolve_job_id`).
        """
        choice = decide_job_id(os.environ, self.job_id)
        if choice.job_id is None:
            raise CallOrderError(
                "the job id of this launch is not known yet: torchrun gave it no run id (TORCHELASTIC_RUN_ID="
                f"{os.environ.get('TORCHELASTIC_RUN_ID', '')!r}), so neighbor_ckpt makes one per launch when "
                "prepare_torchrun_restart() runs or the NeighborCheckpointer is built; call one of them first, or "
                f"set neighbor_ckpt.job_id (or {JOB_ID_ENV})")
        return choice.job_id


@dataclass(frozen=True)
class JobIdChoice:
    """Which job id a process uses, and where it came from (:func:`decide_job_id`)."""

    job_id: str | None
    """The id, already safe as a directory name; None: this launch's id must be made first (``source`` launch)."""

    source: str
    """``NEIGHBOR_CKPT_JOB_ID``, ``config``, ``TORCHELASTIC_RUN_ID``, ``launch`` (made for a torchrun launch without
    a run id), ``SLURM_JOB_ID`` or ``default``."""


def decide_job_id(env: Mapping[str, str], configured: str | None) -> JobIdChoice:
    """The job id from the environment and ``neighbor_ckpt.job_id``; pure (no store, no file).

    In order: NEIGHBOR_CKPT_JOB_ID, the configured id, torchrun's run id when it names the launch; under torchrun
    without one (:data:`UNUSABLE_RUN_IDS`) the id made for this launch (NEIGHBOR_CKPT_LAUNCH_ID; None until made);
    outside torchrun SLURM_JOB_ID, then ``default``."""
    explicit = env.get(JOB_ID_ENV)
    if explicit:
        return JobIdChoice(_safe_name(explicit), JOB_ID_ENV)
    if configured:
        return JobIdChoice(_safe_name(configured), "config")
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is not None:  # launched by torchrun (torchelastic)
        if run_id.strip().lower() not in UNUSABLE_RUN_IDS:
            return JobIdChoice(_safe_name(run_id), "TORCHELASTIC_RUN_ID")
        launch = env.get(LAUNCH_ID_ENV)
        return JobIdChoice(_safe_name(launch) if launch else None, "launch")
    slurm = env.get("SLURM_JOB_ID")
    if slurm:
        return JobIdChoice(_safe_name(slurm), "SLURM_JOB_ID")
    return JobIdChoice("default", "default")


def _safe_name(value: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in value)
    return safe.strip(".") or "default"



# -- the old in-process timer variable ----------------------------------------------------------------------------

LEGACY_TIMERS_ENV = "NEIGHBOR_CKPT_INPROCESS_TIMERS"
"""The timer overrides of the NVRx wrapper (``name=seconds,...``), no longer read: its timers are job-file keys now
(:func:`refuse_legacy_timer_env`)."""

LEGACY_TIMER_KEYS: dict[str, str | None] = {
    "heartbeat_interval": "neighbor_ckpt.detector.interval_s",
    "monitor_thread_interval": "neighbor_ckpt.detector.interval_s",
    "monitor_process_interval": "neighbor_ckpt.detector.interval_s",
    "progress_watchdog_interval": "neighbor_ckpt.detector.interval_s",
    "heartbeat_timeout": "neighbor_ckpt.detector.timeout_s",
    "soft_timeout": "neighbor_ckpt.detector.hang_timeout_s",
    "hard_timeout": "neighbor_ckpt.detector.hang_timeout_s",
    "barrier_timeout": "neighbor_ckpt.inprocess.barrier_timeout_s",
    "completion_timeout": None,
    "last_call_wait": None,
    "termination_grace_time": None,
}
"""Each timer of the old wrapper -> the key that does its work now (None: none does). ``soft_timeout`` started the
recovery and ``hard_timeout`` killed the rank; ``detector.hang_timeout_s`` does both at once (the lagging rank is
killed and replaced). ``completion_timeout`` (no completion barrier any more), ``last_call_wait`` and
``termination_grace_time`` (a dead process is SIGKILLed, no grace) have no counterpart. New, with no old timer:
``neighbor_ckpt.inprocess.abort_timeout_s``."""

_NEW_TIMER_KEYS = ("neighbor_ckpt.detector.interval_s", "neighbor_ckpt.detector.timeout_s",
                   "neighbor_ckpt.detector.hang_timeout_s", "neighbor_ckpt.inprocess.barrier_timeout_s",
                   "neighbor_ckpt.inprocess.abort_timeout_s", "neighbor_ckpt.inprocess.max_restarts")


def _legacy_timer_env_problem(environ: Mapping[str, str]) -> str | None:
    """Why the old timer variable in ``environ`` is refused (one line), or None when it is not set (or empty: it
    overrides nothing, so nothing the user set is ignored)."""
    raw = environ.get(LEGACY_TIMERS_ENV)
    if raw is None or not raw.strip():
        return None
    mapping = ", ".join(f"{old} -> {new.removeprefix('neighbor_ckpt.') if new else '(none)'}"
                        for old, new in LEGACY_TIMER_KEYS.items())
    overrides: dict[str, str] = {}
    for part in filter(None, (x.strip() for x in raw.split(","))):
        name, sep, value = (x.strip() for x in part.partition("="))
        new = LEGACY_TIMER_KEYS.get(name)
        if sep and new is not None and value:
            overrides.setdefault(new, value)  # soft_timeout before hard_timeout: the first named wins
    hint = f"; for this value: {' '.join(f'{k}={v}' for k, v in overrides.items())}" if overrides else ""
    return (f"{LEGACY_TIMERS_ENV}={raw!r} is set, and no longer read: the in-process timers are job-file keys now, "
            f"{', '.join(_NEW_TIMER_KEYS)} (set them in the job file, or as key=value overrides of neighbor-ckpt "
            f"launch{hint}); the old names map as {mapping}; unset {LEGACY_TIMERS_ENV}")


def refuse_legacy_timer_env(environ: Mapping[str, str] = os.environ) -> None:
    """Raise :class:`~neighbor_ckpt.errors.ConfigError` when ``NEIGHBOR_CKPT_INPROCESS_TIMERS`` is set (not empty).

    The variable overrode the timers of the NVRx wrapper; our in-process engine reads its timers from the job file
    (``neighbor_ckpt.detector.*``, ``neighbor_ckpt.inprocess.*``), and a variable silently ignored would leave a user
    believing the timers they set are in force. The message names the new keys and maps every old name to its key.
    Validating an :class:`InprocessConfig` with ``enabled: true`` runs the same check (one problem line under
    ``neighbor_ckpt.inprocess.enabled``); the engine calls this when it is built."""
    problem = _legacy_timer_env_problem(environ)
    if problem is not None:
        raise ConfigError(problem)
