"""The per-user directory under the store root, made safely on a node that other users share.

The store root (``store.dir``; by default ``/dev/shm/neighbor_ckpt-<user>``, one per user) holds one directory per
user: ``<root>/<user>/``, mode 0700, and everything of this user's jobs lies below it (slot files are 0600). A root
this process creates is its user's own, mode 0700. A root that several users share must be made by root, sticky and
writable by all (mode 1777, like ``/tmp``): nobody but root can then rename or remove another user's directory in it.

:func:`private_user_dir` opens both directories without following links (``O_NOFOLLOW``) and checks what it
opened through the file descriptor (owner, type, mode), so a link or a directory that someone else created in its
place is refused with :class:`~neighbor_ckpt.errors.StoreDirError` instead of being written into, and a mode is
only ever changed through the descriptor (``fchmod``), never by a path that could lead elsewhere. The checked user
directory then anchors every later open below it (:mod:`neighbor_ckpt.runtime.private_files`): each file and
directory is opened relative to the one above it, never through a link, and must be this user's.

Refused:
    the root or the user directory is a symbolic link, or not a directory;
    the user directory belongs to another user;
    the root belongs to another user (neither this one nor root): its owner could replace this user's directory;
    a root that others can write without the sticky bit, whoever owns it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from neighbor_ckpt.config import LEGACY_STORE_DIR
from neighbor_ckpt.errors import StoreDirError
from neighbor_ckpt.runtime.private_files import FIX_STORE_DIR, add_anchor, owner_name

logger = logging.getLogger(__name__)

__all__ = ["private_user_dir", "legacy_user_dir", "SHARED_ROOT_MODE", "OWN_ROOT_MODE", "USER_DIR_MODE"]

SHARED_ROOT_MODE = 0o1777
"""Mode of a store root several users share (made by root): every user may add a directory, nobody may remove
another's."""

OWN_ROOT_MODE = 0o700
"""Mode of a store root this process creates: its user's own."""

USER_DIR_MODE = 0o700
"""Mode of a user's directory under the root."""

_FIX = FIX_STORE_DIR


def _open_dir(path: Path, what: str) -> int:
    """A descriptor of ``path`` itself: never of what a link at ``path`` points to."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "a symbolic link" if path.is_symlink() else "not a directory"
            raise StoreDirError(f"the {what} {path} is {kind}: neighbor_ckpt never writes snapshots through it; "
                                f"remove it, or {_FIX}") from err
        raise StoreDirError(f"cannot open the {what} {path}: {err.strerror}; {_FIX}") from err


_owner_name = owner_name


def _check_root(root: Path) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(root, OWN_ROOT_MODE)
        created = True
    except FileExistsError:
        created = False
    fd = _open_dir(root, "store root")
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if created and st.st_uid == me:
            os.fchmod(fd, OWN_ROOT_MODE)  # mkdir's mode went through the umask
            logger.info("created the store root %s (mode 0700, this user's own)", root)
            return
        sticky = bool(st.st_mode & stat.S_ISVTX)
        others_write = bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
        if st.st_uid not in (me, 0):
            raise StoreDirError(
                f"the store root {root} belongs to {_owner_name(st.st_uid)} (mode {stat.S_IMODE(st.st_mode):04o}), "
                f"not to this user ({_owner_name(me)}) nor to root: its owner could rename or replace this user's "
                f"directory in it; {_FIX}, or ask its owner to remove it")
        if others_write and not sticky:
            raise StoreDirError(
                f"the store root {root} (owner {_owner_name(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}) is "
                f"writable by other users without the sticky bit: any of them could replace this user's directory; "
                f"{_FIX}")
    finally:
        os.close(fd)


def private_user_dir(root: Path, user: str) -> Path:
    """``<root>/<user>``, created if missing, checked and returned: a directory (not a link) that this process's
    user owns, mode 0700; the root created shared (1777) if missing, else checked (module docstring).

    Raises:
        StoreDirError: the root or the user directory is not safe to use; the message says why and what to do.
    """
    root = Path(root)
    _check_root(root)
    udir = root / user
    try:
        os.mkdir(udir, USER_DIR_MODE)
    except FileExistsError:
        pass
    except PermissionError as err:
        raise StoreDirError(f"cannot create {udir}: the store root {root} is not writable by this user; "
                            f"{_FIX}") from err
    fd = _open_dir(udir, "user directory")
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid != me:
            raise StoreDirError(
                f"{udir} belongs to {_owner_name(st.st_uid)}, not to this user ({_owner_name(me)}): someone created "
                f"it before this job; neighbor_ckpt keeps snapshots only in a directory of the user's own. Remove it, "
                f"or {_FIX}")
        if stat.S_IMODE(st.st_mode) != USER_DIR_MODE:
            os.fchmod(fd, USER_DIR_MODE)
    finally:
        os.close(fd)
    add_anchor(udir)
    return udir


def legacy_user_dir(user: str, legacy_root: Path | str = LEGACY_STORE_DIR) -> Path | None:
    """This user's directory under the shared default root of earlier releases (``/dev/shm/neighbor_ckpt``), when
    there is one that is a directory (not a link) of this user's; None otherwise. Only ``neighbor-ckpt inspect``
    looks there: jobs no longer write under it."""
    udir = Path(legacy_root) / user
    try:
        fd = os.open(udir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return None
    finally:
        os.close(fd)
    add_anchor(udir)
    return udir
