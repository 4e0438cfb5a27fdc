"""Insurance checkpoints and framework checkpoints: which exist, which iteration they hold, which one wins.

Two kinds of persistent checkpoint stand behind the in-memory snapshots:

* **ours** (:class:`InsuranceFiles`): written by the callback every ``insurance.every_n_steps`` optimizer steps
  through the framework's own save (a Lightning checkpoint), named ``neighbor-insurance-step<N>.ckpt``; the newest two
  are kept, the newest one is loaded;
* **the framework's** (NeMo's ``ModelCheckpoint`` + ``AutoResume``, Megatron-Bridge's ``checkpoint.save`` /
  ``checkpoint.load``): the framework loads it itself, after the callback's restore point; we only need to know which
  iteration it holds (:func:`iteration_from_name`), and, after an in-memory restore, whether it is newer
  (:func:`disk_checkpoint_wins`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from neighbor_ckpt.config import InsuranceConfig
from neighbor_ckpt.errors import NeighborCkptError

logger = logging.getLogger(__name__)

__all__ = ["InsuranceFiles", "checkpoint_step", "checkpoint_consumed_samples", "iteration_from_name",
           "disk_checkpoint_wins", "DEFAULT_DIRNAME"]

DEFAULT_DIRNAME = "neighbor_ckpt_insurance"
"""Where our insurance checkpoints go without ``insurance.dirpath``: ``<framework root dir>/neighbor_ckpt_insurance``."""

_FILE_RE = re.compile(r"neighbor-insurance-step(\d+)\.ckpt$")
_STEP_RE = re.compile(r"step[=_-]?(\d+)")
_CONSUMED_RE = re.compile(r"consumed_samples=(\d+)(?:\.0)?(?!\d)")


@dataclass(frozen=True)
class InsuranceFiles:
    """Our insurance checkpoints in one directory: ``neighbor-insurance-step<N>.ckpt``.

    Args:
        directory: where they are written and looked for.
        every_n_steps: one is due after every N-th optimizer step (0: none written; existing ones are still loaded).
        keep: how many of the newest are kept when one is written.
    """

    directory: Path
    every_n_steps: int = 0
    keep: int = 2

    @classmethod
    def from_config(cls, config: InsuranceConfig, root_dir: str | Path) -> InsuranceFiles | None:
        """The configured insurance (None: neither ``every_n_steps`` nor ``dirpath`` set); the directory defaults to
        ``<root_dir>/neighbor_ckpt_insurance``."""
        if config.every_n_steps <= 0 and config.dirpath is None:
            return None
        directory = Path(config.dirpath) if config.dirpath is not None else Path(root_dir) / DEFAULT_DIRNAME
        return cls(directory, every_n_steps=config.every_n_steps)

    def due(self, step: int) -> bool:
        """Whether one is written after optimizer step ``step``."""
        return self.every_n_steps > 0 and step % self.every_n_steps == 0

    def path(self, step: int) -> Path:
        return self.directory / f"neighbor-insurance-step{step}.ckpt"

    def existing(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every one present, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.directory.iterdir() if (m := _FILE_RE.search(p.name)))

    def newest(self) -> tuple[int, Path] | None:
        """The one an insurance fallback loads: the newest."""
        found = self.existing()
        return found[-1] if found else None

    def prune(self) -> None:
        """Remove all but the newest ``keep`` (call on one rank, after writing one)."""
        for _, old in self.existing()[:-self.keep]:
            old.unlink(missing_ok=True)


def checkpoint_step(path: Any) -> int | None:
    """The global step a checkpoint path names (NeMo: ``...-step=99-...``, ours: ``...step99.ckpt``), or None."""
    found = _STEP_RE.findall(str(path))
    return int(found[-1]) if found else None


def checkpoint_consumed_samples(path: Any) -> int | None:
    """The consumed-samples count a NeMo checkpoint path names (``...-consumed_samples=24.0-...``), or None."""
    found = _CONSUMED_RE.findall(str(path))
    return int(found[-1]) if found else None


def iteration_from_name(path: Any, *, framework: str, steps_for_consumed: Callable[[int], int | None] | None = None,
                        hint: str = "") -> int:
    """The iteration a framework checkpoint holds, from its name: ``step=N``, else ``consumed_samples=`` converted by
    ``steps_for_consumed`` (a whole number of global batches).

    Raises:
        NeighborCkptError: the name says neither: resuming from it, we could not tell which iteration training
            continues from (``hint`` says how to name it).
    """
    step = checkpoint_step(path)
    consumed = checkpoint_consumed_samples(path)
    if step is None and consumed is not None and steps_for_consumed is not None:
        step = steps_for_consumed(consumed)
    if step is None:
        raise NeighborCkptError(f"{framework} resumes from {path}, whose name carries neither step=N nor a whole number of "
                                f"global batches in consumed_samples=: cannot tell which iteration it restores"
                                + (f". {hint}" if hint else ""))
    return step


def disk_checkpoint_wins(path: Any, restored_step: int, *, disk_step: int | None = None) -> bool:
    """After an in-memory restore of ``restored_step``, with the framework about to load the checkpoint ``path``:
    whether that checkpoint is loaded over the in-memory version. The newer iteration wins: the disk checkpoint only
    when it is newer, by ``disk_step`` when the framework knows it (Megatron-Bridge's tracker file), else by its name
    (a name without a step is taken for older: one snapshot is taken every iteration). Announced either way."""
    if disk_step is None:
        disk_step = checkpoint_step(path)
    if disk_step is not None and disk_step > restored_step:
        logger.warning("disk checkpoint %s (step %d) is newer than the in-memory version (step %d): it is loaded "
                       "over it", path, disk_step, restored_step)
        return True
    logger.warning("skipping the disk restore of %s: the in-memory version of step %d is newer", path, restored_step)
    return False
