"""What every format reader returns (one Entry per utterance or segment), the error they raise,
and the line readers they share (plain text, JSON lines, gzip or not)."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class FormatError(ValueError):
    """Malformed or unsupported input: the message names the file, the line and the fix."""


@dataclass
class Entry:
    """One row of the sheet to write; `where` is "file:line" for messages."""

    cls: str
    id: str
    path: str  # absolute
    where: str
    item: str | None = None  # from the source's own column (a recording id); None: by pattern
    start: float | None = None  # seconds; None for a whole file
    end: float | None = None


def resolve(path: str, base: Path) -> str:
    """An absolute, normalised path: a relative one is taken against `base`."""
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def text_lines(path: Path) -> Iterator[tuple[str, list[str]]]:
    """("file:line", whitespace-separated fields) of every non-blank line of a text file."""
    if not path.is_file():
        raise FormatError(f"{path} does not exist")
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield f"{path}:{number}", line.split()


def json_lines(path: Path) -> Iterator[tuple[str, dict]]:
    """("file:line", object) of every non-blank line of a JSONL file (.gz read as gzip)."""
    if not path.is_file():
        raise FormatError(f"{path} does not exist")
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise FormatError(f"{where}: not a JSON line ({exc.msg}): {line[:80]!r}") from None
            if not isinstance(record, dict):
                raise FormatError(f"{where}: expected a JSON object, got {line[:80]!r}")
            yield where, record


def field(record: dict, key: str, where: str, kind: type | tuple = str, hint: str = ""):
    """record[key], checked to be of `kind` (str values stripped and non-empty)."""
    value = record.get(key)
    if isinstance(value, str):
        value = value.strip()
    if value is None or value == "" or not isinstance(value, kind) or isinstance(value, bool):
        got = "nothing" if value is None or value == "" else repr(value)
        raise FormatError(f"{where}: {key!r} must be a {_kind_name(kind)}, got {got}{hint}")
    return value


def _kind_name(kind: type | tuple) -> str:
    return "number" if kind == (int, float) else {str: "string", list: "list"}.get(kind, "value")


def seconds(text: str, where: str, what: str) -> float:
    """A number of seconds written in a text file."""
    try:
        return float(text)
    except ValueError:
        raise FormatError(f"{where}: {what} must be a number of seconds, got {text!r}") from None
