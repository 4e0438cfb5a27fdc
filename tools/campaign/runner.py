"""Running a campaign: each case as a real ``torchrun`` job or as our per-node launchers, the failure-free runs, the
``--resume`` bookkeeping and the command line (``python -m tools.campaign``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, Sequence

from neighbor_ckpt.cli.launch import WORKER_PREFIX_ENV, worker_program
from neighbor_ckpt.recipes import RECIPES_DIR
from neighbor_ckpt.runtime.procs import RUN_TAG_ENV, kill_tagged, new_run_tag
from neighbor_ckpt.snapshot.store import rank_dir

from .cases import KINDS, LOST_NODE, NODES, PARTITIONS, SPARES, WORLD, Case, Outcome, draw_cases
from .judge import (compare, compare_fallback, compare_resized, failure_lines, insurance_iteration, node_loss,
                    other_user, other_user_notes, partition, recoveries, recoveries_from, restart_attempts)
from .report import load_outcomes, mttrs, results_document, summarize

__all__ = ["RECIPE", "GAVE_UP", "inprocess_job", "judge_run", "main", "resume_baseline", "resume_point", "run_case",
           "source_version", "write_config"]

RECIPE = RECIPES_DIR / "mcore_gpt_plain_loop.py"
"""The recipe every case runs (the package's, ``recipes/`` in the checkout)."""
CHECKOUT = Path(__file__).resolve().parents[2]
"""The source checkout this tool runs from (its commit is recorded)."""

_DETECTED_RE = re.compile(r"detected a failure \((\w+)\) at unix ([0-9.]+)")
_MTTR_RE = re.compile(r"recovery MTTR ([0-9.]+) s")
GAVE_UP = "in-process recovery gives up"
"""The engine's announcement that an in-process recovery gave up (the launch then stops for the restart path)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, args: list[str], *, job_id: str, store: Path, config: Path, steps: int, timeout: float,
              max_restarts: int, insurance_every: int = 0) -> tuple[int, str]:
    out.mkdir(parents=True, exist_ok=True)
    options, worker = worker_program([str(RECIPE), "--steps", str(steps), "--out", str(out), "--job-id", job_id,
                                      "--config", str(config), "--insurance-every", str(insurance_every), *args])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", f"--max-restarts={max_restarts}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--monitor-interval=0.5", *options,
           *worker]
    tag = new_run_tag()
    env = dict(os.environ, NEIGHBOR_CKPT_STORE_DIR=str(store), PYTHONUNBUFFERED="1", **{RUN_TAG_ENV: tag})
    log = out / "torchrun.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -999
    # A SIGSTOPped victim that nobody killed, or the helpers of a killed worker, would outlive torchrun.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    kill_tagged(tag)
    return rc, log.read_text(errors="replace")


def _torchrun_nodes(out: Path, args: list[str], *, job_id: str, store: Path, config: Path, steps: int, timeout: float,
                    max_restarts: int, elastic: bool) -> tuple[int, str]:
    """A restart-path case on :data:`~tools.campaign.cases.WORLD` / ``DEVICES`` simulated nodes, one torchrun agent
    each in one rendezvous, as ``neighbor-ckpt launch`` runs ``trainer.num_nodes > 1`` without in-process recovery
    (:mod:`neighbor_ckpt.cli.torchrun_nodes`); the agents' output in ``torchrun.log``. Returns (the launch's status,
    -999 past ``timeout``; the log)."""
    from neighbor_ckpt.cli.torchrun_nodes import node_agents, run_node_agents

    from .cases import DEVICES

    out.mkdir(parents=True, exist_ok=True)
    options, worker = worker_program([str(RECIPE), "--steps", str(steps), "--out", str(out), "--job-id", job_id,
                                      "--config", str(config), *args])
    agents = node_agents(worker, options=options, nodes=WORLD // DEVICES, devices=DEVICES, max_restarts=max_restarts,
                         run_id=job_id, endpoint=f"127.0.0.1:{_free_port()}", store_root=store, elastic=elastic,
                         detector_timeout_s=3.0)
    tag = new_run_tag()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{RUN_TAG_ENV: tag})
    log = out / "torchrun.log"
    result: list[int] = []
    with open(log, "w") as f:
        t = threading.Thread(target=lambda: result.append(run_node_agents(agents, env=env, stdout=f,
                                                                         stderr=subprocess.STDOUT)), daemon=True)
        t.start()
        t.join(timeout)
    kill_tagged(tag)
    return (result[0] if result else -999), log.read_text(errors="replace")


def inprocess_job(out: Path, args: list[str], *, job_id: str, store: Path, config: Path, steps: int,
                  store_port: "int | list[int]", max_restarts: int, insurance_every: int = 0,
                  spares: int = SPARES, grow_back: bool = False, devices: int = 1,
                  network: Any = None):  # noqa: ANN201
    """The per-node launcher commands (each hosting one of the stores) of an in-process case (nothing runs):
    ``WORLD`` active ranks + ``SPARES``, the recipe in its in-process mode (``config`` enables it), one host store
    root per simulated node under ``store``; built by :func:`neighbor_ckpt.cli.launch.inprocess_commands`, as
    ``neighbor-ckpt launch`` builds its own. ``devices``: processes per simulated node (the spares on spare nodes
    of their own), as ``trainer.devices`` of a job with ``trainer.num_nodes > 1``. ``network``: the simulated
    network (:func:`neighbor_ckpt.runtime.netns.simulated_network`) each node's launcher runs in, None: none."""
    from neighbor_ckpt.cli.launch import inprocess_commands
    from neighbor_ckpt.config import NeighborCkptConfig

    program = [str(RECIPE), "--steps", str(steps), "--out", str(out), "--job-id", job_id, "--config", str(config),
               "--insurance-every", str(insurance_every), *args]
    # the launchers' store timeout follows the job's detector, as the processes' does (docs/timeouts.md)
    detector_timeout_s = NeighborCkptConfig.from_yaml(config).detector.timeout_s
    return inprocess_commands(program, active=WORLD, spares=spares, max_restarts=max_restarts, run_id=job_id,
                              store_port=store_port, store_root=store, grow_back=grow_back,
                              detector_timeout_s=detector_timeout_s, devices=devices, network=network)


@contextlib.contextmanager
def _cold() -> Iterator[None]:
    """No worker prefix (:data:`~neighbor_ckpt.cli.launch.WORKER_PREFIX_ENV`) in this process's environment while the
    block builds commands: a worker forked from a warm zygote would run outside its node's network namespace."""
    prefix = os.environ.pop(WORKER_PREFIX_ENV, None)
    try:
        yield
    finally:
        if prefix is not None:
            os.environ[WORKER_PREFIX_ENV] = prefix


def _run_inprocess(out: Path, args: list[str], *, job_id: str, store: Path, config: Path, steps: int,
                   timeout: float, max_restarts: int, spares: int = SPARES, grow_back: bool = False,
                   devices: int = 1, simulate_network: bool = False, probe: bool = False) -> tuple[int, str]:
    """Run an in-process case (:func:`inprocess_job`); the launchers', their processes' and the store host's output
    in ``launch.log``. ``simulate_network``: each simulated node in a network namespace of its own, made around the
    launch and removed after it (:func:`neighbor_ckpt.runtime.netns.simulated_network`, as ``neighbor-ckpt launch``
    does with ``launch.simulate_network``; root), the workers started cold. ``probe``: the other user probes every
    store address of the launch from its start to its end (:class:`~tools.campaign.other_user.Prober`, its summary
    in ``out``). Returns
    (:func:`~neighbor_ckpt.cli.launch.launch_status` of the launchers' exit statuses, -999 past ``timeout``; the
    log)."""
    from neighbor_ckpt.cli.launch import free_ports, run_inprocess, simulated_nodes
    from neighbor_ckpt.errors import ConfigError
    from neighbor_ckpt.runtime.netns import simulated_network

    from .other_user import Prober

    out.mkdir(parents=True, exist_ok=True)
    tag = new_run_tag()
    log = out / "launch.log"
    with open(log, "w") as f, contextlib.ExitStack() as stack:
        try:
            network = stack.enter_context(simulated_network(len(simulated_nodes(WORLD, spares, devices)))) \
                if simulate_network else None
            with _cold() if simulate_network else contextlib.nullcontext():
                procs = inprocess_job(out, args, job_id=job_id, store=store, config=config, steps=steps,
                                      store_port=free_ports(WORLD + spares), max_restarts=max_restarts,
                                      spares=spares, grow_back=grow_back, devices=devices, network=network)
            env = dict(os.environ, PYTHONUNBUFFERED="1", **{RUN_TAG_ENV: tag})
            if simulate_network:
                env.pop(WORKER_PREFIX_ENV, None)
            env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun gives the baseline's workers: the same arithmetic
            if probe:  # from before the launchers start to after they all ended
                prober = Prober(out, run_id=job_id, stores=procs.stores, log=log)
                prober.start()
                stack.callback(prober.stop)
            rc = run_inprocess(procs, env=env, timeout=timeout, stdout=f, stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            rc = -999
        except ConfigError as e:  # no store host listened, or no network: this case failed, the campaign goes on
            f.write(f"\ncampaign: {e}\n")
            rc = -998
    kill_tagged(tag)  # a stopped victim nobody killed, or a process its launcher left behind
    return rc, log.read_text(errors="replace")


def _recoveries(out: Path, log: str, hang_detection: float | None) -> list[dict[str, Any]]:
    """Every recovery of a case: its recovery timelines (in process, and the restart attempts of an in-process case:
    ``<out>/reports``), else the MTTR lines of the log (the restart path writes its timelines beside the host store),
    the first with the hang's ``hang_detection``."""
    found = recoveries(out)
    if found:
        return found
    return [{"attempt": None, "mode": None, "mttr_s": float(m.group(1)),
             "detection_s": hang_detection if i == 0 else None, "file": "log"}
            for i, m in enumerate(_MTTR_RE.finditer(log))]


def case_dir(work: Path, case: Case) -> Path:
    """Where ``case`` of the campaign in ``work`` runs (its output and log)."""
    return work / f"case{case.index:04d}-{case.kind}-r{case.rank}-s{case.step}"


def inprocess_store(work: Path, case: Case) -> Path:
    """The host stores of in-process ``case`` (one root per simulated node under it)."""
    return work / "store" / f"inproc-{case.index}"


def baseline_dir(work: Path, flavour: tuple[bool, int, bool]) -> Path:
    """The failure-free run of the cases of ``flavour`` (:attr:`Case.flavour`)."""
    dist_opt, tp, fixed = flavour
    return work / f"baseline-{'distopt' if dist_opt else 'replicated'}-tp{tp}{'-nodropout' if fixed else ''}"


def run_case(case: Case, *, base: Path, work: Path, steps: int, config: Path, timeout: float = 420,
             insurance_every: int = 0) -> Outcome:
    out = case_dir(work, case)
    job_id = f"campaign-{case.index}"
    # What an interrupted earlier run of this case left (a resumed campaign) must not be found by this one.
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(rank_dir(work / "store", job_id, 0).parent, ignore_errors=True)
    inproc_store = inprocess_store(work, case)
    shutil.rmtree(inproc_store, ignore_errors=True)
    t0 = time.time()
    if case.spec.whole_node and not case.inprocess:  # the restart path on simulated nodes: a torchrun agent each
        own = write_config(out / "nckpt.yaml", base=config, faults=case.planned_faults, elastic=case.spec.shrink)
        rc, log = _torchrun_nodes(out, case.recipe_args(), job_id=job_id, store=work / "store" / f"nodes-{case.index}",
                                  config=own, steps=steps, timeout=timeout, max_restarts=case.max_restarts,
                                  elastic=case.spec.shrink)
    elif case.inprocess:
        own = write_config(out / "nckpt.yaml", base=config, inprocess_spares=case.spares, report_dir=out / "reports",
                           faults=case.planned_faults, elastic=case.spec.shrink, stuck=case.signal == "block",
                           grow_back=case.spec.grow_back, hang=case.simulate_network)
        rc, log = _run_inprocess(out, case.recipe_args(), job_id=job_id, store=inproc_store, config=own,
                                 steps=steps, timeout=timeout, max_restarts=case.max_restarts, spares=case.spares,
                                 grow_back=case.spec.grow_back, devices=case.devices,
                                 simulate_network=case.simulate_network, probe=case.spec.other_user)
    else:
        rc, log = _torchrun(out, case.recipe_args(), job_id=job_id, store=work / "store",
                            config=config, steps=steps, timeout=timeout, max_restarts=case.max_restarts,
                            insurance_every=insurance_every)
    return judge_run(case, out=out, rc=rc, log=log, wall=time.time() - t0, base=base, work=work, steps=steps,
                     config=config, store=inproc_store)


def judge_run(case: Case, *, out: Path, rc: int, log: str, wall: float, base: Path, work: Path, steps: int,
              config: Path, store: Path | None = None) -> Outcome:
    """The outcome of ``case``'s run in ``out`` (exit status ``rc``, launcher output ``log``, ``wall`` seconds), judged
    against the failure-free run ``base``; a fallback to insurance runs the failure-free run resumed from it. An
    in-process case counts as recovered by the restart path only when a restart attempt really ran (its recovery
    reports exist): a give-up line alone (a late replacement that gave up, say) does not make one. ``store``: the
    in-process case's host stores (``node<i>`` under it), where a partition's minority must have written no slot
    after the cut. An ``inproc-other-user`` case's notes end with the other user's attempts, whatever the outcome."""
    o = _judge_run(case, out=out, rc=rc, log=log, wall=wall, base=base, work=work, steps=steps, config=config,
                   store=store)
    notes = other_user_notes(out) if case.spec.other_user else ""
    return dataclasses.replace(o, detail="; ".join(filter(None, (o.detail, notes)))) if notes else o


def _judge_run(case: Case, *, out: Path, rc: int, log: str, wall: float, base: Path, work: Path, steps: int,
               config: Path, store: Path | None = None) -> Outcome:
    detected = [float(m.group(2)) for m in _DETECTED_RE.finditer(log) if m.group(1) != "sigterm"]
    detection = None
    seen_in_log = case.signal == "SIGSTOP" and bool(detected) and (out / "fault.json").exists()
    if seen_in_log:  # the hang's detection: from the victim's stop to the first detection line
        detection = min(detected) - json.loads((out / "fault.json").read_text())["unix"]
    all_recoveries = _recoveries(out, log, detection)
    if case.spec.partition and (out / "fault.json").exists():  # from the cut: nobody's process stops at once
        all_recoveries = recoveries_from(out, float(json.loads((out / "fault.json").read_text())["unix"]))
    if not seen_in_log and (case.signal in ("SIGSTOP", "block") or case.spec.whole_node or case.spec.partition) \
            and case.inprocess:
        detection = next((r["detection_s"] for r in all_recoveries if r["detection_s"] is not None), None)
    mttr = next((r["mttr_s"] for r in all_recoveries if r["mttr_s"] is not None), None)
    common = dict(detection_s=detection, mttr_s=mttr, wall_s=wall, recoveries=tuple(all_recoveries))
    gave_up = case.inprocess and GAVE_UP in log
    restarted = bool(restart_attempts(out))
    if not (out / "fault.json").exists():
        return Outcome(case, "FAILED", "the fault never fired", **common)
    if case.recovery_rank is not None and not (out / "fault.recovery.json").exists():
        return Outcome(case, "FAILED", "the kill during recovery never fired", **common)
    fired = _faults_fired(out)
    if case.planned_faults is not None and fired != len(case.planned_faults):
        return Outcome(case, "FAILED", f"{fired} of {len(case.planned_faults)} planned faults fired", **common)
    if case.spec.misplaced_data:
        stop = f"the data position was not restored: step {case.step}"
        if rc != 0 and "DataPositionError" in log and stop in log:
            return Outcome(case, "stopped", f"stopped by the data check at the replayed step {case.step}, announced",
                           **common)
        return Outcome(case, "FAILED", f"exit {rc}, a restart on other data was not stopped at step {case.step}: "
                                       f"{failure_lines(log)}", **common)
    if rc != 0:
        return Outcome(case, "FAILED", f"exit {rc}: {failure_lines(log)}", **common)
    if "falling back to the insurance checkpoint" in log:
        k = insurance_iteration(out)
        if k is None:
            return Outcome(case, "FAILED", "fell back to insurance, but the recovery reports do not name one "
                                           "insurance iteration", **common)
        resumed = resume_baseline(case, run=out, work=work, steps=steps, config=config, insurance_step=k)
        if resumed is None:
            return Outcome(case, "FAILED", f"the failure-free run resumed from insurance {k} failed", **common)
        diff = compare_fallback(base, resumed, out, insurance_step=k)
        return Outcome(case, "FAILED" if diff else "fallback",
                       diff or f"announced fallback to insurance {k}, bit-exact with the failure-free run resumed "
                               "from it", **common)
    if case.spec.whole_node and not case.inprocess:  # the restart path: the launch said it and went on without it
        said = f"node node{LOST_NODE} is lost for good (its torchrun agent was killed by SIGKILL"
        if said not in log:
            return Outcome(case, "FAILED", f"the launch did not say that node{LOST_NODE} is lost for good: "
                                           f"{failure_lines(log)}", **common)
    elif case.spec.whole_node:  # found as one failure, recovered in process, its detection timed
        lost = node_loss(log, out, node=f"node{LOST_NODE}", processes=case.victims, spare_node=not case.spec.shrink)
        if lost:
            return Outcome(case, "FAILED", lost, **common)
    elif case.spec.partition:  # the minority stopped itself, formed nothing, wrote nothing; one recovery on a spare
        cut = PARTITIONS[case.spec.partition]
        found = partition(log, nodes=cut["nodes"], traffic=cut["traffic"], heal_after_s=cut["heal_after_s"],
                          processes=WORLD + case.spares, spare=WORLD + case.spares - 1, rank=case.victims[0],
                          store=store, cut_unix=json.loads((out / "fault.json").read_text())["unix"])
        if found:
            return Outcome(case, "FAILED", found, **common)
    if case.spec.other_user:  # nothing the other user tried got through, and the kill recovered as inproc-kill's
        found = other_user(log, out, victim=case.rank, spare=WORLD + case.spares - 1)
        if found:
            return Outcome(case, "FAILED", found, **common)
    no_restart = ("; a process announced that its in-process recovery gives up, but no restart attempt ran"
                  if gave_up and not restarted else "")
    if case.spec.shrink:
        diff = compare_resized(base, out, fault_step=case.step)
        if not diff and gave_up and restarted:
            diff = "in-process recovery gave up instead of shrinking"
        return Outcome(case, "FAILED" if diff else "resized",
                       diff or "shrank in process: the global batch's samples kept, losses within 1e-4" + no_restart,
                       **common)
    diff = compare(base, out)
    if not diff and gave_up and restarted:
        return Outcome(case, "fallback", "in-process recovery gave up (announced); the restart path recovered "
                                         "exactly", **common)
    return Outcome(case, "FAILED" if diff else "exact", diff or no_restart.removeprefix("; "), **common)


def _faults_fired(out: Path) -> int:
    """How many planned faults fired in ``out``: the lines of ``faults.jsonl``, where the processes of a lost node
    each write the node's fault, as far as they get before the node dies (one fault); 1 without the file (the
    ``--kill`` flags' ``fault.json``)."""
    path = out / "faults.jsonl"
    if not path.exists():
        return 1
    fired: set[tuple[Any, ...]] = set()
    for i, line in enumerate(path.read_text().splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # cut short: a process of a lost node, whose other process's line is whole
        node = rec.get("node") if isinstance(rec, dict) and rec.get("target") == "node" else None
        fired.add(("node", node, rec.get("step")) if node is not None else ("line", i))
    return len(fired)


def resume_baseline(case: Case, *, run: Path, work: Path, steps: int, config: Path, insurance_step: int,
                    timeout: float = 420) -> Path | None:
    """The failure-free run of ``case``'s configuration resumed from insurance checkpoint ``insurance_step`` (its
    output directory; None if it failed): a job given a copy of that one checkpoint from ``run``'s insurance
    directory (written before the fault, by training identical to the failure-free run's), whose every rank is killed
    in step 0's forward pass, before any snapshot exists: its restart finds nothing in memory and loads the insurance,
    in fresh processes of launcher attempt 1, as the fallback did. One per configuration and step, reused by later
    cases."""
    flavour = f"{'distopt' if case.dist_opt else 'replicated'}-tp{case.tp}"
    out = work / f"resumed-{flavour}-from{insurance_step}"
    if len(list(out.glob("final.rank*.json"))) == WORLD:
        return out
    shutil.rmtree(out, ignore_errors=True)
    name = f"iter_{insurance_step:07d}"
    insurance = out / "insurance"
    shutil.copytree(run / "insurance" / name, insurance / name)
    flags = ["--nodes", str(NODES), "--tp", str(case.tp), *case.flavour_args, "--insurance-dir", str(insurance),
             "--kill", ",".join(map(str, range(WORLD))) + ":0", "--kill-phase", "forward"] + \
        ([] if case.dist_opt else ["--no-dist-opt"])
    rc, _ = _torchrun(out, flags, job_id=f"campaign-resumed-{flavour}-{insurance_step}", store=work / "store-resumed",
                      config=config, steps=steps, timeout=timeout, max_restarts=1, insurance_every=10**6)
    return out if rc == 0 and len(list(out.glob("final.rank*.json"))) == WORLD else None

def write_config(path: Path, *, interval_s: float = 0.5, timeout_s: float = 3.0, base: Path | None = None,
                 inprocess_spares: int | None = None, report_dir: Path | None = None,
                 faults: list[dict[str, Any]] | None = None, elastic: bool = False, stuck: bool = False,
                 grow_back: bool = False, hang: bool = False) -> Path:
    """The campaign's ``neighbor_ckpt:`` section: the detector's bound, and 64 KiB chunks so that a kill in the
    middle of streaming leaves a replica really half written. ``base``: that section as written before (the
    campaign's), extended by ``inprocess_spares`` (in-process recovery on, with that many hot spares),
    ``report_dir`` (where the recovery timeline goes), ``faults`` (``fault_injection.faults``: the faults the recipe
    injects itself), ``elastic`` (``elastic.enabled``) and ``stuck`` (the hang and abort bounds of the CPU job files,
    ``detector.hang_timeout_s`` 3 s and ``inprocess.abort_timeout_s`` 10 s, for a stuck training thread) and
    ``grow_back`` (``inprocess.grow_back``) and ``hang`` (only ``detector.hang_timeout_s`` 3 s: a partition's ranks
    stall in a collective with their heartbeats alive, as in tests/e2e/test_partitions.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = base.read_text() if base is not None else (
        f"neighbor_ckpt:\n  detector:\n    interval_s: {interval_s}\n    timeout_s: {timeout_s}\n"
        "  store:\n    cleanup_on_success: true\n  transport:\n    chunk_mb: 0.0625\n")
    if stuck or hang:
        if "  detector:\n" not in text:
            raise ValueError("write_config: stuck=True or hang=True needs the campaign's detector section in base")
        text = text.replace("  detector:\n", "  detector:\n    hang_timeout_s: 3.0\n", 1)
    if inprocess_spares is not None:
        text += f"  inprocess:\n    enabled: true\n    spares: {inprocess_spares}\n"
        if stuck:
            text += "    abort_timeout_s: 10.0\n"
        if grow_back:
            text += "    grow_back: true\n"
    if report_dir is not None:
        text += f"  report:\n    dir: {json.dumps(str(report_dir))}\n"
    if faults:
        text += f"  fault_injection:\n    enabled: true\n    faults: {json.dumps(faults)}\n"
    if elastic:
        text += "  elastic:\n    enabled: true\n"
    path.write_text(text)
    return path


def source_version() -> str:
    """The commit the campaign runs (``git describe --always --dirty`` of the checkout), or ``unknown``."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=CHECKOUT, capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"

def _settings(args: argparse.Namespace, kinds: Sequence[str]) -> dict[str, Any]:
    return {"seed": args.seed, "faults": args.faults, "steps": args.steps, "kinds": list(kinds),
            "detector_timeout_s": args.detector_timeout, "detector_interval_s": args.detector_interval,
            "insurance_every": args.insurance_every, "insurance_where_needed": args.insurance_where_needed,
            "source": source_version()}


def resume_point(work: Path, settings: dict[str, Any], cases: Sequence[Case]) -> list[Outcome]:
    """The outcomes of the campaign in ``work`` that a ``--resume`` keeps. Refuses (ValueError, with what differs)
    when that campaign ran other settings or another commit, or recorded a case that is not the one drawn now:
    the table of a resumed campaign must be the table of one campaign."""
    meta = work / "campaign.json"
    if not meta.exists():
        raise ValueError(f"--resume: {meta} does not exist; start the campaign without --resume")
    before = json.loads(meta.read_text())
    differ = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
    if differ:
        raise ValueError("--resume: the campaign in " + str(work) + " ran with other settings or source: "
                         + ", ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in differ.items())
                         + "; check out that commit and pass the same options, or start a new campaign")
    done = load_outcomes(work / "outcomes.jsonl")
    for position, o in enumerate(done):
        if position >= len(cases) or o.case != cases[position]:
            raise ValueError(f"--resume: recorded case {o.case} is not case {position} of this campaign")
    return done


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.campaign",
                                 description="randomized faults against the tiny mcore GPT recipe on 4 CPU ranks, and "
                                             "a table (tools/campaign/__init__.py says what each kind does)")
    ap.add_argument("--faults", type=int, default=24, help="number of randomized faults")
    ap.add_argument("--seed", type=int, default=7, help="reproduces the campaign")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {', '.join(KINDS)}")
    ap.add_argument("--detector-timeout", type=float, default=3.0, help="detector.timeout_s (the bound)")
    ap.add_argument("--detector-interval", type=float, default=0.5, help="detector.interval_s")
    ap.add_argument("--insurance-every", type=int, default=2,
                    help="megatron-core distributed checkpoint every N steps in every run (the insurance)")
    ap.add_argument("--insurance-where-needed", action="store_true",
                    help="write the insurance only in the cases no in-memory version can cover, or may not by timing "
                         "(the failure-free runs and every other case run without it, and then fail where they would "
                         "fall back): a "
                         "dist_checkpointing save costs ~3 s here, a third of a case")
    ap.add_argument("--at-step", type=int, default=None, metavar="N",
                    help="every drawn fault at step N (the rest as drawn): the same case again and again, e.g. "
                         "--kinds inproc-partition-primary --faults 20 --at-step 1")
    ap.add_argument("--only", default="",
                    help="comma-separated case numbers (from 1) of the draw to run, the others skipped: reproduces "
                         "cases of a long campaign with the same ranks, steps and damage")
    ap.add_argument("--out", type=Path, default=Path("runs/campaign"))
    ap.add_argument("--resume", action="store_true",
                    help="continue the stopped campaign in --out (same options and commit): keep its recorded "
                         "outcomes and run the cases it has not")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: the table of the campaign recorded in --out (its campaign.json and "
                         "outcomes.jsonl), with its own settings")
    ap.add_argument("--results", type=Path, default=None, metavar="PATH",
                    help="also write the campaign as one JSON document (settings and commit, machine, verdict, the "
                         "table's rows, every outcome) to PATH")
    ap.add_argument("--rejudge", default="", metavar="N[,M...]",
                    help="run nothing: judge the recorded runs of these cases (numbers from 1) of the campaign in "
                         "--out again, with this checkout's judge (tools/campaign/rejudge.py), then --report")
    args = ap.parse_args(argv)
    if args.report or args.rejudge:
        what = "--rejudge" if args.rejudge else "--report"
        try:
            settings = json.loads((args.out / "campaign.json").read_text())
        except (OSError, ValueError) as e:
            ap.error(f"{what}: no campaign recorded in {args.out}: {e}")
        outcomes = load_outcomes(args.out / "outcomes.jsonl")
        if args.rejudge:
            from .rejudge import rejudge

            try:
                numbers = sorted({int(n) for n in args.rejudge.split(",") if n.strip()})
            except ValueError:
                ap.error(f"--rejudge takes case numbers separated by commas, not {args.rejudge!r}")
            try:
                outcomes = rejudge(args.out, numbers, steps=settings["steps"], source=source_version())
            except ValueError as e:
                ap.error(str(e))
        return _finish(args.out, settings, outcomes, args.results)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    try:
        only = sorted({int(n) for n in args.only.split(",") if n.strip()})
    except ValueError:
        ap.error(f"--only takes case numbers separated by commas, not {args.only!r}")
    if only and not 1 <= only[0] <= only[-1] <= args.faults:
        ap.error(f"--only: case numbers run from 1 to --faults ({args.faults}), not {only}")
    work = args.out
    cases = draw_cases(args.faults, args.seed, steps=args.steps, kinds=kinds)
    if args.at_step is not None:
        if not 1 <= args.at_step < args.steps - 1:
            ap.error(f"--at-step: a fault's step runs from 1 to --steps - 2 ({args.steps - 2}), not {args.at_step}")
        cases = [dataclasses.replace(c, step=args.at_step) for c in cases]
    if only:
        cases = [c for c in cases if c.index + 1 in only]
    settings = _settings(args, kinds)
    if args.at_step is not None:  # only when given: the settings of earlier campaigns (and --resume) stay as they were
        settings["at_step"] = args.at_step
    if only:
        settings["only"] = only  # absent otherwise: a campaign recorded before --only existed still resumes
    results = work / "outcomes.jsonl"
    if args.resume:
        try:
            outcomes = resume_point(work, settings, cases)
        except ValueError as e:
            ap.error(str(e))
        print(f"campaign: resuming at case {len(outcomes)} of {len(cases)} (source {settings['source']})", flush=True)
    else:
        outcomes = []
        results.unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "campaign.json").write_text(json.dumps(settings, indent=1) + "\n")
    config = write_config(work / "nckpt.yaml", interval_s=args.detector_interval, timeout_s=args.detector_timeout)
    todo = cases[len(outcomes):]
    if any(c.simulate_network for c in todo):  # the partition kinds: network namespaces, or no such case at all
        from neighbor_ckpt.errors import ConfigError
        from neighbor_ckpt.runtime.netns import refuse_impossible

        try:
            refuse_impossible()
        except ConfigError as e:
            print(f"campaign: the partition kinds cannot run here: {e}", file=sys.stderr)
            return 2
    with contextlib.ExitStack() as held:
        if any(c.spec.other_user for c in todo):  # a second Unix user, or no such case at all
            from .other_user import second_user

            try:  # made here if missing, and then removed when the campaign ends, however it ends
                held.enter_context(second_user())
            except ValueError as e:
                print(f"campaign: the inproc-other-user kind cannot run here: {e}", file=sys.stderr)
                return 2
        return _run_cases(args, work, settings, config, todo, outcomes, results)


def _run_cases(args: argparse.Namespace, work: Path, settings: dict[str, Any], config: Path, todo: Sequence[Case],
               outcomes: list[Outcome], results: Path) -> int:
    """The failure-free runs the cases in ``todo`` need, then the cases, each outcome appended to ``results`` and
    ``outcomes``; the table (:func:`_finish`)."""
    bases: dict[tuple[bool, int, bool], Path] = {}
    for flavour, case in sorted({c.flavour: c for c in todo}.items(), reverse=True):
        dist_opt, tp, fixed = flavour
        out = baseline_dir(work, flavour)
        name = out.name.removeprefix("baseline-")
        bases[flavour] = out
        if args.resume and len(list(out.glob("final.rank*.json"))) == WORLD:
            continue  # the failure-free run of the stopped campaign (deterministic: the same run again)
        shutil.rmtree(out, ignore_errors=True)  # an earlier campaign's run in the same --out: its lines would stay
        flags = ["--nodes", str(NODES), "--tp", str(tp), *case.flavour_args] + ([] if dist_opt else ["--no-dist-opt"])
        rc, log = _torchrun(out, flags, job_id=f"campaign-base-{name}", store=work / "store",
                            config=config, steps=args.steps, timeout=420, max_restarts=0,
                            insurance_every=0 if args.insurance_where_needed else args.insurance_every)
        if rc != 0:
            print(f"campaign: the failure-free run failed (exit {rc}); see {out / 'torchrun.log'}", file=sys.stderr)
            return 1
    for case in todo:
        insure = args.insurance_every if case.may_fall_back or not args.insurance_where_needed else 0
        o = run_case(case, base=bases[case.flavour], work=work, steps=args.steps, config=config,
                     insurance_every=insure)
        outcomes.append(o)
        with open(results, "a") as f:
            f.write(json.dumps(asdict(o)) + "\n")
        print(f"[{case.index + 1}/{args.faults}] {case.kind:20s} rank {case.rank} step {case.step} {case.phase:9s} "
              f"tp{case.tp} {'distopt' if case.dist_opt else 'replicated':10s} -> {o.result} "
              + (f"(detected in {o.detection_s:.2f} s) " if o.detection_s is not None else "")
              + (f"(MTTR {', '.join(f'{m:.2f}' for m in mttrs(o))} s) " if mttrs(o) else "")
              + f"{o.wall_s:.0f} s {o.detail}", flush=True)
    return _finish(work, settings, outcomes, args.results)


def _finish(work: Path, settings: dict[str, Any], outcomes: Sequence[Outcome], results: Path | None) -> int:
    """Print the table of ``outcomes`` under the settings it ran with, keep it in ``<work>/table.md``, write the
    results document to ``results`` (when given); 1 if a case FAILED."""
    from tools.bench.machine import machine_info

    picked = f" (cases {settings['only']} of {settings['faults']})" if settings.get("only") else ""
    print(f"\nseed {settings['seed']}, {len(outcomes)} faults{picked}, detector timeout "
          f"{settings['detector_timeout_s']:g} s / interval {settings['detector_interval_s']:g} s, source "
          f"{settings['source']}\n")
    table = summarize(outcomes)
    print(table)
    (work / "table.md").write_text(table + "\n")
    if results is not None:
        from .rejudge import rejudged

        document = results_document(settings, outcomes, machine=machine_info(work), rejudged=rejudged(work))
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(document, indent=1) + "\n")
        print(f"\nresults: {results}")
    return 0 if all(o.result != "FAILED" for o in outcomes) else 1

