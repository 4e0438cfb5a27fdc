"""megatron_patches.nvrx_gloo: the CPU/gloo pieces NVRx's in-process restart needs (one process)."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_patches import nvrx_gloo
from neighbor_ckpt.errors import UnsupportedVersionError


def test_nvrx_version_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert nvrx_gloo.check_nvrx_version() == importlib.metadata.version("nvidia-resiliency-ext")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.0")
    with pytest.raises(UnsupportedVersionError, match="min-healthy"):
        nvrx_gloo.check_nvrx_version()


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    return srv, cli, peer


def test_socket_shutdown_frees_a_blocked_receive_and_keeps_the_store_port() -> None:
    # In a child process: the shutdown takes down every established TCP connection of the process it runs in, and
    # the pytest process holds other tests' stores and sockets.
    proc = subprocess.run([sys.executable, "-c", "from tests.unit.test_nvrx_gloo import _shutdown_case; _shutdown_case()"],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _shutdown_case() -> None:
    srv_a, blocked, peer_a = _pair()
    srv_k, kept, peer_k = _pair()
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(blocked.recv(10)), daemon=True)
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    n = nvrx_gloo.shutdown_tcp_connections(keep_ports=[srv_k.getsockname()[1]])
    t.join(5)
    assert not t.is_alive() and got == [b""], "the blocked recv was not freed"
    assert time.monotonic() - t0 < 1.0
    assert n >= 2  # both ends of the first pair live in this process
    kept.sendall(b"x")
    assert peer_k.recv(1) == b"x", "a connection to a kept port was shut down"
    for s in (srv_a, blocked, peer_a, srv_k, kept, peer_k):
        s.close()


def test_client_prefix_store_has_no_critical_rank() -> None:
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    store = nvrx_gloo.ClientPrefixStore("127.0.0.1", host.port, "job/0/nvrx/", timeout=timedelta(seconds=5))
    store.set("k", "v")
    assert store.get("k") == b"v" and host.check(["job/0/nvrx//k"])  # torch's PrefixStore joins with "/"
    assert store.critical_ranks == ()
    store.record_terminated_ranks([3])
    assert store.get_terminated_ranks() == {3}


def test_abort_and_finalize_are_nvrx_interfaces() -> None:
    from nvidia_resiliency_ext.inprocess.abort import Abort
    from nvidia_resiliency_ext.inprocess.finalize import Finalize

    events: list[str] = []
    abort = nvrx_gloo.gloo_abort(keep_ports=[1], on_event=lambda name, t: events.append(name))
    assert isinstance(abort, Abort)
    assert abort("state") == "state"  # no process group: AbortTorchDistributed does nothing
    assert events == ["abort_start", "abort_end"]
    ran: list[int] = []
    fin = nvrx_gloo.FinalizeMegatron(cleanups=lambda: [lambda: ran.append(1), lambda: ran.append(2)])
    assert isinstance(fin, Finalize)
    assert fin("state") == "state" and ran == [2, 1]  # last registered first


# -- neighbor_ckpt.inprocess: configuration, timers, attempts --------------------------------------------------


def test_inprocess_recovery_is_built_from_the_config_section(monkeypatch: pytest.MonkeyPatch) -> None:
    from neighbor_ckpt.config import NeighborCkptConfig
    from neighbor_ckpt.errors import ConfigError
    from neighbor_ckpt.inprocess import InprocessRecovery

    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.delenv("NEIGHBOR_CKPT_INPROCESS_TIMERS", raising=False)
    cfg = NeighborCkptConfig()
    with pytest.raises(ConfigError, match="inprocess.enabled is false"):
        InprocessRecovery.from_config(cfg, store_host="127.0.0.1", store_port=1)
    cfg.inprocess.enabled, cfg.inprocess.spares = True, 1
    inproc = InprocessRecovery.from_config(cfg, store_host="127.0.0.1", store_port=1)
    assert (inproc.world_size, inproc.spares, inproc.active_world_size) == (5, 1, 4)
    assert InprocessRecovery.from_config(cfg.inprocess, store_host="h", store_port=2).spares == 1
    cfg.inprocess.spares = 5
    with pytest.raises(ConfigError, match="5 spare"):
        InprocessRecovery.from_config(cfg, store_host="127.0.0.1", store_port=1)


def test_inprocess_timers_are_overridden_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from neighbor_ckpt.errors import ConfigError
    from neighbor_ckpt.inprocess import InprocessTimers

    assert InprocessTimers.from_env("") == InprocessTimers()
    t = InprocessTimers.from_env(" soft_timeout=10, hard_timeout=15 ")
    assert (t.soft_timeout, t.hard_timeout, t.heartbeat_interval) == (10.0, 15.0, InprocessTimers().heartbeat_interval)
    monkeypatch.setenv("NEIGHBOR_CKPT_INPROCESS_TIMERS", "barrier_timeout=30")
    assert InprocessTimers.from_env().barrier_timeout == 30.0
    for bad, msg in (("soft=1", "unknown timer 'soft'"), ("soft_timeout", "unknown timer"),
                     ("soft_timeout=x", "could not convert"), ("soft_timeout=-1", ">= 0"),
                     ("soft_timeout=9,hard_timeout=8", "must be below hard_timeout")):
        with pytest.raises(ConfigError, match=msg):
            InprocessTimers.from_env(bad)


def test_attempt_info_names_in_process_restarts_apart_from_launcher_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    from neighbor_ckpt.recovery.attempt import AttemptInfo

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert AttemptInfo.from_env() == AttemptInfo(launch=2)
    first, launch2, inproc = AttemptInfo(), AttemptInfo(launch=2), AttemptInfo(launch=2, inprocess=1)
    assert (first.label, launch2.label, inproc.label, str(inproc)) == ("0", "2", "2.1", "2.1")
    assert (first.record, launch2.record, inproc.record) == (0, 2, "2.1")  # an int, as before, without in-process
    assert (first.restarted, launch2.restarted, AttemptInfo(inprocess=1).restarted) == (False, True, True)
    assert AttemptInfo(inprocess=1).ordinal > 0 and first.ordinal == 0


def test_checkpointer_turns_its_detector_off_under_inprocess_recovery(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """One log line, no store connection: NVRx's monitors detect failures under in-process recovery."""
    import logging
    from types import SimpleNamespace

    import neighbor_ckpt.checkpointer as ck
    from neighbor_ckpt.config import NeighborCkptConfig

    cfg = NeighborCkptConfig()
    cfg.inprocess.enabled = True
    monkeypatch.setattr(ck.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(ck, "connect_store", lambda timeout_s: pytest.fail("must not dial the rendezvous store"))
    with caplog.at_level(logging.INFO, logger="neighbor_ckpt.checkpointer"):
        assert ck.NeighborCheckpointer._make_detector(SimpleNamespace(config=cfg)) is None
    lines = [r.getMessage() for r in caplog.records if "failure detector off" in r.getMessage()]
    assert len(lines) == 1 and "in-process recovery is on" in lines[0]


_ATTEMPT_JOB = r"""
import json, logging, sys
from pathlib import Path
import torch, torch.distributed as dist
from neighbor_ckpt import NeighborCkptConfig
from neighbor_ckpt.adapters import TorchOptimizerAdapter
from neighbor_ckpt.checkpointer import NeighborCheckpointer
from neighbor_ckpt.recovery.attempt import AttemptInfo

logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s", stream=sys.stdout)
tmp = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
cfg = NeighborCkptConfig.from_dict({"job_id": "att", "store": {"dir": str(tmp / "store")},
                                    "inprocess": {"enabled": True, "spares": 0}})
plain = NeighborCheckpointer(cfg, adapter=TorchOptimizerAdapter(model, opt), handle_sigterm=False)
print("PLAIN", plain.attempt.label)
plain.close(success=False)
ckpt = NeighborCheckpointer(cfg, adapter=TorchOptimizerAdapter(model, opt), handle_sigterm=False,
                            attempt=AttemptInfo(launch=0, inprocess=2))
ckpt.on_failure("RuntimeError: injected")
print("EVENT", json.dumps(json.loads(ckpt.failure.events_path.read_text())["attempt"]))
ckpt.close(success=False)
dist.destroy_process_group()
"""


def test_checkpointer_records_the_inprocess_attempt_and_warns_without_one(tmp_path: Path) -> None:
    """attempt=AttemptInfo(...) names the failure event ("0.2", not the launcher's 0 again); inprocess.enabled
    without attempt= is one warning."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    proc = subprocess.run([sys.executable, "-c", _ATTEMPT_JOB, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PLAIN 0" in proc.stdout and 'EVENT "0.2"' in proc.stdout, proc.stdout
    assert proc.stdout.count("inprocess.enabled but no attempt= given") == 1, proc.stdout
