"""``python -m tools.bench --store-gate [--ops 2000] [--connects 50] [--out FILE]``: what the per-job store token
costs a store operation (issue 29, item 2).

Two store hosts (``python -m neighbor_ckpt.inprocess.store_host``) on this machine, one open and one behind its gate
(``--token-file``). Measured in one run, as ratios to the first:

* ``torch``: torch's own TCPStore client on the open store (what the engine's bounded clients wrap);
* ``bounded``: a :class:`~neighbor_ckpt.inprocess.stores.StoreSet` on the open store (one thread hop per operation);
* ``gated``: the same on the gated store (the process's tunnel and the host's gate: two more hops per operation,
  and a challenge per new connection).

Per operation: the median and 90th percentile of ``set``, ``get``, ``check`` and ``add`` of a 64-byte value, each
``--ops`` times; per connection: a new client's first ``check`` (connection, torch's validation, the handshake).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

OPS = ("set", "get", "check", "add")


def _host(tmp: Path, name: str, token_file: Path | None) -> tuple[subprocess.Popen, int]:
    from neighbor_ckpt.cli.launch import free_ports

    ready = tmp / f"{name}.ready"
    cmd = [sys.executable, "-m", "neighbor_ckpt.inprocess.store_host", "--host", "127.0.0.1", "--port",
           str(free_ports(1)[0]), "--ready", str(ready)]
    if token_file is not None:
        cmd += ["--token-file", str(token_file)]
    proc = subprocess.Popen(cmd, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "error"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the store host {name} did not start")
        time.sleep(0.02)
    return proc, int(ready.read_text().split()[1])


def _time(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median_us": statistics.median(s) * 1e6, "p90_us": s[int(0.9 * (len(s) - 1))] * 1e6}


def _ops(store: Any, n: int) -> dict[str, dict[str, float]]:
    value = b"x" * 64
    store.set("bench/k", value)
    calls = {"set": lambda: store.set("bench/k", value), "get": lambda: store.get("bench/k"),
             "check": lambda: store.check(["bench/k"]), "add": lambda: store.add("bench/n", 1)}
    for fn in calls.values():  # warm: the first call of each kind
        fn()
    return {op: _summary(_time(calls[op], n)) for op in OPS}


def run(ops: int, connects: int) -> dict[str, Any]:
    import torch.distributed as dist

    from neighbor_ckpt.inprocess.store_auth import new_token_file, read_token
    from neighbor_ckpt.inprocess.stores import StoreAddresses, StoreSet

    with tempfile.TemporaryDirectory(prefix="nckpt-store-gate-") as d:
        tmp = Path(d)
        token_file = new_token_file(tmp / "store.token")
        token = read_token(token_file)
        open_host, open_port = _host(tmp, "open", None)
        gated_host, gated_port = _host(tmp, "gated", token_file)
        try:
            def torch_client() -> Any:
                return dist.TCPStore("127.0.0.1", open_port, is_master=False, wait_for_workers=False,
                                     use_libuv=True, timeout=timedelta(seconds=30))

            def store_set(port: int, tok: bytes | None) -> Any:
                return StoreSet(StoreAddresses((("127.0.0.1", port),)), run_id="bench", timeout_s=30.0,
                                connect_timeout_s=30.0, name="bench", token=tok)

            clients: dict[str, Callable[[], Any]] = {
                "torch": torch_client,
                "bounded": lambda: store_set(open_port, None).view("main", ""),
                "gated": lambda: store_set(gated_port, token).view("main", ""),
            }
            result: dict[str, Any] = {}
            for name, make in clients.items():
                per_op = _ops(make(), ops)
                connect = _summary(_time(lambda: make().check(["bench/k"]), connects))
                result[name] = {"ops": per_op, "connect": connect}
        finally:
            for p in (open_host, gated_host):
                p.kill()
                p.wait()
    base = result["torch"]
    for name in ("bounded", "gated"):
        result[name]["ratio_to_torch"] = {
            **{op: result[name]["ops"][op]["median_us"] / base["ops"][op]["median_us"] for op in OPS},
            "connect": result[name]["connect"]["median_us"] / base["connect"]["median_us"]}
    return {"ops_per_kind": ops, "connects": connects, "results": result}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench --store-gate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=2000, help="operations of each kind per client (default 2000)")
    ap.add_argument("--connects", type=int, default=50, help="new connections per client (default 50)")
    ap.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = ap.parse_args(list(argv) if argv is not None else None)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "error")
    res = run(args.ops, args.connects)
    from tools.bench.machine import machine_info

    res["machine"] = machine_info(Path(tempfile.gettempdir()))
    res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                   cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    print(f"{'client':8} " + " ".join(f"{op + ' us':>14}" for op in OPS) + f" {'connect us':>14}")
    for name, r in res["results"].items():
        cells = [f"{r['ops'][op]['median_us']:8.0f} ({r.get('ratio_to_torch', {}).get(op, 1.0):.2f}x)" for op in OPS]
        ratio = r.get("ratio_to_torch", {}).get("connect", 1.0)
        print(f"{name:8} " + " ".join(f"{c:>14}" for c in cells) + f" {r['connect']['median_us']:7.0f} ({ratio:.2f}x)")
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
