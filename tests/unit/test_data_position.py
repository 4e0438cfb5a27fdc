"""Data position in plain loops (docs/data-position.md): the recommended loader (torchdata's
StatefulDataLoader with its own generators, its state carried by the snapshot's pickle-free codec) resumes exactly;
the shuffle-seed trap (``DataLoader(shuffle=True)`` created after ``recover()`` restored the global RNG) does not, and
the checkpointer's data check notices it at the replayed step, across a real restart of the process; the Lightning
callback feeds the check with each batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from neighbor_ckpt.snapshot.codec import decode, encode

stateful = pytest.importorskip("torchdata.stateful_dataloader")
from torchdata.stateful_dataloader.sampler import RandomSampler  # noqa: E402

DATA = list(range(22))  # 7 batches of 3 per epoch, the last sample dropped


def recommended_loader() -> "stateful.StatefulDataLoader":
    return stateful.StatefulDataLoader(DATA, batch_size=3, drop_last=True,
                                       sampler=RandomSampler(DATA, generator=torch.Generator().manual_seed(11)),
                                       generator=torch.Generator().manual_seed(12))


def forever(loader):
    while True:
        yield from loader


def take(it, n):
    return [next(it).tolist() for _ in range(n)]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata 0.11 on torch 2.13: "'set_vital' is deprecated"
        yield


@pytest.mark.parametrize("k", [0, 1, 6, 7, 8, 13, 15])
def test_stateful_loader_state_through_the_snapshot_codec_resumes_exactly_without_touching_the_global_rng(k):
    ref = take(forever(recommended_loader()), 25)
    dl = recommended_loader()
    it = forever(dl)
    take(it, k)
    text, tensors = encode({"loader": dl.state_dict()})  # what snapshot(user_state=...) stores: no pickle
    torch.manual_seed(5)  # recover() restored the global RNG to wherever the snapshot was taken
    before = torch.get_rng_state()
    resumed = recommended_loader()
    resumed.load_state_dict(decode(text, tensors)["loader"])
    assert take(forever(resumed), 25 - k) == ref[k:]
    assert torch.equal(torch.get_rng_state(), before), "the loader drew from the global RNG: dropout would differ"


def test_the_shuffle_seed_trap_a_loader_created_after_the_rng_restore_feeds_other_batches():
    torch.manual_seed(0)
    first = [b.tolist() for b in DataLoader(DATA, batch_size=3, shuffle=True)]  # the run without failure
    torch.manual_seed(0)
    torch.rand(10)  # training consumed the global RNG; recover() restores this state, then the loader is created
    again = [b.tolist() for b in DataLoader(DATA, batch_size=3, shuffle=True)]
    assert again[3] != first[3]


_JOB = r"""
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from neighbor_ckpt import NeighborCkptConfig
from neighbor_ckpt.adapters import TorchOptimizerAdapter
from neighbor_ckpt.checkpointer import NeighborCheckpointer
from neighbor_ckpt.errors import DataPositionError

tmp, phase, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{tmp}/pg-{phase}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = NeighborCheckpointer(NeighborCkptConfig(job_id="dc", data_check=mode), adapter=TorchOptimizerAdapter(model, opt),
                            handle_sigterm=False)
res = ckpt.recover()
seed = lambda step: step + (100 if phase == "other" else 0)
out = {"next_step": res.next_step}
try:
    for step in range(res.next_step, 6):
        tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(seed(step)))
        ckpt.observe_input({"tokens": tokens, "labels": tokens})
        if phase == "first" and step == 4:
            ckpt.wait()  # snapshot 3 committed (the engine commits in the background): the restore target is 3
            os._exit(0)  # dies in step 4, after its input was drawn: nothing closed, nothing flushed
        loss = model(torch.randn(3, 4)).square().mean()
        ckpt.wait(); loss.backward()
        with ckpt.optimizer_step():
            opt.step()
        opt.zero_grad()
        ckpt.snapshot(step)
except DataPositionError as e:
    out["error"] = {"message": str(e), "step": e.step, "rank": e.rank}
out["verdict"] = None if ckpt.datacheck.verdict is None else ckpt.datacheck.verdict.value
ckpt.close(success="error" not in out)
print("RESULT " + json.dumps(out))
"""


def _run(tmp: Path, phase: str, mode: str = "error", attempt: int = 0) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "NEIGHBOR_CKPT_"))}
    env.update(PYTHONPATH=str(Path(__file__).parents[2]), NEIGHBOR_CKPT_STORE_DIR=str(tmp / "store"),
               TORCHELASTIC_RESTART_COUNT=str(attempt))
    proc = subprocess.run([sys.executable, "-c", _JOB, str(tmp), phase, mode], env=env, capture_output=True,
                          text=True, timeout=300)
    if phase == "first":
        assert proc.returncode == 0 and "RESULT" not in proc.stdout, proc.stderr[-3000:]
        return {}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "log": proc.stderr}


@pytest.mark.parametrize("replay", ["same", "other"])
def test_the_checkpointer_checks_the_replayed_step_against_the_input_recorded_before_the_process_died(
        tmp_path: Path, replay: str) -> None:
    _run(tmp_path, "first")
    out = _run(tmp_path, replay, attempt=1)
    assert out["next_step"] == 4
    if replay == "same":
        assert out["verdict"] == "match" and "error" not in out
    else:
        assert out["verdict"] == "mismatch"
        assert out["error"]["step"] == 4 and out["error"]["rank"] == 0
        assert out["error"]["message"].startswith("rank 0: the data position was not restored: step 4, replayed "
                                                  "after the restore of iteration 3")


def test_with_warn_the_checkpointer_logs_and_trains_on(tmp_path: Path) -> None:
    _run(tmp_path, "first")
    out = _run(tmp_path, "other", mode="warn", attempt=1)
    assert out["verdict"] == "mismatch" and "error" not in out
    assert "data_check: warn, training goes on" in out["log"]


def test_the_lightning_callback_feeds_each_batch_to_the_check_except_under_megatron():
    pytest.importorskip("lightning")
    from neighbor_ckpt.lightning.callback import NeighborCheckpoint

    seen = []
    cb = NeighborCheckpoint()
    cb.checkpointer = SimpleNamespace(mark=lambda phase: None, observe_input=seen.append)
    batch = (torch.arange(6).view(2, 3), torch.zeros(2))
    cb.on_train_batch_start(None, None, batch, 0)
    assert seen == [batch]
    cb._megatron = True
    cb.on_train_batch_start(None, None, batch, 1)
    assert len(seen) == 1
