"""The warm zygote: imports the heavy libraries once, then forks one worker per client request (see :mod:`tests.warm`).

``python -m tests.warm.zygote --socket PATH --parent PID``: the socket appears once everything is imported; the
zygote exits when process PID (the pytest session) is gone, stopping what its forks left.

One request per connection: a 4-byte length, the JSON request (argv, env, cwd, unbuffered, client pid, the
client's parent pid) and the client's stdin/stdout/stderr as file descriptors. Replies: ``pid N`` once forked, then
``exit CODE`` or ``signal SIG`` when the fork ended. The fork:

- starts a session of its own (as torchrun starts each worker), takes the client's stdio, working directory,
  environment, argv and ``sys.path[0]``, and runs the script as ``__main__`` (``runpy``);
- answers ``os.getppid()`` with the client's parent (the launcher agent, as a cold worker would: library code
  identifies its launch by it, and a lost-node fault kills it);
- SIGKILLs itself when its client goes away (a launcher's SIGKILL reaches the client only).

What a fork started (megatron-core's manager servers, NeMo's checkpoint writers) stays in the fork's session; the
zygote stops them once every client of that run is gone.

A fork's ``/proc/<pid>/environ`` shows the client's environment, as a cold worker's would (:func:`show_environ`:
``prctl(PR_SET_MM, PR_SET_MM_MAP)`` points the kernel's record of the environment block at a copy of it): the
library kills a pid read from a store only when that process carries the launch's run tag there
(:func:`neighbor_ckpt.runtime.procs.signal_job_process`), and a harness stops a run's processes by the same tag.
Where the kernel refuses it (no ``CONFIG_CHECKPOINT_RESTORE``) the zygote says so once and the forks show the
zygote's environment.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import gc
import importlib
import io
import json
import logging
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import NoReturn

import psutil

logger = logging.getLogger("tests.warm.zygote")

PRELOAD = ("torch", "torch.distributed", "numpy", "yaml", "xxhash", "megatron.core",
           "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
           "megatron.core.pipeline_parallel", "megatron.core.transformer.moe.moe_layer", "lightning.pytorch",
           "nemo.lightning", "nemo.collections.llm")
"""What the workers of the test suite import (the library's own modules are not: each fork imports them fresh)."""

RUN_TAG_ENV = "NEIGHBOR_CKPT_HARNESS_RUN"  # neighbor_ckpt.runtime.procs.RUN_TAG_ENV (not imported here: see PRELOAD)


_PR_SET_MM, _PR_SET_MM_MAP = 35, 14  # linux/prctl.h


class _MmMap(ctypes.Structure):
    """``struct prctl_mm_map`` (linux/prctl.h)."""

    _fields_ = [*((name, ctypes.c_uint64) for name in (
        "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack", "arg_start", "arg_end",
        "env_start", "env_end")),
        ("auxv", ctypes.c_void_p), ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


_ENV_BLOCKS: list[ctypes.Array] = []
"""The environment blocks :func:`show_environ` pointed the kernel at (alive as long as the process)."""


def _set_env_block(start: int | None = None, end: int | None = None) -> str | None:
    """Point this process's environment block (``/proc/<pid>/environ``) at ``[start, end)`` (default: where it is:
    a probe that changes nothing); None when done, else why not. Only while this process runs one thread (the map
    also restates ``brk``, which a concurrent ``brk()`` would move)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sbrk.restype = ctypes.c_void_p
        with open("/proc/self/stat") as f:
            stat = f.read().rpartition(")")[2].split()

        def field(n: int) -> int:  # proc(5)'s numbering: field 3 is the first after the command name
            return int(stat[n - 3])

        mm = _MmMap(start_code=field(26), end_code=field(27), start_data=field(45), end_data=field(46),
                    start_brk=field(47), brk=int(libc.sbrk(0) or 0), start_stack=field(28), arg_start=field(48),
                    arg_end=field(49), env_start=field(50) if start is None else start,
                    env_end=field(51) if end is None else end, auxv=None, auxv_size=0, exe_fd=0xFFFFFFFF)
        if libc.prctl(_PR_SET_MM, _PR_SET_MM_MAP, ctypes.byref(mm), ctypes.sizeof(mm), 0) != 0:
            return f"prctl(PR_SET_MM_MAP): {os.strerror(ctypes.get_errno())}"
    except (OSError, AttributeError, ValueError, IndexError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def show_environ(env: dict[str, str]) -> str | None:
    """Make ``/proc/<this pid>/environ`` show ``env`` (what a harness, and the library's run-tag check, read); None
    when done, else why not."""
    block = b"".join(f"{k}={v}".encode(errors="surrogateescape") + b"\0" for k, v in env.items())
    buf = ctypes.create_string_buffer(block, len(block))
    why = _set_env_block(ctypes.addressof(buf), ctypes.addressof(buf) + len(block))
    if why is None:
        _ENV_BLOCKS.append(buf)
    return why


_SHOW_ENVIRON = True
"""Whether the forks show their client's environment (the kernel allows it: probed at start-up)."""


@dataclass
class _Run:
    """The forks of one harness run (one tag): their clients, and their sessions once they ended."""

    clients: set[int] = field(default_factory=set)
    sessions: set[int] = field(default_factory=set)
    live: set[int] = field(default_factory=set)


class Zygote:
    def __init__(self, path: str, parent: int) -> None:
        self.path, self.parent, self.pid = path, parent, os.getpid()
        self.children: dict[int, tuple[socket.socket, str]] = {}
        self.runs: dict[str, _Run] = {}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = f"{path}.tmp"
        self.listener.bind(tmp)
        os.chmod(tmp, 0o600)
        self.listener.listen(64)
        os.replace(tmp, path)  # the socket appears whole: clients wait for the path
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)

    def serve(self) -> None:
        while psutil.pid_exists(self.parent):
            for _key, _ in self.selector.select(timeout=0.2):
                conn, _ = self.listener.accept()
                self._handle(conn)  # the fork returns from here only by SystemExit
            self._reap()
            self._sweep()
        self.stop()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
            (size,) = struct.unpack("!I", data[:4])
            data = data[4:]
            while len(data) < size:
                more = conn.recv(size - len(data))
                if not more:
                    raise ConnectionError("client went away mid-request")
                data += more
            request = json.loads(data)
        except (OSError, ValueError, struct.error) as e:
            logger.warning("bad request: %s", e)
            conn.close()
            return
        conn.settimeout(None)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._child(conn, fds, request)  # never returns
        for fd in fds:
            os.close(fd)
        tag = request["env"].get(RUN_TAG_ENV) or f"client-{request['client']}"
        run = self.runs.setdefault(tag, _Run())
        run.clients.add(request["client"])
        run.live.add(pid)
        self.children[pid] = (conn, tag)
        try:
            conn.sendall(f"pid {pid}\n".encode())
        except OSError:
            pass
        logger.info("forked %d for client %d: %s", pid, request["client"], " ".join(request["argv"])[:200])

    def _child(self, conn: socket.socket, fds: list[int], request: dict) -> NoReturn:
        """In the fork: become the worker, run it, and exit with its code."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.selector.close()
        self.listener.close()
        for other, _tag in self.children.values():
            other.close()
        os.setsid()
        if _SHOW_ENVIRON:  # before any thread starts: the map restates brk
            show_environ(request["env"])
        for target, fd in enumerate(fds):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        threading.Thread(target=_watch_client, args=(conn,), name="warm-client-watch", daemon=True).start()
        _exit(_run_worker(request))

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn, tag = self.children.pop(pid)
            reply = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                     else f"exit {os.waitstatus_to_exitcode(status)}")
            try:
                conn.sendall(f"{reply}\n".encode())
            except OSError:
                pass
            conn.close()
            run = self.runs[tag]
            run.live.discard(pid)
            run.sessions.add(pid)

    def _sweep(self) -> None:
        """Stop what the forks of a finished run left (a run is finished when no client of it is alive)."""
        for tag, run in list(self.runs.items()):
            if run.live or any(_alive(c) for c in run.clients):
                continue
            _kill_sessions(run.sessions)
            del self.runs[tag]

    def stop(self) -> None:
        if os.getpid() != self.pid:
            return
        for pid in list(self.children):
            _kill(pid)
        _kill_sessions({s for run in self.runs.values() for s in run.sessions} | set(self.children))
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_sessions(sessions: set[int]) -> None:
    if not sessions:
        return
    for pid in psutil.pids():
        try:
            if os.getsid(pid) in sessions:
                _kill(pid)
        except OSError:
            continue


def _watch_client(conn: socket.socket) -> None:
    """In the fork: SIGKILL this process when its client is gone (the client never sends after its request)."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _run_worker(request: dict) -> int:
    env = request["env"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    argv = list(request["argv"])
    script = os.path.abspath(argv[0])
    sys.argv = argv
    sys.path[0] = os.path.dirname(script)
    for p in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if p not in sys.path:
            sys.path.insert(1, p)
    if request.get("unbuffered") or env.get("PYTHONUNBUFFERED"):
        for fd, name in ((1, "stdout"), (2, "stderr")):
            stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                      encoding=getattr(sys, name).encoding, errors=getattr(sys, name).errors)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    launcher_agent = int(request["ppid"])
    os.getppid = lambda: launcher_agent  # the worker's parent, as a cold start has it (see the module docstring)
    _rank_from_env()
    logging.root.handlers.clear()  # the zygote's logging setup is not the worker's
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    return code


def _exit(code: int) -> NoReturn:
    """End the fork as the interpreter ends a cold worker: ``sys.exit`` from here unwinds to the interpreter's own
    shutdown (non-daemon threads joined, atexit handlers, module teardown, finalizers). Ending with ``os._exit`` after
    the atexit handlers would save ~3-4 s of CPU per NeMo process; the one full run that tried it hung an idle rank
    of NVRx's in-process wrapper (since replaced by our own engine) in its soft timeout, which later also happened
    with this exit, so it may be worth trying again. What runs at teardown stays part of the behaviour under test
    meanwhile."""
    sys.exit(code)


def _rank_from_env() -> None:
    """Lightning reads the rank from the environment when it is imported (in the zygote: no rank)."""
    module = sys.modules.get("lightning_utilities.core.rank_zero")
    fabric = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if module is not None and fabric is not None:
        module.rank_zero_only.rank = fabric._get_rank() or 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s zygote %(levelname)s %(message)s")
    global _SHOW_ENVIRON
    why = _set_env_block()  # a probe, while this process still runs one thread (before the imports)
    if why is not None:
        _SHOW_ENVIRON = False
        logger.warning("the forks' /proc/<pid>/environ will be the zygote's (%s): the library's run-tag check "
                       "(neighbor_ckpt.runtime.procs.RUN_TAG_ENV) will not kill a fork named in a store", why)
    t0 = time.monotonic()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a worker that needs it imports it itself (and fails there)
            logger.warning("preload %s failed: %s", name, e)
    gc.freeze()  # the imports' objects: never collected in a fork, so its collections leave the shared pages alone
    logger.info("imported %d modules in %.1f s; threads: %s", len(sys.modules), time.monotonic() - t0,
                [t.name for t in threading.enumerate()])
    zygote = Zygote(args.socket, args.parent)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop() below, in the zygote only
    try:
        zygote.serve()
    finally:
        zygote.stop()


if __name__ == "__main__":
    main()
