"""Who this process is in an in-process launch: the one place that reads the engine's environment.

Our launcher (:mod:`neighbor_ckpt.inprocess.launcher`) starts every process with its index, the launch's size and
spare count, the store list, the run id and the store token's file in the environment (the names are in
:mod:`neighbor_ckpt.inprocess.protocol`). :meth:`ProcessIdentity.from_env` reads them once, checks them and hands the
engine a frozen value; nothing else of the engine reads ``os.environ``.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from neighbor_ckpt.config import refuse_legacy_timer_env
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.inprocess import protocol
from neighbor_ckpt.inprocess.stores import StoreAddresses
from neighbor_ckpt.recovery.attempt import RESTART_COUNT_ENV

__all__ = ["ProcessIdentity", "NODE_ID_ENV", "node_index"]

NODE_ID_ENV = "NEIGHBOR_CKPT_NODE_ID"
"""The node's name as the launch gives it (a simulated node's id on one machine; the host name when unset)."""


def node_index(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The index of this process's node in an in-process launch (:data:`~neighbor_ckpt.inprocess.protocol.
    ENV_NODE_INDEX`, set by its launcher; ``env``: ``os.environ`` when None), None outside one: what a fault with
    ``target: node`` compares with ``fault_injection.node``."""
    raw = (os.environ if env is None else env).get(protocol.ENV_NODE_INDEX, "")
    return int(raw) if raw.isdigit() else None


@dataclass(frozen=True)
class ProcessIdentity:
    """One process of an in-process launch, as its launcher started it (pure, frozen)."""

    process: int
    """The process index (the rank it was started as; a spare's is >= the active world size)."""
    processes: int
    """Processes of the launch, spares included."""
    spares: int
    """How many of the processes are hot spares (the last ones)."""
    stores: StoreAddresses
    """The launch's stores: the primary first, then the standbys."""
    run_id: str = "job"
    """The launch's store namespace."""
    launch: int = 0
    """The launcher-level restart count (``TORCHELASTIC_RESTART_COUNT``)."""
    store_epoch: int = 0
    """The store to start on (a replacement started after a failover gets its launcher's)."""
    token_file: Optional[Path] = None
    """The launch's store token file (None: the stores have no gate)."""
    node: str = ""
    """The node this process runs on (for its ``proc/<p>`` record)."""
    complete_file: Optional[Path] = None
    """Where the launchers write the job's completion marker (:mod:`~neighbor_ckpt.inprocess.completion`; None: no
    marker, not started by our launcher)."""

    def __post_init__(self) -> None:
        if self.processes < 1:
            raise ConfigError(f"in-process recovery: the launch has {self.processes} process(es)")
        if not 0 <= self.spares < self.processes:
            raise ConfigError(f"in-process recovery: {self.spares} spare(s) for {self.processes} process(es): needs "
                              "0 <= spares < processes")
        if self.process < 0:
            raise ConfigError(f"in-process recovery: process index {self.process} is negative")

    @property
    def active_world_size(self) -> int:
        """The ranks of generation 0 (processes less spares)."""
        return self.processes - self.spares

    @property
    def prefix(self) -> str:
        """Every store key of this launch lives under it (:func:`~neighbor_ckpt.inprocess.protocol.launch_prefix`)."""
        return protocol.launch_prefix(self.run_id, self.launch)

    @property
    def is_replacement(self) -> bool:
        """Started by a launcher after generation 0 formed (its index is past the launch's first processes)."""
        return self.process >= self.processes

    def record(self, pid: Optional[int] = None) -> str:
        """This process's ``proc/<p>`` value: JSON ``{"pid", "node", "start"}``."""
        from neighbor_ckpt.runtime.procs import process_start

        pid = os.getpid() if pid is None else pid
        return json.dumps({"pid": pid, "node": self.node or socket.gethostname(), "start": process_start(pid)})

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None, *, store: Optional[str] = None) -> "ProcessIdentity":
        """Read from the environment our launcher set (``env``: ``os.environ`` when None). ``store``: the store list
        given on a recipe's command line (``--inprocess-store``), which wins over the launcher's.

        Raises:
            ConfigError: not started by our launcher (plain torchrun), the old timer variable is set, or a value is
                not what the launcher writes.
        """
        env = os.environ if env is None else env
        refuse_legacy_timer_env(env)
        if protocol.ENV_LAUNCHER not in env:
            raise ConfigError(
                "neighbor_ckpt.inprocess.enabled: in-process recovery needs our launcher, which keeps the surviving "
                "processes alive and starts the spares: run the job with `neighbor-ckpt launch CONFIG` (one machine) "
                "or `neighbor-ckpt launch CONFIG --slurm FILE` (a cluster), not plain torchrun, which stops every "
                "worker of a node when one exits. Or set neighbor_ckpt.inprocess.enabled=false for the restart path")
        what = "--inprocess-store" if store is not None else f"{protocol.ENV_STORE} (our launcher sets it)"
        addresses = StoreAddresses.parse(store if store is not None else env.get(protocol.ENV_STORE, ""), what)
        token, complete = env.get(protocol.ENV_STORE_TOKEN), env.get(protocol.ENV_COMPLETE_FILE)
        return cls(process=_int(env, protocol.ENV_PROCESS, 0), processes=_int(env, protocol.ENV_PROCESSES, 1),
                   spares=_int(env, protocol.ENV_SPARES, 0), stores=addresses,
                   run_id=env.get(protocol.ENV_RUN_ID) or env.get("NEIGHBOR_CKPT_JOB_ID") or "job",
                   launch=_int(env, RESTART_COUNT_ENV, 0), store_epoch=_int(env, protocol.ENV_STORE_EPOCH, 0),
                   token_file=Path(token) if token else None, node=env.get(NODE_ID_ENV, ""),
                   complete_file=Path(complete) if complete else None)

    def require_spares(self, configured: int) -> None:
        """The job file's ``inprocess.spares`` must be the count the launcher started with (one job file for both)."""
        if configured != self.spares:
            raise ConfigError(f"neighbor_ckpt.inprocess.spares is {configured} but the launcher started "
                              f"{self.spares} spare(s): launch the job with the same job file")

    def require_ranks(self, ranks: int) -> None:
        """The job's ranks (``trainer.devices x trainer.num_nodes``) must be the launch's active processes."""
        if ranks != self.active_world_size:
            raise ConfigError(f"in-process launch of {self.processes} process(es) with {self.spares} spare(s) for a "
                              f"job of {ranks} rank(s): start it with `neighbor-ckpt launch` and the same job file")


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"in-process recovery: {name}={raw!r} is not an integer (our launcher sets it)") from None
