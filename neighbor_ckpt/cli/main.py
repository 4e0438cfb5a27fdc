"""The ``neighbor-ckpt`` command.

* ``neighbor-ckpt launch CONFIG [key.path=value ...]`` validates a job file and runs its recipe under torchrun with
  restarts on this node; ``--slurm FILE`` writes a multi-node Slurm batch script instead. CONFIG is a path or the
  name of a job file shipped with the package (``gpt_tiny_cpu``; ``configs/`` in a checkout); the recipe is the
  installed package's (``neighbor_ckpt/recipes``).
* ``neighbor-ckpt plan CONFIG [key.path=value ...]`` prints, per rank class, the bytes snapshotted per iteration,
  the host memory needed, the predicted copy and network time, and whether the snapshot hides in an iteration.
* ``neighbor-ckpt inspect [STORE_DIR]`` lists every slot file under a host store (default: this user's store root):
  role, owner, iteration, sizes, job, and whether header, commit marker and checksums validate. It reads headers as
  JSON and never unpickles anything, and never follows a link or opens another user's file. A store this user left
  under the shared default root of earlier releases (``/dev/shm/neighbor_ckpt/<user>``) is named in one line;
  ``--cleanup`` removes it.
* ``neighbor-ckpt demo [...]``: the 4-rank kill-and-recover demo (``scripts/demo``).

The benchmarks and the fault campaign are not part of the package: they live in the checkout's ``tools/``
(``python -m tools.bench``, ``python -m tools.campaign``; ``scripts/bench``, ``scripts/campaign``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from neighbor_ckpt.errors import ConfigError, SnapshotCorruptError, SnapshotMismatchError, StoreDirError
from neighbor_ckpt.snapshot.slot import SlotFile

__all__ = ["main", "inspect_store"]


def inspect_store(root: Path) -> list[dict[str, Any]]:
    """One record per slot file under ``root`` (any depth), validated without trusting any byte first."""
    rows: list[dict[str, Any]] = []
    for path in sorted(Path(root).rglob("*.slot")):
        role = path.name.split(".")[0]
        row: dict[str, Any] = {"path": str(path), "role": role, "file_bytes": path.lstat().st_size}
        try:
            slot = SlotFile.open(path)
        except StoreDirError as e:
            rows.append(dict(row, status=f"refused: {e}"))
            continue
        except (SnapshotCorruptError, SnapshotMismatchError) as e:
            rows.append(dict(row, status=f"unusable: {e}"))
            continue
        try:
            hdr = slot.read_header()
            row.update(job=hdr.job_id, owner=hdr.owner_rank, iteration=hdr.iteration,
                       payload_bytes=hdr.payload_nbytes, extras_bytes=hdr.extras_nbytes,
                       tensors=len(hdr.meta.get("tensors", [])))
            try:
                slot.verify(hdr)
                row["status"] = "valid" if hdr.payload_xxh3 is not None else "committed (no checksum)"
            except SnapshotCorruptError as e:
                row["status"] = f"CORRUPT: {e}"
        except (SnapshotCorruptError, SnapshotMismatchError) as e:
            row["status"] = f"not committed: {e}"
        finally:
            slot.close()
        rows.append(row)
    return rows


def _legacy_store(cleanup: bool) -> None:
    """One line about this user's store under the shared default root of earlier releases, if there is one;
    ``cleanup``: remove it (and say so, in one line)."""
    import shutil

    from neighbor_ckpt.config import LEGACY_STORE_DIR, effective_user
    from neighbor_ckpt.snapshot.userdir import legacy_user_dir

    old = legacy_user_dir(effective_user(), LEGACY_STORE_DIR)
    if old is None:
        return
    files = [p for p in old.rglob("*") if p.is_file() and not p.is_symlink()]
    mib = sum(p.lstat().st_size for p in files) / 2**20
    if cleanup:
        shutil.rmtree(old)  # never follows a link (rmtree works through descriptors)
        print(f"removed {old}: a store of an earlier release under its shared default root ({len(files)} files, "
              f"{mib:.1f} MiB)")
    else:
        print(f"{old}: a store of an earlier release under its shared default root ({len(files)} files, {mib:.1f} "
              f"MiB), listed below; jobs no longer use it: `neighbor-ckpt inspect --cleanup` removes it")


def _inspect(args: argparse.Namespace) -> int:
    from neighbor_ckpt.config import LEGACY_STORE_DIR, NeighborCkptConfig, effective_user

    if args.store_dir is None:  # this user's default store, and what an earlier release left under the old one
        if not args.json:
            _legacy_store(args.cleanup)
        args.store_dir = NeighborCkptConfig().resolved_store_dir()
        rows = inspect_store(args.store_dir)
        if not args.cleanup:
            rows += inspect_store(Path(LEGACY_STORE_DIR) / effective_user())
    else:
        rows = inspect_store(args.store_dir)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no slot files under {args.store_dir}")
        return 0
    cols = ["role", "owner", "iteration", "payload_bytes", "extras_bytes", "job", "status", "path"]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(*cols)
        for r in rows:
            table.add_row(*(str(r.get(c, "")) for c in cols))
        Console().print(table)
    except ImportError:
        print("\t".join(cols))
        for r in rows:
            print("\t".join(str(r.get(c, "")) for c in cols))
    return 0


def _launch(args: argparse.Namespace) -> int:
    from neighbor_ckpt.cli import launch

    plan = launch.plan_launch(args.config, args.overrides, run_dir=args.run_dir, record=args.record)
    if args.slurm:
        script = launch.slurm_script(plan)  # refuses what the script cannot run before anything is written
        launch.write_run_dir(plan)
        args.slurm.write_text(script)
        print(f"wrote {args.slurm} (run directory {plan.run_dir}); submit it with: sbatch {args.slurm}")
        return 0
    if args.dry_run:
        if plan.inprocess:
            from neighbor_ckpt.config import expand_store_dir

            procs = launch.inprocess_processes(plan, store_port=29650,
                                               store_root=expand_store_dir(plan.job.neighbor_ckpt.store.dir))
            for cmd, env in procs.agents:
                print(" ".join([*(f"{k}={v}" for k, v in env), *cmd]) + " &")
            return 0
        if plan.job.trainer.num_nodes > 1:  # one torchrun agent per simulated node
            from neighbor_ckpt.config import expand_store_dir

            agents = launch.torchrun_nodes(plan, endpoint="127.0.0.1:29500",
                                           store_root=expand_store_dir(plan.job.neighbor_ckpt.store.dir))
            for cmd, env in agents.agents:
                print(" ".join([*(f"{k}={v}" for k, v in env), *cmd]) + " &")
            return 0
        print(" ".join(launch.torchrun_command(plan)))
        return 0
    print(f"neighbor-ckpt: {launch.describe(plan)}; recipe {plan.recipe}; run directory {plan.run_dir}", flush=True)
    return launch.run_local(plan)


def _plan(args: argparse.Namespace) -> int:
    from neighbor_ckpt.cli.launch import resolve_config
    from neighbor_ckpt.planning.jobspec import load_job
    from neighbor_ckpt.planning.mttr import assumptions_for, estimate_both, format_mttr

    job = load_job(resolve_config(args.config), args.overrides)
    plan = job.plan()
    assumptions = assumptions_for(plan.hardware.name, job.neighbor_ckpt.detector)
    mttr = estimate_both(plan, assumptions)
    if args.json:
        print(json.dumps({**plan.to_dict(), "mttr": {m: e.to_dict() for m, e in mttr.items()},
                          "mttr_assumptions": dataclasses.asdict(assumptions)}, indent=1))
        return 0
    print(plan.format_table())
    for w in plan.warnings:
        print(f"WARNING: {w}")
    print()
    print(format_mttr(mttr, assumptions))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="neighbor-ckpt", description="Per-iteration neighbor checkpointing tools.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("launch", help="validate a job file and run its recipe under torchrun (or write a Slurm script)")
    p.add_argument("config", type=Path,
                   help="job file, e.g. configs/gpt_tiny_cpu.yaml, or a shipped one by name, e.g. gpt_tiny_cpu")
    p.add_argument("overrides", nargs="*", help="key.path=value, e.g. trainer.max_steps=20")
    p.add_argument("--run-dir", type=Path, default=None, help="default: <launch.log_dir>/<name>-<timestamp>")
    p.add_argument("--slurm", type=Path, default=None, metavar="FILE", help="write a Slurm batch script, do not run")
    p.add_argument("--dry-run", action="store_true",
                   help="print the torchrun command (in process: the store host and agent commands), do not run")
    p.add_argument("--record", action="store_true", help="record per-step losses and final fingerprints")
    p = sub.add_parser("plan", help="bytes, host memory and time per iteration of a job file, per rank class")
    p.add_argument("config", type=Path, help="job file, or a shipped one by name (as for launch)")
    p.add_argument("overrides", nargs="*", help="key.path=value")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("inspect", help="list the versions held by a host store and check them")
    p.add_argument("store_dir", type=Path, nargs="?", default=None,
                   help="default: this user's store root (NEIGHBOR_CKPT_STORE_DIR, else /dev/shm/neighbor_ckpt-USER)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--cleanup", action="store_true",
                   help="remove this user's store left under the shared default root of earlier releases "
                        "(/dev/shm/neighbor_ckpt/USER)")
    sub.add_parser("demo", help="4 CPU ranks, a real kill and a bit-exact recovery", add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "demo":
        from neighbor_ckpt.cli import demo

        return demo.main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return {"launch": _launch, "plan": _plan, "inspect": _inspect}[args.cmd](args)
    except ConfigError as e:
        print(f"neighbor-ckpt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
