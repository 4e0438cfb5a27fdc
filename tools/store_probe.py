"""What another local user tries against every socket of a running launch (``python3 store_probe.py`` as that user,
the standard library only: it is run with the system's Python, outside the job's environment).

Reads a JSON object on stdin: ``{"prefix": ..., "secret_key": ..., "tcp": [[host, port], ...], "unix": [path, ...],
"records": {"<process index>": {"pid", "node", "start"}, ...}, "timeout_s": float}``, and for each socket makes one
connection per attempt, speaking torch's TCPStore protocol as torch's own client does (``VALIDATE``, then the
operation): *read* the secret key (``GET``), *write* ``complete`` (``SET``), and per record *write* ``dead`` naming the
process and ``proc/<i>`` naming the record's pid (``SET`` twice), each followed by a ``CHECK`` of what it wrote (a
store answers one byte). Prints one JSON line per attempt: the socket, the attempt, whether the connection completed,
and every byte that came back (hex): a store that served the attempt answers; a refused one closes, resets, never
completes the connection, or (a gate) asks for the token first.

With ``"every_s"`` in the object (the fault campaign's ``inproc-other-user``), it probes for as long as the launch
runs: it prints ``{"probe": "started", "pid", "uid"}`` first, then runs each attempt against each socket again every
``every_s`` seconds, or as soon as the last one ended when that took longer (a thread per socket and attempt, a line
per attempt as it ends, with its ``unix`` time), takes further JSON
lines on stdin that add sockets (``{"tcp": [[host, port], ...]}``: those known only once the launch runs), and when
stdin ends it stops and prints ``{"probe": "stopped"}``. A record whose ``pid`` is ``"self"`` names this process (its
pid and its start, as :func:`neighbor_ckpt.runtime.procs.process_start` reads it): a launcher that believed it would
kill the other user's process.

Used by tests/unit/test_shared_node.py, tests/e2e/test_shared_node_sockets.py and tools/campaign/other_user.py.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time

VALIDATE, SET, GET, CHECK = 0, 1, 3, 5
MAGIC = 0x3C85F7CE


def _str(b: bytes) -> bytes:
    return struct.pack("=Q", len(b)) + b


def _attempt(target: object, payload: bytes, timeout_s: float) -> dict:
    out = {"target": target, "connected": False, "received": ""}
    try:
        if isinstance(target, str):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: object = target if not target.startswith("@") else "\0" + target[1:]
        else:
            host, port = target
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            address = (host, port)
        s.settimeout(timeout_s)
        s.connect(address)
        out["connected"] = True
        s.sendall(bytes([VALIDATE]) + struct.pack("=I", MAGIC) + payload)
        got = b""
        while len(got) < 4096:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
        got = locals().get("got", b"")
    finally:
        try:
            s.close()
        except Exception:  # noqa: BLE001
            pass
    out["received"] = got.hex()
    return out


def _set_then_check(key: bytes, value: bytes) -> bytes:
    return bytes([SET]) + _str(key) + _str(value) + bytes([CHECK]) + struct.pack("=Q", 1) + _str(key)


def _own_start() -> float:
    """This process's start in seconds since boot (``/proc/self/stat``'s start time over the clock tick)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _attempts(spec: dict) -> list:
    prefix = spec["prefix"].encode()
    attempts = [("read", bytes([GET]) + _str(prefix + spec["secret_key"].encode())),
                ("complete", _set_then_check(prefix + b"complete", b"1"))]
    for index, record in sorted(spec["records"].items()):
        if record.get("pid") == "self":
            record = dict(record, pid=os.getpid(), start=_own_start())
        attempts.append((f"dead {index} (pid {record['pid']})",
                         _set_then_check(prefix + b"dead", f"{index}:killed by another user;".encode())
                         + _set_then_check(prefix + f"proc/{index}".encode(), json.dumps(record).encode())))
    return attempts


def _once(spec: dict, attempts: list) -> int:
    targets = [tuple(t) for t in spec["tcp"]] + list(spec["unix"])
    results: list[dict] = []
    lock = threading.Lock()

    def run(target: object) -> None:
        for name, payload in attempts:
            r = _attempt(list(target) if isinstance(target, tuple) else target, payload, spec["timeout_s"])
            r["attempt"] = name
            with lock:
                results.append(r)

    threads = [threading.Thread(target=run, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        print(json.dumps(r))
    return 0


def _until_stdin_ends(spec: dict, attempts: list) -> int:
    lock = threading.Lock()
    stop = threading.Event()
    threads: dict = {}

    def emit(record: dict) -> None:
        with lock:
            print(json.dumps(record), flush=True)

    def run(target: object, name: str, payload: bytes) -> None:
        while not stop.is_set():
            began = time.monotonic()
            r = _attempt(target, payload, spec["timeout_s"])
            r["attempt"], r["unix"] = name, time.time()
            emit(r)
            stop.wait(max(0.0, spec["every_s"] - (time.monotonic() - began)))

    def add(targets: list) -> None:
        for t in targets:
            for name, payload in attempts:
                key = (json.dumps(t), name)
                if key not in threads:
                    threads[key] = threading.Thread(target=run, args=(t, name, payload), daemon=True)
                    threads[key].start()

    emit({"probe": "started", "pid": os.getpid(), "uid": os.getuid()})
    add(list(spec["tcp"]) + list(spec["unix"]))
    for line in sys.stdin:
        if line.strip():
            more = json.loads(line)
            add(list(more.get("tcp", [])) + list(more.get("unix", [])))
    stop.set()
    for t in threads.values():
        t.join()
    emit({"probe": "stopped", "sockets": len({k[0] for k in threads})})
    return 0


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    attempts = _attempts(spec)
    spec.setdefault("unix", [])
    return _once(spec, attempts) if spec.get("every_s") is None else _until_stdin_ends(spec, attempts)


if __name__ == "__main__":
    sys.exit(main())
