"""The launchers' counts in the store, idempotent through a retry and a failover.

A write through :class:`~neighbor_ckpt.inprocess.stores.StoreSet` may be applied more than once: an operation whose
reply did not come within the store timeout is sent again (the first one may have been applied: only its reply was
lost), and after a failover a launcher writes its facts again on the new store while the same write may still wait
in its queue, to be sent there once more. A counter bumped with ``add`` would count such a write twice (an ``exited``
that reaches ``processes`` early is a premature give-up). So every count a launcher keeps in the store is a *set*:

``exited``
    ``"<p>,"`` per process that exited (any status), appended by its launcher (or by the launcher that declared it
    dead for a node that never came, :mod:`~neighbor_ckpt.inprocess.roll_call`); read as a set of process indices.
``processes``
    How many process indices were handed out; only ever raised to a maximum (``compare_set`` from what was read), so
    writing it again is harmless. A replacement's index is *claimed*: ``index/<i>`` set from empty to the claim's
    write id (node, launcher pid, attempt, sequence number), the first free ``i`` from ``N`` on; a retried claim
    finds its own id there and takes that index, not the next one.
``nodes`` / ``joined``
    The node ids of the launchers that started an attempt / joined its restart rendezvous (the restart waits until
    every launcher joined: :mod:`~neighbor_ckpt.inprocess.restart_rendezvous`), read as sets.

Pure helpers and small store functions over a :class:`~neighbor_ckpt.inprocess.stores.StoreView` (or any store with
``get``, ``check``, ``append`` and ``compare_set``); ``tests/unit/test_launch_counts.py`` and, against a store host
that drops replies, ``tests/multiproc/test_idempotent_writes.py``."""

from __future__ import annotations

from typing import Any, Iterable

from neighbor_ckpt.inprocess.generation import parse_list
from neighbor_ckpt.inprocess.protocol import key

__all__ = ["id_list", "read_ids", "mark_exited", "exited", "raise_processes", "handed_out", "claim_index",
           "everyone_exited"]


def id_list(ids: Iterable[int]) -> str:
    """``{3, 1}`` -> ``"1,3,"`` (what one append of a set of process indices writes)."""
    return "".join(f"{i}," for i in sorted(set(ids)))


def read_ids(s: Any, k: str) -> set[int]:
    """The set of process indices appended under ``k`` (empty when absent)."""
    return set(parse_list(s.get(k))) if s.check([k]) else set()


def mark_exited(s: Any, indices: Iterable[int]) -> None:
    """``indices`` exited (any status): appended to ``exited``; writing the same index again changes nothing."""
    text = id_list(indices)
    if text:
        s.append("exited", text)


def exited(s: Any) -> set[int]:
    """The processes of the attempt that exited."""
    return read_ids(s, "exited")


def handed_out(s: Any) -> int:
    """``processes`` (0 when not set yet)."""
    raw = s.get("processes") if s.check(["processes"]) else b""
    return int(raw) if raw else 0


def raise_processes(s: Any, want: int) -> int:
    """``processes`` to at least ``want`` (never lowered); returns its value."""
    while True:
        cur = s.get("processes") if s.check(["processes"]) else b""
        if cur and int(cur) >= want:
            return int(cur)
        if s.compare_set("processes", cur, str(want)) == str(want).encode():
            return want


def claim_index(s: Any, write_id: str, first: int) -> int:
    """A new process index for a replacement: the first ``index/<i>`` from ``first`` (the launch's ``N``) on that
    was free or holds ``write_id`` already (a retried claim, or the same claim made again after its reply was lost),
    set to ``write_id``; ``processes`` raised past it. (One ``compare_set`` per replacement of the attempt so far.)"""
    i = first
    while True:
        got = s.compare_set(key("index", i), "", write_id)
        if (got.decode(errors="replace") if isinstance(got, bytes) else str(got)) == write_id:
            raise_processes(s, i + 1)
            return i
        i += 1


def everyone_exited(s: Any) -> bool:
    """Every process index handed out (``0..processes-1``) has exited: no process of the attempt is left."""
    n = handed_out(s)
    return n > 0 and set(range(n)) <= exited(s)
