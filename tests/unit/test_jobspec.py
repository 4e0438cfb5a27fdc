"""Tier 1: job files in configs/ and the checks that run before any process starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from neighbor_ckpt.errors import ConfigError
from neighbor_ckpt.planning.jobspec import JobSpec, apply_overrides, load_job

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_the_five_shipped_configs_exist() -> None:
    assert {p.stem for p in CONFIGS} >= {"gpt_tiny_cpu", "llama_tiny_cpu", "llama3_8b", "llama3_70b", "gpt3_175b"}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_validates_and_round_trips(path: Path, tmp_path: Path) -> None:
    job = load_job(path)
    assert job.data_parallel >= 1
    again = tmp_path / "resolved.yaml"
    again.write_text(job.to_yaml())
    assert load_job(again) == job


def test_overrides_set_nested_values_parsed_as_yaml() -> None:
    job = load_job(REPO / "configs/gpt_tiny_cpu.yaml",
                   ["trainer.max_steps=20", "neighbor_ckpt.transport.enabled=false", "neighbor_ckpt.job_id=x1",
                    "data.paths=[a, b]", "data.kind=indexed"])
    assert job.trainer.max_steps == 20
    assert job.neighbor_ckpt.transport.enabled is False
    assert job.neighbor_ckpt.job_id == "x1"
    assert job.data.paths == ["a", "b"]


def test_overrides_do_not_modify_the_document() -> None:
    doc = {"trainer": {"max_steps": 3}}
    assert apply_overrides(doc, ["trainer.max_steps=4"]) == {"trainer": {"max_steps": 4}}
    assert doc == {"trainer": {"max_steps": 3}}


BAD = {
    "unknown top-level key": (["trainr.max_steps=3"], "config.trainr: unknown key"),
    "unknown nested key": (["neighbor_ckpt.transport.chunk_mbb=4"], "config.neighbor_ckpt.transport.chunk_mbb: unknown key"),
    "wrong type": (["trainer.max_steps=many"], "config.trainer.max_steps: expected an integer, got 'many'"),
    "value outside its set": (["neighbor_ckpt.ring.policy=random"], "config.neighbor_ckpt.ring.policy: 'random' is not allowed (allowed values: 'cross_node', 'next')"),
    "bad neighbor_ckpt value": (["neighbor_ckpt.store.versions=1"], "config.neighbor_ckpt.store.versions: 1 must be >= 2"),
    "TP x PP does not divide the world": (["parallelism.tensor=3"], "tensor x pipeline x context = 3 x 1 x 1 = 3 does not divide the world size"),
    "pipeline does not divide the layers": (["parallelism.pipeline=4"], "config.parallelism.pipeline: 4 does not divide model.num_layers = 2"),
    "batch not divisible by micro x DP": (["trainer.global_batch_size=6"], "config.trainer.global_batch_size: 6 is not a multiple of micro_batch_size x data-parallel size = 2 x 4"),
    "heads not divisible by TP": (["trainer.devices=3", "parallelism.tensor=3", "trainer.global_batch_size=2"], "config.parallelism.tensor: 3 does not divide the attention heads"),
    "bf16 on cpu": (["trainer.precision=bf16-mixed"], "config.trainer.precision: 'bf16-mixed' on accelerator cpu"),
    "override without =": (["trainer.max_steps"], "expected key.path=value"),
    "override into a value": (["trainer.max_steps.x=1"], "trainer.max_steps is not a section"),
    "unknown preset": (["model.preset=gpt5"], "config.model.preset: 'gpt5' is not allowed"),
    "a full-size model on cpu": (["model.preset=llama3_8b", "parallelism.pipeline=1"], "config.model.preset: 'llama3_8b' needs trainer.accelerator gpu"),
    "expert parallelism on a dense model": (["parallelism.expert=2"], "config.parallelism.expert: expert parallelism needs a mixture-of-experts model"),
    "EP does not divide the experts": (["model.num_moe_experts=3", "parallelism.expert=2"], "config.parallelism.expert: 2 does not divide model.num_moe_experts = 3"),
    "expert layout does not divide the world": (["model.num_moe_experts=8", "parallelism.expert=8"], "config.parallelism.expert: expert_tensor x expert x pipeline = 1 x 8 x 1 = 8 does not divide the world size 4"),
    "MoE with TP and no sequence parallelism": (["model.num_moe_experts=4", "parallelism.expert=2", "parallelism.tensor=2"], "config.parallelism.sequence_parallel: mixture of experts with tensor > 1 needs sequence_parallel: true"),
    "in process without the detector": (["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.detector.enabled=false"], "config.neighbor_ckpt.detector.enabled: false is refused with in-process recovery (inprocess.enabled: true): the detector is what notices failures in process"),
    "in process without the hang clock": (["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.detector.hang_timeout_s=null"], "config.neighbor_ckpt.detector.hang_timeout_s: null (off) is refused with in-process recovery"),
    "in-process barrier below the abort watchdog": (["neighbor_ckpt.inprocess.barrier_timeout_s=5"], "config.neighbor_ckpt.inprocess.barrier_timeout_s: 5.0 must exceed inprocess.abort_timeout_s (10.0)"),
    "top-k above the experts": (["model.num_moe_experts=2", "model.moe_router_topk=3"], "config.model.moe_router_topk: 3 is more than num_moe_experts = 2"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_config_gives_one_clear_line_per_problem(case: str) -> None:
    overrides, expected = BAD[case]
    with pytest.raises(ConfigError) as e:
        load_job(REPO / "configs/gpt_tiny_cpu.yaml", overrides)
    lines = str(e.value).splitlines()
    assert any(expected in line for line in lines), lines
    assert all(line.startswith(("config.", "override ")) for line in lines), lines


def test_a_job_file_with_three_problems_reports_three_lines_with_their_key_paths(tmp_path: Path) -> None:
    doc = yaml.safe_load((REPO / "configs/gpt_tiny_cpu.yaml").read_text())
    doc["trainer"]["max_steps"] = "many"  # a type problem, found while reading
    doc["launch"]["max_restartz"] = 2  # an unknown key, found while reading
    doc["neighbor_ckpt"]["detector"] = {"interval_s": 0}  # a range problem, found by the section's rules
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(ConfigError) as e:
        load_job(bad)
    lines = str(e.value).splitlines()
    assert len(lines) == 3, lines
    assert lines[0] == "config.trainer.max_steps: expected an integer, got 'many'"
    assert lines[1].startswith("config.launch.max_restartz: unknown key (allowed keys of config.launch: log_dir, ")
    assert lines[2] == "config.neighbor_ckpt.detector.interval_s: 0.0 must be > 0"


def test_overrides_add_their_problems_to_the_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_job(REPO / "configs/gpt_tiny_cpu.yaml", ["trainer.max_steps=-1", "neighbor_ckpt.store.versions=1",
                                                      "model.num_layers=3", "parallelism.pipeline=2",
                                                      "trainer.devices=8"])
    assert str(e.value).splitlines() == [
        "config.trainer.max_steps: -1 must be >= 1",
        "config.neighbor_ckpt.store.versions: 1 must be >= 2",
        "config.parallelism.pipeline: 2 does not divide model.num_layers = 3",
    ]


def test_a_rule_across_sections_waits_for_the_keys_it_reads() -> None:
    """tensor=0 is one problem; the rules that divide by it (world size, heads) do not run and add nothing."""
    with pytest.raises(ConfigError) as e:
        load_job(REPO / "configs/gpt_tiny_cpu.yaml", ["parallelism.tensor=0"])
    assert str(e.value) == "config.parallelism.tensor: 0 must be >= 1"


def test_the_planners_model_rules_apply_to_the_model_section_under_its_key_paths() -> None:
    with pytest.raises(ConfigError) as e:
        load_job(REPO / "configs/gpt_tiny_cpu.yaml", ["model.hidden_size=66", "hardware.mfu=1.5"])
    assert str(e.value).splitlines() == [
        "config.model.hidden_size: 66 is not divisible by num_attention_heads = 4",
        "config.hardware.mfu: 1.5 must be a positive finite number <= 1.0",
    ]


def test_the_command_prints_one_line_per_problem_and_exits_2_before_starting_anything(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "neighbor_ckpt.cli", "launch", str(REPO / "configs/gpt_tiny_cpu.yaml"),
                           "parallelism.tensor=3", "trainer.max_steps=-1", "neighbor_ckpt.store.versions=1",
                           "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("neighbor-ckpt: error: "))
    problems = [lines[first].removeprefix("neighbor-ckpt: error: ")] + lines[first + 1:]
    assert [line.split(":")[0] for line in problems] == [
        "config.trainer.max_steps", "config.neighbor_ckpt.store.versions", "config.parallelism",
        "config.parallelism.tensor"], proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_missing_or_malformed_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_job(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job(bad)
    bad.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_job(bad)


def test_defaults_alone_are_a_valid_job() -> None:
    assert JobSpec().world_size == 8


def test_slurm_script_runs_one_torchrun_per_node_with_c10d_rendezvous(tmp_path: Path) -> None:
    from neighbor_ckpt.cli import launch as runner

    plan = runner.plan_launch(REPO / "configs/llama3_70b.yaml", ["launch.slurm_partition=batch"],
                              run_dir=tmp_path / "run")
    script = runner.slurm_script(plan)
    assert "#SBATCH --nodes=16" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --partition=batch" in script
    assert "--nnodes=16 --nproc-per-node=8 --max-restarts=10" in script
    assert '--rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:29500"' in script
    assert f"--rdzv-id={plan.run_id}" in script and plan.run_id == plan.job.neighbor_ckpt.job_id
    assert str(tmp_path / "run" / "config.yaml") in script
    proc = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_each_launch_gets_its_own_job_id_unless_the_file_sets_one(tmp_path: Path) -> None:
    from neighbor_ckpt.cli import launch as runner

    plan = runner.plan_launch(REPO / "configs/gpt_tiny_cpu.yaml", run_dir=tmp_path)
    assert plan.run_id.startswith("gpt_tiny_cpu-")
    plan = runner.plan_launch(REPO / "configs/gpt_tiny_cpu.yaml", ["neighbor_ckpt.job_id=fixed"], run_dir=tmp_path)
    assert plan.run_id == "fixed"
    cmd = runner.torchrun_command(plan)
    assert "--rdzv-id=fixed" in cmd and "--nproc-per-node=4" in cmd and "--max-restarts=2" in cmd
    runner.write_run_dir(plan)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["neighbor_ckpt"]["job_id"] == "fixed"


def test_plan_of_llama3_70b_matches_a_hand_computation() -> None:
    """configs/llama3_70b.yaml: 80 layers, hidden 8192, FFN 28672 (SwiGLU), 64 heads, 8 KV groups, head dim 128,
    vocab 128256, untied; TP 4, PP 4, CP 2 on 16 x 8 GPUs -> DP 4; distributed optimizer over DP x CP = 8."""
    h, f, v, tp = 8192, 28672, 128256, 4
    per_layer = (h * (64 + 2 * 8) * 128 + h * h + h * 2 * f + f * h) // tp + 2 * h  # norms replicated over TP
    middle = 20 * per_layer
    first = middle + v * h // tp
    last = middle + h + v * h // tp
    proc = subprocess.run([sys.executable, "-m", "neighbor_ckpt.cli", "plan", str(REPO / "configs/llama3_70b.yaml"),
                           "--json"], capture_output=True, text=True, cwd=REPO, check=True)
    import json

    plan = json.loads(proc.stdout)
    rows = {c["kind"]: c for c in plan["classes"]}
    assert plan["world_size"] == 128 and plan["parallel"]["dp"] == 4
    for kind, params in (("first", first), ("middle", middle), ("last", last)):
        row = rows[kind]
        assert row["params_per_rank"] == params
        assert row["unique_payload_bytes"] == 12 * params // (4 * 2)  # fp32 main + exp_avg + exp_avg_sq / (DP x CP)
        payload = row["unique_payload_bytes"]
        assert row["unique_bytes"] == payload + 65_536  # the store's smallest extras region (64 KiB) travels too
        # one slot file: 64 B preamble + 1 MiB header allowance rounded up to a 4 KiB page (1,052,672), the payload
        # rounded up to 64 B, the 64 KiB extras region, a 64 B commit marker; 2 own + 2 replica versions
        assert row["host_memory_bytes"] == 4 * (1_052_672 + -(-payload // 64) * 64 + 65_536 + 64)
        assert row["d2h_seconds"] == pytest.approx(row["unique_bytes"] / 50e9)  # H100 PCIe preset
        assert row["network_seconds"] == pytest.approx(row["unique_bytes"] * 8 / 400e9)  # 400 Gb/s per GPU
        tokens = 1 * (512 // (1 * 4)) * 8192 // 2  # micro x grad-accum x seq / CP
        assert row["compute_seconds"] == pytest.approx(6 * params * tokens / (989e12 * 0.4))
        assert row["hides"] is True
    assert sum(rows[k]["ranks"] for k in rows) == 128
    text = subprocess.run([sys.executable, "-m", "neighbor_ckpt.cli", "plan", str(REPO / "configs/llama3_70b.yaml")],
                          capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert "first" in text and "middle" in text and "last" in text and "FCR" in text


def test_plan_of_mixtral_8x7b_matches_a_hand_computation_of_dense_and_expert_unique_bytes() -> None:
    """configs/mixtral_8x7b.yaml: 32 layers, hidden 4096, FFN 14336 (SwiGLU) per expert, 32 heads, 8 KV groups, head dim
    128, vocab 32000, untied, RMSNorm, no biases, 8 experts top-2; TP 2 x PP 4 x EP 8, expert TP 1 on 16 x 8 GPUs
    -> dense DP = 128 / (2 x 4) = 16, expert DP = 128 / (1 x 8 x 4) = 4."""
    h, f, v, tp, experts = 4096, 14336, 32000, 2, 8
    attention = (h * (32 + 2 * 8) * 128 + h * h) // tp  # linear_qkv + linear_proj, split over TP
    dense_layer = attention + 2 * h + experts * h  # 2 RMSNorms + the router (8 x 4096, fp32), whole on every TP rank
    assert dense_layer == 21_012_480
    dense_middle = 8 * dense_layer  # 32 layers / PP 4
    dense_first = dense_middle + v * h // tp  # the vocab-parallel word embedding
    dense_last = dense_middle + h + v * h // tp  # final RMSNorm + the untied output layer
    expert_layer = experts // 8 * (2 * f * h + f * h)  # EP 8: one whole expert (fc1 SwiGLU + fc2) per layer per rank
    expert = 8 * expert_layer
    assert expert == 1_409_286_144
    proc = subprocess.run([sys.executable, "-m", "neighbor_ckpt.cli", "plan", str(REPO / "configs/mixtral_8x7b.yaml"),
                           "--json"], capture_output=True, text=True, cwd=REPO, check=True)
    import json

    plan = json.loads(proc.stdout)
    assert plan["world_size"] == 128 and plan["parallel"]["dp"] == 16 and plan["parallel"]["ep"] == 8
    assert plan["rings"]["dense"]["size"] == 16 and plan["rings"]["expert"]["size"] == 4
    rows = {c["kind"]: c for c in plan["classes"]}
    for kind, dense in (("first", dense_first), ("middle", dense_middle), ("last", dense_last)):
        row = rows[kind]
        assert (row["dense_params_per_rank"], row["expert_params_per_rank"]) == (dense, expert)
        assert row["params_per_rank"] == dense + expert
        # fp32 main param + exp_avg + exp_avg_sq of this rank's shard: dense over DP 16, experts over expert-DP 4
        assert row["dense_unique_bytes"] == 12 * -(-dense // 16)
        assert row["expert_unique_bytes"] == 12 * (expert // 4) == 4_227_858_432
        assert row["staged_bytes"] == 0  # Mixtral balances with the aux loss: no expert_bias buffer
        assert row["unique_payload_bytes"] == row["dense_unique_bytes"] + row["expert_unique_bytes"]
        assert row["lazy_backup_bytes"] == 0
        # active params: the dense ones, and top-2 of 8 experts of tokens gathered from the 8-rank expert group,
        # each rank one whole expert (ETP 1) out of TP 2: 2 x 8 x 1 / (8 x 2) = 1 x the local expert params
        tokens = 1 * (512 // (1 * 16)) * 4096
        assert row["compute_seconds"] == pytest.approx(6 * (dense + expert) * tokens / (989e12 * 0.4))
    assert rows["middle"]["dense_unique_bytes"] == 12 * dense_middle // 16 == 126_074_880
    assert sum(rows[k]["ranks"] for k in rows) == 128
    text = subprocess.run([sys.executable, "-m", "neighbor_ckpt.cli", "plan", str(REPO / "configs/mixtral_8x7b.yaml")],
                          capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert "dense/iter" in text and "expert/iter" in text
    assert "rings: dense over dp x cp = 16 ranks, expert over expert-dp = 4 ranks" in text


def test_plan_warns_when_the_store_does_not_fit_in_host_memory() -> None:
    proc = subprocess.run([sys.executable, "-m", "neighbor_ckpt.cli", "plan", str(REPO / "configs/llama3_70b.yaml"),
                           "hardware.shm_gb=64"], capture_output=True, text=True, cwd=REPO, check=True)
    assert "WARNING" in proc.stdout and "shm" in proc.stdout.lower(), proc.stdout


def test_launching_a_multi_node_job_from_one_shell_is_refused_with_the_way_out(tmp_path: Path) -> None:
    from neighbor_ckpt.cli import launch as runner

    plan = runner.plan_launch(REPO / "configs/llama3_8b.yaml", run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=r"config.trainer.num_nodes: 2 GPU nodes cannot run from one shell .*; use "
                                          r"`neighbor-ckpt launch CONFIG --slurm FILE`"):
        runner.run_local(plan)
    assert not (tmp_path / "run").exists()


def test_elastic_without_in_process_recovery_cannot_shrink_a_one_node_launch_and_is_refused_naming_the_key() -> None:
    """One torchrun agent runs every rank of a node and restarts them together: with one node, a rank lost for good
    stops the job, so elastic there is refused with the keys to set; with several nodes the others go on without a
    lost one (``--nnodes 1:N``), and in process the survivors go on."""
    with pytest.raises(ConfigError) as e:
        load_job(REPO / "configs/gpt_tiny_cpu.yaml", ["neighbor_ckpt.elastic.enabled=true"])
    assert str(e.value).splitlines() == [
        "config.neighbor_ckpt.elastic.enabled: cannot shrink this launch: without in-process recovery one torchrun "
        "agent runs every rank of a node and restarts them together, so with one node a rank lost for good stops the "
        "job; set neighbor_ckpt.inprocess.enabled: true (the survivors go on with fewer ranks), run several nodes "
        "(trainer.num_nodes > 1: the others go on without a lost one), or turn elastic off"]
    job = load_job(REPO / "configs/gpt_tiny_cpu.yaml", ["neighbor_ckpt.elastic.enabled=true",
                                                        "neighbor_ckpt.inprocess.enabled=true"])
    assert job.neighbor_ckpt.elastic.enabled and job.neighbor_ckpt.inprocess.enabled
    job = load_job(REPO / "configs/gpt_tiny_cpu.yaml", ["neighbor_ckpt.elastic.enabled=true", "trainer.num_nodes=2",
                                                        "trainer.devices=2"])
    assert job.neighbor_ckpt.elastic.enabled and not job.neighbor_ckpt.inprocess.enabled


def test_launch_refuses_elastic_without_in_process_before_any_process_starts(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "neighbor_ckpt.cli", "launch", str(REPO / "configs/gpt_tiny_cpu.yaml"),
                           "neighbor_ckpt.elastic.enabled=true", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert "neighbor-ckpt: error: config.neighbor_ckpt.elastic.enabled: cannot shrink this launch" in proc.stderr
    assert "set neighbor_ckpt.inprocess.enabled: true" in proc.stderr
    assert not (tmp_path / "run").exists()
