"""Tier 2: the transport contract, on real gloo ranks, for every registered ``transport.kind``.

:func:`check_contract` runs inside each worker, in the order of the
:class:`~neighbor_ckpt.snapshot.transport.NeighborTransport` docstring (recovery images, the exchange, then streaming
and close), and returns what this rank saw go wrong: a list of violations, empty when the transport kept the
contract. It only looks at what arrived, never at how a kind moves it, so one contract serves every kind.

:class:`BrokenTransport` wraps a real transport and reorders or drops one chunk of one transfer (content only: the
message count stays, so no peer hangs); the contract must report each of its failure modes.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import Counter
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pytest
import torch
import torch.distributed as dist

from neighbor_ckpt.config import TransportConfig
from neighbor_ckpt.recovery.flow import read_tensors
from neighbor_ckpt.snapshot.slot import SlotFile, SlotHeader
from neighbor_ckpt.snapshot.store import ROLE_LAZY, ROLE_OWN, ROLE_REPLICA, HostStore
from neighbor_ckpt.snapshot.topology import Topology, build_topology
from neighbor_ckpt.snapshot.transport import NeighborTransport, Pulled
from neighbor_ckpt.snapshot.transport_kinds import make_transport, transport_kinds
from tests.multiproc.test_gloo_ring import _image, _spawn

pytestmark = pytest.mark.multiproc

CHUNK = 1000
"""Bytes per chunk: every image is several chunks (its payload alone is 5,848 bytes)."""
WORLD = 3

Factory = Callable[[Topology, HostStore, dist.ProcessGroup, Callable[[int], None]], NeighborTransport]
"""(topology, store, group, on_replica) -> the transport under test."""


def kind_factory(kind: str, topology: Topology, store: HostStore, group: dist.ProcessGroup,
                 on_replica: Callable[[int], None]) -> NeighborTransport:
    """The transport of ``kind`` as the checkpointer makes it (:func:`make_transport`), with small chunks."""
    return make_transport(TransportConfig(kind=kind, chunk_mb=CHUNK / 2**20), topology=topology, store=store,
                          group=group, on_replica=on_replica)


# -- the contract ----------------------------------------------------------------------------------------------


def _expected(owner: int, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors ``tests.multiproc.test_gloo_ring._image`` writes, from a generator of their own: this runs on the
    receiver thread too, while the main thread seeds the global one to write the next image."""
    g = torch.Generator().manual_seed(owner * 100 + iteration)
    return torch.randn(1000, generator=g), torch.randn(33, 7, dtype=torch.float64, generator=g)


def _image_problems(slot: SlotFile | None, owner: int, iteration: int, what: str) -> list[str]:
    """What is wrong with ``slot`` as a copy of ``owner``'s image of ``iteration`` (checksums and bytes)."""
    if slot is None:
        return [f"{what}: no slot"]
    try:
        hdr = slot.read_header()
        slot.verify(hdr)
    except Exception as e:  # noqa: BLE001 - every failure is a violation to report
        return [f"{what}: does not verify: {e}"]
    out = []
    if (hdr.owner_rank, hdr.iteration) != (owner, iteration):
        out.append(f"{what}: holds iteration {hdr.iteration} of rank {hdr.owner_rank}")
    t0, t1 = _expected(owner, iteration)
    got = read_tensors(slot, hdr)
    if not (torch.equal(got["t0"], t0) and torch.equal(got["t1"], t1)):
        out.append(f"{what}: the payload differs from what was sent")
    if slot.read_extras(hdr) != {"rank": owner, "it": iteration}:
        out.append(f"{what}: the extras differ from what was sent")
    return out


def _message(src: int, dst: int, round_: int) -> torch.Tensor:
    """Bytes ``src`` sends ``dst`` in ``round_``: sizes from empty to several chunks, contents unique per pair."""
    n = 0 if (src + dst + round_) % 4 == 3 else 1 + 2100 * (src + 1) + 37 * dst + 11 * round_
    g = torch.Generator().manual_seed(10_000 * round_ + 100 * src + dst)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _own_slot(store: HostStore, iteration: int) -> tuple[SlotFile, SlotHeader]:
    _image(store, iteration)
    ref = next(r for r in store.committed(ROLE_OWN, verify=True) if r.header.iteration == iteration)
    slot = store.slot(ROLE_OWN, ref.index)
    assert slot is not None  # noqa: S101 - the test's own setup
    return slot, ref.header


def check_contract(make: Factory, rank: int, world: int, root: Path) -> list[str]:
    """Run the contract on this rank (every rank of the world calls it at once); returns the violations seen here."""
    v: list[str] = []
    topo = build_topology(rank=rank, world_size=world, dp_ranks=range(world))
    store = HostStore(root / f"store{rank}", job_id="j", rank=rank)
    group = dist.new_group(backend="gloo")
    before = set(threading.enumerate())
    succ, pred = topo.successor, topo.predecessor
    acked: list[int] = []

    def on_replica(iteration: int) -> None:
        # Called once the replica committed, before the next image can land: each one is checked as it arrives.
        acked.append(iteration)
        idx = next((r.index for r in store.committed(ROLE_REPLICA, verify=False) if r.header.iteration == iteration),
                   None)
        v.extend(_image_problems(None if idx is None else store.slot(ROLE_REPLICA, idx), pred, iteration,
                                 f"replica of iteration {iteration} as it arrived"))

    t = make(topo, store, group, on_replica)

    # 1. recovery images: each rank sends its own image to its predecessor (on a thread, as recovery does) while it
    # pulls its successor's; the pull is hashed as it arrives.
    slot, hdr = _own_slot(store, 1)
    send_errors: list[BaseException] = []

    def _send() -> None:
        try:
            t.send_image(slot, hdr, pred)
        except BaseException as e:  # noqa: BLE001
            send_errors.append(e)

    th = threading.Thread(target=_send)
    th.start()
    pulled: Pulled | None = None
    try:
        pulled = t.pull_image(ROLE_LAZY, succ)
    except Exception as e:  # noqa: BLE001
        v.append(f"pull from rank {succ} raised {e!r}")
    th.join()
    v += [f"send_image to rank {pred} raised {e!r}" for e in send_errors]
    if pulled is not None:
        got = store.slot(ROLE_LAZY, pulled.index)
        if pulled.iteration != 1:
            v.append(f"pull: announced iteration {pulled.iteration}, expected 1")
        if pulled.checksums is None or got is None:
            v.append("pull: no checksums computed on arrival")
        else:
            h = got.read_header()
            arrival = (pulled.checksums.get(got.payload_off, h.payload_nbytes),
                       pulled.checksums.get(got.extras_off, h.extras_nbytes))
            if arrival != got.checksums(h.payload_nbytes, h.extras_nbytes):
                v.append("pull: the checksums computed on arrival are not those of the bytes in the slot")
            try:
                got.verify(h, pulled.checksums)
            except Exception as e:  # noqa: BLE001
                v.append(f"pull: the copy does not verify with its arrival checksums: {e}")
        v += _image_problems(got, succ, 1, "pulled image")

    # 2. the exchange: every pair, then the ring only; every message to its peer, bytes as sent, rounds kept apart.
    peers = [r for r in range(world) if r != rank]
    for round_, (dsts, srcs) in enumerate([(peers, peers), ([succ], [pred])]):
        try:
            received = t.exchange({d: _message(rank, d, round_) for d in dsts}, srcs)
        except Exception as e:  # noqa: BLE001
            v.append(f"exchange round {round_} raised {e!r}")
            continue
        if sorted(received) != sorted(srcs):
            v.append(f"exchange round {round_}: messages from {sorted(received)}, expected from {sorted(srcs)}")
        for s in srcs:
            if s in received and not torch.equal(received[s], _message(s, rank, round_)):
                v.append(f"exchange round {round_}: the message from rank {s} is not what it sent")

    # 3. streaming: three images to the successor, each acknowledged, in order; the replica slots hold the newest two
    # (committed: the commit marker landed), bit for bit.
    t.start()
    for it in (2, 3, 4):
        slot, hdr = _own_slot(store, it)
        if not t.send(slot, hdr):
            v.append(f"streaming: iteration {it} was not acknowledged by rank {succ}")
    dist.barrier(group)
    t.close()
    if acked != [2, 3, 4]:
        v.append(f"streaming: replicas committed in the order {acked}, expected [2, 3, 4]")
    if t.replica_iteration != 4:
        v.append(f"streaming: replica_iteration is {t.replica_iteration}, expected 4")
    if not t.healthy:
        v.append("streaming: the transport is unhealthy after a clean run")
    replicas = {r.header.iteration: r.index for r in store.committed(ROLE_REPLICA, verify=False)}
    if sorted(replicas) != [3, 4]:
        v.append(f"streaming: committed replicas of iterations {sorted(replicas)}, expected [3, 4]")
    for it, idx in replicas.items():
        v += _image_problems(store.slot(ROLE_REPLICA, idx), pred, it, f"replica of iteration {it}")

    # 4. close is clean: nothing the transport started is still running.
    left = [th.name for th in threading.enumerate() if th not in before and th.is_alive()]
    if left:
        v.append(f"close: threads still running: {left}")
    store.close()
    return [f"rank {rank}: {x}" for x in v]


# -- a transport that breaks the contract ------------------------------------------------------------------------


class BrokenTransport(NeighborTransport):
    """Wraps a real transport; on ``armed_rank``, the first transfer of one kind loses one chunk's order or the chunk
    itself. Counts the calls of each method (:attr:`calls`), so a test can also see what went through it.

    ``mode``: ``stream-reorder`` (the first streamed image has chunks 0 and 1 of its payload swapped),
    ``pull-drop`` (chunk 1 of the first recovery image's payload never arrives: the receiver keeps what its slot
    held), ``exchange-reorder`` (the first exchanged message of at least two chunks has chunks 0 and 1 swapped),
    ``none`` (nothing broken: only counts).
    The broken copy is made in a scratch store and handed to the real transport, so the wire protocol (how many
    messages, their sizes) is untouched and no peer waits forever."""

    def __init__(self, inner: NeighborTransport, *, mode: str, chunk: int, scratch: HostStore,
                 armed_rank: int = 0) -> None:
        super().__init__(topology=inner.topology, store=inner.store, group=inner.group)
        self.inner, self.mode, self.chunk, self.scratch = inner, mode, chunk, scratch
        self._armed = inner.topology.rank == armed_rank
        self.calls: Counter[str] = Counter()

    def _fire(self, mode: str) -> bool:
        if self._armed and self.mode == mode:
            self._armed = False
            return True
        return False

    def _mangle(self, buf: torch.Tensor, *, drop: bool) -> None:
        c = self.chunk
        if drop:
            buf[c:2 * c] = 0
        else:
            first = buf[:c].clone()
            buf[:c] = buf[c:2 * c]
            buf[c:2 * c] = first

    def _broken_copy(self, slot: SlotFile, header: SlotHeader, *, drop: bool) -> SlotFile:
        hcap, pcap, ecap = slot.capacities
        copy = self.scratch.ensure(ROLE_OWN, 0, header_cap=hcap, payload_cap=pcap, extras_cap=ecap)
        for off, n in slot.image_segments(header):
            copy.segment(off, n).copy_(slot.segment(off, n))
        self._mangle(copy.segment(copy.payload_off, header.payload_nbytes), drop=drop)
        return copy

    def start(self) -> None:
        self.inner.start()

    def send(self, slot: SlotFile, header: SlotHeader) -> bool:
        self.calls["send"] += 1
        if self._fire("stream-reorder"):
            slot = self._broken_copy(slot, header, drop=False)
        return self.inner.send(slot, header)

    def close(self, *, graceful: bool = True) -> None:
        self.inner.close(graceful=graceful)

    @property
    def healthy(self) -> bool:
        return self.inner.healthy

    @property
    def replica_iteration(self) -> int | None:  # type: ignore[override]
        return self.inner.replica_iteration

    @replica_iteration.setter
    def replica_iteration(self, value: int | None) -> None:
        pass  # the inner transport's counts

    def send_image(self, slot: SlotFile, header: SlotHeader, dst: int) -> None:
        self.calls["send_image"] += 1
        if self._fire("pull-drop"):
            slot = self._broken_copy(slot, header, drop=True)
        self.inner.send_image(slot, header, dst)

    def pull_image(self, role: str, src: int, *, index: int | None = None) -> Pulled:
        self.calls["pull_image"] += 1
        return self.inner.pull_image(role, src, index=index)

    def exchange(self, out: Mapping[int, torch.Tensor], expect_from: Sequence[int], *,
                 limits: Mapping[int, int] | None = None) -> dict[int, torch.Tensor]:
        self.calls["exchange"] += 1
        out = dict(out)
        if self.mode == "exchange-reorder":
            for dst, m in sorted(out.items()):
                if m.numel() >= 2 * self.chunk and self._fire("exchange-reorder"):
                    out[dst] = m.clone()
                    self._mangle(out[dst], drop=False)
        return self.inner.exchange(out, expect_from, limits=limits)


BROKEN_MODES = ("stream-reorder", "pull-drop", "exchange-reorder")


def broken_factory(mode: str, scratch_root: Path, topology: Topology, store: HostStore, group: dist.ProcessGroup,
                   on_replica: Callable[[int], None]) -> NeighborTransport:
    inner = kind_factory("gloo", topology, store, group, on_replica)
    scratch = HostStore(scratch_root / f"scratch{topology.rank}", job_id="j", rank=topology.rank)
    return BrokenTransport(inner, mode=mode, chunk=CHUNK, scratch=scratch)


# -- the tests -------------------------------------------------------------------------------------------------


def _run_contracts(factories: dict[str, Factory], rank: int, world: int, tmp: Path) -> None:
    """Worker: the contract once per named factory, in order, each with its own stores and group; the violations
    go to ``violations<rank>.json`` (name -> list)."""
    found = {name: check_contract(make, rank, world, tmp / name) for name, make in factories.items()}
    (tmp / f"violations{rank}.json").write_text(json.dumps(found))


def _violations(tmp: Path) -> dict[str, list[str]]:
    errors = [p.read_text() for p in tmp.glob("err*")]
    assert not errors, errors
    out: dict[str, list[str]] = {}
    for rank in range(WORLD):
        for name, vs in json.loads((tmp / f"violations{rank}.json").read_text()).items():
            out.setdefault(name, []).extend(vs)
    return out


@pytest.mark.parametrize("kind", transport_kinds())
def test_every_transport_kind_keeps_the_contract(tmp_path: Path, kind: str) -> None:
    factories = {kind: functools.partial(kind_factory, kind)}
    _spawn(functools.partial(_run_contracts, factories), tmp_path, world=WORLD)
    assert _violations(tmp_path) == {kind: []}


def test_the_contract_catches_a_transport_that_reorders_or_drops_a_chunk(tmp_path: Path) -> None:
    factories = {mode: functools.partial(broken_factory, mode, tmp_path / "scratch") for mode in BROKEN_MODES}
    _spawn(functools.partial(_run_contracts, factories), tmp_path, world=WORLD)
    found = _violations(tmp_path)
    for mode in BROKEN_MODES:
        assert found[mode], f"the contract did not notice the {mode} transport"
    assert any("pull" in v or "pulled image" in v for v in found["pull-drop"]), found["pull-drop"]
    assert any("replica" in v for v in found["stream-reorder"]), found["stream-reorder"]
    assert any("exchange" in v for v in found["exchange-reorder"]), found["exchange-reorder"]

