"""Shared fixtures: run a worker under real torchrun (4 gloo processes, real restarts) and read its results."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from neighbor_ckpt.runtime.procs import RUN_TAG_ENV, kill_tagged, new_run_tag

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).parent / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunResult:
    """What a torchrun job left behind."""

    returncode: int
    out: Path
    log: str

    def losses(self) -> dict[int, dict[int, list[tuple[int, str]]]]:
        """rank -> step -> [(attempt, loss as float.hex)] in the order they were recorded."""
        res: dict[int, dict[int, list[tuple[int, str]]]] = {}
        for p in sorted(self.out.glob("losses.rank*.jsonl")):
            rank = int(p.name.split(".")[1].removeprefix("rank"))
            for line in p.read_text().splitlines():
                rec = json.loads(line)
                res.setdefault(rank, {}).setdefault(rec["step"], []).append((rec["attempt"], rec["loss"]))
        return res

    def final(self, rank: int) -> dict[str, Any]:
        return json.loads((self.out / f"final.rank{rank}.json").read_text())

    def report(self, rank: int, attempt: int) -> dict[str, Any]:
        return json.loads((self.out / f"report.rank{rank}.attempt{attempt}.json").read_text())

    def error(self, rank: int) -> dict[str, Any] | None:
        p = self.out / f"error.rank{rank}.json"
        return json.loads(p.read_text()) if p.exists() else None


def job_env(tmp: Path, out: Path, env: dict[str, Any]) -> dict[str, str]:
    full_env = dict(os.environ)
    full_env.update({
        "PYTHONPATH": os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")]),
        "OUT_DIR": str(out),
        "TEST_STORE_BASE": str(tmp / "store"),
        "PYTHONFAULTHANDLER": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    full_env.update({k: str(v) for k, v in env.items()})
    return full_env


def run_logged(cmd: list[str], tmp: Path, out: Path, *, timeout: float, env: dict[str, str]) -> RunResult:
    """Run ``cmd`` in its own process group with output to ``tmp/torchrun.log``; kill the whole group on timeout
    and afterwards. Output goes to a file, not a pipe: a helper process that outlives its worker (NeMo's checkpoint
    writers are orphaned when torchrun SIGTERMs a worker) would keep a pipe open after torchrun exited."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = tmp / "torchrun.log"
    tag = new_run_tag()
    env = {**env, RUN_TAG_ENV: tag}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, cwd=tmp)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
            log = log_path.read_text()
            pytest.fail(f"{' '.join(cmd[:6])} ... timed out after {timeout}s; log: {log_path}\n{log[-6000:]}")
        finally:
            _kill_group(proc.pid)  # reap whatever the job left behind: the launcher's group, and what its workers
            kill_tagged(tag)  # (each in a session of its own) started
    return RunResult(proc.returncode, out, log_path.read_text())


def run_torchrun(worker: str, tmp: Path, *, nproc: int = 4, max_restarts: int = 0, timeout: float = 420,
                 **env: Any) -> RunResult:
    """Run ``tests/workers/<worker>`` under ``torchrun --max-restarts``."""
    out = tmp / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "--monitor-interval=0.5", str(WORKERS / worker)]
    tmp.mkdir(parents=True, exist_ok=True)
    return run_logged(cmd, tmp, out, timeout=timeout, env=job_env(tmp, out, env))


def run_launch(config: str, tmp: Path, *overrides: str, timeout: float = 480, **env: Any) -> RunResult:
    """``neighbor-ckpt launch configs/<config> OVERRIDES --run-dir tmp/run --record``: the user's command."""
    run_dir = tmp / "run"
    out = run_dir / "record"
    cmd = [sys.executable, "-m", "neighbor_ckpt.cli", "launch", str(REPO / "configs" / config), *overrides,
           "--run-dir", str(run_dir), "--record"]
    tmp.mkdir(parents=True, exist_ok=True)
    return run_logged(cmd, tmp, out, timeout=timeout, env=job_env(tmp, out, env))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def assert_same_training(baseline: RunResult, faulted: RunResult, *, nranks: int = 4) -> None:
    """Every per-step loss equal (==, also each recomputation), final parameters and optimizer state equal."""
    base, fault = baseline.losses(), faulted.losses()
    assert sorted(base) == sorted(fault) == list(range(nranks))
    for rank in range(nranks):
        assert sorted(base[rank]) == sorted(fault[rank]), f"rank {rank} trained other steps"
        for step, recs in fault[rank].items():
            expected = base[rank][step][-1][1]
            for attempt, loss in recs:
                assert loss == expected, (f"rank {rank} step {step} attempt {attempt}: loss "
                                          f"{float.fromhex(loss)!r} != {float.fromhex(expected)!r}")
        assert faulted.final(rank) == baseline.final(rank), f"rank {rank}: final state differs"


def recomputed_steps(faulted: RunResult, attempt: int = 1) -> set[int]:
    """Steps that an attempt computed although an earlier attempt had already computed them."""
    again = set()
    for steps in faulted.losses().values():
        for step, recs in steps.items():
            attempts = [a for a, _ in recs]
            if attempt in attempts and any(a < attempt for a in attempts):
                again.add(step)
    return again


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in [("e2e", "end-to-end kill-and-recover tests (real torchrun, SIGKILL)"),
                      ("multiproc", "multi-process gloo tests"), ("gpu", "needs CUDA")]:
        config.addinivalue_line("markers", f"{name}: {doc}")
