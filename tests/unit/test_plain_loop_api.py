"""The plain-loop API as a new user meets it: per-step calls made before ``recover()`` raise a CallOrderError that says
what to call first, and a failure-free loop in a script that configured no logging shows the status line on rank 0
every 10 steps (the plain-loop default): one single-rank gloo job in a subprocess (a process group per process). A
config changed after construction is checked when the checkpointer takes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from neighbor_ckpt import NeighborCkptConfig
from neighbor_ckpt.checkpointer import NeighborCheckpointer
from neighbor_ckpt.errors import ConfigError

_JOB = r"""
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from neighbor_ckpt import NeighborCkptConfig
from neighbor_ckpt.adapters import TorchOptimizerAdapter
from neighbor_ckpt.checkpointer import NeighborCheckpointer
from neighbor_ckpt.errors import CallOrderError

tmp = Path(sys.argv[1])  # no logging configuration at all: what a plain training script often has
dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
model = torch.nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt = NeighborCheckpointer(NeighborCkptConfig(store={"dir": str(tmp / "store")}),
                            adapter=TorchOptimizerAdapter(model, opt), handle_sigterm=False)
errors = {}
for name, call in (("snapshot", lambda: ckpt.snapshot(0)), ("wait", ckpt.wait),
                   ("optimizer_step", lambda: ckpt.optimizer_step().__enter__())):
    try:
        call()
        errors[name] = None
    except CallOrderError as e:
        errors[name] = str(e)
res = ckpt.recover()
for step in range(res.next_step, 25):
    loss = model(torch.randn(3, 4)).square().mean()
    ckpt.wait(); loss.backward()
    with ckpt.optimizer_step():
        opt.step()
    opt.zero_grad()
    ckpt.snapshot(step)
ckpt.close()
print("RESULT " + json.dumps({"errors": errors, "restored": res.restored}))
dist.destroy_process_group()
"""


def test_calls_before_recover_raise_and_a_plain_loop_shows_its_status_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "NEIGHBOR_CKPT_"))}
    env["PYTHONPATH"] = str(Path(__file__).parents[2])
    proc = subprocess.run([sys.executable, "-c", _JOB, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))

    assert out["restored"] is False
    for name, call in (("snapshot", "snapshot()"), ("wait", "wait()"), ("optimizer_step", "optimizer_step()")):
        assert out["errors"][name] == (
            f"rank 0: {call} was called before recover(): call ckpt.recover() on every rank after building the "
            "NeighborCheckpointer and before the first training step (it restores the latest snapshot, or tells you "
            "to start fresh); a snapshot taken first would be taken for this job's latest state at the next recovery")

    status = [x for x in proc.stderr.splitlines() if x.startswith("neighbor_ckpt: step ")]
    assert [x.split(" | ")[0] for x in status] == ["neighbor_ckpt: step 10", "neighbor_ckpt: step 20"], proc.stderr
    assert "ms wait" in status[0] and "unique/rank" in status[0] and "replica off" in status[0]
    assert "host store" in status[0]


def test_the_checkpointer_checks_a_config_changed_after_construction() -> None:
    """Attributes set after construction are checked when the checkpointer takes the config (before any collective),
    with the same key-path lines."""
    cfg = NeighborCkptConfig()
    cfg.job_id = 5  # type: ignore[assignment]
    cfg.store.versions = 1
    with pytest.raises(ConfigError) as ei:
        NeighborCheckpointer(cfg, adapter=None)  # type: ignore[arg-type]
    assert str(ei.value).splitlines() == ["neighbor_ckpt.job_id: expected a string, got 5",
                                          "neighbor_ckpt.store.versions: 1 must be >= 2"]
    with pytest.raises(ConfigError, match="^NeighborCheckpointer expects a NeighborCkptConfig, got dict"):
        NeighborCheckpointer({"store": {"dir": "/x"}}, adapter=None)  # type: ignore[arg-type]


def test_elastic_needs_state_that_can_be_resharded() -> None:
    """``elastic.enabled`` with an adapter whose optimizer state cannot be re-partitioned for another DP size (a torch
    optimizer, replicated) is refused when the checkpointer is built, before any collective."""
    import torch

    from neighbor_ckpt.adapters import TorchOptimizerAdapter

    model = torch.nn.Linear(4, 2)
    adapter = TorchOptimizerAdapter(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ConfigError, match="^neighbor_ckpt.elastic.enabled: TorchOptimizerAdapter keeps optimizer "
                                          "state that cannot be re-partitioned"):
        NeighborCheckpointer(NeighborCkptConfig(elastic={"enabled": True}), adapter=adapter)
