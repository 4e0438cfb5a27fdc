"""Strict mapping <-> dataclass conversion for configuration files.

Every key must be a field (else ``ConfigError`` naming the key path and the allowed keys), every value must
have the field's type (``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, ``list[...]``, optional
forms, nested dataclasses). Used for the ``neighbor_ckpt:`` section and for whole job files.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from neighbor_ckpt.errors import ConfigError

__all__ = ["from_dict", "to_dict"]

def to_dict(obj: Any) -> dict[str, Any]:
    """Plain-dict form of a (nested) config dataclass; round-trips through :func:`from_dict`."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = to_dict(v) if dataclasses.is_dataclass(v) else v
    return out


def from_dict(cls: type, data: Any, path: str) -> Any:
    """Build ``cls`` from a mapping, rejecting unknown keys and ill-typed values with their key path."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__} ({data!r})")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ConfigError(
            f"{path}.{unknown[0]}: unknown key (allowed keys of {path}: {', '.join(sorted(fields))})"
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        tp = hints[name]
        sub = f"{path}.{name}"
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, value if value is not None else {}, sub)
        else:
            kwargs[name] = _coerce(tp, value, sub)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if path != "neighbor_ckpt" and str(e).startswith("neighbor_ckpt."):
            raise ConfigError(path + str(e).removeprefix("neighbor_ckpt")) from None
        raise
    except (TypeError, ValueError) as e:  # pragma: no cover - defensive
        raise ConfigError(f"{path}: {e}") from e


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: {value!r} is not allowed (allowed values: {', '.join(map(repr, allowed))})")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}: invalid value {value!r}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [v if item is Any else _coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported field type {tp!r}")  # pragma: no cover
