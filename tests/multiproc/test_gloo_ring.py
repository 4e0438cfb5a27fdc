"""Tier 2: real gloo process groups in spawned processes (no torchrun). The gloo ring's streaming and pulls through
its wire functions, a dead neighbor, and recovery refusing another layout. The contract every transport kind passes
is ``test_transport_contract.py``."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neighbor_ckpt.snapshot.engine import write_image
from neighbor_ckpt.errors import SnapshotCorruptError, SnapshotMismatchError
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
from neighbor_ckpt.recovery.flow import read_tensors, run_recovery
from neighbor_ckpt.snapshot.store import ROLE_OWN, ROLE_REPLICA, HostStore
from neighbor_ckpt.snapshot.topology import build_topology
from neighbor_ckpt.snapshot.gloo_transport import GlooRingTransport, pull_image, send_image

pytestmark = pytest.mark.multiproc


def _entry(rank: int, world: int, tmp: str, fn: Callable[[int, int, Path], None]) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    try:
        fn(rank, world, Path(tmp))
        (Path(tmp) / f"ok{rank}").write_text("ok")
    except BaseException:  # noqa: BLE001 - reported to the parent through a file
        (Path(tmp) / f"err{rank}").write_text(traceback.format_exc())
        os._exit(1)
    # The verdict is in the files. Leave without running the gloo process group's destructors: tearing
    # down a group whose peer has already gone (or is going) can abort in C++ ("terminate called without
    # an active exception"), which the parent would report as a failure of a test that passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn: Callable[[int, int, Path], None], tmp: Path, world: int = 2) -> None:
    mp.start_processes(_entry, args=(world, str(tmp), fn), nprocs=world, join=True, start_method="spawn")


def _image(store: HostStore, iteration: int, layout: str = "L") -> tuple[list[torch.Tensor], str]:
    torch.manual_seed(store.rank * 100 + iteration)
    tensors = [torch.randn(1000), torch.randn(33, 7, dtype=torch.float64)]
    metas = [TensorMeta.of(f"t{i}", StateKind.MAIN_PARAM, t) for i, t in enumerate(tensors)]
    plan = plan_shards(metas, dp_size=2, distributed_optimizer=True)
    write_image(store, ROLE_OWN, planned=plan.unique, sources=tensors, payload_bytes=plan.unique_bytes,
                iteration=iteration, layout=layout, meta={}, extras={"rank": store.rank, "it": iteration})
    return tensors, layout


def _contract(rank: int, world: int, tmp: Path) -> None:
    topo = build_topology(rank=rank, world_size=world, dp_ranks=range(world))
    store = HostStore(tmp / f"store{rank}", job_id="j", rank=rank)
    group = dist.new_group(backend="gloo")
    transport = GlooRingTransport(topo, store, group, chunk_bytes=1000)  # many chunks
    transport.start()
    for it in (1, 2, 3):
        _image(store, it)
        ref = next(r for r in store.committed(ROLE_OWN, verify=True) if r.header.iteration == it)
        slot = store.slot(ROLE_OWN, ref.index)
        assert slot is not None
        assert transport.send(slot, ref.header), "successor did not acknowledge"
    dist.barrier(group)
    transport.close()
    # the replica of my predecessor holds its two newest images, bit for bit
    pred = topo.predecessor
    got = {r.header.iteration: r for r in store.committed(ROLE_REPLICA, verify=True)}
    assert sorted(got) == [2, 3]
    for it, ref in got.items():
        assert ref.header.owner_rank == pred
        slot = store.slot(ROLE_REPLICA, ref.index)
        tensors = read_tensors(slot, ref.header)
        torch.manual_seed(pred * 100 + it)
        assert torch.equal(tensors["t0"], torch.randn(1000))
        assert torch.equal(tensors["t1"], torch.randn(33, 7, dtype=torch.float64))
        assert slot.read_extras(ref.header) == {"rank": pred, "it": it}
    assert transport.healthy


def test_ring_transport_delivers_every_image_bit_exact_and_acknowledged(tmp_path: Path) -> None:
    _spawn(_contract, tmp_path, world=3)
    assert not list(tmp_path.glob("err*")), [p.read_text() for p in tmp_path.glob("err*")]


def _pull(rank: int, world: int, tmp: Path) -> None:
    store = HostStore(tmp / f"store{rank}", job_id="j", rank=rank)
    group = dist.new_group(backend="gloo")
    if rank == 0:
        _image(store, 4)
        ref = next(store.committed(ROLE_OWN, verify=True))
        slot = store.slot(ROLE_OWN, ref.index)
        for _ in range(2):
            send_image(slot, ref.header, 1, group, chunk=1000)  # many chunks: every one is hashed on arrival
        return
    got = pull_image(store, ROLE_REPLICA, 0, group, chunk=1000)
    assert got is not None and got.iteration == 4 and got.checksums is not None
    slot = store.slot(ROLE_REPLICA, got.index)
    hdr = slot.read_header()
    # what was hashed while receiving is what a second pass over the slot gives
    assert (got.checksums.get(slot.payload_off, hdr.payload_nbytes),
            got.checksums.get(slot.extras_off, hdr.extras_nbytes)) == slot.checksums(hdr.payload_nbytes,
                                                                                     hdr.extras_nbytes)
    slot.verify(hdr, got.checksums)
    torch.manual_seed(0 * 100 + 4)
    assert torch.equal(read_tensors(slot, hdr)["t0"], torch.randn(1000))
    # a byte that arrived damaged (here: its checksum) is caught without a second pass
    again = pull_image(store, ROLE_REPLICA, 0, group, chunk=1000)
    assert again is not None and again.checksums is not None
    slot = store.slot(ROLE_REPLICA, again.index)
    hdr = slot.read_header()
    n, digest = again.checksums.by_offset[slot.payload_off]
    bad = type(again.checksums)({**again.checksums.by_offset, slot.payload_off: (n, digest ^ 1)})
    with pytest.raises(SnapshotCorruptError, match="payload checksum mismatch"):
        slot.verify(hdr, bad)
    slot.verify(hdr, None)  # the slot itself is intact


def test_pulled_image_is_hashed_as_it_arrives_and_verifies_without_a_second_pass(tmp_path: Path) -> None:
    _spawn(_pull, tmp_path, world=2)
    assert not list(tmp_path.glob("err*")), [p.read_text() for p in tmp_path.glob("err*")]


def _dead_neighbor(rank: int, world: int, tmp: Path) -> None:
    topo = build_topology(rank=rank, world_size=world, dp_ranks=range(world))
    store = HostStore(tmp / f"store{rank}", job_id="j", rank=rank)
    group = dist.new_group(backend="gloo", timeout=__import__("datetime").timedelta(seconds=20))
    dist.barrier(group)
    if rank == 1:
        (tmp / "ok1").write_text("ok")
        os._exit(0)  # the neighbor dies without a word
    transport = GlooRingTransport(topo, store, group, chunk_bytes=1 << 20)
    _image(store, 1)
    ref = next(store.committed(ROLE_OWN, verify=True))
    slot = store.slot(ROLE_OWN, ref.index)
    assert slot is not None
    assert transport.send(slot, ref.header) is False
    assert not transport.healthy
    assert transport.send(slot, ref.header) is False  # and stays quiet afterwards


def test_dead_neighbor_marks_the_replica_stale_without_raising(tmp_path: Path) -> None:
    _spawn(_dead_neighbor, tmp_path)
    assert (tmp_path / "ok0").exists(), (tmp_path / "err0").read_text() if (tmp_path / "err0").exists() else ""


def _other_layout(rank: int, world: int, tmp: Path) -> None:
    topo = build_topology(rank=rank, world_size=world, dp_ranks=range(world))
    store = HostStore(tmp / f"store{rank}", job_id="j", rank=rank)
    _image(store, 5, layout="written-by-another-parallel-config")
    group = dist.new_group(backend="gloo")
    with pytest.raises(SnapshotMismatchError, match="another layout"):
        run_recovery(store=store, topology=topo, group=group, layout="this-job", chunk_bytes=1 << 20)


def test_recovery_refuses_snapshots_of_another_layout_on_every_rank(tmp_path: Path) -> None:
    _spawn(_other_layout, tmp_path)
    assert not list(tmp_path.glob("err*")), [p.read_text() for p in tmp_path.glob("err*")]


def _host_memory_refused(rank: int, world: int, tmp: Path) -> None:
    import dataclasses

    from torch import nn

    import neighbor_ckpt.checkpointer as checkpointer_mod
    from neighbor_ckpt import NeighborCheckpointer, NeighborCkptConfig
    from neighbor_ckpt.adapters import TorchOptimizerAdapter
    from neighbor_ckpt.errors import HostMemoryError

    if rank == 1:  # this rank's node has almost no memory available
        real = checkpointer_mod.check_host_memory
        checkpointer_mod.check_host_memory = lambda *a, **k: dataclasses.replace(real(*a, **k), mem_available=1)
    model = nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    cfg = NeighborCkptConfig.from_dict({"job_id": "mem", "store": {"dir": str(tmp / "store")}})
    ckpt = NeighborCheckpointer(cfg, adapter=TorchOptimizerAdapter(model, opt))
    ckpt.recover()
    with pytest.raises(HostMemoryError) as e:
        ckpt.snapshot(0)
    expected = "the node has 0.00 GB available" if rank == 1 else "does not fit on the node of 1 other rank(s)"
    assert expected in str(e.value), str(e.value)
    assert not list((tmp / "store").rglob(f"rank{rank}/*.slot")), "nothing may be allocated"


def test_host_memory_preflight_refuses_on_every_rank_before_allocating_anything(tmp_path: Path) -> None:
    _spawn(_host_memory_refused, tmp_path)
    assert not list(tmp_path.glob("err*")), [p.read_text() for p in tmp_path.glob("err*")]


def _restart_loop(rank: int, world: int, tmp: Path) -> None:
    from torch import nn

    from neighbor_ckpt import NeighborCheckpointer, NeighborCkptConfig
    from neighbor_ckpt.adapters import TorchOptimizerAdapter

    # Each rank its own DP group: its whole state is unique (snapshotted every step, no lazy backup needed).
    groups = [dist.new_group([r]) for r in range(world)]

    def attempt(n: int) -> NeighborCheckpointer:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(n)
        torch.manual_seed(0)
        model = nn.Linear(16, 16)
        opt = torch.optim.Adam(model.parameters())
        cfg = NeighborCkptConfig.from_dict({"job_id": "loop", "store": {"dir": str(tmp / "store"),
                                                                        "cleanup_on_success": False}})
        return NeighborCheckpointer(cfg, adapter=TorchOptimizerAdapter(model, opt), dp_group=groups[rank],
                                    handle_sigterm=False)

    first = attempt(0)
    assert not first.recover().restored
    for it in range(3):
        first.snapshot(it)
    first.wait()
    first.engine.drain()
    second = attempt(1)  # "restarted": restores 2, then dies before completing a step (no snapshot, no close)
    assert second.recover().iteration == 2
    third = attempt(2)
    res = third.recover()
    assert res.iteration == 1, "the state that failed to restore is not chosen twice; its predecessor is"
    third.snapshot(2)  # a step completes: the guard is lifted
    assert not (third.store.dir / "restoring.json").exists()
    third.close(success=True)


def test_a_restored_state_whose_attempt_died_before_a_step_is_never_restored_again(tmp_path: Path) -> None:
    _spawn(_restart_loop, tmp_path)
    assert not list(tmp_path.glob("err*")), [p.read_text() for p in tmp_path.glob("err*")]


def _many_bad_copies(rank: int, world: int, tmp: Path) -> None:
    from neighbor_ckpt.snapshot.damage import damage_newest_slot

    topo = build_topology(rank=rank, world_size=world, dp_ranks=range(world))
    store = HostStore(tmp / f"store{rank}", job_id="j", rank=rank)
    group = dist.new_group(backend="gloo")
    transport = GlooRingTransport(topo, store, group, chunk_bytes=4096)
    transport.start()
    for it in (1, 2):
        _image(store, it)
        ref = next(r for r in store.committed(ROLE_OWN, verify=True) if r.header.iteration == it)
        assert transport.send(store.slot(ROLE_OWN, ref.index), ref.header)
    dist.barrier(group)
    transport.close()
    store.close()
    # On every rank: both copies of iteration 2 and the own copy of iteration 1 are bit-flipped. Headers and
    # commit markers are intact, so only checksums can tell; the replica of iteration 1 is the last good copy.
    d = store.dir
    damage_newest_slot(d, "bitflip")
    damage_newest_slot(d, "bitflip", role="replica")
    older = min(d.glob("own.*.slot"), key=lambda p: _iteration(p))
    _flip_payload(older)
    store = HostStore(tmp / f"store{rank}", job_id="j", rank=rank)
    report, restored = run_recovery(store=store, topology=topo, group=group, layout="L", chunk_bytes=4096)
    assert report.outcome == "restored" and restored is not None, report
    assert (restored.iteration, report.source) == (1, "replica"), report
    torch.manual_seed(rank * 100 + 1)
    assert torch.equal(restored.tensors["t0"], torch.randn(1000))
    assert restored.extras == {"rank": rank, "it": 1}
    assert sum("failed verification" in n for n in report.notes) == 3, report.notes


def _iteration(path: Path) -> int:
    from neighbor_ckpt.snapshot.slot import SlotFile

    s = SlotFile.open(path)
    try:
        return s.read_header().iteration
    finally:
        s.close()


def _flip_payload(path: Path) -> None:
    from neighbor_ckpt.snapshot.slot import SlotFile

    s = SlotFile.open(path)
    off = s.payload_off + 17
    s.close()
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))


def test_recovery_keeps_reconciling_past_every_corrupt_copy_to_the_last_good_one(tmp_path: Path) -> None:
    """Checksums are checked on the chosen copies only: each failing one is excluded and the ranks reconcile again
    (own -> replica -> the older iteration's own -> its replica), never loading a corrupt byte."""
    _spawn(_many_bad_copies, tmp_path)
    assert not list(tmp_path.glob("err*")), [p.read_text() for p in tmp_path.glob("err*")]
