"""What a rank's previous process left running on this machine.

A worker that dies abruptly (SIGKILL, the failure detector's ``os._exit``, the launcher's SIGTERM taking its
default action) runs no finalizers, so its helper processes stay behind: megatron-core's ``dist_checkpointing``
starts a ``multiprocessing`` Manager server in every process that saves, NeMo its checkpoint writers. torchrun
starts each worker in a session of its own, so those helpers are left in the dead worker's process group, orphaned,
about 200 MB each, for as long as the machine runs; every restart adds more, until the node runs out of memory.

So at startup every rank records its process in its host-store directory (which survives restarts, see
:mod:`neighbor_ckpt.snapshot.store`), and the next process of the same rank on the same machine reaps what the recorded one
left: if that process is gone, led its own process group, and the group still has members, the group is SIGKILLed.
A process group id stays reserved while any member lives, so the group can only hold the dead worker's descendants.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

from neighbor_ckpt.runtime.atomic_json import write_atomic_json
from neighbor_ckpt.runtime.private_files import read_private
from neighbor_ckpt.runtime.procs import boot_id, group_members, process_start

__all__ = ["PROCESS_FILE", "this_process", "reap_previous", "record"]

logger = logging.getLogger(__name__)

PROCESS_FILE = "process.json"
"""In a rank's store directory: the process that last ran this rank on this machine."""


def this_process() -> dict[str, Any]:
    """What :data:`PROCESS_FILE` records: pid, process group, start
    (:func:`~neighbor_ckpt.runtime.procs.process_start`), boot id."""
    pid = os.getpid()
    return {"pid": pid, "pgid": os.getpgrp(), "start": process_start(pid), "boot_id": boot_id()}


def reap_previous(rank_dir: Path, *, rank: int) -> int:
    """SIGKILL the orphaned process group of the process recorded in ``rank_dir``; returns how many processes were
    in it (0: nothing to do). Never raises: a record that cannot be read or trusted is left alone."""
    try:
        rec = json.loads(read_private(Path(rank_dir) / PROCESS_FILE, what="process record"))
        pid, pgid, boot = int(rec["pid"]), int(rec["pgid"]), str(rec["boot_id"])
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.debug("rank %d: ignoring unreadable %s: %s", rank, PROCESS_FILE, e)
        return 0
    me = this_process()
    if boot != me["boot_id"] or pid == me["pid"] or pgid != pid or pgid == me["pgid"] or pgid <= 1:
        return 0  # another machine or boot, this very process, or a worker that did not lead its own group
    start = process_start(pid)
    if start is not None:
        # The previous process still runs (the launcher will stop it): not ours to kill. Or its pid was reused,
        # which the kernel allows only once its process group is gone: the group ``pid`` now is someone else's.
        logger.debug("rank %d: previous process %d %s", rank, pid,
                     "still runs" if start == rec.get("start") else "is gone, its pid reused")
        return 0
    members = group_members(pgid)
    if not members:
        return 0
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return 0
    except PermissionError as e:
        logger.warning("rank %d: may not stop the %d leftover process(es) of its previous process (process group "
                       "%d): %s", rank, len(members), pgid, e)
        return 0
    logger.warning("rank %d: stopped %d leftover process(es) of its previous process %d (process group %d, e.g. "
                   "checkpoint writers orphaned when it died)", rank, len(members), pid, pgid)
    return len(members)


def record(rank_dir: Path) -> None:
    """Record this process in ``rank_dir`` (0600, replaced atomically)."""
    write_atomic_json(Path(rank_dir) / PROCESS_FILE, this_process())
