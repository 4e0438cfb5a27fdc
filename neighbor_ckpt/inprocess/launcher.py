"""The per-node launcher of in-process recovery: starts this node's share of a launch's processes and supervises them.

One launcher per (simulated) node::

    python -m neighbor_ckpt.inprocess.launcher --store HOST:PORT --run-id ID --node NODE \\
        --first P --count K --processes N --spares S --max-restarts R [--nodes M] [--store-root DIR] \\
        [--no-python] -- PROGRAM ARGS...

It starts processes ``P..P+K-1`` of the launch's ``N`` (the last ``S`` of the ``N`` are hot spares) as
``python -u PROGRAM ARGS`` (``--no-python``: ``PROGRAM ARGS`` is the whole command, e.g. a profiler or the test
suite's warm-fork client in front of the interpreter), each with ``RANK=p``, ``WORLD_SIZE=N``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE=K``, the store, run id, launcher pid and spare count of :mod:`~neighbor_ckpt.inprocess.protocol`,
``TORCHELASTIC_RESTART_COUNT`` (the launcher-level attempt), ``TORCHELASTIC_RUN_ID`` (the run id),
``NEIGHBOR_CKPT_NODE_ID=NODE``, ``NEIGHBOR_CKPT_STORE_DIR=DIR/NODE`` (with ``--store-root``) and
``TORCH_CPP_LOG_LEVEL=error`` (:func:`child_env`).

**What it does with an exit** (:func:`classify_exit`), polling every ``--poll`` seconds:

* 0: nothing (the process is waited for; the job ends with ``complete``);
* :data:`~protocol.EXIT_FENCED`, or a process already listed in ``dead`` (this launcher killed it because a detector
  listed it, or it exited after being listed): nothing more, it is declared already;
* :data:`~protocol.EXIT_FALLBACK`: the job gives up in-process recovery: the launcher-level restart below;
* :data:`~protocol.EXIT_CUT_OFF` (cut off from the majority): declared dead like any exit, but final: no replacement;
* anything else (a signal, an error, :data:`~protocol.EXIT_HYGIENE`, :data:`~protocol.EXIT_ABORT_HUNG`): the
  launcher declares the process dead: it appends ``"<p>:exited: <how>;"`` to ``dead`` and records the current
  generation's failure (``gen/<g>/failed``, kind ``exited``, first ``compare_set`` wins), the push every survivor
  waits for. After :data:`~protocol.EXIT_HYGIENE` it also starts a *replacement*, which joins as a spare: a new
  process index (:func:`~neighbor_ckpt.inprocess.launch_counts.claim_index`), the same local rank, ``ENV_REPLACES``.

**Liveness from the kernel** (:mod:`~neighbor_ckpt.inprocess.kernel_liveness`): a process stopped, or in ``D``
without CPU time, for ``--detector-timeout`` seconds is SIGKILLed and declared dead like an exit; each beat vouches.

It also reads ``dead`` every tick and SIGKILLs any process of its own listed there (a detector found it silent or
hung; SIGKILL ends a SIGSTOPped process too), and the process whose pid the engine wrote under ``proc/<p>`` when that
is another one on this node (the test suite's warm fork), identified by its start time.

**Restart** (the fallback): when ``giveup`` is set or a process exits 75, the launcher waits ``--fallback-grace``
seconds for its processes to exit, SIGKILLs what is left, and, below ``--max-restarts``, meets the other launchers
under the next attempt's prefix (``joined``: each appends its node and waits until every node is there, at most
``--rendezvous-timeout`` seconds) and starts its ``K`` processes again (the original indices) with
``TORCHELASTIC_RESTART_COUNT`` + 1. When no process of the launch is left (every index handed out is listed in
``exited``) without ``complete``, the launcher that sees it sets ``giveup`` itself. A node lost for good (its
launcher silent, its processes declared dead) is not waited for: the restart goes on without it when the spares or
``--elastic`` allow, else every launcher says so in one line and exits 1 at once
(:mod:`~neighbor_ckpt.inprocess.restart_rendezvous`).

**A store host that cannot start** (its port held by another process, say): the launcher says so in one line (the
node, the store, the port, the cause), declares its processes dead before they start (``dead`` and the current
generation's failure: the spares take their ranks in the first re-form; counted in ``exited``) and stays in the
launch without them (restarts, completion), so no barrier waits for them. A single-machine launch binds the stores'
ports itself and hands each launcher its socket (``--listen-fd``), so this happens only where store hosts bind their
own ports (a cluster).

**Completion**: once ``complete`` is set the launcher writes the completion marker (``--complete-file``,
:mod:`~neighbor_ckpt.inprocess.completion`), starts no replacement, and stops a process of its node that was in no
generation then (a replacement still starting) after ``--detector-timeout`` seconds, unless it exits on its own (a
process that starts after completion finds the marker and exits 0 without a store). Once its processes exited it
says it leaves (``left``); the launcher hosting the store in use waits for every other one to (:data:`HOST_LINGER_S`).

**Exit status**: 0 once ``complete`` is set and its processes have exited (they get ``--complete-grace`` seconds,
then are stopped); :data:`~protocol.EXIT_FALLBACK` when in-process recovery gave up and the restarts are used up;
:data:`EXIT_STORE_LOST` when the store has not answered for ``--store-grace`` seconds (it reaps, queues its writes
and reconnects meanwhile); :data:`~protocol.EXIT_NO_STORE` when it can connect to no store at the start (the others'
roll call declares its processes dead: :mod:`~neighbor_ckpt.inprocess.roll_call`); 1 when the first store operation
fails, the restart's rendezvous times out, or the roll call leaves too few processes for the job's ranks; ``128 +
signal`` when stopped by SIGTERM/SIGINT/SIGHUP; :data:`~protocol.EXIT_CUT_OFF` when it saw no majority of the launchers'
beats for its lease (:mod:`~neighbor_ckpt.inprocess.quorum`; its processes SIGKILLed first), or no majority of the
launchers joined its restart. One line each.

**No process outlives it.** Each process starts in a session of its own (its process group is what the launcher
signals, so what the process started goes with it) with ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: SIGKILL of the launcher
kills its processes, which is how a test loses a node. On its own way out the launcher SIGTERMs what is left and
SIGKILLs it after ``--grace`` seconds. (What a process started in a session of its own is not reached when the
launcher is SIGKILLed; torchrun does no better.)

Why plain :class:`subprocess.Popen` and not torch.distributed.elastic's pieces:
:mod:`~neighbor_ckpt.inprocess.launcher_children`.

The pure decisions (:mod:`~neighbor_ckpt.inprocess.launcher_plan`: :class:`LauncherPlan` from argv,
:func:`child_env`, :func:`classify_exit`; :func:`parse_dead` from :mod:`~neighbor_ckpt.inprocess.generation`) are
apart from the loop (:class:`Launcher`) and tested in one process (``tests/unit/test_inprocess_launcher.py``); the
loop with toy programs and a real store host (``tests/multiproc/test_inprocess_launcher.py``).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from neighbor_ckpt.inprocess import protocol
from neighbor_ckpt.inprocess.completion import mark_complete, marked
from neighbor_ckpt.inprocess.exit_clock import ExitClock
from neighbor_ckpt.inprocess.generation import Fault, GenerationStore, parse_dead
from neighbor_ckpt.inprocess.kernel_liveness import ChildrenInKernel
from neighbor_ckpt.inprocess.launcher_children import child_setup as _child_setup
from neighbor_ckpt.inprocess.launcher_children import drop_staged, recorded_pid_to_kill
from neighbor_ckpt.inprocess.launcher_children import signal_group as _signal_group
from neighbor_ckpt.inprocess.launch_counts import claim_index, everyone_exited, mark_exited, raise_processes
from neighbor_ckpt.inprocess.launcher_plan import (Action, LauncherPlan, child_command, child_env, classify_exit,
                                                   describe_exit, exit_status, parse_args)
from neighbor_ckpt.inprocess.protocol import key
from neighbor_ckpt.inprocess.quorum import LauncherLease
from neighbor_ckpt.inprocess.restart_rendezvous import RestartRendezvous
from neighbor_ckpt.inprocess.roll_call import RollCall, reach_any, unreached_stores
from neighbor_ckpt.runtime.procs import python_module_command

__all__ = ["Launcher", "main", "EXIT_STORE_LOST", "EXIT_LAUNCHER_ERROR"]

logger = logging.getLogger(__name__)

EXIT_STORE_LOST = 69
"""The launcher's status when the store stopped answering for ``--store-grace`` seconds (EX_UNAVAILABLE)."""
EXIT_LAUNCHER_ERROR = 1
"""The launcher's status when its first store operation failed, the restart's rendezvous timed out, or the roll call
left too few processes for the job's ranks."""

HOST_LINGER_S = 2.0
"""At most how long the host of the store in use waits, once the job completed, for the others to leave (``left``)."""


# --- the loop --------------------------------------------------------------------------------------------------


class StoreDown(Exception):
    """The store did not answer."""


class _Outcome(enum.Enum):
    COMPLETE = "complete"
    GIVEUP = "giveup"
    STORE_LOST = "store lost"
    SIGNALED = "signaled"


@dataclass
class _Child:
    index: int
    local_rank: int
    proc: subprocess.Popen
    replaces: Optional[int] = None
    killed: Optional[str] = None
    """Why this launcher SIGKILLed it (listed in ``dead``), if it did."""


@dataclass
class _Attempt:
    number: int
    children: dict[int, _Child] = field(default_factory=dict)
    dead: dict[int, str] = field(default_factory=dict)
    giveup: Optional[str] = None
    complete_at: Optional[float] = None
    replacements: int = 0
    regrow: list[tuple[_Child, str, int]] = field(default_factory=list)
    """Dead processes to replace (``grow_back``): the child, how it exited, the generation current at its death."""
    worst: int = 0
    """The worst status of a process that exited on its own (not stopped by this launcher)."""
    exited: set[int] = field(default_factory=set)
    """Processes this launcher listed in ``exited`` in this attempt (its own that exited, and those of a launcher
    that never came: :mod:`~neighbor_ckpt.inprocess.roll_call`)."""
    started: set[int] = field(default_factory=set)
    """Every process index this node started in this attempt (``processes`` covers them)."""
    unjoined: set[int] = field(default_factory=set)
    """Once the job completed: the processes of this node that were in no generation then (stopped after
    ``detector.timeout_s`` unless they exit on their own)."""


def _current_members(gens: GenerationStore) -> frozenset[int]:
    """The processes of the current generation (none before generation 0 formed)."""
    members = gens.members(gens.current())
    return frozenset() if members is None else members.members


def _last_generation_with(gens: GenerationStore, process: int) -> int:
    """The last generation that may hold ``process`` (which just died): the current one, or the one before when the
    current one formed without it (the survivors can re-form before this launcher reaps the death)."""
    g = gens.current()
    members = gens.members(g)
    if g > 0 and (members is None or process not in members.members):
        return g - 1
    return g


class Launcher:
    """One node's launcher (:func:`main` runs it)."""

    def __init__(self, plan: LauncherPlan, *, env: Optional[Mapping[str, str]] = None) -> None:
        from neighbor_ckpt.inprocess.store_auth import read_token
        from neighbor_ckpt.inprocess.stores import StoreAddresses, StoreSet

        self.plan = plan
        self.env = dict(os.environ if env is None else env)
        self._exits = ExitClock()
        """When each child exited, as the kernel says (the fault's time for the recovery timeline)."""
        self.pid = os.getpid()
        token = None if plan.token_file is None else read_token(Path(plan.token_file))
        self.stores = StoreSet(StoreAddresses(plan.stores), run_id=plan.run_id, timeout_s=plan.store_timeout_s,
                               connect_timeout_s=plan.connect_timeout_s, name=plan.name, token=token,
                               voter=plan.node, voters=plan.nodes)
        """The launch's stores; every operation bounded, failed over to the next standby when one is lost."""
        self.stores.on_failover(self._on_failover)
        self._lease = LauncherLease(node=plan.node, nodes=plan.nodes, timeout_s=plan.detector_timeout_s,
                                    beat_s=plan.beat_s, stores=self.stores, owner=self)
        self._views: dict[int, Any] = {}
        self._down_since: Optional[float] = None
        self._outbox: list[tuple[int, Callable[[Any], Any]]] = []
        self._signal: Optional[int] = None
        self._att: Optional[_Attempt] = None
        self._host: Optional[subprocess.Popen] = None
        self._started: dict[int, Optional[str]] = {}  # pid -> its NEIGHBOR_CKPT_STORE_DIR (staged slots: drop_staged)
        self._cannot_start: Optional[str] = None
        """Why this node's processes do not start (its store host could not start), if they do not."""
        self._beats = 0
        self._beat_at = 0.0
        self._kernel = ChildrenInKernel(plan.detector_timeout_s, node=plan.node)
        """Its processes as the kernel shows them: vouched for in each beat, SIGKILLed when held too long."""
        self._rendezvous = RestartRendezvous(
            node=plan.node, nodes=plan.nodes, indices=plan.indices, call=self._try, later=self._later, beat=self._beat,
            pending=lambda: bool(self._outbox), timeout_s=plan.detector_timeout_s, store_timeout_s=plan.store_timeout_s,
            poll_s=plan.poll_s, rendezvous_timeout_s=plan.rendezvous_timeout_s, processes=plan.processes,
            spares=plan.spares, elastic=plan.elastic, stopped=lambda: self._signal is not None, store_lost=self._store_lost)
        """The restart rendezvous, which goes on without a node lost for good when the job can."""
        self._roll = RollCall(processes=plan.processes, nodes=plan.nodes, bound_s=plan.reach_s)
        """Attempt 0's roll call: the processes of a launcher that never reached a store are declared dead."""
        self._roll_at = 0.0
        self._roll_epoch = 0
        """The store the roll call is held on: the first one, or the one this launcher moved to before it started
        anything (the first store never answered it: a cut at start-up, its host lost)."""
        self._stop_for: Optional[str] = None
        """Why this launch stops without a restart (the roll call found too few processes left), if it does."""

    # -- staged slots -----------------------------------------------------------------------------------------

    def drop_staged_slots(self) -> None:
        """Remove the slots this launcher's processes staged as idle hot spares (before any exit of the launcher: a
        staged slot is a full slot of /dev/shm, and nobody else removes it)."""
        drop_staged(list(self._started), self._started)

    def _sweep_staged(self) -> None:
        """At start: the staged slots of processes gone on this node's store (a launcher SIGKILLed or cut off before
        it dropped them)."""
        from neighbor_ckpt.config import DEFAULT_STORE_DIR, expand_store_dir
        from neighbor_ckpt.snapshot.store import sweep_staged_slots

        where = str(Path(self.plan.store_root) / self.plan.node) if self.plan.store_root is not None else None
        root = expand_store_dir(where or self.env.get("NEIGHBOR_CKPT_STORE_DIR") or DEFAULT_STORE_DIR)
        for path in sweep_staged_slots(root):
            logger.info("removed %s, staged by a process that is gone", path)

    # -- store ------------------------------------------------------------------------------------------------

    def _host_store(self) -> Optional[str]:
        """Start the store host this launcher runs (``--host-store``) and wait until it listens; None when it does
        (or there is none to run), else why not (the port and the cause)."""
        from neighbor_ckpt.inprocess.store_host import failed_path

        index = self.plan.host_store
        if index is None:
            return None
        port = self.plan.stores[index][1]
        ready = Path(tempfile.mkdtemp(prefix="nckpt-store-host-")) / "ready"
        parent = self.pid
        fd = self.plan.listen_fd
        where = ["--listen-fd", str(fd)] if fd is not None else \
            ["--host", self.plan.store_listen or self.plan.stores[index][0], "--port", str(port)]
        try:
            self._host = subprocess.Popen(python_module_command(
                                              "neighbor_ckpt.inprocess.store_host", *where,
                                              "--parent", str(parent), "--ready", str(ready),
                                              *(["--token-file", self.plan.token_file] if self.plan.token_file else []),
                                              *(["--open-store"] if self.plan.open_store else [])),
                                          env=self.env, pass_fds=() if fd is None else (fd,),
                                          preexec_fn=lambda: _child_setup(parent))
        finally:
            if fd is not None:  # the store host holds it now: a store host gone must refuse connections at once
                os.close(fd)
        deadline = time.monotonic() + self.plan.connect_timeout_s
        while not ready.exists():
            if self._host.poll() is not None or time.monotonic() > deadline:
                if self._host.poll() is None:
                    return f"port {port}: the store host did not listen within {self.plan.connect_timeout_s:.0f} s"
                failed = failed_path(ready)
                cause = failed.read_text().strip() if failed.exists() else "see its error above"
                return f"port {port}: the store host exited with status {self._host.returncode} ({cause})"
            time.sleep(0.02)
        self.env[protocol.ENV_STORE_HOST_PID] = str(self._host.pid)
        logger.info("store %d: hosted here (pid %d, port %d)%s", index, self._host.pid, port,
                    " (the primary)" if index == 0 else " (a hot standby)")
        return None

    def _stop_host(self, why: str) -> None:
        if self._host is not None and self._host.poll() is None:
            logger.warning("store %d hosted here: %s: stopping it (pid %d)", self.plan.host_store, why,
                           self._host.pid)
            self._host.kill()  # a SIGSTOPped host ends too
            self._host.wait()

    def _on_failover(self, old: int, new: int, why: str) -> None:
        """The store moved to ``new``: a store host of this node with a lower epoch is stale for good (fenced);
        this launcher's share of the attempt's keys is written again to the new store (its record, the processes
        handed out, its processes that exited, the dead it knows, its node in ``nodes``), and its join of the restart
        rendezvous it is in, if any. Every one of them is idempotent (:mod:`~neighbor_ckpt.inprocess.launch_counts`):
        a write of the same fact still queued, sent there once more, counts once."""
        if self.plan.host_store is not None and self.plan.host_store < new:
            self._stop_host(f"stale since store {new} took over (fenced)")
        att = self._att
        if att is None:
            return
        s = self.stores.view("failover", protocol.launch_prefix(self.plan.run_id, att.number))
        s.set(key("launcher", self.plan.node), json.dumps({"pid": self.pid, "processes": sorted(att.children)}))
        raise_processes(s, max([self.plan.processes, *(i + 1 for i in att.started)]))
        mark_exited(s, att.exited)
        gone = {p: r if r.startswith("exited:") else f"exited: after {r}" for p, r in att.dead.items()  # facts only
                if r.startswith("exited:") or (p in self.plan.indices and p not in att.children)}
        if gone:
            s.append("dead", "".join(f"{p}:{r.replace(';', ',')};" for p, r in sorted(gone.items())))
        s.append("nodes", f"{self.plan.node},")
        joining = self._rendezvous.joining
        if joining is not None and joining > att.number:  # in the restart rendezvous: its join, under its attempt
            self._rendezvous.rejoin(self.stores.view("failover", protocol.launch_prefix(self.plan.run_id, joining)))
        logger.warning("attempt %d: this node's processes %s, %d exited, %d known dead%s: written again to store %d",
                       att.number, sorted(att.children), len(att.exited), len(att.dead),
                       "" if joining is None or joining <= att.number else f", its join of attempt {joining}", new)

    def _store(self, attempt: int) -> Any:
        """The store under ``attempt``'s prefix."""
        if attempt not in self._views:
            self._views[attempt] = self.stores.view("launcher", protocol.launch_prefix(self.plan.run_id, attempt))
        return self._views[attempt]

    def _call(self, attempt: int, fn: Callable[[Any], Any]) -> Any:
        """``fn(store)`` under ``attempt``'s prefix; :class:`StoreDown` when no store of the list answers (the
        first failure is logged), or none was promoted but the job completed (:meth:`known_complete`: the others may
        have left); cut off when none was promoted otherwise."""
        from neighbor_ckpt.inprocess.stores import NoPromotedStore, StoresLost

        try:
            value = fn(self._store(attempt))
        except (NoPromotedStore, StoresLost) as e:
            if isinstance(e, NoPromotedStore) and not self.known_complete():
                self._lease.stop(str(e))
            self._mark_down(str(e))
            raise StoreDown(str(e)) from None
        if self._down_since is not None:
            logger.warning("the store %s answers again", self.plan.store_address)
        self._down_since = None
        return value

    def known_complete(self) -> bool:
        """Whether this node knows, without a store, that the job completed: it saw ``complete``, a process of its own
        exited 0 (only once the job completed) or a launcher wrote the completion marker (the run directory)."""
        att = self._att
        if att is not None and (att.complete_at is not None
                                or any(c.proc.poll() == 0 for c in [*att.children.values()])):
            return True
        return marked(self.plan.complete_file, self.plan.run_id)

    def _mark_down(self, why: str) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning("no store answers (%s): supervising the processes without one for up to %.0f s", why,
                           self.plan.store_grace_s)

    def _try(self, attempt: int, fn: Callable[[Any], Any]) -> Any:
        """:meth:`_call`, None when the store does not answer."""
        try:
            return self._call(attempt, fn)
        except StoreDown:
            return None

    def _later(self, attempt: int, fn: Callable[[Any], Any]) -> None:
        """A write that must reach the store: now, or from the outbox once it answers again."""
        self._outbox.append((attempt, fn))
        self._flush()

    def _flush(self) -> None:
        while self._outbox:
            attempt, fn = self._outbox[0]
            try:
                self._call(attempt, fn)
            except StoreDown:
                return
            self._outbox.pop(0)

    def _store_lost(self) -> bool:
        return self._down_since is not None and time.monotonic() - self._down_since > self.plan.store_grace_s

    # -- processes --------------------------------------------------------------------------------------------

    def _start(self, att: _Attempt, index: int, local_rank: int, replaces: Optional[int] = None) -> _Child:
        env = {**self.env, **child_env(self.plan, index=index, local_rank=local_rank, attempt=att.number,
                                       launcher_pid=self.pid, replaces=replaces, store_epoch=self.stores.epoch)}
        parent = self.pid
        proc = subprocess.Popen(child_command(self.plan), env=env, start_new_session=True,
                                preexec_fn=lambda: _child_setup(parent))
        child = _Child(index=index, local_rank=local_rank, proc=proc, replaces=replaces)
        att.children[index] = child
        att.started.add(index)
        self._exits.watch(proc.pid)
        self._started[proc.pid] = env.get("NEIGHBOR_CKPT_STORE_DIR")
        return child

    def _beat(self, attempt: int) -> None:
        """This launcher's heartbeat under ``attempt``'s prefix (``lhb/<node>``, every :attr:`~LauncherPlan.beat_s`),
        with its processes as the kernel shows them: a silent process it vouches for is not declared, a node whose beat
        stands still is lost, here and in the restart rendezvous (not queued: a late beat is of no use)."""
        now = time.monotonic()
        if now - self._beat_at < self.plan.beat_s or (self._att is not None and self._att.complete_at is not None):
            return  # once the job completed nobody watches (and its store host may be gone)
        if self._down_since is not None:
            return  # no store answers: a beat would only wait out another store timeout (the loop tries it anyway)
        self._beat_at = now
        self._beats += 1
        live = {} if self._att is None else {i: c.proc.pid for i, c in self._att.children.items()}
        beat = self._kernel.beat(self._beats, live, now, lambda i: self._try(
            attempt, lambda s: s.get(key("proc", i)) if s.check([key("proc", i)]) else None))
        self._try(attempt, lambda s: s.set(key("lhb", self.plan.node), beat))
        self._try(attempt, lambda s: self._lease.look(s, self._store(attempt - 1) if attempt else None))  # lease

    def _roll_call(self, att: _Attempt) -> None:
        """Attempt 0's roll call (:mod:`~neighbor_ckpt.inprocess.roll_call`), every :attr:`~LauncherPlan.beat_s`:
        the processes of launchers that never came are declared dead (and listed in ``exited``), or the launch stops
        when the processes left cannot cover the job's ranks."""
        now = time.monotonic()
        if att.number or self._roll.done or att.complete_at is not None or now - self._roll_at < self.plan.beat_s:
            return
        if self.stores.epoch != self._roll_epoch:  # a new store holds only who came again: the roll call was of the
            self._roll.done = True                # store this launcher started on
            return
        self._roll_at = now
        got = self._try(0, lambda s: self._roll.look(s, now))
        if not got:
            return
        absent, came = got
        self._rendezvous.lost.update(self._roll.lost(came, absent))
        verdict = self._roll.verdict(absent, came, spares=self.plan.spares, elastic=self.plan.elastic)
        if verdict.cut_off:  # a minority's verdict binds nobody: no giveup, nothing written, its processes stopped
            self._lease.stop(verdict.message)
            return
        if not verdict.go_on:
            self._stop_for = verdict.message
            self._give_up(att, verdict.message)
            return
        logger.warning("%s", verdict.message)
        for index in absent:
            self._declare(att, index, f"never started: {self._roll.cause(came)}")
        att.exited.update(absent)
        self._later(0, lambda s: mark_exited(s, absent))

    def _report(self, att: _Attempt) -> None:
        info = json.dumps({"pid": self.pid, "processes": sorted(att.children)})
        self._later(att.number, lambda s: s.set(key("launcher", self.plan.node), info))

    def _kill_listed(self, att: _Attempt) -> None:
        """SIGKILL every live process of this node listed in ``dead``."""
        for index, child in att.children.items():
            why = att.dead.get(index)
            if why is None or child.killed is not None or child.proc.poll() is not None:
                continue
            child.killed = why
            logger.warning("process %d (pid %d) is listed dead (%s): SIGKILL", index, child.proc.pid, why)
            _signal_group(child.proc, signal.SIGKILL)
            self._kill_recorded_pid(att, index, child.proc.pid)

    def _kill_recorded_pid(self, att: _Attempt, index: int, pid: int) -> None:
        """The pid the engine wrote under ``proc/<index>``, when it is not the child itself but runs on this node
        (a fork of the test suite's warm zygote): SIGKILL it too, if :func:`recorded_pid_to_kill` says so."""
        raw = self._try(att.number, lambda s: s.get(key("proc", index)) if s.check([key("proc", index)]) else None)
        other = recorded_pid_to_kill(raw, node=self.plan.node, child=pid)
        if other is not None:
            try:
                os.kill(other, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _watch_kernel(self, att: _Attempt) -> None:
        """A process held in the kernel (stopped, in D without CPU) for ``detector.timeout_s``: SIGKILL, declared."""
        live = {i: c.proc.pid for i, c in att.children.items() if c.killed is None and c.proc.poll() is None}
        for v in self._kernel.look(live, time.monotonic()) if att.complete_at is None else ():
            child = att.children[v.process]
            child.killed = f"{v.describe()}: SIGKILLed by its launcher"
            logger.warning("process %d (pid %d) has been %s (detector.timeout_s %g): SIGKILL, declared dead",
                           v.process, child.proc.pid, v.describe(), self.plan.detector_timeout_s)
            _signal_group(child.proc, signal.SIGKILL)
            self._kill_recorded_pid(att, v.process, child.proc.pid)
            what = f"{v.event} of process {v.process} seen by its launcher ({self.plan.name})"
            self._declare(att, v.process, child.killed, fault=Fault(time.time() - v.held_s, what))

    def _declare(self, att: _Attempt, index: int, reason: str, pid: Optional[int] = None,
                 fault: Optional[Fault] = None) -> None:
        """``dead`` + the current generation's failure: the push every survivor waits for; the fault's time is when
        this launcher saw the exit (:class:`ExitClock`'s, else now; the recovery timeline's *detect* starts there)."""
        when = (self._exits.seen(pid) if pid is not None else None) or time.time()
        seen = fault or Fault(when, f"exit of process {index} seen by its launcher ({self.plan.name})")

        def write(s: Any) -> None:
            # an idle spare's death fails no generation (GenerationStore.report_death): the job goes on without it
            GenerationStore(s, process=-1, name=self.plan.name).report_death(
                (index,), kind="exited", reason=reason, by=self.plan.name, fault=seen)

        att.dead.setdefault(index, f"exited: {reason}")
        self._later(att.number, write)

    def _reap(self, att: _Attempt) -> None:
        for index, child in list(att.children.items()):
            code = child.proc.poll()
            if code is None:
                continue
            del att.children[index]
            _signal_group(child.proc, signal.SIGKILL)  # what it started in its session goes with it
            drop_staged([child.proc.pid], self._started)
            att.exited.add(index)
            self._later(att.number, lambda s, i=index: mark_exited(s, (i,)))
            how = describe_exit(code)
            if att.complete_at is not None:  # the job is over: a late death fails no generation
                logger.info("process %d (pid %d) %s after the job completed", index, child.proc.pid, how)
                continue
            if child.killed is None and index not in att.dead and code not in (0, protocol.EXIT_FENCED):
                fresh = self._try(att.number, lambda s: parse_dead(s.get("dead")) if s.check(["dead"]) else {})
                att.dead.update(fresh or {})
            action = classify_exit(code, child.killed is not None or index in att.dead)
            if child.killed is None and code != protocol.EXIT_FALLBACK:
                att.worst = max(att.worst, exit_status(code))
            if action is Action.NOTHING:
                logger.info("process %d (pid %d) %s", index, child.proc.pid, how)
                # a process exits 0 only once the job completed: this node knows it even if it cannot read the
                # store now (a launcher cut off during a failover, when the job ended meanwhile)
                if att.complete_at is None:
                    self._completed(att)
            elif action is Action.DECLARED:
                logger.info("process %d (pid %d) %s; declared dead already (%s)", index, child.proc.pid, how,
                            child.killed or att.dead.get(index, "fenced"))
                self._later(att.number, lambda s, fact=f"{index}:exited: {how};": s.append("dead", fact))  # gone
            elif action is Action.FALLBACK:
                logger.warning("process %d (pid %d) %s: the job falls back to the launcher's restart", index,
                               child.proc.pid, how)
                self._give_up(att, f"process {index} exited with status {code}")
            else:
                self._declare(att, index, how, pid=child.proc.pid)
                if action is Action.REPLACE:
                    self._replace(att, child, how)
                else:
                    logger.warning("process %d (pid %d) %s: declared dead", index, child.proc.pid, how)
            if self.plan.grow_back and action in (Action.DECLARE, Action.DECLARED):
                g = self._try(att.number, lambda s: _last_generation_with(GenerationStore(s, process=-1), index))
                att.regrow.append((child, how, 0 if g is None else g))
                logger.info("process %d: a replacement starts once a generation after %d has completed a step "
                            "(--grow-back)", index, 0 if g is None else g)

    def _give_up(self, att: _Attempt, reason: str) -> None:
        """Set ``giveup`` (first ``compare_set`` wins); ``att.giveup``: the reason that stands."""
        stood = self._try(att.number, lambda s: s.compare_set("giveup", "", reason))
        if stood is None:
            self._later(att.number, lambda s: s.compare_set("giveup", "", reason))
        att.giveup = att.giveup or (reason if stood is None else stood.decode(errors="replace"))

    def _grow_back(self, att: _Attempt) -> None:
        """Start the replacements ``grow_back`` owes, once a generation formed after each death made progress."""
        if not att.regrow or att.complete_at is not None or att.giveup is not None:
            return
        current = self._try(att.number, lambda s: GenerationStore(s, process=-1).current())
        if current is None or not any(g < current for _, _, g in att.regrow):
            return
        if not self._try(att.number, lambda s: s.check([key("progress", current)])):
            return
        due = [r for r in att.regrow if r[2] < current]
        att.regrow = [r for r in att.regrow if r[2] >= current]
        for child, how, _ in due:
            self._replace(att, child, how)

    def _replace(self, att: _Attempt, child: _Child, how: str) -> None:
        if att.complete_at is not None:
            logger.info("process %d %s: not replaced, the job completed", child.index, how)
            return
        if att.replacements >= self.plan.max_replacements:
            logger.error("process %d %s: declared dead, NOT replaced (%d replacements on this node already, "
                         "--max-replacements)", child.index, how, att.replacements)
            return
        claim = f"{self.plan.node}:{self.pid}:{att.number}:{att.replacements}"  # the same until one was started
        new = self._try(att.number, lambda s: claim_index(s, claim, self.plan.processes))
        if new is None:
            logger.error("process %d %s: declared dead, NOT replaced (the store does not answer: no new index)",
                         child.index, how)
            return
        att.replacements += 1
        started = self._start(att, new, child.local_rank, replaces=child.index)
        logger.warning("process %d (pid %d) %s: declared dead; replacement process %d (pid %d) started, joins as a "
                       "spare", child.index, child.proc.pid, how, new, started.proc.pid)
        self._report(att)

    def _watch_store(self, att: _Attempt) -> None:
        """One look at ``dead``, ``giveup``, ``complete`` (nothing when the store does not answer)."""
        def look(s: Any) -> tuple[Optional[bytes], Optional[bytes], bool]:
            dead = s.get("dead") if s.check(["dead"]) else None
            giveup = s.get("giveup") if s.check(["giveup"]) else None
            return dead, giveup, s.check(["complete"])

        if att.complete_at is not None:
            return  # the job is over: nothing more to read (its store host may be gone already)
        got = self._try(att.number, look)
        if got is None:
            if marked(self.plan.complete_file, self.plan.run_id):  # the others learnt it and may have left
                self._completed(att)
            return
        dead, giveup, complete = got
        att.dead.update(parse_dead(dead))
        if giveup is not None and att.giveup is None:
            att.giveup = giveup.decode(errors="replace")
        if complete and att.complete_at is None:
            self._completed(att)
            logger.info("the job is complete: waiting for %d process(es) of this node to exit", len(att.children))

    def _completed(self, att: _Attempt) -> None:
        """The job completed: no more failovers, the completion marker for processes that start from now on, and the
        processes of this node that never joined a generation (a replacement still starting) are stopped once
        ``detector.timeout_s`` has passed (:meth:`_stop_unjoined`) unless they exit on their own (the marker)."""
        att.complete_at = time.monotonic()
        self.stores.settle()  # first: a store lost now is not failed over from (the others may have left)
        members = self._try(att.number, lambda s: _current_members(GenerationStore(s, process=-1)))
        if self.plan.complete_file is not None:
            mark_complete(Path(self.plan.complete_file), self.plan.run_id)
        if members is not None:
            att.unjoined = {i for i in att.children if i not in members}
            if att.unjoined:
                logger.info("the job is complete: process(es) %s of this node never joined a generation: they exit "
                            "on their own or are stopped in %.1f s (detector.timeout_s)", sorted(att.unjoined),
                            self.plan.detector_timeout_s)

    def _stop_unjoined(self, att: _Attempt) -> None:
        """Once the job completed: SIGTERM the processes of this node that never joined a generation, when
        ``detector.timeout_s`` has passed since (SIGKILL ``--grace`` seconds later)."""
        if att.complete_at is None or not att.unjoined:
            return
        waited = time.monotonic() - att.complete_at
        if waited < self.plan.detector_timeout_s:
            return
        for index in sorted(att.unjoined):
            child = att.children.get(index)
            if child is None or child.proc.poll() is not None:
                continue
            if child.killed is None:
                child.killed = "stopped by its launcher: the job completed before it joined"
                logger.warning("process %d (pid %d) has not joined a generation %.1f s after the job completed: "
                               "stopping it", index, child.proc.pid, waited)
                _signal_group(child.proc, signal.SIGTERM)
            elif waited > self.plan.detector_timeout_s + self.plan.grace_s:
                _signal_group(child.proc, signal.SIGKILL)

    def _everyone_exited(self, att: _Attempt) -> bool:
        """No process of the launch is left (every index handed out is listed in ``exited``)."""
        return bool(self._try(att.number, everyone_exited))

    def _stop(self, att: _Attempt, grace_s: float, *, sig: int = signal.SIGTERM) -> None:
        """``sig`` to every live process (nothing when ``sig`` is 0), SIGKILL after ``grace_s``, reap them all."""
        live = [c for c in att.children.values() if c.proc.poll() is None]
        if sig:
            for c in live:
                _signal_group(c.proc, sig)
        deadline = time.monotonic() + grace_s
        while any(c.proc.poll() is None for c in live) and time.monotonic() < deadline:
            if not sig and self._signal is not None:  # stopped while waiting for the processes to exit
                break
            self._beat(att.number)  # alive: the restart rendezvous must not take this node for lost
            time.sleep(min(self.plan.poll_s, 0.05))
        for c in live:
            if c.proc.poll() is None:
                logger.warning("process %d (pid %d) still running after %.0f s: SIGKILL", c.index, c.proc.pid,
                               grace_s)
                c.killed = c.killed or "stopped by its launcher"
                _signal_group(c.proc, signal.SIGKILL)
        for c in list(att.children.values()):
            c.proc.wait()
            _signal_group(c.proc, signal.SIGKILL)
        att.children.clear()

    def _run_attempt(self, number: int) -> _Outcome:
        att = self._att = _Attempt(number=number)
        n = self.plan.processes
        self._later(number, lambda s: s.compare_set("processes", "", str(n)))
        self._rendezvous.announce(number)
        for index in self._rendezvous.to_declare(number) if number else ():  # lost for good with their node
            self._declare(att, index, "lost for good with its node: not restarted")
            att.exited.add(index)
            self._later(number, lambda s, i=index: mark_exited(s, (i,)))
        if self._cannot_start is not None:
            for index in self.plan.indices:  # never started: declared dead at once, counted as exited
                self._declare(att, index, f"never started: {self._cannot_start}")
                att.exited.add(index)
                self._later(number, lambda s, i=index: mark_exited(s, (i,)))
        else:
            for local_rank, index in enumerate(self.plan.indices):
                self._start(att, index, local_rank)
            logger.info("attempt %d: started process(es) %s (pids %s) of %d", number, list(self.plan.indices),
                        [c.proc.pid for c in att.children.values()], n)
        self._report(att)
        while True:
            if self._signal is not None:
                return _Outcome.SIGNALED
            self._reap(att)
            self._watch_kernel(att)
            self._flush()
            self._beat(att.number)
            self._watch_store(att)
            self._kill_listed(att)
            self._roll_call(att)
            self._grow_back(att)
            if att.giveup is not None:
                logger.warning("in-process recovery gave up (%s): waiting up to %.0f s for %d process(es) of this "
                               "node to exit", att.giveup, self.plan.fallback_grace_s, len(att.children))
                self._stop(att, self.plan.fallback_grace_s, sig=0)
                self._flush()
                return _Outcome.GIVEUP
            if att.complete_at is not None:
                if not att.children:
                    return _Outcome.COMPLETE
                self._stop_unjoined(att)
                if time.monotonic() - att.complete_at > self.plan.complete_grace_s:
                    logger.warning("the job is complete but %d process(es) still run after %.0f s: stopping them",
                                   len(att.children), self.plan.complete_grace_s)
                    self._stop(att, self.plan.grace_s)
                    return _Outcome.COMPLETE
            elif not att.children and not self._outbox and self._everyone_exited(att):
                reason = "every process of the launch exited before the job completed"
                logger.warning("%s: giving up in-process recovery", reason)
                self._give_up(att, reason)
                continue
            if self._store_lost():
                logger.error("the store %s has not answered for %.0f s: stopping this node's %d process(es)",
                             self.plan.store_address, self.plan.store_grace_s, len(att.children))
                self._stop(att, self.plan.grace_s)
                return _Outcome.STORE_LOST
            time.sleep(self.plan.poll_s)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signal = signum

    def run(self) -> int:
        """Supervise until the job completes, gives up, loses the store or a signal stops it: the exit status."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self._sweep_staged()
        failed = self._host_store()
        if failed is not None:
            self._cannot_start = f"node {self.plan.node} cannot host store {self.plan.host_store}: {failed}"
            logger.error("%s: its process(es) %s are declared dead and do not start (the spares take them); this "
                         "launcher goes on without them and without its store", self._cannot_start,
                         list(self.plan.indices))
            # The primary's host (store 0): everyone fails over to store 1 once their first connection gives up; no
            # early promotion here, which could pick a later standby while store 1's host is still starting.
        reached, why = reach_any(self.plan.stores, self.plan.reach_s, token=self.stores.token)
        if reached is None:
            logger.error("node %s reached no store of the launch within %.0f s (%s): nothing started; the other "
                         "launchers declare its process(es) %s dead", self.plan.node, self.plan.reach_s,
                         "; ".join(f"{self.stores.addresses.describe(i)}: {why.get(i, 'not tried')}"
                                   for i in range(len(self.plan.stores))), list(self.plan.indices))
            self._stop_host("the launcher did not start")
            return protocol.EXIT_NO_STORE
        self.stores.unreached(unreached_stores(why, before=reached))
        try:
            self._call(0, lambda s: s.check(["processes"]))
            dead = self._call(0, lambda s: parse_dead(s.get("dead") if s.check(["dead"]) else None))
        except StoreDown as e:
            logger.error("node %s cannot reach a store of %s (%s): nothing started", self.plan.node,
                         self.plan.store_address, e)
            self._stop_host("the launcher did not start")
            return EXIT_LAUNCHER_ERROR
        # moved before anything started here (the first store never answered): the roll call is of the store that did
        self._roll_epoch = self.stores.epoch
        if self._cannot_start is None and all(i in dead for i in self.plan.indices):  # the others' roll call
            self._cannot_start = f"declared dead before this launcher reached a store ({dead[self.plan.first]})"
            logger.error("node %s: its process(es) %s were %s: they do not start; this launcher stays in the launch "
                         "without them", self.plan.node, list(self.plan.indices), self._cannot_start)
        self.stores.start_following()  # fencing: a newer store promoted while this launcher was cut off
        self._lease.guard.start()
        number = 0
        try:
            while True:
                outcome = self._run_attempt(number)
                att = self._att
                assert att is not None
                if outcome is _Outcome.COMPLETE:  # the host of the store in use waits for the others to leave
                    hosting = self.plan.host_store == self.stores.epoch and self._host is not None
                    self._rendezvous.leave(number, hosting=hosting, reachable=self._down_since is None,
                                           bound_s=HOST_LINGER_S)
                    logger.info("the job completed: exiting 0")
                    return 0
                if outcome is _Outcome.SIGNALED:
                    sig = self._signal or signal.SIGTERM
                    logger.warning("stopped by %s: stopping this node's processes", signal.Signals(sig).name)
                    return 128 + sig
                if outcome is _Outcome.STORE_LOST:
                    logger.error("exiting %d: the store was lost (worst status of a process: %d)", EXIT_STORE_LOST,
                                 att.worst)
                    return EXIT_STORE_LOST
                if self._stop_for is not None:
                    logger.error("the launch stops: %s: exiting %d", self._stop_for, EXIT_LAUNCHER_ERROR)
                    return EXIT_LAUNCHER_ERROR
                if number >= self.plan.max_restarts:
                    logger.error("in-process recovery gave up (%s) and the launcher-level restarts are used up "
                                 "(%d of %d): exiting %d", att.giveup, number, self.plan.max_restarts,
                                 protocol.EXIT_FALLBACK)
                    return protocol.EXIT_FALLBACK
                number += 1
                logger.warning("restart %d of %d: waiting for the %d launcher(s) of the launch", number,
                               self.plan.max_restarts, self.plan.nodes)
                if not self._rendezvous.meet(number):
                    if self._signal is not None:
                        return 128 + self._signal
                    if not self._rendezvous.cut_off and self.plan.host_store == self.stores.epoch and self._host:
                        self._rendezvous.wait_stopped(number, self.plan.store_timeout_s + HOST_LINGER_S)  # in use
                    return protocol.EXIT_CUT_OFF if self._rendezvous.cut_off else EXIT_LAUNCHER_ERROR
        finally:
            self._lease.guard.close()
            self.stores.close()
            if self._att is not None and self._att.children:
                self._stop(self._att, self.plan.grace_s)
            self.drop_staged_slots()
            self._exits.close()
            if self._host is not None and self._host.poll() is None:
                self._host.terminate()
                try:
                    self._host.wait(timeout=self.plan.grace_s)
                except subprocess.TimeoutExpired:
                    self._host.kill()
                    self._host.wait()


def main(argv: Optional[Sequence[str]] = None) -> int:
    plan = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "error")  # before torch: the store client's retries are noisy
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s neighbor_ckpt launcher {plan.node} (pid {os.getpid()}): %(message)s")
    from neighbor_ckpt.errors import ConfigError
    from neighbor_ckpt.inprocess.stores import leave

    try:
        launcher = Launcher(plan)
    except ConfigError as e:  # the token file: missing, not the user's, readable by others
        logger.error("%s: nothing started", e)
        return EXIT_LAUNCHER_ERROR
    return leave(launcher.run())  # its end closed the store clients: they had their timeout to finish


if __name__ == "__main__":
    sys.exit(main())
