"""The small JSON files a rank leaves in its store directory for the next process (the restore journal, the failure
event, the data-position stop marker, the process record): readable by their owner only, replaced atomically.

:func:`write_atomic_json` writes a temporary file beside the target and renames it over the target: a process
killed mid-write leaves the previous file or none, never half of one.

Both names are opened relative to their checked directory, never through a link, and only as this user's files
(:mod:`neighbor_ckpt.runtime.private_files`).

May import: :mod:`neighbor_ckpt.runtime.private_files` (layer rule of :mod:`neighbor_ckpt.runtime`: see
:mod:`neighbor_ckpt.layers`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from neighbor_ckpt.runtime.private_files import create_private, replace_private

__all__ = ["write_atomic_json"]


def write_atomic_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path``, mode 0600, atomically (``path`` + ``.tmp``, then ``os.replace``)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = create_private(tmp)  # a leftover temporary file or a planted link is removed, never opened
    try:
        os.write(fd, json.dumps(data).encode())
    finally:
        os.close(fd)
    replace_private(tmp, path)
