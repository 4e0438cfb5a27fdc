"""Resuming the data position mid-epoch: SkipFirst / install_skip on a real DataLoader + DistributedSampler."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from neighbor_ckpt.lightning._data import SkipFirst, install_skip, uninstall_skip

N = 103  # not a multiple of anything used below: the last batch is short


def dataset() -> TensorDataset:
    return TensorDataset(torch.arange(N))


def loader(rank: int = 0, replicas: int = 2, batch_size: int = 4, drop_last: bool = False,
           shuffle: bool = True) -> DataLoader:
    sampler = DistributedSampler(dataset(), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=17)
    return DataLoader(dataset(), batch_size=batch_size, sampler=sampler, drop_last=drop_last)


def epoch(dl: DataLoader, e: int) -> list[list[int]]:
    dl.sampler.set_epoch(e)
    return [b[0].tolist() for b in dl]


def reference(e: int, **kw) -> list[list[int]]:
    return epoch(loader(**kw), e)


@pytest.mark.parametrize("k", [0, 1, 3, 12, 13])
@pytest.mark.parametrize("rank", [0, 1])
def test_after_install_skip_the_epoch_yields_exactly_batches_k_onwards(rank, k):
    ref = reference(2, rank=rank)
    assert len(ref) == 13
    dl = loader(rank=rank)
    assert install_skip(dl, k) is True
    assert epoch(dl, 2) == ref[k:]


def test_the_following_epoch_is_unaffected():
    dl = loader()
    install_skip(dl, 5)
    assert epoch(dl, 3) == reference(3)[5:]
    assert epoch(dl, 4) == reference(4)
    assert epoch(dl, 4) == reference(4)


def test_set_epoch_before_or_after_install_gives_the_same_batches():
    a, b = loader(), loader()
    a.sampler.set_epoch(6)
    install_skip(a, 2)
    install_skip(b, 2)
    b.sampler.set_epoch(6)
    assert [x[0].tolist() for x in a] == [x[0].tolist() for x in b] == reference(6)[2:]


def test_set_epoch_on_the_wrapper_is_forwarded_to_the_distributed_sampler():
    dl = loader()
    install_skip(dl, 1)
    wrapper = dl.batch_sampler.sampler
    assert isinstance(wrapper, SkipFirst) and wrapper.inner is dl.sampler
    wrapper.set_epoch(9)
    assert dl.sampler.epoch == 9
    assert [b[0].tolist() for b in dl] == reference(9)[1:]


def test_set_epoch_on_a_sampler_without_it_is_a_no_op():
    SkipFirst([1, 2, 3], 1).set_epoch(3)


def test_attributes_of_the_inner_sampler_are_visible_through_the_wrapper():
    dl = loader(rank=1)
    install_skip(dl, 1)
    w = dl.batch_sampler.sampler
    assert (w.rank, w.num_replicas, w.shuffle, w.seed) == (1, 2, True, 17)


def test_len_is_unchanged():
    dl = loader()
    n_batches, n_samples = len(dl), len(dl.batch_sampler.sampler)
    install_skip(dl, 4)
    assert len(dl) == n_batches == 13
    assert len(dl.batch_sampler.sampler) == n_samples == len(dl.sampler)
    assert len(dl.batch_sampler) == n_batches


def test_skip_of_the_whole_epoch_or_more_yields_nothing_then_recovers():
    dl = loader()
    install_skip(dl, 100)
    assert epoch(dl, 1) == []
    assert epoch(dl, 2) == reference(2)


def test_drop_last_batches_are_skipped_the_same_way():
    ref = reference(0, drop_last=True)
    dl = loader(drop_last=True)
    install_skip(dl, 2)
    assert epoch(dl, 0) == ref[2:]


def test_no_skip_requested_leaves_the_loader_untouched():
    dl = loader()
    sampler = dl.batch_sampler.sampler
    assert install_skip(dl, 0) is True
    assert dl.batch_sampler.sampler is sampler


def test_loader_without_batch_sampler_is_reported_unsupported():
    dl = DataLoader(dataset(), batch_size=None)
    assert install_skip(dl, 2) is False


def test_uninstall_skip_restores_the_inner_sampler():
    dl = loader()
    inner = dl.batch_sampler.sampler
    install_skip(dl, 2)
    uninstall_skip(dl)
    assert dl.batch_sampler.sampler is inner
    assert epoch(dl, 0) == reference(0)
    uninstall_skip(dl)  # idempotent


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(40))


def test_iterable_dataset_loader_is_either_resumed_or_reported_unsupported():
    dl = DataLoader(Stream(), batch_size=4)
    ok = install_skip(dl, 2)
    first = next(iter(dl)).tolist()
    assert (ok and first == [8, 9, 10, 11]) or (not ok and first == [0, 1, 2, 3])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_skip_wrapper_can_be_copied_and_pickled(how):
    w = SkipFirst(DistributedSampler(dataset(), num_replicas=2, rank=0, seed=17), 4)
    clone = copy.deepcopy(w) if how == "deepcopy" else pickle.loads(pickle.dumps(w))
    assert clone.skip == 4 and list(clone) == list(w)
