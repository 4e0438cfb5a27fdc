"""The job id of a torchrun launch that has no run id: made once per launch, shared by its restarts.

Plain ``torchrun`` (no ``--rdzv-id``, no ``--standalone``) sets ``TORCHELASTIC_RUN_ID=none`` for every launch. Taken
as the job id, it made a brand-new launch into the same host store find an old, crashed launch's snapshots and resume
from them without a word. Which id a process uses is :func:`neighbor_ckpt.config.decide_job_id` (pure); this module
makes the missing one:

* **Where it lives.** The torchrun agent hosts a TCPStore (the rendezvous store; ``torch/distributed/elastic/
  rendezvous/static_tcp_rendezvous.py`` and ``dynamic_rendezvous.py``) and hands it to the workers as
  MASTER_ADDR/MASTER_PORT with ``TORCHELASTIC_USE_AGENT_STORE=True`` (``elastic/agent/server/local_elastic_agent.py``).
  It lives in the agent, so it outlives every worker restart of the launch, and a new launch has a new one.
* **Who writes it.** Every worker proposes a fresh id with one ``compare_set(key, "", candidate)``: the store keeps
  the first proposal and answers it to everyone, later attempts included. That is "rank 0 of attempt 0 publishes,
  restarted attempts read" without trusting ``TORCHELASTIC_RESTART_COUNT``, which is per agent and can differ
  between nodes (see :mod:`neighbor_ckpt.runtime.torchrun`), and without a wait on rank 0.
* **When.** Before :func:`~neighbor_ckpt.runtime.torchrun.prepare_torchrun_restart` points MASTER_PORT at the
  attempt's own store (it calls :func:`establish_launch_id` first), or when the checkpointer resolves its job id
  (:func:`resolve_job_id`); the id is then kept in ``NEIGHBOR_CKPT_LAUNCH_ID`` for the rest of the process, so
  :meth:`~neighbor_ckpt.config.NeighborCkptConfig.resolved_job_id` answers it everywhere.
* **Without an agent store** (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): on one node every worker is a child of the
  one agent, which lives as long as the launch, so the id is derived from the agent process (boot id, pid, start
  time). Across nodes there is nothing shared to derive it from: :class:`~neighbor_ckpt.errors.ConfigError` asks
  for ``--rdzv-id`` or ``neighbor_ckpt.job_id``.

An earlier launch's host store under the same root is never loaded (its job id differs); :func:`report_leftovers`
names it in one log line per rank with its size and the command that deletes it.

May import: :mod:`neighbor_ckpt.errors`, :mod:`neighbor_ckpt.config`, :mod:`neighbor_ckpt.runtime.procs`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shlex
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping

from neighbor_ckpt.config import LAUNCH_ID_ENV, JobIdChoice, NeighborCkptConfig, decide_job_id
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.runtime import procs

__all__ = ["LAUNCH_KEY", "LAUNCH_PREFIX", "new_launch_id", "agent_store_address", "exchange_launch_id",
           "establish_launch_id", "resolve_job_id", "leftover_launch_stores", "report_leftovers"]

logger = logging.getLogger(__name__)

LAUNCH_KEY = "neighbor_ckpt/launch_id"
"""Key of the launch's id in the agent's store."""

LAUNCH_PREFIX = "launch-"
"""Every id made here starts with it (so an earlier launch's leftover store can be told apart from another job's)."""


def new_launch_id() -> str:
    """A fresh id: ``launch-<UTC date>-<time>-<8 hex digits>`` (readable in ``ls``, unique per launch)."""
    return f"{LAUNCH_PREFIX}{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"


def agent_store_address(env: Mapping[str, str] = os.environ) -> tuple[str, int] | None:
    """The torchrun agent's store (MASTER_ADDR, MASTER_PORT) while the workers are told to use it; None otherwise
    (not under torchrun, the agent does not share it, or :func:`prepare_torchrun_restart` already pointed MASTER_PORT
    at the attempt's own store: it sets ``TORCHELASTIC_USE_AGENT_STORE=False``)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port:
        return None
    return addr, int(port)


def exchange_launch_id(store: Any, candidate: str) -> str:
    """The launch's id in ``store``: ``candidate`` if nobody proposed one before, else the first proposal.

    One atomic ``compare_set`` (expected value empty: set only when the key is absent); every caller of every attempt
    gets the same answer."""
    value = store.compare_set(LAUNCH_KEY, "", candidate)
    return value.decode() if isinstance(value, bytes) else str(value)


def _single_agent(env: Mapping[str, str]) -> bool:
    group_world_size = env.get("GROUP_WORLD_SIZE")
    if group_world_size is not None:
        return group_world_size == "1"
    return env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE")


def _agent_process_id() -> str:
    """An id of this worker's parent (the torchrun agent on this node): the same for all its workers and restarts."""
    ppid = os.getppid()
    raw = f"{procs.boot_id()}/{ppid}/{procs.process_start(ppid)}"
    return f"{LAUNCH_PREFIX}agent-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def establish_launch_id(*, timeout_s: float = 120.0) -> str | None:
    """Make (or read) this launch's id and keep it in ``NEIGHBOR_CKPT_LAUNCH_ID``; idempotent.

    Does nothing and returns None unless this process runs under torchrun without a usable run id and without an
    explicit NEIGHBOR_CKPT_JOB_ID (the configured ``job_id`` is not known here: an unused launch id costs one store
    round trip). Call before the process group exists or after, in every worker.

    Raises:
        ConfigError: several agents (nodes) and no agent store shared with the workers: nothing to agree on.
    """
    env = os.environ
    have = env.get(LAUNCH_ID_ENV)
    if have:
        return have
    choice = decide_job_id(env, None)
    if choice.source != "launch":
        return None
    address = agent_store_address(env)
    if address is not None:
        import torch.distributed as dist

        store = dist.TCPStore(address[0], address[1], is_master=False, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        try:
            launch_id = exchange_launch_id(store, new_launch_id())
        finally:
            del store
        how = f"agent store {address[0]}:{address[1]}"
    elif _single_agent(env):
        launch_id, how = _agent_process_id(), "the torchrun agent process (its store is not shared with workers)"
    else:
        raise ConfigError(
            "neighbor_ckpt.job_id: torchrun gave this launch no run id (TORCHELASTIC_RUN_ID="
            f"{env.get('TORCHELASTIC_RUN_ID', '')!r}) and does not share its agent store with the workers "
            "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1?), so a new launch cannot be told from an old one: pass "
            "--rdzv-id=<an id unique to this launch> to torchrun, or set neighbor_ckpt.job_id (or NEIGHBOR_CKPT_JOB_ID)")
    os.environ[LAUNCH_ID_ENV] = launch_id
    logger.info("rank %s: torchrun gave no run id; job id of this launch: %s (from %s; restart %s)",
                env.get("RANK", "?"), launch_id, how, env.get("TORCHELASTIC_RESTART_COUNT", "?"))
    return launch_id


def resolve_job_id(config: NeighborCkptConfig) -> JobIdChoice:
    """The job id of this process (:func:`~neighbor_ckpt.config.decide_job_id`), after making this launch's id when
    the launcher gave none (:func:`establish_launch_id`)."""
    choice = decide_job_id(os.environ, config.job_id)
    if choice.job_id is None:
        establish_launch_id()
        choice = decide_job_id(os.environ, config.job_id)
    assert choice.job_id is not None  # noqa: S101 - establish_launch_id sets it or raises
    return choice


def _is_launch_dir(name: str) -> bool:
    return name == "none" or name.startswith(LAUNCH_PREFIX)


def leftover_launch_stores(user_dir: Path, job_id: str, rank: int) -> list[tuple[Path, int]]:
    """This rank's directories (and their sizes in bytes) left under ``user_dir`` (``<store root>/<user>``) by
    earlier torchrun launches without a run id: job ids ``none`` (before launch ids existed) or ``launch-*``, other
    than ``job_id``. Another job's explicitly named store is not an earlier launch of this one and is not listed."""
    out: list[tuple[Path, int]] = []
    try:
        entries = sorted(user_dir.iterdir())
    except OSError:
        return out
    for job_dir in entries:
        if job_dir.name == job_id or not _is_launch_dir(job_dir.name):
            continue
        d = job_dir / f"rank{rank}"
        if d.is_dir():
            out.append((d, procs.dir_bytes(d)))
    return out


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def report_leftovers(user_dir: Path, job_id: str, rank: int) -> list[tuple[Path, int]]:
    """Log (one WARNING line) the host stores of earlier launches this rank ignores; returns them."""
    found = leftover_launch_stores(user_dir, job_id, rank)
    if found:
        where = ", ".join(f"{p} ({_fmt_bytes(n)})" for p, n in found)
        logger.warning(
            "rank %d: ignored the snapshots of an earlier launch: %s. This launch (job id %s) never loads them: "
            "torchrun gave no run id, so every launch gets its own job id (its restarts share it); to "
            "resume across launches give them one id (neighbor_ckpt.job_id, NEIGHBOR_CKPT_JOB_ID or torchrun "
            "--rdzv-id). The old files only hold host memory: delete them with: rm -rf %s",
            rank, where, job_id, " ".join(shlex.quote(str(p)) for p, _ in found))
    return found
