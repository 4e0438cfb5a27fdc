"""Another Unix user cannot starve the store gates of a running in-process launch (issue 53, item 5, end to end).

The launch (tests/e2e/inprocess_launch.py: real store hosts, one per simulated node, node 0's the primary and the
others hot standbys, each behind its gate; our launchers with ``--grow-back``; four megatron-core ranks and a hot
spare) holds its ranks inside step 4's optimizer step. Meanwhile a second Unix user (tests/other_user_drip.py:
``useradd -s /usr/sbin/nologin``, removed afterwards) opens 256 connections on every gate, each dripping a byte of
its answer every 4 s and made again when dropped, until every gate is as full as that user can make it. Then the
ranks go on and rank 1 is SIGKILLed inside step 5's optimizer step, under that siege: the generation re-forms over the
job's connections through the gates, the spare takes rank 1, node1's launcher grows back a replacement (a new
process, which connects through the gates and joins as a spare, or finds the job completed when it starts that late),
and the job ends bit for bit the failure-free run after exactly one recovery, in process, with no fall-back to the
restart path and no store failover (no store found silent, none promoted). The kernel's count of the other user's
established connections to each gate, from the kill to the first step after it, shows the siege was on; every gate
logged that user's refusals.

What it costs: 20 to 35 s on the 2-core test machine, on top of the session's failure-free in-process launch
(``inprocess_baseline``, shared with tests/e2e/test_inprocess_recovery.py and others).

CI runs as root; elsewhere this is skipped, saying why (the fixture ``nologin_user``).
"""

from __future__ import annotations

import json
import pwd
import re
import threading
import time
from pathlib import Path

import pytest

from neighbor_ckpt.inprocess.store_auth import OTHER_USERS_HANDSHAKES
from tests.conftest import RunResult
from tests.e2e.inprocess_launch import attempts, failures, launch_inprocess, load
from tests.e2e.test_inprocess_recovery import ACTIVE, SPARES, check_inprocess, first_failure
from tests.e2e.test_store_failover import store_moves
from tests.other_user_drip import CONNECTIONS, Dripper, connections_of, nologin_user  # noqa: F401 - the fixture

pytestmark = pytest.mark.e2e

STEPS, HOLD_AT_STEP, KILL_STEP = 10, 4, 5  # STEPS: the session's failure-free in-process launch (tests/e2e/conftest.py)
GATE = re.compile(r"neighbor_ckpt store host: listening on ([0-9.]+):(\d+) \(pid (\d+)\), a gate before the store on")
SAMPLE_S = 0.05
"""How often the test counts the other user's established connections to each gate (the kernel's sock_diag)."""


def _gates(log: Path, launch: threading.Thread, count: int) -> list[tuple[str, int, int]]:
    """(host, port, store host's pid) of every store host's gate, from the launch's log, once ``count`` listen."""
    deadline = time.monotonic() + 300
    while True:
        text = log.read_text(errors="replace") if log.exists() else ""
        found = sorted({(h, int(p), int(pid)) for h, p, pid in GATE.findall(text)})
        if len(found) >= count:
            return found
        assert launch.is_alive() and time.monotonic() < deadline, f"{len(found)} gate(s) listen: {text[-4000:]}"
        time.sleep(0.05)


def test_another_user_dripping_on_every_store_gate_starves_no_part_of_an_in_process_recovery_with_grow_back(
        nologin_user: pwd.struct_passwd, inprocess_baseline: RunResult, tmp_path: Path) -> None:  # noqa: F811
    release, out = tmp_path / "release", tmp_path / "out"
    result: dict[str, RunResult] = {}
    # HANG_TIMEOUT: every rank waits in the held step meanwhile, which the hang detector must not take for a hang
    launch = threading.Thread(target=lambda: result.setdefault("res", launch_inprocess(
        tmp_path, grow_back=True, STEPS=STEPS, FAULT="kill", KILL_RANK=1, KILL_STEP=KILL_STEP,
        HOLD_AT_STEP=HOLD_AT_STEP, HOLD_FILE=release, HANG_TIMEOUT=60)))
    drippers: dict[int, Dripper] = {}
    samples: list[tuple[float, dict[int, int]]] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(SAMPLE_S):
            samples.append((time.time(), connections_of(nologin_user.pw_uid, set(drippers))))

    sampler = threading.Thread(target=sample, name="count-drippers", daemon=True)
    launch.start()
    try:
        gates = _gates(tmp_path / "torchrun.log", launch, ACTIVE + SPARES)  # one store host per node
        for host, port, _pid in gates:
            drippers[port] = Dripper(nologin_user.pw_name, port, host)
        sampler.start()
        held = [out / f"held.rank{r}.json" for r in range(ACTIVE)]
        while not all(p.exists() for p in held):
            assert launch.is_alive(), "the launch ended before its ranks held"
            time.sleep(0.1)
        # every gate as full as the other user can make it: all its connections made, some in a handshake (a slot
        # of this node's other users held), the rest closed unanswered (no slot left for this user)
        full = {port: d.wait_for(f"all connections made on the gate at port {port} and that gate full for this user",
                                 lambda s: s["connects"] >= CONNECTIONS and s["challenged"] >= 1 and s["dropped"] >= 1)
                for port, d in drippers.items()}
        assert {s["uid"] for s in full.values()} == {nologin_user.pw_uid}, full
        release.touch()
        launch.join()
        alive = {port: d.proc.poll() is None for port, d in drippers.items()}
    finally:
        release.touch()
        launch.join()
        sampling.set()
        if sampler.is_alive():
            sampler.join()
        for d in drippers.values():
            d.stop()
    res = result["res"]
    (out / "other_user.json").write_text(json.dumps(  # what the test saw of the other user, for a failure's reader
        {"uid": nologin_user.pw_uid, "gates": gates, "established": samples,
         "drippers": {port: d.history for port, d in drippers.items()}}))
    # one recovery, in process: the spare took rank 1, the survivors kept their processes, bit for bit
    mttr = check_inprocess(inprocess_baseline, res, kind="kill")
    assert first_failure(res)[0] in ("exited", "exception"), failures(res)
    assert {g for g, _, _ in failures(res)} == {0}, f"more than one recovery: {failures(res)}"
    assert sorted(p.name for p in (res.out / "reports").glob("recovery_timeline.attempt*.json")) == \
        ["recovery_timeline.attempt0.1.json"], "one recovery timeline, in process"
    assert attempts(res, launch=1) == [] and "restart 1 of" not in res.log, "no fall-back to the restart path"
    # grown back: node1's launcher started a replacement for the killed process (process 5), which joins as a spare
    # through the gates (or, started as the job completes, finds the completion marker first); it takes no rank
    assert re.search(r"process 1 \(pid \d+\) .*declared dead; replacement process 5 \(pid \d+\) started, joins as a "
                     r"spare", res.log), res.log[-8000:]
    assert [a for a in attempts(res) if a["initial_rank"] == 5] == []
    joined = "process 5: started during generation 1: a spare from generation 2 on" in res.log
    assert joined or "the job completed before this process joined it" in res.log, res.log[-8000:]
    # no store failover: nobody found a store silent, nobody moved to a standby
    assert store_moves(res) == [] and "failing over" not in res.log, res.log[-8000:]
    # the other user's drippers were on every gate through the recovery, as the kernel counts them
    fault = load(out / "fault.json")["unix"]
    end = fault + mttr["first_step_end"]  # the first step after the kill ended on every rank
    during = [c for t, c in samples if fault <= t <= end]
    assert len(during) >= 2, f"the other user's connections counted {len(during)} time(s) from the kill to the first " \
        f"step after it ({fault} to {end}): {samples[-5:]}"
    # at every count connected to every gate, and at some count in every handshake slot a gate gives that user
    least = {port: min(c[port] for c in during) for port in drippers}
    most = {port: max(c[port] for c in during) for port in drippers}
    assert min(least.values()) >= 1 and min(most.values()) >= OTHER_USERS_HANDSHAKES, \
        f"the other user's connections per gate from the kill to the first step after it: fewest {least}, most {most}"
    assert all(alive.values()), f"the other user's program ended early: {alive}"
    # every gate refused the other user's connections beyond its slots (one line per address per minute each)
    refusing = {int(pid) for pid in re.findall(
        rf"store host \(pid (\d+)\): store gate: refused a client from \S+ \(uid {nologin_user.pw_uid}\): the "
        rf"{OTHER_USERS_HANDSHAKES} handshakes of this node's other users already under way", res.log)}
    assert refusing == {pid for _, _, pid in gates}, (refusing, gates)
    made = sum(d.last.get("connects", 0) for d in drippers.values())
    expired = sum(d.last.get("dropped_after_drips", 0) for d in drippers.values())
    print(f"\n[gate starvation] {len(drippers)} gates, {CONNECTIONS} dripping connections of uid "
          f"{nologin_user.pw_uid} each ({made} connects in all, {expired} dripping handshakes closed at their "
          f"deadline); from the kill to the first step after it ({end - fault:.2f} s, {len(during)} counts) "
          f"established per gate: fewest {sorted(least.values())}, most {sorted(most.values())}; the grown-back "
          f"replacement {'joined as a spare' if joined else 'started as the job completed'}")

