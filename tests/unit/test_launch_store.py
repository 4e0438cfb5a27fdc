"""neighbor_ckpt.runtime.launch_store: the own-slot capacities a replaced rank reads before its recovery (one process,
real c10d stores)."""

from __future__ import annotations

import torch.distributed as dist

from neighbor_ckpt.runtime.launch_store import AGENT_STORE_ENV, SlotCapacities, recorded_agent_store


def test_a_published_capacities_is_found_by_the_next_process_of_that_rank_only():
    store = dist.HashStore()
    first = SlotCapacities(job_id="job", generation=0, store=store)
    assert first.lookup(1) is None, "a first launch finds nothing"
    assert first.publish(1, (4096, 1 << 20, 65536))
    again = SlotCapacities(job_id="job", generation=0, store=store)  # the rank's next process
    assert again.lookup(1) == (4096, 1 << 20, 65536)
    assert again.lookup(0) is None
    assert SlotCapacities(job_id="other", generation=0, store=store).lookup(1) is None
    assert SlotCapacities(job_id="job", generation=1, store=store).lookup(1) is None, "another data-parallel layout"


def test_an_unreadable_layout_or_no_store_means_no_preparation_not_an_error():
    store = dist.HashStore()
    layouts = SlotCapacities(job_id="job", generation=0, store=store)
    store.set(layouts.key(2), "not json")
    assert layouts.lookup(2) is None
    store.set(layouts.key(3), "[1, -2, 3]")
    assert layouts.lookup(3) is None
    opened = []
    none = SlotCapacities(job_id="job", generation=0, opener=lambda: opened.append(1))
    assert none.lookup(0) is None and not none.publish(0, (1, 2, 3))
    assert opened == [1], "the store is opened once, on first use"


def test_the_agent_store_address_is_read_back_as_prepare_torchrun_restart_records_it():
    assert recorded_agent_store({AGENT_STORE_ENV: "10.0.0.7:29500"}) == ("10.0.0.7", 29500)
    assert recorded_agent_store({AGENT_STORE_ENV: "[fe80::1]:29500"}) == ("[fe80::1]", 29500)
    assert recorded_agent_store({}) is None
    assert recorded_agent_store({AGENT_STORE_ENV: "host"}) is None
    assert recorded_agent_store({AGENT_STORE_ENV: "host:port"}) is None
