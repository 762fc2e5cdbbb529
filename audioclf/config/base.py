"""What every config section shares: the error type, the checks, and the dotted-key diff."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says which key and the fix."""


def choices(cls: type, name: str) -> tuple:
    """The allowed values of a Literal field: the one home of that rule for other modules."""
    return typing.get_args(typing.get_type_hints(cls)[name])


def check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"config key {key}={value!r} is invalid: expected {expected}")


_ABSENT = object()


def differences(old: Mapping, new: Mapping, prefix: str = "") -> dict[str, tuple]:
    """Dotted keys whose values differ between two nested dicts (or that one side lacks), sorted,
    each with (old value, new value); a missing value is None. Nested dicts are compared key by
    key, so the names say which setting changed."""
    out = {}
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.update(differences(a, b, f"{prefix}{key}."))
        elif a is _ABSENT or b is _ABSENT or a != b:
            out[f"{prefix}{key}"] = (None if a is _ABSENT else a, None if b is _ABSENT else b)
    return out
