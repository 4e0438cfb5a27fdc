"""The NeMo step-overhead benchmark's arithmetic (pure): step times from per-rank stamps, and the verdict."""

import pytest

from tools.bench.nemo_step import TARGET, step_times, verdict


def test_step_times_take_the_slowest_rank_and_skip_warmup():
    stamps = [[0.0, 1.0, 2.0, 3.5, 4.0], [0.1, 1.2, 2.1, 3.0, 4.5]]
    # ends: 0.1 1.2 2.1 3.5 4.5; steps 0 and 1 are warm-up, step i takes end[i] - end[i-1]
    assert step_times(stamps, warmup=2) == pytest.approx([0.9, 1.4, 1.0])
    assert step_times(stamps, warmup=0) == pytest.approx([1.1, 0.9, 1.4, 1.0])


def test_step_times_refuse_ranks_with_different_step_counts():
    with pytest.raises(ValueError, match="same number of steps"):
        step_times([[0.0, 1.0], [0.0]], warmup=0)


def test_verdict_is_the_median_of_per_round_ratios_and_the_share_of_the_floor():
    rounds = [{"off": [1.0, 1.0, 1.0], "on": [1.04, 1.04, 1.06], "floor": [1.08, 1.08, 1.08]},
              {"off": [2.0, 2.0, 2.0], "on": [2.1, 2.1, 2.1], "floor": [2.2, 2.2, 2.2]}]
    v = verdict(rounds)
    assert v.on_ratio == pytest.approx((1.04 + 1.05) / 2)
    assert v.floor_ratio == pytest.approx((1.08 + 1.1) / 2)
    assert v.share_of_floor == pytest.approx((v.on_ratio - 1) / (v.floor_ratio - 1))
    assert v.passed is (v.on_ratio <= TARGET)
    assert any("PASS" in line for line in v.lines())


def test_verdict_without_floor_names_no_floor():
    v = verdict([{"off": [1.0], "on": [1.2]}])
    assert v.floor_ratio is None and v.share_of_floor is None and not v.passed
    assert not any("floor" in line for line in v.lines())


def test_blocks_rotate_the_variant_order_each_round_and_skip_each_blocks_first_step():
    from tools.bench.nemo_step import block_variant

    seq = [block_variant(s, warmup=2, block_steps=3, variants=("off", "on", "floor")) for s in range(2 + 2 * 9)]
    assert seq[:2] == [(None, -1, False)] * 2
    firsts = [seq[i][:2] for i in range(2, 20, 3)]
    assert firsts == [("off", 0), ("on", 0), ("floor", 0), ("on", 1), ("floor", 1), ("off", 1)]
    assert [seq[i][2] for i in range(2, 8)] == [False, True, True, False, True, True]


def test_block_rounds_group_the_timed_steps_of_the_slowest_rank_by_round_and_variant():
    from tools.bench.nemo_step import block_rounds

    # warmup 1, blocks of 2 steps, variants off/on: steps 1-2 off (round 0), 3-4 on, 5-6 on (round 1), 7-8 off
    ends = [0.0, 1.0, 2.0, 3.0, 4.5, 5.5, 7.0, 8.0, 9.0]
    fast = [(s, t - 0.1) for s, t in enumerate(ends)]
    slow = list(enumerate(ends))
    rounds = block_rounds([fast, slow], warmup=1, block_steps=2, variants=("off", "on"))
    assert rounds == [{"off": [1.0], "on": [1.5]}, {"on": [1.5], "off": [1.0]}]
    # a round that lacks a variant (the run ended early) is dropped
    assert block_rounds([slow[:7]], warmup=1, block_steps=2, variants=("off", "on")) == [{"off": [1.0], "on": [1.5]}]
