"""A TCP store in a process of its own, for in-process recovery.

The engine's generations, the per-generation process groups and the launchers' reports live in one
``torch.distributed.TCPStore``: hosted by rank 0, killing rank 0 would take it down with it, and the survivors could
not re-form. This process hosts it (every user under its own key prefix) and lives until it is
terminated, or until the process given with ``--parent`` is gone (so a launch script that dies does not leave it
behind)::

    python -m neighbor_ckpt.inprocess.store_host --port 29650 [--host 0.0.0.0] [--parent PID] [--ready FILE]

``--ready FILE`` is written once the store listens (the launch waits for it before starting the agents).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--parent", type=int, default=None, help="exit when this process is gone")
    ap.add_argument("--ready", type=Path, default=None, help="write this file once the store listens")
    args = ap.parse_args(argv)

    import torch.distributed as dist

    store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False, use_libuv=True,
                          timeout=timedelta(seconds=30))
    if args.ready is not None:
        tmp = args.ready.with_name(args.ready.name + ".tmp")
        tmp.write_text(f"{os.getpid()} {args.port}\n")
        os.replace(tmp, args.ready)
    print(f"neighbor_ckpt store host: listening on {args.host}:{args.port} (pid {os.getpid()})", flush=True)
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
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
