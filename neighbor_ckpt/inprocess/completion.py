"""The job's completion marker: a file a process reads without any store.

Once the job has completed (``complete`` in the store), the store hosts linger a moment and go. A process that starts
later than that (a replacement still importing when the job ended) would find every store gone and fail over through
all of them before it could learn that nothing is left to do. So every launcher, when it learns that the job
completed, writes a marker file (:func:`mark_complete`, mode 0600, written once and atomically) at the path it gives
its processes in :data:`~neighbor_ckpt.inprocess.protocol.ENV_COMPLETE_FILE` (read once, into the process's
:class:`~neighbor_ckpt.inprocess.identity.ProcessIdentity`); the engine looks at it first
(:func:`completed`) and a process that finds it returns at once, as an idle spare that was never used does (its
program exits 0).

The path is per launch (the launch's run id is part of its name: :func:`marker_path`), so a marker left by an
earlier launch in the same directory never ends a new one. It is read as the snapshot slots are opened: without
following a link (``O_NOFOLLOW``), and only when it is a regular file of this user that no one else can read or write
(as :func:`mark_complete` writes it); anything else at that path is not the marker (another user's file, a link to
one) and ends nothing.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Optional


__all__ = ["marker_path", "mark_complete", "marked", "completed"]

logger = logging.getLogger(__name__)

_refused: set[str] = set()
"""The paths found holding something that is not the marker (said once each)."""


def marker_path(directory: Path, run_id: str) -> Path:
    """The completion marker of launch ``run_id`` in ``directory`` (the directory of the launch's token file: the
    run directory of ``neighbor-ckpt launch``)."""
    return Path(directory) / f"complete.{run_id}"


def mark_complete(path: Path, run_id: str) -> None:
    """Write the marker (0600, through a temporary file and a rename: a reader sees it whole or not at all); an error
    is logged, not raised (the marker only saves a late process its failover)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{run_id}\n")
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not write the completion marker %s: %s", path, e)


def marked(path: Optional[Path], run_id: Optional[str]) -> bool:
    """Whether the marker of launch ``run_id`` is at ``path`` (False without a path); nothing logged."""
    if path is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # absent, or a link (ELOOP): not the marker
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            if str(path) in _refused:
                return False
            _refused.add(str(path))  # said once: launchers look every poll
            logger.warning("%s: not taken for the completion marker (not a private file of this user: uid %d, mode "
                           "%o)", path, st.st_uid, stat.S_IMODE(st.st_mode))
            return False
        text = f.read(4096).decode(errors="replace").strip()
    return run_id is None or text == run_id


def completed(path: Optional[Path], run_id: Optional[str]) -> bool:
    """Whether launch ``run_id`` has completed: its launcher wrote the marker at ``path`` (the identity's
    :attr:`~neighbor_ckpt.inprocess.identity.ProcessIdentity.complete_file`); logs one line when it has. False
    without a path (not started by our launcher)."""
    if not marked(path, run_id):
        return False
    logger.info("neighbor_ckpt: the job completed before this process joined it (%s): nothing to do, exiting", path)
    return True
