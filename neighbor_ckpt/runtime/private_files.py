"""Files under a user's private store directory, opened relative to the checked directory, never through a link.

The store root and its per-user directory are checked once (owner, type, mode: :mod:`neighbor_ckpt.snapshot.userdir`),
which then names the user directory an *anchor* here (:func:`add_anchor`). Every later open of a file below an
anchor starts from a descriptor of the anchor (opened ``O_NOFOLLOW``, its owner checked again) and walks down one
name at a time, ``openat``-style: every directory on the way and the file itself are opened with ``O_NOFOLLOW`` and
must belong to this process's user. A symbolic link where a directory, a slot, a journal or a record is expected is
never followed, and a file another user owns is never read nor written: either is a
:class:`~neighbor_ckpt.errors.StoreDirError` that names the file, its owner and the setting that picks another
directory. A path under no anchor (a test's temporary directory, a file handed to ``neighbor-ckpt inspect``) gets the
same checks on its last name only.

May import: :mod:`neighbor_ckpt.errors` (layer rule of :mod:`neighbor_ckpt.runtime`: see :mod:`neighbor_ckpt.layers`).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from neighbor_ckpt.errors import StoreDirError

__all__ = ["add_anchor", "open_private", "create_private", "replace_private", "read_private", "make_private_dirs",
           "open_dir_nofollow", "owner_name", "FIX_STORE_DIR"]

FIX_STORE_DIR = ("set neighbor_ckpt.store.dir (or NEIGHBOR_CKPT_STORE_DIR) to a directory of your own, e.g. "
                 "/dev/shm/neighbor_ckpt-$USER")
"""What every refusal of a store path says to do."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_lock = threading.Lock()
_anchors: set[str] = set()


def owner_name(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` without a passwd entry."""
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def add_anchor(user_dir: Path) -> None:
    """Name ``user_dir`` (checked by the caller: this user's, 0700, not a link) a directory whose files are opened
    through a descriptor of it (module docstring)."""
    with _lock:
        _anchors.add(os.path.abspath(user_dir))


def _anchor_of(path: str) -> tuple[str, list[str]] | None:
    """The deepest anchor above ``path`` and the names from it to ``path`` (None: under no anchor)."""
    best = None
    with _lock:
        for a in _anchors:
            if path.startswith(a + os.sep) and (best is None or len(a) > len(best)):
                best = a
    if best is None:
        return None
    return best, path[len(best) + 1:].split(os.sep)


def _refuse_link(path: str, err: OSError, what: str) -> StoreDirError:
    kind = "a symbolic link" if os.path.islink(path) else "not what was expected (a link or another kind of file)"
    return StoreDirError(f"the {what} {path} is {kind}: neighbor_ckpt never follows a link under its store; "
                         f"remove it, or {FIX_STORE_DIR}")


def _check_owner(fd: int, path: str, what: str) -> os.stat_result:
    st = os.fstat(fd)
    me = os.geteuid()
    if st.st_uid != me:
        raise StoreDirError(f"the {what} {path} belongs to {owner_name(st.st_uid)}, not to this user "
                            f"({owner_name(me)}): neighbor_ckpt never reads or writes another user's file; remove "
                            f"it, or {FIX_STORE_DIR}")
    return st


def open_dir_nofollow(path: Path | str, what: str = "directory") -> int:
    """A descriptor of the directory ``path`` itself (never of a link's target); :class:`StoreDirError` for a link
    or a non-directory, ``OSError`` otherwise."""
    try:
        return os.open(path, _DIR_FLAGS)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse_link(str(path), err, what) from err
        raise


def _openat(dir_fd: int, name: str, flags: int, mode: int, full: str, what: str) -> int:
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR) or (err.errno == errno.EMLINK):
            raise _refuse_link(full, err, what) from err
        raise
    try:
        _check_owner(fd, full, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def _parent_fd(path: Path | str, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """A checked descriptor of ``path``'s directory (walked from its anchor) and ``path``'s last name.
    ``create``: make missing directories below the anchor (0700)."""
    full = os.path.abspath(path)
    found = _anchor_of(full)
    if found is None:
        parent, name = os.path.split(full)
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd, name
        finally:
            os.close(fd)
        return
    anchor, names = found
    fd = open_dir_nofollow(anchor, "store directory")
    try:
        _check_owner(fd, anchor, "store directory")
        here = anchor
        for name in names[:-1]:
            here = os.path.join(here, name)
            if create:
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            nxt = _openat(fd, name, os.O_RDONLY | os.O_DIRECTORY, 0, here, "store directory")
            os.close(fd)
            fd = nxt
            if create and stat.S_IMODE(os.fstat(fd).st_mode) != 0o700:
                os.fchmod(fd, 0o700)
        yield fd, names[-1]
    finally:
        os.close(fd)


def open_private(path: Path | str, flags: int, mode: int = 0o600, *, what: str = "store file") -> int:
    """``os.open(path, flags | O_NOFOLLOW, mode)`` relative to the checked directory above it (module docstring);
    the file must belong to this user. :class:`StoreDirError` for a link or another user's file; ``OSError`` (e.g.
    ``FileNotFoundError``) otherwise."""
    with _parent_fd(path) as (dfd, name):
        return _openat(dfd, name, flags, mode, os.path.abspath(path), what)


def create_private(path: Path | str, *, what: str = "store file") -> int:
    """A new empty file at ``path`` (0600, read-write), made relative to the checked directory above it: whatever
    was at ``path`` (a leftover temporary file, a planted link) is removed first, never opened."""
    with _parent_fd(path) as (dfd, name):
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        fd = _openat(dfd, name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600, os.path.abspath(path), what)
        os.fchmod(fd, 0o600)
        return fd


def replace_private(src: Path | str, dst: Path | str) -> None:
    """``os.replace(src, dst)`` with both names taken relative to their checked directories (a rename never follows
    a link: whatever is at ``dst`` is replaced, not written through)."""
    with _parent_fd(src) as (sfd, sname), _parent_fd(dst) as (dfd, dname):
        os.replace(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)


def read_private(path: Path | str, *, what: str = "store file") -> bytes:
    """The bytes of the file at ``path``, opened as :func:`open_private` does."""
    fd = open_private(path, os.O_RDONLY, what=what)
    try:
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


def make_private_dirs(path: Path | str) -> None:
    """Make ``path`` and the directories between it and its anchor (0700, this user's, none a link), each made and
    checked relative to the one above it. Outside an anchor: ``mkdir -p`` with mode 0700."""
    full = os.path.abspath(path)
    if _anchor_of(full) is None:
        Path(full).mkdir(mode=0o700, parents=True, exist_ok=True)
        return
    with _parent_fd(os.path.join(full, "_"), create=True):
        pass
