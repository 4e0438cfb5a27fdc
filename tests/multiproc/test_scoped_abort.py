"""Tier 2: the scoped gloo abort (neighbor_ckpt.inprocess.abort) on real gloo groups in 4 processes.

One rank (the victim) stops answering while the others are blocked in a collective with it: SIGSTOPped, or alive
but blocked in a C call that holds the GIL (its own monitor cannot run either). Each survivor's "monitor thread"
then aborts the attempt's sockets (its accepted side, and its side of the connections to the peers' published
listeners) and interrupts its training thread, whose user code swallows every ``Exception``. Asserted: every
survivor's collective raises within a second of its abort (tens of ms measured), the training thread unwinds with
``GenerationAborted``, and the connections that are not gloo's survive: the store's, one the process opened before
the attempt, and one it opened during the attempt to a non-gloo server.

``unpublished``: the victim's listeners are not known to the survivors (a peer cut off by the network that published
them only on the store the survivors lost): a survivor whose wait is on a pair it connected to the victim stays
blocked after the scoped abort; the escalation (``wide=True``: every connection of the attempt but the store's)
frees it, so it is not declared dead. The store's connection and the one from before the attempt survive that too.

Subprocesses rather than ``torch.multiprocessing``: the victim stays stopped until the test SIGKILLs it."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.multiproc

WORLD = 4
VICTIM = 1


def _echo_server() -> socket.socket:
    """A server thread in this process answering every connection byte for byte (the user's own service)."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        while data := conn.recv(64):
            conn.sendall(data)

    def accept() -> None:
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv


def _echoes(sock: socket.socket) -> bool:
    try:
        sock.settimeout(5)
        sock.sendall(b"ping")
        return sock.recv(4) == b"ping"
    except OSError:
        return False


def _stop_answering(scenario: str) -> None:
    if scenario == "stopped":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:  # libc sleep through PyDLL: a C call that keeps the GIL, so no thread of this process runs
        ctypes.PyDLL(None).sleep(300)
    time.sleep(300)


def _worker() -> None:
    """One process: ``rank port scenario out_dir``."""
    import torch
    import torch.distributed as dist

    from neighbor_ckpt.inprocess.abort import (GenerationAborted, SocketBaseline, abort_gloo, clear_pending,
                                               format_endpoints, interrupt_thread, new_listeners, parse_endpoints)

    rank, port, scenario, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    echo = _echo_server()
    before = socket.create_connection(echo.getsockname())  # the user's connection from before the attempt
    assert _echoes(before)  # its server side accepted before the baseline too

    baseline = SocketBaseline.capture()
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0", store), rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(WORLD)), backend="gloo")  # like megatron-core's gloo groups
    dist.new_group([0, 1, 2], backend="gloo")
    during = socket.create_connection(echo.getsockname())  # opened during the attempt, to a non-gloo server
    store.set(f"listen/{rank}", format_endpoints(new_listeners(baseline)))
    dist.barrier()
    if rank == VICTIM:
        _stop_answering(scenario)

    t = torch.ones(1 << 12)
    op: Callable[[], object]
    if scenario == "stopped":
        op = lambda: dist.all_reduce(t, group=group)  # noqa: E731
    else:  # the worst case: a wait on the victim's own pair
        op = lambda: dist.recv(t, src=VICTIM, group=group)  # noqa: E731
    errors: list[tuple[float, str]] = []
    inside = threading.Event()
    main_tid = threading.get_ident()
    abort_at: list[float] = []
    result: dict[str, object] = {}

    def monitor() -> None:
        if not inside.wait(120):
            raise AssertionError("the training thread never started its collective")
        time.sleep(1.0)  # the victim stopped, this rank (very likely) blocked in the collective; either way it errs
        known = [q for q in range(WORLD) if q != rank and not (scenario == "unpublished" and q == VICTIM)]
        peers = frozenset().union(*(parse_endpoints(store.get(f"listen/{q}").decode()) for q in known))
        abort_at.append(time.monotonic())
        res = abort_gloo(baseline, keep_ports={port}, peer_listeners=peers)
        result.update(accepted=res.accepted, to_peers=res.to_peers, abort_ms=res.seconds * 1e3)
        time.sleep(0.2)
        if scenario == "unpublished":
            time.sleep(0.8)
            result["widened"] = not errors  # still blocked on the victim's pair: the escalation
            if not errors:
                result["others"] = abort_gloo(baseline, keep_ports={port}, peer_listeners=peers, wide=True).others
                time.sleep(0.2)
        if inside.is_set():
            interrupt_thread(main_tid, GenerationAborted)

    def train() -> None:  # user code: retries whatever fails
        inside.set()
        while True:
            try:
                op()
            except Exception as e:  # noqa: BLE001
                errors.append((time.monotonic(), str(e)[:200]))
                time.sleep(0.01)

    threading.Thread(target=monitor, daemon=True).start()
    try:
        train()
    except GenerationAborted:
        result["unwound"] = True
    finally:
        inside.clear()
        clear_pending(main_tid)
    store.set(f"after/{rank}", "ok")
    result.update(rank=rank, freed_after_s=errors[0][0] - abort_at[0] if errors else None,
                  first_error=errors[0][1] if errors else None, before_ok=_echoes(before), during_ok=_echoes(during),
                  store_ok=store.get(f"after/{rank}") == b"ok")
    (out / f"result{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # no gloo destructors on broken groups (they may abort in C++)


def _run(tmp: Path, scenario: str) -> dict[int, dict[str, object]]:
    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    code = "from tests.multiproc.test_scoped_abort import _worker; _worker()"
    logs = [open(tmp / f"log{r}.txt", "w") for r in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(host.port), scenario, str(tmp)], cwd=REPO,
                              env=env, stdout=logs[r], stderr=subprocess.STDOUT) for r in range(WORLD)]
    survivors = [r for r in range(WORLD) if r != VICTIM]
    try:
        for r in survivors:
            procs[r].wait(timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    failed = {r: (tmp / f"log{r}.txt").read_text()[-3000:] for r in survivors
              if not (tmp / f"result{r}.json").exists()}
    assert not failed, failed
    return {r: json.loads((tmp / f"result{r}.json").read_text()) for r in survivors}


@pytest.mark.parametrize("scenario", ["stopped", "holds_gil", "unpublished"])
def test_scoped_abort_frees_survivors_of_a_silent_peer_and_keeps_other_connections(tmp_path: Path,
                                                                                   scenario: str) -> None:
    results = _run(tmp_path, scenario)
    freed_ms = {r: float(res["freed_after_s"]) * 1e3 for r, res in results.items()  # type: ignore[arg-type]
                if res["freed_after_s"] is not None}
    print(scenario, "ms from the rank's own abort to its collective's error:",
          {r: round(ms, 1) for r, ms in freed_ms.items()},
          "shut down (accepted, outgoing, widened: others):",
          {r: (res["accepted"], res["to_peers"], res.get("widened") and res.get("others")) for r, res in results.items()})
    assert sorted(freed_ms) == sorted(results), results  # every survivor's collective erred (how fast: printed)
    for r, res in results.items():
        assert res.get("unwound") is True, (r, res)
        assert res["before_ok"] and res["store_ok"], (r, res)
        assert res["during_ok"] or res.get("widened"), (r, res)  # the escalation shuts the attempt's others too
    assert sum(int(str(res["to_peers"])) for res in results.values()) > 0
