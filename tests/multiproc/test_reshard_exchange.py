"""Tier 2: the elastic reshard's point-to-point exchange on real gloo ranks: a process that cannot pack its part
still takes part, so its peers learn why instead of waiting in the exchange until the group times out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neighbor_ckpt.errors import SnapshotCorruptError, SnapshotMismatchError
from neighbor_ckpt.recovery.elastic import _move, _Open
from neighbor_ckpt.recovery.reshard import Copy, choose_version, plan_reshard
from neighbor_ckpt.snapshot.engine import write_image
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
from neighbor_ckpt.snapshot.gloo_transport import GlooTransport
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore
from neighbor_ckpt.snapshot.topology import build_topology
from tests.multiproc.test_gloo_ring import _spawn
from tests.unit.test_reshard import _layouts

pytestmark = pytest.mark.multiproc


def _unpackable_part(rank: int, world: int, tmp: Path) -> None:
    import torch.distributed as dist

    layouts = _layouts(world, 1, buffers=False)
    # Rank 1 holds both old ranks' copies (rank 0's store was lost: its replica on rank 1 serves it), so rank 1 sends
    # rank 0 its shards and its small state. Old rank 0's optimizer scalars hold a tensor: they cannot be resharded.
    choice = choose_version([Copy(0, 5, 1, "replica"), Copy(1, 5, 1, "own")], old_world=world)
    plan = plan_reshard(layouts, layouts, choice)
    opened = _Open()
    if rank == 1:
        for owner, lay in layouts.items():
            metas = [TensorMeta(t.name, StateKind.MAIN_PARAM, torch.float32, tuple(t.shape)) for t in lay.tensors]
            shard = plan_shards(metas, dp_size=1, distributed_optimizer=True)
            names = {t.name.split("/", 2)[1] for t in lay.tensors}
            scalars = {n: {"step": torch.tensor(5.0) if owner == 0 else 5} for n in names}
            store = HostStore(tmp / f"old{owner}", job_id="j", rank=owner)
            slot, hdr = write_image(store, ROLE_OWN, planned=shard.unique,
                                    sources=[torch.ones(t.shape) for t in lay.tensors],
                                    payload_bytes=shard.unique_bytes, iteration=5, layout="L", meta={},
                                    extras={"adapter": {"scalars": scalars}})
            opened.slots[owner] = (slot, hdr)
    expected = (SnapshotMismatchError, "cannot be resharded") if rank == 1 else \
        (SnapshotCorruptError, "rank 1 could not send its part of the reshard: rank 1: per-parameter")
    with pytest.raises(expected[0], match=expected[1]):
        _move(plan, opened, rank=rank, new_layout=layouts[rank],
              transport=GlooTransport(build_topology(rank=rank, world_size=world, dp_ranks=range(world)),
                                      HostStore(tmp / f"new{rank}", job_id="j", rank=rank), dist.group.WORLD,
                                      chunk_bytes=1 << 20))
    dist.barrier()  # both ranks left the exchange


def test_a_rank_that_cannot_pack_its_part_tells_its_peers_instead_of_leaving_them_waiting(tmp_path: Path) -> None:
    _spawn(_unpackable_part, tmp_path)
    assert not list(tmp_path.glob("err*")), [p.read_text() for p in tmp_path.glob("err*")]
