"""Launcher integration: make ``torchrun --max-restarts N`` worker-group restarts work (gloo and NCCL).

Problem (torch 2.13, see REPORT.md): under torchrun the elastic agent hosts the
TCPStore that the workers' ``init_process_group(init_method="env://")`` uses
(``TORCHELASTIC_USE_AGENT_STORE=True``; ``torch/distributed/rendezvous.py``
``_create_c10d_store``).  That store lives in the agent, so it survives a
worker-group restart, and the restarted workers use it again with the *same*
keys (``default_pg/0//cpu//0/<rank>`` for gloo, the NCCL unique-id key for
NCCL).  A restarted rank that reads a peer's key before that peer rewrote it
gets the *previous attempt's* address and fails with
``Gloo connectFullMesh failed ... Connection refused``.

Fix: give every worker-group incarnation its own, fresh TCPStore, hosted by
global rank 0 of that incarnation (what torch does without torchelastic):

* global rank 0 starts a TCPStore server on an OS-chosen free port ``P`` in its
  own process, writes a random token into it, and publishes ``"P token"`` in the
  agent's store (still reachable at the agent-provided MASTER_ADDR/MASTER_PORT);
* every other rank reads that record and accepts it only after connecting to
  ``MASTER_ADDR:P`` and reading the same token back.  A record left over from a
  previous incarnation points at a server that died with the previous rank 0
  (the agents stop all workers before the new rendezvous completes), so it is
  rejected and the rank retries until the new rank 0 has published;
* every rank then sets ``MASTER_PORT=P`` and ``TORCHELASTIC_USE_AGENT_STORE=False``,
  so ``init_process_group`` makes rank 0 re-use its own server (TCPStore
  multi-tenancy, same port in the same process) and all others connect to it.

We deliberately do NOT derive the port from ``TORCHELASTIC_RESTART_COUNT``:
that counter is per agent and is not incremented when an agent restarts its
workers because *another* node re-joined (``elastic/agent/server/api.py``
``_invoke_run``), so on multi-node jobs it can differ between nodes
(pytorch/pytorch#108158, #135712) and the ranks would disagree on the port.

It also makes the job id of a launch that torchrun gave no run id
(:func:`~neighbor_ckpt.runtime.launch_identity.establish_launch_id`), while the agent's store is still the one
MASTER_PORT names.

Must be called in every rank, before the default process group is created
(e.g. when constructing a Lightning callback, before ``Trainer.fit``).  It is
a no-op outside torchelastic, when the agent does not share its store
(``TORCHELASTIC_USE_AGENT_STORE`` != "True", e.g. with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), when the process group already
exists, and on the first attempt of a single-agent (single-node) job, where
the agent's store cannot hold stale worker keys yet.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from datetime import timedelta

from neighbor_ckpt.runtime.launch_identity import establish_launch_id
from neighbor_ckpt.runtime.launch_store import AGENT_STORE_ENV

__all__ = ["prepare_torchrun_restart"]

logger = logging.getLogger(__name__)

_KEY = "neighbor_ckpt/torchrun_fix/rank0_store"
_TOKEN_KEY = "neighbor_ckpt/torchrun_fix/token"

# Rank 0 keeps its per-incarnation store server alive for the process lifetime.
_SERVER = None
_DONE = False


def _single_agent() -> bool:
    group_world_size = os.environ.get("GROUP_WORLD_SIZE")
    if group_world_size is not None:
        return group_world_size == "1"
    return os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")


def prepare_torchrun_restart(timeout: float = 900.0) -> bool:
    """Give this torchrun worker-group incarnation a fresh c10d store.

    Call in every rank before ``torch.distributed.init_process_group`` (Lightning
    calls it inside ``Trainer.fit``).  Non-zero ranks block until global rank 0
    has called it too (at most ``timeout`` seconds).

    Returns True if ``MASTER_PORT`` / ``TORCHELASTIC_USE_AGENT_STORE`` were changed.
    """
    global _SERVER, _DONE
    if _DONE:
        return False
    if "TORCHELASTIC_RUN_ID" not in os.environ or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return False  # not launched by torchelastic
    # A launch without a run id gets its job id now, while MASTER_PORT still names the agent's store (below it may be
    # pointed at this attempt's own store, which dies with the attempt).
    establish_launch_id(timeout_s=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False  # the agent hands out a fresh port per round already
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        logger.warning("prepare_torchrun_restart: process group already initialized; too late, doing nothing")
        return False
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and _single_agent():
        return False  # first incarnation of a single-agent job: agent store is still clean

    rank = int(os.environ["RANK"])
    addr = os.environ["MASTER_ADDR"]
    agent_port = int(os.environ["MASTER_PORT"])
    os.environ[AGENT_STORE_ENV] = f"{addr}:{agent_port}"  # the store that outlives this incarnation (launch_store)
    t0 = time.monotonic()
    agent_store = dist.TCPStore(addr, agent_port, is_master=False, timeout=timedelta(seconds=timeout))

    if rank == 0:
        token = uuid.uuid4().hex
        _SERVER = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                                timeout=timedelta(seconds=timeout))
        port = _SERVER.port
        _SERVER.set(_TOKEN_KEY, token)
        agent_store.set(_KEY, f"{port} {token}")
    else:
        deadline = t0 + timeout
        while True:
            try:
                agent_store.wait([_KEY], timedelta(seconds=max(1.0, deadline - time.monotonic())))
                port_s, token = agent_store.get(_KEY).decode().split()
                port = int(port_s)
                # Fast reject of a stale record: the previous rank 0's server is gone (connection refused).
                socket.create_connection((addr, port), timeout=2).close()
                probe = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=2))
                ok = probe.check([_TOKEN_KEY]) and probe.get(_TOKEN_KEY).decode() == token
                del probe
                if ok:
                    break
            except Exception as exc:  # stale record: previous rank 0's server is gone
                logger.debug("prepare_torchrun_restart: waiting for rank 0 store: %s", exc)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"prepare_torchrun_restart: global rank 0 did not publish its store within {timeout:.0f}s "
                    f"(agent store {addr}:{agent_port}); was it called on every rank?")
            time.sleep(0.2)
    del agent_store

    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    _DONE = True
    logger.info(
        "prepare_torchrun_restart: rank %d restart_count=%s: per-incarnation store at %s:%d hosted by rank 0 "
        "(agent store port %d; took %.2fs)", rank, os.environ["TORCHELASTIC_RESTART_COUNT"], addr, port,
        agent_port, time.monotonic() - t0)
    return True
