"""Shared-node safety of the store's directories (snapshot/userdir.py): a link or a directory that another user
created where this user's store goes is refused with a clear error, never written through.

Directories owned by another user are made with ``os.chown``, which needs root: CI runs as root, so these tests run
there; elsewhere they are skipped, saying why."""

from __future__ import annotations

import getpass
import os
import stat
from pathlib import Path

import pytest

from neighbor_ckpt.errors import StoreDirError
from neighbor_ckpt.snapshot.store import HostStore
from neighbor_ckpt.snapshot.userdir import private_user_dir

OTHER_UID = 54321
"""A uid that is not this process's (no passwd entry needed)."""

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another user needs root "
                                                           "(CI runs as root)")


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_a_new_root_is_this_users_own_and_the_user_directory_private(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        udir = private_user_dir(tmp_path / "root", "alice")
    finally:
        os.umask(old)
    assert udir == tmp_path / "root" / "alice"
    assert _mode(tmp_path / "root") == 0o700  # nobody else can make a directory in it, nor pre-create it
    assert _mode(udir) == 0o700


def test_an_existing_user_directory_with_a_wider_mode_is_narrowed(tmp_path: Path) -> None:
    (tmp_path / "alice").mkdir(mode=0o755)
    os.chmod(tmp_path / "alice", 0o755)
    private_user_dir(tmp_path, "alice")
    assert _mode(tmp_path / "alice") == 0o700


def test_a_symlink_in_place_of_the_user_directory_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    os.chmod(elsewhere, 0o755)
    (root / getpass.getuser()).symlink_to(elsewhere)
    with pytest.raises(StoreDirError, match="symbolic link"):
        HostStore(root, job_id="job", rank=0)
    assert _mode(elsewhere) == 0o755
    assert list(elsewhere.iterdir()) == []


def test_a_symlink_as_the_store_root_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "root").symlink_to(target)
    with pytest.raises(StoreDirError, match="store root .* is a symbolic link"):
        private_user_dir(tmp_path / "root", "alice")
    assert list(target.iterdir()) == []


def test_a_file_in_place_of_the_user_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "alice").write_text("")
    with pytest.raises(StoreDirError, match="not a directory"):
        private_user_dir(tmp_path, "alice")


def test_a_root_others_may_write_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(StoreDirError, match="without the sticky bit"):
        private_user_dir(root, "alice")


@needs_root
def test_a_user_directory_another_user_created_is_refused_naming_its_owner(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o1777)
    theirs = root / getpass.getuser()
    theirs.mkdir(mode=0o777)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(StoreDirError, match=f"belongs to uid {OTHER_UID}.*neighbor_ckpt.store.dir"):
        HostStore(root, job_id="job", rank=0, versions=2)
    assert list(theirs.iterdir()) == []


@needs_root
def test_a_root_another_user_owns_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(StoreDirError, match=f"belongs to uid {OTHER_UID}.*nor to root.*neighbor_ckpt.store.dir"):
        private_user_dir(root, "alice")
    assert not (root / "alice").exists()


@needs_root
def test_a_shared_sticky_root_another_user_created_is_refused(tmp_path: Path) -> None:
    """Its owner could rename this user's directory in it and put another in its place: only root's will do."""
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o1777)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(StoreDirError, match=f"belongs to uid {OTHER_UID}.*neighbor_ckpt.store.dir"):
        private_user_dir(root, "alice")
    assert not (root / "alice").exists()


def test_a_shared_sticky_root_of_roots_is_used(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o1777)
    if os.lstat(root).st_uid != 0:
        pytest.skip("a directory owned by root needs root (CI runs as root)")
    udir = private_user_dir(root, "alice")
    assert os.lstat(udir).st_uid == os.geteuid() and _mode(udir) == 0o700


def test_the_store_of_an_earlier_release_is_found_in_the_same_place(tmp_path: Path) -> None:
    """The layout did not change (``<root>/<user>/<job>/rank<r>``): a store that an earlier release made (root and
    user directory by plain mkdir, default umask) is opened as it is, its user directory narrowed to 0700."""
    store = HostStore(tmp_path, job_id="job", rank=3)
    user = store.user_dir.name
    os.chmod(tmp_path, 0o755)
    os.chmod(tmp_path / user, 0o755)
    again = HostStore(tmp_path, job_id="job", rank=3)
    assert again.dir == tmp_path / user / "job" / "rank3"
    assert _mode(tmp_path / user) == 0o700
