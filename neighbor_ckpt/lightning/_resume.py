"""Composing with a disk resume (``trainer.fit(ckpt_path=...)``, NeMo's ``AutoResume``).

Lightning loads ``trainer.ckpt_path`` *after* ``on_fit_start`` (strategies that restore after setup, such as
NeMo's ``MegatronStrategy``, load everything then; the others load loop, optimizer and scheduler state then).
When the callback has just restored an in-memory version, that version is at least as new as any disk
checkpoint of the run (one is taken every iteration), so the pending disk load would only roll training
back. :func:`skip_pending_disk_restore` makes it a no-op, once; a disk checkpoint whose name says it is newer
(``step=N`` / ``stepN``) is still loaded.

This touches one private attribute of Lightning's trainer (``_checkpoint_connector``), present in
``lightning`` / ``pytorch_lightning`` 2.x; without it nothing is changed and a warning says so.
"""

from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["disk_checkpoint_step", "disk_checkpoint_consumed_samples", "skip_pending_disk_restore"]

_STEP_RE = re.compile(r"step[=_-]?(\d+)")
_CONSUMED_RE = re.compile(r"consumed_samples=(\d+)(?:\.0)?(?!\d)")


def disk_checkpoint_step(path: Any) -> int | None:
    """The global step a checkpoint path names (NeMo: ``...-step=99-...``, ours: ``...step99.ckpt``), or None."""
    found = _STEP_RE.findall(str(path))
    return int(found[-1]) if found else None


def disk_checkpoint_consumed_samples(path: Any) -> int | None:
    """The consumed-samples count a NeMo checkpoint path names (``...-consumed_samples=24.0-...``), or None."""
    found = _CONSUMED_RE.findall(str(path))
    return int(found[-1]) if found else None


def _disk_is_newer(path: Any, restored_step: int) -> bool:
    disk_step = disk_checkpoint_step(path)
    if disk_step is not None and disk_step > restored_step:
        logger.warning("disk checkpoint %s (step %d) is newer than the in-memory version (step %d): it is loaded "
                       "over it", path, disk_step, restored_step)
        return True
    return False


def skip_pending_disk_restore(trainer: Any, restored_step: int) -> None:
    """Keep Lightning from loading a disk checkpoint over the in-memory version of ``restored_step``."""
    conn = getattr(trainer, "_checkpoint_connector", None)
    if conn is None or not hasattr(conn, "resume_start"):
        if trainer.ckpt_path:
            logger.warning("cannot keep this Lightning version from loading %s over the in-memory version",
                           trainer.ckpt_path)
        return
    if trainer.strategy.restore_checkpoint_after_setup:
        # Nothing is loaded yet; the path may be only known inside resume_start (fit(ckpt_path=...)).
        original = conn.resume_start

        def resume_start(checkpoint_path: Any = None) -> None:
            del conn.resume_start  # one shot: the class method shows through again
            if checkpoint_path and not _disk_is_newer(checkpoint_path, restored_step):
                logger.warning("skipping the disk restore of %s: the in-memory version of step %d is newer",
                               checkpoint_path, restored_step)
                checkpoint_path = None
            original(checkpoint_path)

        conn.resume_start = resume_start
    elif trainer.ckpt_path and not _disk_is_newer(trainer.ckpt_path, restored_step):
        # Model and callbacks were loaded before setup (and overwritten by the in-memory restore since);
        # loops, optimizers and schedulers would be loaded next: leave nothing to load.
        conn._loaded_checkpoint = {}
        logger.warning("skipping the disk restore of %s: the in-memory version of step %d is newer",
                       trainer.ckpt_path, restored_step)
