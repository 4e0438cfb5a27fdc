"""Tier 2: recovery moves its bytes through the transport it is given (:func:`run_recovery` with ``transport=``), and a
transfer the transport damages is caught by the recovery's verification (the checksums computed on arrival) and never
loaded: the next round restores an older iteration instead. Three gloo ranks, one DP ring; rank 1 lost its own slots,
so it pulls its state from rank 2, which holds its replica."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from neighbor_ckpt.recovery.flow import run_recovery
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore
from neighbor_ckpt.snapshot.topology import build_topology
from tests.multiproc.test_gloo_ring import _spawn
from tests.multiproc.test_transport_contract import CHUNK, BrokenTransport, _expected, _own_slot, kind_factory

pytestmark = pytest.mark.multiproc


def _recover(rank: int, world: int, tmp: Path, mode: str) -> None:
    topo = build_topology(rank=rank, world_size=world, dp_ranks=range(world))
    store = HostStore(tmp / f"store{rank}", job_id="j", rank=rank)
    group = dist.new_group(backend="gloo")
    inner = kind_factory("gloo", topo, store, group, lambda iteration: None)
    t = BrokenTransport(inner, mode=mode, chunk=CHUNK, armed_rank=2,
                        scratch=HostStore(tmp / f"scratch{rank}", job_id="j", rank=rank))
    t.start()
    for it in (1, 2):
        slot, hdr = _own_slot(store, it)
        assert t.send(slot, hdr)
    dist.barrier(group)
    t.close()
    if rank == 1:
        store.invalidate_after(ROLE_OWN, None)  # a replaced node: its own slots are gone
    t.calls.clear()
    report, restored = run_recovery(store=store, topology=topo, transport=t, layout="L")
    assert report.outcome == "restored" and restored is not None, report.to_dict()
    t0, t1 = _expected(rank, restored.iteration)
    assert torch.equal(restored.tensors["t0"], t0) and torch.equal(restored.tensors["t1"], t1)
    (tmp / f"seen{rank}.json").write_text(json.dumps({"report": report.to_dict(), "calls": dict(t.calls)}))


def _seen(tmp: Path, world: int = 3) -> list[dict]:
    assert not list(tmp.glob("err*")), [p.read_text() for p in tmp.glob("err*")]
    return [json.loads((tmp / f"seen{r}.json").read_text()) for r in range(world)]


def _recover_intact(rank: int, world: int, tmp: Path) -> None:
    _recover(rank, world, tmp, "none")


def _recover_damaged(rank: int, world: int, tmp: Path) -> None:
    _recover(rank, world, tmp, "pull-drop")


def test_recovery_moves_every_image_through_the_transport(tmp_path: Path) -> None:
    _spawn(_recover_intact, tmp_path, world=3)
    seen = _seen(tmp_path)
    assert [s["report"]["iteration"] for s in seen] == [2, 2, 2]
    assert seen[1]["report"]["source"] == "replica" and seen[1]["report"]["pulled_bytes"] > 0
    assert [s["calls"] for s in seen] == [{}, {"pull_image": 1}, {"send_image": 1}]


def test_a_transfer_the_transport_damaged_fails_verification_and_an_older_iteration_is_restored(
        tmp_path: Path) -> None:
    _spawn(_recover_damaged, tmp_path, world=3)
    seen = _seen(tmp_path)
    assert [s["report"]["iteration"] for s in seen] == [1, 1, 1], "the damaged copy of iteration 2 is never loaded"
    assert any("iteration 2" in n and "failed verification" in n for n in seen[1]["report"]["notes"]), seen[1]
    assert [s["calls"] for s in seen] == [{}, {"pull_image": 2}, {"send_image": 2}]


def _damaged_exchange(rank: int, world: int, tmp: Path) -> None:
    from neighbor_ckpt.errors import SnapshotCorruptError
    from neighbor_ckpt.recovery.elastic import _move, _Open
    from neighbor_ckpt.recovery.reshard import Copy, choose_version, plan_reshard
    from neighbor_ckpt.snapshot.engine import write_image
    from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
    from tests.unit.test_reshard import _layouts

    # As in test_reshard_exchange: rank 1 holds both old ranks' copies and sends rank 0 its shards and small state;
    # the transport swaps the first two 8-byte chunks of that message (its framing header).
    layouts = _layouts(world, 1, buffers=False)
    choice = choose_version([Copy(0, 5, 1, "replica"), Copy(1, 5, 1, "own")], old_world=world)
    plan = plan_reshard(layouts, layouts, choice)
    opened = _Open()
    if rank == 1:
        for owner, lay in layouts.items():
            metas = [TensorMeta(t.name, StateKind.MAIN_PARAM, torch.float32, tuple(t.shape)) for t in lay.tensors]
            shard = plan_shards(metas, dp_size=1, distributed_optimizer=True)
            store = HostStore(tmp / f"old{owner}", job_id="j", rank=owner)
            slot, hdr = write_image(store, ROLE_OWN, planned=shard.unique,
                                    sources=[torch.ones(t.shape) for t in lay.tensors],
                                    payload_bytes=shard.unique_bytes, iteration=5, layout="L", meta={},
                                    extras={"adapter": {"scalars": {}}})
            opened.slots[owner] = (slot, hdr)
    topo = build_topology(rank=rank, world_size=world, dp_ranks=range(world))
    inner = kind_factory("gloo", topo, HostStore(tmp / f"new{rank}", job_id="j", rank=rank), dist.group.WORLD,
                         lambda iteration: None)
    t = BrokenTransport(inner, mode="exchange-reorder", chunk=8, armed_rank=1,
                        scratch=HostStore(tmp / f"scratch{rank}", job_id="j", rank=rank))
    if rank == 0:
        with pytest.raises(SnapshotCorruptError, match="received from rank 1 is unreadable"):
            _move(plan, opened, rank=rank, new_layout=layouts[rank], transport=t)
    else:
        assert _move(plan, opened, rank=rank, new_layout=layouts[rank], transport=t).iteration == 5
    assert t.calls["exchange"] == 1
    dist.barrier()  # both ranks left the exchange


def test_a_reshard_message_the_transport_damaged_is_a_typed_corruption_not_a_parse_error(tmp_path: Path) -> None:
    _spawn(_damaged_exchange, tmp_path, world=2)
    assert not list(tmp_path.glob("err*")), [p.read_text() for p in tmp_path.glob("err*")]


BEFORE = ("n0", "n0", "n1", "n1", "n2", "n2", "n3", "n3")
"""8 ranks on 4 nodes of 2: the cross-node ring is (0, 4, 1, 5, 2, 6, 3, 7)."""
AFTER = ("n0", "n0", "n4", "n1", "n2", "n2", "n3", "n3")
"""Rank 2 taken by a spare on a fifth node: the ring becomes (0, 6, 1, 7, 4, 2, 5, 3)."""


def _recover_after_the_ring_changed(rank: int, world: int, tmp: Path) -> None:
    before = build_topology(rank=rank, world_size=world, dp_ranks=range(world), nodes=BEFORE)
    after = build_topology(rank=rank, world_size=world, dp_ranks=range(world), nodes=AFTER)
    assert (before.successor_of(2), after.successor_of(2)) == (6, 5)
    store = HostStore(tmp / f"store{rank}", job_id="j", rank=rank)
    group = dist.new_group(backend="gloo")
    t = kind_factory("gloo", before, store, group, lambda iteration: None)
    t.start()
    for it in (1, 2):
        slot, hdr = _own_slot(store, it)
        assert t.send(slot, hdr)
    dist.barrier(group)
    t.close()
    if rank == 2:  # the spare that took rank 2: an empty store on another node
        store.invalidate_after(ROLE_OWN, None)
    t = kind_factory("gloo", after, store, dist.new_group(backend="gloo"), lambda iteration: None)
    report, restored = run_recovery(store=store, topology=after, transport=t, layout="L")
    assert report.outcome == "restored" and restored is not None, report.to_dict()
    t0, t1 = _expected(rank, restored.iteration)
    assert torch.equal(restored.tensors["t0"], t0) and torch.equal(restored.tensors["t1"], t1)
    (tmp / f"seen{rank}.json").write_text(json.dumps({"report": report.to_dict()}))


def test_a_spare_on_another_node_pulls_its_replica_from_the_rank_that_holds_it_though_the_ring_changed(
        tmp_path: Path) -> None:
    """A spare on a fifth node takes rank 2 of 4 nodes x 2: the cross-node ring is computed again and rank 2's
    successor is now rank 5, but its replica lies on rank 6 (its successor when the snapshots were taken): the
    recovery finds it there (each rank reports whose replica it holds) instead of giving up."""
    _spawn(_recover_after_the_ring_changed, tmp_path, world=8)
    seen = _seen(tmp_path, world=8)
    assert [s["report"]["iteration"] for s in seen] == [2] * 8
    assert seen[2]["report"]["source"] == "replica" and seen[2]["report"]["pulled_bytes"] > 0, seen[2]
    assert any("pulling the replica from rank 6" in n for n in seen[2]["report"]["notes"]), seen[2]
