"""What every config section shares: the error type and the checks."""

from __future__ import annotations

import typing
from typing import Any


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says which key and the fix."""


def choices(cls: type, name: str) -> tuple:
    """The allowed values of a Literal field: the one home of that rule for other modules."""
    return typing.get_args(typing.get_type_hints(cls)[name])


def check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"config key {key}={value!r} is invalid: expected {expected}")
