"""The small JSON files a rank leaves in its store directory for the next process (the restore journal, the failure
event, the data-position stop marker, the process record): readable by their owner only, replaced atomically.

:func:`write_atomic_json` writes a temporary file beside the target and renames it over the target: a process
killed mid-write leaves the previous file or none, never half of one.

May import: nothing of :mod:`neighbor_ckpt` (layer rule of :mod:`neighbor_ckpt.runtime`: see
:mod:`neighbor_ckpt.layers`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["write_atomic_json"]


def write_atomic_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path``, mode 0600, atomically (``path`` + ``.tmp``, then ``os.replace``)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a leftover temporary file
        os.write(fd, json.dumps(data).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
