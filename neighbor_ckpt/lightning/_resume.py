"""Composing with a disk resume (``trainer.fit(ckpt_path=...)``, NeMo's ``AutoResume``): Lightning's plumbing.

Lightning loads ``trainer.ckpt_path`` *after* ``on_fit_start`` (strategies that restore after setup, such as
NeMo's ``MegatronStrategy``, load everything then; the others load loop, optimizer and scheduler state then).
When the callback has just restored an in-memory version, the newer iteration wins
(:func:`neighbor_ckpt.glue.insurance.disk_checkpoint_wins`, the policy shared with the other frameworks' callbacks):
:func:`skip_pending_disk_restore` makes the pending disk load a no-op, once, unless the disk checkpoint's name says it
is newer (``step=N`` / ``stepN``).

This touches one private attribute of Lightning's trainer (``_checkpoint_connector``), present in
``lightning`` / ``pytorch_lightning`` 2.x; without it nothing is changed and a warning says so.
"""

from __future__ import annotations

import logging
from typing import Any

from neighbor_ckpt.glue.insurance import disk_checkpoint_wins

logger = logging.getLogger(__name__)

__all__ = ["skip_pending_disk_restore"]


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
            if checkpoint_path and not disk_checkpoint_wins(checkpoint_path, restored_step):
                checkpoint_path = None
            original(checkpoint_path)

        conn.resume_start = resume_start
    elif trainer.ckpt_path and not disk_checkpoint_wins(trainer.ckpt_path, restored_step):
        # Model and callbacks were loaded before setup (and overwritten by the in-memory restore since);
        # loops, optimizers and schedulers would be loaded next: leave nothing to load.
        conn._loaded_checkpoint = {}
