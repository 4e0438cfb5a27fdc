"""megatron_patches.data_iter: the data iterator handed to megatron-core's forward-backward functions goes to the
data-position check (issue 31), the patch is reversible by identity, and what must not be observed is not."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron_patches import data_iter  # noqa: E402
from megatron_patches.data_iter import (SCHEDULES, ObservedMicroBatches, observe_forward_backward,  # noqa: E402
                                        observe_iterator)


def test_the_schedules_are_wrapped_while_a_hook_lives_and_restored_by_identity():
    import megatron.core.pipeline_parallel.schedules as schedules

    before = {n: getattr(schedules, n) for n in SCHEDULES}
    seen: list[Any] = []
    first = observe_forward_backward(seen.append)
    second = observe_forward_backward(seen.append)
    try:
        assert data_iter.installed()
        for n in SCHEDULES:
            assert getattr(schedules, n) is not before[n] and getattr(schedules, n).__wrapped__ is before[n]
        # get_forward_backward_func returns these module globals: a call after the patch gets the wrapped one
        assert "forward_backward_no_pipelining" in schedules.get_forward_backward_func.__code__.co_names
        first.remove()
        assert data_iter.installed(), "a second hook still lives"
    finally:
        first.remove()
        second.remove()
        second.remove()
    assert not data_iter.installed()
    assert {n: getattr(schedules, n) for n in SCHEDULES} == before


def test_a_training_call_observes_every_micro_batch_and_forward_only_none_and_observed_ones_are_left_alone():
    drawn: list[Any] = []
    seen: list[Any] = []

    def schedule(*, forward_step_func: Any, data_iterator: Any, num_microbatches: int, forward_only: bool = False):
        for _ in range(num_microbatches):
            forward_step_func(data_iterator)
        return data_iterator

    def forward_step(it: Any) -> None:
        if it is not None:
            drawn.append(next(it))

    wrapped = data_iter._wrap(schedule)
    data_iter._observers.append(seen.append)
    try:
        out = wrapped(forward_step_func=forward_step, data_iterator=iter(range(10)), num_microbatches=4)
        assert isinstance(out, ObservedMicroBatches) and seen == drawn == [0, 1, 2, 3]
        seen.clear()
        wrapped(forward_step_func=forward_step, data_iterator=iter(range(10)), num_microbatches=2, forward_only=True)
        assert seen == [], "validation / evaluation is not the training input"
        assert wrapped(forward_step_func=forward_step, data_iterator=None, num_microbatches=2) is None
        mine = observe_iterator(iter(range(3)), seen.append)
        assert wrapped(forward_step_func=forward_step, data_iterator=mine, num_microbatches=3) is mine
        assert seen == [0, 1, 2], "an iterator the user wrapped with hooks.observe is not observed twice"
    finally:
        data_iter._observers.remove(seen.append)


def test_virtual_pipeline_lists_get_their_first_iterator_observed():
    seen: list[Any] = []
    a, b = iter([1, 2]), iter([3, 4])
    out = observe_iterator([None, a, b], seen.append)
    assert out[0] is None and isinstance(out[1], ObservedMicroBatches) and out[2] is b
    assert next(out[1]) == 1 and seen == [1]
    assert observe_iterator([None, None], seen.append) == [None, None]


def test_an_iterator_with_only_next_is_observed_as_it_is():
    class NextOnly:  # megatron-core 0.16's RerunDataIterator: __next__, no __iter__
        def __init__(self) -> None:
            self.i = 0

        def __next__(self) -> int:
            self.i += 1
            return self.i

    seen: list[Any] = []
    inner = NextOnly()
    out = observe_iterator(inner, seen.append)
    assert out.inner is inner and next(out) == 1 and seen == [1]
