"""Shared fixtures: run a worker under real torchrun (4 gloo processes, real restarts) and read its results;
the failure-free runs they are compared with, computed once per configuration per test run (``baseline``); and the
test tiers.

Tiers: ``scripts/test`` (plain ``pytest``) runs the quick tier: every test that is not end to end, plus the
end-to-end tests marked ``quick`` (one Lightning and one megatron-core kill-and-recover job, ...). The other
end-to-end tests are the full tier (marker ``full``, added here): deselected unless ``--all`` is given, ``-m``
names ``full``, or the test's file or node id is named on the command line
(``pytest tests/e2e/test_recipes.py`` runs that file's tests)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

from neighbor_ckpt.cli.launch import WORKER_PREFIX_ENV, worker_program
from neighbor_ckpt.cli.launch import free_ports as free_ports_below_ephemeral
from neighbor_ckpt.runtime.procs import RUN_TAG_ENV, kill_tagged, new_run_tag
from tests.warm.client import SOCKET_ENV as WARM_SOCKET_ENV

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).parent / "workers"
COLD_ENV = "NEIGHBOR_CKPT_TEST_COLD"
"""``NEIGHBOR_CKPT_TEST_COLD=1``: every end-to-end test starts its workers cold (no warm zygote, see tests/warm)."""


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (:func:`neighbor_ckpt.cli.launch.free_ports`): no other
    process's outgoing connection can be given it before the test binds it."""
    return free_ports_below_ephemeral(1)[0]


def free_ports(count: int) -> int:
    """A port ``p`` such that ``p .. p + count - 1`` can all be bound now, on every interface (the Slurm script's
    store host listens on the rendezvous port + 1: a free port alone left the next one to chance, and a gloo
    connection's ephemeral port took it once in CI), below the ephemeral range as :func:`free_port`'s."""
    for _ in range(200):
        base = free_port()
        if base + count - 1 > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


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

    def killed(self, *, restarted: bool = True) -> bool:
        """Whether a worker died and (``restarted``) torchrun restarted the group. torchrun names the first worker it
        finds dead: usually the SIGKILLed victim (``exitcode: -9``), but a survivor whose collective failed on the
        victim's closed connection can exit first (``-6``, or ``1`` for its RuntimeError when it exits fast, as a
        warm worker does). In these jobs only the injected fault makes a worker fail; what a later attempt left (its
        reports, its losses, its errors) shows the restart."""
        if "exitcode: -9" in self.log:
            return True
        died = "failed (exitcode: " in self.log
        return died and (not restarted or self._later_attempt_ran())

    def _later_attempt_ran(self) -> bool:
        if any(self.out.glob("report.rank*.attempt[1-9]*.json")):
            return True
        for p in self.out.glob("losses.rank*.jsonl"):
            if any(json.loads(line).get("attempt", 0) >= 1 for line in p.read_text().splitlines() if line.strip()):
                return True
        return any(json.loads(p.read_text()).get("attempt", 0) >= 1 for p in self.out.glob("error.rank*.json"))


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
    full_env = job_env(tmp, out, env)
    options, program = worker_program([str(WORKERS / worker)], env=full_env)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "--monitor-interval=0.5", *options, *program]
    tmp.mkdir(parents=True, exist_ok=True)
    return run_logged(cmd, tmp, out, timeout=timeout, env=full_env)


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


def assert_replaced_rank_restored_from_its_replica(baseline: RunResult, faulted: RunResult) -> dict[str, Any]:
    """The megatron-core headline kill (rank 1 SIGKILLed inside optimizer step 5, its store replaced, one torchrun
    restart), as every transport and environment must show it: the job finished, bit for bit the failure-free run
    with only step 5 computed twice; rank 1 pulled its shard of iteration 4 from its successor (weights regenerated,
    never backed up) and rank 0 restored its own slot. Returns rank 1's report of the restart."""
    assert faulted.returncode == 0, faulted.log[-6000:]
    assert faulted.killed(), "the kill did not happen"
    assert_same_training(baseline, faulted)
    assert recomputed_steps(faulted) <= {5}
    rep = faulted.report(1, 1)
    assert (rep["outcome"], rep["iteration"], rep["source"]) == ("restored", 4, "replica"), rep
    assert rep["pulled_bytes"] > 0 and rep["lazy_bytes"] == 0, "weights must be regenerated, never backed up"
    kept = faulted.report(0, 1)
    assert kept["source"] == "own" and kept["pulled_bytes"] == 0, kept
    return rep


# --- warm workers (tests/warm) --------------------------------------------------------------------------------------


_ZYGOTE: list[tuple[subprocess.Popen, str]] = []


def _warm_env() -> dict[str, str]:
    """The environment that makes every launcher of the library start its workers from the warm zygote (started on
    first use, for the rest of the session)."""
    if not _ZYGOTE:
        sock_dir = tempfile.mkdtemp(prefix="nckpt-warm-")
        path = os.path.join(sock_dir, "zygote.sock")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = open(os.path.join(sock_dir, "zygote.log"), "w")  # noqa: SIM115 - open for the zygote's lifetime
        proc = subprocess.Popen([sys.executable, "-m", "tests.warm.zygote", "--socket", path,
                                 "--parent", str(os.getpid())], env=env, cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        _ZYGOTE.append((proc, path))
    _proc, path = _ZYGOTE[0]
    return {WORKER_PREFIX_ENV: f"{sys.executable} {REPO / 'tests' / 'warm' / 'client.py'}", WARM_SOCKET_ENV: path}


@contextlib.contextmanager
def warm_workers() -> Iterator[None]:
    """For a fixture of module or session scope: its launches start their workers from the warm zygote too (unless
    ``NEIGHBOR_CKPT_TEST_COLD=1``). Such a fixture is set up before its first test's ``_worker_start``, with the
    environment of none, so without this its workers start cold (a failure-free baseline: 10 to 15 s more)."""
    if os.environ.get(COLD_ENV) == "1":
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _warm_env().items():
            mp.setenv(key, value)
        yield


def _stop_zygote() -> None:
    for proc, path in _ZYGOTE:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    _ZYGOTE.clear()


@pytest.fixture(autouse=True)
def _worker_start(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """End-to-end tests start their workers warm (forked from the zygote: tests/warm), unless marked ``cold`` or
    ``NEIGHBOR_CKPT_TEST_COLD=1``; every other test runs with neither variable set."""
    node = request.node
    warm = (node.get_closest_marker("e2e") is not None and node.get_closest_marker("cold") is None
            and os.environ.get(COLD_ENV) != "1")
    if warm:
        for key, value in _warm_env().items():
            monkeypatch.setenv(key, value)
    else:
        monkeypatch.delenv(WORKER_PREFIX_ENV, raising=False)
        monkeypatch.delenv(WARM_SOCKET_ENV, raising=False)


# --- failure-free baselines, once per configuration per test run -------------------------------------------------


@dataclass
class _Baseline:
    result: RunResult
    seconds: float
    users: list[str] = field(default_factory=list)


_BASELINES: dict[tuple[str, ...], _Baseline] = {}
"""Every failure-free run of this pytest session, by configuration: what the ``baseline`` fixture hands out."""


def _env_key(env: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f"{k}={v}" for k, v in sorted(env.items()))


class Baselines:
    """``baseline(worker, **env)``: the failure-free run of ``tests/workers/<worker>`` under torchrun with that
    environment (what :func:`run_torchrun` returns, no restarts); ``baseline.launch(config, *overrides, **env)``:
    the failure-free ``neighbor-ckpt launch configs/<config> OVERRIDES --record`` (its host store in its own
    directory). Computed when a test first asks for it, then handed to every test of the session (any file) that
    asks for the same configuration: the same :class:`RunResult`. A failed baseline fails each test that asks."""

    def __init__(self, factory: pytest.TempPathFactory, user: str) -> None:
        self._factory, self._user = factory, user

    def __call__(self, worker: str, *, nproc: int = 4, timeout: float = 420, warm: bool = False,
                 **env: Any) -> RunResult:
        """``warm``: if this call computes the run, its workers fork from the warm zygote even in a ``cold`` test (a
        cold faulted job then checks warm and cold workers against each other, bit for bit)."""
        key = ("torchrun", worker, f"nproc={nproc}", *_env_key(env))
        extra = _warm_env() if warm and os.environ.get(COLD_ENV) != "1" else {}
        return self._get(key, lambda tmp: run_torchrun(worker, tmp, nproc=nproc, timeout=timeout, **env, **extra))

    def launch(self, config: str, *overrides: str, timeout: float = 480, warm: bool = False,
               **env: Any) -> RunResult:
        """``warm``: as for :meth:`__call__`."""
        key = ("launch", config, *overrides, *_env_key(env))
        extra = _warm_env() if warm and os.environ.get(COLD_ENV) != "1" else {}
        return self._get(key, lambda tmp: run_launch(config, tmp, *overrides, timeout=timeout,
                                                     **{"NEIGHBOR_CKPT_STORE_DIR": tmp / "store", **env, **extra}))

    def _get(self, key: tuple[str, ...], run: Any) -> RunResult:
        entry = _BASELINES.get(key)
        if entry is None:
            name = "base-" + "-".join(key[1:]).replace("/", "_").replace(".", "_")[:60]
            t0 = time.monotonic()
            res = run(self._factory.mktemp(name))
            entry = _BASELINES[key] = _Baseline(res, time.monotonic() - t0)
        if self._user not in entry.users:
            entry.users.append(self._user)
        res = entry.result
        if res.returncode != 0:
            pytest.fail(f"the failure-free run {' '.join(key)} failed (exit {res.returncode}); log: {res.log[-6000:]}")
        return res


@pytest.fixture
def baseline(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Baselines:
    """The failure-free runs this test compares with (see :class:`Baselines`)."""
    return Baselines(tmp_path_factory, request.node.nodeid)


# --- tiers --------------------------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all", action="store_true", dest="all_tiers",
                     help="run every test tier (default: the quick tier; the end-to-end tests not marked quick "
                          "are the full tier, marker 'full')")


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in [("e2e", "end-to-end kill-and-recover tests (real torchrun, SIGKILL)"),
                      ("multiproc", "multi-process gloo tests"), ("gpu", "needs CUDA"),
                      ("cold", "an end-to-end test whose workers start cold, never forked from the warm zygote"),
                      ("quick", "an end-to-end test of the quick tier (scripts/test)"),
                      ("full", "the full tier: every e2e test not marked quick; run by --all (scripts/test --all)")]:
        config.addinivalue_line("markers", f"{name}: {doc}")


def _named_on_command_line(config: pytest.Config) -> list[tuple[Path, str]]:
    """(file, node id within the file or '') of every file or test named on the command line (not directories)."""
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        return []
    named = []
    for arg in config.args:
        path, _, inner = arg.partition("::")
        p = (config.invocation_params.dir / path).resolve()
        if p.is_file():
            named.append((p, inner))
    return named


def _is_named(item: pytest.Item, named: list[tuple[Path, str]]) -> bool:
    inner = item.nodeid.partition("::")[2]
    return any(item.path.resolve() == path and (not sel or inner == sel or inner.startswith((sel + "::", sel + "[")))
               for path, sel in named)


_DESELECTED: list[int] = []


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("quick"):
            item.add_marker(pytest.mark.full)
    markexpr = config.getoption("markexpr", "") or ""
    if config.getoption("all_tiers") or "full" in markexpr.replace("(", " ").replace(")", " ").split():
        return
    named = _named_on_command_line(config)
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("full") and not _is_named(item, named) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
        _DESELECTED.append(len(drop))


def pytest_unconfigure(config: pytest.Config) -> None:
    _stop_zygote()


def pytest_report_header(config: pytest.Config) -> str:
    return ("test tier: all (--all)" if config.getoption("all_tiers") else
            "test tier: quick (--all, 'scripts/test --all': every tier; naming a test file or node id runs it)")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _DESELECTED:
        terminalreporter.write_line(f"quick tier: {sum(_DESELECTED)} full-tier tests deselected "
                                    "(scripts/test --all runs every tier)")
    for _proc, path in _ZYGOTE:
        log = Path(path).with_name("zygote.log")
        forks = log.read_text(errors="replace").count(" forked ") if log.exists() else 0
        terminalreporter.write_line(f"warm workers: {forks} worker processes forked from the zygote (tests/warm); "
                                    f"tests marked cold and {COLD_ENV}=1 runs start theirs cold")
    if not _BASELINES:
        return
    terminalreporter.section("failure-free baselines (each computed once, shared by the tests that compare with it)")
    for key, entry in _BASELINES.items():
        users = ", ".join(u.rpartition("/")[2] for u in entry.users)
        terminalreporter.write_line(f"{entry.seconds:6.1f}s  {' '.join(key)}  <- {len(entry.users)} test(s): {users}")
