"""The contract between our in-process engine, its per-node launchers and the store: key names, environment
variables and exit statuses. No logic: every party imports its names from here.

**Processes.** A launch starts ``N = active + spares`` *processes*, numbered ``0..N-1`` (the *process index*, stable
for the process's life; ``RANK`` as the launcher sets it). One launcher per (simulated) node starts its share
(:mod:`neighbor_ckpt.inprocess.launcher`). Ranks are assigned per generation (:mod:`neighbor_ckpt.inprocess.
assignment`): processes ``0..active-1`` start as ranks ``0..active-1``, the others are idle hot spares.

**Store.** One TCP store at a time, on a node's store host (:mod:`neighbor_ckpt.inprocess.store_host`): the primary,
then after a failover the next standby, where every process and launcher writes its part again
(:mod:`neighbor_ckpt.inprocess.stores`). Every key below lives
under :func:`launch_prefix` (the job's run id and the launcher-level restart count, so a restarted launch never meets
an old launch's keys). Values are plain text (ASCII, decimal integers, comma-separated lists, JSON objects of plain
types): nothing read from the store is unpickled.

``proc/<p>``
    JSON ``{"pid", "node", "start"}``, written by process ``p`` when its engine starts (who it is, where it runs).
``hb/<p>``
    Heartbeat of process ``p`` (its monitor thread): ``"<beat> <generation> <counter> <iteration> <phase>"``; the
    progress tag ``(counter, iteration, phase)`` is the training thread's (``-``/``None`` fields when idle).
``dead``
    Append-only, ``"<p>:<reason>;"`` per entry: processes declared dead, by their launcher (the process exited) or by
    a detector (silent, hung). A process that finds itself here exits at once with :data:`EXIT_FENCED`; its launcher
    SIGKILLs any of its processes listed here.
``gen``
    The current generation number (decimal), advanced by whoever completes a generation's barrier.
``gen/<g>/arrived``
    Append-only ``"<p>,"`` per process that joined generation ``g``'s barrier.
``gen/<g>/members``
    The canonical outcome of generation ``g``'s barrier (first ``compare_set`` wins): JSON ``{"members": [...],
    "progressed": bool, "hangs": int}`` (the processes in it; whether generation ``g - 1`` completed a step; how many
    generations so far failed on a hang with every rank's tag equal).
``gen/<g>/failed``
    Why generation ``g`` failed (first ``compare_set`` wins): JSON ``{"by", "kind", "ranks", "reason", "unix"}``;
    ``kind`` in :data:`FAILURE_KINDS`. Every process's monitor waits on this key (the push of a failure).
``gen/<g>/faults``
    Append-only ``"<unix> <what>;"`` per witness of generation ``g``'s fault: a launcher that saw its process exit, a
    monitor that found a peer silent (its last heartbeat) or a rank stuck (its last progress), a process whose own
    training function raised. The earliest is when the fault happened; the recovery timeline's *detect* starts there.
``gen/<g>/holds/<p>``
    With ``elastic.enabled``: which snapshots process ``p``'s node holds, written before it joins generation ``g``
    (JSON ``[store generation, world size, data-parallel size, [[old rank, iteration], ...]]``, its newest store
    generation with a committed snapshot): a shrink keeps survivors whose nodes hold a complete version between them
    (:mod:`neighbor_ckpt.inprocess.holdings`).
``gen/<g>/listen/<p>``
    The gloo listeners of process ``p``'s groups in generation ``g`` (``"host:port,..."``, published once its groups
    exist): a survivor's abort shuts down its own side of connections to them too (a peer that is stopped or stuck
    never closes its side, :mod:`neighbor_ckpt.inprocess.abort`).
``gen/<g>/reach/<p>``
    The processes whose gloo listeners process ``p`` could not reach once every rank of generation ``g`` stalled
    alike (``"1,3"``, ``"-"`` for none): a process a majority cannot reach is blamed for the hang
    (:mod:`neighbor_ckpt.inprocess.reachability`).
``gen/<g>/finished``
    Append-only ``"<p>,"`` per active rank whose training function returned in generation ``g`` (a list, so that a
    rank writes it again on a new store after a failover without counting twice).
``progress/<g>``
    Set once generation ``g`` completed a training step (its first).
``complete``
    Set when the job completed (every active rank of one generation returned): idle spares and launchers stop.
``giveup``
    Why in-process recovery gave up (first ``compare_set`` wins): every process exits with
    :data:`EXIT_FALLBACK`; the launchers restart the job (launcher-level restart count + 1).
``launcher/<node>``
    JSON ``{"pid", "processes": [...]}`` of node ``node``'s launcher (rewritten when it starts a replacement).
``lhb/<node>``
    Heartbeat of node ``node``'s launcher, several times per ``detector.timeout_s``: ``"<beat> run=<p>,... held=<p>:
    <T|D>:<seconds>,..."``, a counter, then its processes as the kernel shows them: those it vouches running, those
    stopped or in an uninterruptible sleep and for how long (:mod:`neighbor_ckpt.inprocess.kernel_liveness`). A
    monitor whose ring predecessor is silent reads it: a process vouched running is not declared; on another node, a
    launcher silent too means the node is lost, and every process of that node is declared dead in the same decision;
    a launcher silent for twice ``detector.timeout_s`` costs its node even while its processes beat
    (:mod:`neighbor_ckpt.inprocess.monitor`).
``processes``
    How many process indices the launch has handed out (indices ``0..processes-1``): every launcher, before it
    starts anything, does ``compare_set("processes", "", str(N))`` (the first one sets ``N``, the others find it
    set); it is only ever raised. A launcher starting a replacement (:data:`EXIT_HYGIENE`, ``grow_back``) claims
    the next free ``index/<i>`` (``compare_set`` from empty to its write id) and raises ``processes`` past it.
``exited``
    Append-only ``"<p>,"`` per process that exited (any status), by its launcher; read as a set. When every index
    handed out is in it and ``complete`` is not set, no process of the launch is left: a launcher that sees it sets
    ``giveup``.
``vote/<k>``
    Outside the launch prefix, on store ``k`` (next to the epoch key): append-only ``"<node>,"`` per launcher that
    lost store ``k - 1`` and votes to promote store ``k``; the vote that makes a majority of the nodes promotes it
    (:mod:`~neighbor_ckpt.inprocess.stores`).
``nodes``, ``joined``
    Append-only ``"<node>,"`` per launcher that started this launcher-level attempt, and per launcher that joined its
    restart rendezvous (read as sets). A launcher restarting the job waits, under the next attempt's prefix, until
    every node of the launch joined or is lost, and restarts only with a majority of them
    (:mod:`~neighbor_ckpt.inprocess.restart_rendezvous`).
``joined/<node>``
    JSON list of the process indices node ``node``'s launcher restarts, written before its node is appended to
    ``joined`` (the processes no joined launcher restarts are lost with the nodes that did not join).

No count is kept with ``add``: a store operation that went unanswered is sent again, and a launcher writes its facts
again on a new store after a failover, so every count is a set of writer ids or a claim by a write id
(:mod:`neighbor_ckpt.inprocess.launch_counts`): a write applied twice counts once.
"""

from __future__ import annotations

__all__ = ["EXIT_NO_STORE", "EXIT_FALLBACK", "EXIT_FENCED", "EXIT_HYGIENE", "EXIT_ABORT_HUNG", "EXIT_CUT_OFF",
           "FAILURE_KINDS", "ENV_STORE", "ENV_STORE_TOKEN", "ENV_STORE_EPOCH", "ENV_STORE_HOSTED", "ENV_STORE_HOST_PID",
           "ENV_NODE_INDEX", "ENV_COMPLETE_FILE", "ENV_RUN_ID", "ENV_LAUNCHER", "ENV_PROCESS", "ENV_PROCESSES",
           "ENV_SPARES", "ENV_REPLACES", "launch_prefix", "key"]

EXIT_NO_STORE = 68
"""A launcher that reached no store of the launch at its start (EX_NOHOST): it started nothing; the other launchers'
roll call declares its processes dead (:mod:`~neighbor_ckpt.inprocess.roll_call`)."""
EXIT_FALLBACK = 75
"""Every process, when in-process recovery gives up (EX_TEMPFAIL): the launchers restart the job."""
EXIT_FENCED = 76
"""A process that found itself declared dead (a stopped process that resumed, a stale generation)."""
EXIT_HYGIENE = 77
"""A process whose state after a failed generation is not clean (leaked threads, memory): its launcher starts a new
process in its place, which joins as a spare."""
EXIT_ABORT_HUNG = 78
"""A process whose NCCL abort itself hung (the abort watchdog ended it)."""
EXIT_CUT_OFF = 79
"""A process or launcher that could not see a majority of the launch (a network partition left it on the minority
side, :mod:`~neighbor_ckpt.inprocess.quorum`): it stopped without writing anything more. Final: its launcher neither
restarts nor replaces it."""

FAILURE_KINDS = ("exception", "exited", "silent", "hung", "hang_all", "launcher", "store")
"""``exception``: the training function raised on a rank; ``exited``: a launcher saw its process exit;
``silent``: no heartbeat within ``detector.timeout_s`` (a stopped rank, a lost node); ``hung``: a rank whose
progress tag lags while its heartbeat goes on (stuck in a collective or a C call): it is killed and replaced;
``hang_all``: no progress on any rank, every tag equal: the same ranks re-form once; ``launcher``: a launcher's own
report (a process it could not start); ``store``: the store stopped answering and the processes moved to the next
standby (:mod:`~neighbor_ckpt.inprocess.stores`)."""

ENV_STORE = "NEIGHBOR_CKPT_INPROCESS_STORE"
"""``host:port[,host:port...]``: the launch's stores in order, the primary first, then one hot standby per node
(every process and launcher; :mod:`~neighbor_ckpt.inprocess.stores`)."""
ENV_STORE_TOKEN = "NEIGHBOR_CKPT_INPROCESS_STORE_TOKEN"
"""The *path* of the launch's store token file (:mod:`~neighbor_ckpt.inprocess.store_auth`; never the token)."""
ENV_STORE_EPOCH = "NEIGHBOR_CKPT_INPROCESS_STORE_EPOCH"
"""The index of the store in use when a launcher started the process (a replacement started after a failover)."""
ENV_STORE_HOST_PID = "NEIGHBOR_CKPT_INPROCESS_STORE_HOST_PID"
"""The pid of the store host this process's launcher runs, if any (fault injection stops or kills it)."""
ENV_STORE_HOSTED = "NEIGHBOR_CKPT_INPROCESS_STORE_HOSTED"
"""The index of the store this process's node hosts (its launcher's store host), if any: fault injection's
``store_node`` target."""
ENV_NODE_INDEX = "NEIGHBOR_CKPT_INPROCESS_NODE_INDEX"
"""The index of this process's node among the launch's nodes (the store it hosts: node ``i`` hosts store ``i``):
fault injection's ``node`` target."""
ENV_COMPLETE_FILE = "NEIGHBOR_CKPT_INPROCESS_COMPLETE_FILE"
"""The path of the launch's completion marker (:mod:`~neighbor_ckpt.inprocess.completion`): written by every launcher
once the job completed; a process that finds it when it starts has nothing to do and exits 0 without a store."""
ENV_RUN_ID = "NEIGHBOR_CKPT_INPROCESS_RUN"
"""The launch's run id (the store namespace)."""
ENV_LAUNCHER = "NEIGHBOR_CKPT_INPROCESS_LAUNCHER"
"""Set by our launcher in every process it starts (its pid): in-process recovery is refused without it."""
ENV_PROCESS = "RANK"
"""The process index (= the initial rank)."""
ENV_PROCESSES = "WORLD_SIZE"
"""Processes of the launch, spares included (the engine rewrites ``RANK``/``WORLD_SIZE`` per generation)."""
ENV_SPARES = "NEIGHBOR_CKPT_INPROCESS_SPARES"
"""How many of the processes are hot spares (the last ones)."""
ENV_REPLACES = "NEIGHBOR_CKPT_INPROCESS_REPLACES"
"""Set by a launcher in a replacement process only (one started after an :data:`EXIT_HYGIENE`): the index of the
process it replaces. Its own index (``RANK``) is new, ``>= WORLD_SIZE``; it joins as a spare."""


def launch_prefix(run_id: str, launch: int) -> str:
    """Every key of one launcher-level attempt of a launch lives under this prefix (a ``PrefixStore`` adds the
    ``/``)."""
    return f"neighbor_ckpt/inprocess/{run_id}/{launch}"


def key(*parts: object) -> str:
    """A key relative to :func:`launch_prefix`: ``key("gen", 3, "failed") == "gen/3/failed"``."""
    return "/".join(str(p) for p in parts)
