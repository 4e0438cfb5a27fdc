"""The one writer of the small JSON files a rank leaves for the next process (restore journal, failure event,
data-position stop marker, process record): 0600, atomic."""

from __future__ import annotations

import json
import os
import stat

from neighbor_ckpt.runtime.atomic_json import write_atomic_json


def test_written_file_is_0600_json_and_no_temporary_file_is_left(tmp_path):
    path = tmp_path / "f.json"
    write_atomic_json(path, {"a": 1, "b": [2, 3]})
    assert json.loads(path.read_text()) == {"a": 1, "b": [2, 3]}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_a_leftover_temporary_file_of_another_mode_does_not_make_the_file_readable_by_others(tmp_path):
    """O_CREAT's mode applies only to a file it creates: a temporary file left 0644 by a killed writer is reused,
    and the fchmod makes it 0600 before the rename."""
    path = tmp_path / "f.json"
    tmp = tmp_path / "f.json.tmp"
    tmp.write_text("half of a")
    os.chmod(tmp, 0o644)
    write_atomic_json(path, {"iteration": 7})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"iteration": 7} and not tmp.exists()


def test_every_writer_of_these_files_uses_it():
    """datacheck's stop marker and the reaper's process record had their own copies of this writer without the
    fchmod: all of them use the shared one now."""
    import neighbor_ckpt.recovery.datacheck as datacheck
    import neighbor_ckpt.recovery.journal as journal
    import neighbor_ckpt.runtime.reaper as reaper

    for module in (datacheck, journal, reaper):
        assert module.write_atomic_json is write_atomic_json, module.__name__
