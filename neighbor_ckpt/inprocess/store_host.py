"""A TCP store in a process of its own, for in-process recovery.

The engine's generations, the per-generation process groups and the launchers' reports live in one
``torch.distributed.TCPStore`` at a time: hosted by rank 0, killing rank 0 would take it down with it, and the
survivors could not re-form. Every node's launcher runs one of these (the first node's is the primary, the others
hot standbys, :mod:`neighbor_ckpt.inprocess.stores`); each lives until it is terminated, or until the process given
with ``--parent`` is gone (its launcher: losing the node loses its store host too)::

    python -m neighbor_ckpt.inprocess.store_host --port 29650 [--host 0.0.0.0] [--parent PID] [--ready FILE]
        [--token-file FILE] [--listen-fd FD]

``--ready FILE`` is written once the store listens (the launcher waits for it before it starts its processes).
``--listen-fd FD``: serve on this inherited listening socket instead of binding ``--host:--port``: a single-machine
launch binds every store's port before anything starts and hands each socket down (launcher, then store host), so no
other process can take the port between its choice and its use (:func:`neighbor_ckpt.cli.launch.run_inprocess`).
With ``--token-file`` (every launch's launchers pass it) the store itself listens on the loopback interface only,
sealed before torch serves it with a key of this process's that only the gate signs with (torch's own client comes
in through a :class:`~neighbor_ckpt.inprocess.store_auth.Door`; no other user of the node reaches the store:
:mod:`~neighbor_ckpt.inprocess.loopback`), and a :class:`~neighbor_ckpt.inprocess.store_auth.Gate` on
``--host:--port`` admits the clients that hold the job's token.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``0`` picks a free port), not listening yet: what must hold before the
    kernel completes any connection to it (a seal) is put on it before :func:`start_listening`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def start_listening(sock: socket.socket, backlog: int = 16384) -> socket.socket:
    sock.listen(backlog)
    return sock


def listen_socket(host: str, port: int, backlog: int = 16384) -> socket.socket:
    """A socket listening on ``host:port`` only (``0.0.0.0``/``::``: every interface), for the store server.

    torch's own server listens on every interface, as IPv6 with IPv4 mapped into it, and looks each new client's
    address up by name (``getnameinfo``) on its one event-loop thread before it serves anything else: a mapped
    ``::ffff:10.0.0.7`` is in no hosts file, so each connection waits for a reverse DNS answer. Seen here: a burst of
    connections after a failover met a DNS server that stopped answering, and the store served nobody for 5 s per
    connection. An IPv4 socket bound to the job's address gives plain IPv4 peers (``127.0.0.1`` is in
    ``/etc/hosts``) and keeps the store off the other interfaces."""
    return start_listening(bound_socket(host, port), backlog)


def failed_path(ready: Path) -> Path:
    """Where a store host that cannot start writes why (one line), beside its ``--ready`` file."""
    return ready.with_name(ready.name + ".failed")


class OpenStoreRefused(RuntimeError):
    """The store behind the gate cannot be sealed here and the job did not ask for an open one by name."""


OPEN_STORE_KEY = "launch.open_store"
"""The job file's key that accepts a store open to the node's users where the kernel cannot seal it."""


def _sealed_listener(host: str, *, allow_open: bool = False) -> tuple[socket.socket, bytes | None, Any]:
    """The store's listening socket on ``host`` (loopback, a free port), with the
    :class:`~neighbor_ckpt.inprocess.store_auth.Door` that lets torch's own client in (to close once torch's server
    has started): (socket, key, door). The order is bind, seal, listen: the kernel completes no connection before the
    key is on the socket (a connection completed in between would reach torch's store unsigned, with full rights).

    Without TCP-MD5 in this kernel, or without the door's address, the store would be open to every user of the node:
    :class:`OpenStoreRefused` unless ``allow_open`` (the job file's :data:`OPEN_STORE_KEY`), which gives
    (socket, None, None) and says so in one warning."""
    from neighbor_ckpt.inprocess import loopback, store_auth

    key = loopback.new_key()
    why = "no port for its door"
    for _ in range(8):  # a port free on host but taken on the door's address: another port
        sock = bound_socket(host, 0)
        try:
            door = store_auth.Door(sock.getsockname()[:2], key)
        except OSError as e:
            sock.close()
            why = f"{store_auth.DOOR_HOST} at its port: {e.strerror or e}"
            if e.errno == errno.EADDRINUSE:
                continue
            break
        try:
            loopback.seal(sock, key)
        except loopback.Unsealable as e:
            door.close()
            sock.close()
            why = str(e)
            break
        return start_listening(sock), key, door
    if not allow_open:
        raise OpenStoreRefused(
            f"the store behind the gate cannot be sealed on this node ({why}), so every user of the node could reach "
            f"it: not started. Enable TCP-MD5 (CONFIG_TCP_MD5SIG, no FIPS mode) and the loopback address "
            f"{store_auth.DOOR_HOST}, or accept an open store by setting {OPEN_STORE_KEY}: true in the job file")
    sock = listen_socket(host, 0)
    logging.getLogger(__name__).warning("the store behind the gate (%s:%d) is open to every user of this node (%s: "
                                        "true): %s", *sock.getsockname()[:2], OPEN_STORE_KEY, why)
    return sock, None, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=None, help="the port to bind (not with --listen-fd)")
    ap.add_argument("--listen-fd", type=int, default=None, help="serve on this inherited listening socket")
    ap.add_argument("--parent", type=int, default=None, help="exit when this process is gone")
    ap.add_argument("--ready", type=Path, default=None, help="write this file once the store listens")
    ap.add_argument("--token-file", type=Path, default=None,
                    help="admit only the clients that hold this file's token (store_auth)")
    ap.add_argument("--open-store", action="store_true",
                    help=f"serve the store open to the node's users where it cannot be sealed ({OPEN_STORE_KEY})")
    args = ap.parse_args(argv)
    if (args.port is None) == (args.listen_fd is None):
        ap.error("give --port or --listen-fd (one of them)")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s neighbor_ckpt store host (pid {os.getpid()}): %(message)s")

    import torch.distributed as dist

    from neighbor_ckpt.inprocess import store_auth

    token = None if args.token_file is None else store_auth.read_token(args.token_file)
    if args.listen_fd is not None:
        public = socket.socket(fileno=args.listen_fd)
        args.host, args.port = public.getsockname()[:2]
    else:
        try:
            public = listen_socket(args.host, args.port)
        except OSError as e:  # one line for the launcher (it names the node and stops or goes on without this store)
            why = f"cannot listen on {args.host}:{args.port}: {e.strerror or e}"
            logging.getLogger(__name__).error("%s", why)
            if args.ready is not None:
                failed_path(args.ready).write_text(why + "\n")
            return 1
    try:
        sock, key, door = (public, None, None) if token is None else _sealed_listener("127.0.0.1",
                                                                                     allow_open=args.open_store)
    except OpenStoreRefused as e:
        logging.getLogger(__name__).error("%s", e)
        if args.ready is not None:
            failed_path(args.ready).write_text(f"{e}\n")
        return 1
    host, port = sock.getsockname()[:2]
    store = dist.TCPStore(host if door is None else door.host, port, is_master=True, wait_for_workers=False,
                          use_libuv=True, timeout=timedelta(seconds=30), master_listen_fd=sock.fileno())
    sock.detach()  # the server owns the descriptor now (and closes it)
    if door is not None:
        door.close()  # torch's own client is in: nobody else comes in unsigned
    gate = None if token is None else store_auth.Gate(public, (host, port), token, backend_key=key)
    if args.ready is not None:
        tmp = args.ready.with_name(args.ready.name + ".tmp")
        tmp.write_text(f"{os.getpid()} {args.port}\n")
        os.replace(tmp, args.ready)
    print(f"neighbor_ckpt store host: listening on {args.host}:{args.port} (pid {os.getpid()})"
          + ("" if gate is None else f", a gate before the store on {host}:{port}"
                                     + (" (sealed)" if key is not None else " (open to this node's users)")),
          flush=True)
    stop = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    while not stop:
        if args.parent is not None and not _alive(args.parent):
            break
        time.sleep(0.2)
    if gate is not None:
        gate.close()
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
