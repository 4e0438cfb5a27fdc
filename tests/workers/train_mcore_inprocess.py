"""Test worker: the plain megatron-core loop (``recipes/mcore_gpt_plain_loop.py``'s tiny GPT, DistributedOptimizer)
under in-process recovery with hot spares (:mod:`neighbor_ckpt.inprocess`).

One process per rank, ``active + SPARES`` processes (our launcher, one per simulated node). Heavy
imports happen once, at process start (spares included); everything that holds a process group is built again in
each attempt of the wrapped function: the gloo group, megatron-core's parallel state, model, DDP,
DistributedOptimizer, scheduler (all by the recipe's ``build_gpt``) and NeighborCheckpointer. Survivors find their own
host slots; the spare (its own store root, like a fresh node) pulls the lost rank's state from the ring successor.

On a failure the checkpointer is closed with ``close(success=False)`` (host slots kept) by the engine's clean-ups,
i.e. *after* the abort: closed from the exception handler, before the abort, its transport would send a close
message to the successor and wait up to 30 s for its receiver thread, blocked on a predecessor that is still
training (an exception on one rank) until the abort frees it.

Environment: OUT_DIR, TEST_STORE_BASE (each process's store root is ``TEST_STORE_BASE/<node>``, the node being the
launcher's ``NEIGHBOR_CKPT_NODE_ID``: a replacement process gets a new index but runs on its launcher's node), SPARES,
STEPS, NEIGHBOR_CKPT_JOB_ID (fixed for the launch: every attempt shares the host stores), FAULT
(kill|raise|stop|block|gil|stop_launcher|none), KILL_RANK (a rank, or ranks separated by commas), KILL_STEP (first
attempt only, inside the optimizer step of KILL_STEP: SIGKILL, a RuntimeError, SIGSTOP, the training thread blocked in
a C call while the heartbeat goes on, the main thread holding the GIL for HOLD_GIL_S seconds (default 4) and then
going on, or its launcher SIGSTOPped while the training thread waits in a C call), HANG_TIMEOUT (``detector.hang_timeout_s``, default 3 s; interval 0.2 s and timeout 2 s as the
CPU job files), RECOVERY_KILL_RANK (SIGKILL of that rank in the first in-process attempt, while it loads the restored
state: failpoint ``recovery.load``, before the attempt completes a step; with RECOVERY_KILL_NODE=1 its node's launcher
first: the whole node), PERMANENT (1: a SIGKILLed rank's node is
gone, its launcher is killed too), KILL_NODE (1: a killed rank SIGKILLs its node's launcher first, and with it every
process of its node and the store host it runs: a whole node lost), LEAK_THREAD_RANK (that rank leaks a thread in generation 0: the hygiene check
after the failed generation must catch it), BLOCK_CLEANUP_RANK (that rank's clean-up after the failed generation 0
blocks in a C call), KILL_IDLE_SPARE_AT_STEP (every idle spare SIGKILLs itself once rank 0 logged that step), KILL2_RANK and
KILL2_STEP (a second fault: that rank SIGKILLed in that step of generation 1, once a spare is up), ECHO_PORT (a TCP connection to the test's echo server opened before the
first attempt, used in every attempt: ``echo.initial<i>.iter<k>.json``), TP (tensor parallel size, default 1),
GLOBAL_BATCH (samples per step, fixed whatever the data-parallel size; default 2 x 2 x the initial DP), DROPOUT
(default 0.1), ELASTIC (1: ``neighbor_ckpt.elastic.enabled``: without a spare the survivors continue on a smaller
data-parallel size), KEEP_OLD (1: after an elastic reshard each survivor copies the previous layout's store to
``OUT/oldstore/<node>`` before training on, for the test's reference resharding).

Outputs under OUT_DIR (``rank`` is the attempt's rank, ``initial`` the rank the process started as):
``losses.rank<r>.jsonl`` (step, loss over the global batch as hex, attempt = restart iteration, pid, consumed samples
before the step, data-parallel size), ``resharded.rank<r>.npz`` + ``resharded.rank<r>.json`` (after an elastic
reshard: this rank's optimizer shards as loaded, and their spans), ``final.rank<r>.json``
(fingerprints, as tests/workers/train_mcore.py's recipe writes them), ``attempt.initial<i>.iter<k>.json``
(pid and its start time, rank, node, times of this attempt's phases), ``events.initial<i>.json`` (every event of
the process, its exit status, the process it replaces),
``fault.json`` (when the fault was injected; ``fault.rank<r>.json`` per faulty rank), ``report.rank<r>.attempt<k>.json``
(recovery report), ``reports/recovery_timeline.attempt<launch>[.<k>].json`` (rank 0's recovery timeline).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

INITIAL_RANK = int(os.environ["RANK"])  # the process index: a replacement's is new (>= WORLD_SIZE)
# The simulated node is the launcher's (a replacement process runs on its launcher's node, under a new index).
NODE = os.environ.get("NEIGHBOR_CKPT_NODE_ID") or f"node{INITIAL_RANK}"
os.environ["NEIGHBOR_CKPT_STORE_DIR"] = str(Path(os.environ["TEST_STORE_BASE"]) / NODE)
os.environ["NEIGHBOR_CKPT_NODE_ID"] = NODE
OUT = Path(os.environ["OUT_DIR"])
MBS, N_MB = 2, 2

logging.basicConfig(level=logging.INFO, format=f"[init{INITIAL_RANK}] %(asctime)s %(name)s %(levelname)s %(message)s")
T_START = time.time()
if os.environ.get("INPROCESS_DEBUG"):
    logging.getLogger("neighbor_ckpt.inprocess").setLevel(logging.DEBUG)

# -- heavy imports, once per process ------------------------------------------------------------------------------
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_patches import enable_cpu  # noqa: E402

enable_cpu(nemo=False)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

from megatron_patches import install_hooks, mcore_groups  # noqa: E402
from megatron_patches.step_tags import tag_optimizer_steps  # noqa: E402
from neighbor_ckpt import NeighborCkptConfig  # noqa: E402
from neighbor_ckpt.adapters.megatron import MegatronOptimizerAdapter  # noqa: E402
from neighbor_ckpt.checkpointer import NeighborCheckpointer  # noqa: E402
from neighbor_ckpt.inprocess import InprocessRecovery  # noqa: E402
from neighbor_ckpt.inprocess.engine_state import Attempt  # noqa: E402
from neighbor_ckpt.runtime import failpoints  # noqa: E402
from neighbor_ckpt.runtime.procs import process_start  # noqa: E402

PID_START = process_start()
"""This process's start time (with the pid, its identity: the harness checks that no process outlives the launch)."""

_spec = importlib.util.spec_from_file_location(
    "mcore_gpt_plain_loop", Path(__file__).resolve().parents[2] / "recipes" / "mcore_gpt_plain_loop.py")
assert _spec is not None and _spec.loader is not None  # noqa: S101 - the file is in this repository
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)  # the recipe's GPT (build_gpt) and its final fingerprints
# the recipe builds megatron-core's pieces with imports inside build_gpt: import them now, not in an attempt
import megatron.core.distributed, megatron.core.models.gpt.gpt_layer_specs  # noqa: E401,E402,F401
import megatron.core.optimizer, megatron.core.optimizer_param_scheduler, megatron.core.transformer  # noqa: E401,E402,F401
SEQ, VOCAB = recipe.SEQ, recipe.VOCAB
T_IMPORTED = time.time()
STEPS = int(os.environ.get("STEPS", "10"))
TP = int(os.environ.get("TP", "1"))
ACTIVE = int(os.environ["WORLD_SIZE"]) - int(os.environ.get("SPARES", "1"))
GLOBAL_BATCH = int(os.environ.get("GLOBAL_BATCH") or MBS * N_MB * (ACTIVE // TP))
LAUNCH_ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # launcher-level restarts (the fallback)
FAULT = os.environ.get("FAULT", "none")
KILL_RANKS = {int(r) for r in os.environ.get("KILL_RANK", "-1").split(",")}
KILL_STEP = int(os.environ.get("KILL_STEP", "-1"))
RECOVERY_KILL_RANK = int(os.environ.get("RECOVERY_KILL_RANK", "-1"))
log = logging.getLogger("train_mcore_inprocess")


def _launch_suffix() -> str:
    """File-name part for a launcher-level restart (the fallback): ``.launch<N>`` from the first restart on."""
    return f".launch{LAUNCH_ATTEMPT}" if LAUNCH_ATTEMPT else ""


def write_json(name: str, obj: Any) -> None:
    tmp = OUT / f".{name}.tmp"
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, OUT / name)



def make_config() -> NeighborCkptConfig:
    cfg = NeighborCkptConfig()  # job id and store root from NEIGHBOR_CKPT_JOB_ID / NEIGHBOR_CKPT_STORE_DIR
    cfg.inprocess.enabled = True  # the engine's monitor is the failure detector, on the detector's timers
    cfg.inprocess.spares = int(os.environ.get("SPARES", "1"))
    cfg.elastic.enabled = os.environ.get("ELASTIC") == "1"
    cfg.report.dir = str(OUT / "reports")
    # the CPU job files' detector timers (a tiny GPT step is ~0.1 s; a loaded 2-core machine stalls for ~1 s)
    cfg.detector.interval_s, cfg.detector.timeout_s = 0.2, float(os.environ.get("DETECTOR_TIMEOUT", "2.0"))
    cfg.detector.hang_timeout_s = float(os.environ.get("HANG_TIMEOUT", "3.0"))
    cfg.inprocess.barrier_timeout_s, cfg.inprocess.abort_timeout_s = 120.0, 10.0  # the CPU job files'
    return cfg


inproc = InprocessRecovery.from_config(make_config(),
                                       model_parallel=TP, batch_micro_batches=GLOBAL_BATCH // MBS)


def inject_fault(rank: int, att: Attempt) -> None:
    rec = {"launch_attempt": LAUNCH_ATTEMPT, "rank": rank, "initial_rank": INITIAL_RANK, "step": KILL_STEP,
           "kind": FAULT, "unix": time.time(), "pid": os.getpid(), "pid_start": PID_START}
    write_json(f"fault.rank{rank}.json", rec)
    if rank == min(KILL_RANKS):
        write_json("fault.json", rec)
    for h in logging.getLogger().handlers:
        h.flush()
    if FAULT == "kill":
        log.warning("fault injection: SIGKILL of rank %d inside the optimizer step of step %d", rank, KILL_STEP)
        if os.environ.get("STORE_NODE") == "1" or os.environ.get("KILL_NODE") == "1":
            # the whole node: its launcher (and with it the store host it runs and every process of the node: they
            # die with it), then this rank
            launcher = int(os.environ["NEIGHBOR_CKPT_INPROCESS_LAUNCHER"])
            log.warning("fault injection: the node is gone: SIGKILL of its launcher (pid %d), which hosts store %s",
                        launcher, os.environ.get("NEIGHBOR_CKPT_INPROCESS_STORE_HOSTED"))
            for h in logging.getLogger().handlers:
                h.flush()
            os.kill(launcher, signal.SIGKILL)
        if os.environ.get("PERMANENT") == "1":
            from neighbor_ckpt.runtime.failpoints import lose_node

            lose_node()
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "stop":
        log.warning("fault injection: SIGSTOP of rank %d inside the optimizer step of step %d", rank, KILL_STEP)
        if os.environ.get("KILL_NODE") == "1":  # the whole node hangs: its launcher first, then this rank
            launcher = int(os.environ["NEIGHBOR_CKPT_INPROCESS_LAUNCHER"])
            log.warning("fault injection: the node hangs: SIGSTOP of its launcher (pid %d)", launcher)
            for h in logging.getLogger().handlers:
                h.flush()
            os.kill(launcher, signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)  # its watcher finds it silent; its launcher kills it
        time.sleep(3600)
    if FAULT == "gil":
        # The main thread in a call that holds the GIL (a model rebuild on a loaded machine): every other Python
        # thread of the process, its heartbeat included, is starved for HOLD_GIL_S seconds; then training goes on.
        import ctypes

        hold = float(os.environ.get("HOLD_GIL_S", "4"))
        log.warning("fault injection: rank %d's main thread holds the GIL for %g s inside the optimizer step of step "
                    "%d", rank, hold, KILL_STEP)
        for h in logging.getLogger().handlers:
            h.flush()
        t0 = time.monotonic()
        ctypes.PyDLL(None).usleep(int(hold * 1e6))  # PyDLL: the GIL is held through the call
        log.warning("fault injection: rank %d held the GIL for %.2f s; training goes on", rank, time.monotonic() - t0)
        return
    if FAULT == "stop_launcher":
        # The node's launcher hangs (SIGSTOP), its process does not: its training thread waits in a C call (the GIL
        # released, its heartbeat beating on) until the others have found the node lost and it is fenced.
        import ctypes

        launcher = int(os.environ["NEIGHBOR_CKPT_INPROCESS_LAUNCHER"])
        log.warning("fault injection: SIGSTOP of rank %d's launcher (pid %d) inside the optimizer step of step %d",
                    rank, launcher, KILL_STEP)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(launcher, signal.SIGSTOP)
        ctypes.CDLL(None).sleep(3600)
    if FAULT == "block":
        # The training thread stuck in a C call (no Python, the GIL released) while the monitor thread beats on.
        log.warning("fault injection: rank %d's training thread blocked in a C call inside the optimizer step of "
                    "step %d", rank, KILL_STEP)
        for h in logging.getLogger().handlers:
            h.flush()
        import ctypes

        ctypes.CDLL(None).sleep(3600)
    log.warning("fault injection: RuntimeError on rank %d inside the optimizer step of step %d", rank, KILL_STEP)
    raise RuntimeError(f"injected fault on rank {rank} at step {KILL_STEP}")


def hold_until_released(rank: int) -> None:
    """Every active rank waits here (``HOLD_AT_STEP``, first generation of the first launch) until the file
    ``HOLD_FILE`` exists, having written ``held.rank<r>.json`` (its pid): a test does something to the running launch
    meanwhile (its heartbeats go on; set ``HANG_TIMEOUT`` above the wait). Bounded: 600 s."""
    write_json(f"held.rank{rank}.json", {"rank": rank, "pid": os.getpid(), "unix": time.time()})
    log.info("rank %d holds before step %s until %s exists", rank, os.environ["HOLD_AT_STEP"], os.environ["HOLD_FILE"])
    deadline = time.monotonic() + 600
    while not Path(os.environ["HOLD_FILE"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def stop_store_host(rank: int) -> None:
    """SIGSTOP the store host this process's launcher runs (the primary), SIGCONT it ``STOP_STORE_FOR`` seconds
    later (default 15): the job fails over to the next store meanwhile, and the resumed host must stay unused."""
    import subprocess

    pid = int(os.environ["NEIGHBOR_CKPT_INPROCESS_STORE_HOST_PID"])
    stop_for = float(os.environ.get("STOP_STORE_FOR", "15"))
    write_json("fault.json", {"rank": rank, "initial_rank": INITIAL_RANK, "kind": "stop_store", "pid": pid,
                              "step": int(os.environ["STOP_STORE_AT_STEP"]), "unix": time.time()})
    log.warning("fault injection: SIGSTOP of the store host (pid %d) for %g s, inside rank %d's optimizer step",
                pid, stop_for, rank)
    os.kill(pid, signal.SIGSTOP)
    # resumed by a process of its own (a thread here would fail this process's hygiene check after the failover)
    subprocess.Popen(["sh", "-c", f"sleep {stop_for}; kill -CONT {pid}; echo 'fault injection: SIGCONT of the store "
                                  f"host (pid {pid})' >&2"], start_new_session=True)


def block_in_cleanup() -> None:
    """A clean-up that never returns (blocked in a C call): the engine must declare this process dead."""
    import ctypes

    log.warning("fault injection: the clean-up of process %d blocks in a C call", INITIAL_RANK)
    for h in logging.getLogger().handlers:
        h.flush()
    ctypes.CDLL(None).sleep(3600)


def train(att: Attempt) -> dict[str, Any]:
    rank, world = att.rank, att.world_size
    times: dict[str, float] = {"enter": time.time()}
    write_json(f"attempt.initial{INITIAL_RANK}.iter{att.iteration}{_launch_suffix()}.json",
               {"pid": os.getpid(), "pid_start": PID_START, "rank": rank, "world_size": world,
                "initial_rank": INITIAL_RANK, "node": NODE, "iteration": att.iteration, "times": times})
    inproc.init_process_group()
    times["pg_ready"] = time.time()
    gpt = recipe.build_gpt(tp=TP, steps=STEPS, micro_batch_size=MBS,  # parallel state, model, optimizer
                           global_batch=GLOBAL_BATCH, dropout=float(os.environ.get("DROPOUT", "0.1")))
    ddp_model, optimizer, scheduler = gpt.model, gpt.optimizer, gpt.scheduler
    global_batch = gpt.global_batch
    times["built"] = time.time()

    groups = mcore_groups()
    ckpt = NeighborCheckpointer(make_config(), adapter=MegatronOptimizerAdapter([ddp_model], optimizer),
                                dp_group=groups.dp_group, model_parallel_coord=groups.coord, handle_sigterm=False,
                                attempt=inproc.attempt_info(), global_batch=GLOBAL_BATCH, micro_batch_size=MBS)
    # Closed after the abort if this attempt fails (the abort frees its streaming threads first); slots stay.
    inproc.on_restart(lambda: ckpt.close(success=False))
    armed = FAULT in ("kill", "raise", "stop", "block", "gil", "stop_launcher") and att.iteration == 0 and LAUNCH_ATTEMPT == 0 and rank in KILL_RANKS

    stop_store = (os.environ.get("STOP_STORE_AT_STEP") is not None and att.iteration == 0 and LAUNCH_ATTEMPT == 0
                  and os.environ.get("NEIGHBOR_CKPT_INPROCESS_STORE_HOSTED") == "0")
    second = (os.environ.get("KILL2_STEP") is not None and att.iteration == 1 and LAUNCH_ATTEMPT == 0
              and rank == int(os.environ.get("KILL2_RANK", "-1")))
    hold = os.environ.get("HOLD_AT_STEP") is not None and att.iteration == 0 and LAUNCH_ATTEMPT == 0

    def maybe_fault() -> None:
        if hold and ckpt.last_iteration is not None and ckpt.last_iteration + 1 == int(os.environ["HOLD_AT_STEP"]):
            hold_until_released(rank)
        if armed and ckpt.last_iteration is not None and ckpt.last_iteration + 1 == KILL_STEP:
            inject_fault(rank, att)
        if stop_store and ckpt.last_iteration is not None and ckpt.last_iteration + 1 == int(os.environ["STOP_STORE_AT_STEP"]):
            stop_store_host(rank)
        if second and ckpt.last_iteration is not None and ckpt.last_iteration + 1 == int(os.environ["KILL2_STEP"]):
            # the second fault waits for a spare to be up (a replacement that grew back): the test is about it
            deadline = time.monotonic() + 300
            while not inproc.idle_spares() and time.monotonic() < deadline:
                time.sleep(0.1)
            log.warning("fault injection: second fault, SIGKILL of rank %d in step %s (idle spares: %s)", rank,
                        os.environ["KILL2_STEP"], inproc.idle_spares())
            write_json(f"fault2.rank{rank}.json", {"rank": rank, "initial_rank": INITIAL_RANK, "unix": time.time(),
                                                  "step": int(os.environ["KILL2_STEP"])})
            for h in logging.getLogger().handlers:
                h.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    fault_tag = tag_optimizer_steps(optimizer, on_enter=maybe_fault, on_exit=lambda: None)  # inside the step tag
    inproc.on_restart(fault_tag.remove)
    hooks = install_hooks(ckpt, optimizer)
    inproc.on_restart(hooks.remove)
    if att.iteration == 0 and rank == int(os.environ.get("BLOCK_CLEANUP_RANK", "-1")):
        inproc.on_restart(block_in_cleanup)
    times["ckpt_ready"] = time.time()
    if att.iteration == 1 and LAUNCH_ATTEMPT == 0 and rank == RECOVERY_KILL_RANK:
        log.warning("fault injection: SIGKILL of rank %d while it loads the restored state (in-process attempt 1)",
                    rank)
        if os.environ.get("RECOVERY_KILL_NODE") == "1":  # its node whole: the launcher first, then this rank
            def lose_node_and_die() -> None:
                failpoints.lose_node()
                os.kill(os.getpid(), signal.SIGKILL)

            failpoints.arm("recovery.load", lose_node_and_die)
        else:
            failpoints.arm("recovery.load", failpoints.kill_self())
    result = ckpt.recover()
    times["recovered"] = time.time()
    echo_check(att)
    if att.iteration == 0 and rank == int(os.environ.get("LEAK_THREAD_RANK", "-1")):
        import threading

        log.warning("fault injection: rank %d leaks a thread (the hygiene check must catch it)", rank)
        threading.Thread(target=time.sleep, args=(3600,), name="leaked-by-the-test", daemon=True).start()
    consumed = 0
    if result.restored:
        scheduler.load_state_dict(result.user_state["scheduler"])
        consumed = result.user_state["consumed_samples"]
    write_json(f"report.rank{rank}.attempt{att.iteration}{_launch_suffix()}.json", result.report.to_dict())
    if result.report.resharded:
        dump_resharded(ckpt, rank)

    def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):  # noqa: ANN202
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(output_tensor: torch.Tensor):  # noqa: ANN202
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # mcore divides the loss in place

        return output, loss_func

    forward_backward = get_forward_backward_func()
    first = True
    try:
        for step in range(result.next_step, STEPS):
            ddp_model.zero_grad_buffer()
            optimizer.zero_grad()
            losses = forward_backward(forward_step_func=forward_step,
                                      data_iterator=recipe.sample_batches(gpt, consumed), model=[ddp_model],
                                      num_microbatches=gpt.n_mb, seq_length=SEQ, micro_batch_size=MBS,
                                      decoder_seq_length=SEQ, forward_only=False)
            loss = recipe.global_loss(gpt, losses)
            if first:
                times["first_forward_backward"] = time.time()
            step_consumed = consumed
            ok, _, _ = optimizer.step()
            if first:
                times["first_optimizer_step"] = time.time()
            if not ok:
                raise RuntimeError(f"optimizer step {step} was skipped (non-finite gradients)")
            scheduler.step(increment=global_batch)
            consumed += global_batch
            ckpt.snapshot(step, user_state={"scheduler": scheduler.state_dict(), "consumed_samples": consumed})
            with open(OUT / f"losses.rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.hex(), "attempt": att.iteration,
                                    "launch_attempt": LAUNCH_ATTEMPT, "pid": os.getpid(),
                                    "initial_rank": INITIAL_RANK, "unix": time.time(),
                                    "consumed_samples": step_consumed, "dp": gpt.dp_size}) + "\n")
            if first:
                first = False
                inproc.mark_progress()
                times["first_step_end"] = time.time()
                write_json(f"attempt.initial{INITIAL_RANK}.iter{att.iteration}{_launch_suffix()}.json",
                           {"pid": os.getpid(), "pid_start": PID_START, "rank": rank, "world_size": world,
                            "initial_rank": INITIAL_RANK, "node": NODE, "iteration": att.iteration, "times": times,
                            "recovery": result.report.to_dict()})
    except BaseException as e:
        ckpt.on_failure(f"{type(e).__name__}: {e}")  # the failure event for the timeline; never raises
        raise
    hooks.remove()
    fault_tag.remove()
    ckpt.close(success=True)
    write_json(f"final.rank{rank}.json", recipe.fingerprints(gpt))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return {"rank": rank}


def dump_resharded(ckpt: NeighborCheckpointer, rank: int) -> None:
    """After an elastic reshard: this rank's optimizer shards as loaded into megatron-core (read back from the live
    optimizer) with their spans, and (KEEP_OLD) a copy of the previous layout's store on this node, which the
    checkpointer releases once the new layout has a complete snapshot."""
    import shutil

    import numpy as np

    spans = ckpt.adapter.dp_shards() or {}
    live = {m.name: t for m, t in ckpt.adapter.named_tensors() if m.name in spans}
    np.savez(OUT / f"resharded.rank{rank}.npz", **{n: t.detach().cpu().numpy() for n, t in live.items()})
    write_json(f"resharded.rank{rank}.json", {"spans": {n: list(v) for n, v in spans.items()},
                                             "coord": list(ckpt.topology.model_parallel_coord),
                                             "report": ckpt.last_report.to_dict() if ckpt.last_report else None})
    if os.environ.get("KEEP_OLD") == "1":
        src = ckpt.store.job_dir
        dst = OUT / "oldstore" / NODE
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(f"g{ckpt.generations.generation}"),
                        dirs_exist_ok=True)


ECHO: Any = None
"""ECHO_PORT: a TCP connection to the test's echo server, opened before the first attempt (the scoped abort must
leave it alone)."""


def echo_check(att: Attempt) -> None:
    """Send one line through the connection opened before the first attempt; record that it came back."""
    if ECHO is None:
        return
    msg = f"process {INITIAL_RANK} generation {att.iteration}\n".encode()
    ECHO.sendall(msg)
    got = b""
    while not got.endswith(b"\n"):
        chunk = ECHO.recv(256)
        if not chunk:
            break
        got += chunk
    write_json(f"echo.initial{INITIAL_RANK}.iter{att.iteration}.json", {"sent": msg.decode(), "got": got.decode()})


def kill_idle_spare_at(step: int) -> None:
    """This idle spare SIGKILLs itself once rank 0 has logged ``step`` (first launch, generation 0 only)."""
    import threading

    def watch() -> None:
        losses = OUT / "losses.rank0.jsonl"
        while True:
            lines = losses.read_text().splitlines() if losses.exists() else []
            if any(line.endswith("}") and json.loads(line)["step"] >= step for line in lines):
                break
            time.sleep(0.05)
        if os.environ.get("KILL_IDLE_SPARE_WHEN_STAGED"):  # ...and once its staged slot is there (bounded wait)
            staged = f"*/*/staged-{os.getpid()}.own.slot"
            deadline = time.monotonic() + 120
            while not any(Path(os.environ["NEIGHBOR_CKPT_STORE_DIR"]).glob(staged)) and time.monotonic() < deadline:
                time.sleep(0.05)
        if inproc.current is None and LAUNCH_ATTEMPT == 0:
            write_json(f"fault.spare{INITIAL_RANK}.json", {"initial_rank": INITIAL_RANK, "step": step,
                                                           "unix": time.time(), "pid": os.getpid()})
            log.warning("fault injection: SIGKILL of idle spare process %d after rank 0's step %d", INITIAL_RANK,
                        step)
            for h in logging.getLogger().handlers:
                h.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="test-kill-idle-spare", daemon=True).start()


def wait_for_completion() -> None:
    """A replacement that is still starting when the job completes (its imports on a loaded machine, as in a fault
    campaign's case): it reaches the engine only once its launcher wrote the completion marker."""
    marker = Path(os.environ["NEIGHBOR_CKPT_INPROCESS_COMPLETE_FILE"])
    log.info("replacement process %d: waiting for the job to complete (%s) before it starts", INITIAL_RANK, marker)
    deadline = time.monotonic() + 600
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    write_json(f"late_start.{INITIAL_RANK}.json", {"unix": time.time(), "marker": marker.exists()})


def main() -> int:
    global ECHO
    OUT.mkdir(parents=True, exist_ok=True)
    if os.environ.get("ECHO_PORT"):
        import socket

        ECHO = socket.create_connection(("127.0.0.1", int(os.environ["ECHO_PORT"])))
    log.info("process %d started as rank %d on %s; imports took %.2fs", os.getpid(), INITIAL_RANK, NODE,
             T_IMPORTED - T_START)
    if os.environ.get("KILL_IDLE_SPARE_AT_STEP") and INITIAL_RANK >= inproc.active_world_size:
        kill_idle_spare_at(int(os.environ["KILL_IDLE_SPARE_AT_STEP"]))
    if os.environ.get("REPLACEMENT_WAITS_FOR_COMPLETION") == "1" and os.environ.get(
            "NEIGHBOR_CKPT_INPROCESS_REPLACES") is not None:
        wait_for_completion()
    code = 0
    try:
        ret = inproc.run(train)
        log.info("done: %s", "spare, never used" if ret is None else f"rank {ret['rank']}")
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        write_json(f"events.initial{INITIAL_RANK}{_launch_suffix()}.json",
                   {"pid": os.getpid(), "pid_start": PID_START, "start": T_START, "imported": T_IMPORTED,
                    "process": INITIAL_RANK, "launch": LAUNCH_ATTEMPT, "node": NODE, "replaces": os.environ.get("NEIGHBOR_CKPT_INPROCESS_REPLACES"),
                    "code": code, "events": inproc.events})
        log.info("process %d leaves with status %d", INITIAL_RANK, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
