"""A whole training job in one YAML file: what ``neighbor-ckpt launch`` runs and ``neighbor-ckpt plan`` plans.

The file (see ``configs/``) has the sections of :class:`JobSpec`: ``model``, ``parallelism``, ``trainer``,
``data``, ``checkpoint`` (NeMo's persistent checkpoint, our insurance), ``hardware`` (for the planner),
``launch`` and ``neighbor_ckpt`` (:class:`~neighbor_ckpt.config.NeighborCkptConfig`). Command-line
overrides ``key.path=value`` are applied to the YAML document before validation; values are parsed as YAML
(``true``, ``4``, ``null``, ``[a, b]``).

Everything is checked before any process starts, and every problem is one line naming the key path, all of them
in one :class:`~neighbor_ckpt.errors.ConfigError`: unknown keys, wrong types, values outside their allowed set or
range, a model the planner's rules reject (:class:`~neighbor_ckpt.planning.planner.ModelShape`, under
``config.model``), and parallelism the world size or the model cannot hold.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml

from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.validation import Problems, check_tree, deferred, from_dict, to_dict, validate

__all__ = ["ModelSpec", "ParallelismSpec", "TrainerSpec", "DataSpec", "CheckpointSpec", "HardwareSpec",
           "LaunchSpec", "JobSpec", "load_job", "apply_overrides"]

Preset = Literal["gpt_tiny", "llama_tiny", "llama3_8b", "llama3_70b", "gpt3_175b", "mixtral_8x7b"]


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    """The model: a preset, optionally resized (any field left null keeps the preset's value)."""

    preset: Preset = "gpt_tiny"
    """Architecture and size. ``gpt_*``: LayerNorm, GELU, learned positions; ``llama*``: RMSNorm, SwiGLU,
    RoPE, grouped-query attention; ``mixtral_8x7b``: Llama's with every MLP a mixture of 8 experts, top-2
    (``plan`` only: the recipe does not build it yet)."""

    num_layers: int | None = None
    """Transformer layers."""

    hidden_size: int | None = None
    """Hidden size."""

    ffn_hidden_size: int | None = None
    """MLP hidden size."""

    num_attention_heads: int | None = None
    """Attention heads."""

    num_query_groups: int | None = None
    """Key/value heads (grouped-query attention); null: the preset's."""

    seq_length: int | None = None
    """Sequence length in tokens."""

    dropout: float | None = None
    """Hidden and attention dropout (null: the preset's; the tiny presets use 0.1 so RNG restoration is
    exercised)."""

    num_moe_experts: int | None = None
    """Mixture of experts: routed experts per layer (null: the preset's; dense presets have none)."""

    moe_router_topk: int | None = None
    """Experts each token is routed to (null: the preset's, 2)."""

    moe_ffn_hidden_size: int | None = None
    """FFN hidden size of one expert (null: the preset's, ``ffn_hidden_size``)."""

    moe_router_enable_expert_bias: bool | None = None
    """Aux-loss-free load balancing with a per-router ``expert_bias`` buffer (null: the preset's, off)."""


@dataclass(kw_only=True, slots=True)
class ParallelismSpec:
    """Model parallelism; data parallelism is what the world size leaves: DP = world / (TP x PP x CP)."""

    tensor: int = 1
    """Tensor-parallel size."""

    pipeline: int = 1
    """Pipeline-parallel size."""

    context: int = 1
    """Context-parallel size."""

    expert: int = 1
    """Expert-parallel size (mixture of experts): each rank holds ``num_moe_experts / expert`` experts per layer.
    Expert params' optimizer state is sharded over the expert-data-parallel group, world / (expert_tensor x expert x
    pipeline) ranks, and rings over it."""

    expert_tensor: int | None = None
    """Expert tensor-parallel size (null: ``tensor``, megatron-core's default)."""

    virtual_pipeline: int | None = None
    """Interleaved pipeline chunks per stage (null: no interleaving)."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tensor > 1)."""

    distributed_optimizer: bool = True
    """megatron-core's distributed optimizer (ZeRO-1). With it each rank snapshots 12 bytes per local param / DP
    per iteration; without it the snapshot is small state only and redundant state is backed up lazily."""

    def _check(self, p: Problems) -> None:
        for name in ("tensor", "pipeline", "context", "expert"):
            p.at_least(name, getattr(self, name), 1)
        p.at_least("expert_tensor", self.expert_tensor, 1, optional=True)
        p.at_least("virtual_pipeline", self.virtual_pipeline, 1, optional=True)
        if p.ok("tensor"):
            p.check(not self.sequence_parallel or self.tensor > 1, "sequence_parallel", "needs parallelism.tensor > 1")


@dataclass(kw_only=True, slots=True)
class TrainerSpec:
    """The Lightning / NeMo trainer."""

    accelerator: Literal["gpu", "cpu"] = "gpu"
    """``cpu`` runs megatron-core on CPU tensors and gloo through ``megatron_patches.enable_cpu()``: smoke runs
    and tests only."""

    devices: int = 8
    """Processes (GPUs) per node."""

    num_nodes: int = 1
    """Nodes."""

    max_steps: int = 1000
    """Optimizer steps."""

    micro_batch_size: int = 1
    """Sequences per micro-batch."""

    global_batch_size: int = 8
    """Sequences per optimizer step, over all DP ranks and micro-batches."""

    precision: Literal["32", "bf16-mixed", "16-mixed"] = "bf16-mixed"
    """Training precision (quote it in YAML: ``"32"``)."""

    lr: float = 3e-4
    """Peak learning rate (Adam, cosine schedule with warm-up)."""

    warmup_steps: int = 2
    """Warm-up steps of the LR schedule."""

    log_every_n_steps: int = 10
    """Trainer log interval; the neighbor-checkpoint status line follows it."""

    seed: int = 1234
    """Global seed."""

    def _check(self, p: Problems) -> None:
        for name in ("devices", "num_nodes", "max_steps", "micro_batch_size", "global_batch_size",
                     "log_every_n_steps"):
            p.at_least(name, getattr(self, name), 1)
        p.at_least("warmup_steps", self.warmup_steps, 0)
        p.check(self.accelerator != "cpu" or self.precision == "32", "precision",
                f"{self.precision!r} on accelerator cpu; use \"32\"")


@dataclass(kw_only=True, slots=True)
class DataSpec:
    """Training data."""

    kind: Literal["mock", "indexed"] = "mock"
    """``mock``: NeMo's MockDataModule (random tokens, deterministic); ``indexed``: Megatron indexed datasets at
    ``paths`` (NeMo PreTrainingDataModule)."""

    paths: list[str] | None = None
    """Indexed dataset prefixes (``kind: indexed``)."""

    tokenizer: str | None = None
    """HuggingFace tokenizer name or path (``kind: indexed``); mock data uses a null tokenizer."""

    num_train_samples: int = 10_000
    """Samples in the mock dataset."""

    def _check(self, p: Problems) -> None:
        p.check(self.kind != "indexed" or bool(self.paths), "paths", "required when data.kind is 'indexed'")
        p.at_least("num_train_samples", self.num_train_samples, 1)


@dataclass(kw_only=True, slots=True)
class CheckpointSpec:
    """NeMo's persistent (disk) checkpoint: the insurance for the rare failures in-memory copies cannot
    cover. ``AutoResume`` restarts from it only when no in-memory version is newer."""

    every_n_train_steps: int = 0
    """Persistent checkpoint interval (0: none)."""

    dir: str | None = None
    """Checkpoint directory (null: ``<launch.log_dir>/<name>/checkpoints``)."""

    async_save: bool = True
    """NeMo's asynchronous distributed checkpointing (GPU only; always off on CPU)."""

    def _check(self, p: Problems) -> None:
        p.at_least("every_n_train_steps", self.every_n_train_steps, 0, " (0: none)")


@dataclass(kw_only=True, slots=True)
class HardwareSpec:
    """The machines, for ``neighbor-ckpt plan``: a known GPU, optionally with measured figures."""

    gpu: Literal["h100", "a100", "cpu"] = "h100"
    """Hardware preset."""

    gpu_tflops: float | None = None
    """Dense peak TFLOPS per GPU (null: the preset's)."""

    mfu: float | None = None
    """Model FLOPS utilisation expected (null: the preset's)."""

    pcie_gbytes_per_s: float | None = None
    """Device-to-host copy bandwidth per GPU, GB/s (null: the preset's)."""

    nic_gbits_per_s: float | None = None
    """Network bandwidth per GPU, Gb/s (null: the preset's)."""

    host_memory_gb: float | None = None
    """Host memory per node, GB (null: the preset's)."""

    shm_gb: float | None = None
    """Size of /dev/shm per node, GB (null: the preset's)."""


@dataclass(kw_only=True, slots=True)
class LaunchSpec:
    """How ``neighbor-ckpt launch`` starts the job."""

    max_restarts: int = 3
    """torchrun worker-group restarts (each recovers from the neighbor copies)."""

    log_dir: str = "runs"
    """Where the run directory ``<log_dir>/<name>`` goes (logs, reports, resolved config)."""

    rdzv_port: int = 29500
    """c10d rendezvous port on the first node (multi-node)."""

    slurm_partition: str | None = None
    """Slurm partition for ``--slurm`` (null: the cluster's default)."""

    slurm_account: str | None = None
    """Slurm account for ``--slurm``."""

    slurm_time: str = "04:00:00"
    """Slurm time limit for ``--slurm``."""

    open_store: bool = False
    """In process: serve each node's store open to every user of that node where the kernel cannot seal it (no TCP-MD5,
    ``CONFIG_TCP_MD5SIG`` or FIPS mode, or no loopback address ``127.0.0.2``). Off: such a store host refuses to start
    and says why (docs/shared-nodes.md). Only for nodes no other user logs in to."""

    simulate_network: bool = False
    """Run each simulated node of an in-process launch on one machine in a network namespace of its own (veth pairs
    on bridges, one address per node; root only), so that ``neighbor_ckpt.fault_injection.target: partition`` can cut
    the network between nodes for real (docs/nodes.md, network partitions). Not for ``--slurm`` (real nodes have real networks)."""


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """One training job: the top level of a file in ``configs/``."""

    name: str = "job"
    """Run name (directory names, Slurm job name)."""

    framework: Literal["nemo", "bridge"] = "nemo"
    """Which training framework ``neighbor-ckpt launch`` runs: ``nemo`` (NeMo 2, ``recipes/nemo_pretrain.py``; a job
    file without the key) or ``bridge`` (Megatron-Bridge 0.6's ``pretrain``, ``recipes/bridge_pretrain.py``: the
    tiny presets, on the restart path or in process)."""

    recipe: Literal["gpt", "llama"] = "gpt"
    """Which recipe builds the NeMo objects (``recipes/nemo_pretrain.py``)."""

    model: ModelSpec = field(default_factory=ModelSpec)
    """Model."""

    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    """TP / PP / CP and the distributed optimizer."""

    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    """Trainer."""

    data: DataSpec = field(default_factory=DataSpec)
    """Data."""

    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    """Persistent insurance checkpoint."""

    hardware: HardwareSpec = field(default_factory=HardwareSpec)
    """Machines, for the planner."""

    launch: LaunchSpec = field(default_factory=LaunchSpec)
    """Launcher."""

    neighbor_ckpt: NeighborCkptConfig = field(default_factory=NeighborCkptConfig)
    """The neighbor-checkpoint switches."""

    def __post_init__(self) -> None:
        validate(self, "config")

    def _check(self, p: Problems) -> None:
        """The rules across sections; each runs only when the keys it reads passed their own rules."""
        par, t = self.parallelism, self.trainer
        with deferred():  # the planner's rules of a model and a machine, under this file's key paths
            shape, hardware = self.model_shape(), self._hardware_figures()
        check_tree(shape, p.at("model"))
        check_tree(hardware, p.at("hardware"))
        sizes = ("parallelism.tensor", "parallelism.pipeline", "parallelism.context")
        if p.ok(*sizes, "trainer.devices", "trainer.num_nodes"):
            mp = par.tensor * par.pipeline * par.context
            world = self.world_size
            if p.check(world % mp == 0, "parallelism",
                       f"tensor x pipeline x context = {par.tensor} x {par.pipeline} x {par.context} = {mp} does not "
                       f"divide the world size trainer.devices x trainer.num_nodes = {t.devices} x {t.num_nodes} = "
                       f"{world}") and p.ok("trainer.micro_batch_size", "trainer.global_batch_size"):
                dp = world // mp
                p.check(t.global_batch_size % (t.micro_batch_size * dp) == 0, "trainer.global_batch_size",
                        f"{t.global_batch_size} is not a multiple of micro_batch_size x data-parallel size = "
                        f"{t.micro_batch_size} x {dp}")
                el = self.neighbor_ckpt.elastic
                if el.enabled:
                    # Without in-process recovery, one torchrun agent runs every rank of its node and restarts them
                    # all: only another node can go on without a lost one (torchrun --nnodes 1:N).
                    p.check(self.neighbor_ckpt.inprocess.enabled or t.num_nodes > 1, "neighbor_ckpt.elastic.enabled",
                            "cannot shrink this launch: without in-process recovery one torchrun agent runs every "
                            "rank of a node and restarts them together, so with one node a rank lost for good stops "
                            "the job; set neighbor_ckpt.inprocess.enabled: true (the survivors go on with fewer "
                            "ranks), run several nodes (trainer.num_nodes > 1: the others go on without a lost one), "
                            "or turn elastic off")
                    p.check(par.distributed_optimizer, "neighbor_ckpt.elastic.enabled",
                            "needs parallelism.distributed_optimizer: true (elastic resharding re-partitions "
                            "megatron-core's distributed-optimizer shards)")
                    p.check(el.min_data_parallel <= dp, "neighbor_ckpt.elastic.min_data_parallel",
                            f"{el.min_data_parallel} exceeds the job's data-parallel size {dp}")
                if p.ok("parallelism.expert", "parallelism.expert_tensor"):
                    emp = self.expert_tensor * par.expert * par.pipeline
                    p.check(world % emp == 0, "parallelism.expert",
                            f"expert_tensor x expert x pipeline = {self.expert_tensor} x {par.expert} x {par.pipeline}"
                            f" = {emp} does not divide the world size {world}")
        nc = self.neighbor_ckpt
        p.check(not self.launch.simulate_network or nc.inprocess.enabled, "launch.simulate_network",
                "the simulated network is made for the simulated nodes of an in-process launch: set "
                "neighbor_ckpt.inprocess.enabled: true, or launch.simulate_network: false")
        p.check(self.launch.simulate_network or not any(f.target == "partition" for f in nc.fault_injection.planned()),
                "neighbor_ckpt.fault_injection.target", "partition cuts the network between simulated nodes: it needs "
                "launch.simulate_network: true (root; in process)")
        if p.ok("model", *sizes, "parallelism.virtual_pipeline", "parallelism.expert", "parallelism.expert_tensor"):
            self._check_split(shape, p)
        p.check(t.accelerator != "cpu" or self.model.preset in ("gpt_tiny", "llama_tiny"), "model.preset",
                f"{self.model.preset!r} needs trainer.accelerator gpu (the CPU presets are 'gpt_tiny' and "
                "'llama_tiny')")

    def _check_split(self, shape: Any, p: Problems) -> None:
        """Whether the model splits over the parallelism (the model's and the parallelism's own rules hold)."""
        par = self.parallelism
        p.check(shape.num_layers % par.pipeline == 0, "parallelism.pipeline",
                f"{par.pipeline} does not divide model.num_layers = {shape.num_layers}")
        vp = par.virtual_pipeline
        p.check(vp is None or (par.pipeline > 1 and shape.num_layers % (par.pipeline * vp) == 0),
                "parallelism.virtual_pipeline", f"{vp} needs pipeline > 1 and pipeline x virtual_pipeline to divide "
                f"model.num_layers = {shape.num_layers}")
        p.check(shape.num_attention_heads % par.tensor == 0 and shape.query_groups % par.tensor == 0,
                "parallelism.tensor", f"{par.tensor} does not divide the attention heads ({shape.num_attention_heads})"
                f" and query groups ({shape.query_groups}) of the model")
        p.check(par.context == 1 or shape.seq_length % (2 * par.context) == 0, "parallelism.context",
                f"model.seq_length {shape.seq_length} must be a multiple of 2 x context = {2 * par.context}")
        if not shape.is_moe:
            p.check(par.expert == 1 and par.expert_tensor is None, "parallelism.expert",
                    "expert parallelism needs a mixture-of-experts model (model.num_moe_experts)")
            return
        p.check(shape.num_moe_experts % par.expert == 0, "parallelism.expert",
                f"{par.expert} does not divide model.num_moe_experts = {shape.num_moe_experts}")
        p.check(shape.expert_ffn_hidden_size % self.expert_tensor == 0, "parallelism.expert_tensor",
                f"{self.expert_tensor} does not divide the expert FFN hidden size {shape.expert_ffn_hidden_size}")
        # megatron-core's MoELayer.forward refuses to train with TP > 1 and no sequence parallelism
        p.check(par.tensor == 1 or par.sequence_parallel, "parallelism.sequence_parallel",
                "mixture of experts with tensor > 1 needs sequence_parallel: true (megatron-core refuses otherwise)")

    @property
    def world_size(self) -> int:
        return self.trainer.devices * self.trainer.num_nodes

    @property
    def data_parallel(self) -> int:
        p = self.parallelism
        return self.world_size // (p.tensor * p.pipeline * p.context)

    @property
    def expert_tensor(self) -> int:
        """Expert tensor-parallel size actually used (``parallelism.expert_tensor``, else ``tensor``)."""
        p = self.parallelism
        return p.tensor if p.expert_tensor is None else p.expert_tensor

    @property
    def expert_data_parallel(self) -> int:
        """Expert-data-parallel size: world / (expert_tensor x expert x pipeline)."""
        p = self.parallelism
        return self.world_size // (self.expert_tensor * p.expert * p.pipeline)

    def model_shape(self) -> Any:
        """The :class:`~neighbor_ckpt.planning.planner.ModelShape` of the preset with this spec's resizes applied."""
        from neighbor_ckpt.planning.planner import PRESETS

        shape = PRESETS[self.model.preset]
        changes = {f.name: getattr(self.model, f.name) for f in dataclasses.fields(self.model)
                   if f.name not in ("preset", "dropout") and getattr(self.model, f.name) is not None}
        return dataclasses.replace(shape, **changes)

    def hardware_preset(self) -> Any:
        """The :class:`~neighbor_ckpt.planning.planner.Hardware` of ``hardware.gpu`` with this spec's figures applied
        and ``trainer.devices`` GPUs per node."""
        return dataclasses.replace(self._hardware_figures(), gpus_per_node=self.trainer.devices)

    def _hardware_figures(self) -> Any:
        from neighbor_ckpt.planning.planner import HARDWARE

        changes = {f.name: getattr(self.hardware, f.name) for f in dataclasses.fields(self.hardware)
                   if f.name != "gpu" and getattr(self.hardware, f.name) is not None}
        return dataclasses.replace(HARDWARE[self.hardware.gpu], **changes)

    def plan(self) -> Any:
        """The planner's :class:`~neighbor_ckpt.planning.planner.JobPlan` for this job (``neighbor-ckpt plan``)."""
        from neighbor_ckpt.planning.planner import Parallelism, plan_job

        p, t = self.parallelism, self.trainer
        par = Parallelism(tp=p.tensor, pp=p.pipeline, cp=p.context, dp=self.data_parallel, ep=p.expert,
                          etp=p.expert_tensor, distributed_optimizer=p.distributed_optimizer, micro_batch_size=t.micro_batch_size,
                          global_batch_size=t.global_batch_size)
        store = self.neighbor_ckpt.store
        extras = None if store.extras_capacity_mb is None else int(store.extras_capacity_mb * 2**20)
        return plan_job(self.model_shape(), par, self.hardware_preset(), versions=store.versions,
                        param_dtype_bytes=4 if t.precision == "32" else 2, extras_bytes=extras)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def apply_overrides(doc: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set ``key.path=value`` overrides into a parsed YAML document (a new dict; values parsed as YAML)."""
    out = copy.deepcopy(doc)  # keeps the file's key order: problems are reported in it
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: expected key.path=value, e.g. trainer.max_steps=20")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({e.__class__.__name__})") from None
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def load_job(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> JobSpec:
    """Read, override and validate a job file. Raises one :class:`ConfigError` with one line per problem, each
    naming its key path."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    try:
        doc = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    doc = apply_overrides(doc, overrides)
    return from_dict(JobSpec, doc, "config")

