"""Plan a job before launching it: per-rank snapshot sizes, host memory, and whether the snapshot hides.

Pure and framework-agnostic (stdlib + math). Inputs are a :class:`ModelShape` (a megatron-core GPTModel),
a :class:`Parallelism` and a :class:`Hardware`; :func:`plan_job` returns a frozen :class:`JobPlan` with one
:class:`RankClassPlan` per kind of pipeline stage (ranks of one stage kind hold the same amount of state).

What is modelled (reconstructed from FFTrainer §2 "Communication and computation overlap" and §4.2; the
paper's formulas did not survive text extraction):

* compute per iteration: "the number of floating-point operations on each parameter" is 2 per token
  forward and 4 backward, so ``compute_s = 6 * params_per_rank * tokens_per_rank / (peak_flops * mfu)``
  with ``tokens_per_rank = micro_batch * grad_accum * seq_length / cp``. This ignores attention-score
  FLOPs (undercount, grows with ``seq_length``) and counts embedding lookups as matmuls (overcount on the
  first stage); both are second order next to the mfu guess.
* unique state per iteration (FFTrainer §4.2 "12 Phi / D for the Adam optimizer"): what the razor's
  :func:`~neighbor_ckpt.snapshot.razor.disposition` calls unique of the weights, the fp32 main params and the
  optimizer state. With the distributed optimizer that is the main params + exp_avg + exp_avg_sq of this rank's
  shard, ``12 * ceil(params_per_rank / (dp * cp))`` bytes. megatron-core shards the distributed optimizer over
  the data-parallel-*with-context-parallel* group, so the shard factor is ``dp * cp`` (CP does not shard the
  parameters themselves); the neighbor ring runs over the same group, and it is the razor's DP size.
* mixture of experts (``ModelShape.num_moe_experts``; every layer's MLP an MoE layer, as in Mixtral): the expert
  weights are split over expert parallelism (EP, ``E / ep`` experts per rank) and expert tensor parallelism
  (ETP, megatron-core's default: the TP size), and their distributed-optimizer shard lives in the
  *expert-data-parallel* group of ``world / (etp * ep * pp)`` ranks (megatron-core's
  ``parallel_state.get_expert_data_parallel_world_size``; CP folds into it), not in the dense DP x CP group. The
  razor's rules apply to each part with its own group size: unique bytes = ``12 * ceil(dense / (dp*cp)) +
  12 * ceil(expert / edp)``, and each part has its own ring. The routers' ``expert_bias`` buffers (aux-loss-free
  balancing) are changing buffers: the razor stages them (fp32, ``E`` per layer, every rank its own).
  Compute counts the active parameters: a token visits ``topk`` of the ``E`` experts, and with balanced routing
  a rank's expert work is ``6 * tokens * topk * (one whole expert's params) / tp``.
* host memory per rank: the store's own footprint formula,
  :func:`~neighbor_ckpt.snapshot.store.store_bytes_per_rank` (the one the preflight checks).
* FFTrainer eq. 1-2: the snapshot hides inside one iteration when its transfer time does not exceed the
  compute time. We define ``fcr = compute_s / max(d2h_s, network_s)``; ``fcr >= 1`` means it hides. This
  matches the paper's prose: higher GPU FLOPS lower FCR, longer sequences and larger batches raise it,
  faster NICs raise it (``fcr = b * s * dp * cp * BW / (2 * F)`` for Adam when the network is the
  bottleneck: the parameter count cancels).

Failure/goodput arithmetic (FlashRecovery eq. 1-4, FFTrainer eq. 3-5, Table 2) is in
:mod:`neighbor_ckpt.planning.goodput`. Inputs are checked with
:mod:`neighbor_ckpt.validation`: every problem of a call is one line of one ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

from neighbor_ckpt.snapshot.razor import Disposition, StateKind, disposition
from neighbor_ckpt.snapshot.slot import MIN_EXTRAS_BYTES
from neighbor_ckpt.snapshot.store import store_bytes_per_rank
from neighbor_ckpt.validation import Problems, validate

__all__ = [
    "ModelShape", "Hardware", "Parallelism", "RankClassPlan", "JobPlan", "plan_job", "PRESETS", "HARDWARE",
    "OPTIMIZER_STATE_BYTES",
]

log = logging.getLogger(__name__)

OPTIMIZER_STATE_BYTES: dict[str, int] = {"adam": 8, "sgd": 4}
"""fp32 optimizer state per parameter, besides the master copy: Adam's exp_avg + exp_avg_sq, SGD's momentum."""



# -- model -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The shape of a megatron-core GPTModel, enough to count its parameters exactly."""

    num_layers: int
    """Transformer layers."""

    hidden_size: int
    """Hidden size ``h``."""

    ffn_hidden_size: int
    """MLP hidden size (per branch; SwiGLU's fc1 has twice as many outputs)."""

    num_attention_heads: int
    """Query heads. The head dimension is ``hidden_size / num_attention_heads``."""

    num_query_groups: int | None = None
    """Key/value heads (grouped-query attention); None: as many as query heads (multi-head attention)."""

    vocab_size: int
    """Vocabulary size *after* Megatron's padding (divisible by the tensor-parallel size)."""

    seq_length: int
    """Sequence length in tokens (also the size of learned absolute position embeddings)."""

    gated_linear_unit: bool = False
    """SwiGLU-style MLP: fc1 produces ``2 * ffn_hidden_size`` outputs."""

    add_bias_linear: bool = True
    """Biases on QKV, proj, fc1 and fc2 (GPT: True, Llama: False)."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """``LayerNorm`` has a weight and a bias per norm, ``RMSNorm`` only a weight."""

    share_embeddings_and_output_weights: bool = True
    """Tied input embedding and output layer. With pipeline parallelism the last stage still holds its own
    copy of the word embedding (megatron-core keeps it in sync with an all-reduce)."""

    position_embedding: Literal["learned_absolute", "rope"] = "learned_absolute"
    """``learned_absolute`` adds a ``seq_length x hidden_size`` table (replicated across TP); ``rope`` none."""

    num_moe_experts: int | None = None
    """Routed experts per layer (mixture of experts: every layer's MLP is an MoE layer with a router of
    ``num_moe_experts x hidden_size`` weights, as in Mixtral); None: a dense model."""

    moe_router_topk: int = 2
    """Experts each token is routed to (compute only: every rank holds all of its local experts)."""

    moe_ffn_hidden_size: int | None = None
    """FFN hidden size of one expert (SwiGLU: per branch); None: ``ffn_hidden_size``."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free load balancing: every router keeps an fp32 ``expert_bias`` buffer of ``num_moe_experts``
    entries, updated every step (the razor stages it: a changing buffer)."""

    def __post_init__(self) -> None:
        validate(self, "ModelShape")

    def _check(self, p: Problems) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
                     "seq_length"):
            p.integer(name, getattr(self, name))
        if self.num_query_groups is not None:
            p.integer("num_query_groups", self.num_query_groups)
        p.one_of("normalization", self.normalization, ("LayerNorm", "RMSNorm"))
        p.one_of("position_embedding", self.position_embedding, ("learned_absolute", "rope"))
        if self.num_moe_experts is not None and p.integer("num_moe_experts", self.num_moe_experts) \
                and p.integer("moe_router_topk", self.moe_router_topk):
            p.check(self.moe_router_topk <= self.num_moe_experts, "moe_router_topk",
                    f"{self.moe_router_topk} is more than num_moe_experts = {self.num_moe_experts}")
        if self.moe_ffn_hidden_size is not None:
            p.integer("moe_ffn_hidden_size", self.moe_ffn_hidden_size)
        if p.ok("hidden_size", "num_attention_heads"):
            p.check(self.hidden_size % self.num_attention_heads == 0, "hidden_size",
                    f"{self.hidden_size} is not divisible by num_attention_heads = {self.num_attention_heads}")
        if p.ok("num_attention_heads", "num_query_groups"):
            p.check(self.num_attention_heads % self.query_groups == 0, "num_query_groups",
                    f"{self.num_query_groups} does not divide num_attention_heads = {self.num_attention_heads}")

    @property
    def query_groups(self) -> int:
        """Key/value heads actually used."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts model."""
        return self.num_moe_experts is not None

    @property
    def expert_ffn_hidden_size(self) -> int:
        """FFN hidden size of one expert."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def check_split(self, p: Problems, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
        """Record in ``p`` (keys ``tp``, ``pp``, ``ep``, ``etp``) whether ``tp`` x ``pp`` ranks, with experts split
        over ``ep`` x ``etp`` (None: ``tp``), can hold this model."""
        if p.integer("tp", tp):
            for name, value in (("num_attention_heads", self.num_attention_heads),
                                ("num_query_groups", self.query_groups), ("ffn_hidden_size", self.ffn_hidden_size),
                                ("vocab_size", self.vocab_size)):
                p.check(value % tp == 0, "tp", f"{tp} does not divide ModelShape.{name} = {value}")
        if p.integer("pp", pp):
            p.check(self.num_layers % pp == 0, "pp", f"{pp} does not divide ModelShape.num_layers = {self.num_layers}")
        if p.integer("ep", ep):
            if not self.is_moe:
                p.check(ep == 1, "ep", f"{ep} needs a mixture-of-experts model (ModelShape.num_moe_experts is None)")
            elif isinstance(self.num_moe_experts, int):
                p.check(self.num_moe_experts % ep == 0, "ep",
                        f"{ep} does not divide ModelShape.num_moe_experts = {self.num_moe_experts}")
        if etp is not None and p.integer("etp", etp) and self.is_moe:
            p.check(self.expert_ffn_hidden_size % etp == 0, "etp",
                    f"{etp} does not divide the expert FFN hidden size {self.expert_ffn_hidden_size}")

    def _layer(self, tp: int) -> tuple[int, int]:
        """(params split over TP held by one TP rank, params replicated on every TP rank) of one layer; of an MoE
        layer its dense part only (attention, norms, router), the experts are :meth:`_experts`."""
        h, f = self.hidden_size, self.ffn_hidden_size
        qkv_out = (self.num_attention_heads + 2 * self.query_groups) * self.head_dim
        fc1_out = 2 * f if self.gated_linear_unit else f
        split = qkv_out * h + h * self.num_attention_heads * self.head_dim
        norm = 2 * h if self.normalization == "LayerNorm" else h
        replicated = 2 * norm  # input_layernorm, pre_mlp_layernorm
        if self.add_bias_linear:
            split += qkv_out  # column-parallel biases are split
            replicated += h  # row-parallel biases (proj) are not
        if self.is_moe:
            e = self.num_moe_experts or 0
            replicated += e * h + (e if self.add_bias_linear else 0)  # the router, fp32, whole on every TP rank
        else:
            split += fc1_out * h + h * f + (fc1_out if self.add_bias_linear else 0)
            replicated += h if self.add_bias_linear else 0  # fc2's bias
        return split // tp, replicated

    def _experts(self, ep: int, etp: int) -> int:
        """Expert params of one layer held by one rank: ``E / ep`` experts, each split over ``etp`` like a dense
        MLP over TP (fc1 and its bias column-parallel, fc2 row-parallel with its bias whole)."""
        if not self.is_moe:
            return 0
        h, f = self.hidden_size, self.expert_ffn_hidden_size
        fc1_out = 2 * f if self.gated_linear_unit else f
        one = (fc1_out * h + h * f) // etp + ((fc1_out // etp + h) if self.add_bias_linear else 0)
        return (self.num_moe_experts or 0) // ep * one

    def dense_and_expert_params_per_stage(self, tp: int = 1, pp: int = 1, ep: int = 1,
                                          etp: int | None = None) -> list[tuple[int, int]]:
        """(dense params, expert params) held by ONE rank of each pipeline stage (megatron-core GPTModel).

        Dense: one tensor-parallel rank's share. The first stage holds the word embedding (vocab-parallel) and
        learned position embeddings (replicated); the last stage the final norm and the output layer
        (column-parallel, no bias), which is absent when embeddings are shared and ``pp == 1`` but is a full copy
        of the word embedding on the last stage when they are shared and ``pp > 1``. Layers are split evenly over
        the stages. Expert (MoE only): ``E / ep`` experts per layer, each split over ``etp`` (None: ``tp``).
        """
        p = Problems()
        self.check_split(p, tp, pp, ep, etp)
        p.raise_if_any()
        h = self.hidden_size
        split, replicated = self._layer(tp)
        per_layer = split + replicated
        layers = self.num_layers // pp
        stages = [layers * per_layer for _ in range(pp)]
        stages[0] += self.vocab_size * h // tp
        if self.position_embedding == "learned_absolute":
            stages[0] += self.seq_length * h
        stages[-1] += 2 * h if self.normalization == "LayerNorm" else h
        if not (self.share_embeddings_and_output_weights and pp == 1):
            stages[-1] += self.vocab_size * h // tp
        expert = layers * self._experts(ep, tp if etp is None else etp)
        return [(dense, expert) for dense in stages]

    def params_per_stage(self, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> list[int]:
        """Parameters (dense + expert) held by ONE rank of each pipeline stage: see
        :meth:`dense_and_expert_params_per_stage`."""
        return [d + e for d, e in self.dense_and_expert_params_per_stage(tp, pp, ep, etp)]

    def expert_bias_per_stage(self, pp: int = 1) -> int:
        """Entries of the routers' ``expert_bias`` buffers (fp32) of one stage: ``E`` per layer when enabled."""
        if not (self.is_moe and self.moe_router_enable_expert_bias):
            return 0
        return self.num_layers // pp * (self.num_moe_experts or 0)

    def total_params(self) -> int:
        """Parameters of the whole model (``tp = pp = ep = 1``: every expert; tied embeddings counted once)."""
        return self.params_per_stage(1, 1)[0]


PRESETS: dict[str, ModelShape] = {
    "gpt_tiny": ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=128,
                           seq_length=64),
    "llama_tiny": ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                             num_query_groups=2, vocab_size=128, seq_length=64, gated_linear_unit=True,
                             add_bias_linear=False, normalization="RMSNorm",
                             share_embeddings_and_output_weights=False, position_embedding="rope"),
    "llama3_8b": ModelShape(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                            num_query_groups=8, vocab_size=128256, seq_length=8192, gated_linear_unit=True,
                            add_bias_linear=False, normalization="RMSNorm",
                            share_embeddings_and_output_weights=False, position_embedding="rope"),
    "llama3_70b": ModelShape(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                             num_query_groups=8, vocab_size=128256, seq_length=8192, gated_linear_unit=True,
                             add_bias_linear=False, normalization="RMSNorm",
                             share_embeddings_and_output_weights=False, position_embedding="rope"),
    "gpt3_175b": ModelShape(num_layers=96, hidden_size=12288, ffn_hidden_size=49152, num_attention_heads=96,
                            vocab_size=51200, seq_length=2048),
    # NeMo 2.7.3 MixtralConfig8x7B: the Llama layout with every MLP an MoE layer of 8 SwiGLU experts, top-2
    "mixtral_8x7b": ModelShape(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                               num_query_groups=8, vocab_size=32000, seq_length=4096, gated_linear_unit=True,
                               add_bias_linear=False, normalization="RMSNorm",
                               share_embeddings_and_output_weights=False, position_embedding="rope",
                               num_moe_experts=8, moe_router_topk=2),
}
"""Model shapes by name (the ``model.preset`` of a job file). GPT: LayerNorm, biases, learned positions,
tied embeddings; Llama: RMSNorm, SwiGLU, RoPE, grouped-query attention, untied embeddings; Mixtral: Llama's with
8 experts per layer, top-2."""


# -- hardware ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """One kind of machine. Sizes and bandwidths are decimal (GB = 1e9 bytes, Gb = 1e9 bits)."""

    name: str
    """Display name."""

    gpu_tflops: float
    """Dense bf16 peak per GPU, TFLOPS."""

    mfu: float = 0.4
    """Model FLOPS utilisation expected of the training step (fraction of the peak)."""

    pcie_gbytes_per_s: float
    """Effective device-to-host copy bandwidth per GPU, GB/s."""

    nic_gbits_per_s: float
    """Network bandwidth per GPU towards the ring successor, Gb/s."""

    host_memory_gb: float
    """Host memory per node, GB."""

    shm_gb: float
    """Size of ``/dev/shm`` per node, GB (the host store lives there)."""

    gpus_per_node: int = 8
    """GPUs (training processes) per node."""

    def __post_init__(self) -> None:
        validate(self, "Hardware")

    def _check(self, p: Problems) -> None:
        for name in ("gpu_tflops", "pcie_gbytes_per_s", "nic_gbits_per_s", "host_memory_gb", "shm_gb"):
            p.positive(name, getattr(self, name))
        p.positive("mfu", self.mfu, upper=1.0)
        p.integer("gpus_per_node", self.gpus_per_node)


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(name="h100", gpu_tflops=989.0, pcie_gbytes_per_s=50.0, nic_gbits_per_s=400.0,
                     host_memory_gb=2048.0, shm_gb=1024.0, gpus_per_node=8),
    "a100": Hardware(name="a100", gpu_tflops=312.0, pcie_gbytes_per_s=25.0, nic_gbits_per_s=200.0,
                     host_memory_gb=1024.0, shm_gb=512.0, gpus_per_node=8),
    # Order-of-magnitude figures for the small CPU test machines (2 cores, ~24 GB RAM): torch matmul on a
    # couple of cores, memcpy into /dev/shm, gloo over loopback TCP.
    "cpu": Hardware(name="cpu", gpu_tflops=0.1, mfu=0.2, pcie_gbytes_per_s=5.0, nic_gbits_per_s=10.0,
                    host_memory_gb=16.0, shm_gb=8.0, gpus_per_node=2),
}
"""Hardware presets by name (the ``hardware.gpu`` of a job file): H100 SXM (PCIe Gen5, one 400 Gb/s NIC per
GPU), A100 SXM (PCIe Gen4, 200 Gb/s), and the CPU test machines."""


# -- parallelism -------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallelism:
    """How the model and the batch are split over ranks (megatron-core's TP x CP x DP x PP)."""

    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size (layers split evenly)."""

    cp: int = 1
    """Context-parallel size (splits the sequence; does not shard parameters)."""

    dp: int = 1
    """Data-parallel size (without CP)."""

    ep: int = 1
    """Expert-parallel size (MoE): each rank holds ``num_moe_experts / ep`` experts of every layer."""

    etp: int | None = None
    """Expert tensor-parallel size (MoE); None: ``tp`` (megatron-core's default)."""

    distributed_optimizer: bool = True
    """megatron-core's distributed optimizer: optimizer state and fp32 main params sharded over DP x CP."""

    micro_batch_size: int = 1
    """Sequences per micro-batch per DP rank."""

    global_batch_size: int | None = None
    """Sequences per optimizer step over all DP ranks; None: ``micro_batch_size * dp`` (no accumulation)."""

    def __post_init__(self) -> None:
        validate(self, "Parallelism")

    def _check(self, p: Problems) -> None:
        for name in ("tp", "pp", "cp", "dp", "ep", "micro_batch_size"):
            p.integer(name, getattr(self, name))
        if self.etp is not None:
            p.integer("etp", self.etp)
        if p.ok("tp", "cp", "dp", "ep", "etp"):
            p.check(self.tp * self.cp * self.dp % (self.expert_tp * self.ep) == 0, "ep",
                    f"expert tensor x expert = {self.expert_tp} x {self.ep} does not divide the ranks of a pipeline "
                    f"stage, tp x cp x dp = {self.tp} x {self.cp} x {self.dp}")
        if self.global_batch_size is not None and p.integer("global_batch_size", self.global_batch_size) \
                and p.ok("micro_batch_size", "dp"):
            p.check(self.global_batch_size % (self.micro_batch_size * self.dp) == 0, "global_batch_size",
                    f"{self.global_batch_size} is not divisible by micro_batch_size x dp = {self.micro_batch_size} x "
                    f"{self.dp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step: ``global / (micro * dp)``."""
        if self.global_batch_size is None:
            return 1
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def shard_factor(self) -> int:
        """Ranks that share one copy of the dense parameters' optimizer state: DP x CP (their neighbor ring too)."""
        return self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size actually used."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size, ``world / (etp x ep x pp)``: the ranks that share one copy of the expert
        parameters' optimizer state (their neighbor ring too). CP folds into it."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)


# -- plan --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class RankClassPlan:
    """What one rank of a kind of pipeline stage snapshots, holds and spends per iteration."""

    kind: Literal["first", "middle", "last", "all"]
    """Pipeline stage kind; ``all`` when ``pp == 1``."""

    stages: int
    """Pipeline stages of this kind."""

    ranks: int
    """Ranks of this kind: ``stages * tp * cp * dp``."""

    params_per_rank: int
    """Parameters held by one rank (one TP rank of the stage; CP and DP replicate them): dense + expert."""

    dense_params_per_rank: int
    """Of ``params_per_rank``, the dense ones (all of them for a dense model)."""

    expert_params_per_rank: int
    """Of ``params_per_rank``, the experts' (MoE): ``E / ep`` experts per layer, each split over ETP."""

    unique_payload_bytes: int
    """Unique tensor bytes snapshotted per iteration (the razor's unique and staged dispositions):
    ``dense_unique_bytes + expert_unique_bytes + staged_bytes``."""

    dense_unique_bytes: int
    """Of the payload, the dense params' state. Distributed optimizer: ``12 * ceil(dense / (dp*cp))`` for Adam (fp32
    main param + exp_avg + exp_avg_sq). Replicated optimizer: 0 when DP x CP > 1 (all of it is redundant), otherwise
    everything (weights + master + state)."""

    expert_unique_bytes: int
    """Of the payload, the expert params' state: the same rules with the expert-data-parallel size,
    ``12 * ceil(expert / edp)`` under the distributed optimizer."""

    staged_bytes: int
    """Of the payload, changing module buffers the razor stages (the routers' fp32 ``expert_bias``)."""

    extras_bytes: int
    """Small per-rank state carried in every snapshot (RNG, counters, data position), counted in its transfer."""

    lazy_backup_bytes: int
    """Replicated optimizer only: redundant state written at failure time by one live holder per DP group
    (weights in param dtype + fp32 master + optimizer state). Any rank may be the holder, so every rank
    reserves room."""

    host_memory_bytes: int
    """Host (shared) memory one rank needs: :func:`~neighbor_ckpt.snapshot.store.store_bytes_per_rank`, i.e.
    ``versions`` own + ``versions`` replica slots (header allowance + unique payload + extras region) plus one
    lazy-backup slot when there is redundant state."""

    d2h_seconds: float
    """``unique_bytes / pcie``: device-to-host copy time of one snapshot."""

    network_seconds: float
    """``unique_bytes / nic``: streaming time of one snapshot to the ring successor."""

    compute_seconds: float
    """``6 * params_per_rank * tokens_per_rank / (peak * mfu)``: one iteration's compute."""

    @property
    def unique_bytes(self) -> int:
        """Bytes per snapshot: payload + extras."""
        return self.unique_payload_bytes + self.extras_bytes

    @property
    def fcr(self) -> float:
        """Free checkpointing ratio: ``compute / max(d2h, network)``; ``inf`` when nothing is transferred."""
        transfer = max(self.d2h_seconds, self.network_seconds)
        return self.compute_seconds / transfer if transfer > 0 else math.inf

    @property
    def hides(self) -> bool:
        """The snapshot (copy and stream) fits in one iteration's compute: ``fcr >= 1``."""
        return self.fcr >= 1.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-safe: an infinite ``fcr`` becomes None)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(unique_bytes=self.unique_bytes, fcr=None if math.isinf(self.fcr) else self.fcr, hides=self.hides)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class JobPlan:
    """The plan of a whole job: one :class:`RankClassPlan` per stage kind, and what to worry about."""

    model: ModelShape
    """The model planned."""

    parallel: Parallelism
    """Its parallel layout."""

    hardware: Hardware
    """The machines."""

    versions: int
    """Snapshot versions kept per rank (own and replica alike)."""

    classes: tuple[RankClassPlan, ...]
    """One entry per pipeline stage kind, first to last."""

    warnings: tuple[str, ...]
    """Human-readable problems (host memory over /dev/shm or RAM, snapshot not hidden by compute)."""

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def rings(self) -> dict[str, dict[str, Any]]:
        """The neighbor rings a rank belongs to: each part of the state rings over the group that shards its
        optimizer state (dense: DP x CP; experts, MoE only: expert-data-parallel), with that group's size."""
        p = self.parallel
        out = {"dense": {"group": "data-parallel x context-parallel", "size": p.shard_factor}}
        if self.model.is_moe:
            out["expert"] = {"group": "expert-data-parallel = world / (etp x ep x pp)", "size": p.expert_dp}
        return out

    @property
    def nodes(self) -> int:
        return math.ceil(self.world_size / self.hardware.gpus_per_node)

    @property
    def ranks_per_node(self) -> int:
        return min(self.hardware.gpus_per_node, self.world_size)

    def format_table(self) -> str:
        """A plain-text table, one row per rank class, followed by the warnings."""
        moe = self.model.is_moe
        header = ("class", "stages", "ranks", "params/rank", "unique/iter", *(("dense/iter", "expert/iter") if moe
                                                                               else ()),
                  "host/rank", "host/node", "D2H s", "net s", "compute s", "FCR", "hides")
        rows = [header]
        for c in self.classes:
            fcr = "inf" if math.isinf(c.fcr) else f"{c.fcr:.2f}"
            split = (_bytes(c.dense_unique_bytes), _bytes(c.expert_unique_bytes)) if moe else ()
            rows.append((c.kind, str(c.stages), str(c.ranks), _si(c.params_per_rank), _bytes(c.unique_bytes), *split,
                         _bytes(c.host_memory_bytes), _bytes(c.host_memory_bytes * self.ranks_per_node),
                         f"{c.d2h_seconds:.3g}", f"{c.network_seconds:.3g}", f"{c.compute_seconds:.3g}", fcr,
                         "yes" if c.hides else "NO"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        p, hw = self.parallel, self.hardware
        lines.insert(0, f"world {self.world_size} = tp {p.tp} x pp {p.pp} x cp {p.cp} x dp {p.dp} on {self.nodes} "
                        f"{hw.name} node(s); {self.versions} versions; distributed optimizer "
                        f"{'on' if p.distributed_optimizer else 'off'}; grad accum {p.grad_accum}")
        if moe:
            lines.append(f"experts {self.model.num_moe_experts} top-{self.model.moe_router_topk}: ep {p.ep} x etp "
                            f"{p.expert_tp}; rings: dense over dp x cp = {p.shard_factor} ranks, expert over "
                            f"expert-dp = {p.expert_dp} ranks")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON/YAML."""
        return {
            "model": dataclasses.asdict(self.model),
            "parallel": dataclasses.asdict(self.parallel),
            "hardware": dataclasses.asdict(self.hardware),
            "versions": self.versions,
            "world_size": self.world_size,
            "nodes": self.nodes,
            "rings": self.rings,
            "classes": [c.to_dict() for c in self.classes],
            "warnings": list(self.warnings),
        }


def _si(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"


def _bytes(n: float) -> str:
    return _si(n) + "B"


def _stage_kinds(pp: int) -> list[tuple[str, list[int]]]:
    if pp == 1:
        return [("all", [0])]
    kinds = [("first", [0])]
    if pp > 2:
        kinds.append(("middle", list(range(1, pp - 1))))
    return kinds + [("last", [pp - 1])]


def plan_job(model: ModelShape, parallel: Parallelism, hw: Hardware, *, versions: int = 2,
             optimizer: Literal["adam", "sgd"] = "adam", master_dtype_bytes: int = 4, param_dtype_bytes: int = 2,
             extras_bytes: int | None = None) -> JobPlan:
    """Plan the per-iteration neighbor snapshot of every kind of rank (see the module docstring).

    Args:
        model, parallel, hw: what is trained, how it is split, on what.
        versions: snapshot versions kept per rank (own and replica alike).
        optimizer: ``adam`` (2 fp32 states per parameter) or ``sgd`` (momentum: 1).
        master_dtype_bytes: bytes of the optimizer's master copy of a parameter (fp32: 4).
        param_dtype_bytes: bytes of a model weight as trained (bf16: 2); lazy backups only.
        extras_bytes: small per-rank state per snapshot (``store.extras_capacity_mb``); None: the store's smallest
            extras region, :data:`~neighbor_ckpt.snapshot.store.MIN_EXTRAS_BYTES`. 0 leaves it out of the transfer
            times; the host memory always budgets the region the store allocates.

    Raises:
        ConfigError: one line per bad argument, or per way the model does not split over ``parallel``.
    """
    problems = Problems()
    args = problems.at("plan_job")
    args.integer("versions", versions)
    args.integer("master_dtype_bytes", master_dtype_bytes)
    args.integer("param_dtype_bytes", param_dtype_bytes)
    if extras_bytes is not None:
        args.integer("extras_bytes", extras_bytes, minimum=0)
    args.one_of("optimizer", optimizer, OPTIMIZER_STATE_BYTES)
    p = parallel
    layout = problems.at("Parallelism")
    model.check_split(layout, p.tp, p.pp, p.ep, p.etp)
    layout.check(p.cp == 1 or model.seq_length % (2 * p.cp) == 0, "cp",
                 f"{p.cp} needs ModelShape.seq_length = {model.seq_length} divisible by 2 x cp")
    problems.raise_if_any()
    extras = MIN_EXTRAS_BYTES if extras_bytes is None else extras_bytes
    per_stage = model.dense_and_expert_params_per_stage(p.tp, p.pp, p.ep, p.etp)
    groups = {"dense": p.shard_factor, "expert": p.expert_dp}
    # a token's expert work: topk experts, each split over etp x (its tokens gathered over the TP ranks): per rank
    # 6 * tokens * topk * (one whole expert) / tp, with one whole expert = local experts' params * ep * etp / E
    active_expert = (model.moe_router_topk * p.ep * p.expert_tp / (model.num_moe_experts * p.tp)
                     if model.is_moe else 0.0)
    tokens = p.micro_batch_size * p.grad_accum * model.seq_length / p.cp
    flops = hw.gpu_tflops * 1e12 * hw.mfu
    pcie = hw.pcie_gbytes_per_s * 1e9
    nic = hw.nic_gbits_per_s * 1e9 / 8

    classes = []
    for kind, stages in _stage_kinds(p.pp):
        dense, expert = max(per_stage[s] for s in stages)  # middle stages are identical
        params = dense + expert
        unique_by: dict[str, int] = {}
        lazy = 0
        for part, count in (("dense", dense), ("expert", expert)):
            shard = groups[part]  # the razor's DP size for this part: the group its optimizer state is sharded over
            held = -(-count // shard) if p.distributed_optimizer else count  # the optimizer's params on this rank
            state_bytes = {StateKind.WEIGHT: param_dtype_bytes * count,
                           StateKind.MAIN_PARAM: master_dtype_bytes * held,
                           StateKind.OPTIMIZER: OPTIMIZER_STATE_BYTES[optimizer] * held}
            by = {d: 0 for d in Disposition}
            for state, nbytes in state_bytes.items():
                by[disposition(state, dp_size=shard, distributed_optimizer=p.distributed_optimizer)] += nbytes
            unique_by[part], lazy = by[Disposition.UNIQUE], lazy + by[Disposition.LAZY]
        staged_kind = disposition(StateKind.BUFFER, dp_size=p.shard_factor,
                                  distributed_optimizer=p.distributed_optimizer)
        staged = 4 * model.expert_bias_per_stage(p.pp) if staged_kind is Disposition.STAGED else 0
        payload = unique_by["dense"] + unique_by["expert"] + staged
        unique = payload + extras
        active = dense + expert * active_expert
        classes.append(RankClassPlan(
            kind=kind, stages=len(stages), ranks=len(stages) * p.tp * p.cp * p.dp, params_per_rank=params,
            dense_params_per_rank=dense, expert_params_per_rank=expert, unique_payload_bytes=payload,
            dense_unique_bytes=unique_by["dense"], expert_unique_bytes=unique_by["expert"], staged_bytes=staged,
            extras_bytes=extras, lazy_backup_bytes=lazy,
            host_memory_bytes=store_bytes_per_rank(unique_bytes=payload, lazy_bytes=lazy, versions=versions,
                                                   extras_bytes=extras_bytes),
            d2h_seconds=unique / pcie, network_seconds=unique / nic, compute_seconds=6 * active * tokens / flops))

    plan_warnings = []
    ranks_per_node = min(hw.gpus_per_node, p.world_size)
    for c in classes:
        per_node = c.host_memory_bytes * ranks_per_node
        if per_node > hw.host_memory_gb * 1e9:
            plan_warnings.append(f"{c.kind} stage: host store needs {_bytes(per_node)} per node "
                                 f"({ranks_per_node} ranks x {_bytes(c.host_memory_bytes)}), more than the node's "
                                 f"{hw.host_memory_gb:g} GB of memory")
        elif per_node > hw.shm_gb * 1e9:
            plan_warnings.append(f"{c.kind} stage: host store needs {_bytes(per_node)} per node, more than "
                                 f"/dev/shm ({hw.shm_gb:g} GB): enlarge /dev/shm or keep fewer versions")
        if not c.hides:
            bottleneck = "device-to-host copy" if c.d2h_seconds >= c.network_seconds else "network"
            plan_warnings.append(f"{c.kind} stage: FCR {c.fcr:.2f} < 1, the snapshot ({_bytes(c.unique_bytes)}) "
                                 f"takes longer than one iteration's compute ({c.compute_seconds:.3g} s; bottleneck: "
                                 f"{bottleneck}); more DP, larger batches or longer sequences raise FCR")
    plan = JobPlan(model=model, parallel=parallel, hardware=hw, versions=versions, classes=tuple(classes),
                   warnings=tuple(plan_warnings))
    for w in plan.warnings:
        log.debug("plan: %s", w)
    return plan
