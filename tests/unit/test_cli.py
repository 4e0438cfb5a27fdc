"""`neighbor-ckpt inspect`: lists versions and catches corruption without unpickling anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from neighbor_ckpt.cli.main import inspect_store, main
from neighbor_ckpt.snapshot.engine import write_image
from neighbor_ckpt.snapshot.razor import StateKind, TensorMeta, plan_shards
from neighbor_ckpt.snapshot.store import ROLE_OWN, HostStore
from neighbor_ckpt.cli.launch import LAUNCHER
from neighbor_ckpt.runtime.procs import python_module_command

LAUNCHER_HEAD = python_module_command(LAUNCHER)
"""How a launcher's command line starts (this interpreter, ``-P -m`` the launcher): its own arguments follow."""


def _store_with_two_versions(tmp_path: Path) -> HostStore:
    store = HostStore(tmp_path, job_id="job", rank=3)
    t = torch.arange(100, dtype=torch.float32)
    plan = plan_shards([TensorMeta.of("w", StateKind.MAIN_PARAM, t)], dp_size=2, distributed_optimizer=True)
    for it in (7, 8):
        write_image(store, ROLE_OWN, planned=plan.unique, sources=[t + it], payload_bytes=plan.unique_bytes,
                    iteration=it, layout="L", meta={}, extras={"it": it})
    return store


def test_inspect_lists_every_committed_version_as_valid(tmp_path: Path) -> None:
    _store_with_two_versions(tmp_path)
    rows = inspect_store(tmp_path)
    assert sorted((r["iteration"], r["owner"], r["status"]) for r in rows) == [(7, 3, "valid"), (8, 3, "valid")]


def test_inspect_reports_a_flipped_byte_as_corrupt(tmp_path: Path) -> None:
    store = _store_with_two_versions(tmp_path)
    path = store.path(ROLE_OWN, 0)
    slot = store.slot(ROLE_OWN, 0)
    assert slot is not None
    off = slot.payload_off + 5
    raw = bytearray(path.read_bytes())
    raw[off] ^= 0x10
    path.write_bytes(bytes(raw))
    statuses = sorted(r["status"] for r in inspect_store(tmp_path))
    assert statuses[0].startswith("CORRUPT: ") and "payload checksum mismatch" in statuses[0]
    assert statuses[1] == "valid"


def test_inspect_cli_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _store_with_two_versions(tmp_path)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["iteration"] for r in rows} == {7, 8}


def test_cli_rejects_unknown_arguments(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path), "--bogus"])


# --- `neighbor-ckpt launch` / `demo` with in-process recovery (issue 17): what is planned, nothing runs ----------

REPO = Path(__file__).resolve().parents[2]
INPROC = ["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=1"]


def test_inprocess_launch_starts_one_launcher_per_process_each_a_simulated_node(tmp_path: Path) -> None:
    from neighbor_ckpt.cli import launch
    from neighbor_ckpt.inprocess.launcher_plan import child_env, parse_args
    from neighbor_ckpt.inprocess.protocol import ENV_STORE_TOKEN

    plan = launch.plan_launch(REPO / "configs/gpt_tiny_cpu.yaml", INPROC, run_dir=tmp_path / "run")
    assert (plan.inprocess, plan.spares, plan.processes) == (True, 1, 5)
    assert "4 ranks + 1 hot spare(s) = 5 processes" in launch.describe(plan)
    procs = launch.inprocess_processes(plan, store_port=29650,
                                       store_root=tmp_path / "shm")
    stores = ",".join(f"127.0.0.1:{29650 + i}" for i in range(5))
    assert procs.stores == stores
    assert len(procs.agents) == 5
    for i, (cmd, env) in enumerate(procs.agents):
        assert list(cmd[:len(LAUNCHER_HEAD)]) == LAUNCHER_HEAD, "the launcher runs without the cwd on sys.path"
        own = parse_args(cmd[len(LAUNCHER_HEAD):])  # the launcher reads its own command line as planned
        assert (own.node, own.first, own.count, own.processes, own.spares, own.nodes) == (f"node{i}", i, 1, 5, 1, 5)
        assert (own.store_address, own.run_id, own.max_restarts) == (stores, plan.run_id, 2)
        assert (own.host_store, own.store_listen) == (i, "127.0.0.1"), "each node hosts one store: 0 the primary"
        assert own.store_root == str(tmp_path / "shm") and not own.no_python
        assert "--inprocess-store" not in own.program, "the processes read the store list their launcher gives"
        assert dict(env)["NEIGHBOR_CKPT_NODE_ID"] == f"node{i}"  # one simulated node per launcher, its own store
        assert dict(env)["NEIGHBOR_CKPT_STORE_DIR"] == str(tmp_path / "shm" / f"node{i}")
        assert not any("nvidia_resiliency_ext" in a or "ft-restart" in a for a in cmd)
        assert not own.grow_back
        assert own.token_file == str(plan.run_dir / "store.token") == str(procs.token_file), \
            "the stores admit the holders of the run directory's token: its path on the command line, never itself"
        assert child_env(own, index=i, local_rank=0, attempt=0, launcher_pid=1)[ENV_STORE_TOKEN] == own.token_file
    with pytest.raises(AttributeError):
        plan.run_id = "other"  # type: ignore[misc]  # the plan stays frozen data
    grow = launch.plan_launch(REPO / "configs/gpt_tiny_cpu.yaml", [*INPROC, "neighbor_ckpt.inprocess.grow_back=true"],
                              run_dir=tmp_path / "run2")
    cmds = [cmd for cmd, _ in launch.inprocess_processes(grow, store_port=29650, store_root=tmp_path / "shm").agents]
    assert all(parse_args(cmd[len(LAUNCHER_HEAD):]).grow_back for cmd in cmds), "inprocess.grow_back reaches every launcher"
    assert "--grow-back" in launch.slurm_script(grow)
    script = launch.slurm_script(grow)
    made = script.index("-m neighbor_ckpt.inprocess.store_auth")
    assert made < script.index("srun ") and f"--token-file {grow.run_dir / 'store.token'}" in script, \
        "the Slurm script makes the token file once, before the launchers, and names it to each"


def test_simulated_nodes_hold_devices_ranks_each_and_the_spares_fill_spare_nodes_of_their_own() -> None:
    from neighbor_ckpt.cli.launch import simulated_nodes
    from neighbor_ckpt.errors import ConfigError

    assert simulated_nodes(4, 1) == ((0, 1), (1, 1), (2, 1), (3, 1), (4, 1)), "one node per process: as before"
    assert simulated_nodes(4, 2, 2) == ((0, 2), (2, 2), (4, 2))
    assert simulated_nodes(4, 3, 2) == ((0, 2), (2, 2), (4, 2), (6, 1)), "ceil(spares / devices) spare nodes"
    assert simulated_nodes(4, 0, 2) == ((0, 2), (2, 2))
    with pytest.raises(ConfigError, match="per node"):
        simulated_nodes(4, 0, 0)


def test_a_job_of_two_nodes_launches_one_launcher_per_node_with_its_ranks_and_a_spare_node(tmp_path: Path) -> None:
    from neighbor_ckpt.cli import launch
    from neighbor_ckpt.inprocess.launcher_plan import child_env, parse_args
    from neighbor_ckpt.inprocess.protocol import ENV_NODE_INDEX

    plan = launch.plan_launch(REPO / "configs/gpt_tiny_cpu.yaml",
                              ["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=2",
                               "trainer.num_nodes=2", "trainer.devices=2"], run_dir=tmp_path / "run")
    assert (plan.processes, plan.per_node, plan.simulated_nodes) == (6, 2, ((0, 2), (2, 2), (4, 2)))
    procs = launch.inprocess_processes(plan, store_port=29650, store_root=tmp_path / "shm")
    assert procs.stores == ",".join(f"127.0.0.1:{29650 + i}" for i in range(3)), "one store per node"
    for i, (cmd, env) in enumerate(procs.agents):
        own = parse_args(cmd[len(LAUNCHER_HEAD):])
        assert (own.node, own.first, own.count, own.processes, own.spares, own.nodes, own.host_store) == \
            (f"node{i}", 2 * i, 2, 6, 2, 3, i)
        assert dict(env)["NEIGHBOR_CKPT_STORE_DIR"] == str(tmp_path / "shm" / f"node{i}"), "the node's processes share it"
        assert child_env(own, index=2 * i + 1, local_rank=1, attempt=0, launcher_pid=1)[ENV_NODE_INDEX] == str(i)


def test_inprocess_launchers_run_the_warm_prefixed_command_as_a_whole(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    import sys

    from neighbor_ckpt.cli import launch
    from neighbor_ckpt.inprocess.launcher_plan import child_command, parse_args

    monkeypatch.setenv(launch.WORKER_PREFIX_ENV, "python3 /x/client.py")
    procs = launch.inprocess_commands(["train.py", "--steps", "3"], active=2, spares=0, max_restarts=0,
                                      run_id="r", store_port=1, store_root=tmp_path)
    own = parse_args(procs.agents[1][0][len(LAUNCHER_HEAD):])
    assert own.no_python and child_command(own) == ["python3", "/x/client.py", sys.executable, "-u", "train.py",
                                                    "--steps", "3"]


def test_restart_path_launch_is_unchanged_when_inprocess_is_off(tmp_path: Path) -> None:
    from neighbor_ckpt.cli import launch
    from neighbor_ckpt.errors import ConfigError

    plan = launch.plan_launch(REPO / "configs/gpt_tiny_cpu.yaml", run_dir=tmp_path)
    assert (plan.inprocess, plan.spares, plan.processes) == (False, 0, 4)
    cmd = launch.torchrun_command(plan)
    head = python_module_command("torch.distributed.run")
    assert cmd[:len(head)] == head and "--inprocess-store" not in cmd
    assert "under torchrun" in launch.describe(plan)
    with pytest.raises(ConfigError, match="does not enable neighbor_ckpt.inprocess"):
        launch.inprocess_processes(plan, store_port=1, store_root=tmp_path)


def test_inprocess_without_neighbor_snapshots_is_refused(tmp_path: Path) -> None:
    from neighbor_ckpt.cli import launch
    from neighbor_ckpt.errors import ConfigError

    with pytest.raises(ConfigError, match="neighbor_ckpt.enabled is false"):
        launch.plan_launch(REPO / "configs/gpt_tiny_cpu.yaml", [*INPROC, "neighbor_ckpt.enabled=false"],
                           run_dir=tmp_path)


def test_launch_dry_run_prints_one_launcher_per_process_each_hosting_a_store(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", str(REPO / "configs/gpt_tiny_cpu.yaml"), *INPROC, "--run-dir", str(tmp_path),
                 "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 5 and all("-m neighbor_ckpt.inprocess.launcher" in line for line in lines)
    assert [line.split("--node ")[1].split()[0] for line in lines] == [f"node{i}" for i in range(5)]
    assert [line.split("--host-store ")[1].split()[0] for line in lines] == [str(i) for i in range(5)]


def test_demo_inprocess_plans_the_restart_and_the_inprocess_runs_of_the_same_kill(tmp_path: Path) -> None:
    from neighbor_ckpt.cli import demo

    # the in-process run with a hot spare is the default; --inprocess (the old switch) still means the same
    for extra in ([], ["--inprocess"]):
        plans = demo.demo_plans(demo.parse_args([*extra, "--out", str(tmp_path), "trainer.max_steps=8"]))
        assert sorted(plans) == ["baseline", "faulted", "inprocess"]
        assert [plans[k].inprocess for k in ("baseline", "faulted", "inprocess")] == [False, False, True]
        assert plans["inprocess"].processes == 5 and plans["inprocess"].record
        for k in ("faulted", "inprocess"):
            fi = plans[k].job.neighbor_ckpt.fault_injection
            assert (fi.enabled, fi.rank, fi.step, fi.phase) == (True, 1, 5, "optimizer")
        assert not plans["baseline"].job.neighbor_ckpt.fault_injection.enabled
        assert all(plans[k].job.trainer.max_steps == 8 for k in plans)
    # the short form: the restart path alone
    assert sorted(demo.demo_plans(demo.parse_args(["--restart-only", "--out", str(tmp_path)]))) == \
        ["baseline", "faulted"]
    with pytest.raises(SystemExit):
        demo.parse_args(["--restart-only", "--inprocess"])


def test_an_inprocess_launch_succeeds_when_only_a_lost_nodes_launcher_died() -> None:
    from neighbor_ckpt.cli.launch import launch_status

    assert launch_status([0, 0, 0, 0]) == 0
    assert launch_status([0, -9, 0, 0]) == 0  # a node gone for good (SIGKILL of its launcher), the survivors finished
    assert launch_status([0, -9, -9, 0]) == 0, "two nodes of four lost, the others finished the job (elastic)"
    assert launch_status([-9, -9]) == -9, "nobody finished the job"
    assert launch_status([0, 1, 0, 0]) == 1 and launch_status([0, -15, 0, 0]) == -15
    assert launch_status([0, 68, 0, 0]) == 0, "a launcher that reached no store: the others finished the job"
    assert launch_status([68, 68]) == 68, "nobody finished the job"
    assert launch_status([0, 79, 0, -9]) == 0, "a partition's minority cut itself off, the majority finished"
    assert launch_status([79, 79, 79]) == 79, "nobody finished the job"


def test_worker_prefix_runs_every_worker_under_the_command_and_a_bad_one_is_a_config_error() -> None:
    import sys

    from neighbor_ckpt.cli.launch import WORKER_PREFIX_ENV, worker_program
    from neighbor_ckpt.errors import ConfigError

    assert worker_program(["train.py", "--steps", "3"], env={}) == ([], ["train.py", "--steps", "3"])
    options, program = worker_program(["train.py"], env={WORKER_PREFIX_ENV: "numactl -N 0 'nsys profile'"})
    assert options == ["--no-python"]
    assert program == ["numactl", "-N", "0", "nsys profile", sys.executable, "-u", "train.py"]
    with pytest.raises(ConfigError, match=f"{WORKER_PREFIX_ENV}=.*is not a command line"):
        worker_program(["train.py"], env={WORKER_PREFIX_ENV: "numactl 'unbalanced"})


# --- job files shipped with the package (issue 27): by bare name or checkout path from anywhere --------------------


def test_a_shipped_job_file_is_found_by_its_bare_name_or_checkout_path_from_any_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from neighbor_ckpt.cli import launch
    from neighbor_ckpt.recipes import CONFIGS_DIR, RECIPES_DIR

    monkeypatch.chdir(tmp_path)  # no configs/ here
    shipped = CONFIGS_DIR / "gpt_tiny_cpu.yaml"
    for name in ("gpt_tiny_cpu", "gpt_tiny_cpu.yaml", "configs/gpt_tiny_cpu.yaml"):
        assert launch.resolve_config(name) == shipped
        plan = launch.plan_launch(name, ["trainer.max_steps=3"], run_dir=tmp_path / "run")
        assert plan.job.name == "gpt_tiny_cpu" and plan.job.trainer.max_steps == 3
        assert plan.recipe == RECIPES_DIR / "nemo_pretrain.py" and plan.recipe.is_file()
    assert main(["plan", "llama3_8b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 16
    own = tmp_path / "gpt_tiny_cpu.yaml"  # a file of the name where the user is: that one, not the shipped one
    own.write_text(shipped.read_text().replace("name: gpt_tiny_cpu", "name: mine"))
    assert launch.plan_launch("gpt_tiny_cpu.yaml", run_dir=tmp_path / "run").job.name == "mine"


def test_a_missing_job_file_elsewhere_is_an_error_naming_the_shipped_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from neighbor_ckpt.cli import launch
    from neighbor_ckpt.errors import ConfigError

    for missing in (tmp_path / "gpt_tiny_cpu.yaml", Path("elsewhere/gpt_tiny_cpu.yaml"), Path("no_such_job")):
        with pytest.raises(ConfigError, match="no such config file .*gpt_tiny_cpu, llama3_70b"):
            launch.plan_launch(missing, run_dir=tmp_path / "run")
    assert main(["launch", str(tmp_path / "x.yaml"), "--dry-run"]) == 2
    assert "no such config file" in capsys.readouterr().err


def test_the_installed_command_has_no_benchmark_or_campaign() -> None:
    for tool in ("bench", "campaign"):
        with pytest.raises(SystemExit):
            main([tool])
