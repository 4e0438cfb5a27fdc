"""The NVRx in-process wrapper, built for neighbor_ckpt on a plain training loop.

Usage (one process per rank, ``active + spares`` processes; see :mod:`neighbor_ckpt.inprocess`)::

    inproc = InprocessRecovery.from_config(cfg, store_host="10.0.0.1", store_port=29650)  # cfg.inprocess.spares
    # or InprocessRecovery(spares=1, store_host="10.0.0.1", store_port=29650)

    def train(attempt: Attempt) -> None:          # called again in the same process after every failure
        inproc.init_process_group()               # a new gloo group for this attempt (RANK/WORLD_SIZE as assigned)
        ...build parallel state, model, optimizer...
        ckpt = NeighborCheckpointer(cfg, ..., attempt=inproc.attempt_info())   # cfg.inprocess.enabled = True
        inproc.on_restart(lambda: ckpt.close(success=False))   # runs after the abort; host slots stay
        result = ckpt.recover()
        for step in range(result.next_step, steps):
            ...
            inproc.mark_progress()                # after the first completed step of this attempt

    inproc.run(train)   # returns on success; SystemExit(FALLBACK_EXIT_CODE) when in-process recovery gives up

**Rank assignment.** NVRx's ``Tree`` with one ``RESERVE`` layer holding every rank, at most ``world - spares``
active: ranks ``0..active-1`` start active, the others are idle hot spares. When an active rank is lost, a spare
is activated *with the lost rank's number*; every survivor keeps its number, so its own host slots (``rank<r>/``)
and its ring neighbors stay what they were, and only the spare (whose store holds nothing for that rank) pulls
state from the ring successor. ``MaxActiveWorldSize + ShiftRanks`` would renumber every rank after the lost one.

**Elastic shrink** (``elastic``: an :class:`~neighbor_ckpt.recovery.reshard.ElasticPolicy`, from
``neighbor_ckpt.elastic``): when no spare is left, the survivors go on with a smaller world instead of giving up. The
tree's root layer also *backfills*: the highest active rank takes the lost rank's number (NVRx ``BACKFILL``), the
ranks after it keep theirs, and the world shrinks to the policy's size (a multiple of the model-parallel size whose
data-parallel size divides the global batch); a survivor beyond it becomes an idle spare. The training function
then builds a layout of the new size and ``recover()`` reshards the snapshots into it (each survivor's own slots,
the lost rank's replica on its ring successor).

**Fallback.** In-process recovery gives up (every rank exits with :data:`FALLBACK_EXIT_CODE`, announced in one log
line, and the launcher's restart path takes over; ``recover()`` then resumes from the host stores as today) when:
no spare is left to fill the lost rank (and elastic shrinking is off, or no smaller world fits its policy); a
recovery attempt fails before it completes a step (a second failure in the recovery window, or a failing recovery);
more than ``max_restarts`` in-process restarts; or the wrapper itself fails.

**Timers** (:class:`InprocessTimers`): the values that held 9 of 9 times on a 2-core CPU machine with gloo
(``/work/shared/notes/cpu-stack.md``); tighter ones caused false soft timeouts and a store-barrier bug of NVRx 0.4.1.
``soft_timeout`` must exceed the longest blocking C call of the loop (a gloo collective, a store wait): the progress
watchdog advances only while the main thread runs Python code. ``NEIGHBOR_CKPT_INPROCESS_TIMERS``
(``name=seconds,...``, e.g. ``soft_timeout=10,hard_timeout=15``) overrides them when no ``timers`` are given (tests on
a loaded machine; production keeps the defaults or passes its own).
"""

import dataclasses
import gc
import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from neighbor_ckpt.config import InprocessConfig, NeighborCkptConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.recovery.attempt import AttemptInfo, launcher_restart_count
from neighbor_ckpt.recovery.reshard import ElasticPolicy

__all__ = ["InprocessRecovery", "InprocessTimers", "Attempt", "FALLBACK_EXIT_CODE", "TIMERS_ENV"]

logger = logging.getLogger(__name__)

FALLBACK_EXIT_CODE = 75
"""Exit status of every rank when in-process recovery gives up (EX_TEMPFAIL): the launcher restarts the job."""

TIMERS_ENV = "NEIGHBOR_CKPT_INPROCESS_TIMERS"
"""``name=seconds,...``: overrides of :class:`InprocessTimers` when none are passed (see the module docstring)."""


@dataclass(kw_only=True, frozen=True)
class InprocessTimers:
    """NVRx wrapper timers, in seconds (NVRx defaults in brackets)."""

    monitor_thread_interval: float = 0.1
    """How often each rank's monitor thread looks for an interruption in the store [1]."""
    monitor_process_interval: float = 0.05
    """How often each rank's monitor process checks its rank and the heartbeats [1]."""
    progress_watchdog_interval: float = 0.05
    """Automatic progress timestamps from the main thread [1]."""
    heartbeat_interval: float = 0.5
    """Heartbeat period of each rank's monitor process [1]."""
    heartbeat_timeout: float = 5.0
    """A rank whose heartbeat is this old is declared dead (a whole node gone) [30]."""
    soft_timeout: float = 5.0
    """No Python progress on the main thread for this long: the rank aborts and restarts [60]."""
    hard_timeout: float = 8.0
    """No progress for this long: the rank is terminated [90]."""
    barrier_timeout: float = 15.0
    """Store barriers between restart iterations [120]."""
    completion_timeout: float = 15.0
    """The completion barrier at the end of the wrapped function [120]."""
    last_call_wait: float = 0.0
    """Time for other ranks to report concurrent failures before the restart [1]."""
    termination_grace_time: float = 1.0
    """SIGTERM to SIGKILL of a hard-timed-out rank [5]."""

    def as_kwargs(self) -> dict[str, timedelta]:
        return {f.name: timedelta(seconds=getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_env(cls, value: Optional[str] = None) -> "InprocessTimers":
        """The defaults with the overrides of :data:`TIMERS_ENV` (or ``value``): ``name=seconds,...``."""
        raw = os.environ.get(TIMERS_ENV, "") if value is None else value
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, float] = {}
        for part in filter(None, (x.strip() for x in raw.split(","))):
            name, sep, sec = part.partition("=")
            name = name.strip()
            try:
                if not sep or name not in names:
                    raise ValueError(f"unknown timer {name!r}")
                kw[name] = float(sec)
                if not kw[name] >= 0:
                    raise ValueError("must be >= 0")
            except ValueError as e:
                raise ConfigError(f"{TIMERS_ENV}: {part!r}: {e}; expected name=seconds[,name=seconds...] with "
                                  f"names from {sorted(names)}") from None
        timers = cls(**kw)
        if not timers.soft_timeout < timers.hard_timeout:
            raise ConfigError(f"{TIMERS_ENV}: soft_timeout {timers.soft_timeout:g} s must be below hard_timeout "
                              f"{timers.hard_timeout:g} s")
        return timers


@dataclass
class Attempt:
    """One call of the training function (restart iteration ``iteration``; 0: the first)."""

    iteration: int
    rank: int
    """This attempt's rank (``RANK`` as assigned by the wrapper: survivors keep theirs, a spare gets the lost one)."""
    world_size: int
    initial_rank: int
    """The rank this process was started as (a spare's is >= the active world size)."""
    call_wrapper: Any = field(repr=False, default=None)


class InprocessRecovery:
    """Builds and runs the NVRx ``Wrapper`` for one training function; see the module docstring.

    Args:
        spares: hot spare processes among ``world_size`` (the job's processes: active + spares).
        store_host, store_port: the TCP store hosted outside the ranks (:mod:`neighbor_ckpt.inprocess.store_host`);
            its port is the one connection the abort keeps.
        world_size: all processes of the job (default: ``WORLD_SIZE``).
        run_id: key namespace in the store (default: ``NEIGHBOR_CKPT_JOB_ID`` or ``TORCHELASTIC_RUN_ID``); the
            launcher's restart count is appended, so a launcher-level restart starts from clean keys.
        timers: wrapper timers.
        max_restarts: at most this many in-process restarts (None: bounded by the spares and the no-progress rule).
        monitor_log_dir: where NVRx's monitor processes log (default: not kept).
        elastic: continue on a smaller world when no spare is left (see the module docstring; None: give up).
    """

    def __init__(self, *, spares: int, store_host: str, store_port: int, world_size: Optional[int] = None,
                 run_id: Optional[str] = None, timers: Optional[InprocessTimers] = None,
                 max_restarts: Optional[int] = None, monitor_log_dir: Optional[Path] = None,
                 elastic: Optional[ElasticPolicy] = None) -> None:
        from megatron_patches.nvrx_gloo import check_nvrx_version

        check_nvrx_version()
        world = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", "1"))
        if spares < 0 or spares >= world:
            raise ConfigError(f"neighbor_ckpt.inprocess.spares: {spares} spare(s) for {world} process(es): needs "
                              f"0 <= spares < world size")
        self.world_size = world
        self.spares = spares
        self.active_world_size = world - spares
        self.store_host = store_host
        self.store_port = int(store_port)
        run = run_id or os.environ.get("NEIGHBOR_CKPT_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "job"
        self.prefix = f"neighbor_ckpt/inprocess/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.timers = timers or InprocessTimers.from_env()
        self.max_restarts = max_restarts
        self.monitor_log_dir = monitor_log_dir
        self.elastic = elastic
        self.initial_rank = int(os.environ.get("RANK", "0"))
        self.current: Optional[Attempt] = None
        self.events: list[dict[str, Any]] = []
        """``{"iteration", "name", "unix"}``: abort_start/abort_end/finalize_end (monitor thread), initialize,
        enter, and whatever the training function records with :meth:`event`."""
        self.gave_up: Optional[str] = None
        self._lock = threading.Lock()
        self._cleanups: list[Callable[[], None]] = []
        self._app_store: Any = None
        self._iteration = 0
        self._was_active = False
        self._attempt_info: Optional[AttemptInfo] = None

    @classmethod
    def from_config(cls, config: "NeighborCkptConfig | InprocessConfig", *, store_host: str, store_port: int,
                    model_parallel: int = 1, batch_micro_batches: Optional[int] = None,
                    **kwargs: Any) -> "InprocessRecovery":
        """Built from the ``neighbor_ckpt.inprocess`` section (``spares``) and, given the whole configuration, its
        ``elastic`` section (with ``model_parallel`` = TP x PP x CP and ``batch_micro_batches`` = global batch /
        micro-batch size of the job: the world sizes it may shrink to); ``kwargs`` as for the constructor.

        Raises :class:`ConfigError` when the section is not enabled (the caller should run without the wrapper)."""
        section = config.inprocess if isinstance(config, NeighborCkptConfig) else config
        if not section.enabled:
            raise ConfigError("neighbor_ckpt.inprocess.enabled is false: run the training function without "
                              "InprocessRecovery (or set neighbor_ckpt.inprocess.enabled=true)")
        if isinstance(config, NeighborCkptConfig) and config.elastic.enabled and "elastic" not in kwargs:
            kwargs["elastic"] = ElasticPolicy(model_parallel=model_parallel,
                                              min_data_parallel=config.elastic.min_data_parallel,
                                              batch_micro_batches=batch_micro_batches)
        return cls(spares=section.spares, store_host=store_host, store_port=store_port, **kwargs)

    def attempt_info(self) -> AttemptInfo:
        """This attempt for :class:`~neighbor_ckpt.NeighborCheckpointer` (``attempt=``): the launcher's restart
        count, the in-process restart iteration, whether this process is a hot spare activated now, and when this
        process noticed the previous attempt's failure and finished aborting it (the recovery timeline)."""
        self._need_attempt()
        assert self._attempt_info is not None  # noqa: S101 - set with the attempt
        return self._attempt_info

    def _make_attempt_info(self, iteration: int, *, activated_spare: bool) -> AttemptInfo:
        with self._lock:
            prev = [e for e in self.events if e["iteration"] == iteration - 1]
        starts = [e["unix"] for e in prev if e["name"] == "abort_start"]
        ends = [e["unix"] for e in prev if e["name"] == "abort_end"]
        return AttemptInfo(launch=launcher_restart_count(), inprocess=iteration, activated_spare=activated_spare,
                           failure_noticed_unix=min(starts) if starts and iteration > 0 else None,
                           abort_end_unix=max(ends) if ends and iteration > 0 else None)

    # -- events ----------------------------------------------------------------------------------------

    def event(self, name: str, when: Optional[float] = None) -> float:
        t = time.time() if when is None else when
        with self._lock:
            self.events.append({"iteration": self._iteration, "name": name, "unix": t})
        return t

    # -- per attempt -----------------------------------------------------------------------------------

    def app_store(self) -> Any:
        """This process's client of the external store, under this launch attempt's prefix (created once)."""
        if self._app_store is None:
            base = dist.TCPStore(self.store_host, self.store_port, is_master=False, wait_for_workers=False,
                                 use_libuv=True, timeout=timedelta(seconds=self.timers.barrier_timeout))
            self._app_store = dist.PrefixStore(self.prefix + "app/", base)
        return self._app_store

    def init_process_group(self, *, backend: str = "gloo", timeout: timedelta = timedelta(seconds=120)) -> None:
        """A new default process group for this attempt, over ``PrefixStore(pg_<iteration>)`` of the external
        store (an attempt never meets the keys of the previous one)."""
        att = self._need_attempt()
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized at the start of an in-process attempt")
        store = dist.PrefixStore(f"pg_{att.iteration}/", self.app_store())
        dist.init_process_group(backend, store=store, rank=att.rank, world_size=att.world_size, timeout=timeout)
        self.event("pg_ready")

    def on_restart(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` if this attempt fails, after the abort freed every blocked collective and before the
        next attempt (last registered first). Errors are logged, not raised."""
        with self._lock:
            self._cleanups.append(cleanup)

    def mark_progress(self) -> None:
        """This attempt completed a training step (call once, after its first completed step)."""
        att = self._need_attempt()
        self.app_store().set(f"progress/{att.iteration}", str(att.rank))
        self.event("first_step_end")

    def _need_attempt(self) -> Attempt:
        if self.current is None:
            raise RuntimeError("InprocessRecovery: only inside the function given to run()")
        return self.current

    def _take_cleanups(self) -> list[Callable[[], None]]:
        with self._lock:
            fns, self._cleanups = self._cleanups, []

        def guarded(fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - a clean-up must not stop the others
                    logger.warning("in-process restart: clean-up %r failed: %s", fn, e)
            return run

        return [guarded(f) for f in fns]

    # -- the wrapper -----------------------------------------------------------------------------------

    def _gate(self) -> Any:
        """NVRx ``Initialize``: the fallback rules, evaluated identically on every rank (same tree, same store)."""
        from nvidia_resiliency_ext.inprocess.initialize import Initialize
        from nvidia_resiliency_ext.inprocess.exception import RestartAbort

        outer = self

        class _NeighborCkptGate(Initialize):
            def __call__(self, state: Any) -> Any:
                outer._iteration = state.iteration
                outer.event("initialize")
                why = outer._shrink_refused(state)
                if why is None and outer.max_restarts is not None and state.iteration > outer.max_restarts:
                    why = f"more than {outer.max_restarts} in-process restarts"
                elif why is None and state.iteration >= 2 and \
                        not outer.app_store().check([f"progress/{state.iteration - 1}"]):
                    why = (f"in-process restart {state.iteration - 1} failed before completing a step (a failure "
                           f"during recovery, or a second failure in its window)")
                if why is not None:
                    outer.gave_up = why
                    raise RestartAbort(why)
                return state

        return _NeighborCkptGate()

    def _shrink_refused(self, state: Any) -> Optional[str]:
        """Why the assigned world may not go on (None: it may): fewer active ranks than the job's, and no elastic
        policy, or none that allows this size. Identical on every rank (the same tree, the same policy)."""
        active = state.active_world_size
        if active is None or active >= self.active_world_size:
            return None
        policy = self.elastic
        if policy is None:
            return (f"no hot spare left to replace the lost rank(s) ({active} of {self.active_world_size} active "
                    "ranks remain)")
        if active % policy.model_parallel or not policy.data_parallel_ok(active // policy.model_parallel):
            return f"no hot spare left and no smaller world to continue with: {policy.why_not(active)}"
        if state.iteration > 0:
            logger.warning("neighbor_ckpt: no hot spare left: continuing on %d of %d ranks (elastic, data-parallel "
                           "size %d)", active, self.active_world_size, active // policy.model_parallel)
        return None

    def _finalize(self) -> Any:
        from megatron_patches.nvrx_gloo import FinalizeMegatron

        return FinalizeMegatron(cleanups=self._take_cleanups, on_event=self.event)

    def build(self) -> Any:
        """The NVRx ``Wrapper`` (not yet applied to a function)."""
        from nvidia_resiliency_ext import inprocess
        from nvidia_resiliency_ext.inprocess.rank_assignment import Layer, LayerFlag, Tree

        import megatron_patches.nvrx_gloo as nvrx_gloo

        store_cls = nvrx_gloo.ClientPrefixStore
        flag = LayerFlag.RESERVE if self.elastic is None else LayerFlag.RESERVE | LayerFlag.BACKFILL
        policy = self.elastic

        def world_size_filter(active: int) -> int:  # the largest world the elastic policy allows, else unchanged
            return (policy.world_size(active) or active) if policy is not None else active

        log_file = None
        if self.monitor_log_dir is not None:
            Path(self.monitor_log_dir).mkdir(parents=True, exist_ok=True)
            log_file = str(Path(self.monitor_log_dir).resolve() / "nvrx_monitor.rank{rank}.log")
        return inprocess.Wrapper(
            store_factory=store_cls,
            store_kwargs={"host_name": self.store_host, "port": self.store_port, "prefix": self.prefix + "nvrx/",
                          "timeout": timedelta(seconds=self.timers.barrier_timeout)},
            initialize=self._gate(),
            abort=nvrx_gloo.gloo_abort(keep_ports=[self.store_port], on_event=self.event),
            finalize=self._finalize(),
            health_check=None,  # NVRx's CudaHealthCheck is a no-op on CPU
            rank_assignment=Tree([Layer(min_ranks=1, max_ranks=self.active_world_size, key_or_fn="root",
                                        flag=flag)],
                                 world_size_filter=world_size_filter if policy is not None else None),
            monitor_process_logfile=log_file,
            **self.timers.as_kwargs(),
        )

    def run(self, fn: Callable[[Attempt], Any]) -> Any:
        """Call ``fn(attempt)`` under the wrapper: again, in this process, after every contained failure. Returns
        ``fn``'s value (None on a spare that was never used); raises ``SystemExit(FALLBACK_EXIT_CODE)`` after one
        log line when in-process recovery gives up."""
        from nvidia_resiliency_ext.inprocess import CallWrapper

        outer = self

        def entry(call_wrapper=None):  # noqa: ANN001, ANN202 - NVRx finds the CallWrapper by this annotation
            state = call_wrapper.state
            outer._iteration = call_wrapper.iteration
            outer.current = Attempt(iteration=call_wrapper.iteration, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), initial_rank=state.initial_rank,
                                    call_wrapper=call_wrapper)
            spare = state.initial_rank >= outer.active_world_size
            outer._attempt_info = outer._make_attempt_info(call_wrapper.iteration,
                                                           activated_spare=spare and not outer._was_active)
            outer._was_active = True
            outer.event("enter")
            if outer._attempt_info.activated_spare:
                logger.info("neighbor_ckpt: hot spare (initial rank %d) takes rank %d's place in in-process restart %d",
                            state.initial_rank, outer.current.rank, call_wrapper.iteration)
            try:
                return fn(outer.current)
            finally:
                outer.current = None
                outer._attempt_info = None

        entry.__signature__ = inspect.Signature([inspect.Parameter(  # type: ignore[attr-defined]
            "call_wrapper", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=CallWrapper)])
        wrapped = self.build()(entry)
        # NVRx runs ``while gc.collect(): pass`` before every restart iteration: with torch and megatron-core
        # imported (~0.5 M objects) that is ~0.3 s per pass on a slow core, twice at least. Everything alive now
        # (modules, the imports' objects) lives as long as the process: exempt it from collection.
        gc.collect()
        gc.freeze()
        try:
            return wrapped()
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            why = self.gave_up or f"{type(e).__name__}: {e}"
            logger.error("neighbor_ckpt: in-process recovery gives up on initial rank %d (%s): exiting with status %d "
                         "so the launcher restarts the job; recover() then resumes from the host stores",
                         self.initial_rank, why, FALLBACK_EXIT_CODE)
            raise SystemExit(FALLBACK_EXIT_CODE) from e
