#!/usr/bin/env python3
"""Does ``SnapshotEngine.snapshot()`` wait for the device when the extras hold a CUDA tensor?

``python3 tools/gpu_probe/sync_probe.py``: on the H100,
``tests/gpu/test_engine_cuda.py::test_fp16_scaler_and_staged_buffers_are_copied_without_a_device_sync_and_before_the_next_forward``
failed with "snapshot() waited for the device (or raise SLEEP_CYCLES)": right after ``snapshot()`` returned, the
stream (a ``torch.cuda._sleep`` of ~0.25 s enqueued before it) was idle. This probe repeats that test's loop
(megatron-core's DynamicGradScaler, whose ``state_dict()['scale']`` is a CUDA tensor, in the extras; a BatchNorm
buffer as a *staged* tensor; a 64K-float CUDA main shard; two own slots on /dev/shm) and:

1. *instrumented* (the test's loop, 6 iterations): whether the stream is still busy after the sleep, after the
   step's producers and after ``snapshot()``; each piece of ``snapshot()`` (``codec.encode``, every
   ``_stage_small``, the event record) with the stream's state before and after it and its time; torch's
   synchronizing calls (``torch.cuda.set_sync_debug_mode("warn")``, each with the Python stack that made it);
   the host (page-locked) and device allocator counters that changed during ``snapshot()`` (a ``cudaHostAlloc`` or
   ``cudaMalloc`` can wait for the device without torch calling it a sync); garbage collections during it; and the
   engine worker thread's timeline (``_process``, ``HostStore.ensure``, ``SlotFile.pin_for_cuda``).
2. ``set_sync_debug_mode("error")`` around ``snapshot()``: the traceback of a synchronizing call, if torch knows it.
3. a 4x longer sleep (~1 s), to rule timing out.
4. candidates, each in a fresh subprocess running the test's loop unchanged but for one thing: ``asis``;
   ``reuse_pinned`` (the candidate fix: the extras' CUDA tensors are copied into page-locked buffers the engine
   keeps from one snapshot to the next instead of a new ``pin_memory=True`` tensor per snapshot);
   ``cpu_scale`` (control: no CUDA tensor in the extras); ``no_staged`` (control: no staged buffer);
   ``gc_off`` (control: the garbage collector disabled).

Seen on the H100 (torch 2.11, 2026-11): ``snapshot()`` never made the stream idle (every piece of it kept a busy
stream busy; no synchronizing call in 'warn' or 'error' mode; pinned allocations only at the first two snapshots,
then reused). The stream went idle in the test's own producer, ``scaler.update(found_inf=True)`` at iteration 3 (the
scaler's first backoff: its first ``torch.max``), in the first loop of each process only; with the kernels already
launched once (phases 2 and 3) every iteration stayed busy. All five candidates failed alike at iteration 3. The fix
is in the test (warm the producers' kernels up before the loop), not in the engine.

Without CUDA it prints one "needs CUDA" line and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SLEEP_CYCLES = 500_000_000  # as tests/gpu/test_engine_cuda.py: ~0.25 s at H100 clocks
VERSIONS = 2
CANDIDATES = {
    "asis": "the engine as it is (the failing test's loop in a fresh process)",
    "reuse_pinned": "candidate: page-locked extras buffers kept by the engine, reused at every snapshot",
    "cpu_scale": "control: the extras' scale as a CPU tensor (no CUDA tensor in the extras)",
    "no_staged": "control: no staged buffer (the BatchNorm buffer not in the plan)",
    "gc_off": "control: gc.disable() for the whole loop",
}
CANDIDATE_TIMEOUT_S = 30
DEV = "cuda"  # a CPU dry run of this script's logic sets "cpu"


def _busy() -> bool:
    import torch

    return not torch.cuda.current_stream().query()


# -- the test's set-up ------------------------------------------------------------------------------------------


def _scaler_class(full_import: bool) -> Any:
    """megatron-core's DynamicGradScaler: through ``megatron.core.optimizer`` as the test imports it (a heap of
    the test's size, for the garbage collector), or straight from its file (seconds faster, same class code)."""
    if full_import:
        from megatron.core.optimizer.grad_scaler import DynamicGradScaler

        return DynamicGradScaler
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("megatron-core is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "core" / "optimizer" / "grad_scaler.py"
    mspec = importlib.util.spec_from_file_location("_probe_grad_scaler", path)
    assert mspec is not None and mspec.loader is not None
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod.DynamicGradScaler


class Setup:
    """tmpfs store (2 versions), scaler, BatchNorm buffer (staged), main shard, engine: as the test."""

    def __init__(self, scaler_cls: Any, *, staged: bool = True) -> None:
        import torch
        from torch import nn

        from neighbor_ckpt.snapshot.engine import SnapshotEngine
        from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
        from neighbor_ckpt.snapshot.store import HostStore

        base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
        self.dir = Path(tempfile.mkdtemp(prefix="nckpt-sync-probe-", dir=base))
        self.store = HostStore(self.dir / "store", job_id="job-gpu", rank=0, versions=VERSIONS)
        self.scaler = scaler_cls(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=2, hysteresis=2)
        assert self.scaler.state_dict()["scale"].is_cuda or DEV == "cpu"
        self.bn = nn.BatchNorm1d(64).to(DEV)
        self.main = torch.randn(1 << 16, device=DEV)
        named = [(TensorMeta.of("main/shard", StateKind.MAIN_PARAM, self.main), self.main)]
        if staged:
            named.append((TensorMeta.of("buffer/bn.running_mean", StateKind.BUFFER, self.bn.running_mean),
                          self.bn.running_mean))
        plan = plan_shards([m for m, _ in named], dp_size=1, distributed_optimizer=False)
        by_name = {m.name: t for m, t in named}
        self.engine = SnapshotEngine(store=self.store, plan=plan, sources=[by_name[p.meta.name] for p in plan.unique],
                                     layout="L", meta={}, transport=None)
        self.staged_names = [p.meta.name for p in self.engine.plan.staged]
        self.check_scale = True
        self.a = torch.randn(1024, 1024, device=DEV)

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def check(self, it: int, want_mean: Any, want_scale: Any) -> str:
        """The test's checks of the committed slot; '' when they hold."""
        import torch

        from neighbor_ckpt.recovery.flow import read_tensors
        from neighbor_ckpt.snapshot.store import ROLE_OWN

        def bits(t: torch.Tensor) -> bytes:
            c = t.detach().cpu().contiguous()
            return c.view(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""

        refs = {r.header.iteration: r for r in self.store.committed(ROLE_OWN, verify=True)}
        if it not in refs:
            return f"iteration {it} not committed (have {sorted(refs)})"
        slot = self.store.slot(ROLE_OWN, refs[it].index)
        got = read_tensors(slot, refs[it].header)
        if "buffer/bn.running_mean" in got and bits(got["buffer/bn.running_mean"]) != bits(want_mean):
            return "bn.running_mean differs"
        saved = slot.read_extras(refs[it].header)["grad_scaler"]
        if self.check_scale and isinstance(saved["scale"], torch.Tensor):
            if saved["scale"].is_cuda or bits(saved["scale"]) != bits(want_scale):
                return "scale differs"
        return ""


def _snapshot_reusing_pinned(self: Any, iteration: int, extras: Any) -> None:
    """The candidate fix of ``SnapshotEngine.snapshot``: as it is, but the extras' CUDA tensors are copied into
    page-locked buffers the engine keeps (one per position in the encoded extras, re-made only when the shape or
    dtype there changes). The previous job is committed (the wait at the top), so nothing reads them any more."""
    import torch

    from neighbor_ckpt.snapshot import codec as _codec
    from neighbor_ckpt.snapshot import engine as em

    if self._closed:
        raise RuntimeError("snapshot() after close()")
    self.wait()
    t0 = time.perf_counter()
    text, tensors = _codec.encode(extras)
    for _, src, host in self._staged:
        em._stage_small(src, host)
    bufs = self.__dict__.setdefault("_extras_host", [])
    host_tensors = []
    for i, t in enumerate(tensors):
        if not t.is_cuda:
            host_tensors.append(em._stage_small(t))
            continue
        while len(bufs) <= i:
            bufs.append(None)
        buf = bufs[i]
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = bufs[i] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host_tensors.append(em._stage_small(t, buf))
    event = None
    if self._device or any(t.is_cuda for t in tensors):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
    job = em._Job(iteration, text, host_tensors, event)
    self._pending = job
    self._queue.put(job)
    self.stats.snapshot_seconds = time.perf_counter() - t0


# -- instrumentation ----------------------------------------------------------------------------------------------


class Instrument:
    """Timeline of one snapshot() call (main thread) and of the worker thread."""

    DEVICE_KEYS = ("num_device_alloc", "num_device_free", "num_sync_all_streams", "num_alloc_retries",
                   "segment.all.allocated", "segment.all.freed")

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.worker: list[tuple[float, str]] = []
        self.gcs: list[tuple[float, float, int]] = []
        self.syncs: list[str] = []
        self._gc_t0: float | None = None
        self._active = False
        self.t_origin = time.perf_counter()

    def rel(self) -> float:
        return (time.perf_counter() - self.t_origin) * 1e3

    def wrap(self, owner: Any, name: str, label: str, *, worker: bool = False) -> Callable[[], None]:
        orig = getattr(owner, name)
        inst = self

        def wrapped(*a: Any, **k: Any) -> Any:
            if worker or threading.current_thread() is not threading.main_thread():
                inst.worker.append((inst.rel(), f"{threading.current_thread().name}: {label} start"))
                try:
                    return orig(*a, **k)
                finally:
                    inst.worker.append((inst.rel(), f"{threading.current_thread().name}: {label} end"))
            if not inst._active:
                return orig(*a, **k)
            b0, t0 = _busy(), time.perf_counter()
            r = orig(*a, **k)
            dt = (time.perf_counter() - t0) * 1e3
            b1 = _busy()
            extra = ""
            try:
                import torch

                if isinstance(r, torch.Tensor):
                    extra = f" -> {tuple(r.shape)} {r.dtype} pinned={r.is_pinned()}"
            except Exception:  # noqa: BLE001
                pass
            inst.steps.append(f"{label}: busy {b0}->{b1} {dt:.3f} ms{extra}")
            return r

        setattr(owner, name, wrapped)
        return lambda: setattr(owner, name, orig)

    def gc_callback(self, phase: str, info: dict[str, Any]) -> None:
        if not self._active:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.gcs.append((self.rel(), (time.perf_counter() - self._gc_t0) * 1e3, int(info.get("generation", -1))))
            self._gc_t0 = None

    def showwarning(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                    line: Any = None) -> None:
        text = str(message)
        if "synchroniz" in text.lower():
            stack = "".join(traceback.format_stack()[:-1][-8:])
            self.syncs.append(f"[thread {threading.current_thread().name}] {text.strip()}\n{stack}")
        else:
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _counters() -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    dev = torch.cuda.memory_stats()
    try:
        host = dict(torch.cuda.host_memory_stats())
    except Exception as e:  # noqa: BLE001
        host = {"unavailable": str(e)}
    return ({k: dev.get(k) for k in Instrument.DEVICE_KEYS},
            {k: v for k, v in host.items() if isinstance(v, (int, float))})


def _diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k) and "time" not in k}


# -- the loops ------------------------------------------------------------------------------------------------------


def test_loop(s: Setup, *, iters: int, sleep: int, mode: str = "", inst: Instrument | None = None,
              extras_fn: Callable[[Any], Any] | None = None, label: str = "") -> list[dict[str, Any]]:
    """The failing test's loop; ``mode``: '' (plain), 'warn' or 'error' (torch's sync debug mode around
    ``snapshot()``). Returns one record per iteration."""
    import torch

    out = []
    for it in range(1, iters + 1):
        rec: dict[str, Any] = {"it": it}
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep)
        rec["busy_after_sleep"] = _busy()
        p0 = _counters() if inst is not None else None
        prod = (s.a @ s.a)[0, :64] * it
        b_mm = _busy()
        s.bn.running_mean.copy_(prod)
        del prod
        b_copy = _busy()
        s.scaler.update(found_inf=bool(it % 2))
        rec["busy_after_producers"] = _busy()
        rec["busy_producers_detail"] = f"after a@a {b_mm}, after copy_ {b_copy}, after scaler.update {_busy()}"
        if p0 is not None:
            p1 = _counters()
            rec["producer_counters"] = {**_diff(p0[0], p1[0]), **_diff(p0[1], p1[1])}
        extras = {"grad_scaler": s.scaler.state_dict()}
        if extras_fn is not None:
            extras = extras_fn(extras)
        if inst is not None:
            inst.steps, inst.syncs, inst.gcs = [], [], []
            c0 = _counters()
            inst._active = True
        t0 = time.perf_counter()
        failed = ""
        if mode:
            torch.cuda.set_sync_debug_mode(mode)
        try:
            s.engine.snapshot(it, extras)
        except Exception as e:  # noqa: BLE001 - 'error' mode raises at the synchronizing call
            failed = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        finally:
            if mode:
                torch.cuda.set_sync_debug_mode(0)
        rec["snapshot_ms"] = (time.perf_counter() - t0) * 1e3
        rec["busy_after_snapshot"] = _busy()
        if inst is not None:
            inst._active = False
            c1 = _counters()
            rec["device_counters"] = _diff(c0[0], c1[0])
            rec["host_counters"] = _diff(c0[1], c1[1])
            rec["steps"], rec["syncs"], rec["gcs"] = list(inst.steps), list(inst.syncs), list(inst.gcs)
        want_mean, want_scale = s.bn.running_mean.clone(), s.scaler.scale.clone()
        s.bn.running_mean.add_(1.0)
        s.scaler._scale.mul_(3.0)
        s.engine.wait()
        torch.cuda.synchronize()
        rec["raised"] = failed
        rec["check"] = "skipped (snapshot raised)" if failed else (s.check(it, want_mean, want_scale) or "ok")
        s.scaler._scale.div_(3.0)
        rec["test_would_assert"] = it > VERSIONS
        out.append(rec)
        _print_rec(label, rec)
    return out


def _print_rec(label: str, r: dict[str, Any]) -> None:
    flag = ""
    if r["test_would_assert"] and not r["busy_after_snapshot"]:
        flag = "   <== the test's assertion fails here"
    print(f"{label} it={r['it']}: busy after sleep={r['busy_after_sleep']} after producers="
          f"{r['busy_after_producers']} after snapshot()={r['busy_after_snapshot']} snapshot {r['snapshot_ms']:.2f} ms"
          f" check={r['check']}{flag}")
    if not r["busy_after_producers"]:
        print(f"      the test's producers left the stream idle: {r.get('busy_producers_detail')}")
    if r.get("producer_counters"):
        print(f"      allocator counters changed in the test's producers: {r['producer_counters']}")
    for st in r.get("steps", []):
        print(f"      {st}")
    if r.get("device_counters"):
        print(f"      device allocator counters changed in snapshot(): {r['device_counters']}")
    if "host_counters" in r:
        print(f"      host (pinned) allocator counters changed in snapshot(): {r['host_counters'] or 'none'}")
    for at, ms, gen in r.get("gcs", []):
        print(f"      gc collection of generation {gen} during snapshot(): {ms:.2f} ms")
    for sy in r.get("syncs", []):
        print("      TORCH SYNC WARNING in snapshot(): " + sy.replace("\n", "\n        "))
    if r.get("raised"):
        print("      snapshot() RAISED under set_sync_debug_mode('error'):\n        "
              + r["raised"].strip().replace("\n", "\n        "))


def main_probe() -> int:
    import torch

    from neighbor_ckpt.snapshot import codec as codec_mod
    from neighbor_ckpt.snapshot import engine as engine_mod
    from neighbor_ckpt.snapshot.engine import SnapshotEngine
    from neighbor_ckpt.snapshot.slot import SlotFile
    from neighbor_ckpt.snapshot.store import HostStore

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    t0 = time.perf_counter()
    try:
        scaler_cls = _scaler_class(full_import=True)
        how = "megatron.core.optimizer.grad_scaler (full import, as the test)"
    except Exception as e:  # noqa: BLE001
        print(f"full megatron import failed ({type(e).__name__}: {e}); loading grad_scaler.py alone")
        scaler_cls = _scaler_class(full_import=False)
        how = "grad_scaler.py alone"
    print(f"DynamicGradScaler from {how} in {time.perf_counter() - t0:.1f} s; gc objects {len(gc.get_objects())}")

    inst = Instrument()
    undo = [inst.wrap(codec_mod, "encode", "codec.encode"),
            inst.wrap(engine_mod, "_stage_small", "_stage_small"),
            inst.wrap(torch.cuda.Event, "record", "Event.record"),
            inst.wrap(SnapshotEngine, "_process", "engine._process", worker=True),
            inst.wrap(HostStore, "ensure", "HostStore.ensure", worker=True),
            inst.wrap(SlotFile, "pin_for_cuda", "SlotFile.pin_for_cuda (cudaHostRegister)", worker=True)]
    gc.callbacks.append(inst.gc_callback)
    old_show = warnings.showwarning
    warnings.showwarning = inst.showwarning
    warnings.simplefilter("always")

    print("\n== 1. the test's loop, instrumented, torch.cuda.set_sync_debug_mode('warn') around snapshot()")
    s = Setup(scaler_cls)
    print(f"staged plan entries: {s.staged_names}")
    calls: list[float] = []
    orig_snapshot = SnapshotEngine.snapshot

    def timed_snapshot(self: Any, *a: Any, **k: Any) -> Any:
        calls.append(inst.rel())
        return orig_snapshot(self, *a, **k)

    SnapshotEngine.snapshot = timed_snapshot  # type: ignore[method-assign]
    try:
        recs1 = test_loop(s, iters=6, sleep=SLEEP_CYCLES, mode="warn", inst=inst, label="[warn]")
    finally:
        SnapshotEngine.snapshot = orig_snapshot  # type: ignore[method-assign]
        s.close()
    print("   worker-thread timeline (ms; snapshot() calls at " + ", ".join(f"{c:.1f}" for c in calls) + "):")
    for at, what in inst.worker:
        print(f"      {at:9.1f}  {what}")

    print("\n== 2. torch.cuda.set_sync_debug_mode('error') around snapshot() (fresh engine)")
    inst.worker.clear()
    s = Setup(scaler_cls)
    try:
        test_loop(s, iters=4, sleep=SLEEP_CYCLES, mode="error", label="[error]")
    finally:
        s.close()

    print("\n== 3. a 4x longer sleep (~1 s at H100 clocks), plain")
    s = Setup(scaler_cls)
    try:
        recs3 = test_loop(s, iters=4, sleep=4 * SLEEP_CYCLES, label="[4x sleep]")
    finally:
        s.close()
    for u in undo:
        u()
    gc.callbacks.remove(inst.gc_callback)
    warnings.showwarning = old_show

    fails1 = [r["it"] for r in recs1 if r["test_would_assert"] and not r["busy_after_snapshot"]]
    fails3 = [r["it"] for r in recs3 if r["test_would_assert"] and not r["busy_after_snapshot"]]
    print(f"\nphase 1: stream idle after snapshot() at asserted iterations {fails1 or 'none'}; "
          f"phase 3 (4x sleep): {fails3 or 'none'}")

    print("\n== 4. candidates, each in a fresh process (the test's loop, 4 iterations, plain)")
    verdicts = {}
    for name, what in CANDIDATES.items():
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--candidate", name], env=env,
                               capture_output=True, text=True, timeout=CANDIDATE_TIMEOUT_S)
            out, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out = str(e.stdout or "") + f"\n[timed out after {CANDIDATE_TIMEOUT_S} s]"
            rc = None
        print(f"-- {name}: {what} (exit {rc}, {time.perf_counter() - t0:.1f} s)")
        for line in out.splitlines():
            if "pynvml" in line or "FutureWarning" in line or "warnings.warn" in line:
                continue
            print("   " + line)
            if line.startswith("VERDICT "):
                verdicts[name] = line[len("VERDICT "):]
    print("\n== summary")
    for name in CANDIDATES:
        print(f"  {name:13s} {verdicts.get(name, 'no verdict')}")
    return 0


def candidate(name: str) -> int:
    import torch

    from neighbor_ckpt.snapshot.engine import SnapshotEngine

    scaler_cls = _scaler_class(full_import=False)
    if name == "reuse_pinned":
        SnapshotEngine.snapshot = _snapshot_reusing_pinned  # type: ignore[method-assign]
    if name == "gc_off":
        gc.disable()
    extras_fn: Callable[[Any], Any] | None = None
    if name == "cpu_scale":
        cpu_scale = torch.tensor([2.0**16])  # a constant: a .cpu() of the real one would wait for the sleep

        def _cpu_extras(ex: Any) -> Any:
            return {"grad_scaler": dict(ex["grad_scaler"], scale=cpu_scale)}

        extras_fn = _cpu_extras
    s = Setup(scaler_cls, staged=name != "no_staged")
    s.check_scale = name != "cpu_scale"
    try:
        recs = test_loop(s, iters=4, sleep=SLEEP_CYCLES, extras_fn=extras_fn, label=f"[{name}]")
    finally:
        s.close()
    bad = [r["it"] for r in recs if r["test_would_assert"] and not r["busy_after_snapshot"]]
    wrong = [r["it"] for r in recs if r["check"] != "ok"]
    verdict = ("PASS" if not bad and not wrong else "FAIL") + (
        f" (stream idle after snapshot() at iterations {bad})" if bad else "") + (
        f" (slot contents wrong at {wrong})" if wrong else "") + " snapshot ms: " + ", ".join(
        f"{r['snapshot_ms']:.2f}" for r in recs)
    print("VERDICT " + verdict)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidate", choices=sorted(CANDIDATES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from tools.gpu_probe import cuda_here

    if not cuda_here("sync_probe"):
        return 0
    if args.candidate:
        return candidate(args.candidate)
    return main_probe()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
