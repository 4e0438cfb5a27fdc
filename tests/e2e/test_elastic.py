"""End to end, elastic shrink in process (issue 18, plain megatron-core loop): a rank is lost for good with no hot
spare left, and the survivors go on with a smaller data-parallel size, the global batch unchanged.

4 ranks, one of our launchers per simulated node (:mod:`tests.e2e.inprocess_launch`), DistributedOptimizer, dropout
0, global batch 24 (micro-batch 2: 3 micro-batches per rank at DP 4, 4 at DP 3). Rank 1 is SIGKILLed inside the
optimizer step of step 5 together with its launcher (``PERMANENT``: its node is gone, so no launcher reports the
exit: rank 1's ring successor finds it silent). The survivors keep their processes; the engine backfills the highest
rank into the gap and the training function builds a DP-3 layout, whose ``recover()`` reshards the DP-4 snapshots
(each survivor's own slots, rank 1's replica on its ring successor) into it. No process of the launch outlives it.

Compared with the failure-free DP-4 run: every loss before the failure bit for bit; every loss after it within 1e-4
relative (the same samples in each global batch, summed in another order); the consumed-samples sequence identical.
The resharded optimizer state equals a reference resharding computed here, in one process, from the same snapshots
(the survivors copied the previous layout's store before training on), bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from neighbor_ckpt.snapshot.slot import SlotFile
from tests.conftest import Baselines, RunResult, run_torchrun, warm_workers
from tests.e2e.inprocess_launch import (assert_no_orphans, attempts, failures, launch_config, launch_inprocess,
                                        launcher_exits, timeline)

pytestmark = pytest.mark.e2e

STEPS, KILL_STEP = 10, 5
ELASTIC_ENV = dict(STEPS=STEPS, GLOBAL_BATCH=24, DROPOUT=0.0)


def _global_losses(res: RunResult) -> dict[int, list[dict[str, Any]]]:
    """Rank 0's records per step (whichever process is rank 0 after the shrink writes them)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for line in (res.out / "losses.rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], []).append(rec)
    return out


def _reference(oldstore: Path, iteration: int) -> dict[tuple[tuple[int, ...], str], np.ndarray]:
    """Per (model-parallel coordinate, tensor): the whole flattened tensor, assembled in this process from every old
    rank's shard of ``iteration`` found in the survivors' copies of the previous layout's store."""
    full: dict[tuple[tuple[int, ...], str], np.ndarray] = {}
    seen: set[int] = set()
    for path in sorted(oldstore.glob("*/rank*/*.slot")):
        slot = SlotFile.open(path)
        try:
            hdr = slot.read_header()
            if hdr.iteration != iteration or hdr.owner_rank in seen:
                continue
            slot.verify(hdr)
            seen.add(hdr.owner_rank)
            coord = tuple(hdr.meta["coord"])
            for t in hdr.meta["tensors"]:
                span = hdr.meta["shards"].get(t["name"])
                if span is None:
                    continue
                numel, start, end = span
                arr = full.setdefault((coord, t["name"]), np.full(numel, np.nan, dtype=np.float32))
                view = slot.payload_view(t["offset"], getattr(torch, t["dtype"]), t["shape"])
                arr[start:end] = view.reshape(-1).numpy()
        finally:
            slot.close()
    assert seen, "no old snapshot found"
    assert not any(np.isnan(a).any() for a in full.values()), f"old ranks {sorted(seen)} do not cover every tensor"
    return full


def _check_shrink(base: RunResult, res: RunResult, *, dp_before: int, dp_after: int, lost: int = 1,
                  global_batch: int = 24) -> None:
    """TP 1: ``dp_after`` survivors go on as ranks (any other survivor idles)."""
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    # the lost node's launcher was SIGKILLed with its process; every other launcher finished the job
    assert launcher_exits(res) == {f"node{n}": -9 if n == lost else 0 for n in range(4)}, res.log[-6000:]
    # Nobody reports the lost rank's exit (its launcher is gone): its ring successor's monitor finds it silent and
    # declares it dead. A survivor whose collective saw the closed connection may have failed the generation first.
    successor = (lost + 1) % 4
    gen0 = [(k, w) for g, k, w in failures(res) if g == 0]
    assert gen0 in ([("silent", f"process {successor}")], *([("exception", f"process {p}")] for p in range(4)
                                                             if p != lost)), failures(res)
    assert f"process {successor}: process {lost} sent no heartbeat for" in res.log, "its successor did not declare it"
    assert f"continuing on {dp_after} of 4 ranks (elastic)" in res.log
    base_l, got = _global_losses(base), _global_losses(res)
    assert sorted(got) == list(range(STEPS)), f"trained steps {sorted(got)}"
    for step in range(STEPS):
        expected = float.fromhex(base_l[step][-1]["loss"])
        for rec in got[step]:
            assert rec["consumed_samples"] == base_l[step][-1]["consumed_samples"] == step * global_batch, (step, rec)
            loss = float.fromhex(rec["loss"])
            if step < KILL_STEP:
                assert rec["loss"] == base_l[step][-1]["loss"] and rec["dp"] == dp_before, (step, rec)
            else:
                assert rec["dp"] == dp_after, (step, rec)
                assert abs(loss - expected) <= 1e-4 * abs(expected), (step, loss, expected)
    # the survivors kept their processes; nothing restarted
    atts = attempts(res)
    pids: dict[int, set[int]] = {}
    for a in atts:
        pids.setdefault(a["initial_rank"], set()).add(a["pid"])
    assert all(len(p) == 1 for p in pids.values()), pids
    assert lost not in {a["initial_rank"] for a in atts if a["iteration"] == 1}
    # every new rank restored by resharding the same iteration; the timeline says what changed
    reports = [json.loads(p.read_text()) for p in sorted(res.out.glob("report.rank*.attempt1.json"))]
    assert len(reports) == dp_after, reports
    for rep in reports:
        assert rep["outcome"] == "restored" and rep["source"] == "reshard", rep
        assert (rep["data_parallel_before"], rep["data_parallel_after"]) == (dp_before, dp_after), rep
        assert rep["iteration"] == KILL_STEP - 1, rep
    tl = timeline(res, "0.1")
    assert (tl["mode"], tl["restarted_ranks"]) == ("in-process", []), tl
    assert (tl["data_parallel_before"], tl["data_parallel_after"]) == (dp_before, dp_after), tl
    assert "data-parallel size %d -> %d: the global batch is %d samples, %d micro-batch(es) of 2 per rank (was %d)" % (
        dp_before, dp_after, global_batch, global_batch // (2 * dp_after), global_batch // (2 * dp_before)) in res.log
    # the resharded optimizer state is the reference resharding of the same snapshots, bit for bit
    full = _reference(res.out / "oldstore", KILL_STEP - 1)
    checked = 0
    for r in range(dp_after):
        meta = json.loads((res.out / f"resharded.rank{r}.json").read_text())
        with np.load(res.out / f"resharded.rank{r}.npz") as live:
            for name, (numel, start, end) in meta["spans"].items():
                expected = full[(tuple(meta["coord"]), name)][start:end]
                assert np.array_equal(live[name].reshape(-1), expected), (r, name)
                checked += 1
    assert checked > 0


@pytest.fixture(scope="module")
def elastic_baseline(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    with warm_workers():
        res = launch_inprocess(tmp_path_factory.mktemp("elastic-base"), spares=0, FAULT="none", **ELASTIC_ENV)
    assert res.returncode == 0, res.log[-8000:]
    assert_no_orphans(res)
    return res


def test_plain_loop_loses_a_rank_for_good_and_continues_on_dp3_with_the_global_batch(elastic_baseline: RunResult,
                                                                                    tmp_path: Path) -> None:
    res = launch_inprocess(tmp_path, spares=0, FAULT="kill", KILL_RANK=1, KILL_STEP=KILL_STEP,
                           PERMANENT=1, ELASTIC=1, KEEP_OLD=1, **ELASTIC_ENV)
    _check_shrink(elastic_baseline, res, dp_before=4, dp_after=3)


def test_a_shrink_that_leaves_a_survivor_idle_keeps_the_one_whose_node_holds_the_lost_ranks_replica(
        tmp_path: Path) -> None:
    """Global batch 16: 3 survivors, but DP 3 does not divide 8 micro-batches, so DP 4 -> 2 and one survivor idles.
    Rank 2 is lost for good. Its replica is only on rank 3's node, and rank 1's snapshot only on rank 1's (its
    replica was on rank 2's), so ranks 1 and 3 stay; rank 0's snapshot is also on rank 1's node, so rank 0 idles and
    rank 3 becomes rank 0. Rank order alone kept ranks 0 and 1 and left rank 2's only copy in rank 3's idle store:
    no complete version (the 200-fault campaign's failure)."""
    env = dict(STEPS=STEPS, GLOBAL_BATCH=16, DROPOUT=0.0)
    base = launch_inprocess(tmp_path / "base", spares=0, FAULT="none", **env)
    assert base.returncode == 0, base.log[-8000:]
    res = launch_inprocess(tmp_path / "shrink", spares=0, FAULT="kill", KILL_RANK=2, KILL_STEP=KILL_STEP,
                           PERMANENT=1, ELASTIC=1, KEEP_OLD=1, **env)
    _check_shrink(base, res, dp_before=4, dp_after=2, lost=2, global_batch=16)
    assert "generation 1: 2 ranks; shrunk from 4; idle [0]" in res.log, res.log[-6000:]


def test_restart_path_reshards_to_the_nodes_that_come_back_and_grows_back_to_the_configured_size(
        elastic_baseline: RunResult, tmp_path: Path) -> None:
    """The restart path (plain torchrun, the recipe unmodified): the whole job dies in step 5 and comes back on 3
    nodes (one is gone), which reshard the DP-4 snapshots to DP 3; it dies again in step 7 and comes back on 4 nodes
    (a new, empty one among them), which reshard the DP-3 snapshots back to DP 4 (grow back) and finish. The nodes are
    the per-rank store roots under one TEST_STORE_BASE, shared by the launches; the job id is fixed. The failure-free
    run is the in-process one of the same recipe, global batch and dropout (the launcher does not change what is
    computed: the first five losses must equal it bit for bit)."""
    cfg = tmp_path / "elastic.yaml"
    cfg.write_text("neighbor_ckpt:\n  elastic:\n    enabled: true\n")
    store = tmp_path / "store"
    common = dict(STEPS=STEPS, NCKPT_CONFIG=cfg, EXTRA_ARGS="--global-batch 24 --dropout 0", TEST_STORE_BASE=store)
    base = elastic_baseline
    runs = [run_torchrun("train_mcore.py", tmp_path / "dp4", nproc=4, KILL_RANK="0,1,2,3", KILL_STEP=5,
                         NEIGHBOR_CKPT_JOB_ID="grow", **common),
            run_torchrun("train_mcore.py", tmp_path / "dp3", nproc=3, KILL_RANK="0,1,2", KILL_STEP=7,
                         NEIGHBOR_CKPT_JOB_ID="grow", **common),
            run_torchrun("train_mcore.py", tmp_path / "dp4-again", nproc=4, NEIGHBOR_CKPT_JOB_ID="grow", **common)]
    assert runs[2].returncode == 0, runs[2].log[-6000:]
    expected = {json.loads(line)["step"]: json.loads(line) for line in
                (base.out / "losses.rank0.jsonl").read_text().splitlines()}
    steps: dict[int, tuple[int, dict[str, Any]]] = {}
    for i, r in enumerate(runs):
        for line in (r.out / "losses.rank0.jsonl").read_text().splitlines():
            rec = json.loads(line)
            steps[rec["step"]] = (i, rec)
    assert sorted(steps) == list(range(STEPS))
    for step, (i, rec) in steps.items():
        assert i == (0 if step < 5 else 1 if step < 7 else 2), (step, i)
        assert rec["consumed_samples"] == expected[step]["consumed_samples"] == step * 24
        if step < 5:
            assert rec["loss"] == expected[step]["loss"], step
        else:
            a, b = float.fromhex(rec["loss"]), float.fromhex(expected[step]["loss"])
            assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)
    # The global batch on the samples themselves: in every step, the ranks of the run that trained it consumed
    # exactly samples step x 24 .. step x 24 + 23, each once, each rank 24 / DP of them (not only the counter).
    per_step: dict[int, dict[int, dict[int, list[int]]]] = {}
    for i, r in enumerate(runs):
        for path in sorted(r.out.glob("losses.rank*.jsonl")):
            rank = int(path.name.split(".")[1].removeprefix("rank"))
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                per_step.setdefault(rec["step"], {}).setdefault(i, {})[rank] = rec["samples"]
    for step, by_run in sorted(per_step.items()):
        ranks = by_run[max(by_run)]
        dp = 4 if step < 5 or step >= 7 else 3
        assert len(ranks) == dp and all(len(v) == 24 // dp for v in ranks.values()), (step, ranks)
        assert sorted(x for v in ranks.values() for x in v) == list(range(step * 24, step * 24 + 24)), (step, ranks)
    for run, nranks, it, dp in ((runs[1], 3, 4, (4, 3)), (runs[2], 4, 6, (3, 4))):
        for r in range(nranks):
            rep = run.report(r, 0)
            assert (rep["outcome"], rep["source"], rep["iteration"]) == ("restored", "reshard", it), rep
            assert (rep["data_parallel_before"], rep["data_parallel_after"]) == dp, rep
            assert f"global batch 24 samples kept: {24 // (2 * dp[1])} micro-batch(es) of 2 per rank" in \
                " ".join(rep["notes"]), rep
    assert "data-parallel size 4 -> 3: the global batch is 24 samples, 4 micro-batch(es) of 2 per rank (was 3)" \
        in runs[1].log, runs[1].log[-4000:]
    # the successful end removed every generation of the job's store on every node
    assert not list(store.glob("node*/*/grow/**/*.slot")), sorted(store.glob("node*/*/grow/**/*.slot"))


def test_restart_path_second_failure_before_the_new_layouts_first_snapshot_reshards_the_old_layout_from_memory(
        elastic_baseline: RunResult, tmp_path: Path) -> None:
    """Issue 31 item 2. The job dies in step 5 on 4 nodes and comes back on 3 (DP 4 -> 3, store generation 1). In its
    first step after the reshard, rank 1 is SIGKILLed halfway through streaming its first DP-3 snapshot (iteration 5)
    to its successor, and torchrun restarts the 3 ranks with rank 1's node replaced (every store generation of it
    empty): generation 1 holds no complete version (rank 1's snapshot 5 is gone with its node, its replica never
    committed), while generation 0, not released yet (that waits for the first DP-3 snapshot on every rank, committed
    and replicated), holds iteration 4 of every old rank. The restart reshards generation 0 again, from memory, into
    generation 2 (the rule before chose generation 1, the newest with a committed copy, whose restore had no complete
    version); the replayed step 5 is bit for bit the one the first DP-3 attempt trained, every later step within 1e-4
    of the failure-free DP-4 run, each step on its 24 samples."""
    cfg = tmp_path / "elastic.yaml"
    cfg.write_text("neighbor_ckpt:\n  elastic:\n    enabled: true\n")
    common = dict(STEPS=STEPS, NCKPT_CONFIG=cfg, TEST_STORE_BASE=tmp_path / "store", NEIGHBOR_CKPT_JOB_ID="again")
    run_torchrun("train_mcore.py", tmp_path / "dp4", nproc=4, KILL_RANK="0,1,2,3", KILL_STEP=5,
                 EXTRA_ARGS="--global-batch 24 --dropout 0", **common)
    res = run_torchrun("train_mcore.py", tmp_path / "dp3", nproc=3, max_restarts=1, KILL_RANK="1", KILL_STEP=5,
                       KILL_PHASE="stream", EXTRA_ARGS="--global-batch 24 --dropout 0 --replace-store", **common)
    assert res.returncode == 0, res.log[-8000:]
    assert "falling back to the insurance" not in res.log and "starting over" not in res.log, res.log[-8000:]
    # Ranks 0 and 2 usually commit their snapshot 5 (in the background, within milliseconds) before torchrun stops
    # them: generation 1 then holds copies but no complete version, and is skipped for generation 0, resharded into
    # generation 2. On a loaded machine they may be stopped first: generation 1 then holds nothing and generation 0
    # is resharded into it again. Either way the old layout's snapshots are the source, from memory (checked below).
    assert ("store generation 1 holds no complete version" in res.log and "elastic reshard into generation 2" in
            res.log) or "elastic reshard into generation 1" in res.log, res.log[-8000:]
    for r in range(3):
        for attempt in (0, 1):
            rep = res.report(r, attempt)
            assert (rep["outcome"], rep["source"], rep["iteration"]) == ("restored", "reshard", 4), (attempt, rep)
            assert (rep["data_parallel_before"], rep["data_parallel_after"]) == (4, 3), rep
    expected = {json.loads(line)["step"]: json.loads(line) for line in
                (elastic_baseline.out / "losses.rank0.jsonl").read_text().splitlines()}
    recs: dict[int, list[dict[str, Any]]] = {}
    for line in (res.out / "losses.rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        recs.setdefault(rec["step"], []).append(rec)
    assert sorted(recs) == list(range(5, STEPS)), sorted(recs)
    assert [r["attempt"] for r in recs[5]] == [0, 1], recs[5]
    assert recs[5][0]["loss"] == recs[5][1]["loss"], recs[5]  # the same state, resharded twice: the same step
    for step, rs in recs.items():
        a, b = float.fromhex(rs[-1]["loss"]), float.fromhex(expected[step]["loss"])
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)
    for step in range(5, STEPS):
        samples = [json.loads(line)["samples"] for r in range(3)
                   for line in (res.out / f"losses.rank{r}.jsonl").read_text().splitlines()
                   if json.loads(line)["step"] == step and json.loads(line)["attempt"] == 1]
        assert sorted(x for v in samples for x in v) == list(range(step * 24, step * 24 + 24)), (step, samples)


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("tp,dp_after", [(2, 1)], ids=["tp2-dp2-to-dp1"])  # DP 4 -> 3: the plain loop's test above
def test_nemo_recipe_loses_a_rank_for_good_and_continues_on_a_smaller_dp_in_process(
        tp: int, dp_after: int, baseline: Baselines, tmp_path: Path) -> None:
    """``neighbor-ckpt launch configs/gpt_tiny_cpu.yaml`` (NeMo 2 ``llm.pretrain``, MegatronStrategy, distributed
    optimizer, 4 CPU ranks, global batch 24, micro-batch 2, dropout 0) with in-process recovery and elastic on and no
    spare; rank 1 is killed for good in step 5's optimizer step: the launch finishes every step on a smaller DP (TP 2:
    DP 2 -> 1, one survivor idles; TP 1, DP 4 -> 3, is the plain loop's test above, the same shrink). Compared with
    the failure-free run of the same file (the restart path's, shared): losses bit-exact before the failure, within
    1e-4 after it, the consumed-samples sequence identical; the timeline says what changed."""
    over = ("trainer.max_steps=10", "trainer.global_batch_size=24", "model.dropout=0", f"parallelism.tensor={tp}")
    dp_before = 4 // tp
    base = baseline.launch("gpt_tiny_cpu.yaml", *over)
    res = launch_config("gpt_tiny_cpu.yaml", tmp_path / "fault", *over, "neighbor_ckpt.inprocess.enabled=true",
                        "neighbor_ckpt.elastic.enabled=true", "neighbor_ckpt.fault_injection.enabled=true",
                        "neighbor_ckpt.fault_injection.rank=1", "neighbor_ckpt.fault_injection.step=5",
                        "neighbor_ckpt.fault_injection.phase=optimizer", "neighbor_ckpt.fault_injection.permanent=true",
                        "neighbor_ckpt.fault_injection.replace_store=false", timeout=1800)
    assert res.returncode == 0, res.log[-8000:]
    # no process outlives the launch: with TP 2 one survivor idles at DP 1, and exits when the job completes
    assert_no_orphans(res)
    assert f"continuing on {dp_after * tp} of 4 ranks" in res.log and "in-process recovery gives up" not in res.log
    expected = {json.loads(line)["step"]: json.loads(line) for line in
                (base.out / "losses.rank0.jsonl").read_text().splitlines()}
    got: dict[int, list[dict[str, Any]]] = {}
    for line in (res.out / "losses.rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        got.setdefault(rec["step"], []).append(rec)
    assert sorted(got) == list(range(10)), sorted(got)
    for step, recs in got.items():
        for rec in recs:
            assert rec["consumed_samples"] == expected[step]["consumed_samples"] == (step + 1) * 24, (step, rec)
            if step < 5:
                assert rec["loss"] == expected[step]["loss"] and rec["dp"] == dp_before, (step, rec)
            else:
                a, b = float.fromhex(rec["loss"]), float.fromhex(expected[step]["loss"])
                assert rec["dp"] == dp_after and abs(a - b) <= 1e-4 * abs(b), (step, a, b)
    tls = [json.loads(p.read_text()) for p in (tmp_path / "fault" / "run").rglob("recovery_timeline.*.json")]
    assert [(t["mode"], t["data_parallel_before"], t["data_parallel_after"]) for t in tls] == \
        [("in-process", dp_before, dp_after)], tls
    # the callback took the global batch from NeMo's sampler: the recovery states the batch it keeps
    reports = [json.loads(p.read_text()) for p in res.out.glob("report.rank0.attempt*.json")]
    assert any(f"global batch 24 samples kept: {24 // (2 * dp_after)} micro-batch(es) of 2 per rank" in
               " ".join(r["notes"]) for r in reports), reports
