"""How a case is judged: its losses, samples and final state against the failure-free run (``==``), a fallback against
that run resumed from the same insurance checkpoint, a shrink within 1e-4 on the same samples; and the log lines
that say why a case failed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["compare", "compare_fallback", "compare_resized", "failed_generations", "failure_lines",
           "insurance_iteration", "node_loss", "other_user", "other_user_notes", "partition", "recoveries",
           "recoveries_from", "restart_attempts", "CUT_OFF", "FOREIGN"]

_REPORT_RE = re.compile(r"^report\.rank\d+\.attempt(\d+)(?:\.\d+)*\.json$")


def _losses_by_attempt(out: Path) -> dict[int, dict[int, list[tuple[int, str]]]]:
    """rank -> step -> [(launcher restart count, loss), ...] in the order trained."""
    per_rank: dict[int, dict[int, list[tuple[int, str]]]] = {}
    for path in out.glob("losses.rank*.jsonl"):
        rank = int(path.name.split(".")[1][4:])
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            per_rank.setdefault(rank, {}).setdefault(rec["step"], []).append((int(rec.get("attempt", 0)), rec["loss"]))
    return per_rank


def _losses(out: Path) -> dict[int, dict[int, list[str]]]:
    """rank -> step -> [loss, ...] in the order trained."""
    return {rank: {step: [loss for _, loss in recs] for step, recs in steps.items()}
            for rank, steps in _losses_by_attempt(out).items()}


def _finals(out: Path) -> dict[int, Any]:
    return {int(p.name.split(".")[1][4:]): json.loads(p.read_text()) for p in out.glob("final.rank*.json")}


def compare(base: Path, run: Path, *, steps_only: bool = False) -> str:
    """'' when ``run`` trained exactly what ``base`` did (every loss, recomputations included, and finals);
    ``steps_only``: only that every rank trained every step."""
    b, r = _losses(base), _losses(run)
    if sorted(b) != sorted(r):
        return f"ranks {sorted(r)} != {sorted(b)}"
    for rank in b:
        if sorted(b[rank]) != sorted(r[rank]):
            return f"rank {rank} trained steps {sorted(r[rank])}, expected {sorted(b[rank])}"
    if steps_only:
        return ""
    for rank in b:
        for step, losses in r[rank].items():
            if any(x != b[rank][step][-1] for x in losses):
                return f"rank {rank} step {step}: loss {losses} != {b[rank][step][-1]}"
    if _finals(base) != _finals(run):
        return "final parameters or optimizer state differ"
    return ""


def _samples(out: Path) -> dict[int, list[int]]:
    """step -> the sorted samples the ranks trained in it, in the last (launch attempt, in-process generation) that
    trained it (a shrink's ranks are other processes than before it)."""
    per_step: dict[int, dict[tuple[int, int], list[int]]] = {}
    for path in out.glob("losses.rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            when = (int(rec.get("attempt", 0)), int(rec.get("generation", 0)))
            per_step.setdefault(rec["step"], {}).setdefault(when, []).extend(rec.get("samples") or [])
    return {step: sorted(by[max(by)]) for step, by in per_step.items()}


def compare_resized(base: Path, run: Path, *, fault_step: int, rel: float = 1e-4) -> str:
    """'' when a shrink trained what it should: every step; before ``fault_step`` every rank's loss equal to the
    failure-free run (the same layout); from it on, rank 0's losses within ``rel`` (another data-parallel size
    reduces in another order); every step's samples, over all ranks, those of the failure-free run (the global batch
    kept)."""
    b, r = _losses(base), _losses(run)
    if not r or sorted(r[0]) != sorted(b[0]):
        return f"rank 0 trained steps {sorted(r.get(0, {}))}, expected {sorted(b[0])}"
    for rank, steps in r.items():
        for step, losses in steps.items():
            if step < fault_step and rank in b and any(x != b[rank][step][-1] for x in losses):
                return f"rank {rank} step {step} (before the shrink): loss {losses} != {b[rank][step][-1]}"
    for step, losses in r[0].items():
        want, got = float.fromhex(b[0][step][-1]), float.fromhex(losses[-1])
        if abs(got - want) > rel * abs(want):
            return f"step {step}: loss {got!r} not within {rel:g} of {want!r}"
    sb, sr = _samples(base), _samples(run)
    for step in sb:
        if sr.get(step) != sb[step]:
            return f"step {step} trained samples {sr.get(step)}, expected {sb[step]} (the global batch)"
    return ""


def insurance_iteration(run: Path) -> int | None:
    """The insurance iteration a fallback restored: the one iteration the recovery reports with outcome
    ``insurance`` name (None: no such report, or reports that disagree)."""
    its = set()
    for path in run.glob("report.rank*.attempt*.json"):
        rep = json.loads(path.read_text())
        if rep.get("outcome") == "insurance" and rep.get("iteration") is not None:
            its.add(int(rep["iteration"]))
    return its.pop() if len(its) == 1 else None


def _launch_of(attempt: Any) -> int | None:
    """The launcher attempt of a record's ``attempt`` (``3`` or ``"<launch>.<in-process restart>"``)."""
    try:
        return int(str(attempt).split(".")[0])
    except ValueError:
        return None


def _timelines(run: Path) -> list[dict[str, Any]]:
    """Every recovery timeline rank 0 wrote to ``<run>/reports`` (``recovery_timeline.*.json``, however many per
    attempt), in the order the recoveries happened (their first known event; the file name breaks ties)."""
    found = []
    for path in (run / "reports").glob("recovery_timeline.*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # half written: a job killed while writing it
        if not isinstance(data, dict):
            continue
        times = [t for t in (data.get("events_unix") or {}).values() if isinstance(t, (int, float))]
        found.append((min(times) if times else float("inf"), path.name, data))
    return [dict(data, file=name) for _, name, data in sorted(found, key=lambda x: (x[0], x[1]))]


def restart_attempts(run: Path) -> list[int]:
    """The launcher attempts after the first (restart count >= 1) that really ran in ``run``: a process of that
    attempt wrote its recovery report (``report.rank<R>.attempt<N>[.<M>].json``) or rank 0 its recovery timeline."""
    launches = {int(m.group(1)) for p in run.glob("report.rank*.attempt*.json") if (m := _REPORT_RE.match(p.name))}
    launches.update(n for t in _timelines(run) if (n := _launch_of(t.get("attempt"))) is not None)
    return sorted(n for n in launches if n >= 1)


def recoveries(run: Path) -> list[dict[str, Any]]:
    """One entry per recovery of ``run`` (every recovery timeline, in order): ``attempt``, ``mode`` (``in-process``
    or ``restart``), ``mttr_s`` (the timeline's MTTR) and ``detection_s`` (its ``detect`` phase; None: unknown), and
    the timeline's ``file``."""
    out = []
    for t in _timelines(run):
        mttr, detect = t.get("mttr_s"), (t.get("phases_s") or {}).get("detect")
        out.append({"attempt": t.get("attempt"), "mode": t.get("mode"),
                    "mttr_s": None if mttr is None else float(mttr),
                    "detection_s": None if detect is None else float(detect), "file": t["file"]})
    return out


def recoveries_from(run: Path, unix: float) -> list[dict[str, Any]]:
    """:func:`recoveries` measured from ``unix`` (a partition's cut, ``fault.json``) instead of each timeline's own
    fault estimate (the last heartbeat or snapshot its witness saw, which a cut that silences nobody's process at once
    can place well after the cut): ``mttr_s`` to the timeline's ``first_step_end``, ``detection_s`` to its
    ``failure_noticed`` (None where the timeline lacks the event)."""
    out = []
    for t, entry in zip(_timelines(run), recoveries(run)):
        events = t.get("events_unix") or {}
        end, noticed = events.get("first_step_end"), events.get("failure_noticed")
        out.append(dict(entry, mttr_s=None if end is None else float(end) - unix,
                        detection_s=None if noticed is None else float(noticed) - unix, measured_from="the cut"))
    return out


def compare_fallback(base: Path, resumed: Path, run: Path, *, insurance_step: int) -> str:
    """'' when a fallback case trained what it should, bit for bit: what the first launch attempt trained equals the
    failure-free run ``base``; every step from ``insurance_step + 1`` on trained after the fallback (a later launcher
    attempt) equals ``resumed``, the failure-free run resumed from the same insurance checkpoint (a fresh process
    replays those steps from that checkpoint, not from the uninterrupted run's RNG and state); every rank trained
    every step; the final parameters and optimizer state equal ``resumed``'s."""
    missing = compare(base, run, steps_only=True)
    if missing:
        return f"fell back to insurance but did not finish training: {missing}"
    b, rs, r = _losses(base), _losses(resumed), _losses_by_attempt(run)
    for rank, steps in r.items():
        for step, recs in steps.items():
            for attempt, loss in recs:
                if attempt == 0:
                    expected, what = b[rank][step][-1], "the failure-free run"
                elif step > insurance_step and step in rs.get(rank, {}):
                    expected, what = rs[rank][step][-1], f"the failure-free run resumed from insurance {insurance_step}"
                else:
                    return f"rank {rank} step {step} trained in launch attempt {attempt}, before insurance {insurance_step}"
                if loss != expected:
                    return f"rank {rank} step {step} attempt {attempt}: loss {loss} != {expected} ({what})"
    if _finals(resumed) != _finals(run):
        return f"final parameters or optimizer state differ from the run resumed from insurance {insurance_step}"
    return ""


_GENERATION_FAILED_RE = re.compile(r"generation (\d+) failed \((\w+) by ([^)]+)\)")


def failed_generations(log: str) -> list[tuple[int, str, str]]:
    """Every ``generation G failed (KIND by WHO)`` line of an in-process launch's processes, deduplicated (each
    survivor logs the one record that stands): sorted (G, KIND, WHO)."""
    return sorted({(int(g), k, w) for g, k, w in _GENERATION_FAILED_RE.findall(log)})


def node_loss(log: str, run: Path, *, node: str, processes: tuple[int, ...], spare_node: bool) -> str:
    """'' when the loss of ``node`` (whose processes were ``processes``) was found and recovered as one failure:
    a monitor declared every one of them dead in one decision (``node <node> is lost: ... declaring its process(es)
    [...] dead together``), none of them was declared on its own (one after the other), generation 0 is the only one
    that failed, and rank 0 wrote one recovery timeline, in process, no process restarted, with its detection known
    and measured from the fault; ``spare_node``: the spares took exactly the lost ranks (those of ``processes``),
    else the job went from DP 4 to 2 (elastic). Otherwise what differs."""
    together = re.search(rf"node {re.escape(node)} is lost: process \d+ sent no heartbeat for [^\n]*: declaring its "
                         rf"process\(es\) {re.escape(str(list(processes)))} dead together", log)
    if together is None:
        return f"no decision declared {node}'s processes {list(processes)} dead together"
    alone = [p for p in processes if re.search(rf"process {p} sent no heartbeat for [^\n]*declaring it dead", log)]
    if alone:
        return f"{node}'s process(es) {alone} declared dead on their own, one after the other"
    generations = sorted({g for g, _, _ in failed_generations(log)})
    if generations != [0]:
        return f"generations {generations} failed, expected only generation 0 (one failure)"
    timelines = _timelines(run)
    if len(timelines) != 1:
        return f"{len(timelines)} recovery timelines ({[t['file'] for t in timelines]}), expected one"
    t = timelines[0]
    if t.get("mode") != "in-process" or t.get("restarted_ranks") != []:
        return f"the recovery was {t.get('mode')} with restarted ranks {t.get('restarted_ranks')} ({t['file']})"
    detect = (t.get("phases_s") or {}).get("detect")
    if detect is None or not str(t.get("detect_from", "")).startswith("the fault"):
        return (f"the timeline has no detection measured from the fault (detect {detect}, from "
                f"{t.get('detect_from')!r}; {t['file']})")
    if spare_node and sorted(t.get("spare_ranks") or []) != list(processes):
        return f"the spares took ranks {t.get('spare_ranks')}, expected {list(processes)} ({t['file']})"
    if not spare_node and (t.get("data_parallel_before"), t.get("data_parallel_after")) != (4, 2):
        return (f"data-parallel {t.get('data_parallel_before')} -> {t.get('data_parallel_after')}, expected 4 -> 2 "
                f"({t['file']})")
    return ""


CUT_OFF = "cut off from the majority"
"""What a process that cannot see a majority logs (one line) before it exits."""


def _lines_of(log: str, process: int) -> list[str]:
    """The log lines process ``process`` wrote about itself (the engine's ``process P: ...`` and
    ``process P (rank R): ...``)."""
    return [line for line in log.splitlines() if re.search(rf"(INFO|WARNING|ERROR):? process {process}\b", line)]


def partition(log: str, *, nodes: list[int], traffic: str, heal_after_s: float | None, processes: int, spare: int,
              rank: int, store: Path | None = None, cut_unix: float | None = None) -> str:
    """'' when a partition of ``nodes`` (one process per node: process ``i`` on node ``i``; ``processes`` in all) went
    as it must: the cut was made (``traffic``); with ``all`` traffic each process cut off said it is cut off from the
    majority (or its launcher did first, which then stops it: each has its lease, :mod:`neighbor_ckpt.inprocess.quorum`)
    and formed no generation after generation 0, and no slot of its node's host store (``store/node<i>``)
    was written after the cut (``cut_unix``); with ``ranks`` traffic the majority found the node unreachable over
    the ranks' network; with ``heal_after_s`` the cut healed and no process of the majority was declared dead by the
    others; and spare process ``spare`` took rank ``rank``'s place in generation 1 (one recovery). Otherwise what
    differs."""
    made = f"fault injection: node(s) {nodes} cut off ({traffic} traffic)"
    if made not in log:
        return f"the cut was not made (no line {made!r})"
    if traffic == "ranks":
        found = f"process(es) {nodes} unreachable from a majority over the ranks' network"
        if found not in log:
            return f"no line {found!r}"
    else:
        for p in nodes:
            mine = _lines_of(log, p)
            if not any(CUT_OFF in line for line in mine) and f"launcher node{p}: {CUT_OFF}" not in log:
                return f"process {p} (cut off) never said it is {CUT_OFF}, nor did its launcher (node{p})"
            formed = [line for line in mine if re.search(r": generation [1-9]\d*: ", line)]
            if formed:
                return f"process {p} of the minority formed a generation: {formed[0].strip()[:200]}"
            written = [] if store is None or cut_unix is None else sorted(
                str(f) for f in (store / f"node{p}").rglob("*.slot") if f.is_file() and f.stat().st_mtime > cut_unix)
            if written:
                return f"node{p} (cut off) wrote snapshot slots after the cut: {written[:3]}"
    if heal_after_s is not None:
        healed = f"the partition of node(s) {nodes} healed after {heal_after_s:g} s"
        if healed not in log:
            return f"the cut did not heal before the launch ended (no line {healed!r})"
        fenced = [p for p in range(processes) if p not in nodes
                  and any("declared dead by the others" in line for line in _lines_of(log, p))]
        if fenced:
            return f"process(es) {fenced} of the majority fenced after the heal"
    took = f"hot spare (process {spare}) takes rank {rank}'s place in generation 1"
    if took not in log:
        return f"no line {took!r}"
    return ""


FOREIGN = "killed by another user"
"""The reason the other user's ``dead`` entries give (tools/store_probe.py): a job that logs it read one of them."""
_DECLARED_RE = re.compile(r"\): process (\d+) \(pid \d+\) [^\n]*?[:;] declared dead|"
                          r"process (\d+)(?: \(rank \d+\))?: declared dead by the others")
"""A launcher declaring its process dead (it exited, or it was listed dead already), or a process finding itself
declared dead by the others."""


def other_user(log: str, run: Path, *, victim: int, spare: int) -> str:
    """'' when the other user (``inproc-other-user``) got nothing and changed nothing: its probe
    (``<run>/other_user.json``, :mod:`tools.campaign.other_user`) ran as that user, made attempts on every gate of
    the launch and on at least one store behind them, every one refused, and its process lived to the end; the job
    never read an entry of theirs (no :data:`FOREIGN` in its log), declared only ``victim`` dead, failed in
    generation 0 only, and spare process ``spare`` took the victim's rank in one in-process recovery (one recovery
    timeline, no process restarted). Otherwise what differs."""
    path = run / "other_user.json"
    if not path.exists():
        return "the other user's probe left no summary (other_user.json)"
    s = json.loads(path.read_text())
    if not s.get("started") or s.get("uid") is None or s.get("uid") != s.get("other_uid") or s.get("uid") == 0:
        return f"the probe did not run as the other user (started {s.get('started')}, uid {s.get('uid')}, " \
               f"the other user's {s.get('other_uid')}): {s.get('stderr', '')[-300:]}"
    if s.get("served"):
        return f"{s['attempts'] - s['refused']} of {s['attempts']} attempts of the other user were answered: " \
               f"{json.dumps(s['served'][:2])[:400]}"
    if s.get("attempts", 0) == 0 or s.get("refused") != s.get("attempts"):
        return f"the other user's attempts: {s.get('attempts')}, refused {s.get('refused')}"
    probed = {tuple(a) for a in s.get("addresses", [])}
    gates = {tuple(a) for a in s.get("gates", [])}
    if not gates or not gates <= probed or len(probed - gates) < 2:
        return (f"the other user probed {sorted(probed)}: not every gate of the launch ({sorted(gates)}) and a store "
                "behind one and its door")
    if not s.get("alive_at_end"):
        return "the other user's probe process did not live to the end of the launch"
    if FOREIGN in log:
        line = next(ln for ln in log.splitlines() if FOREIGN in ln)
        return f"the job read an entry the other user wrote: {line.strip()[:200]}"
    declared = sorted({int(a or b) for a, b in _DECLARED_RE.findall(log)})
    if declared != [victim]:
        return f"processes {declared} declared dead, expected only the victim {victim}"
    generations = sorted({g for g, _, _ in failed_generations(log)})
    if generations != [0]:
        return f"generations {generations} failed, expected only generation 0 (one failure)"
    took = f"hot spare (process {spare}) takes rank {victim}'s place in generation 1"
    if took not in log:
        return f"no line {took!r}"
    timelines = _timelines(run)
    if len(timelines) != 1 or timelines[0].get("mode") != "in-process" or timelines[0].get("restarted_ranks") != []:
        return f"recoveries {[(t.get('mode'), t.get('restarted_ranks'), t['file']) for t in timelines]}, expected " \
               "one in process with no process restarted"
    return ""


def other_user_notes(run: Path) -> str:
    """The other user's attempts in one phrase, for the outcome's notes ('' without ``<run>/other_user.json``)."""
    path = run / "other_user.json"
    if not path.exists():
        return ""
    s = json.loads(path.read_text())
    by = ", ".join(f"{how} {n}" for how, n in sorted(s.get("by", {}).items()))
    addresses = [tuple(a) for a in s.get("addresses", [])]
    gates = sum(list(a) in s.get("gates", []) for a in addresses)
    doors = sum(a[0] == "127.0.0.2" for a in addresses)
    return (f"other user: {s.get('attempts')} attempts in {s.get('span_s', 0):g} s on {len(addresses)} store "
            f"addresses ({gates} gates, {len(addresses) - gates - doors} stores behind them, {doors} doors), "
            f"{s.get('refused')} refused ({by}); its process "
            + ("alive at the end" if s.get("alive_at_end") else "NOT alive at the end"))


_FAILURE_RE = re.compile(r"failed \(exitcode: -?\d+\) local_rank|detected a failure \((?!sigterm)|Traceback|"
                         r"^\[rank\d+\]:?\s*[\w.]*(Error|Exception)\b|rank \d+: .*(refused|failed|cannot)|attempt \d+|"
                         r"generation \d+ failed \(\w+ by|recovery gives up on|not restarting")


def failure_lines(log: str, *, limit: int = 12) -> str:
    """The lines of a torchrun log that say which worker failed how, in every attempt (what a FAILED case reports;
    torchrun's own exit code is 1 whatever happened)."""
    hits = [line.strip()[:240] for line in log.splitlines() if _FAILURE_RE.search(line)]
    return " | ".join(hits[-limit:]) or " | ".join(log.strip().splitlines()[-3:])[-300:]
