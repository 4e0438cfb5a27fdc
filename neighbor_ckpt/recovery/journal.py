"""What a rank writes into its store directory so that the *next* process knows what happened to this one.

Two small files survive a restart because the store does (shared memory, same node):

* the restore journal (:data:`RESTORE_JOURNAL`): written before a restored state is loaded, removed when the first
  step after it completes. Found by the next attempt, it means that state was restored once and its attempt died
  before finishing a step: it is never chosen again (without this, a state that crashes the job on load, or on the
  first step, would be restored forever: a restart loop);
* the failure event (:data:`EVENTS_FILE`): the wall-clock time a survivor noticed the failure, the start of the
  next recovery's timeline (:mod:`neighbor_ckpt.report.timeline`), and the survivor's in-flight step with the
  fingerprint of its input (``"input"``, :mod:`neighbor_ckpt.recovery.datacheck`).

Both are plain JSON, mode 0600, written atomically (temporary file + rename): a process killed mid-write leaves
the previous file or none, never half of one.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from neighbor_ckpt.errors import StoreDirError
from neighbor_ckpt.runtime.atomic_json import write_atomic_json
from neighbor_ckpt.runtime.private_files import read_private

__all__ = ["RESTORE_JOURNAL", "EVENTS_FILE", "RestoreJournal", "record_failure_event", "take_failure_event",
           "read_failure_input"]

logger = logging.getLogger(__name__)

RESTORE_JOURNAL = "restoring.json"
"""In a rank's store directory while a restored state has not yet completed a step (restart-loop guard)."""

EVENTS_FILE = "events.json"
"""Per-rank file in the rank's store directory (mode 0600, JSON) where a survivor records the failure."""


class RestoreJournal:
    """The restore journal of one rank: "a restored state whose attempt dies before completing a step is never
    chosen again".

    The journal is local; the verdict is collective: the iterations named by *any* rank's journal are excluded on
    every rank (a state that crashed one rank crashed the job). The all-gather that makes it collective is issued
    by :class:`~neighbor_ckpt.recovery.recoverer.Recoverer`, with the other recovery collectives.
    """

    def __init__(self, store_dir: Path, *, rank: int) -> None:
        self.path = store_dir / RESTORE_JOURNAL
        self.rank = rank
        self._open = False

    @property
    def open(self) -> bool:
        """This process restored a state and no step has completed since."""
        return self._open

    def read(self) -> int | None:
        """The iteration a previous attempt restored without completing a step after it (None: no journal).

        An unreadable journal is reported and ignored: it guards against a loop, it must not stop a restore."""
        try:
            return int(json.loads(read_private(self.path, what="restore journal"))["iteration"])
        except FileNotFoundError:
            return None
        except StoreDirError as e:  # a link or another user's file: refused, nothing of it read
            logger.error("rank %d: refusing the restore journal: %s", self.rank, e)
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("rank %d: ignoring unreadable restore journal %s: %s", self.rank, self.path, e)
            return None

    def begin(self, iteration: int, *, attempt: int) -> None:
        """Written before the restored state of ``iteration`` is loaded (a load that kills the process counts)."""
        write_atomic_json(self.path, {"iteration": iteration, "attempt": attempt})
        self._open = True

    def clear(self) -> None:
        """The restored state proved itself (a step completed), or nothing was restored."""
        self._open = False
        self.path.unlink(missing_ok=True)

    def step_completed(self) -> None:
        """Per-step hook: the first completed step after a restore closes the journal (cheap otherwise)."""
        if self._open:
            self.clear()


def record_failure_event(path: Path, *, rank: int, attempt: int | str, reason: str, when: float,
                         inflight_input: dict[str, object] | None = None) -> None:
    """Write ``{"failure_noticed_unix": when, ...}`` to ``path`` (0600, atomic). Never raises: it runs on the
    failure path (a signal handler, the detector's thread), where the original error must stay visible.

    ``inflight_input``: the in-flight step and its input fingerprint (``{"step": i, "fp": hex}``), kept as
    ``"input"``."""
    data: dict[str, object] = {"rank": rank, "attempt": attempt, "pid": os.getpid(), "failure_noticed_unix": when,
                               "reason": reason[:200]}
    if inflight_input is not None:
        data["input"] = inflight_input
    try:
        write_atomic_json(path, data)
    except OSError as e:
        logger.warning("rank %d: could not record the failure time in %s: %s", rank, path, e)


def take_failure_event(path: Path, *, not_after: float) -> float | None:
    """Read and delete a failure event recorded by :func:`record_failure_event` in a previous process.

    Returns its time, or None when absent, unreadable, or not earlier than ``not_after`` (this process'
    start: an event can only come from before it). Deleted even when unusable, so it is never read twice."""
    try:
        raw = read_private(path, what="failure event")
    except StoreDirError as e:
        logger.error("refusing the failure event: %s", e)
        return None
    except OSError:
        return None
    try:
        path.unlink()
    except OSError:
        pass
    try:
        data = json.loads(raw)
        when = float(data["failure_noticed_unix"])
    except (ValueError, KeyError, TypeError):
        logger.warning("ignoring unreadable failure event %s", path)
        return None
    return when if math.isfinite(when) and when <= not_after else None


def read_failure_input(path: Path) -> dict[str, object] | None:
    """The ``"input"`` of a failure event (``{"step": i, "fp": hex}``), without consuming the event (None: no event,
    unreadable, or none recorded). Read before :func:`take_failure_event` deletes it."""
    try:
        value = json.loads(path.read_bytes()).get("input")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, dict) else None
