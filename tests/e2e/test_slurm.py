"""End to end under a real Slurm: the script ``neighbor-ckpt launch --slurm`` writes is submitted with ``sbatch``
to a single-node Slurm on this machine (munged, slurmctld and slurmd started by the ``slurm_cluster`` fixture,
tests/e2e/slurm_cluster.py). The tiny GPT recipe (``configs/gpt_tiny_cpu.yaml``, 10 steps, in-process recovery) on
2 simulated nodes of 2 ranks and a spare node (one Slurm task per simulated node, each our per-node launcher with its
node's processes) loses node 1 whole in step 5; the spare node takes its ranks inside the same Slurm job, node 0's
processes keep theirs, and every per-step loss, the final weights and the optimizer state equal the failure-free
``neighbor-ckpt launch`` run bit for bit. (One task per rank, the form of a job of one rank per node, is the same
script with ``--count 1``: checked as text below; it ran live here until CI time ran short, as the restart-mode
script did until commit 3b6ca7a.) The restart-mode script (torchrun under srun, restarting the worker group in the
allocation) is checked as text, with the GPU scripts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, Baselines, RunResult, assert_same_training, free_ports, job_env, run_logged
from tests.e2e.slurm_cluster import SlurmCluster

e2e = pytest.mark.e2e
pytestmark = pytest.mark.cold  # srun starts the workers cold, as on a cluster (not forked from the warm zygote)

CONFIG = "gpt_tiny_cpu.yaml"
STEPS = "trainer.max_steps=10"


def sbatch_launch(cluster: SlurmCluster, tmp: Path, *overrides: str, timeout: float = 900,
                  **env: Any) -> tuple[RunResult, str, str]:
    """``neighbor-ckpt launch configs/<CONFIG> OVERRIDES --record --slurm job.sbatch``, then ``sbatch --wait``;
    returns the job's result (log: the job's ``slurm-<id>.out``), the Slurm job id and the script."""
    tmp.mkdir(parents=True, exist_ok=True)
    run_dir, script, out = tmp / "run", tmp / "job.sbatch", tmp / "run" / "record"
    # rdzv_port: the script's fixed c10d port would collide with other tests' jobs on this machine; the in-process
    # script's store host takes the next port
    write = subprocess.run([sys.executable, "-m", "neighbor_ckpt.cli", "launch", str(REPO / "configs" / CONFIG),
                            *overrides, f"launch.rdzv_port={free_ports(6)}", "--run-dir", str(run_dir), "--record",
                            "--slurm", str(script)], capture_output=True, text=True, cwd=tmp, timeout=300)
    assert write.returncode == 0, write.stdout + write.stderr
    res, job_id = sbatch_wait(cluster, script, tmp, out, run_dir, timeout=timeout, env=job_env(tmp, out, env))
    return res, job_id, script.read_text()


def sbatch_wait(cluster: SlurmCluster, script: Path, tmp: Path, out: Path, run_dir: Path, *, timeout: float,
                env: dict[str, str]) -> tuple[RunResult, str]:
    """``sbatch --wait`` of ``script``; the job's result (log: its ``run_dir/slurm-<id>.out``) and its id."""
    try:
        sub = run_logged(["sbatch", "--wait", "--parsable", str(script)], tmp, out, timeout=timeout,
                         env=cluster.env(env))
    finally:
        cluster.cancel_all()
    job_id = sub.log.strip().splitlines()[0].split(";")[0] if sub.log.strip() else ""
    assert job_id.isdigit(), f"sbatch did not submit: {sub.log}\n{cluster.logs()}"
    slurm_out = run_dir / f"slurm-{job_id}.out"
    log = slurm_out.read_text() if slurm_out.exists() else f"(no {slurm_out})\n{cluster.logs()}"
    return RunResult(sub.returncode, out, log), job_id


INPROCESS = ["neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=1"]


def _attempts(res: RunResult) -> dict[int, list[dict[str, Any]]]:
    """Initial rank -> the in-process attempts that process ran (pid, rank, iteration), by iteration."""
    by_proc: dict[int, list[dict[str, Any]]] = {}
    for p in sorted(res.out.glob("attempt.initial*.iter*.json")):
        a = json.loads(p.read_text())
        by_proc.setdefault(a["initial_rank"], []).append(a)
    return {r: sorted(v, key=lambda a: a["iteration"]) for r, v in by_proc.items()}


@e2e
def test_slurm_script_inprocess_two_nodes_of_two_ranks_and_a_spare_node_lose_node_1_whole_bit_exactly(
        slurm_cluster: SlurmCluster, baseline: Baselines, tmp_path: Path) -> None:
    """``trainer.num_nodes=2 trainer.devices=2`` + 2 spares on the one-node test cluster: one task per simulated node
    of 2 processes (``--count 2``), a spare node; node 1 lost whole in step 5 (``fault_injection.target: node``): one
    decision declares both its processes, the spare node takes ranks 2 and 3, bit for bit."""
    pytest.importorskip("nemo.collections.llm")
    base = baseline.launch(CONFIG, STEPS, warm=True)
    res, job_id, script = sbatch_launch(
        slurm_cluster, tmp_path, STEPS, "trainer.num_nodes=2", "trainer.devices=2",
        "neighbor_ckpt.inprocess.enabled=true", "neighbor_ckpt.inprocess.spares=2",
        "neighbor_ckpt.fault_injection.enabled=true", "neighbor_ckpt.fault_injection.target=node",
        "neighbor_ckpt.fault_injection.node=1", "neighbor_ckpt.fault_injection.step=5",
        NEIGHBOR_CKPT_STORE_DIR=tmp_path / "store")
    assert res.returncode == 0, f"Slurm job {job_id} failed (sbatch --wait exit {res.returncode}):\n{res.log[-8000:]}"
    assert "#SBATCH --ntasks=3" in script and "FIRST=$((SLURM_PROCID * 2))" in script, script
    assert_same_training(base, res)
    assert "node node1 is lost: process 3 sent no heartbeat for" in res.log, res.log[-6000:]
    assert "declaring its process(es) [2, 3] dead together" in res.log
    procs = _attempts(res)
    for initial in (0, 1):  # node 0's processes: same process, same rank, through the recovery
        its = procs[initial]
        assert [a["iteration"] for a in its] == [0, 1] and len({a["pid"] for a in its}) == 1, its
        assert {a["rank"] for a in its} == {initial}, its
    assert sorted((procs[p][0]["iteration"], procs[p][0]["rank"]) for p in (4, 5)) == [(1, 2), (1, 3)], procs
    for r in (2, 3):  # the spare node's store is empty (another simulated node): node 1's state from replicas
        rep = res.report(r, 1)
        assert (rep["outcome"], rep["source"]) == ("restored", "replica"), rep
    for r in range(4):
        assert res.report(r, 1)["iteration"] == 5, res.report(r, 1)
    assert "in-process recovery gives up" not in res.log and not list(res.out.glob("*.launch*"))


SLURM_TOY = r'''
import json, os, signal, sys, time
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
from neighbor_ckpt.inprocess import protocol
from neighbor_ckpt.inprocess.store_auth import read_token, tunnel_address

out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
keep = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NEIGHBOR_CKPT_NODE_ID", "NEIGHBOR_CKPT_STORE_DIR", protocol.ENV_STORE)
(out / f"env.{rank}.json").write_text(json.dumps({k: os.environ.get(k) for k in keep}))
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # a lost process: its launcher declares it to the others
host, port = os.environ[protocol.ENV_STORE].split(",")[0].rsplit(":", 1)  # the primary
token = read_token(Path(os.environ[protocol.ENV_STORE_TOKEN]))  # its gate admits the job's token only
refused = False
try:
    dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, use_libuv=True,
                  timeout=timedelta(seconds=3)).check(["complete"])
except RuntimeError:
    refused = True
(out / f"refused.{rank}.json").write_text(json.dumps(refused))
host, port = tunnel_address((host, int(port)), token)
store = dist.PrefixStore(protocol.launch_prefix(os.environ[protocol.ENV_RUN_ID], 0),
                         dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, use_libuv=True))
while rank == 0 and not store.check(["gen/0/failed"]):
    time.sleep(0.05)
while rank == 0 and not all((out / f"refused.{r}.json").exists() for r in (2, 3, 4)):
    time.sleep(0.05)  # the others' refusals first: once complete, a process still trying is stopped
if rank == 0:
    (out / "seen.json").write_text(json.dumps({"dead": store.get("dead").decode(),
                                               "failed": json.loads(store.get("gen/0/failed"))}))
    store.set("complete", "0")
while not store.check(["complete"]):
    time.sleep(0.05)
'''


@e2e
def test_slurm_script_inprocess_plumbing_with_a_toy_program(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The in-process script's plumbing without NeMo or the engine: the generated script, its worker command
    replaced by a toy, under the real single-node Slurm: 5 tasks, each a launcher with one process (a simulated
    node: its node id and host store, and its store host: task 0's the primary, behind its gate); a client without the
    job's token is refused; process 1 dies, its launcher declares it (``dead``, ``gen/0/failed``), process 0 marks the
    job complete (through its tunnel), every launcher exits 0 and so does the job."""
    from neighbor_ckpt.cli import launch

    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir(parents=True)
    (tmp_path / "toy.py").write_text(SLURM_TOY)
    plan = launch.plan_launch(REPO / "configs" / CONFIG, [STEPS, *INPROCESS, f"launch.rdzv_port={free_ports(6)}"],
                              run_dir=run_dir)
    launch.write_run_dir(plan)
    lines = launch.slurm_script(plan).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("exec ") and "inprocess.launcher" in line)
    lines[at] = lines[at].split(" -- ")[0].replace(" --no-python", "") + f" -- {tmp_path / 'toy.py'} {out}"
    script = tmp_path / "toy.sbatch"
    script.write_text("\n".join(lines))
    env = job_env(tmp_path, out, {"NEIGHBOR_CKPT_STORE_DIR": tmp_path / "store", "NEIGHBOR_CKPT_WORKER_PREFIX": ""})
    sub, job_id = sbatch_wait(slurm_cluster, script, tmp_path, out, run_dir, timeout=300, env=env)
    log = sub.log
    assert sub.returncode == 0, f"Slurm job {job_id} failed (sbatch --wait exit {sub.returncode}):\n{log[-8000:]}"
    for rank in range(5):
        env_of = json.loads((out / f"env.{rank}.json").read_text())
        assert (env_of["RANK"], env_of["WORLD_SIZE"], env_of["LOCAL_RANK"]) == (str(rank), "5", "0")
        assert env_of["NEIGHBOR_CKPT_NODE_ID"] == f"node{rank}"
        assert env_of["NEIGHBOR_CKPT_STORE_DIR"] == str(tmp_path / "store" / f"node{rank}")
    assert all(json.loads((out / f"refused.{rank}.json").read_text()) for rank in (0, 2, 3, 4)), \
        "torch's own client, without the job's token, is refused at the primary's gate"
    assert "store gate: refused a client from" in log
    seen = json.loads((out / "seen.json").read_text())
    assert seen["dead"] == "1:exited: killed by signal 9 (SIGKILL);"
    assert (seen["failed"]["by"], seen["failed"]["kind"], seen["failed"]["ranks"]) == ("launcher:node1", "exited", [1])
    assert log.count("the job completed: exiting 0") == 5, log[-8000:]


def test_slurm_scripts_of_both_modes_for_a_gpu_cluster_and_this_cpu_machine(tmp_path: Path) -> None:
    """Quick tier, no Slurm needed: the in-process script of a multi-node GPU job (Llama 3 70B, 16 nodes x 8 GPUs,
    8 spares: one more node; one launcher task per node with the node's 8 processes, the last node's 8 the spares)
    and of the CPU job above (5 tasks on one node, overcommitted, each a simulated node with one process); the
    restart-mode script of the CPU job: one torchrun per node under ``srun --kill-on-bad-exit=0`` (torchrun restarts
    the worker group inside the allocation; the in-process job above runs the same sbatch/srun plumbing live), no
    GPUs asked of a CPU cluster."""
    from neighbor_ckpt.cli import launch

    plan = launch.plan_launch(REPO / "configs/llama3_70b.yaml", INPROCESS[:1] + ["neighbor_ckpt.inprocess.spares=8"],
                              run_dir=tmp_path / "run")
    script = launch.slurm_script(plan)
    for line in ("#SBATCH --nodes=17", "#SBATCH --ntasks=17", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=8", "srun --kill-on-bad-exit=0 ", 'NODE="$(hostname)"',
                 "FIRST=$((SLURM_NODEID * 8))", "COUNT=$(( 136 - FIRST < 8 ? 136 - FIRST : 8 ))",
                 'export NEIGHBOR_CKPT_STORE_DIR="$STORE_ROOT"'):
        assert line in script, line
    port = plan.job.launch.rdzv_port + 1
    assert (f'-m neighbor_ckpt.inprocess.launcher --store "$STORES" --run-id {plan.run_id} '
            '--node "$NODE" --first "$FIRST" --count "$COUNT" --processes 136 --spares 8 --max-restarts 10 '
            f'--nodes 17 --detector-timeout {plan.job.neighbor_ckpt.detector.timeout_s:g} '
            f'--token-file {plan.run_dir / "store.token"} --complete-file {plan.run_dir / f"complete.{plan.run_id}"} '
            '--host-store "$HOSTIDX" -- ') in script \
        and "--store-root" not in script
    made = f"-m neighbor_ckpt.inprocess.store_auth {plan.run_dir / 'store.token'} || exit 1"
    assert made in script and script.index(made) < script.index("srun "), "the token file, once, before the tasks"
    stale = f"rm -f {plan.run_dir / f'complete.{plan.run_id}'}"
    assert stale in script and script.index(stale) < script.index("srun "), \
        "a completion marker of an earlier submission is removed before the tasks start"
    assert "HOSTIDX=$SLURM_NODEID" in script and f"awk -v p={port}" in script, "a store on every node, same port"
    assert "--inprocess-store" not in script and "ft-restart" not in script
    cpu_plan = launch.plan_launch(REPO / "configs" / CONFIG, [STEPS, *INPROCESS], run_dir=tmp_path)
    cpu = launch.slurm_script(cpu_plan)
    assert "#SBATCH --ntasks=5" in cpu and "#SBATCH --overcommit" in cpu and "--gpus" not in cpu
    assert 'NODE="node$SLURM_PROCID" FIRST=$SLURM_PROCID COUNT=1' in cpu
    assert (f'--processes 5 --spares 1 --max-restarts 2 --nodes 5 '
            f'--detector-timeout {cpu_plan.job.neighbor_ckpt.detector.timeout_s:g} '
            f'--token-file {cpu_plan.run_dir / "store.token"} '
            f'--complete-file {cpu_plan.run_dir / f"complete.{cpu_plan.run_id}"} '
            '--host-store "$HOSTIDX" --store-root "$STORE_ROOT" -- ') in cpu and "HOSTIDX=$SLURM_PROCID" in cpu, \
        "one simulated node per task, each with its store host"
    restart = launch.slurm_script(launch.plan_launch(REPO / "configs" / CONFIG, [STEPS], run_dir=tmp_path))
    assert "srun --kill-on-bad-exit=0" in restart and "-m torch.distributed.run" in restart
    assert "--max-restarts=2" in restart and "ft_launcher" not in restart
    assert "--gpus-per-node" not in restart, "a CPU job must not ask Slurm for GPUs"
    for text in (script, cpu, restart):
        proc = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
        assert proc.returncode == 0, proc.stderr
