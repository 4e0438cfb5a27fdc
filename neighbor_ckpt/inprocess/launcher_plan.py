"""The per-node launcher's plan and pure decisions (:mod:`neighbor_ckpt.inprocess.launcher` runs them): its command
line as frozen data (:class:`LauncherPlan`, :func:`parse_args`), what each process it starts gets
(:func:`child_command`, :func:`child_env`) and what an exit means (:func:`classify_exit`). Tested in one process
(``tests/unit/test_inprocess_launcher.py``)."""

from __future__ import annotations

import argparse
import enum
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.inprocess import protocol

__all__ = ["LauncherPlan", "Action", "classify_exit", "describe_exit", "exit_status", "child_env", "child_command",
           "parse_args"]


# --- the plan: argv -> frozen data -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class LauncherPlan:
    """What one launcher runs (pure data, from :func:`parse_args`)."""

    stores: tuple[tuple[str, int], ...]
    """The launch's stores in order (the primary first; :mod:`~neighbor_ckpt.inprocess.stores`)."""
    run_id: str
    node: str
    first: int
    """The first process index this launcher starts."""
    count: int
    """How many (``first..first+count-1``)."""
    processes: int
    """``N``: processes of the launch, spares included."""
    spares: int
    """The last ``spares`` of the ``N`` are hot spares."""
    max_restarts: int
    """Launcher-level restarts (when in-process recovery gives up)."""
    nodes: int
    """Launchers of the launch (the restart rendezvous waits for all of them)."""
    program: tuple[str, ...]
    store_root: Optional[str] = None
    no_python: bool = False
    poll_s: float = 0.05
    grace_s: float = 10.0
    """SIGTERM, then SIGKILL after this (the launcher's own exit)."""
    fallback_grace_s: float = 30.0
    """On a give-up: how long the processes get to exit on their own before SIGKILL."""
    complete_grace_s: float = 60.0
    """Once ``complete`` is set: how long the processes get to exit before they are stopped."""
    store_grace_s: float = 60.0
    """How long the store may not answer before the launcher gives up (:data:`EXIT_STORE_LOST`)."""
    connect_timeout_s: float = 120.0
    rendezvous_timeout_s: float = 300.0
    max_replacements: int = 16
    """Replacements (after :data:`~protocol.EXIT_HYGIENE`, and with ``grow_back``) this launcher starts per attempt,
    at most."""
    elastic: bool = False
    """The job's ``neighbor_ckpt.elastic.enabled`` (``--elastic``): a restart may go on without a node lost for good
    when the processes left are fewer than the job's ranks (:mod:`~neighbor_ckpt.inprocess.restart_rendezvous`)."""
    grow_back: bool = False
    """Also replace a process of this node that died otherwise (killed, crashed, declared dead): the replacement
    joins as a spare and can take the next lost rank. It starts once a generation formed after the death has
    completed a step, so that its start-up (imports, one CPU core for seconds) stays off that recovery's path."""
    host_store: Optional[int] = None
    """The index of the store this launcher hosts (a store host process beside its own, which dies with it), if
    any."""
    store_listen: Optional[str] = None
    """The address the hosted store listens on (None: its own address in ``stores``, the job's interface)."""
    detector_timeout_s: float = 5.0
    """The job's ``detector.timeout_s`` (``--detector-timeout``): every timeout of the launcher that is about the job's
    liveness follows from it (:attr:`store_timeout_s`; once the job completed, how long a process that never joined a
    generation gets to exit on its own; docs/timeouts.md)."""
    listen_fd: Optional[int] = None
    """A listening socket this launcher inherited for the store it hosts (``--listen-fd``): a single-machine launch
    binds every store's port before the launchers start and hands it over, so no other process can take it
    meanwhile; the store host serves on it. None: the store host binds its address itself (a cluster)."""
    complete_file: Optional[str] = None
    """The launch's completion marker (:mod:`~neighbor_ckpt.inprocess.completion`): written once the job completed;
    a process that starts later finds it and exits 0 without a store."""
    open_store: bool = False
    """The job's ``launch.open_store`` (``--open-store``): the hosted store host serves its store open to the node's
    users where the kernel cannot seal it, instead of refusing to start."""
    token_file: Optional[str] = None
    """The launch's store token file (:mod:`~neighbor_ckpt.inprocess.store_auth`): the hosted store admits only the
    clients that hold it, and this launcher and its processes present it. None: the stores have no gate."""

    def __post_init__(self) -> None:
        if not self.program:
            raise ValueError("no program: give it after `--`")
        if self.processes < 1 or self.count < 1 or self.first < 0 or self.first + self.count > self.processes:
            raise ValueError(f"--first {self.first} --count {self.count}: not a range of the {self.processes} "
                             f"processes of the launch")
        if not 0 <= self.spares < self.processes:
            raise ValueError(f"--spares {self.spares}: needs 0 <= spares < processes ({self.processes})")
        if self.max_restarts < 0 or self.nodes < 1:
            raise ValueError("--max-restarts must be >= 0 and --nodes >= 1")
        if not self.stores:
            raise ValueError("--store: no store")
        if self.host_store is not None and not 0 <= self.host_store < len(self.stores):
            raise ValueError(f"--host-store {self.host_store}: not an index of the {len(self.stores)} store(s)")
        if self.listen_fd is not None and self.host_store is None:
            raise ValueError("--listen-fd: a socket for the hosted store, but no --host-store")

    @property
    def store_timeout_s(self) -> float:
        """How long a store operation may go unanswered before the store counts as lost (then: the next one): the
        processes' own (:func:`~neighbor_ckpt.inprocess.stores.store_timeout_for` of ``detector.timeout_s``), so
        that one launcher's stall never promotes a store the processes still use."""
        from neighbor_ckpt.inprocess.stores import store_timeout_for

        return store_timeout_for(self.detector_timeout_s)

    @property
    def reach_s(self) -> float:
        """How long the launcher tries to open a connection to any store of the list at its start before it exits
        (:func:`~neighbor_ckpt.inprocess.roll_call.reach_any`): the store timeout plus ``detector.timeout_s``. The
        other launchers' roll call declares its processes dead that long after the first process is ready."""
        return self.store_timeout_s + self.detector_timeout_s

    @property
    def beat_s(self) -> float:
        """How often the launcher beats (``lhb/<node>``): four times per ``detector.timeout_s``, at most every
        second, at least every ``poll_s``; a monitor takes the node for lost once the beat stood still for
        ``detector.timeout_s``."""
        return max(self.poll_s, min(1.0, self.detector_timeout_s / 4))

    @property
    def indices(self) -> range:
        """This launcher's process indices."""
        return range(self.first, self.first + self.count)

    @property
    def store_host(self) -> str:
        """The primary store's host."""
        return self.stores[0][0]

    @property
    def store_port(self) -> int:
        return self.stores[0][1]

    @property
    def store_address(self) -> str:
        """The store list as ``host:port[,host:port...]`` (:data:`~protocol.ENV_STORE`)."""
        return ",".join(f"{h}:{p}" for h, p in self.stores)

    @property
    def name(self) -> str:
        """``launcher:<node>``: the ``by`` of the failures it records."""
        return f"launcher:{self.node}"


def _positive(text: str) -> float:
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be > 0")
    return v


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m neighbor_ckpt.inprocess.launcher",
                                 description="Start and supervise one node's processes of an in-process launch.")
    ap.add_argument("--store", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                    help="the launch's stores, the primary first, then the standbys")
    ap.add_argument("--host-store", type=int, default=None, metavar="INDEX",
                    help="host the store of this index of the list (a store host beside this launcher)")
    ap.add_argument("--store-listen", default=None,
                    help="the address the hosted store listens on (default: its address in --store)")
    ap.add_argument("--detector-timeout", type=_positive, default=5.0,
                    help="the job's detector.timeout_s: the store timeout (max(2 x it, 3) s, as the processes') and "
                         "the roll call follow from it (default 5)")
    ap.add_argument("--listen-fd", type=int, default=None, metavar="FD",
                    help="an inherited listening socket for the hosted store (a single-machine launch binds it)")
    ap.add_argument("--complete-file", default=None, metavar="FILE",
                    help="the launch's completion marker: written once the job completed (processes read it)")
    ap.add_argument("--token-file", default=None, metavar="FILE",
                    help="the launch's store token (a 0600 file; the stores admit only its holders)")
    ap.add_argument("--run-id", required=True, help="the launch's run id (the store namespace)")
    ap.add_argument("--node", required=True, help="this node's id (NEIGHBOR_CKPT_NODE_ID of its processes)")
    ap.add_argument("--first", type=int, required=True, help="the first process index started here")
    ap.add_argument("--count", type=int, required=True, help="how many processes are started here")
    ap.add_argument("--processes", type=int, required=True, help="N: processes of the launch, spares included")
    ap.add_argument("--spares", type=int, default=0, help="the last SPARES of the N are hot spares")
    ap.add_argument("--max-restarts", type=int, default=0, help="launcher-level restarts when recovery gives up")
    ap.add_argument("--nodes", type=int, default=None,
                    help="launchers of the launch (default: ceil(processes / count))")
    ap.add_argument("--store-root", default=None,
                    help="host store root: each process gets NEIGHBOR_CKPT_STORE_DIR=STORE_ROOT/NODE")
    ap.add_argument("--no-python", action="store_true", help="PROGRAM is a whole command, not a Python script")
    ap.add_argument("--poll", type=_positive, default=0.05, help="seconds between two looks (default 0.05)")
    ap.add_argument("--grace", type=_positive, default=10.0, help="SIGTERM, then SIGKILL after this (default 10)")
    ap.add_argument("--fallback-grace", type=_positive, default=30.0,
                    help="on a give-up, seconds the processes get to exit before SIGKILL (default 30)")
    ap.add_argument("--complete-grace", type=_positive, default=60.0,
                    help="once complete, seconds the processes get to exit before they are stopped (default 60)")
    ap.add_argument("--store-grace", type=_positive, default=60.0,
                    help="seconds the store may not answer before the launcher stops (default 60)")
    ap.add_argument("--connect-timeout", type=_positive, default=120.0,
                    help="seconds the first store operation may wait for a store that accepted the connection (its "
                         "host may still be starting; default 120); a launcher that cannot connect to any store "
                         "exits after the store timeout plus --detector-timeout")
    ap.add_argument("--rendezvous-timeout", type=_positive, default=300.0,
                    help="seconds the restart waits for every launcher (default 300)")
    ap.add_argument("--max-replacements", type=int, default=16,
                    help="replacement processes per attempt at most (default 16)")
    ap.add_argument("--elastic", action="store_true",
                    help="the job's neighbor_ckpt.elastic.enabled: a restart may go on without a node lost for good "
                         "at a smaller data-parallel size")
    ap.add_argument("--open-store", action="store_true",
                    help="the job's launch.open_store: where the kernel cannot seal the hosted store, serve it open to "
                         "the node's users instead of refusing to start")
    ap.add_argument("--grow-back", action="store_true",
                    help="replace every process of this node that dies (it joins as a spare), once the next "
                         "generation has completed a step")
    ap.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")
    return ap


def parse_args(argv: Sequence[str]) -> LauncherPlan:
    """The plan of ``argv`` (exits with a usage error, as argparse does, when it is not one)."""
    ap = _parser()
    a = ap.parse_args(list(argv))
    program = list(a.program)
    if program[:1] == ["--"]:
        program = program[1:]
    from neighbor_ckpt.inprocess.stores import StoreAddresses

    try:
        stores = StoreAddresses.parse(a.store, "--store").addresses
    except ConfigError:
        ap.error(f"--store {a.store!r}: expected HOST:PORT[,HOST:PORT...]")
    nodes = a.nodes if a.nodes is not None else -(-a.processes // max(1, a.count))
    try:
        return LauncherPlan(stores=stores, host_store=a.host_store, store_listen=a.store_listen,
                            detector_timeout_s=a.detector_timeout, listen_fd=a.listen_fd,
                            complete_file=a.complete_file, token_file=a.token_file, open_store=a.open_store, run_id=a.run_id, node=a.node,
                            first=a.first, count=a.count, processes=a.processes, spares=a.spares,
                            max_restarts=a.max_restarts, nodes=nodes, program=tuple(program), store_root=a.store_root, no_python=a.no_python,
                            poll_s=a.poll, grace_s=a.grace, fallback_grace_s=a.fallback_grace,
                            complete_grace_s=a.complete_grace, store_grace_s=a.store_grace,
                            connect_timeout_s=a.connect_timeout, rendezvous_timeout_s=a.rendezvous_timeout,
                            max_replacements=a.max_replacements, grow_back=a.grow_back, elastic=a.elastic)
    except ValueError as e:
        ap.error(str(e))
        raise  # unreachable: ap.error exits


def child_command(plan: LauncherPlan) -> list[str]:
    """What each process runs: ``python -u PROGRAM ARGS`` (this interpreter), or ``PROGRAM ARGS`` with
    ``--no-python``."""
    return list(plan.program) if plan.no_python else [sys.executable, "-u", *plan.program]


def child_env(plan: LauncherPlan, *, index: int, local_rank: int, attempt: int, launcher_pid: int,
              replaces: Optional[int] = None, store_epoch: int = 0) -> dict[str, str]:
    """The environment a process gets on top of the launcher's (pure but for the run tag, the same on every call of
    one launcher); ``store_epoch``: the store in use now. The run tag
    (:data:`~neighbor_ckpt.runtime.procs.RUN_TAG_ENV`) is the launcher's own when it has one (its launch drew it),
    else one drawn once for this launcher (:func:`~neighbor_ckpt.runtime.procs.launch_run_tag`): the launcher kills a
    recorded pid only if it carries it (:func:`~neighbor_ckpt.inprocess.launcher_children.recorded_pid_to_kill`)."""
    from neighbor_ckpt.runtime.procs import RUN_TAG_ENV, launch_run_tag

    env = {protocol.ENV_PROCESS: str(index), protocol.ENV_PROCESSES: str(plan.processes),
           "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(plan.count),
           protocol.ENV_STORE: plan.store_address, protocol.ENV_RUN_ID: plan.run_id,
           protocol.ENV_LAUNCHER: str(launcher_pid), protocol.ENV_SPARES: str(plan.spares),
           "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_RUN_ID": plan.run_id,
           "NEIGHBOR_CKPT_NODE_ID": plan.node, "TORCH_CPP_LOG_LEVEL": "error", RUN_TAG_ENV: launch_run_tag()}
    if plan.store_root is not None:
        env["NEIGHBOR_CKPT_STORE_DIR"] = str(Path(plan.store_root) / plan.node)
    if replaces is not None:
        env[protocol.ENV_REPLACES] = str(replaces)
    if store_epoch:
        env[protocol.ENV_STORE_EPOCH] = str(store_epoch)
    if plan.host_store is not None:
        env[protocol.ENV_STORE_HOSTED] = str(plan.host_store)
        env[protocol.ENV_NODE_INDEX] = str(plan.host_store)
    if plan.token_file is not None:
        env[protocol.ENV_STORE_TOKEN] = str(plan.token_file)
    if plan.complete_file is not None:
        env[protocol.ENV_COMPLETE_FILE] = str(plan.complete_file)
    return env


# --- pure decisions --------------------------------------------------------------------------------------------


class Action(enum.Enum):
    """What the launcher does about a process that exited."""

    NOTHING = "nothing"
    """Exit 0: waited for."""
    DECLARED = "declared"
    """Fenced, or already listed in ``dead``: nothing more."""
    FALLBACK = "fallback"
    """Exit 75: the job-level restart."""
    DECLARE = "declare"
    """Declare it dead (``dead`` + ``gen/<g>/failed``)."""
    REPLACE = "replace"
    """Declare it dead and start a replacement (:data:`~protocol.EXIT_HYGIENE`)."""
    CUT_OFF = "cut_off"
    """Nothing more, for good (:data:`~protocol.EXIT_CUT_OFF`): no restart, no replacement, nothing written for it
    (the majority declares it, if it goes on)."""


def classify_exit(code: int, declared: bool) -> Action:
    """What to do about a process that exited with ``code`` (``Popen.returncode``: negative for a signal);
    ``declared``: it is listed in ``dead`` already (a detector listed it, or this launcher killed it for that)."""
    if code == 0:
        return Action.NOTHING
    if code == protocol.EXIT_FALLBACK:
        return Action.FALLBACK
    if code == protocol.EXIT_CUT_OFF:
        return Action.CUT_OFF
    if code == protocol.EXIT_FENCED or declared:
        return Action.DECLARED
    if code == protocol.EXIT_HYGIENE:
        return Action.REPLACE
    return Action.DECLARE


def describe_exit(code: int) -> str:
    """``"exited with status 3"``, ``"killed by signal 9 (SIGKILL)"``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        return f"killed by signal {-code} ({name})"
    known = {protocol.EXIT_HYGIENE: " (hygiene: replaced)", protocol.EXIT_ABORT_HUNG: " (its abort hung)",
             protocol.EXIT_FENCED: " (fenced)", protocol.EXIT_CUT_OFF: " (cut off from the majority)",
             protocol.EXIT_FALLBACK: " (in-process recovery gave up)"}
    return f"exited with status {code}{known.get(code, '')}"


def exit_status(code: int) -> int:
    """A ``Popen.returncode`` as a shell reports it (a signal ``s``: ``128 + s``)."""
    return 128 - code if code < 0 else code
