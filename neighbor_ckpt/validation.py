"""The one validation mechanism: every problem of a file or of an input, one line each, in one ``ConfigError``.

Used by the ``neighbor_ckpt:`` section (:mod:`neighbor_ckpt.config`), job files
(:mod:`neighbor_ckpt.planning.jobspec`), and the planner's and goodput model's inputs. Three parts:

* :class:`Problems` collects ``<key path>: <what is wrong>`` lines. Its rule helpers (:meth:`~Problems.at_least`,
  :meth:`~Problems.positive`, :meth:`~Problems.integer`, ...) record one line when a value breaks the rule;
  :meth:`~Problems.ok` tells whether a key has a problem already, so a rule that combines keys (``tensor`` must
  divide the heads) runs only on clean inputs; :meth:`~Problems.raise_if_any` raises them all at once.
* A dataclass states its value rules in a ``_check(self, p: Problems)`` method; :func:`validate` runs it and the
  ``_check`` of every nested dataclass field, each under its key path, and raises once. Call it from
  ``__post_init__`` with the path the object is known by (``validate(self, "neighbor_ckpt")``).
* :func:`from_dict` builds a dataclass from a mapping (a YAML document): unknown keys (a class lists keys it renamed
  in ``_renamed: ClassVar[dict[str, str]]``), wrong types, values outside a ``Literal``, then the ``_check`` rules
  of the whole tree, all under their key paths. :func:`to_dict` is its inverse.
* :func:`checked` makes a dataclass's constructor hold to the same rules as :func:`from_dict`, with the same
  messages: unknown (or renamed) keyword arguments, wrong types (a nested section given as a mapping is built from
  it, as from a YAML document), then the ``_check`` rules. ``NeighborCkptConfig(store={"versions": 1})`` raises
  ``neighbor_ckpt.store.versions: 1 must be >= 2``, ``NeighborCkptConfig(job_id=5)`` raises
  ``neighbor_ckpt.job_id: expected a string, got 5``.

Example: ``from_dict(NeighborCkptConfig, {"store": {"versions": 1}, "transport": {"chunk_mb": "8", "chunk": 1}},
"neighbor_ckpt")`` raises one :class:`ConfigError` whose message is::

    neighbor_ckpt.transport.chunk_mb: expected a number, got '8'
    neighbor_ckpt.transport.chunk: unknown key (allowed keys of neighbor_ckpt.transport: chunk_mb, ...)
    neighbor_ckpt.store.versions: 1 must be >= 2

May import: :mod:`neighbor_ckpt.errors` only.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
import types
import typing
from typing import Any, Iterator, Literal

from neighbor_ckpt.errors import ConfigError

__all__ = ["Problems", "validate", "check_tree", "check_types", "checked", "deferred", "from_dict", "to_dict"]

_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("neighbor_ckpt_validation_deferred", default=False)


class Problems:
    """Problems found so far, each ``<key path>: <message>``; scopes made by :meth:`at` share one list.

    Args:
        path: key path of the scope (``neighbor_ckpt``, ``config``); ``""`` for function arguments.
    """

    __slots__ = ("path", "_lines")

    def __init__(self, path: str = "", *, _lines: list[tuple[str, str]] | None = None) -> None:
        self.path = path
        self._lines: list[tuple[str, str]] = [] if _lines is None else _lines

    def _key(self, key: str | object) -> str:
        key = str(key)
        if not key:
            return self.path
        if not self.path or key.startswith("["):
            return self.path + key
        return f"{self.path}.{key}"

    def at(self, key: str) -> Problems:
        """The scope of a nested key (``p.at("store")``): what it records lands in the same list."""
        return Problems(self._key(key), _lines=self._lines)

    def add(self, key: str | object, message: str) -> None:
        """Record one problem of ``key`` (``""``: of this scope itself)."""
        self._lines.append((self._key(key), message))

    def check(self, ok: bool, key: str, message: str) -> bool:
        """Record ``message`` for ``key`` unless ``ok``; returns ``ok``."""
        if not ok:
            self.add(key, message)
        return ok

    def ok(self, *keys: str) -> bool:
        """No problem recorded at or under any of ``keys`` (none given: anywhere in this scope)."""
        for full in [self._key(k) for k in keys] or [self.path]:
            for path, _ in self._lines:
                if not full or path == full or path.startswith((full + ".", full + "[")):
                    return False
        return True

    @property
    def lines(self) -> list[str]:
        """Every problem recorded (all scopes), one ``path: message`` line each, in the order found."""
        return [f"{path}: {message}" if path else message for path, message in self._lines]

    def raise_if_any(self) -> None:
        """Raise one :class:`ConfigError` with one line per problem, if there is any."""
        if self._lines:
            raise ConfigError("\n".join(self.lines))

    # -- rules of one value. Each records at most one line, and none when ``key`` has a problem already (a value
    # -- that failed its type check holds the default meanwhile). --------------------------------------------

    def _rule(self, ok: bool, key: str, value: Any, requirement: str) -> bool:
        if not self.ok(key):
            return False
        return self.check(ok, key, f"{value!r} {requirement}")

    def at_least(self, key: str, value: Any, minimum: float, note: str = "", *, optional: bool = False) -> bool:
        """``value >= minimum`` (``None`` passes when ``optional``): ``'<path>: 1 must be >= 2<note>'``."""
        return self._rule((optional and value is None) or (value is not None and value >= minimum), key, value,
                          f"must be >= {minimum}{note}")

    def above(self, key: str, value: Any, bound: float = 0, note: str = "", *, optional: bool = False) -> bool:
        """``value > bound`` (``None`` passes when ``optional``): ``'<path>: 0 must be > 0<note>'``."""
        return self._rule((optional and value is None) or (value is not None and value > bound), key, value,
                          f"must be > {bound}{note}")

    def integer(self, key: str, value: Any, minimum: int = 1) -> bool:
        """An ``int`` (not a ``bool``) ``>= minimum``, for inputs that no schema has type-checked."""
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
        return self._rule(ok, key, value, f"must be an integer >= {minimum}")

    def positive(self, key: str, value: Any, *, upper: float | None = None) -> bool:
        """A finite number ``> 0`` (and ``<= upper``), for inputs that no schema has type-checked."""
        ok = _is_number(value) and 0 < value < math.inf and (upper is None or value <= upper)
        return self._rule(ok, key, value, "must be a positive finite number" + (f" <= {upper}" if upper else ""))

    def non_negative(self, key: str, value: Any) -> bool:
        """A finite number ``>= 0``, for inputs that no schema has type-checked."""
        ok = _is_number(value) and 0 <= value < math.inf
        return self._rule(ok, key, value, "must be a non-negative finite number")

    def one_of(self, key: str, value: Any, allowed: typing.Iterable[Any]) -> bool:
        """``value`` is one of ``allowed``: ``"<path>: 'x' is not allowed (allowed values: 'a', 'b')"``."""
        allowed = tuple(allowed)
        return self._rule(value in allowed, key, value,
                          f"is not allowed (allowed values: {', '.join(map(repr, allowed))})")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# -- dataclasses --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Dataclasses built inside do not validate themselves: the caller validates the whole tree once, under the key
    paths it knows (:func:`from_dict` does; so does a job file that derives a model shape from its sections)."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def check_tree(obj: Any, p: Problems) -> None:
    """Run the ``_check`` rules of ``obj``'s nested dataclass fields (each under its field name), then its own."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_tree(value, p.at(f.name))
    hook = getattr(obj, "_check", None)
    if hook is not None:
        hook(p)


def validate(obj: Any, path: str, *, types: bool = False) -> None:
    """Check ``obj`` and its nested dataclasses; raise one :class:`ConfigError` listing every problem.

    ``types``: first check (and coerce) every field's type as :func:`from_dict` does (:func:`check_types`).
    A no-op inside :func:`deferred`."""
    if _deferred.get():
        return
    p = Problems(path)
    if types:
        check_types(obj, p)
    check_tree(obj, p)
    p.raise_if_any()


def check_types(obj: Any, p: Problems) -> None:
    """The type rules of :func:`from_dict`, applied to a constructed dataclass, recursively.

    A field that holds a mapping where its type is a dataclass is built from it (:func:`from_dict`'s rules, under the
    field's key path); ``None`` there gives that section's defaults (as a null YAML section does). Values are coerced
    as :func:`from_dict` coerces them (an ``int`` for a ``float`` field becomes a ``float``). A field with a problem
    holds its default afterwards, so the ``_check`` rules never see a value of the wrong type."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        tp, value = hints[f.name], getattr(obj, f.name)
        if dataclasses.is_dataclass(tp):
            if isinstance(value, tp):
                check_types(value, p.at(f.name))
                continue
            if value is not None and not isinstance(value, dict):
                p.add(f.name, f"expected a mapping or a {tp.__name__}, got {type(value).__name__} ({value!r})")
                value = _default(f)
            else:
                with deferred():
                    value = _build(tp, value if value is not None else {}, p.at(f.name))
            object.__setattr__(obj, f.name, value)
            continue
        try:
            coerced = _coerce(tp, value)
        except _Invalid as e:
            p.add(f"{f.name}{e.index}", e.message)
            coerced = _default(f)
        if coerced is not value:
            object.__setattr__(obj, f.name, coerced)


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _unknown_key(cls: type, name: Any, allowed: Any, p: Problems) -> None:
    renamed: dict[str, str] = getattr(cls, "_renamed", {})
    if name in renamed:
        p.add(name, f"renamed to {renamed[name]}")
    else:
        p.add(name, f"unknown key (allowed keys of {p.path}: {', '.join(sorted(allowed))})")


def checked(path: str) -> Any:
    """Class decorator (over ``@dataclass``): the constructor validates like :func:`from_dict`, under ``path``.

    Unknown keyword arguments are reported as unknown keys (renamed ones name their new key), nested sections may be
    given as mappings, every value is type-checked, then the ``_check`` rules of the whole tree run; one
    :class:`ConfigError` lists every problem with its key path. Inside :func:`deferred` (what :func:`from_dict` builds)
    the constructor checks nothing: the builder checks the whole tree once, under its own key paths."""

    def wrap(cls: type) -> type:
        init = cls.__init__  # type: ignore[misc]
        names = frozenset(f.name for f in dataclasses.fields(cls))

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if _deferred.get():
                init(self, *args, **kwargs)
                return
            unknown = [k for k in kwargs if k not in names]
            if unknown:
                p = Problems(path)
                for k in unknown:
                    _unknown_key(cls, k, names, p)
                p.raise_if_any()
            init(self, *args, **kwargs)
            validate(self, path, types=True)

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return wrap


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain-dict form of a (nested) config dataclass; round-trips through :func:`from_dict`."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = to_dict(v) if dataclasses.is_dataclass(v) else v
    return out


def from_dict(cls: type, data: Any, path: str) -> Any:
    """Build ``cls`` from a mapping and check it; one :class:`ConfigError` lists every problem with its key path.

    Every key must be a field, every value must have the field's type (``bool``, ``int``, ``float``, ``str``,
    ``Literal[...]``, ``list[...]``, optional forms, nested dataclasses), and every ``_check`` rule must hold.
    """
    p = Problems(path)
    with deferred():
        obj = _build(cls, data, p)
    check_tree(obj, p)
    p.raise_if_any()
    return obj


def _build(cls: type, data: Any, p: Problems) -> Any:
    """``cls`` from ``data``; problems are recorded in ``p`` and their fields keep the defaults."""
    if not isinstance(data, dict):
        p.add("", f"expected a mapping, got {type(data).__name__} ({data!r})")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name not in fields:
            _unknown_key(cls, name, fields, p)
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value if value is not None else {}, p.at(name))
            continue
        try:
            kwargs[name] = _coerce(tp, value)
        except _Invalid as e:
            p.add(f"{name}{e.index}", e.message)
    return cls(**kwargs)


class _Invalid(Exception):
    def __init__(self, message: str, index: str = "") -> None:
        super().__init__(message)
        self.message, self.index = message, index


def _coerce(tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise _Invalid(f"{value!r} is not allowed (allowed values: {', '.join(map(repr, allowed))})")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        first: _Invalid | None = None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value)
            except _Invalid as e:
                first = first or e
        raise first or _Invalid(f"invalid value {value!r}")
    if tp is bool:
        if not isinstance(value, bool):
            raise _Invalid(f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Invalid(f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if not _is_number(value):
            raise _Invalid(f"expected a number, got {value!r}")
        return float(value)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, list):
            raise _Invalid(f"expected a list, got {value!r}")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(v if item is Any else _coerce(item, v))
            except _Invalid as e:
                raise _Invalid(e.message, f"[{i}]{e.index}") from None
        return out
    if tp is str:
        if isinstance(value, os.PathLike):  # a pathlib.Path given to a constructor: its string
            value = os.fspath(value)
        if not isinstance(value, str):
            raise _Invalid(f"expected a string, got {value!r}")
        return value
    raise _Invalid(f"unsupported field type {tp!r}")  # pragma: no cover
