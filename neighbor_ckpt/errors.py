"""Typed errors of neighbor_ckpt.

Every error a user can trigger is a :class:`NeighborCkptError`. Messages say what happened, on which
rank, and what the user can do about it.
"""

from __future__ import annotations

__all__ = [
    "NeighborCkptError",
    "ConfigError",
    "SnapshotError",
    "SnapshotCorruptError",
    "SnapshotMismatchError",
    "HostMemoryError",
    "StoreDirError",
    "TransportError",
    "NoRecoverableStateError",
    "TopologyError",
    "UnsupportedVersionError",
    "UnsupportedPlatformError",
    "CallOrderError",
    "DataPositionError",
]


class NeighborCkptError(Exception):
    """Base class of every error raised by neighbor_ckpt."""


class ConfigError(NeighborCkptError, ValueError):
    """A configuration key or value is invalid. The message names the key path."""


class TopologyError(NeighborCkptError, ValueError):
    """Process groups / ranks do not form a layout neighbor_ckpt can work with."""


class SnapshotError(NeighborCkptError):
    """A snapshot cannot be used."""


class SnapshotCorruptError(SnapshotError):
    """A snapshot's bytes are torn, truncated or fail their checksum: it is never loaded."""


class SnapshotMismatchError(SnapshotError):
    """A snapshot is intact but belongs to another job, layout or parallel configuration."""


class HostMemoryError(NeighborCkptError):
    """The host store does not fit in the shared-memory filesystem or the node's memory."""


class StoreDirError(NeighborCkptError, PermissionError):
    """The host store's directory is not safe to use: a link, or a directory another user created or can replace.
    The message names the directory, its owner, and the setting that picks another one."""


class TransportError(NeighborCkptError):
    """Streaming a snapshot to / from a neighbor failed."""


class NoRecoverableStateError(NeighborCkptError):
    """No complete in-memory version exists and no insurance checkpoint is available."""


class UnsupportedVersionError(NeighborCkptError):
    """An installed megatron-core / NeMo version is not one whose internals neighbor_ckpt was built against.

    The message names the installed version, the supported ones, and the pin (or extra) to install.
    """


class UnsupportedPlatformError(NeighborCkptError):
    """A facility was asked for on a platform it must not run on (e.g. the CPU shim on a CUDA machine)."""


class DataPositionError(NeighborCkptError):
    """After a recovery, the replayed step's input differs from the input that step had before the failure: the data
    position (sampler, loader state, shuffle seed) was not restored, and training on would silently diverge.

    Raised under ``neighbor_ckpt.data_check: error`` (the default); the message names the step, the rank and what to
    do. Attributes: ``step``, ``rank``, ``expected`` and ``actual`` (the xxh3-64 fingerprints)."""

    def __init__(self, message: str, *, step: int = -1, rank: int = -1, expected: int | None = None,
                 actual: int | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.rank = rank
        self.expected = expected
        self.actual = actual


class CallOrderError(NeighborCkptError, RuntimeError):
    """A method was called before the one it depends on (``snapshot()`` before ``recover()``). The message names
    the call to make first."""
