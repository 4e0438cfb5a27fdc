"""The NeMo step-overhead benchmark's arithmetic (pure): step times from per-rank stamps, and the verdict."""

import pytest

from neighbor_ckpt.cli.bench.nemo_step import TARGET, step_times, verdict


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
