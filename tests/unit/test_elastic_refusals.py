"""Tier 1: elastic.enabled where nothing can change the data-parallel size is refused at checkpointer construction,
from configuration and environment alone (the same on every rank of a launch: no collective), and only there; the
global batch given to the checkpointer is checked before any collective; the line after a reshard states the global
batch actually used (issue 31 item 2). The job-file refusal of ``neighbor-ckpt launch`` is in test_jobspec.py."""

from __future__ import annotations

import pytest
import torch

from neighbor_ckpt.adapters import TorchOptimizerAdapter
from neighbor_ckpt.checkpointer import check_setup, elastic_cannot_shrink
from neighbor_ckpt.config import NeighborCkptConfig
from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.report.status import resize_line

TORCHRUN_ONE_AGENT = {"TORCHELASTIC_RUN_ID": "none", "GROUP_WORLD_SIZE": "1", "WORLD_SIZE": "4"}
"""``torchrun --nproc-per-node 4 script.py``: one agent, no --rdzv-id (neighbor_ckpt makes a job id per launch)."""


def elastic(**kw) -> NeighborCkptConfig:
    return NeighborCkptConfig(elastic={"enabled": True}, **kw)


def test_one_torchrun_agent_with_a_per_launch_job_id_cannot_shrink_and_says_what_to_set() -> None:
    why = elastic_cannot_shrink(elastic(), TORCHRUN_ONE_AGENT)
    assert why.startswith("nothing can shrink this job: one torchrun agent restarts every rank with the same "
                          "world size")
    assert "Set neighbor_ckpt.inprocess.enabled: true" in why and "neighbor_ckpt.job_id" in why


@pytest.mark.parametrize("config,env", [
    (elastic(inprocess={"enabled": True}), TORCHRUN_ONE_AGENT),  # in process: the survivors go on
    (elastic(job_id="grow"), TORCHRUN_ONE_AGENT),  # a later launch on fewer ranks reshards (test_elastic.py)
    (elastic(), {**TORCHRUN_ONE_AGENT, "NEIGHBOR_CKPT_JOB_ID": "grow"}),
    (elastic(), {**TORCHRUN_ONE_AGENT, "TORCHELASTIC_RUN_ID": "job-7"}),  # torchrun --rdzv-id: may be relaunched
    (elastic(), {**TORCHRUN_ONE_AGENT, "GROUP_WORLD_SIZE": "2"}),  # multi-node: --nnodes MIN:MAX re-forms smaller
    (elastic(), {"WORLD_SIZE": "4"}),  # not torchrun: the launcher is unknown
    (NeighborCkptConfig(), TORCHRUN_ONE_AGENT),  # elastic off
    (elastic(enabled=False), TORCHRUN_ONE_AGENT),
], ids=["inprocess", "config-job-id", "env-job-id", "rdzv-id", "multi-node", "no-torchrun", "elastic-off", "off"])
def test_every_path_that_can_shrink_is_left_alone(config: NeighborCkptConfig, env: dict[str, str]) -> None:
    assert elastic_cannot_shrink(config, env) == ""


def _mcore_like_adapter() -> TorchOptimizerAdapter:
    """An adapter that passes the reshardable-state check (distributed optimizer, DP shards), without megatron."""
    model = torch.nn.Linear(4, 2)
    a = TorchOptimizerAdapter(model, torch.optim.AdamW(model.parameters()))
    a.distributed_optimizer = True  # type: ignore[misc]
    a.dp_shards = lambda: {}  # type: ignore[method-assign]
    return a


def test_check_setup_refuses_it_on_every_rank_alike_before_any_collective() -> None:
    with pytest.raises(ConfigError, match="^neighbor_ckpt.elastic.enabled: nothing can shrink this job"):
        check_setup(elastic(), _mcore_like_adapter(), env=TORCHRUN_ONE_AGENT)
    assert check_setup(elastic(job_id="grow"), _mcore_like_adapter(), env=TORCHRUN_ONE_AGENT).elastic.enabled
    # the adapter's own refusal comes first, unchanged
    model = torch.nn.Linear(4, 2)
    plain = TorchOptimizerAdapter(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ConfigError, match="^neighbor_ckpt.elastic.enabled: TorchOptimizerAdapter keeps optimizer"):
        check_setup(elastic(), plain, env=TORCHRUN_ONE_AGENT)


def test_the_global_batch_given_to_the_checkpointer_is_checked_before_any_collective() -> None:
    a = _mcore_like_adapter()
    assert check_setup(None, a, global_batch=24, micro_batch_size=2, env={}) == NeighborCkptConfig()
    with pytest.raises(ConfigError, match="give global_batch= and micro_batch_size= together"):
        check_setup(None, a, global_batch=24, env={})
    with pytest.raises(ConfigError, match="global_batch=25 must be a positive multiple of micro_batch_size=2"):
        check_setup(None, a, global_batch=25, micro_batch_size=2, env={})


def test_the_line_after_a_reshard_states_the_global_batch_used_or_that_it_was_not_given() -> None:
    assert resize_line(4, 3, (24, 2)) == ("data-parallel size 4 -> 3: the global batch is 24 samples, 4 "
                                          "micro-batch(es) of 2 per rank (was 3), so a step takes about 1.33x as "
                                          "long (throughput x 0.75)")
    unknown = resize_line(4, 3, None)
    assert "unchanged" not in unknown and "not given to the checkpointer" in unknown
    assert resize_line(3, 3, (24, 2)) == "" and resize_line(None, 3, None) == ""


def test_the_plain_loop_recipe_takes_the_global_batch_from_the_job_never_from_the_world_with_elastic(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from neighbor_ckpt.recipes import mcore_gpt_plain_loop as recipe

    monkeypatch.setenv("WORLD_SIZE", "3")
    job = tmp_path / "job.yaml"
    job.write_text("trainer:\n  global_batch_size: 24\nneighbor_ckpt:\n  elastic:\n    enabled: true\n")
    on, off = elastic(), NeighborCkptConfig()
    assert recipe.job_global_batch(recipe.parse_args(["--global-batch", "24"]), on) == 24
    assert recipe.job_global_batch(recipe.parse_args(["--config", str(job)]), on) == 24
    with pytest.raises(ConfigError, match="^neighbor_ckpt.elastic.enabled needs the job's global batch"):
        recipe.job_global_batch(recipe.parse_args([]), on)
    # elastic off: the data-parallel size cannot change, and the 4-rank tests' default stays what it was
    assert recipe.job_global_batch(recipe.parse_args([]), off) == 2 * 2 * 3
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert recipe.job_global_batch(recipe.parse_args(["--tp", "2"]), off) == 2 * 2 * 2
