"""Which attempt of a job a checkpointer belongs to: the launcher's restart count and the in-process restart.

A launcher restart (torchrun, our in-process launcher's job restart, Slurm) starts new processes and bumps ``TORCHELASTIC_RESTART_COUNT``; an
in-process restart (:mod:`neighbor_ckpt.inprocess`) calls the training function again in the same processes and the
count stays. Every record that names an attempt (the failure detector's key prefix, the failure event, the restore
journal, the recovery timeline's file) takes :class:`AttemptInfo`, so in-process attempts do not repeat each other's
keys. Without in-process recovery it is the restart count alone, written as before (an int).

May import: nothing of neighbor_ckpt.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["AttemptInfo", "RESTART_COUNT_ENV", "launcher_restart_count"]


RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
"""The launcher-level restart count, as torchrun (and our launcher, which speaks its protocol) sets it."""


def launcher_restart_count() -> int:
    """``TORCHELASTIC_RESTART_COUNT`` (0 when unset: the first attempt, or no torchelastic launcher)."""
    return int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)


@dataclass(frozen=True)
class AttemptInfo:
    """One attempt of the job as this process sees it (given by :class:`~neighbor_ckpt.inprocess.InprocessRecovery`
    under in-process recovery, else :meth:`from_env`)."""

    launch: int = 0
    """The launcher's restart count (``TORCHELASTIC_RESTART_COUNT``)."""
    inprocess: int = 0
    """The in-process restart iteration within this launch (0: the training function's first call)."""
    activated_spare: bool = False
    """This process was started as an idle hot spare and becomes active in this attempt (it holds no state of the
    rank it now is)."""
    failure_noticed_unix: float | None = None
    """In-process restarts: when this process noticed the failure of the previous in-process attempt (the engine
    began its abort; None: not known, or this process was not part of it)."""
    abort_end_unix: float | None = None
    """In-process restarts: when this process's abort of the previous attempt ended (its process groups freed)."""
    fault_unix: float | None = None
    """In-process restarts: when the previous attempt's fault happened, as its earliest witness saw it (a launcher the
    exit of its process, a monitor a silent peer's last heartbeat; None: unknown). The recovery timeline's *detect*
    starts here."""
    fault_what: str | None = None
    """Which event :attr:`fault_unix` is, in words (``exit of process 1 seen by its launcher (node1)``)."""
    fault_lookup: Callable[[], tuple[float, str] | None] | None = field(default=None, compare=False, repr=False)
    """In process: asks the store again for the previous attempt's earliest fault witness (a launcher's record can
    arrive after the survivors re-formed: they noticed the lost peer first). See :meth:`fault`."""
    progress_sink: Callable[[Callable[[], tuple[int, int | None, str]]], None] | None = \
        field(default=None, compare=False, repr=False)
    """In process: where the checkpointer hands its progress tag (the engine's monitor thread is the failure
    detector there, for the process's whole life)."""

    @classmethod
    def from_env(cls) -> AttemptInfo:
        return cls(launch=launcher_restart_count())

    def fault(self) -> tuple[float, str] | None:
        """``(unix, what)`` of the previous attempt's fault as its earliest witness saw it: asked again now when the
        engine gave a lookup (never raises), else as known when this attempt began; None when unknown."""
        if self.fault_lookup is not None:
            try:
                found = self.fault_lookup()
            except Exception:  # noqa: BLE001 - a store that does not answer now: what was known at the start
                found = None
            if found is not None and (self.fault_unix is None or found[0] <= self.fault_unix):
                return found
        return None if self.fault_unix is None else (self.fault_unix, self.fault_what or "")

    @property
    def restarted(self) -> bool:
        """Not the job's first attempt: the launcher restarted it, or it restarted in process."""
        return self.launch > 0 or self.inprocess > 0

    @property
    def label(self) -> str:
        """``"<launch>"``, or ``"<launch>.<inprocess>"`` for an in-process restart: store keys and file names."""
        return str(self.launch) if self.inprocess == 0 else f"{self.launch}.{self.inprocess}"

    @property
    def record(self) -> int | str:
        """The attempt as written in JSON records: the restart count (an int, as before in-process recovery existed),
        or :attr:`label` for an in-process restart."""
        return self.launch if self.inprocess == 0 else self.label

    @property
    def ordinal(self) -> int:
        """An int that is > 0 exactly when :attr:`restarted` (for interfaces that take a restart count)."""
        return self.launch + self.inprocess

    def __str__(self) -> str:
        return self.label
