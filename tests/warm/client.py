"""A worker process started by a launcher, run as a fork of the warm zygote (see :mod:`tests.warm`).

Usage (what ``NEIGHBOR_CKPT_WORKER_PREFIX`` makes a launcher run): ``python client.py PYTHON [-u] SCRIPT ARGS...``.
Standard library only: starting this process costs milliseconds. When the zygote cannot be reached, the worker
starts cold (``exec PYTHON [-u] SCRIPT ARGS``), saying so on stderr.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import time

SOCKET_ENV = "NEIGHBOR_CKPT_TEST_WARM_SOCKET"
CONNECT_TIMEOUT_S = 300.0
"""How long to wait for the zygote's socket: it appears once the zygote has imported everything (~25 s of CPU)."""

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
"""What a launcher sends its workers (torchrun: SIGTERM, then SIGKILL; SIGKILL of this process kills the fork
through the zygote's watch)."""


def _split(argv: list[str]) -> tuple[str, list[str], list[str]]:
    """PYTHON [-flags] SCRIPT ARGS -> (python, flags, [SCRIPT, *ARGS])."""
    python, rest = argv[0], argv[1:]
    flags = []
    while rest and rest[0].startswith("-"):
        flags.append(rest.pop(0))
    if not rest:
        raise SystemExit(f"tests/warm/client.py: no script in {argv!r}")
    return python, flags, rest


def _cold(python: str, flags: list[str], program: list[str], why: str) -> None:
    print(f"tests/warm/client.py: starting cold ({why})", file=sys.stderr, flush=True)
    os.execv(python, [python, *flags, *program])


def _connect(path: str) -> socket.socket | None:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def main() -> None:
    python, flags, program = _split(sys.argv[1:])
    path = os.environ.get(SOCKET_ENV)
    unsupported = [f for f in flags if f != "-u"]
    if not path or unsupported:
        _cold(python, flags, program, f"{SOCKET_ENV} unset" if not path else f"interpreter flags {unsupported}")
    sock = _connect(path)
    if sock is None:
        _cold(python, flags, program, f"no zygote at {path} after {CONNECT_TIMEOUT_S:.0f} s")
    request = json.dumps({"argv": program, "env": dict(os.environ), "cwd": os.getcwd(), "unbuffered": "-u" in flags,
                          "client": os.getpid(), "ppid": os.getppid()}).encode()
    socket.send_fds(sock, [struct.pack("!I", len(request)) + request], [0, 1, 2])
    replies = sock.makefile("r")
    first = replies.readline().split()
    if first[:1] != ["pid"]:
        raise SystemExit(f"tests/warm/client.py: the zygote refused: {' '.join(first)}")
    child = int(first[1])

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    how = replies.readline().split()
    if len(how) != 2:
        print("tests/warm/client.py: the zygote went away before the worker ended", file=sys.stderr, flush=True)
        os._exit(70)
    kind, value = how[0], int(how[1])
    if kind == "signal":  # die the way the fork died: the launcher reads the signal from this process
        print(f"tests/warm/client.py: the worker (pid {child}) died of signal {value}; so does this process "
              f"(pid {os.getpid()})", file=sys.stderr, flush=True)
        if value in FORWARDED:
            signal.signal(value, signal.SIG_DFL)
        os.kill(os.getpid(), value)
        time.sleep(5)
        os._exit(128 + value)
    os._exit(value)


if __name__ == "__main__":
    main()
