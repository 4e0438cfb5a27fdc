"""The launcher's children as processes (:mod:`neighbor_ckpt.inprocess.launcher` runs them): each dies with its
launcher (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set between fork and exec), is signalled as its own session's process
group, and a pid another process recorded beside it is SIGKILLed only when it is the same process on this node and
carries this launch's run tag (:func:`recorded_pid_to_kill`).

**Why plain** :class:`subprocess.Popen` **and not torch.distributed.elastic's pieces.** ``start_processes``'s
``PContext`` runs a fixed set of processes as one group (``wait()`` fails the group when one fails, ``close()`` stops
them all): no replacement started into a running group, no running on after one died, the whole point here.
``SubprocessHandler``'s constructor takes no ``preexec_fn`` (the parent-death signal) short of overriding its private
``_popen``. So: ``Popen`` with ``start_new_session=True`` and that ``preexec_fn``; the processes write to the
launcher's stdout and stderr (the launch log), as ``ft_launcher``'s workers did.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
from typing import Callable, Mapping, Optional, Sequence

__all__ = ["child_setup", "signal_group", "recorded_pid_to_kill", "drop_staged"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Optional[Callable[..., int]]:
    """libc's ``prctl``, resolved here in the parent (the child between fork and exec only calls it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def child_setup(parent: int) -> None:
    """In the child, between fork and exec: die with the launcher (SIGKILL when it is gone)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the launcher died before prctl: the signal will never come
        os._exit(1)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to ``proc``'s process group (its own session), or to ``proc`` if the group is gone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def recorded_pid_to_kill(raw: Optional[bytes], *, node: str, child: int, tag: Optional[str] = None) -> Optional[int]:
    """The pid of a ``proc/<p>`` record (JSON ``{"pid", "node", "start"}``) that a launcher of ``node`` may SIGKILL
    beside its ``child``: another process, recorded on this node, running as this launcher's user, whose start time
    is the one recorded (the same process, not a pid reused since), and whose environment carries this launch's run
    tag ``tag`` (default: the one this launcher gives its children,
    :func:`~neighbor_ckpt.runtime.procs.launch_run_tag`; :data:`~neighbor_ckpt.runtime.procs.RUN_TAG_ENV`). None
    otherwise, with one line in the log for a process of this node that fails the user or the tag check: whoever can
    write the record (a job process, or anyone the store lets in) names no process outside the job, neither another
    user's nor one of this user's that this launch did not start (a shell, another job).

    Why the tag and not the run id (:data:`~neighbor_ckpt.inprocess.protocol.ENV_RUN_ID`, which every child carries
    too): see :data:`~neighbor_ckpt.runtime.procs.RUN_TAG_ENV`; in short, the run id is chosen by whoever starts the
    launch and repeats across launches of one job file, the tag is drawn per launch."""
    from neighbor_ckpt.runtime.procs import launch_run_tag, process_start, process_uid, tag_refusal

    try:
        rec = json.loads(raw) if raw else None
        other, start = int(rec["pid"]), rec.get("start")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if other == child or rec.get("node") != node or start is None:
        return None
    if process_uid(other) != os.getuid():
        logger.warning("the pid recorded beside process pid %d (%d) runs as another user: not signalled", child,
                       other)
        return None
    if process_start(other) != start:
        return None
    why = tag_refusal(other, tag or launch_run_tag())
    if why is not None:
        logger.warning("the pid recorded beside process pid %d (%d) is not signalled: %s", child, other, why)
        return None
    return other


def drop_staged(pids: Sequence[int], started: Mapping[int, Optional[str]]) -> None:
    """Remove the slots these processes staged as idle hot spares (``started``: pid -> its
    ``NEIGHBOR_CKPT_STORE_DIR``): a spare SIGKILLed, or stopped by its launcher's SIGTERM, runs no clean-up of its own,
    and a staged slot is a full slot of /dev/shm."""
    from neighbor_ckpt.config import DEFAULT_STORE_DIR, expand_store_dir
    from neighbor_ckpt.snapshot.store import remove_staged_slots

    for pid in pids:
        root = expand_store_dir(started.get(pid) or DEFAULT_STORE_DIR)
        for path in remove_staged_slots(root, [pid]):
            logger.info("removed %s, staged by process %d, which exited", path, pid)
