"""Failure and goodput arithmetic: what failures cost, and how often the in-memory copies cannot save us.

Pure functions (stdlib + math only). The equations were reconstructed from the prose and tables of the
seed papers (their formulas did not survive text extraction); each function says exactly what it computes.

Goodput (FlashRecovery §II eq. 1-4, FFTrainer §3.1 "relative MFU loss")
    FlashRecovery: over a training period ``d`` with ``m`` failures, recovery overhead ``s0`` (the MTTR),
    recomputation ``s1 ~ t/2`` ("under the assumption that failures occur uniformly at random, this cost
    can be approximated as t/2") and a blocking checkpoint cost ``k0`` every interval ``t``::

        F(t)  = m * (s0 + t/2) + (d/t) * k0              (1)
        t*    = sqrt(2 * d * k0 / m)                     (3)
        Fmin  = m * s0 + sqrt(2 * d * k0 * m)            (4)

    With ``m = d / MTBF_cluster`` the lost fraction is ``F/d = k0/t + (t/2 + s0) / MTBF_cluster``, which
    is FFTrainer's "sum of losses from three resources" (checkpoint overhead, rollback, recovery), and
    ``t* = sqrt(2 * k0 * MTBF_cluster)`` (Young's formula). FFTrainer Table 2's MFU-loss column
    (0.19 / 0.10 / 0.06 / 0.05 at a cluster MTBF of 3 / 6 / 9 / 12 h) is reproduced by ``t`` = 30 min,
    ``k0`` = 0 and an MTTR of 20 min (see the unit tests).

Failure probabilities (FFTrainer §3.1 Table 2, §6.2 eq. 3-5, §7.3 Table 6)
    * a cluster of ``G`` GPUs, each with MTBF ``M`` hours, sees at least one failure within ``T`` hours with
      probability ``1 - exp(-G*T/M)`` (Table 2's failure-probability columns: 16,384 GPUs and 65,536 GPUs
      at M = 80,000 h, the paper printing 0.99 for anything above; only ``G/M`` matters, so the second
      column fits 16,384 GPUs at M = 20,000 h equally well; see :func:`p_cluster_failure`);
    * a node of ``g`` GPUs fails within ``T`` hours with ``p = 1 - exp(-g*T/M)``, and exactly ``k`` of
      ``N`` nodes fail with ``C(N,k) p^k (1-p)^(N-k)`` (eq. 4, :func:`p_k_node_failures`);
    * given exactly ``k`` random failed nodes, the in-memory state is lost when the failed set contains a
      rank together with its ring successor (eq. 3; :func:`p_unrecoverable`), which also covers "all workers
      of a DP group fail";
    * the probability of recovering from host memory within ``T`` hours is
      ``sum_k P(k failures) * (1 - p_unrecoverable(k))`` (eq. 5, :func:`p_recovery`).

Topology assumed by :func:`p_unrecoverable` (the "ring-of-nodes" model)
    There is one DP ring per model-parallel coordinate (TP x PP; under megatron-core the ring runs over the
    data-parallel-with-context-parallel group, as in ``megatron_patches/groups.py``). A ring's members sit
    on ``L = ring_nodes`` distinct nodes and the ring visits those nodes in a fixed cyclic order, so a
    member's successor is on the *next* node of that cycle. Every node belongs to exactly one such cycle
    (all rings through a node see the same cycle), so the ``N`` nodes split into ``N/L`` disjoint node
    cycles. A set of failed nodes is unrecoverable iff it contains two cycle-adjacent nodes (for ``L = 2``:
    both nodes of a pair; for ``L = 1``: the ring lives on one node, so any failure of that node loses it).

    FFTrainer's eq. 3 is the special case of one ring over all servers (``ring_nodes = nodes``); Gemini's
    group placement with two replicas is ``ring_nodes = 2``. The ``dp`` argument is the ring's member count
    (DP x CP under megatron-core). With TP filling whole nodes every member has its own node and
    ``ring_nodes = dp``; :func:`ring_nodes_for` derives ``L`` from TP/CP/DP. When a ring holds
    several members per node and spans three or more nodes, the model assumes the members are dealt
    round-robin over the nodes (n0 n1 n2 n0 n1 n2 ...); an ordering that links more node pairs loses state
    more often than computed here.

Inputs are checked with :class:`~neighbor_ckpt.validation.Problems`: every bad argument of a call is one line
(``interval_s: 0 must be a positive finite number``) of one :class:`~neighbor_ckpt.errors.ConfigError`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from neighbor_ckpt.validation import Problems

__all__ = [
    "LossBreakdown",
    "cluster_mtbf",
    "loss_breakdown",
    "goodput_loss",
    "mfu_loss",
    "optimal_interval",
    "min_goodput_loss",
    "p_cluster_failure",
    "node_failure_probability",
    "p_k_node_failures",
    "ring_nodes_for",
    "p_unrecoverable",
    "monte_carlo_p_unrecoverable",
    "p_recovery",
]

def _check_cluster(p: Problems, node_mtbf_s: float, nodes: int) -> None:
    p.positive("node_mtbf_s", node_mtbf_s)
    p.integer("nodes", nodes)


# -- goodput -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class LossBreakdown:
    """Fractions of wall-clock time lost to failures and checkpointing (first-order model, valid while the
    total is well below 1; it is not clamped)."""

    checkpoint: float
    """``overhead_s / interval_s``: time the training is blocked by taking checkpoints."""

    rollback: float
    """``rollback_s / MTBF_cluster``: work redone after each failure (half an interval by default)."""

    restart: float
    """``mttr_s / MTBF_cluster``: detection, restart and state loading after each failure."""

    @property
    def total(self) -> float:
        """The lost fraction: FFTrainer's relative MFU loss, FlashRecovery's ``F(t) / d``."""
        return self.checkpoint + self.rollback + self.restart


def cluster_mtbf(node_mtbf_s: float, nodes: int = 1) -> float:
    """MTBF of a job that stops whenever any of ``nodes`` independent nodes fails: ``node_mtbf_s / nodes``."""
    p = Problems()
    _check_cluster(p, node_mtbf_s, nodes)
    p.raise_if_any()
    return node_mtbf_s / nodes


def loss_breakdown(*, interval_s: float, overhead_s: float, mttr_s: float, node_mtbf_s: float, nodes: int = 1,
                   rollback_s: float | None = None) -> LossBreakdown:
    """The three losses of FlashRecovery eq. 1 divided by the period ``d``.

    ``F(t)/d = k0/t + (s1 + s0)/MTBF`` with ``k0 = overhead_s``, ``t = interval_s``, ``s0 = mttr_s``,
    ``s1 = rollback_s`` (default ``t/2``) and ``MTBF = node_mtbf_s / nodes``. For per-iteration neighbor
    checkpoints pass the iteration time as ``interval_s`` and the non-hidden part of the snapshot as
    ``overhead_s``.
    """
    p = Problems()
    p.positive("interval_s", interval_s)
    p.non_negative("overhead_s", overhead_s)
    p.non_negative("mttr_s", mttr_s)
    if rollback_s is not None:
        p.non_negative("rollback_s", rollback_s)
    _check_cluster(p, node_mtbf_s, nodes)
    p.raise_if_any()
    s1 = interval_s / 2 if rollback_s is None else rollback_s
    mtbf = node_mtbf_s / nodes
    return LossBreakdown(checkpoint=overhead_s / interval_s, rollback=s1 / mtbf, restart=mttr_s / mtbf)


def goodput_loss(*, interval_s: float, overhead_s: float, mttr_s: float, node_mtbf_s: float, nodes: int = 1,
                 rollback_s: float | None = None) -> float:
    """Fraction of time lost (``loss_breakdown(...).total``); goodput is ``1 -`` this."""
    return loss_breakdown(interval_s=interval_s, overhead_s=overhead_s, mttr_s=mttr_s, node_mtbf_s=node_mtbf_s,
                          nodes=nodes, rollback_s=rollback_s).total


mfu_loss = goodput_loss
"""FFTrainer's name for the same quantity ("relative MFU loss", §3.1)."""


def optimal_interval(*, overhead_s: float, node_mtbf_s: float, nodes: int = 1) -> float:
    """FlashRecovery eq. 3, ``t* = sqrt(2 * d * k0 / m)``, with ``m = d / MTBF``: ``sqrt(2 * k0 * MTBF)``.

    Returns 0 when the checkpoint costs nothing: checkpoint as often as possible (every iteration).
    """
    p = Problems()
    p.non_negative("overhead_s", overhead_s)
    _check_cluster(p, node_mtbf_s, nodes)
    p.raise_if_any()
    return math.sqrt(2.0 * overhead_s * (node_mtbf_s / nodes))


def min_goodput_loss(*, overhead_s: float, mttr_s: float, node_mtbf_s: float, nodes: int = 1) -> float:
    """FlashRecovery eq. 4 divided by ``d``: ``s0/MTBF + sqrt(2 * k0 / MTBF)``, the loss at ``t*``."""
    p = Problems()
    p.non_negative("overhead_s", overhead_s)
    p.non_negative("mttr_s", mttr_s)
    _check_cluster(p, node_mtbf_s, nodes)
    p.raise_if_any()
    mtbf = node_mtbf_s / nodes
    return mttr_s / mtbf + math.sqrt(2.0 * overhead_s / mtbf)


# -- failure probabilities ---------------------------------------------------------------------------------


def p_cluster_failure(*, gpus: int, hours: float, gpu_mtbf_hours: float) -> float:
    """Probability that at least one of ``gpus`` GPUs (exponential lifetimes) fails within ``hours``:
    ``1 - exp(-gpus * hours / gpu_mtbf_hours)`` (FFTrainer Table 2)."""
    return _p_any_gpu_fails("gpus", gpus, hours, gpu_mtbf_hours)


def _check_lifetimes(p: Problems, hours: float, gpu_mtbf_hours: float) -> None:
    p.non_negative("hours", hours)
    p.positive("gpu_mtbf_hours", gpu_mtbf_hours)


def node_failure_probability(*, hours: float, gpu_mtbf_hours: float, gpus_per_node: int = 8) -> float:
    """Probability that a node with ``gpus_per_node`` GPUs loses one within ``hours``:
    ``1 - exp(-g * hours / gpu_mtbf_hours)`` (FFTrainer §6.2, the ``p`` of eq. 4)."""
    return _p_any_gpu_fails("gpus_per_node", gpus_per_node, hours, gpu_mtbf_hours)


def _p_any_gpu_fails(name: str, gpus: int, hours: float, gpu_mtbf_hours: float) -> float:
    """``1 - exp(-gpus * hours / gpu_mtbf_hours)``, its inputs checked (``name``: what the caller calls ``gpus``)."""
    p = Problems()
    p.integer(name, gpus)
    _check_lifetimes(p, hours, gpu_mtbf_hours)
    p.raise_if_any()
    return -math.expm1(-gpus * hours / gpu_mtbf_hours)


def _log_binomial_pmf(n: int, k: int, p: float) -> float:
    if p <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if k == n else -math.inf
    log_comb = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    return log_comb + k * math.log(p) + (n - k) * math.log1p(-p)


def p_k_node_failures(nodes: int, k: int, p_node: float) -> float:
    """FFTrainer eq. 4: exactly ``k`` of ``nodes`` independent nodes fail, ``C(N,k) p^k (1-p)^(N-k)``."""
    p = Problems()
    p.integer("nodes", nodes)
    p.integer("k", k, 0)
    p.check(isinstance(p_node, (int, float)) and not isinstance(p_node, bool) and 0.0 <= p_node <= 1.0, "p_node",
            f"{p_node!r} must be a probability in [0, 1]")
    p.raise_if_any()
    if k > nodes:
        return 0.0
    return math.exp(_log_binomial_pmf(nodes, k, float(p_node)))


def ring_nodes_for(*, tp: int, cp: int, dp: int, gpus_per_node: int) -> int:
    """Nodes spanned by one DP ring under megatron-core's rank order (TP fastest, then CP, then DP).

    The ring is the data-parallel-with-context-parallel group: ``cp * dp`` members, ``tp`` ranks apart.
    With ``tp`` a multiple of ``gpus_per_node`` every member is on its own node (``L = cp * dp``); with
    ``gpus_per_node`` a multiple of ``tp`` each node holds ``gpus_per_node / tp`` consecutive members.
    """
    p = Problems()
    for name, value in (("tp", tp), ("cp", cp), ("dp", dp), ("gpus_per_node", gpus_per_node)):
        p.integer(name, value)
    p.raise_if_any()
    g, members = gpus_per_node, cp * dp
    if tp % g == 0:
        return members
    p.check(g % tp == 0, "tp", f"{tp} neither divides nor is a multiple of gpus_per_node = {g}: the DP rings do not "
            "tile the nodes")
    p.raise_if_any()
    per_node = g // tp
    if members <= per_node:
        return 1
    p.check(members % per_node == 0, "dp", f"a DP ring of cp x dp = {members} members does not fill whole nodes of "
            f"{per_node} members (gpus_per_node = {g}, tp = {tp})")
    p.raise_if_any()
    return members // per_node


def _ring_nodes(p: Problems, nodes: int, dp: int, ring_nodes: int | None) -> int:
    """Check ``nodes``, ``dp`` and ``ring_nodes`` into ``p``; the cycle length ``L`` (1 when ``p`` got a problem)."""
    p.integer("nodes", nodes)
    p.integer("dp", dp)
    if ring_nodes is not None:
        p.integer("ring_nodes", ring_nodes)
    if not p.ok("nodes", "dp", "ring_nodes"):
        return 1
    length = min(dp, nodes) if ring_nodes is None else ring_nodes
    p.check(length <= dp, "ring_nodes", f"{length} exceeds dp = {dp}: a ring of dp members spans at most dp nodes")
    p.check(nodes % length == 0, "ring_nodes", f"{length} does not divide nodes = {nodes}: the node cycles must tile "
            "the nodes")
    return length


def _failed_nodes(p: Problems, nodes: int, k: int) -> None:
    p.integer("k", k, 0)
    if p.ok("k", "nodes"):
        p.check(k <= nodes, "k", f"{k} failed nodes exceeds nodes = {nodes}")


def _safe_subsets_of_cycle(length: int, upto: int) -> list[int]:
    """``a[j]``: j-subsets of a node cycle of ``length`` with no two cycle-adjacent nodes (j <= upto).

    Cycle: ``length/(length-j) * C(length-j, j) = length/j * C(length-j-1, j-1)`` (Kaplansky). Length 2 is
    a pair (either node alone is safe); length 1 is a ring living on one node (no failure is safe).
    """
    a = [1] + [0] * upto
    if length >= 2:
        for j in range(1, min(upto, length // 2) + 1):
            a[j] = length * math.comb(length - j - 1, j - 1) // j
    return a


def _poly_mul(x: list[int], y: list[int], upto: int) -> list[int]:
    out = [0] * (upto + 1)
    for i, xi in enumerate(x):
        if xi:
            for j in range(upto + 1 - i):
                out[i + j] += xi * y[j]
    return out


def _safe_subset_counts(nodes: int, length: int, upto: int) -> list[int]:
    """Coefficients of ``g(x)^(nodes/length)`` up to ``x^upto``: safe failure sets of every size."""
    result = [1] + [0] * upto
    base = _safe_subsets_of_cycle(length, upto)
    e = nodes // length
    while e:
        if e & 1:
            result = _poly_mul(result, base, upto)
        e >>= 1
        if e:
            base = _poly_mul(base, base, upto)
    return result


def p_unrecoverable(nodes: int, dp: int, k: int, *, ring_nodes: int | None = None) -> float:
    """Probability that ``k`` simultaneous, uniformly random node failures lose some rank's state.

    State is lost when a failed node holds a rank whose ring successor is on a failed node too (FFTrainer
    §4.2 corner case 2; corner case 1, a whole DP group failing, implies it). Closed form, under the
    ring-of-nodes model of this module's docstring (``nodes/L`` disjoint node cycles of length
    ``L = ring_nodes``, default ``min(dp, nodes)``, i.e. one ring member per node)::

        p = 1 - [x^k] g_L(x)^(N/L) / C(N, k)
        g_L(x) = sum_j a_L(j) x^j,  a_L(j) = L/(L-j) * C(L-j, j)  (L >= 2; j-subsets of an L-cycle
                                                                    with no two adjacent nodes)
        g_1(x) = 1

    For a single ring over all servers (``dp = ring_nodes = nodes``) this is FFTrainer's eq. 3:
    ``1 - N/(N-k) * C(N-k, k) / C(N, k)``; for ``k = 2`` it is ``2/(N-1)``. Computed with exact integers.
    """
    p = Problems()
    length = _ring_nodes(p, nodes, dp, ring_nodes)
    _failed_nodes(p, nodes, k)
    p.raise_if_any()
    if k == 0:
        return 0.0
    total = math.comb(nodes, k)
    safe = _safe_subset_counts(nodes, length, k)[k]
    return (total - safe) / total


def monte_carlo_p_unrecoverable(nodes: int, dp: int, k: int, *, ring_nodes: int | None = None,
                                trials: int = 100_000, seed: int = 0) -> float:
    """Monte Carlo estimate of :func:`p_unrecoverable`: draw ``k`` distinct failed nodes, ``trials`` times.

    Node ``n`` is position ``n % L`` of cycle ``n // L``; its successor is the next position of that cycle.
    """
    p = Problems()
    length = _ring_nodes(p, nodes, dp, ring_nodes)
    _failed_nodes(p, nodes, k)
    p.integer("trials", trials)
    p.raise_if_any()
    rng = random.Random(seed)
    population = range(nodes)
    lost = 0
    for _ in range(trials):
        failed = set(rng.sample(population, k))
        if any((n - n % length) + (n % length + 1) % length in failed for n in failed):
            lost += 1
    return lost / trials


def p_recovery(nodes: int, dp: int, *, hours: float, gpu_mtbf_hours: float, ring_nodes: int | None = None,
               gpus_per_node: int = 8, tail: float = 1e-13) -> float:
    """FFTrainer eq. 5: probability that every failure within ``hours`` is recoverable from host memory,
    ``sum_k P(k of N nodes fail) * (1 - p_unrecoverable(N, dp, k))`` with ``P`` from eq. 4 and
    ``p = node_failure_probability(...)``.

    The sum stops once the remaining binomial mass is below ``tail``; that remainder counts as lost
    (so the result is a lower bound, off by at most ``tail``).

    Against FFTrainer Table 6 (800-2,000 machines, 3 h and 12 h, GPU MTBF 80,000 h): Gemini's columns
    (``ring_nodes=2``) are reproduced within 0.01 points; FFTrainer's own columns are 0.15-0.21 points
    *lower* than this model at 12 h (99.74 printed vs 99.885 here at 800 machines) and are matched within
    0.01 points only if each scenario is also multiplied by ``(1-p)^2`` (the failed node's two neighbours
    surviving, counted a second time). We keep the model as the paper describes it; see the unit tests.
    """
    problems = Problems()
    length = _ring_nodes(problems, nodes, dp, ring_nodes)
    problems.integer("gpus_per_node", gpus_per_node)
    _check_lifetimes(problems, hours, gpu_mtbf_hours)
    problems.raise_if_any()
    n = nodes
    p = node_failure_probability(hours=hours, gpu_mtbf_hours=gpu_mtbf_hours, gpus_per_node=gpus_per_node)
    pmf: list[float] = []
    mass = 0.0
    for k in range(n + 1):
        pmf.append(math.exp(_log_binomial_pmf(n, k, p)))
        mass += pmf[-1]
        if mass >= 1.0 - tail and k >= n * p:
            break
    kmax = len(pmf) - 1
    safe = _safe_subset_counts(n, length, kmax)
    return sum(pk * (safe[k] / math.comb(n, k)) for k, pk in enumerate(pmf))
