"""What the NeMo and Megatron-Bridge recipes share: their entry (:func:`start_recipe`: the command line, logging, the
job file, megatron-core on CPU) and the in-process engine set-up with its record files (:class:`InprocessJob`).

``nemo_pretrain.py`` and ``bridge_pretrain.py`` are scripts (torchrun runs them as files); they import this module
from the installed package. What differs between them (the framework, how an attempt is built and run) stays in each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

from neighbor_ckpt.planning.jobspec import JobSpec, load_job

__all__ = ["start_recipe", "InprocessJob"]


def start_recipe(argv: list[str] | None, *, description: str, run_dir_help: str, record_help: str, log_format: str,
                 nemo: bool) -> tuple[JobSpec, argparse.Namespace]:
    """A recipe's start, before the framework is imported: its command line (``--config``, ``--run-dir``,
    ``--record``, ``--inprocess-store``) parsed, logging at INFO with ``[rank<RANK>] `` before ``log_format``, the job
    file loaded (validated), and on ``trainer.accelerator: cpu`` megatron-core (and NeMo when ``nemo``) set up for CPU
    ranks (:func:`megatron_patches.enable_cpu`). Returns the job and the parsed arguments."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", type=Path, required=True, help="job file (configs/*.yaml), already resolved")
    ap.add_argument("--run-dir", type=Path, required=True, help=run_dir_help)
    ap.add_argument("--record", action="store_true", help=record_help)
    ap.add_argument("--inprocess-store", metavar="HOST:PORT", default=None,
                    help="in-process recovery: the store host (default: what our launcher sets)")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] {log_format}")
    job = load_job(args.config)
    if job.trainer.accelerator == "cpu":
        from megatron_patches import enable_cpu

        if nemo:
            enable_cpu()
        else:
            enable_cpu(nemo=False)  # before Megatron-Bridge is imported
    return job, args


class InprocessJob:
    """A recipe's in-process engine (:class:`~neighbor_ckpt.inprocess.InprocessRecovery`) built from the job file, and
    its ``--record`` files: ``attempt.initial<R>.iter<G>[.launch<L>].json`` per attempt (:meth:`record_attempt`) and
    the engine's events at the end (:meth:`recording_events`), under ``<run-dir>/record/``.

    Args:
        job: the job file.
        args: the recipe's arguments (:func:`start_recipe`).
        started: when the recipe started (unix time; default: now), written with the events.

    Raises:
        ConfigError: the launch is not the job file's (its ranks or spares differ: it was not started with
            ``neighbor-ckpt launch`` and this job file), see :meth:`InprocessRecovery.from_config`.
    """

    def __init__(self, job: JobSpec, args: argparse.Namespace, *, started: float | None = None) -> None:
        from neighbor_ckpt.inprocess import InprocessRecovery

        self.started = time.time() if started is None else started
        p, t = job.parallelism, job.trainer
        self.inproc = InprocessRecovery.from_config(job.neighbor_ckpt, store=args.inprocess_store, ranks=job.world_size,
                                                    model_parallel=p.tensor * p.pipeline * p.context,
                                                    batch_micro_batches=t.global_batch_size // t.micro_batch_size)
        self.launch = self.inproc.launch
        """The launcher's restart count (in process, generations count inside one launch)."""
        self.record = bool(args.record)
        self.out = args.run_dir / "record"
        if self.record:
            self.out.mkdir(parents=True, exist_ok=True)
        self._suffix = f".launch{self.launch}" if self.launch else ""

    def record_attempt(self, attempt: Any) -> None:
        """With ``--record``: which process runs which rank in ``attempt`` (the engine's ``Attempt``)."""
        if not self.record:
            return
        initial = self.inproc.initial_rank
        (self.out / f"attempt.initial{initial}.iter{attempt.iteration}{self._suffix}.json").write_text(json.dumps(
            {"pid": os.getpid(), "rank": attempt.rank, "world_size": attempt.world_size, "initial_rank": initial,
             "iteration": attempt.iteration, "launch": self.launch}))

    @contextlib.contextmanager
    def recording_events(self) -> Iterator[None]:
        """Around the engine's run: with ``--record``, its events are written when it ends, however it ends."""
        try:
            yield
        finally:
            if self.record:
                (self.out / f"events.initial{self.inproc.initial_rank}{self._suffix}.json").write_text(json.dumps(
                    {"pid": os.getpid(), "start": self.started, "events": self.inproc.events}, indent=1))
