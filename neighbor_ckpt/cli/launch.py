"""``neighbor-ckpt launch``: run a job file's recipe under torchrun with restarts, or write a Slurm script.

With ``neighbor_ckpt.inprocess.enabled`` the job runs ``devices x nodes + spares`` processes under our own per-node
launcher instead (``python -m neighbor_ckpt.inprocess.launcher``, :mod:`neighbor_ckpt.inprocess.launcher`): one
launcher per (simulated) node, which keeps its processes running when another one dies (plain torchrun stops its
whole local worker group), declares a dead process to the survivors through the store and kills the processes a
detector lists as dead; and each runs a TCP store host beside it (``python -m neighbor_ckpt.inprocess.store_host``):
the first node's is the store every process's engine, the per-generation process groups and the launchers use, the
others hot standbys the job fails over to when it is lost (:mod:`neighbor_ckpt.inprocess.stores`). Each simulated
node gets its own host store directory (``<store dir>/node<i>``) and node id, as on a cluster, so a spare that replaces a lost rank
starts with an empty store and pulls that rank's state from its ring successor. When in-process recovery gives up,
every process exits 75 and the launchers restart the job together (``launch.max_restarts``): the restart path.

The job file is a path, or the name of one shipped with the package (``gpt_tiny_cpu``; ``configs/gpt_tiny_cpu.yaml``
also outside a checkout: :func:`resolve_config`); the recipe is the one inside this installed package
(``neighbor_ckpt/recipes/nemo_pretrain.py``; ``bridge_pretrain.py`` for a job file with ``framework: bridge``, both
paths). The job file is validated (with the overrides applied) before
anything starts; the resolved file is written to the run directory
``<launch.log_dir>/<name>-<timestamp>/config.yaml`` and the recipe reads only that, so a restarted worker group sees
exactly what the first one saw. The torchrun rendezvous id is unique per launch and stable across its restarts: it is
the neighbor-checkpoint job id (unless the file sets ``neighbor_ckpt.job_id``), so a new launch never restores
snapshots left by an old one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import secrets
import shlex
import socket
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from neighbor_ckpt.config import expand_store_dir
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.inprocess.completion import marker_path
from neighbor_ckpt.inprocess.store_auth import TOKEN_FILE
from neighbor_ckpt.cli.torchrun_nodes import NodeAgents, node_agents, run_node_agents
from neighbor_ckpt.planning.jobspec import JobSpec, load_job
from neighbor_ckpt.runtime.network_plan import NetworkPlan
from neighbor_ckpt.runtime.netns import simulated_network
from neighbor_ckpt.runtime.procs import (RUN_TAG_ENV, python_code_command, python_module_command, stop_processes,
                                         with_run_tag)
from neighbor_ckpt.recipes import RECIPES_DIR, find_config, recipe_path, shipped_configs

__all__ = ["LaunchPlan", "plan_launch", "torchrun_command", "slurm_script", "run_local", "describe", "RECIPE",
           "InprocessProcesses", "inprocess_processes", "inprocess_commands", "simulated_nodes", "run_inprocess", "bind_stores",
           "LAUNCHER", "free_ports", "ephemeral_ports", "launch_status", "WORKER_PREFIX_ENV", "worker_program", "resolve_config",
           "torchrun_nodes"]

RECIPE = RECIPES_DIR / "nemo_pretrain.py"
"""The recipe ``launch`` runs: the one inside this installed package (``neighbor_ckpt/recipes``)."""
BRIDGE_RECIPE = RECIPES_DIR / "bridge_pretrain.py"
"""The recipe of a job file with ``framework: bridge`` (Megatron-Bridge)."""
LAUNCHER = "neighbor_ckpt.inprocess.launcher"
"""The per-node launcher of an in-process launch, as a module (``python -m``) of this interpreter's environment."""
WORKER_PREFIX_ENV = "NEIGHBOR_CKPT_WORKER_PREFIX"
"""A command every worker runs under (shell words), e.g. ``nsys profile -o /tmp/rank`` or ``numactl -N 0``: the
launcher then runs ``PREFIX PYTHON -u SCRIPT ARGS`` for each worker (``--no-python``). The test suite starts its
workers warm through it (tests/warm)."""


def worker_program(program: Sequence[str], *, env: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
    """The launcher options and worker command line for ``program`` (a script and its arguments) under torchrun or
    the in-process launcher: unchanged without ``NEIGHBOR_CKPT_WORKER_PREFIX`` (in ``env``, default this
    process's), else ``--no-python`` and the prefixed interpreter command.

    Raises:
        ConfigError: the variable is not a command line (unbalanced quotes)."""
    raw = (os.environ if env is None else env).get(WORKER_PREFIX_ENV, "")
    try:
        prefix = shlex.split(raw)
    except ValueError as e:
        raise ConfigError(f"{WORKER_PREFIX_ENV}={raw!r} is not a command line ({e}): quote it as a shell would, "
                          f"e.g. {WORKER_PREFIX_ENV}='numactl -N 0', or unset it") from None
    if not prefix:
        return [], list(program)
    return ["--no-python"], [*prefix, sys.executable, "-u", *program]


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchPlan:
    """What ``launch`` will do (pure data; nothing has run yet)."""

    job: JobSpec
    """The validated job, overrides applied."""

    run_dir: Path
    """Run directory: resolved config, torchrun log, NeMo logs, reports."""

    run_id: str
    """torchrun rendezvous id = the neighbor-checkpoint job id of this launch."""

    recipe: Path
    """The recipe script."""

    record: bool = False
    """Pass ``--record`` to the recipe (per-step losses and final fingerprints)."""

    @property
    def inprocess(self) -> bool:
        """In-process recovery (``neighbor_ckpt.inprocess.enabled``): our per-node launchers instead of torchrun."""
        return self.job.neighbor_ckpt.inprocess.enabled

    @property
    def spares(self) -> int:
        """Hot spare processes on top of the job's ranks (0 unless in process)."""
        return self.job.neighbor_ckpt.inprocess.spares if self.inprocess else 0

    @property
    def processes(self) -> int:
        """Processes the launch starts: ``devices x nodes + spares``."""
        return self.job.world_size + self.spares

    @property
    def per_node(self) -> int:
        """Processes per simulated node of an in-process launch on one machine: ``trainer.devices`` when the job
        has several nodes (``trainer.num_nodes > 1``), else 1 (the single-node form: every process a node of its
        own, so a spare that replaces a lost rank starts with an empty host store)."""
        t = self.job.trainer
        return t.devices if t.num_nodes > 1 else 1

    @property
    def simulated_nodes(self) -> tuple[tuple[int, int], ...]:
        """``(first process, count)`` per simulated node of an in-process launch on one machine
        (:func:`simulated_nodes`)."""
        return simulated_nodes(self.job.world_size, self.spares, self.per_node)


def resolve_config(config: str | Path) -> Path:
    """The job file ``config`` names: the path when it exists, else a shipped job file named by its bare name
    (``gpt_tiny_cpu``, ``gpt_tiny_cpu.yaml``) or by its path in a checkout (``configs/gpt_tiny_cpu.yaml``), see
    :func:`neighbor_ckpt.recipes.find_config`.

    Raises:
        ConfigError: neither exists (the message lists the shipped job files)."""
    path = find_config(config)
    if not path.exists():
        raise ConfigError(f"{config}: no such config file (shipped job files, usable by name: "
                          f"{', '.join(shipped_configs())})")
    return path


def plan_launch(config: str | Path, overrides: Sequence[str] = (), *, run_dir: Path | None = None,
                record: bool = False) -> LaunchPlan:
    """Validate ``config`` (a path, or a shipped job file's name: :func:`resolve_config`) + ``overrides`` and decide
    the run directory and ids (no side effects)."""
    job = load_job(resolve_config(config), overrides)
    if job.neighbor_ckpt.inprocess.enabled and not job.neighbor_ckpt.enabled:
        raise ConfigError("config.neighbor_ckpt.inprocess.enabled: in-process recovery restores from the neighbor "
                          "snapshots, but neighbor_ckpt.enabled is false; enable both, or neither")
    recipe = recipe_path((BRIDGE_RECIPE if job.framework == "bridge" else RECIPE).name)  # raises when it is missing
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_id = job.neighbor_ckpt.job_id or f"{job.name}-{stamp}-{secrets.token_hex(2)}"  # unique per launch
    if job.neighbor_ckpt.job_id is None:
        job = dataclasses.replace(job, neighbor_ckpt=dataclasses.replace(job.neighbor_ckpt, job_id=run_id))
    rd = run_dir or Path(job.launch.log_dir) / f"{job.name}-{stamp}"
    return LaunchPlan(job=job, run_dir=Path(rd), run_id=run_id, recipe=recipe, record=record)


PORTS_FROM = 10240
"""The lowest port :func:`free_ports` picks (below it: the well-known and registered services of a machine)."""


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel hands out for outgoing connections and ``bind(0)``
    (``/proc/sys/net/ipv4/ip_local_port_range``; Linux's default when it cannot be read)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> int | None:
    """``port`` (the kernel's choice for 0) when ``host:port`` can be bound now, else None."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return None
        return int(s.getsockname()[1])


def _free_port() -> int:
    return free_ports(1)[0]


def _recipe_args(plan: LaunchPlan) -> list[str]:
    args = [str(plan.recipe), "--config", str(plan.run_dir / "config.yaml"), "--run-dir", str(plan.run_dir)]
    return args + (["--record"] if plan.record else [])


def describe(plan: LaunchPlan) -> str:
    """One line: what the launch starts."""
    job = plan.job
    if not plan.inprocess:
        nodes = job.trainer.num_nodes
        where = (f" as {nodes} simulated nodes of {job.trainer.devices} (one torchrun agent each, one rendezvous"
                 f"{'; elastic: the others go on without a lost node' if job.neighbor_ckpt.elastic.enabled else ''})"
                 if nodes > 1 else "")
        return f"{job.name}: {job.world_size} ranks under torchrun{where} (restarts: {job.launch.max_restarts})"
    return (f"{job.name}: {job.world_size} ranks + {plan.spares} hot spare(s) = {plan.processes} processes, "
            f"in-process recovery (one launcher per simulated node, a store host process; restarts when it gives "
            f"up: {job.launch.max_restarts})")


@dataclass(frozen=True, kw_only=True, slots=True)
class InprocessProcesses:
    """The processes of an in-process launch on this machine (pure data): one launcher
    (``python -m neighbor_ckpt.inprocess.launcher``) per simulated node, each with its own environment additions;
    each launcher also hosts one of the launch's stores (``stores``: node ``i`` the ``i``-th; store 0 is the
    primary, the others hot standbys, :mod:`neighbor_ckpt.inprocess.stores`)."""

    stores: str
    """The store list every launcher and process gets (``host:port,host:port,...``)."""

    agents: tuple[tuple[tuple[str, ...], tuple[tuple[str, str], ...]], ...]
    """Per simulated node ``i``, its launcher: (command line, environment additions)."""

    token_file: Path
    """The launch's store token file (:mod:`~neighbor_ckpt.inprocess.store_auth`), made by :func:`run_inprocess`
    before the launchers start."""

    network: NetworkPlan | None = None
    """``launch.simulate_network``: the simulated network the launchers run in (made around :func:`run_inprocess`,
    :func:`neighbor_ckpt.runtime.netns.simulated_network`), each in its node's namespace; None: this machine's."""


def _store_ports(store_port: int | Sequence[int], n: int) -> list[int]:
    ports = list(range(store_port, store_port + n)) if isinstance(store_port, int) else list(store_port)
    if len(ports) < n or len(set(ports[:n])) < n:
        raise ConfigError(f"in-process launch: {n} distinct store ports needed, got {ports}")
    return ports[:n]


def free_ports(n: int, *, host: str = "127.0.0.1", avoid: Sequence[int] = ()) -> list[int]:
    """``n`` distinct ports free now on this machine (a store per simulated node, a rendezvous), none of ``avoid``.

    They are drawn at random *below* the kernel's ephemeral range (:func:`ephemeral_ports`), so that no outgoing
    connection of another process can be given one of them before it is bound (a port picked with ``bind(0)`` lies in
    that range: it did happen, and a store host could not start). Each is checked by binding it. Another process can
    still pick the same port on purpose: :func:`run_inprocess` binds the stores' ports itself before anything starts
    and takes another port for one that is taken by then. Without room below the range: ports the kernel picks."""
    low, _ = ephemeral_ports()
    rng = random.SystemRandom()
    ports: list[int] = []
    while len(ports) < n:
        want = rng.randrange(PORTS_FROM, low) if low - PORTS_FROM >= 16 * n else 0
        p = _bindable(host, want)
        if p is not None and p not in ports and p not in avoid:
            ports.append(p)
    return ports


def inprocess_processes(plan: LaunchPlan, *, store_port: int | Sequence[int], store_root: Path,
                        host: str = "127.0.0.1",
                        network: tuple[NetworkPlan, Path] | None = None) -> InprocessProcesses:
    """One launcher per simulated node for a single-machine in-process launch (:attr:`LaunchPlan.simulated_nodes`:
    one process per node for a one-node job, ``trainer.devices`` per node for ``trainer.num_nodes > 1``, spares on
    spare nodes of their own): node ``i`` has its own host store ``<store_root>/node<i>`` and its own store host
    on ``store_port[i]`` (an int: ``store_port + i``), as on a cluster where a lost node takes its processes, its
    host store and its store host with it. The launchers keep their processes running when another dies and restart the job
    together when in-process recovery gives up (``launch.max_restarts``), see
    :mod:`neighbor_ckpt.inprocess.launcher`.
    """
    if not plan.inprocess:
        raise ConfigError("inprocess_processes: the job does not enable neighbor_ckpt.inprocess")
    return inprocess_commands(_recipe_args(plan), active=plan.job.world_size, spares=plan.spares,
                              max_restarts=plan.job.launch.max_restarts, run_id=plan.run_id, store_port=store_port,
                              store_root=store_root, host=host, grow_back=plan.job.neighbor_ckpt.inprocess.grow_back,
                              token_file=plan.run_dir / TOKEN_FILE,
                              detector_timeout_s=plan.job.neighbor_ckpt.detector.timeout_s, devices=plan.per_node,
                              elastic=plan.job.neighbor_ckpt.elastic.enabled, network=network,
                              open_store=plan.job.launch.open_store)


def simulated_nodes(active: int, spares: int, devices: int = 1) -> tuple[tuple[int, int], ...]:
    """The simulated nodes of a single-machine in-process launch (pure): ``(first process, process count)`` per
    node. ``devices`` processes per node, as ``trainer.devices`` ranks per node of a cluster: the ``active`` ranks
    fill ``ceil(active / devices)`` nodes, the spares ``ceil(spares / devices)`` whole spare nodes of their own
    (the last one holding fewer when ``spares`` is not a multiple), as the Slurm script plans them; one process per
    node when ``devices`` is 1 (the single-node form)."""
    if devices < 1:
        raise ConfigError(f"in-process launch: {devices} processes per node; at least 1")
    nodes = [(first, min(devices, active - first)) for first in range(0, active, devices)]
    nodes += [(active + first, min(devices, spares - first)) for first in range(0, spares, devices)]
    return tuple(nodes)


def inprocess_commands(program: Sequence[str], *, active: int, spares: int, max_restarts: int, run_id: str,
                       store_port: int | Sequence[int], store_root: Path, host: str = "127.0.0.1",
                       grow_back: bool = False, token_file: Path | None = None,
                       detector_timeout_s: float | None = None, devices: int = 1,
                       elastic: bool = False, network: tuple[NetworkPlan, Path] | None = None,
                       open_store: bool = False) -> InprocessProcesses:
    """The commands of :func:`inprocess_processes` for any ``program`` (the script and its arguments):
    ``neighbor-ckpt launch`` runs the NeMo recipe with them, the fault campaign the plain megatron-core loop.
    ``token_file``: the launch's store token (default: ``store.token`` in ``store_root``); the completion marker
    lies beside it (:func:`~neighbor_ckpt.inprocess.completion.marker_path`). ``detector_timeout_s``: the job's
    ``detector.timeout_s``, which the launchers' timeouts follow (None: the launcher's default, the detector's).
    ``devices``: processes per simulated node (:func:`simulated_nodes`); node ``i`` hosts store ``i``, its
    processes share its host store directory ``<store_root>/node<i>``. ``elastic``: the job's
    ``neighbor_ckpt.elastic.enabled`` (a launchers' restart may go on without a node lost for good). ``network``: a
    simulated network and its plan file (:func:`neighbor_ckpt.runtime.netns.simulated_network`): node ``i``'s
    launcher runs in its namespace, its store listens on its store address (``host`` is not used), gloo on its rank
    interface. ``open_store``: the job's ``launch.open_store`` (:func:`launcher_command`)."""
    processes = active + spares
    nodes = simulated_nodes(active, spares, devices)
    net, net_file = network if network is not None else (None, None)
    if net is not None and net.nodes != len(nodes):
        raise ConfigError(f"in-process launch: a simulated network of {net.nodes} nodes for {len(nodes)} nodes")
    hosts = [host if net is None else net.address(i) for i in range(len(nodes))]
    stores = ",".join(f"{h}:{p}" for h, p in zip(hosts, _store_ports(store_port, len(nodes))))
    token = Path(token_file) if token_file is not None else Path(store_root) / TOKEN_FILE
    options, worker = worker_program(program)
    agents = tuple(((*(net.enter(i) if net is not None else ()), *launcher_command(
                        worker, options=options, store=stores, run_id=run_id,
                                           node=f"node{i}", first=str(first), count=str(count), processes=processes,
                                           spares=spares, max_restarts=max_restarts, nodes=len(nodes),
                                           store_root=str(store_root), grow_back=grow_back, host_store=str(i),
                                           store_listen=hosts[i], token_file=str(token),
                                           complete_file=str(marker_path(token.parent, run_id)),
                                           detector_timeout_s=detector_timeout_s, elastic=elastic,
                                           open_store=open_store)),
                    (("NEIGHBOR_CKPT_NODE_ID", f"node{i}"),
                     ("NEIGHBOR_CKPT_STORE_DIR", str(Path(store_root) / f"node{i}")),
                     ("TORCH_CPP_LOG_LEVEL", "error"),
                     *(sorted(net.env(str(net_file)).items()) if net is not None else ())))
                   for i, (first, count) in enumerate(nodes))
    return InprocessProcesses(stores=stores, agents=agents, token_file=token, network=net)


def launcher_command(worker: Sequence[str], *, options: Sequence[str] = (), store: str, run_id: str, node: str,
                     first: str, count: str, processes: int, spares: int, max_restarts: int, nodes: int,
                     store_root: str | None, grow_back: bool = False, host_store: str | None = None,
                     store_listen: str | None = None, token_file: str | None = None, complete_file: str | None = None,
                     detector_timeout_s: float | None = None, elastic: bool = False,
                     open_store: bool = False) -> list[str]:
    """One node's launcher command line (``first``/``count``/``node``/``store_root``/``host_store`` are text: the
    Slurm script passes shell expressions); ``options``, ``worker``: :func:`worker_program`'s. ``open_store``: the
    job's ``launch.open_store`` (a store host that cannot seal its store serves it open instead of refusing)."""
    cmd = [*python_module_command(LAUNCHER), "--store", store, "--run-id", run_id, "--node", node, "--first", first,
           "--count", count, "--processes", str(processes), "--spares", str(spares),
           "--max-restarts", str(max_restarts), "--nodes", str(nodes)]
    if detector_timeout_s is not None:
        cmd += ["--detector-timeout", f"{detector_timeout_s:g}"]
    if token_file is not None:
        cmd += ["--token-file", token_file]
    if complete_file is not None:
        cmd += ["--complete-file", complete_file]
    if host_store is not None:
        cmd += ["--host-store", host_store]
    if store_listen is not None:
        cmd += ["--store-listen", store_listen]
    if store_root is not None:
        cmd += ["--store-root", store_root]
    if elastic:
        cmd.append("--elastic")
    if grow_back:
        cmd.append("--grow-back")
    if open_store:
        cmd.append("--open-store")
    return [*cmd, *options, "--", *worker]


def torchrun_command(plan: LaunchPlan, *, endpoint: str | None = None) -> list[str]:
    """The single-node torchrun command line (c10d rendezvous on localhost unless ``endpoint`` is given)."""
    t = plan.job.trainer
    options, worker = worker_program(_recipe_args(plan))
    return [*python_module_command("torch.distributed.run"), f"--nnodes={t.num_nodes}",
            f"--nproc-per-node={t.devices}", f"--max-restarts={plan.job.launch.max_restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint or f'127.0.0.1:{_free_port()}'}",
            f"--rdzv-id={plan.run_id}", "--monitor-interval=0.5", *options, *worker]


def torchrun_nodes(plan: LaunchPlan, *, endpoint: str, store_root: Path) -> NodeAgents:
    """The restart path of a job of ``trainer.num_nodes > 1`` on this machine (pure): one torchrun agent per simulated
    node, one c10d rendezvous at ``endpoint`` (:mod:`neighbor_ckpt.cli.torchrun_nodes`); node ``i``'s host store is
    ``<store_root>/node<i>``."""
    job = plan.job
    options, worker = worker_program(_recipe_args(plan))
    return node_agents(worker, options=options, nodes=job.trainer.num_nodes, devices=job.trainer.devices,
                       max_restarts=job.launch.max_restarts, run_id=plan.run_id, endpoint=endpoint,
                       store_root=store_root, elastic=job.neighbor_ckpt.elastic.enabled,
                       detector_timeout_s=job.neighbor_ckpt.detector.timeout_s)


def slurm_script(plan: LaunchPlan) -> str:
    """A Slurm batch script: one torchrun per node (``srun --ntasks-per-node=1``), c10d rendezvous on the first
    node, restarts handled by torchrun inside the allocation (a killed rank restarts its node's worker group, the
    Slurm job goes on), the resolved config in the run directory. GPUs are requested only for
    ``trainer.accelerator: gpu``; the workers run on the Python that wrote the script (the job's environment on a
    shared file system), as :func:`torchrun_command` does. With ``neighbor_ckpt.inprocess.enabled``: one process
    per rank and per hot spare instead (:func:`_slurm_script_inprocess`). The full test tier submits both to a
    single-node Slurm (tests/e2e/test_slurm.py)."""
    _check_script_values(plan)
    if plan.inprocess:
        return _slurm_script_inprocess(plan)
    job, lc = plan.job, plan.job.launch
    if job.neighbor_ckpt.elastic.enabled:
        raise ConfigError("neighbor_ckpt.elastic.enabled: the Slurm script of the restart path runs torchrun on a "
                          f"fixed number of nodes (--nnodes={job.trainer.num_nodes}), so a node lost for good stops "
                          "the job; set neighbor_ckpt.inprocess.enabled: true (its launchers go on without a lost "
                          "node), or turn elastic off")
    t = job.trainer
    opts = [f"--job-name={job.name}", f"--nodes={t.num_nodes}", "--ntasks-per-node=1"]
    if t.accelerator == "gpu":
        opts.append(f"--gpus-per-node={t.devices}")
    recipe = " ".join(shlex.quote(a) for a in _recipe_args(plan))
    new_tag = shlex.join(python_code_command("import uuid; print(uuid.uuid4().hex)"))
    lines = [*_sbatch_header(plan, opts),
             'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             "export NEIGHBOR_CKPT_NODE_ID=$(hostname)   # ring successors are chosen on other nodes",
             "# the run tag every worker carries: a pid read from torchrun's store is killed only if it carries it",
             f'export {RUN_TAG_ENV}="${{{RUN_TAG_ENV}:-$({new_tag})}}"',
             f"srun --kill-on-bad-exit=0 {shlex.join(python_module_command('torch.distributed.run'))} \\",
             f"    --nnodes={t.num_nodes} --nproc-per-node={t.devices} --max-restarts={lc.max_restarts} \\",
             f"    --rdzv-backend=c10d --rdzv-endpoint=\"$HEAD_NODE:{lc.rdzv_port}\" "
             f"{shlex.quote(f'--rdzv-id={plan.run_id}')} \\",
             f"    {recipe}", ""]
    return "\n".join(lines)


def _check_script_values(plan: LaunchPlan) -> None:
    """Refuse a value of the job file or the command line that no quoting keeps on its line of a script: a line
    break (it would end an ``#SBATCH`` line or the task's here-document and start a line of its own) or a NUL.
    Every other value is quoted where it lands (``shlex.quote``), whatever shell characters it holds.

    Raises:
        ConfigError: naming the setting."""
    job, lc = plan.job, plan.job.launch
    if lc.simulate_network:
        raise ConfigError("launch.simulate_network: simulated nodes on one machine only (`neighbor-ckpt launch` "
                          "without --slurm): a Slurm job runs on real nodes; set it false")
    values = {"name": job.name, "neighbor_ckpt.job_id (the run id)": plan.run_id, "the run directory": str(plan.run_dir),
              "launch.slurm_time": lc.slurm_time, "launch.slurm_partition": lc.slurm_partition or "",
              "launch.slurm_account": lc.slurm_account or "", "neighbor_ckpt.store.dir": job.neighbor_ckpt.store.dir}
    for what, value in values.items():
        bad = sorted({repr(c) for c in str(value) if c in "\n\r\0"})
        if bad:
            raise ConfigError(f"{what}: {value!r} holds {', '.join(bad)}, which no quoting keeps on one line of a "
                              f"Slurm script; choose a value without line breaks")


def _sbatch_header(plan: LaunchPlan, opts: list[str]) -> list[str]:
    """``#SBATCH`` lines (``opts``, then exclusive node use, time, output, partition, account) and the preamble.
    Each option is one shell word (``shlex.quote``: sbatch reads quoted ``#SBATCH`` values as the shell would)."""
    lc = plan.job.launch
    opts = [*opts, "--exclusive", f"--time={lc.slurm_time}", f"--output={plan.run_dir}/slurm-%j.out"]
    if lc.slurm_partition:
        opts.append(f"--partition={lc.slurm_partition}")
    if lc.slurm_account:
        opts.append(f"--account={lc.slurm_account}")
    return ["#!/bin/bash", *(f"#SBATCH {shlex.quote(o)}" for o in opts), "", "set -euo pipefail",
            "# Generated by `neighbor-ckpt launch --slurm`; the job file was validated when this was written."]


def _shell_store_dir(value: str) -> str:
    """A ``store.dir`` value as a shell word: quoted, its ``{user}`` the running user's name (``$(id -un)``)."""
    return '"$(id -un)"'.join(shlex.quote(part) if part else "" for part in value.split("{user}")) or "''"


def _slurm_script_inprocess(plan: LaunchPlan) -> str:
    """In-process recovery under Slurm: one ``srun --kill-on-bad-exit=0`` task per node, each running our
    launcher (:mod:`neighbor_ckpt.inprocess.launcher`) with that node's processes: ``--first
    $((SLURM_NODEID * devices)) --count devices`` (fewer on the last node). A task whose process dies does not end
    the step; the launchers keep their other processes running, declare the dead one to the survivors, and restart
    the job together when in-process recovery gives up. GPU jobs get ``ceil(spares / devices)`` more nodes for the
    spares and all of a node's GPUs per task (``LOCAL_RANK`` picks one); the node id is the host name and the
    node's processes share its host store directory. A CPU job (the tiny presets) runs on one Slurm node as
    simulated nodes, as ``neighbor-ckpt launch`` does on one machine (:attr:`LaunchPlan.simulated_nodes`): one task
    per simulated node (``--overcommit``; one process each for a one-node job, ``trainer.devices`` each for
    ``trainer.num_nodes > 1``, the spares on spare nodes of their own), node id ``node<task>``, host store
    ``<store dir>/node<task>``, so a spare starts with an empty store. Every launcher
    hosts one of the launch's stores (:mod:`neighbor_ckpt.inprocess.stores`): the first node's is the primary, the
    others hot standbys, each on ``launch.rdzv_port + 1`` of its node (simulated nodes: ``+ 1 + task``)."""
    job, lc = plan.job, plan.job.launch
    t = job.trainer
    n = plan.processes
    simulated = t.accelerator != "gpu"
    if simulated:
        nodes, per = len(plan.simulated_nodes), plan.per_node
        opts = [f"--job-name={job.name}", "--nodes=1", f"--ntasks={nodes}", "--overcommit"]
        where = ['NODE="node$SLURM_PROCID" FIRST=$SLURM_PROCID COUNT=1'] if per == 1 else \
            [f'NODE="node$SLURM_PROCID" FIRST=$((SLURM_PROCID * {per}))',
             f"COUNT=$(( {n} - FIRST < {per} ? {n} - FIRST : {per} ))"]
        store_root: str | None = "@STORE_ROOT@"
    else:
        nodes = t.num_nodes + -(-plan.spares // t.devices)
        opts = [f"--job-name={job.name}", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1"]
        if t.accelerator == "gpu":
            opts.append(f"--gpus-per-node={t.devices}")
        where = [f'NODE="$(hostname)" FIRST=$((SLURM_NODEID * {t.devices}))',
                 f"COUNT=$(( {n} - FIRST < {t.devices} ? {n} - FIRST : {t.devices} ))",
                 'export NEIGHBOR_CKPT_STORE_DIR="$STORE_ROOT"   # the node\'s processes share its host store']
        store_root = None
    store_port = lc.rdzv_port + 1
    options, worker = worker_program(_recipe_args(plan))
    cmd = launcher_command(worker, options=options, store="@STORES@", run_id=plan.run_id,
                           node="@NODE@", first="@FIRST@", count="@COUNT@", processes=n, spares=plan.spares,
                           max_restarts=lc.max_restarts, nodes=nodes, store_root=store_root,
                           grow_back=plan.job.neighbor_ckpt.inprocess.grow_back, host_store="@HOSTIDX@",
                           token_file=str(plan.run_dir / TOKEN_FILE),
                           complete_file=str(marker_path(plan.run_dir, plan.run_id)),
                           detector_timeout_s=job.neighbor_ckpt.detector.timeout_s,
                           elastic=job.neighbor_ckpt.elastic.enabled, open_store=lc.open_store)
    launcher = shlex.join(cmd)
    for token, var in (("@NODE@", '"$NODE"'), ("@FIRST@", '"$FIRST"'), ("@COUNT@", '"$COUNT"'),
                       ("@STORE_ROOT@", '"$STORE_ROOT"'), ("@STORES@", '"$STORES"'), ("@HOSTIDX@", '"$HOSTIDX"')):
        launcher = launcher.replace(token, var)
    if simulated:  # every task on the first node: one port each
        stores = [f'export STORES=$(for i in $(seq 0 {nodes - 1}); do printf "%s${{HEAD_NODE}}:$(({store_port} + i))" '
                  '"$([ $i -gt 0 ] && echo ,)"; done)']
        where = [*where, "HOSTIDX=$SLURM_PROCID"]
    else:  # every node hosts one on the same port
        awk = ("'BEGIN { ORS = \"\" } { printf \"%s%s:%d\", (NR > 1 ? \",\" : \"\"), $1, p }'")
        stores = [f'export STORES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk -v p={store_port} {awk})']
        where = [*where, "HOSTIDX=$SLURM_NODEID"]
    task = shlex.quote(str(plan.run_dir / "inprocess_task.sh"))
    default_root = _shell_store_dir(job.neighbor_ckpt.store.dir)
    make_token = python_module_command("neighbor_ckpt.inprocess.store_auth", str(plan.run_dir / TOKEN_FILE))
    lines = [*_sbatch_header(plan, opts),
             f"# In-process recovery: {job.world_size} ranks + {plan.spares} hot spare(s) = {n} processes, "
             f"{nodes} launcher(s) (python -m {LAUNCHER}), each hosting one of the {nodes} store(s) (the first "
             "node's is the primary, the others hot standbys).",
             'export HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             f"STORE_ROOT={default_root}",
             'export STORE_ROOT="${NEIGHBOR_CKPT_STORE_DIR:-$STORE_ROOT}"',
             *stores,
             "# the stores admit only the holders of this token (a 0600 file of the run directory, made once)",
             f"{shlex.join(make_token)} || exit 1",
             "# a completion marker left by an earlier submission of this script would end this one before it trains",
             f"rm -f {shlex.quote(str(marker_path(plan.run_dir, plan.run_id)))}",
             f"cat > {task} <<'TASK'",
             "#!/bin/bash",
             "# one task = one node's launcher" + (" (a simulated node)" if simulated else ""),
             *where,
             "export TORCH_CPP_LOG_LEVEL=error",
             f"exec {launcher}",
             "TASK",
             f"chmod +x {task}",
             "rc=0",
             f"srun --kill-on-bad-exit=0 {task} || rc=$?",
             "# every launcher writes the completion marker once the job completed: a node lost on the way (its task",
             "# killed with it) does not fail a job the others finished",
             f"if [ $rc -ne 0 ] && [ -e {shlex.quote(str(marker_path(plan.run_dir, plan.run_id)))} ]; then",
             '    echo "the job completed; a task of a lost node failed (srun exit $rc): exit 0"',
             "    rc=0",
             "fi",
             "exit $rc",
             ""]
    return "\n".join(lines)


def write_run_dir(plan: LaunchPlan) -> Path:
    """Create the run directory and write the resolved config into it."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    path = plan.run_dir / "config.yaml"
    path.write_text(plan.job.to_yaml())
    return path


def run_local(plan: LaunchPlan, *, log: Path | None = None) -> int:
    """Run the job on this node under torchrun (``trainer.num_nodes > 1``: one torchrun agent per simulated node,
    :mod:`neighbor_ckpt.cli.torchrun_nodes`; in process: one of our launchers per simulated node, each hosting a
    store); returns the launcher's exit code (several: :func:`~neighbor_ckpt.cli.torchrun_nodes.nodes_status` of the
    agents', in process :func:`launch_status` of the launchers'). Output goes to
    ``log`` if given (the run directory's ``torchrun.log`` is the usual choice), else to this terminal. Every process
    of the job carries a run tag (:data:`~neighbor_ckpt.runtime.procs.RUN_TAG_ENV`): this environment's, else one
    drawn for this launch (:func:`~neighbor_ckpt.runtime.procs.with_run_tag`), which torchrun and the in-process
    launchers hand to their workers; a pid read from a store is killed only if it carries it."""
    t = plan.job.trainer
    if t.num_nodes != 1 and not plan.inprocess and t.accelerator == "gpu":
        raise ConfigError(f"config.trainer.num_nodes: {t.num_nodes} GPU nodes cannot run from one shell (simulated "
                          "nodes on one machine are for trainer.accelerator: cpu); use `neighbor-ckpt launch CONFIG "
                          "--slurm FILE` (or run torchrun on every node)")
    write_run_dir(plan)
    with contextlib.ExitStack() as stack:
        out = None if log is None else stack.enter_context(open(log, "w"))
        kw: dict[str, Any] = {"env": with_run_tag(os.environ)}
        if out is not None:
            kw.update(stdout=out, stderr=subprocess.STDOUT)
        if not plan.inprocess and t.num_nodes > 1:
            return run_node_agents(torchrun_nodes(plan, endpoint=f"127.0.0.1:{_free_port()}",
                                                  store_root=_store_root(plan)), **kw)
        if not plan.inprocess:
            return subprocess.call(torchrun_command(plan), **kw)
        return _run_inprocess(plan, kw)


def _store_root(plan: LaunchPlan) -> Path:
    """The host stores' root of a launch on this machine (``NEIGHBOR_CKPT_STORE_DIR`` wins over the job file's
    ``store.dir``); simulated node ``i``'s is ``<root>/node<i>``."""
    return expand_store_dir(os.environ.get("NEIGHBOR_CKPT_STORE_DIR") or plan.job.neighbor_ckpt.store.dir)


def _run_inprocess(plan: LaunchPlan, kw: dict) -> int:
    """Start one launcher per simulated node (each hosting one of the stores), wait for all of them; with
    ``launch.simulate_network`` each in its node's network namespace, made here and removed at the end."""
    ports = free_ports(len(plan.simulated_nodes))
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(simulated_network(len(plan.simulated_nodes))) \
            if plan.job.launch.simulate_network else None
        return run_inprocess(inprocess_processes(plan, store_port=ports, store_root=_store_root(plan), network=net),
                             **kw)


def launch_status(codes: Sequence[int]) -> int:
    """The exit status of an in-process launch from its launchers' (pure): 0 when every launcher succeeded (the job
    completed), or when the only failures are launchers killed by SIGKILL (a node lost on purpose:
    ``fault_injection.permanent`` or ``target: node`` kills the node's launcher, its processes die with it), or
    launchers that reached no store (:data:`~neighbor_ckpt.inprocess.protocol.EXIT_NO_STORE`: the others declared
    their processes dead), and at
    least one succeeded (a launcher exits 0 only once the job completed: the survivors finished it, on spares or on a
    smaller data-parallel size), or cut off from the majority (a partition's minority stopped itself,
    :data:`~neighbor_ckpt.inprocess.protocol.EXIT_CUT_OFF`); else the worst status (a signal's negative status is
    not lost behind a 0). A launcher's own statuses: :mod:`neighbor_ckpt.inprocess.launcher` (75: in-process
    recovery gave up and the restarts are used up)."""
    from neighbor_ckpt.inprocess.protocol import EXIT_CUT_OFF, EXIT_NO_STORE

    ok = sum(c == 0 for c in codes)
    lost = [c for c in codes if c != 0]
    if all(c in (-signal.SIGKILL, EXIT_NO_STORE, EXIT_CUT_OFF) for c in lost) and ok:
        return 0
    return max(codes, key=abs)


def _option(cmd: Sequence[str], name: str) -> str | None:
    """The value of launcher option ``name`` in ``cmd`` (before the program's ``--``), or None."""
    cmd = list(cmd)
    end = cmd.index("--") if "--" in cmd else len(cmd)
    return cmd[cmd.index(name) + 1] if name in cmd[:end] else None


def bind_stores(procs: InprocessProcesses) -> tuple[InprocessProcesses, dict[int, socket.socket]]:
    """Bind the port of every store the launchers of ``procs`` host, now, in this process: the commands to run
    instead (each launcher gets its store's socket, ``--listen-fd``, which it hands to its store host) and the
    sockets by launcher. A port taken since it was chosen is replaced by another free one, in every launcher's store
    list, with one line on stderr: a port another process took never stops a launch, and from here on no other
    process can take one (it is bound until the store host ends)."""
    from neighbor_ckpt.inprocess.store_host import listen_socket
    from neighbor_ckpt.inprocess.stores import StoreAddresses

    first = procs.agents[0][0] if procs.agents else ()
    stores = list(StoreAddresses.parse(_option(first, "--store") or procs.stores, "--store").addresses)
    held: dict[int, socket.socket] = {}
    try:
        for i, (cmd, _) in enumerate(procs.agents):
            index = _option(cmd, "--host-store")
            if index is None:
                continue
            h = int(index)
            host, port = stores[h]
            listen = _option(cmd, "--store-listen") or host
            while True:
                try:
                    held[i] = listen_socket(listen, port)
                    break
                except OSError as e:
                    new = free_ports(1, host=listen, avoid=[p for _, p in stores])[0]
                    print(f"neighbor-ckpt launch: store {h} (node {_option(cmd, '--node')}): port {port} was taken "
                          f"since it was chosen ({e.strerror or e}): port {new} instead", file=sys.stderr, flush=True)
                    stores[h] = (host, new)
                    port = new
    except BaseException:
        for sock in held.values():
            sock.close()
        raise
    text = StoreAddresses(tuple(stores)).format()
    agents = []
    for i, (cmd, extra) in enumerate(procs.agents):
        cmd = list(cmd)
        end = cmd.index("--") if "--" in cmd else len(cmd)
        if "--store" in cmd[:end]:
            cmd[cmd.index("--store") + 1] = text
        if i in held:
            cmd[end:end] = ["--listen-fd", str(held[i].fileno())]
        agents.append((tuple(cmd), extra))
    return dataclasses.replace(procs, stores=text, agents=tuple(agents)), held


HUNG_NODE_GRACE_S = 10.0
"""Once the job completed (a launcher exited 0) and every other launcher has exited or is stopped: how long a
stopped one is given before the launch ends it (a node that hung for good, SIGSTOPped with its ranks)."""


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP; ``T`` in ``/proc/<pid>/stat``)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _wait_launchers(agents: Sequence[subprocess.Popen], timeout: float | None) -> list[int]:
    """Wait for every launcher; their exit statuses. A launcher still stopped :data:`HUNG_NODE_GRACE_S` after the
    job completed (some launcher exited 0) while every other one exited is a node that hung for good: it is
    SIGKILLed, said in one line, and its processes go with it (their parent-death signal); its status is then -9,
    a node lost. ``timeout``: :class:`subprocess.TimeoutExpired` past it."""
    end = None if timeout is None else time.monotonic() + timeout
    since: float | None = None
    while any(a.poll() is None for a in agents):
        if end is not None and time.monotonic() > end:
            raise subprocess.TimeoutExpired([str(a.args) for a in agents], timeout or 0.0)
        live = [a for a in agents if a.poll() is None]
        if any(a.returncode == 0 for a in agents) and all(_stopped(a.pid) for a in live):
            since = since if since is not None else time.monotonic()
            if time.monotonic() - since > HUNG_NODE_GRACE_S:
                for a in live:
                    print(f"neighbor-ckpt launch: the job completed; launcher pid {a.pid} is still stopped (its node "
                          "hung for good): SIGKILL", file=sys.stderr, flush=True)
                    a.kill()
                    a.wait()
        else:
            since = None
        time.sleep(0.2)
    return [int(a.returncode) for a in agents]


def run_inprocess(procs: InprocessProcesses, *, env: dict[str, str] | None = None,
                  timeout: float | None = None, bind_ports: bool = True, **kw: Any) -> int:
    """Start the launchers of ``procs`` (environment: ``env`` or this process's, plus each one's additions), wait
    for all of them; returns :func:`launch_status` of their exit statuses. The stores' ports are bound here first
    and handed down (:func:`bind_stores`; ``bind_ports=False``: each store host binds its own, as the launchers of a
    cluster do, and one that cannot is its launcher's to report; never with a simulated network, where each store
    binds its node's own address in its node's namespace). ``timeout``: seconds for the launchers, then
    :class:`subprocess.TimeoutExpired`; every launcher still running is stopped on the way out (a launcher stops its
    own processes and its store host when it is terminated)."""
    from neighbor_ckpt.inprocess.store_auth import new_token_file

    new_token_file(procs.token_file)
    base = dict(os.environ if env is None else env)
    agents: list[subprocess.Popen] = []
    procs, held = bind_stores(procs) if bind_ports and procs.network is None else (procs, {})
    try:
        for i, (cmd, extra) in enumerate(procs.agents):
            marker = _option(cmd, "--complete-file")
            if marker is not None:  # a marker of an earlier launch with this run id must not end this one
                Path(marker).unlink(missing_ok=True)
            sock = held.pop(i, None)
            try:
                agents.append(subprocess.Popen(list(cmd), env={**base, **dict(extra)},
                                               pass_fds=() if sock is None else (sock.fileno(),), **kw))
            finally:
                if sock is not None:  # the launcher holds it now: closed here, it is the store host's alone
                    sock.close()
        return launch_status(_wait_launchers(agents, timeout))
    finally:
        for sock in held.values():
            sock.close()
        stop_processes(agents)
