"""When a launcher's child processes exited, as the kernel tells it, not when the launcher's loop next looked.

A launcher reaps its children between store operations (reports, the dead list, grow-back), which take a while on a
loaded machine or during a failover; the time it *reaps* a killed process can be well after the kill. The recovery
timeline starts at the fault as its earliest witness saw it (:mod:`neighbor_ckpt.report.timeline`), so the launcher
timestamps each exit as it happens: one pidfd per child (``os.pidfd_open``, Linux 5.3), all in one epoll, one daemon
thread waiting on it. Where pidfds are not available the launcher falls back to the time it reaps the child.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Optional

__all__ = ["ExitClock", "EXIT_CLOCK_THREAD"]

logger = logging.getLogger(__name__)

EXIT_CLOCK_THREAD = "neighbor_ckpt-exit-clock"


class ExitClock:
    """The exit times of the processes :meth:`watch` was given (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}
        """pidfd -> pid, for the processes still running."""
        self._seen: dict[int, float] = {}
        self._epoll: Optional[select.epoll] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def watch(self, pid: int) -> None:
        """Time ``pid``'s exit from now on (a child of this process, just started). Best effort: without pidfds the
        exit is timed when it is reaped."""
        if not hasattr(os, "pidfd_open") or not hasattr(select, "epoll"):
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError as e:  # an old kernel, or a process already gone (reaped: nothing to time)
            logger.debug("no pidfd for process %d: %s", pid, e)
            return
        with self._lock:
            if self._closed:
                os.close(fd)
                return
            if self._epoll is None:
                self._epoll = select.epoll()
                self._thread = threading.Thread(target=self._run, name=EXIT_CLOCK_THREAD, daemon=True)
                self._thread.start()
            self._fds[fd] = pid
            self._epoll.register(fd, select.EPOLLIN)

    def seen(self, pid: int) -> Optional[float]:
        """When ``pid`` exited (unix seconds), if it was watched and has exited."""
        with self._lock:
            return self._seen.get(pid)

    def close(self) -> None:
        """Stop watching (the thread ends within a tenth of a second)."""
        with self._lock:
            self._closed = True

    def _run(self) -> None:
        assert self._epoll is not None  # noqa: S101 - set before the thread starts
        while True:
            events = self._epoll.poll(0.1)
            now = time.time()
            with self._lock:
                for fd, _ in events:
                    pid = self._fds.pop(fd, None)
                    self._epoll.unregister(fd)
                    os.close(fd)
                    if pid is not None:
                        self._seen[pid] = now
                if self._closed:
                    for fd in self._fds:
                        os.close(fd)
                    self._fds.clear()
                    self._epoll.close()
                    return
