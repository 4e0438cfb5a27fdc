"""The transport seam in one process: ``transport.kind`` validation, the factory, the names kept importable, and the
rounds recovery allows itself. The multi-rank contract is ``tests/multiproc/test_transport_contract.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from neighbor_ckpt.config import TRANSPORT_KINDS, NeighborCkptConfig, TransportConfig
from neighbor_ckpt.errors import ConfigError, TopologyError
from neighbor_ckpt.recovery.flow import COPIES_PER_VERSION_RESHARD, COPIES_PER_VERSION_RESTORE, max_rounds
from neighbor_ckpt.snapshot import gloo_transport
from neighbor_ckpt.snapshot.store import HostStore
from neighbor_ckpt.snapshot.topology import build_topology
from neighbor_ckpt.snapshot.transport import NeighborTransport
from neighbor_ckpt.snapshot.transport_kinds import make_transport, transport_kinds


def test_transport_kind_defaults_to_gloo_and_an_unknown_kind_names_the_known_ones() -> None:
    assert TransportConfig().kind == "gloo"
    assert NeighborCkptConfig.from_dict({"transport": {"kind": "gloo"}}).transport.kind == "gloo"
    with pytest.raises(ConfigError, match=r"neighbor_ckpt\.transport\.kind: 'nccl' is not allowed \(allowed values: "
                                          r"'gloo', 'gloo_split'\)"):
        NeighborCkptConfig.from_dict({"transport": {"kind": "nccl"}})
    with pytest.raises(ConfigError, match=r"neighbor_ckpt\.transport\.kind"):
        TransportConfig(kind="tcp")


def test_the_configurable_kinds_are_the_registered_ones() -> None:
    assert set(TRANSPORT_KINDS) == set(transport_kinds())


def test_max_rounds_keeps_what_each_recovery_needs() -> None:
    assert [max_rounds(v, copies_per_version=COPIES_PER_VERSION_RESTORE) for v in (1, 2, 3)] == [6, 10, 14]
    assert [max_rounds(v, copies_per_version=COPIES_PER_VERSION_RESHARD) for v in (1, 2, 3)] == [4, 6, 8]



def test_make_transport_builds_the_configured_kind_over_the_group_passed_in(tmp_path: Path,
                                                                            group: dist.ProcessGroup) -> None:
    topo = build_topology(rank=0, world_size=1, dp_ranks=[0])
    store = HostStore(tmp_path / "store", job_id="j", rank=0)
    cfg = TransportConfig(chunk_mb=0.5, rate_limit_mb_per_s=3)
    t = make_transport(cfg, topology=topo, store=store, group=group)
    assert isinstance(t, NeighborTransport) and t.kind == "gloo" and t.group is group and t.store is store
    assert (t.chunk, t.rate) == (1 << 19, 3e6)
    t.close()  # never started: nothing to stop, nothing sent
    with pytest.raises(TopologyError, match="at least two ranks"):
        t.start()  # one DP rank: no ring to stream on (recovery still uses the transport)
    cfg.kind = "nccl"  # set after validation: the factory refuses it too
    with pytest.raises(ConfigError, match=r"'nccl' is not a known transport \(known kinds: 'gloo', 'gloo_split'\)"):
        make_transport(cfg, topology=topo, store=store, group=group)


def test_gloo_split_streams_over_a_group_of_its_own_and_recovers_over_the_one_passed_in(
        tmp_path: Path, group: dist.ProcessGroup) -> None:
    topo = build_topology(rank=0, world_size=1, dp_ranks=[0])
    store = HostStore(tmp_path / "store", job_id="j", rank=0)
    t = make_transport(TransportConfig(kind="gloo_split"), topology=topo, store=store, group=group)
    assert isinstance(t, gloo_transport.GlooSplitTransport) and t.kind == "gloo_split"
    assert t.group is group and t.stream_group is not group
    assert dist.get_process_group_ranks(t.stream_group) == dist.get_process_group_ranks(group)


def test_an_announced_message_larger_than_the_receiver_expects_is_refused_before_allocation() -> None:
    """On 2c061fd the elastic exchange allocated whatever size a peer announced (``torch.empty(n)``)."""
    from neighbor_ckpt.errors import TransportError
    from neighbor_ckpt.snapshot.gloo_transport import check_announced

    check_announced({1: 100, 2: 0}, {1: 100, 2: 5}, rank=0)
    check_announced({1: 1 << 40}, None, rank=0)  # no limit given: as before
    with pytest.raises(TransportError, match="rank 2 announced a message of 1099511627776 bytes where at most 5"):
        check_announced({1: 100, 2: 1 << 40}, {1: 100, 2: 5}, rank=0)
    with pytest.raises(TransportError, match="-1 bytes"):
        check_announced({1: -1}, {1: 100}, rank=0)
