"""The snapshot engine on CUDA sources, in one process: side-stream D2H copies into page-locked /dev/shm slots.

What it proves on a GPU: the committed slot holds exactly the source bytes for every dtype; the copy is ordered
after GPU work enqueued before ``snapshot()`` (which returns while that work still runs); slots are registered
with CUDA once, unregistered when re-created or closed, and a refused registration leaves a pageable slot that
still snapshots correctly without poisoning later CUDA calls; a snapshot restores into CUDA tensors bit-exactly.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from neighbor_ckpt.adapters.torch_optim import TorchOptimizerAdapter
from neighbor_ckpt.snapshot.engine import SnapshotEngine, header_capacity
from neighbor_ckpt.snapshot.slot import MIN_EXTRAS_BYTES
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
from neighbor_ckpt.recovery.flow import read_tensors
from neighbor_ckpt.snapshot.slot import PREAMBLE_BYTES, SlotFile
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore
from tests.gpu.conftest import CUDA_ONLY, on_tmpfs

pytestmark = [pytest.mark.gpu, CUDA_ONLY]

JOB = "job-gpu"
SLEEP_CYCLES = 500_000_000
"""``torch.cuda._sleep`` cycles the producer spins before writing the source: ~0.25 s at H100 clocks."""


# -- helpers -------------------------------------------------------------------------------------------------


def host_bits(t: torch.Tensor) -> bytes:
    c = t.detach().cpu().contiguous()
    return c.view(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""


def cuda_state(seed: int = 0) -> list[tuple[TensorMeta, torch.Tensor]]:
    """Contiguous CUDA tensors of awkward dtypes/sizes (non-finite values, odd byte counts) and one CPU tensor
    (torch optimizers keep ``step`` on the CPU), as an adapter would hand them to the engine."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    main = torch.randn((1 << 20) + 3, generator=g, device=dev)
    main[0], main[1], main[2] = float("nan"), float("-inf"), -0.0
    tensors = {
        "main/shard": (StateKind.MAIN_PARAM, main),
        "optim/exp_avg": (StateKind.OPTIMIZER, torch.randn(333, 7, generator=g, device=dev).to(torch.bfloat16)),
        "optim/exp_avg_sq": (StateKind.OPTIMIZER, torch.rand(129, generator=g, device=dev).to(torch.float16)),
        "optim/f64": (StateKind.OPTIMIZER, torch.rand(17, 3, generator=g, dtype=torch.float64, device=dev)),
        "optim/ids": (StateKind.OPTIMIZER, torch.arange(1001, dtype=torch.int64, device=dev) * (seed + 1)),
        "optim/mask": (StateKind.OPTIMIZER, torch.rand(77, generator=g, device=dev) > 0.5),
        "optim/bytes": (StateKind.OPTIMIZER, torch.randint(-128, 127, (5,), generator=g, device=dev,
                                                           dtype=torch.int8)),
        "optim/step": (StateKind.OPTIMIZER, torch.tensor(float(seed + 3))),  # CPU
    }
    return [(TensorMeta.of(n, k, t), t) for n, (k, t) in tensors.items()]


def make_engine(store: HostStore, named: list[tuple[TensorMeta, torch.Tensor]]) -> SnapshotEngine:
    plan = plan_shards([m for m, _ in named], dp_size=1, distributed_optimizer=False)  # DP 1: all unique
    assert len(plan.unique) == len(named)
    by_name = {m.name: t for m, t in named}
    return SnapshotEngine(store=store, plan=plan, sources=[by_name[p.meta.name] for p in plan.unique],
                          layout="L", meta={}, transport=None)


def committed(store: HostStore, iteration: int) -> tuple[SlotFile, dict[str, torch.Tensor]]:
    """The own slot holding ``iteration`` (checksums verified) and its tensors (views of the slot)."""
    refs = {r.header.iteration: r for r in store.committed(ROLE_OWN, verify=True)}
    assert iteration in refs, f"iteration {iteration} not committed; have {sorted(refs)}"
    slot = store.slot(ROLE_OWN, refs[iteration].index)
    assert slot is not None
    return slot, read_tensors(slot, refs[iteration].header)


def own_slots(store: HostStore) -> list[SlotFile]:
    slots = [store.slot(ROLE_OWN, i) for i in range(store.versions)]
    assert all(s is not None for s in slots)
    return slots  # type: ignore[return-value]


@pytest.fixture
def store(shm_dir: Path):
    s = HostStore(shm_dir / "store", job_id=JOB, rank=0, versions=2)
    yield s
    s.close()


@pytest.fixture
def tmpfs_store(store: HostStore) -> HostStore:
    if not on_tmpfs(store.root):
        pytest.skip("needs a writable /dev/shm: page-locking slots of disk-backed files may be refused")
    return store


# -- page-locking lifecycle of one slot ----------------------------------------------------------------------


def test_pin_registers_exactly_the_payload_once_and_unpin_and_close_unregister_it(shm_dir: Path):
    if not on_tmpfs(shm_dir):
        pytest.skip("needs a writable /dev/shm")
    s = SlotFile.create(shm_dir / "a.slot", header_cap=4096, payload_cap=3 * 4096 + 5, extras_cap=64)
    probe = s.payload  # outlives close(): the mapping stays alive while a view of it exists
    last = s.segment(s.payload_off + s.payload_cap - 1, 1)  # a tensor whose storage starts at the last byte
    head = s.segment(0, PREAMBLE_BYTES)
    assert not s.pinned and not probe.is_pinned()
    assert s.pin_for_cuda(torch.device("cuda", torch.cuda.current_device())) is True
    assert s.pinned and probe.is_pinned() and last.is_pinned()
    assert not head.is_pinned(), "the registration must cover the payload region only"
    assert s.pin_for_cuda() is True, "pinning twice must be a no-op, not a second registration"
    s.unpin()
    assert not s.pinned and not probe.is_pinned()
    s.unpin()  # no-op
    assert s.pin_for_cuda() is True and probe.is_pinned()
    s.close()
    assert not s.pinned and not probe.is_pinned()
    torch.cuda.synchronize()


def test_slot_without_payload_is_never_registered(shm_dir: Path):
    s = SlotFile.create(shm_dir / "empty.slot", header_cap=4096, payload_cap=0, extras_cap=64)
    assert s.pin_for_cuda() is False and not s.pinned
    s.close()


def test_refused_registration_warns_with_the_error_and_the_path_and_leaves_no_stale_cuda_error(
        shm_dir: Path, caplog: pytest.LogCaptureFixture):
    s = SlotFile.create(shm_dir / "b.slot", header_cap=4096, payload_cap=8192, extras_cap=64)
    probe = s.payload
    cudart = torch.cuda.cudart()
    ptr = probe.data_ptr()
    rc = cudart.cudaHostRegister(ptr, s.payload_cap, 0)  # someone else registered this range already
    if int(rc) != 0:
        pytest.skip(f"cannot register a /dev/shm mapping here ({cudart.cudaGetErrorString(rc)})")
    try:
        caplog.set_level(logging.WARNING, logger="neighbor_ckpt.snapshot.store")
        assert s.pin_for_cuda() is False
        assert not s.pinned
        msgs = [r.getMessage() for r in caplog.records if "cudaHostRegister" in r.getMessage()]
        assert len(msgs) == 1, msgs
        assert str(s.path) in msgs[0] and "cudaError" in msgs[0], msgs[0]
        # The refusal did not stay behind as this thread's CUDA last error: the next kernel launch check passes.
        x = torch.ones(16, device="cuda")
        x.add_(1)
        torch.cuda.synchronize()
        assert x.sum().item() == 32.0
        s.close()  # not pinned by the slot: it must not unregister someone else's registration
        assert probe.is_pinned()
    finally:
        assert int(cudart.cudaHostUnregister(ptr)) == 0
    assert not probe.is_pinned()


# -- the engine on CUDA sources ---------------------------------------------------------------------------------


def test_snapshot_of_cuda_sources_is_bit_exact_in_a_page_locked_slot(tmpfs_store: HostStore):
    store = tmpfs_store
    named = cuda_state(1)
    engine = make_engine(store, named)
    try:
        for it in (1, 2, 3):  # both own slots, then the first one again
            with torch.no_grad():
                for _, t in named:
                    if t.is_floating_point():
                        t.mul_(-1.5)
            engine.snapshot(it, {"it": it})
            engine.wait()
            slot, got = committed(store, it)
            assert slot.pinned and slot.payload.is_pinned(), "the slot is not page-locked"
            assert list(got) == [m.name for m, _ in named]
            for m, t in named:
                assert got[m.name].dtype == t.dtype and tuple(got[m.name].shape) == tuple(t.shape), m.name
                assert host_bits(got[m.name]) == host_bits(t), f"iteration {it}: {m.name} differs"
            assert slot.read_extras(slot.read_header())["it"] == it
        assert engine.stats.failures == 0
        assert all(s.pinned for s in own_slots(store))
    finally:
        engine.close()


def test_snapshot_returns_at_once_and_copies_what_the_stream_computed_before_it(tmpfs_store: HostStore):
    """GPU work enqueued right before ``snapshot()`` (a long spin, then a write of the source) is still running
    when ``snapshot()`` returns; the committed slot holds the values written by that work, never older ones."""
    store = tmpfs_store
    src = torch.zeros(1 << 20, device="cuda")
    noise = torch.randn(1 << 20, device="cuda")
    a = torch.randn(1024, 1024, device="cuda")
    named = [(TensorMeta.of("optim/exp_avg", StateKind.OPTIMIZER, src), src)]
    engine = make_engine(store, named)
    try:
        for it in range(1, 5):
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            src.copy_((a @ a).view(-1) * it)  # the producer: its result lands in the source after the spin
            src.add_(noise)
            engine.snapshot(it, {"it": it})
            busy = not torch.cuda.current_stream().query()
            engine.wait()
            if it > store.versions:
                # The first snapshot into each slot page-locks it, and cudaHostRegister waits for the device to go
                # idle (seen on an H100, torch 2.11): the producer may be done by then. Later snapshots must not wait.
                assert busy, "the producer finished before snapshot() returned: raise SLEEP_CYCLES"
            torch.cuda.synchronize()
            slot, got = committed(store, it)
            assert slot.pinned
            assert host_bits(got["optim/exp_avg"]) == host_bits(src), f"iteration {it}: the copy ran early"
        assert engine.stats.failures == 0
    finally:
        engine.close()


def test_recreated_slots_are_unregistered_and_closing_the_store_unregisters_the_rest(tmpfs_store: HostStore):
    store = tmpfs_store
    src = [torch.arange(1000.0, device="cuda"), torch.ones(7, dtype=torch.float64, device="cuda")]
    named = [(TensorMeta.of(f"optim/t{i}", StateKind.OPTIMIZER, t), t) for i, t in enumerate(src)]
    engine = make_engine(store, named)
    try:
        for it in (1, 2):
            engine.snapshot(it, {"blob": "x"})
            engine.wait()
        first = own_slots(store)
        probes = [s.payload for s in first]  # views that outlive the slot objects
        assert all(s.pinned for s in first) and all(p.is_pinned() for p in probes)
        for it in (3, 4):  # the small state outgrows the slots: each own slot is re-created with a bigger capacity
            src[0].add_(1)
            src[1].mul_(2)
            engine.snapshot(it, {"blob": "x" * 200_000})
            engine.wait()
            _, got = committed(store, it)
            assert host_bits(got["optim/t0"]) == host_bits(src[0]) and host_bits(got["optim/t1"]) == host_bits(src[1])
        assert engine.stats.failures == 0
        second = own_slots(store)
        assert all(a is not b for a, b in zip(first, second)), "the slots were not re-created"
        assert all(b.extras_cap > a.extras_cap for a, b in zip(first, second))
        assert not any(s.pinned for s in first)
        assert not any(p.is_pinned() for p in probes), "a re-created slot's old mapping is still registered"
        assert all(s.pinned for s in second)
    finally:
        engine.close()
    probes2 = [s.payload for s in second]
    assert all(p.is_pinned() for p in probes2)
    store.close()
    assert not any(s.pinned for s in second)
    assert not any(p.is_pinned() for p in probes2), "closing the store left slots registered"


def test_refused_registration_costs_one_warning_per_slot_and_every_snapshot_still_commits(
        tmpfs_store: HostStore, caplog: pytest.LogCaptureFixture):
    """The slots the engine will use are registered by someone else first: the engine's own registration is refused
    in its worker thread (one warning per slot, none per iteration), and every snapshot still commits exactly (the
    refusal does not resurface as a CUDA error of a later call in that thread)."""
    store = tmpfs_store
    named = cuda_state(2)
    engine = make_engine(store, named)
    cudart = torch.cuda.cudart()
    slots = [store.ensure(ROLE_OWN, i, header_cap=header_capacity(engine.meta), payload_cap=engine.plan.unique_bytes,
                          extras_cap=MIN_EXTRAS_BYTES) for i in range(store.versions)]
    probes = [s.payload for s in slots]
    ptrs = []
    caplog.set_level(logging.WARNING, logger="neighbor_ckpt.snapshot.store")
    try:
        for s in slots:
            rc = cudart.cudaHostRegister(s.payload.data_ptr(), s.payload_cap, 0)
            assert int(rc) == 0, cudart.cudaGetErrorString(rc)
            ptrs.append(s.payload.data_ptr())
        for it in (1, 2, 3, 4):
            with torch.no_grad():
                named[0][1].add_(1)
            engine.snapshot(it, {"it": it})
            engine.wait()
            slot, got = committed(store, it)
            assert slot in slots, "the engine re-created the prepared slot: capacities differ"
            assert not slot.pinned
            for m, t in named:
                assert host_bits(got[m.name]) == host_bits(t), f"iteration {it}: {m.name} differs"
        assert engine.stats.failures == 0
        warned = [r.getMessage() for r in caplog.records if "cudaHostRegister" in r.getMessage()]
        assert len(warned) == len(slots), warned
        for s in slots:
            assert sum(str(s.path) in w for w in warned) == 1, (s.path, warned)
    finally:
        engine.close()
        store.close()
        for p in ptrs:
            assert int(cudart.cudaHostUnregister(p)) == 0
    assert not any(p.is_pinned() for p in probes)


def test_slots_left_pageable_still_snapshot_exactly_and_in_order(tmpfs_store: HostStore,
                                                                 monkeypatch: pytest.MonkeyPatch):
    """Without page-locking (what a refused registration leaves), the side-stream copies into pageable memory are
    still ordered after the producer and exact, only synchronous."""
    monkeypatch.setattr(SlotFile, "pin_for_cuda", lambda self, *args, **kwargs: False)
    store = tmpfs_store
    named = cuda_state(3)
    src = named[0][1]
    noise = torch.randn_like(src)
    engine = make_engine(store, named)
    try:
        for it in (1, 2, 3):
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            src.add_(noise)  # lands after the spin
            engine.snapshot(it, {"it": it})
            engine.wait()
            torch.cuda.synchronize()
            slot, got = committed(store, it)
            assert not slot.pinned and not slot.payload.is_pinned()
            for m, t in named:
                assert host_bits(got[m.name]) == host_bits(t), f"iteration {it}: {m.name} differs"
        assert engine.stats.failures == 0
    finally:
        engine.close()


# -- restore into CUDA tensors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fresh_mapping", [False, True], ids=["same-mapping", "reopened-file"])
def test_snapshot_restores_into_cuda_model_and_optimizer_bit_exactly(tmpfs_store: HostStore, fresh_mapping: bool):
    """The local restore path of a restarted rank (``read_tensors`` of a verified own slot, then the adapter's
    ``load``) into a CUDA model and AdamW state that were zeroed: every tensor comes back bit-exact on its device,
    and the step that followed the snapshot is recomputed bit-exactly."""
    store = tmpfs_store
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 8)).to(dev)
    model.register_buffer("scale", torch.randn(5, device=dev).to(torch.bfloat16))
    model.register_buffer("count", torch.arange(3, device=dev))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    xs = [torch.randn(32, 64, device=dev) for _ in range(4)]

    def step(x: torch.Tensor) -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for x in xs[:3]:
        step(x)
    adapter = TorchOptimizerAdapter(model, opt)
    named = adapter.named_tensors()  # CUDA weights and moments; AdamW (not fused) keeps its step counters on the CPU
    engine = make_engine(store, named)
    try:
        engine.snapshot(3, adapter.capture_extras())
        engine.wait()
        assert engine.stats.failures == 0
    finally:
        engine.close()
    expected = {m.name: t.detach().clone() for m, t in named}
    step(xs[3])
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for _, t in named:
            t.zero_()

    slot, _ = committed(store, 3)
    assert slot.pinned
    if fresh_mapping:  # a restarted process maps the file anew
        path = slot.path
        store.close()
        slot = SlotFile.open(path)
    hdr = slot.read_header()
    slot.verify(hdr)
    adapter.load(read_tensors(slot, hdr), slot.read_extras(hdr))
    torch.cuda.synchronize()
    if fresh_mapping:
        slot.close()

    restored = adapter.named_tensors()
    assert [m.name for m, _ in restored] == list(expected)
    for m, t in restored:
        want = expected[m.name]
        assert t.device == want.device and t.dtype == want.dtype and t.shape == want.shape, m.name
        assert host_bits(t) == host_bits(want), f"{m.name} differs after the restore"
    step(xs[3])
    for n, p in model.named_parameters():
        assert host_bits(p) == host_bits(after[n]), f"{n}: the step after the restore differs"


def test_fp16_scaler_and_staged_buffers_are_copied_without_a_device_sync_and_before_the_next_forward(
        tmpfs_store: HostStore):
    """fp16 training with megatron-core's DynamicGradScaler: its state_dict's ``scale`` is a CUDA tensor, as is a
    BatchNorm buffer the next forward updates. ``snapshot()`` returns while the GPU still computes them (no
    ``.cpu()`` synchronization on the training thread), and the snapshot holds their values after that work and
    before the next forward's in-place updates, enqueued right after ``snapshot()`` returned."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    store = tmpfs_store
    scaler = DynamicGradScaler(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=2, hysteresis=2)
    assert scaler.state_dict()["scale"].is_cuda
    bn = nn.BatchNorm1d(64).cuda()
    main = torch.randn(1 << 16, device="cuda")
    named = [(TensorMeta.of("main/shard", StateKind.MAIN_PARAM, main), main),
             (TensorMeta.of("buffer/bn.running_mean", StateKind.BUFFER, bn.running_mean), bn.running_mean)]
    engine = make_engine(store, named)
    assert [p.meta.name for p in engine.plan.staged] == ["buffer/bn.running_mean"]
    a = torch.randn(1024, 1024, device="cuda")
    # CUDA loads kernels lazily (CUDA_MODULE_LOADING=LAZY, the default), and loading one at its first launch can wait
    # for the device: on an H100 (torch 2.11) the scaler's first backoff (iteration 3: its first torch.max) left the
    # stream idle before snapshot() was called (tools/gpu_probe/sync_probe.py). Launch every kernel of the producers
    # below once, before the loop, so that only snapshot() is measured.
    warm = DynamicGradScaler(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                             growth_interval=1, hysteresis=1)
    warm.update(found_inf=True)  # backoff: mul, max
    warm.update(found_inf=False)  # growth: mul
    torch.empty_like(bn.running_mean).copy_((a @ a)[0, :64] * 1)
    del warm
    torch.cuda.synchronize()
    try:
        for it in range(1, 5):
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            # the step's producers, still running when snapshot() returns
            bn.running_mean.copy_((a @ a)[0, :64] * it)
            scaler.update(found_inf=bool(it % 2))  # a new scale tensor computed on the device
            busy_before = not torch.cuda.current_stream().query()
            engine.snapshot(it, {"grad_scaler": scaler.state_dict()})
            busy = not torch.cuda.current_stream().query()
            want_mean, want_scale = bn.running_mean.clone(), scaler.scale.clone()  # enqueued after the staging
            bn.running_mean.add_(1.0)  # the next forward updates the buffer in place
            scaler._scale.mul_(3.0)
            engine.wait()
            if it > store.versions:
                assert busy_before, ("the step's producers waited for the device before snapshot() was called (a "
                                     "kernel loaded at its first launch?): warm it up above, or raise SLEEP_CYCLES")
                assert busy, "snapshot() waited for the device (or raise SLEEP_CYCLES)"
            torch.cuda.synchronize()
            refs = {r.header.iteration: r for r in store.committed(ROLE_OWN, verify=True)}
            slot = store.slot(ROLE_OWN, refs[it].index)
            got = read_tensors(slot, refs[it].header)
            assert host_bits(got["buffer/bn.running_mean"]) == host_bits(want_mean), f"iteration {it}"
            saved = slot.read_extras(refs[it].header)["grad_scaler"]
            assert not saved["scale"].is_cuda and host_bits(saved["scale"]) == host_bits(want_scale)
            scaler._scale.div_(3.0)
        assert engine.stats.failures == 0
    finally:
        engine.close()
