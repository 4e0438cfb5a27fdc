"""The restart path on one machine as simulated nodes: one torchrun agent per node, one c10d rendezvous.

``neighbor-ckpt launch CONFIG trainer.num_nodes=N trainer.devices=D`` without in-process recovery runs the job as
``N`` simulated nodes of ``D`` ranks each, as on a cluster where every node runs its own ``torchrun``: agent ``i``
(:func:`node_agents`) has its own environment, ``NEIGHBOR_CKPT_NODE_ID=node<i>`` (the data-parallel ring puts every
rank's replica on another node), ``NEIGHBOR_CKPT_STORE_DIR=<store root>/node<i>`` (the node's host store, shared by
its ranks) and ``NEIGHBOR_CKPT_INPROCESS_NODE_INDEX=i`` (what a fault with ``target: node`` compares with
``fault_injection.node``); all agents meet in one c10d rendezvous (``--rdzv-endpoint=127.0.0.1:PORT
--rdzv-id=RUN_ID``), hosted by node 0's agent (``is_host``), as the first node of a cluster hosts it.

With ``neighbor_ckpt.elastic.enabled`` the agents take ``--nnodes=1:N``: after a node is lost for good, the others'
next rendezvous round completes without it, once its agent's keep-alive has expired
(:func:`rdzv_conf`: within about ``detector.timeout_s``), and the restarted worker group, on fewer ranks, restores
by resharding the distributed optimizer's state from the host stores.

:func:`run_node_agents` starts the agents and supervises them. An agent killed by SIGKILL is a node lost: its
workers (each in a session of its own, and not told of their agent's death) are SIGKILLed with it, found by the
node's tag in their environment (:data:`NODE_TAG_ENV`). Without ``elastic`` the launch then says in one line which
node is gone and what to set, stops the other agents and exits 1 at once, instead of leaving them waiting for the
lost node in their next rendezvous (torchrun's join timeout, 600 s).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from neighbor_ckpt.inprocess.protocol import ENV_NODE_INDEX
from neighbor_ckpt.runtime.procs import kill_tagged, python_module_command, stop_processes

__all__ = ["NODE_TAG_ENV", "NodeAgents", "rdzv_conf", "node_agents", "run_node_agents", "kill_node",
           "nodes_status", "LAST_CALL_MIN_S"]

NODE_TAG_ENV = "NEIGHBOR_CKPT_SIMULATED_NODE"
"""Every process of a simulated node carries ``<run id>/node<i>/<launch>`` in its environment (its agent's, inherited
by the workers; ``<launch>`` is drawn by :func:`run_node_agents`, so two launches of one run id never share a tag):
what :func:`kill_node` finds them by."""

LAST_CALL_MIN_S = 10
"""The shortest wait of a rendezvous round for more nodes once it has its minimum (``last_call_timeout``): the
agents of one launch start together, but on a loaded machine one of them can take seconds longer to import torch,
and a first round formed without it would start the job on fewer ranks."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeAgents:
    """The torchrun agents of a restart-path launch on one machine (pure data): per simulated node ``node<i>``, its
    command line and environment additions."""

    agents: tuple[tuple[tuple[str, ...], tuple[tuple[str, str], ...]], ...]
    """Per node ``i``: (the torchrun command, the environment additions)."""

    elastic: bool
    """``neighbor_ckpt.elastic.enabled``: the others go on without a node lost for good."""

    detector_timeout_s: float
    """The job's ``detector.timeout_s`` (what the rendezvous keep-alive follows)."""


def rdzv_conf(detector_timeout_s: float, *, host: bool, elastic: bool) -> str:
    """The agents' ``--rdzv-conf`` (pure): ``is_host`` (node 0's agent hosts the rendezvous store; the others never
    do, so the store does not die with another node) and, with ``elastic``, the keep-alive that drops a lost node:
    a beat every ``max(1, timeout // 3)`` s (torchrun takes whole seconds), missed ``ceil(timeout / interval)`` times
    (at least 3), so a node whose agent died is out of the rendezvous about ``detector.timeout_s`` later (the
    default, 5 s x 3, waited 15 s), and ``last_call_timeout``: :data:`LAST_CALL_MIN_S` or ``2 x timeout``, the wait
    for more nodes once one is there."""
    parts = [f"is_host={'true' if host else 'false'}"]
    if elastic:
        interval = max(1, int(detector_timeout_s // 3))
        attempts = max(3, math.ceil(detector_timeout_s / interval))
        last_call = max(LAST_CALL_MIN_S, math.ceil(2 * detector_timeout_s))
        parts += [f"keep_alive_interval={interval}", f"keep_alive_max_attempt={attempts}",
                  f"last_call_timeout={last_call}"]
    return ",".join(parts)


def node_agents(worker: Sequence[str], *, options: Sequence[str] = (), nodes: int, devices: int, max_restarts: int,
                run_id: str, endpoint: str, store_root: Path, elastic: bool,
                detector_timeout_s: float) -> NodeAgents:
    """One torchrun agent per simulated node (pure): ``nodes`` agents of ``devices`` workers each running ``worker``
    (``options``: torchrun options before it, :func:`~neighbor_ckpt.cli.launch.worker_program`'s), one c10d
    rendezvous at ``endpoint`` with id ``run_id``; ``--nnodes=N`` (``1:N`` with ``elastic``); node ``i`` hosts the
    rendezvous store when ``i == 0`` and has its own host store ``<store_root>/node<i>``."""
    if nodes < 1 or devices < 1:
        raise ValueError(f"node_agents: {nodes} node(s) of {devices} rank(s)")
    nnodes = f"1:{nodes}" if elastic else str(nodes)
    agents = []
    for i in range(nodes):
        cmd = (*python_module_command("torch.distributed.run"), f"--nnodes={nnodes}", f"--nproc-per-node={devices}",
               f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
               f"--rdzv-id={run_id}", f"--rdzv-conf={rdzv_conf(detector_timeout_s, host=i == 0, elastic=elastic)}",
               "--monitor-interval=0.5", *options, *worker)
        env = (("NEIGHBOR_CKPT_NODE_ID", f"node{i}"), ("NEIGHBOR_CKPT_STORE_DIR", str(Path(store_root) / f"node{i}")),
               (ENV_NODE_INDEX, str(i)), (NODE_TAG_ENV, f"{run_id}/node{i}"), ("TORCH_CPP_LOG_LEVEL", "error"))
        agents.append((cmd, env))
    return NodeAgents(agents=tuple(agents), elastic=elastic, detector_timeout_s=detector_timeout_s)


def kill_node(tag: str) -> int:
    """SIGKILL every process (of this user) whose environment has ``NEIGHBOR_CKPT_SIMULATED_NODE=tag``: what is left
    of a simulated node whose agent died; returns how many."""
    return kill_tagged(tag, var=NODE_TAG_ENV)


def nodes_status(codes: Sequence[int | None], *, elastic: bool) -> int:
    """The exit status of a restart-path launch of simulated nodes from its agents' (pure; None: still running,
    stopped by the launch): 0 when every agent succeeded, or, with ``elastic``, when the only failures are agents
    killed by SIGKILL (nodes lost) and at least one succeeded (an agent exits 0 only when its workers completed the
    job); else the worst status (1 for agents the launch stopped)."""
    done = [1 if c is None else c for c in codes]
    ok = sum(c == 0 for c in done)
    lost = [c for c in done if c != 0]
    if not lost or (elastic and ok and all(c == -signal.SIGKILL for c in lost)):
        return 0
    return max(lost, key=abs)


def _say(line: str, out: Any = None) -> None:
    """One line on stderr, and in the agents' log ``out`` (a file) when their output goes there."""
    for stream in {id(sys.stderr): sys.stderr, id(out): out}.values():
        if stream is not None and hasattr(stream, "write"):
            print(f"neighbor-ckpt launch: {line}", file=stream, flush=True)


def run_node_agents(agents: NodeAgents, *, env: dict[str, str] | None = None, poll_s: float = 0.2,
                    **kw: Any) -> int:
    """Start the agents of ``agents`` (environment: ``env`` or this process's, plus each one's additions) and wait
    for them; returns :func:`nodes_status` of their exit statuses.

    An agent killed by SIGKILL is a node lost for good: what is left of it is SIGKILLed (:func:`kill_node`). With
    ``elastic``, one line says the others go on without it. Without, one line names the node and the setting, the
    other agents are stopped at once (each stops its workers) and the launch returns 1. Another agent that fails
    ends the job the same way (its status is returned). Every agent still running on the way out is stopped."""
    base = dict(os.environ if env is None else env)
    launch = uuid.uuid4().hex[:12]
    tags = [f"{dict(extra)[NODE_TAG_ENV]}/{launch}" for _, extra in agents.agents]
    out = kw.get("stdout")
    procs: list[subprocess.Popen] = []
    codes: list[int | None] = []
    try:
        for (cmd, extra), tag in zip(agents.agents, tags):
            procs.append(subprocess.Popen(list(cmd), env={**base, **dict(extra), NODE_TAG_ENV: tag}, **kw))
            codes.append(None)
        while any(c is None for c in codes):
            time.sleep(poll_s)
            for i, p in enumerate(procs):
                if codes[i] is not None or p.poll() is None:
                    continue
                codes[i] = p.returncode
                tag = tags[i]
                if p.returncode == -signal.SIGKILL:
                    killed = kill_node(tag)
                    if agents.elastic and i > 0:
                        _say(f"node node{i} is lost for good (its torchrun agent was killed by SIGKILL; {killed} "
                             f"process(es) of it stopped): the other node(s) go on without it on a smaller "
                             f"data-parallel size (neighbor_ckpt.elastic.enabled), once its rendezvous keep-alive "
                             f"expired (~{agents.detector_timeout_s:g} s)", out)
                        continue
                    if agents.elastic:
                        _say("node node0 is lost for good (its torchrun agent was killed by SIGKILL) and it hosted the "
                             "rendezvous: the other nodes cannot meet again without it; run with in-process recovery "
                             "(neighbor_ckpt.inprocess.enabled: true), whose stores fail over; stopping the other "
                             "nodes", out)
                    else:
                        _say(f"node node{i} is lost for good (its torchrun agent was killed by SIGKILL) and the job "
                             "cannot go on without it: set neighbor_ckpt.elastic.enabled: true (the other nodes go on "
                             "on a smaller data-parallel size, resharded from host memory), or run with in-process "
                             "recovery and a spare node (neighbor_ckpt.inprocess.enabled: true, "
                             "neighbor_ckpt.inprocess.spares); stopping the other nodes", out)
                    stop_processes(procs)
                    return 1
                if p.returncode != 0:
                    kill_node(tag)
                    _say(f"node node{i}: its torchrun agent exited {p.returncode}: stopping the other nodes", out)
                    stop_processes(procs)
                    codes = [p.returncode if c is None else c for c in codes]
                    return nodes_status(codes, elastic=agents.elastic)
        return nodes_status(codes, elastic=agents.elastic)
    finally:
        stop_processes(procs)
        for tag in tags[:len(procs)]:  # what outlived its agent (the workers start sessions of their own)
            kill_node(tag)
