"""What NVIDIA resiliency-ext's in-process restart (``nvidia_resiliency_ext.inprocess``) needs on CPU / gloo.

NVRx 0.4.1 is written for NCCL on GPUs. Measured on CPU with gloo (``/work/shared/notes/cpu-stack.md``):

* **gloo has no working abort.** ``AbortTorchDistributed`` (the default) skips non-NCCL groups, and neither
  ``_abort_process_group()``, ``backend.abort()`` nor ``destroy_process_group()`` from another thread frees a main
  thread blocked in a gloo collective: it waits for gloo's own timeout. Shutting down this process's own
  ESTABLISHED TCP connections (except those to the stores) makes the blocked call raise within ~10 ms:
  :class:`AbortGlooSockets`, composed *before* ``AbortTorchDistributed`` (``Compose`` runs right to left, see
  :func:`gloo_abort`).
* ``ThreadedFinalize`` raises "CUDA is not available"; megatron-core's ``parallel_state`` must be dropped between
  restart iterations or ``initialize_model_parallel`` refuses ("data parallel group is already initialized"):
  :class:`FinalizeMegatron` calls ``destroy_model_parallel()`` after the abort.
* The wrapper's ``TCPStore`` is hosted by rank 0 (killing rank 0 takes it down) and lists rank 0 as critical, so
  rank 0 waits forever at exit for ranks that died. :class:`ClientPrefixStore` is a pure client of a store hosted
  elsewhere (a separate long-lived process), under a key prefix (one per launcher attempt: the store outlives a
  launcher-level restart), with no critical rank.

Each piece is an NVRx interface class (``Abort``, ``Finalize``, ``StoreMixin``), applied by passing it to
``inprocess.Wrapper``: nothing in NVRx or megatron-core is modified, so there is nothing to undo.
:func:`check_nvrx_version` refuses an NVRx release these were not written against (``ft_launcher
--ft-restart-policy min-healthy``, which keeps other agents' workers alive, was removed after 0.4.1).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch

from megatron_patches._versions import _describe, _matches
from neighbor_ckpt.errors import UnsupportedVersionError

__all__ = ["NVRX_SUPPORTED", "check_nvrx_version", "shutdown_tcp_connections", "AbortGlooSockets",
           "FinalizeMegatron", "ClientPrefixStore", "gloo_abort"]

logger = logging.getLogger(__name__)

NVRX_SUPPORTED: tuple[str, ...] = ("0.4.1",)
"""nvidia-resiliency-ext releases these classes were written against (read: inprocess/{wrap,abort,store,
rank_assignment}.py, fault_tolerance/launcher.py)."""


def check_nvrx_version() -> str:
    """The installed nvidia-resiliency-ext version; :class:`UnsupportedVersionError` unless supported."""
    try:
        version = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedVersionError(
            f"nvidia-resiliency-ext is not installed; in-process recovery needs nvidia-resiliency-ext "
            f"{_describe(NVRX_SUPPORTED)}. Install it: pip install nvidia-resiliency-ext==0.4.1") from None
    if not _matches(version, NVRX_SUPPORTED):
        raise UnsupportedVersionError(
            f"nvidia-resiliency-ext {version} is installed, but neighbor_ckpt's in-process recovery supports "
            f"{_describe(NVRX_SUPPORTED)} only (its gloo abort, store and launcher policy depend on that release; "
            f"'ft_launcher --ft-restart-policy min-healthy' was removed upstream after 0.4.1). "
            f"Pin it: pip install nvidia-resiliency-ext==0.4.1")
    return version


def shutdown_tcp_connections(keep_ports: Iterable[int]) -> int:
    """``shutdown(SHUT_RDWR)`` every ESTABLISHED TCP connection of this process whose local or remote port is not in
    ``keep_ports``; returns how many. A gloo send/recv blocked on such a socket fails at once ("Connection reset" /
    "closed by peer"), in this process and, through the FIN, in its peers. The file descriptors stay open (their
    owners close them); only a duplicate is closed here."""
    import psutil  # an undeclared dependency of megatron-core's dist_checkpointing; installed with it

    keep = {int(p) for p in keep_ports}
    n = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or conn.fd is None or conn.fd < 0:
            continue
        lport = conn.laddr.port if conn.laddr else None
        rport = conn.raddr.port if conn.raddr else None
        if lport in keep or rport in keep:
            continue
        try:
            s = socket.socket(fileno=os.dup(conn.fd))
        except OSError:
            continue  # closed meanwhile
        try:
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.close()
    return n


def _nvrx() -> Any:
    check_nvrx_version()
    from nvidia_resiliency_ext import inprocess

    return inprocess


def _abort_base() -> type:
    _nvrx()
    from nvidia_resiliency_ext.inprocess.abort import Abort

    return Abort


def _finalize_base() -> type:
    _nvrx()
    from nvidia_resiliency_ext.inprocess.finalize import Finalize

    return Finalize


def _make_abort_class() -> type:
    Abort = _abort_base()

    class AbortGlooSockets(Abort):  # type: ignore[misc, valid-type]
        """NVRx ``Abort`` that frees gloo collectives blocked in this process (see the module docstring).

        ``keep_ports``: the store ports (the wrapper's and the application's TCP store) whose connections must stay
        up. ``on_event(name, unix_time)``: called at the start and the end (for the recovery timeline)."""

        def __init__(self, keep_ports: Iterable[int],
                     on_event: Callable[[str, float], None] | None = None) -> None:
            self.keep_ports = frozenset(int(p) for p in keep_ports)
            self.on_event = on_event
            self.last_count = 0
            self.last_seconds = 0.0

        def __call__(self, state: Any) -> Any:
            t0 = time.time()
            if self.on_event is not None:
                self.on_event("abort_start", t0)
            self.last_count = shutdown_tcp_connections(self.keep_ports)
            self.last_seconds = time.time() - t0
            logger.debug("AbortGlooSockets: shut down %d TCP connection(s) in %.1f ms", self.last_count,
                         self.last_seconds * 1e3)
            return state

    return AbortGlooSockets


def _make_finalize_class() -> type:
    Finalize = _finalize_base()

    class FinalizeMegatron(Finalize):  # type: ignore[misc, valid-type]
        """NVRx ``Finalize`` for CPU: run the attempt's clean-ups (``cleanups()`` returns callables, run last first;
        e.g. closing the snapshot engine once the abort has freed its threads), then drop megatron-core's
        ``parallel_state``, its num-microbatches calculator (NeMo's data sampler refuses to set up a second one, and
        an elastic shrink needs another number of micro-batches per rank) and any process group left. An exception
        here makes the wrapper give up (the process exits and the launcher restarts the job), which is the right
        outcome for a process we cannot clean."""

        def __init__(self, cleanups: Callable[[], list[Callable[[], None]]] | None = None,
                     on_event: Callable[[str, float], None] | None = None) -> None:
            self.cleanups = cleanups
            self.on_event = on_event

        def __call__(self, state: Any) -> Any:
            for fn in reversed(self.cleanups() if self.cleanups is not None else []):
                fn()
            try:
                from megatron.core import parallel_state
            except ImportError:
                parallel_state = None
            if parallel_state is not None:
                parallel_state.destroy_model_parallel()
                from megatron.core import num_microbatches_calculator

                num_microbatches_calculator.destroy_num_microbatches_calculator()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            if self.on_event is not None:
                self.on_event("finalize_end", time.time())
            return state

    return FinalizeMegatron


_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    # The NVRx base classes are resolved on first use (NVRx imports torch.distributed internals and pynvml).
    makers = {"AbortGlooSockets": _make_abort_class, "FinalizeMegatron": _make_finalize_class,
              "ClientPrefixStore": _make_store_class}
    if name in makers:
        if name not in _CLASSES:
            _CLASSES[name] = makers[name]()
        return _CLASSES[name]
    raise AttributeError(f"module 'megatron_patches.nvrx_gloo' has no attribute {name!r}")


def _make_store_class() -> type:
    _nvrx()
    from nvidia_resiliency_ext.inprocess.store import StoreMixin

    class ClientPrefixStore(torch.distributed.PrefixStore, StoreMixin):  # type: ignore[misc, valid-type]
        """NVRx wrapper store: a client of the TCP store at ``host_name:port`` (hosted by a separate long-lived
        process), every key under ``prefix``; no critical rank (nobody waits for the dead at exit). Constructed by
        the wrapper and by its monitor process from ``store_kwargs``."""

        def __init__(self, host_name: str, port: int, prefix: str,
                     timeout: timedelta = timedelta(seconds=300)) -> None:
            self.base_store = torch.distributed.TCPStore(host_name, int(port), is_master=False, timeout=timeout,
                                                         wait_for_workers=False, use_libuv=True)
            super().__init__(prefix, self.base_store)

        @property
        def critical_ranks(self) -> tuple[int, ...]:
            return ()

    # picklable by reference (the monitor process is forked, but keep the name importable)
    ClientPrefixStore.__module__ = __name__
    ClientPrefixStore.__qualname__ = "ClientPrefixStore"
    return ClientPrefixStore


def gloo_abort(keep_ports: Iterable[int], on_event: Callable[[str, float], None] | None = None) -> Any:
    """The abort for gloo: sockets first, then NVRx's ``AbortTorchDistributed`` (destroys every process group)."""
    inprocess = _nvrx()
    from nvidia_resiliency_ext.inprocess.abort import Abort, AbortTorchDistributed

    AbortGlooSockets = __getattr__("AbortGlooSockets")
    parts = [AbortTorchDistributed(), AbortGlooSockets(keep_ports, on_event)]
    if on_event is not None:
        class _AbortDone(Abort):  # type: ignore[misc, name-defined]
            def __call__(self, state: Any) -> Any:
                on_event("abort_end", time.time())
                return state

        parts.insert(0, _AbortDone())
    return inprocess.Compose(*parts)
