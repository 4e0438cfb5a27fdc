"""Reporting: status line, metrics, interval selection, recovery timeline (computation, PNG + JSON), failure
events that survive a restart, recovery progress. One process; the end-to-end wiring test runs a
single-rank gloo job in a subprocess (twice: a failed run, then its recovery)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from neighbor_ckpt.config import ReportConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.runtime.procs import python_module_command
from neighbor_ckpt.report.status import (PLAIN_LOOP_LOG_EVERY, Reporter, SnapshotStats, format_status, log_to_loggers,
                                  recovery_metrics, recovery_progress, replica_lag, resolve_progress_mode,
                                  resolve_status_interval, status_metrics, stream_gbps_between)
from neighbor_ckpt.recovery.journal import record_failure_event, take_failure_event
from neighbor_ckpt.recovery.attempt import AttemptInfo
from neighbor_ckpt.report.timeline import (EVENTS, EVENTS_INPROCESS, PHASES, PHASES_INPROCESS, RankEvents,
                                           compute_timeline, newest_commit_unix, wait_for_renders, write_timeline)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RENDER_LIMIT_S = 300.0
"""How long a test waits for a picture being drawn in the background (generous: a loaded machine is slow)."""
T0 = 1_700_000_000.0


# -- helpers -------------------------------------------------------------------------------------------------


def rank_events(offset: float = 0.0, *, snap: float | None = 0.0, fail: float | None = 0.5) -> RankEvents:
    """Events of one rank, in seconds after T0 (plus ``offset`` for everything but snap/fail)."""
    return RankEvents(last_snapshot=None if snap is None else T0 + snap,
                      failure_noticed=None if fail is None else T0 + fail,
                      process_start=T0 + 2.0 + offset, process_group_ready=T0 + 4.0 + offset,
                      recovery_start=T0 + 5.0 + offset, reconcile_end=T0 + 5.2 + offset,
                      transfer_end=T0 + 5.5 + offset, restore_end=T0 + 5.6 + offset)


def stats(**kw: Any) -> SnapshotStats:
    base = dict(iteration=119, snapshot_s=0.0031, wait_s=0.0002, unique_bytes=12_000_000, extras_bytes=400_000,
                replicated_iteration=119, replica_lag=0, streaming=True, stream_bytes=0, stream_seconds=0.0,
                host_store_bytes=52_000_000)
    base.update(kw)
    return SnapshotStats(**base)


class FakeLogger:
    """A Lightning logger's surface: log_metrics(metrics, step=...) and save()."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []
        self.saves = 0

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((dict(metrics), step))

    def save(self) -> None:
        self.saves += 1


def reporter(tmp_path: Path, *, rank_zero: bool = True, every: int = 10, loggers=(), **cfg: Any) -> Reporter:
    return Reporter(ReportConfig(**cfg), rank_zero=rank_zero, every_n_steps=every, report_dir=tmp_path / "reports",
                    attempt=1, loggers=loggers)


# -- timeline computation ------------------------------------------------------------------------------------


def test_timeline_phases_follow_the_events_and_sum_to_the_mttr() -> None:
    per_rank = [rank_events(0.0), rank_events(0.1, snap=-0.2, fail=0.7), rank_events(0.05, snap=None, fail=None)]
    tl = compute_timeline(per_rank, first_step_end=T0 + 7.0, attempt=1, outcome="restored", iteration=7,
                          recovery_phases={"inventory": 0.01})
    assert tuple(tl.phases) == PHASES
    # job-wide events: newest snapshot, earliest notice, latest everything else
    assert tl.events["last_snapshot"] == T0 and tl.events["failure_noticed"] == T0 + 0.5
    assert tl.events["process_start"] == pytest.approx(T0 + 2.1)
    assert tl.process_group_ready == pytest.approx(T0 + 4.1)
    expected = {"detect": 0.5, "restart": 1.6, "rendezvous": 3.0, "reconcile": 0.2, "transfer": 0.3,
                "restore": 0.1, "first_step": 1.3}
    for name, v in expected.items():
        assert tl.phases[name] == pytest.approx(v, abs=1e-6), name
    assert tl.total_s == pytest.approx(7.0)
    assert sum(tl.phases.values()) == pytest.approx(tl.events["first_step_end"] - tl.events["last_snapshot"])
    assert tl.notes == ()
    assert tl.origin == T0
    line = tl.summary()
    assert line.startswith("MTTR 7.00 s = detect 0.50 s + restart 1.60 s + rendezvous 3.00 s")
    assert "first step 1.30 s" in line and "restored: iteration 7" in line


def test_timeline_without_a_survivor_event_folds_detect_into_restart() -> None:
    per_rank = [rank_events(0.0, fail=None), rank_events(0.0, fail=None)]
    tl = compute_timeline(per_rank, first_step_end=T0 + 7.0, attempt=2, outcome="restored", iteration=3)
    assert tl.phases["detect"] is None
    assert tl.phases["restart"] == pytest.approx(2.0)
    assert tl.total_s == pytest.approx(7.0)
    assert any("no surviving rank recorded the failure" in n and "folded into restart" in n for n in tl.notes)
    assert "detect ?" in tl.summary()


def test_timeline_without_snapshot_time_or_first_step_starts_and_ends_at_known_events() -> None:
    tl = compute_timeline([rank_events(snap=None)], first_step_end=None, attempt=1, outcome="insurance",
                          iteration=4)
    assert tl.phases["detect"] is None and tl.phases["first_step"] is None
    assert tl.phases["restart"] == pytest.approx(1.5)
    assert tl.origin == T0 + 0.5
    assert tl.total_s == pytest.approx(5.6 - 0.5)
    assert len(tl.notes) == 2


def test_timeline_clamps_events_out_of_order() -> None:
    # a node whose clock is behind: the failure notice predates the last snapshot on another node
    tl = compute_timeline([rank_events(snap=1.0, fail=0.5)], first_step_end=T0 + 7.0, attempt=1,
                          outcome="restored", iteration=1)
    assert tl.phases["detect"] == 0.0
    assert all(v is not None and v >= 0 for v in tl.phases.values())
    assert tl.total_s == pytest.approx(6.0)
    assert any("clock skew" in n for n in tl.notes)


def test_rank_events_round_trip_through_the_gather_tensor() -> None:
    ev = rank_events(snap=None)
    t = ev.to_tensor()
    assert t.dtype == torch.float64 and t.numel() == len(dataclasses.fields(RankEvents)) == 12
    assert RankEvents.from_tensor(t) == ev
    inproc = dataclasses.replace(ev, abort_end=T0 + 1.0, activated_spare=1.0, prepared_slot_wait=0.125, fault=T0 + 0.5)
    assert RankEvents.from_tensor(inproc.to_tensor()) == inproc


def test_timeline_reports_the_longest_wait_for_a_prepared_receive_slot() -> None:
    """The part of a replaced rank's slot preparation that still lay on the recovery's path: the longest wait of any
    rank whose pull landed in a slot it prepared in advance; None when none did."""
    ranks = [rank_events(), dataclasses.replace(rank_events(), prepared_slot_wait=0.04),
             dataclasses.replace(rank_events(), prepared_slot_wait=0.0), rank_events()]
    tl = compute_timeline(ranks, first_step_end=T0 + 6.0, attempt=1, outcome="restored", iteration=4)
    assert tl.prepared_slot_wait_s == 0.04 and tl.to_json()["prepared_slot_wait_s"] == 0.04
    plain = compute_timeline([rank_events()] * 4, first_step_end=T0 + 6.0, attempt=1, outcome="restored", iteration=4)
    assert plain.prepared_slot_wait_s is None and plain.to_json()["prepared_slot_wait_s"] is None


# -- in-process recoveries -------------------------------------------------------------------------------------


def inproc_events(*, survivor: bool = True, spare: bool = False, start: float = -100.0) -> RankEvents:
    """A rank of an in-process recovery: its process started ``start`` s after T0 (long before the failure), a
    survivor aborted at T0 + 0.7 (noticed at T0 + 0.5), a spare has no abort."""
    return RankEvents(last_snapshot=T0, failure_noticed=T0 + 0.5 if survivor else None, process_start=T0 + start,
                      process_group_ready=T0 + 1.0, recovery_start=T0 + 1.2, reconcile_end=T0 + 1.25,
                      transfer_end=T0 + 1.3, restore_end=T0 + 1.4, abort_end=T0 + 0.7 if survivor else None,
                      activated_spare=1.0 if spare else 0.0)


def test_inprocess_timeline_has_abort_and_reform_no_restarted_rank_and_the_spare() -> None:
    per_rank = [inproc_events(), inproc_events(survivor=False, spare=True), inproc_events(), inproc_events()]
    tl = compute_timeline(per_rank, first_step_end=T0 + 1.6, attempt=AttemptInfo(launch=0, inprocess=1),
                          outcome="restored", iteration=4)
    assert tl.mode == "in-process" and tl.restarted_ranks == () and tl.spare_ranks == (1,) and tl.spare_used
    assert tl.phase_names == PHASES_INPROCESS
    assert tl.phases == pytest.approx({"detect": 0.5, "abort": 0.2, "reform": 0.5, "reconcile": 0.05,
                                       "transfer": 0.05, "restore": 0.1, "first_step": 0.2}, abs=1e-5)
    assert tl.total_s == pytest.approx(1.6) and tl.notes == ()
    data = tl.to_json()
    assert data["mode"] == "in-process" and data["restarted_ranks"] == [] and data["spare_used"] is True
    assert data["spare_ranks"] == [1] and data["attempt"] == "0.1"
    assert list(data["phases_s"]) == list(PHASES_INPROCESS) and list(data["events_unix"]) == list(EVENTS_INPROCESS)
    assert set(data["definitions"]) == set(PHASES_INPROCESS)
    assert "in-process, hot spare for rank(s) [1]" in tl.summary() and "abort 0.20 s" in tl.summary()


def test_inprocess_timeline_without_spare_when_every_process_stays() -> None:
    """An exception on one rank: every process stays, none is a spare."""
    tl = compute_timeline([inproc_events() for _ in range(3)], first_step_end=T0 + 1.6,
                          attempt=AttemptInfo(launch=2, inprocess=3), outcome="restored", iteration=4)
    assert (tl.mode, tl.restarted_ranks, tl.spare_used, tl.attempt) == ("in-process", (), False, "2.3")


def test_restart_timeline_lists_every_new_process_as_restarted() -> None:
    """The launcher restarted every worker (in-process recovery gave up, or it is off): mode restart."""
    tl = compute_timeline([rank_events(0.0), rank_events(0.1)], first_step_end=T0 + 7.0,
                          attempt=AttemptInfo(launch=1), outcome="restored", iteration=3)
    assert (tl.mode, tl.restarted_ranks, tl.spare_used, tl.attempt) == ("restart", (0, 1), False, 1)
    assert tl.phase_names == PHASES and tl.to_json()["restarted_ranks"] == [0, 1]


def test_timeline_mode_from_the_data_without_attempt_info() -> None:
    """An int attempt: in process when some rank's process predates the failure; unknown reference -> None."""
    mixed = [inproc_events(), dataclasses.replace(inproc_events(), process_start=T0 + 0.9)]
    tl = compute_timeline(mixed, first_step_end=T0 + 1.6, attempt=0, outcome="restored", iteration=4)
    assert tl.mode == "in-process" and tl.restarted_ranks == (1,)
    unknown = compute_timeline([rank_events(snap=None, fail=None)], first_step_end=T0 + 7.0, attempt=1,
                               outcome="restored", iteration=2)
    assert unknown.mode == "restart" and unknown.restarted_ranks is None
    with pytest.raises(ValueError, match="timeline mode"):
        compute_timeline(mixed, first_step_end=None, attempt=0, outcome="restored", iteration=4, mode="both")


def test_inprocess_timeline_png_draws_the_inprocess_phases(tmp_path: Path) -> None:
    tl = compute_timeline([inproc_events(), inproc_events(survivor=False, spare=True)], first_step_end=T0 + 1.6,
                          attempt=AttemptInfo(inprocess=1), outcome="restored", iteration=4)
    from neighbor_ckpt.report import timeline_png

    data = tl.to_json()
    segments = timeline_png._segments(data["phases_s"], data["events_unix"], tl.origin)
    assert [seg[1] for seg in segments] == ["detect", "abort", "re-form groups", "reconcile", "transfer", "restore",
                                            "first step"]
    out = write_timeline(tl, tmp_path, background=False)
    assert out.path_png == tmp_path / "recovery_timeline.attempt0.1.png"
    assert out.path_png.read_bytes()[:8] == PNG_MAGIC
    assert json.loads(out.path_json.read_text())["mode"] == "in-process"


def test_write_timeline_draws_the_png_in_a_process_of_its_own(tmp_path: Path) -> None:
    """The JSON is there when write_timeline returns; the PNG is drawn from it by another process (no GIL shared
    with training; wait_for_renders waits for it), which does not import torch."""
    from neighbor_ckpt.report import timeline as timeline_mod

    tl = compute_timeline([rank_events()], first_step_end=T0 + 7.0, attempt=4, outcome="restored", iteration=2)
    out = write_timeline(tl, tmp_path)
    assert out.path_json is not None and json.loads(out.path_json.read_text())["png"] == str(out.path_png)
    ((proc, png),) = timeline_mod._renders
    assert proc.args[:-2] == python_module_command("neighbor_ckpt.report.timeline_png", "--parent", str(os.getpid()))
    assert png == out.path_png
    assert wait_for_renders(timeout=RENDER_LIMIT_S), f"the picture was not drawn within {RENDER_LIMIT_S} s"
    assert proc.returncode == 0 and not timeline_mod._renders
    assert out.path_png is not None and out.path_png.read_bytes()[:8] == PNG_MAGIC
    assert not list(tmp_path.glob("*.tmp")), "the picture is renamed into place"


def test_the_picture_process_dies_with_its_parent(tmp_path: Path) -> None:
    import subprocess
    import sys

    # the parent named is not this process's parent (already gone): it leaves at once, drawing nothing
    done = subprocess.run([sys.executable, "-m", "neighbor_ckpt.report.timeline_png", "--parent", "1",
                           str(tmp_path / "none.json"), str(tmp_path / "t.png")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and not (tmp_path / "t.png").exists(), done


def test_the_picture_process_imports_no_torch_and_reports_a_bad_json_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "t.json"
    bad.write_text("{}")
    code = ("import sys, runpy; sys.argv = ['x', %r, %r]\n"
            "try:\n    runpy.run_module('neighbor_ckpt.report.timeline_png', run_name='__main__')\n"
            "except SystemExit as e:\n    print('torch' in sys.modules, e.code)") % (str(bad), str(tmp_path / "t.png"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "1"], done
    assert done.stderr.strip().startswith("neighbor_ckpt: could not draw the recovery timeline"), done.stderr
    assert not (tmp_path / "t.png").exists()


# -- timeline files ------------------------------------------------------------------------------------------


def test_write_timeline_writes_png_and_json(tmp_path: Path) -> None:
    tl = compute_timeline([rank_events(0.0), rank_events(0.2)], first_step_end=T0 + 7.5, attempt=3,
                          outcome="restored", iteration=12, recovery_phases={"inventory": 0.01, "transfer": 0.2})
    out = write_timeline(tl, tmp_path / "a" / "b", background=False)
    assert out.path_png == tmp_path / "a" / "b" / "recovery_timeline.attempt3.png"
    assert out.path_json == tmp_path / "a" / "b" / "recovery_timeline.attempt3.json"
    assert out.path_png.read_bytes()[:8] == PNG_MAGIC
    data = json.loads(out.path_json.read_text())
    assert list(data["phases_s"]) == list(PHASES) and list(data["events_unix"]) == list(EVENTS)
    assert data["mttr_s"] == pytest.approx(7.5)
    assert data["iteration"] == 12 and data["attempt"] == 3 and data["png"] == str(out.path_png)
    assert len(data["per_rank_events_unix"]) == 2 and data["recovery_phases_rank0_s"]["transfer"] == 0.2
    assert set(data["definitions"]) == set(PHASES)


def test_write_timeline_with_missing_phases_still_draws(tmp_path: Path) -> None:
    tl = compute_timeline([rank_events(snap=None, fail=None)], first_step_end=None, attempt=0,
                          outcome="restored", iteration=1)
    out = write_timeline(tl, tmp_path, background=False)
    assert out.path_png is not None and out.path_png.read_bytes()[:8] == PNG_MAGIC
    assert json.loads(out.path_json.read_text())["phases_s"]["detect"] is None


def test_write_timeline_without_matplotlib_writes_only_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    tl = compute_timeline([rank_events()], first_step_end=T0 + 7.0, attempt=1, outcome="restored", iteration=2)
    with caplog.at_level(logging.INFO, logger="neighbor_ckpt.report.timeline"):
        out = write_timeline(tl, tmp_path)
    assert out.path_png is None and out.path_json is not None and out.path_json.exists()
    assert not list(tmp_path.glob("*.png"))
    warned = [r for r in caplog.records if "needs matplotlib" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING and "pip install matplotlib" in warned[0].getMessage()


# -- failure events and commit times that survive a restart ----------------------------------------------------


def test_failure_event_is_private_read_once_and_never_from_the_future(tmp_path: Path) -> None:
    p = tmp_path / "events.json"
    record_failure_event(p, rank=2, attempt=0, reason="SIGTERM from the launcher", when=T0 + 1)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert json.loads(p.read_text())["rank"] == 2
    assert take_failure_event(p, not_after=T0 + 5) == T0 + 1
    assert not p.exists()
    assert take_failure_event(p, not_after=T0 + 5) is None
    record_failure_event(p, rank=2, attempt=0, reason="", when=T0 + 10)
    assert take_failure_event(p, not_after=T0 + 5) is None and not p.exists()
    p.write_text("{not json")
    assert take_failure_event(p, not_after=T0 + 5) is None


def test_failure_event_never_raises(tmp_path: Path) -> None:
    record_failure_event(tmp_path / "missing-dir" / "events.json", rank=0, attempt=0, reason="x", when=T0)


def test_snapshot_engine_stamps_the_commit_time_into_the_header(tmp_path: Path) -> None:
    from neighbor_ckpt.snapshot.engine import SnapshotEngine
    from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
    from neighbor_ckpt.snapshot.store import HostStore

    store = HostStore(tmp_path / "store", job_id="j", rank=0)
    assert newest_commit_unix(store) is None
    src = [torch.arange(10, dtype=torch.float32)]
    plan = plan_shards([TensorMeta.of("t", StateKind.OPTIMIZER, src[0])], dp_size=1, distributed_optimizer=False)
    eng = SnapshotEngine(store=store, plan=plan, sources=src, layout="L", meta={}, transport=None)
    before = time.time()
    try:
        for it in (1, 2):
            eng.snapshot(it, {"i": it})
            eng.wait()
    finally:
        eng.close()
    newest = newest_commit_unix(store)
    assert newest is not None and before <= newest <= time.time()
    # a slot of another job does not count
    other = HostStore(tmp_path / "store", job_id="other", rank=0)
    assert newest_commit_unix(other) is None


# -- status line, metrics, intervals ----------------------------------------------------------------------------


def test_status_line_format() -> None:
    line = format_status(120, stats(), 1.3)
    assert line == ("neighbor_ckpt: step 120 | snapshot 3.1 ms wait 0.2 ms | 12.4 MB unique/rank | replica lag 0 it "
                    "| stream 1.3 GB/s | host store 52.0 MB")


def test_status_line_without_streaming_and_with_a_stale_stream() -> None:
    off = format_status(5, stats(replica_lag=None, replicated_iteration=None, streaming=False, unique_bytes=0,
                                 extras_bytes=3_200, host_store_bytes=900), None)
    assert "3.2 KB unique/rank | replica off | stream off | host store 900 B" in off
    stale = format_status(5, stats(replica_lag=4, streaming=False, failures=1), 0.05)
    assert "replica lag 4 it (streaming stopped) | stream 50 MB/s" in stale and stale.endswith("1 snapshot(s) failed")


def test_status_metrics() -> None:
    m = status_metrics(stats(), 1.25)
    assert m == {"neighbor_ckpt/snapshot_ms": pytest.approx(3.1), "neighbor_ckpt/wait_ms": pytest.approx(0.2),
                 "neighbor_ckpt/unique_bytes": 12_400_000.0, "neighbor_ckpt/replica_lag": 0.0,
                 "neighbor_ckpt/stream_gbps": 1.25}
    m = status_metrics(stats(replica_lag=None), None)
    assert set(m) == {"neighbor_ckpt/snapshot_ms", "neighbor_ckpt/wait_ms", "neighbor_ckpt/unique_bytes"}


def test_recovery_metrics() -> None:
    tl = compute_timeline([rank_events(fail=None)], first_step_end=T0 + 7.0, attempt=1, outcome="restored",
                          iteration=1)
    m = recovery_metrics(tl)
    assert "neighbor_ckpt/recovery/detect_s" not in m
    assert m["neighbor_ckpt/recovery/restart_s"] == pytest.approx(2.0)
    assert m["neighbor_ckpt/recovery/first_step_s"] == pytest.approx(1.4)
    assert m["neighbor_ckpt/recovery/total_s"] == pytest.approx(7.0)


@pytest.mark.parametrize(("configured", "trainer_every", "expected"),
                         [(None, 25, 25), (None, None, PLAIN_LOOP_LOG_EVERY), (0, 25, 0), (7, 25, 7), (7, None, 7)])
def test_status_interval(configured: int | None, trainer_every: int | None, expected: int) -> None:
    assert resolve_status_interval(configured, trainer_every) == expected


def test_status_interval_rejects_negative() -> None:
    with pytest.raises(ConfigError, match="status_every_n_steps"):
        resolve_status_interval(None, -1)


def test_replica_lag_and_stream_throughput() -> None:
    assert replica_lag(-1, None, None) is None
    assert replica_lag(10, 10, 0) == 0
    assert replica_lag(10, 8, 0) == 2
    assert replica_lag(8, None, 8) == 1  # restored at 7, first snapshot 8 not yet acknowledged
    assert replica_lag(8, 3, 8) == 1  # an acknowledgement from before the restart does not count
    a = stats(stream_bytes=1_000_000_000, stream_seconds=2.0)
    b = stats(stream_bytes=4_000_000_000, stream_seconds=3.0)
    assert stream_gbps_between(None, a) == pytest.approx(0.5) and a.stream_gbps == pytest.approx(0.5)
    assert stream_gbps_between(a, b) == pytest.approx(3.0)
    assert stream_gbps_between(b, b) is None


# -- the reporter ---------------------------------------------------------------------------------------------


def test_reporter_status_on_rank_zero_at_the_interval(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lg = FakeLogger()
    rep = reporter(tmp_path, every=10, loggers=[lg])
    assert [s for s in range(31) if rep.status_due(s)] == [0, 10, 20, 30]
    assert not any(reporter(tmp_path, rank_zero=False).status_due(s) for s in range(31))
    assert not any(reporter(tmp_path, every=0).status_due(s) for s in range(31))
    assert rep.emit_status(0, stats(iteration=-1)) is None  # nothing snapshotted yet
    with caplog.at_level(logging.INFO, logger="neighbor_ckpt.report.status"):
        rep.emit_status(10, stats(stream_bytes=10**9, stream_seconds=1.0))
        line = rep.emit_status(20, stats(stream_bytes=3 * 10**9, stream_seconds=2.0))
    assert line is not None and "stream 2.0 GB/s" in line
    assert [r.getMessage() for r in caplog.records][-1] == line
    assert [step for _, step in lg.calls] == [10, 20] and lg.saves == 2
    assert lg.calls[1][0]["neighbor_ckpt/stream_gbps"] == pytest.approx(2.0)


def test_reporter_sends_no_metrics_when_off_or_without_loggers(tmp_path: Path) -> None:
    lg = FakeLogger()
    reporter(tmp_path, loggers=[lg], log_metrics=False).emit_status(10, stats())
    reporter(tmp_path).emit_status(10, stats())  # no logger: nothing to call, no error
    assert lg.calls == []


def test_reporter_attach_replaces_the_plain_loop_defaults(tmp_path: Path) -> None:
    lg = FakeLogger()
    rep = reporter(tmp_path, every=50)
    rep.attach(every_n_steps=3, loggers=[lg], report_dir=tmp_path / "logs", process_group_ready=T0)
    assert rep.every_n_steps == 3 and rep.loggers == (lg,) and rep.report_dir == tmp_path / "logs"
    assert rep.process_group_ready == T0
    other = reporter(tmp_path, rank_zero=False)
    other.attach(every_n_steps=3)
    assert other.every_n_steps == 0


def test_reporter_timeline_after_the_first_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lg = FakeLogger()
    rep = reporter(tmp_path, loggers=[lg])
    assert not rep.timeline_pending and rep.finish_timeline(T0, step=1) is None
    rep.begin_timeline([rank_events()], outcome="restored", iteration=7, recovery_phases={"load": 0.01})
    assert rep.timeline_pending
    with caplog.at_level(logging.INFO, logger="neighbor_ckpt.report.status"):
        tl = rep.finish_timeline(T0 + 7.0, step=8)
    assert not rep.timeline_pending and tl is not None
    assert tl.path_png == tmp_path / "reports" / "recovery_timeline.attempt1.png"
    # drawn off the calling (training) thread
    assert wait_for_renders(timeout=RENDER_LIMIT_S), f"the picture was not drawn within {RENDER_LIMIT_S} s"
    assert tl.path_png.read_bytes()[:8] == PNG_MAGIC and tl.path_json is not None and tl.path_json.exists()
    assert any(r.getMessage().startswith("neighbor_ckpt: recovery MTTR 7.00 s") and str(tl.path_png) in r.getMessage()
               for r in caplog.records)
    metrics, step = lg.calls[-1]
    assert step == 8 and metrics["neighbor_ckpt/recovery/first_step_s"] == pytest.approx(1.4)
    # rank != 0 keeps nothing
    quiet = reporter(tmp_path, rank_zero=False)
    quiet.begin_timeline([rank_events()], outcome="restored", iteration=7, recovery_phases={})
    assert not quiet.timeline_pending


def test_reporter_timeline_off_writes_no_file_but_still_reports(tmp_path: Path) -> None:
    lg = FakeLogger()
    rep = reporter(tmp_path, loggers=[lg], timeline=False)
    rep.begin_timeline([rank_events()], outcome="restored", iteration=7, recovery_phases={})
    tl = rep.finish_timeline(T0 + 7.0, step=8)
    assert tl is not None and tl.path_png is None and tl.path_json is None
    assert not (tmp_path / "reports").exists()
    assert "neighbor_ckpt/recovery/total_s" in lg.calls[-1][0]
    assert not reporter(tmp_path, timeline=False, log_metrics=False).wants_recovery_events


def test_log_to_loggers_passes_step() -> None:
    lg = FakeLogger()
    log_to_loggers([lg], {"a": 1.0}, 5)
    assert lg.calls == [({"a": 1.0}, 5)]


# -- recovery progress ----------------------------------------------------------------------------------------


def test_progress_mode() -> None:
    assert resolve_progress_mode("auto", isatty=True) == "rich"
    assert resolve_progress_mode("auto", isatty=False) == "log"
    assert resolve_progress_mode("rich", isatty=False) == "rich"
    assert resolve_progress_mode("none", isatty=True) == "none"


def test_progress_logs_one_line_per_phase(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="neighbor_ckpt.report.status"):
        with recovery_progress("auto", enabled=True) as prog:  # pytest's stderr is not a TTY
            for name in ("inventory", "exchange", "transfer"):
                prog.phase(name)
    msgs = [r.getMessage() for r in caplog.records]
    assert [m.split(" done")[0] for m in msgs if " done in " in m] == [
        "neighbor_ckpt recovery: inventory", "neighbor_ckpt recovery: exchange", "neighbor_ckpt recovery: transfer"]
    assert msgs[-1].startswith("neighbor_ckpt recovery: finished in")


@pytest.mark.parametrize(("mode", "enabled"), [("none", True), ("auto", False)])
def test_progress_off_is_silent(mode: str, enabled: bool, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="neighbor_ckpt.report.status"):
        with recovery_progress(mode, enabled=enabled) as prog:
            prog.phase("inventory")
    assert caplog.records == []


def test_rich_progress_runs_and_stops() -> None:
    with recovery_progress("rich", enabled=True) as prog:
        for name in ("inventory", "exchange", "transfer", "verify", "load", "restore", "transfer"):
            prog.phase(name)
    with pytest.raises(RuntimeError, match="boom"):
        with recovery_progress("rich", enabled=True) as prog:
            prog.phase("inventory")
            raise RuntimeError("boom")


# -- wiring: a single-rank gloo job that fails, then recovers (one process at a time) -----------------------------

_JOB = r"""
import json, logging, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from neighbor_ckpt import NeighborCkptConfig
from neighbor_ckpt.adapters import TorchOptimizerAdapter
from neighbor_ckpt.checkpointer import NeighborCheckpointer
from neighbor_ckpt.report import timeline

timeline.RENDER_WAIT_S = __RENDER_LIMIT_S__  # the exit waits for the picture; the test's bound, not the product's, on a slow machine
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s", stream=sys.stdout)
tmp = Path(sys.argv[1]); fail = sys.argv[2] == "fail"
dist.init_process_group("gloo", init_method=f"file://{tmp}/pg{os.environ['TORCHELASTIC_RESTART_COUNT']}",
                        rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
cfg = NeighborCkptConfig.from_dict({"job_id": "wiring", "store": {"dir": str(tmp / "store"),
                                    "cleanup_on_success": False},
                                    "report": {"status_every_n_steps": 2, "dir": str(tmp / "reports")}})
ckpt = NeighborCheckpointer(cfg, adapter=TorchOptimizerAdapter(model, opt), handle_sigterm=False)
res = ckpt.recover()
for step in range(res.next_step, 6 if fail else 8):
    loss = model(torch.randn(3, 4)).square().mean()
    ckpt.wait(); loss.backward()
    with ckpt.optimizer_step():
        opt.step()
    opt.zero_grad()
    ckpt.snapshot(step)
ckpt.wait()
st = ckpt.stats()
out = {"restored": res.iteration, "stats": {"iteration": st.iteration, "unique_bytes": st.unique_bytes,
       "replica_lag": st.replica_lag, "host_store_bytes": st.host_store_bytes}}
if fail:
    time.sleep(0.05)
    ckpt.on_failure("RuntimeError: injected")
    ckpt.close(success=False)
else:
    ckpt.close(success=False)  # no wait here: the interpreter's exit waits for the picture
    tl = ckpt.last_timeline
    out["timeline"] = None if tl is None else {"phases": dict(tl.phases), "png": str(tl.path_png),
                                               "json": str(tl.path_json), "notes": list(tl.notes)}
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


def _run_job(tmp_path: Path, mode: str, attempt: int) -> tuple[dict[str, Any], str]:
    env = dict(os.environ, TORCHELASTIC_RESTART_COUNT=str(attempt), PYTHONPATH=str(Path(__file__).parents[2]))
    env.pop("NEIGHBOR_CKPT_STORE_DIR", None)
    env.pop("NEIGHBOR_CKPT_JOB_ID", None)
    proc = subprocess.run([sys.executable, "-c", _JOB.replace("__RENDER_LIMIT_S__", repr(RENDER_LIMIT_S)), str(tmp_path), mode], env=env,
                          capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), proc.stdout


def test_checkpointer_reports_status_and_writes_the_timeline_after_recovery(tmp_path: Path) -> None:
    first, log = _run_job(tmp_path, "fail", 0)
    assert first["restored"] is None
    assert first["stats"]["iteration"] == 5 and first["stats"]["unique_bytes"] > 0  # DP 1: everything is unique
    assert first["stats"]["replica_lag"] is None and first["stats"]["host_store_bytes"] > 0
    status = [x for x in log.splitlines() if x.startswith("neighbor_ckpt.report.status neighbor_ckpt: step")]
    assert [x.split(" | ")[0].rsplit(" ", 1)[1] for x in status] == ["2", "4"]
    assert "replica off" in status[0]
    events = list((tmp_path / "store").rglob("events.json"))
    assert len(events) == 1 and stat.S_IMODE(events[0].stat().st_mode) == 0o600

    second, log = _run_job(tmp_path, "recover", 1)
    assert second["restored"] == 5
    assert not list((tmp_path / "store").rglob("events.json")), "the failure event is consumed by the recovery"
    tl = second["timeline"]
    assert tl is not None and tl["notes"] == []
    assert all(v is not None and v >= 0 for v in tl["phases"].values())
    assert Path(tl["png"]) == tmp_path / "reports" / "recovery_timeline.attempt1.png"
    # The job process ended right after close(): its exit waited for the picture (whose process dies with it).
    assert Path(tl["png"]).exists(), "the job exited without drawing its recovery timeline's picture:\n" + log[-3000:]
    assert Path(tl["png"]).read_bytes()[:8] == PNG_MAGIC
    data = json.loads(Path(tl["json"]).read_text())
    assert data["outcome"] == "restored" and data["iteration"] == 5
    assert data["mttr_s"] == pytest.approx(sum(tl["phases"].values()))
    assert "neighbor_ckpt recovery: inventory done in" in log
    assert "neighbor_ckpt: recovery MTTR" in log


def test_process_start_time_is_on_the_wall_clock() -> None:
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "from neighbor_ckpt.report.timeline import process_start_unix; "
                          "print(repr(process_start_unix()))"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2])))
    after = time.time()
    started = float(out.stdout.strip().splitlines()[-1])
    assert before - 0.05 <= started <= after, (before, started, after)  # to a clock tick, not to a second


def test_lightning_report_dir_never_lands_in_the_package_sources(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from neighbor_ckpt.lightning.callback import default_report_dir

    repo = Path(__file__).parents[2]  # a run from the repository root without a logger
    assert default_report_dir(repo) == repo / "neighbor_ckpt_reports"
    assert not (default_report_dir(repo) / "__init__.py").exists()


def test_the_wait_for_a_picture_is_bounded_and_says_when_it_gives_up(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from neighbor_ckpt.report import timeline as timeline_mod

    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a drawing that never ends
    try:
        with timeline_mod._renders_lock:
            timeline_mod._renders.append((stuck, tmp_path / "t.png"))
        with caplog.at_level(logging.WARNING, logger="neighbor_ckpt.report.timeline"):
            assert not wait_for_renders(timeout=0.0)
        assert any("gave up waiting" in r.getMessage() and str(tmp_path / "t.png") in r.getMessage()
                   for r in caplog.records)
        assert not timeline_mod._renders
    finally:
        stuck.kill()
        stuck.wait()
