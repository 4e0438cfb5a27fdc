"""The data-position check (neighbor_ckpt.recovery.datacheck): fingerprints, the input record that survives the
process, the comparison after a recovery in each data_check mode, the stop marker, and the failure event's record."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
import torch

from neighbor_ckpt.errors import DataPositionError
from neighbor_ckpt.recovery.datacheck import (RECORD_FILE, RING, ROW_WHOLE_BYTES, STOPPED_FILE, DataCheck, InputRecord,
                                              Verdict, compare, fingerprint, parse_input,
                                              token_tensor)
from megatron_patches.data_iter import observe_iterator
from neighbor_ckpt.recovery.journal import read_failure_input, record_failure_event, take_failure_event


def tokens(seed: int, shape: tuple[int, ...] = (2, 33)) -> torch.Tensor:
    return torch.randint(0, 50_000, shape, generator=torch.Generator().manual_seed(seed))


# -- fingerprint and batch shapes -------------------------------------------------------------------------------------


def test_fingerprint_is_deterministic_and_tells_batches_apart():
    assert fingerprint(tokens(1)) == fingerprint(tokens(1).clone())
    assert fingerprint(tokens(1)) != fingerprint(tokens(2))
    t = tokens(3)
    swapped = t.clone()
    swapped[0, 0], swapped[0, 1] = t[0, 1], t[0, 0]
    assert fingerprint(t) != fingerprint(swapped)


def test_fingerprint_of_a_large_micro_batch_is_a_sample_that_still_tells_batches_and_shifts_apart():
    big = tokens(5, (8, 8192))  # 512 KiB of int64 ids: each row sampled, not hashed whole
    assert big.shape[1] * 8 > ROW_WHOLE_BYTES
    assert fingerprint(big) == fingerprint(big.clone())
    assert fingerprint(big) != fingerprint(tokens(6, (8, 8192)))
    assert fingerprint(big) != fingerprint(torch.roll(big, 1)), "a data position off by one token"
    assert fingerprint(big) != fingerprint(big[:, :4096].contiguous()), "the size is part of it"
    last = big.clone()
    last[-1, -1] += 1
    assert fingerprint(big) != fingerprint(last), "the sample reaches the last byte"


def test_fingerprint_of_a_non_contiguous_view_equals_its_contiguous_copy():
    t = tokens(4, (4, 34))[:, :-1]
    assert not t.is_contiguous()
    assert fingerprint(t) == fingerprint(t.contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int32])
def test_fingerprint_takes_any_dtype(dtype):
    assert isinstance(fingerprint(torch.ones(3, 5).to(dtype)), int)


def test_token_tensor_finds_the_ids_in_common_batch_shapes():
    t, y = tokens(5), tokens(6)
    assert token_tensor(t) is t
    assert token_tensor({"labels": y, "tokens": t}) is t
    assert token_tensor({"input_ids": t, "attention_mask": y}) is t
    assert token_tensor({"x": t}) is t
    assert token_tensor((t, y)) is t
    assert token_tensor([{"tokens": t}, 3]) is t
    assert token_tensor(({"tokens": t}, 0, 0)) is t  # NeMo-style (batch, batch_idx, dataloader_idx)
    assert token_tensor(None) is None and token_tensor({"a": 1}) is None


# -- the input record -------------------------------------------------------------------------------------------------


def test_input_record_keeps_the_last_ring_steps_and_survives_reopening(tmp_path):
    rec = InputRecord(tmp_path / RECORD_FILE)
    for step in range(RING + 5):
        rec.put(step, step * 1000 + 7)
    rec.close()
    again = InputRecord(tmp_path / RECORD_FILE)
    assert again.get(RING + 4) == (RING + 4) * 1000 + 7
    assert again.get(5) == 5007
    assert again.get(4) is None, "overwritten by step RING + 4"
    assert again.get(-1) is None and again.get(10_000) is None
    assert oct((tmp_path / RECORD_FILE).stat().st_mode & 0o777) == "0o600"
    again.clear()
    assert again.get(5) is None
    again.close()


def test_a_torn_entry_of_the_input_record_is_ignored(tmp_path):
    rec = InputRecord(tmp_path / RECORD_FILE)
    rec.put(3, 0xDEADBEEF)
    rec.close()
    raw = bytearray((tmp_path / RECORD_FILE).read_bytes())
    raw[3 * 40 + 9] ^= 0x01  # one bit of the fingerprint (40-byte entries): a half-written entry
    (tmp_path / RECORD_FILE).write_bytes(bytes(raw))
    assert InputRecord(tmp_path / RECORD_FILE).get(3) is None


def _record_then_die(path: str) -> None:
    rec = InputRecord(Path(path))
    rec.put(41, 0x1234)
    os.kill(os.getpid(), signal.SIGKILL)


def test_the_input_record_outlives_a_sigkilled_writer(tmp_path):
    p = mp.get_context("spawn").Process(target=_record_then_die, args=(str(tmp_path / RECORD_FILE),))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    assert InputRecord(tmp_path / RECORD_FILE).get(41) == 0x1234


# -- the comparison ----------------------------------------------------------------------------------------------------


def test_compare_verdicts():
    assert compare(None, 5) is Verdict.UNKNOWN
    assert compare(5, 5) is Verdict.MATCH
    assert compare(5, 6) is Verdict.MISMATCH


def run_before_failure(store: Path, steps: int, *, mode: str = "error", seed_of=lambda s: s) -> DataCheck:
    """Steps 0..steps-1 snapshotted, then step ``steps`` drew its input and the process "died"."""
    dc = DataCheck(mode, store_dir=store, rank=3, attempt=0)
    dc.arm(0, restored=False)
    for step in range(steps):
        dc.observe({"tokens": tokens(seed_of(step))})  # one micro-batch per step (several: the tests further down)
        dc.step_done(step)
    dc.observe({"tokens": tokens(seed_of(steps))})  # the in-flight step
    dc.close()
    return dc


def test_the_same_input_after_a_restore_is_verified(tmp_path, caplog):
    run_before_failure(tmp_path, 6)
    dc = DataCheck("error", store_dir=tmp_path, rank=3, attempt=1)
    dc.arm(5, restored=True, restored_iteration=4)
    with caplog.at_level(logging.INFO, logger="neighbor_ckpt.recovery.datacheck"):
        dc.observe(tokens(5))
    assert dc.verdict is Verdict.MATCH
    assert "step 5 replays the input it had before the failure" in caplog.text


def test_other_input_after_a_restore_raises_a_data_position_error_naming_step_rank_and_remedy(tmp_path):
    run_before_failure(tmp_path, 6)
    dc = DataCheck("error", store_dir=tmp_path, rank=3, attempt=1)
    dc.arm(5, restored=True, restored_iteration=4)
    with pytest.raises(DataPositionError) as e:
        dc.observe({"tokens": tokens(77)})
    msg = str(e.value)
    assert "rank 3: the data position was not restored: step 5" in msg
    assert "restore of iteration 4" in msg
    assert "StatefulDataLoader" in msg and "data_check: warn" in msg and "global RNG" in msg
    assert (e.value.step, e.value.rank, e.value.expected) == (5, 3, fingerprint(tokens(5)))
    assert InputRecord(tmp_path / RECORD_FILE).get(5) == fingerprint(tokens(5)), "the mismatch is never recorded"


def test_warn_logs_the_mismatch_and_goes_on(tmp_path, caplog):
    run_before_failure(tmp_path, 6)
    dc = DataCheck("warn", store_dir=tmp_path, rank=3, attempt=1)
    dc.arm(5, restored=True, restored_iteration=4)
    with caplog.at_level(logging.WARNING, logger="neighbor_ckpt.recovery.datacheck"):
        dc.observe(tokens(77))
    assert dc.verdict is Verdict.MISMATCH
    assert "data_check: warn, training goes on" in caplog.text and "step 5" in caplog.text
    assert not (tmp_path / STOPPED_FILE).exists()


def test_off_computes_and_writes_nothing(tmp_path):
    dc = DataCheck("off", store_dir=tmp_path, rank=0)
    dc.arm(5, restored=True, restored_iteration=4)
    dc.observe(tokens(1))
    assert dc.inflight is None and dc.verdict is None and not dc.enabled
    assert not (tmp_path / RECORD_FILE).exists()


def test_only_the_first_replayed_step_is_checked(tmp_path):
    run_before_failure(tmp_path, 8)
    dc = DataCheck("error", store_dir=tmp_path, rank=3, attempt=1)
    dc.arm(5, restored=True, restored_iteration=4)
    dc.observe(tokens(5))
    dc.step_done(5)
    dc.observe(tokens(123))  # step 6 differs: not checked (the expectation was for the first replayed step only)
    assert dc.verdict is Verdict.MATCH


def test_a_rank_without_a_record_checks_nothing(tmp_path, caplog):
    dc = DataCheck("error", store_dir=tmp_path, rank=1, attempt=1)  # a replaced node: empty store
    with caplog.at_level(logging.INFO, logger="neighbor_ckpt.recovery.datacheck"):
        dc.arm(5, restored=True, restored_iteration=4)
    dc.observe(tokens(77))
    assert dc.verdict is None and "no input recorded for step 5" in caplog.text


def test_the_failure_event_is_the_second_source(tmp_path):
    dc = DataCheck("error", store_dir=tmp_path, rank=2, attempt=1)
    dc.arm(5, restored=True, restored_iteration=4, failure_input=(5, fingerprint(tokens(5))))
    with pytest.raises(DataPositionError, match="from this rank's failure event"):
        dc.observe(tokens(6))


def test_a_record_of_another_timeline_is_not_used(tmp_path, caplog):
    run_before_failure(tmp_path, 6, seed_of=lambda s: s + 100)
    dc = DataCheck("error", store_dir=tmp_path, rank=3, attempt=1)
    snap = {"step": 4, "fp": f"{fingerprint(tokens(4)):016x}"}  # the restored snapshot saw other input at step 4
    with caplog.at_level(logging.WARNING, logger="neighbor_ckpt.recovery.datacheck"):
        dc.arm(5, restored=True, restored_iteration=4, snapshot_input=snap)
    dc.observe(tokens(77))
    assert dc.verdict is None and "from another timeline" in caplog.text


def test_a_fresh_start_empties_the_record(tmp_path):
    run_before_failure(tmp_path, 3)
    dc = DataCheck("error", store_dir=tmp_path, rank=0, attempt=1)
    dc.arm(0, restored=False)
    assert dc.record is not None and dc.record.get(1) is None
    dc.observe(tokens(55))
    assert dc.verdict is None


def test_snapshot_and_failure_extras_name_the_observed_step(tmp_path):
    dc = DataCheck("error", store_dir=tmp_path, rank=0)
    dc.arm(0, restored=False)
    assert dc.failure_extras() is None and dc.snapshot_extras(0) is None
    dc.observe(tokens(1))
    assert parse_input(dc.snapshot_extras(0)) == (0, fingerprint(tokens(1)))
    dc.step_done(0)
    assert dc.snapshot_extras(1) is None
    dc.observe(tokens(2))
    assert parse_input(dc.failure_extras()) == (1, fingerprint(tokens(2)))
    assert parse_input(None) is None and parse_input({"step": 1, "fp": "zz"}) is None


# -- the stop marker: further restarts of the same launch stop at once -------------------------------------------------


def test_after_a_mismatch_a_restart_of_the_same_launch_stops_at_once_and_a_new_launch_does_not(tmp_path):
    run_before_failure(tmp_path, 6)
    dc = DataCheck("error", store_dir=tmp_path, rank=3, attempt=1)
    dc.arm(5, restored=True, restored_iteration=4)
    with pytest.raises(DataPositionError):
        dc.observe(tokens(77))
    marker = json.loads((tmp_path / STOPPED_FILE).read_text())
    assert marker["attempt"] == 1 and marker["step"] == 5
    with pytest.raises(DataPositionError, match="attempt 1 of this launch stopped on a data-position mismatch"):
        DataCheck("error", store_dir=tmp_path, rank=3, attempt=2).refuse_if_stopped()
    DataCheck("warn", store_dir=tmp_path, rank=3, attempt=2).refuse_if_stopped()  # warn: goes on, marker removed
    assert not (tmp_path / STOPPED_FILE).exists()
    (tmp_path / STOPPED_FILE).write_text(json.dumps(marker))
    DataCheck("error", store_dir=tmp_path, rank=3, attempt=0).refuse_if_stopped()  # a new launch
    assert not (tmp_path / STOPPED_FILE).exists()


# -- the survivors' failure record ---------------------------------------------------------------------------------


def test_the_failure_event_keeps_the_in_flight_input_and_is_still_consumed_once(tmp_path):
    path = tmp_path / "events.json"
    record_failure_event(path, rank=1, attempt=0, reason="SIGTERM", when=100.0,
                         inflight_input={"step": 5, "fp": "00000000000000ff"})
    assert parse_input(read_failure_input(path)) == (5, 0xFF)
    assert path.exists(), "reading the input does not consume the event"
    assert take_failure_event(path, not_after=200.0) == 100.0
    assert read_failure_input(path) is None
    record_failure_event(path, rank=1, attempt=0, reason="x", when=1.0)
    assert read_failure_input(path) is None


# -- the iterator wrapper -----------------------------------------------------------------------------------------------


def test_observed_iterator_hands_every_item_on_and_observes_it():
    seen = []

    class Source:
        flag = "inner attribute"

        def __iter__(self):
            return iter([1, 2, 3])

    it = observe_iterator(Source(), seen.append)
    assert list(it) == [1, 2, 3] and seen == [1, 2, 3]
    assert it.flag == "inner attribute"


# -- the micro-benchmark's rows (no timing asserted) ------------------------------------------------------------------


def test_bench_rows_are_observe_input_over_snapshot_against_one_percent():
    from tools.bench.micro.fingerprint import fingerprint_rows
    from tools.bench.micro.fingerprint import TOKEN_SHAPES

    samples = {"snapshot": [1e-3, 2e-3, 3e-3], **{f"observe {a}x{b}": [5e-6, 8e-6, 30e-6] for a, b in TOKEN_SHAPES}}
    samples[f"observe {TOKEN_SHAPES[1][0]}x{TOKEN_SHAPES[1][1]}"] = [40e-6, 50e-6, 60e-6]
    small, big = fingerprint_rows(samples)
    assert (small.unit, small.op, small.target) == ("us", "<=", 0.01)
    assert small.value == pytest.approx(8.0) and small.baseline == pytest.approx(2000.0)
    assert small.ratio == pytest.approx(0.004) and small.status == "PASS"
    assert big.ratio == pytest.approx(0.025) and big.status == "MISS"
    samples.update({f"snapshot {a}x{b}": [1e-3, 1e-3, 1e-3] for a, b in TOKEN_SHAPES})
    small, _ = fingerprint_rows(samples)
    assert small.detail["paired_ratio_median"] == pytest.approx(0.008)


def test_bench_rows_judge_the_training_threads_cpu_time_and_keep_the_wall_clock_beside_it():
    from tools.bench.micro.fingerprint import fingerprint_rows
    from tools.bench.micro.fingerprint import TOKEN_SHAPES

    samples = {"snapshot": [4e-3] * 3, "snapshot cpu": [1e-3] * 3}
    for a, b in TOKEN_SHAPES:  # the wall clock waited for the GIL; the thread's CPU time did not
        samples.update({f"observe {a}x{b}": [80e-6] * 3, f"observe cpu {a}x{b}": [5e-6] * 3,
                        f"snapshot cpu {a}x{b}": [1e-3] * 3})
    small, _ = fingerprint_rows(samples)
    assert small.ratio == pytest.approx(0.005) and small.status == "PASS"
    assert small.detail["clock"] == "thread CPU time" and small.detail["wall_ratio"] == pytest.approx(0.02)


# -- every sample of every micro-batch (issue 31) ---------------------------------------------------------------------

from neighbor_ckpt.recovery.datacheck import (InputMark, combine_samples, parse_mark, read_mark,  # noqa: E402
                                              sample_hashes, step_fingerprint)


def test_a_change_in_one_row_of_a_large_micro_batch_changes_that_rows_hash_only():
    big = tokens(5, (8, 8192))  # 8 x 8192 int64 ids: rows 1, 3, 4 and 6 were never read by the old 16 KiB windows
    base = sample_hashes(big)
    assert len(base) == 8 and len(set(base)) == 8
    for row in range(8):
        other = big.clone()
        other[row] = tokens(100 + row, (8192,))  # another sample in that row only
        changed = sample_hashes(other)
        assert [i for i in range(8) if changed[i] != base[i]] == [row], row
        assert fingerprint(other) != fingerprint(big), row
    shifted = big.clone()
    shifted[4, 4000:] = big[4, 3999:-1]  # a shift inside the middle of one row: seen by the strided sample
    assert fingerprint(shifted) != fingerprint(big)


def test_sample_hashes_of_views_and_device_like_copies_equal_those_of_contiguous_rows():
    big = tokens(9, (4, 4096))
    assert sample_hashes(big.t().contiguous().t()) == sample_hashes(big), "strided view: same rows, same hashes"
    assert sample_hashes(big[1:3]) == sample_hashes(big)[1:3], "a row's hash does not depend on its neighbours"
    small = tokens(3, (4, 33))
    assert sample_hashes(small[2:]) == sample_hashes(small)[2:]
    assert sample_hashes(torch.tensor([], dtype=torch.int64)) == []


def record_steps(store: Path, steps: list[list[torch.Tensor]], *, inflight: list[torch.Tensor]) -> None:
    """Steps with several micro-batches each, snapshotted; then ``inflight``'s micro-batches drawn, and the
    process "died"."""
    store.mkdir(parents=True, exist_ok=True)
    dc = DataCheck("error", store_dir=store, rank=0, attempt=0)
    dc.arm(0, restored=False)
    for step, mbs in enumerate(steps):
        for mb in mbs:
            dc.observe({"tokens": mb})
        dc.step_done(step)
    for mb in inflight:
        dc.observe({"tokens": mb})
    dc.close()


def test_a_change_confined_to_the_last_of_four_micro_batches_is_caught_at_that_micro_batch(tmp_path):
    mbs = [tokens(10 + i) for i in range(4)]
    record_steps(tmp_path, [[tokens(i) for i in range(4)]], inflight=mbs)
    dc = DataCheck("error", store_dir=tmp_path, rank=0, attempt=1)
    dc.arm(1, restored=True, restored_iteration=0)
    for mb in mbs[:3]:
        dc.observe(mb)  # the first three are the same: judged only once all four were seen
    assert dc.verdict is None
    with pytest.raises(DataPositionError, match="step 1") as e:
        dc.observe(tokens(99))
    assert "of its first 4 micro-batch(es)" in str(e.value)

    same = DataCheck("error", store_dir=tmp_path, rank=0, attempt=1)
    same.arm(1, restored=True, restored_iteration=0)
    for mb in mbs:
        same.observe(mb)
    assert same.verdict is Verdict.MATCH


def test_the_micro_batch_order_is_part_of_the_step_fingerprint():
    a, b = fingerprint(tokens(1)), fingerprint(tokens(2))
    assert step_fingerprint(step_fingerprint(None, a), b) != step_fingerprint(step_fingerprint(None, b), a)
    assert step_fingerprint(None, a) == a


def test_a_failure_in_the_middle_of_a_step_is_compared_over_the_micro_batches_it_drew(tmp_path):
    mbs = [tokens(20 + i) for i in range(4)]
    record_steps(tmp_path, [[tokens(i) for i in range(4)]], inflight=mbs[:2])  # died after 2 of 4
    assert InputRecord(tmp_path / RECORD_FILE).mark(1).n == 2
    dc = DataCheck("error", store_dir=tmp_path, rank=0, attempt=1)
    dc.arm(1, restored=True, restored_iteration=0)
    dc.observe(mbs[0])
    dc.observe(mbs[1])
    assert dc.verdict is Verdict.MATCH
    dc.observe(tokens(77))  # beyond what was recorded: nothing to compare
    assert dc.verdict is Verdict.MATCH


def test_a_replayed_step_with_fewer_micro_batches_is_a_mismatch_at_its_end(tmp_path):
    mbs = [tokens(30 + i) for i in range(4)]
    record_steps(tmp_path, [[tokens(i) for i in range(4)]], inflight=mbs)
    dc = DataCheck("error", store_dir=tmp_path, rank=0, attempt=1)
    dc.arm(1, restored=True, restored_iteration=0)
    for mb in mbs[:3]:
        dc.observe(mb)
    with pytest.raises(DataPositionError, match="the step ended before the 4 seen before the failure"):
        dc.step_done(1)


def test_a_failure_event_with_its_count_is_compared_over_that_many_micro_batches(tmp_path):
    mbs = [tokens(40 + i) for i in range(3)]
    fp = None
    for mb in mbs:
        fp = step_fingerprint(fp, fingerprint(mb))
    dc = DataCheck("error", store_dir=tmp_path, rank=2, attempt=1)
    dc.arm(5, restored=True, restored_iteration=4, failure_input=InputMark(5, fp, 3, 0))
    for mb in mbs:
        dc.observe(mb)
    assert dc.verdict is Verdict.MATCH
    (tmp_path / "x").mkdir()
    other = DataCheck("error", store_dir=tmp_path / "x", rank=2, attempt=1)
    other.arm(5, restored=True, restored_iteration=4, failure_input=InputMark(5, fp, 3, 0))
    other.observe(mbs[0])
    other.observe(mbs[1])
    with pytest.raises(DataPositionError, match="from this rank's failure event"):
        other.observe(tokens(1))


def test_extras_carry_the_count_and_sample_sum_and_parse_back(tmp_path):
    dc = DataCheck("error", store_dir=tmp_path, rank=0)
    dc.arm(0, restored=False)
    dc.observe(tokens(1))
    dc.observe(tokens(2))
    mark = parse_mark(dc.failure_extras())
    assert mark == InputMark(0, dc.inflight.fp, 2, combine_samples(sample_hashes(tokens(1)) + sample_hashes(tokens(2))))
    assert parse_mark({"step": 3, "fp": "ff"}) == InputMark(3, 0xFF, 0, 0), "a failure event of an older release"
    assert read_mark(tmp_path / RECORD_FILE, 0) == (2, mark)


def test_the_no_input_line_gives_the_real_reason(tmp_path, caplog):
    (tmp_path / "new").mkdir()
    fresh = DataCheck("error", store_dir=tmp_path / "new", rank=1, attempt=1)  # a replaced node: no record before
    never = tmp_path / "never"
    never.mkdir()
    InputRecord(never / RECORD_FILE).close()  # a record that never saw an input (nothing fed the check)
    early = tmp_path / "early"
    record_steps(early, [[tokens(0)]] * 3, inflight=[])  # steps 0..2 recorded; died before step 3 drew its input
    with caplog.at_level(logging.INFO, logger="neighbor_ckpt.recovery.datacheck"):
        fresh.arm(5, restored=True, restored_iteration=4)
        DataCheck("error", store_dir=never, rank=2, attempt=1).arm(5, restored=True, restored_iteration=4)
        DataCheck("error", store_dir=early, rank=3, attempt=1).arm(3, restored=True, restored_iteration=2)
    lines = [r.getMessage() for r in caplog.records]
    assert any("rank 1" in m and "no input recorded for step 5" in m and "did not exist when this attempt started" in m
               for m in lines), lines
    assert any("rank 2" in m and "no input reached the data check on this rank" in m and "replaced" not in m
               for m in lines), lines
    assert any("rank 3" in m and "the failure came before step 3 drew its input" in m and "replaced" not in m
               for m in lines), lines


# -- across an elastic reshard: the order-independent sum of the global batch --------------------------------------


def test_the_sample_sum_of_a_global_batch_does_not_depend_on_how_it_is_dealt():
    batch = [tokens(200 + i, (1, 64)) for i in range(24)]  # 24 samples
    h = [sample_hashes(s)[0] for s in batch]
    total = combine_samples(h)

    def dealt(ranks: int, mbs: int) -> int:  # each rank's micro-batches, each rank's partial sum, added up
        per = len(batch) // ranks
        partial = [combine_samples(sample_hashes(torch.cat(batch[r * per:(r + 1) * per][m::mbs])))
                   for r in range(ranks) for m in range(mbs)]
        return combine_samples(partial)

    assert dealt(4, 3) == dealt(3, 4) == dealt(2, 2) == dealt(1, 1) == total
    assert combine_samples(reversed(h)) == total
    other = list(h)
    other[17] = sample_hashes(tokens(999, (1, 64)))[0]
    assert combine_samples(other) != total, "one sample of the global batch changed"


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        yield None
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()


def old_layout(gen: Path, batch: list[torch.Tensor], ranks: int, *, step: int = 5) -> None:
    """The previous layout: ``ranks`` ranks, each drew its share of ``batch`` for ``step`` (two micro-batches)."""
    per = len(batch) // ranks
    for r in range(ranks):
        share = batch[r * per:(r + 1) * per]
        record_steps(gen / f"rank{r}", [[tokens(s)] for s in range(step)], inflight=[torch.cat(share[::2]),
                                                                                      torch.cat(share[1::2])])


def test_after_a_reshard_the_global_batch_is_compared_by_its_sample_sum(tmp_path, one_rank_group, caplog):
    batch = [tokens(300 + i, (1, 48)) for i in range(12)]
    old_layout(tmp_path / "g0", batch, 4)
    (tmp_path / "g1" / "rank0").mkdir(parents=True)
    dc = DataCheck("error", store_dir=tmp_path / "g1" / "rank0", rank=0, attempt=1)
    dc.arm_reshard(5, group=None, old_generation=tmp_path / "g0", old_world=4, restored_iteration=4)
    for m in range(3):  # this layout: one rank, 3 micro-batches of 4, in another order
        dc.observe(torch.cat(batch[m::3]))
    with caplog.at_level(logging.INFO, logger="neighbor_ckpt.recovery.datacheck"):
        dc.before_snapshot(5)
    assert dc.verdict is Verdict.MATCH and "global batch after the elastic reshard" in caplog.text

    (tmp_path / "g1b" / "rank0").mkdir(parents=True)
    bad = DataCheck("error", store_dir=tmp_path / "g1b" / "rank0", rank=0, attempt=1)
    bad.arm_reshard(5, group=None, old_generation=tmp_path / "g0", old_world=4, restored_iteration=4)
    bad.observe(torch.cat(batch[:11] + [tokens(1, (1, 48))]))  # one sample of twelve is another
    with pytest.raises(DataPositionError, match="resharded to another data-parallel size"):
        bad.before_snapshot(5)


def test_after_a_reshard_a_lost_old_record_says_why_it_is_not_checked(tmp_path, one_rank_group, caplog):
    batch = [tokens(400 + i, (1, 48)) for i in range(12)]
    old_layout(tmp_path / "g0", batch, 4)
    (tmp_path / "g0" / "rank2" / RECORD_FILE).unlink()  # its node is gone
    (tmp_path / "g1" / "rank0").mkdir(parents=True)
    dc = DataCheck("error", store_dir=tmp_path / "g1" / "rank0", rank=0, attempt=1)
    with caplog.at_level(logging.INFO, logger="neighbor_ckpt.recovery.datacheck"):
        dc.arm_reshard(5, group=None, old_generation=tmp_path / "g0", old_world=4, restored_iteration=4)
    dc.observe(tokens(1, (12, 48)))
    dc.before_snapshot(5)
    assert dc.verdict is None
    assert "not checked after the elastic reshard: the input record of old rank(s) 2 did not survive" in caplog.text
