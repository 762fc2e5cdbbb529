"""The configuration reference (docs/configuration.md) generated from the field comments."""

from __future__ import annotations

import dataclasses
import inspect
import re

from audioclf.config.sections import Config

# ---------------------------------------------------------------------------------------------
# Reference documentation (README's config table is generated from the field comments)


# A field comment that starts so puts the key in the reference's experimental table: in the
# code, off by default, measured not to help yet; the comment says what was measured.
EXPERIMENTAL = "experimental: "


def reference_markdown() -> str:
    """A Markdown table of every config key, its default and its one-line comment, then one of
    the experimental keys (their comment starts with EXPERIMENTAL)."""
    header = ["| key | default | meaning |", "| --- | --- | --- |"]
    rows, experimental = list(header), list(header)

    def walk(cls: type, prefix: str) -> None:
        source = inspect.getsource(cls)
        comments = dict(re.findall(r"^\s+(\w+): .*?#\s*(.+)$", source, flags=re.M))
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
                continue
            shown = (
                "null"
                if default is None
                else repr(default)
                if isinstance(default, str)
                else default
            )
            meaning = comments.get(f.name, "").replace("<", "&lt;").replace("|", "\\|")
            table = experimental if meaning.startswith(EXPERIMENTAL) else rows
            meaning = meaning.removeprefix(EXPERIMENTAL)
            table.append(f"| `{prefix}{f.name}` | `{shown}` | {meaning} |")

    for section in dataclasses.fields(Config):
        walk(section.default_factory, f"{section.name}.")
    if len(experimental) == len(header):
        return "\n".join(rows)
    note = (
        "**Experimental** (in the code and off by default: measured not to help yet, as each "
        "says; a recipe that turns one on is an experiment):"
    )
    return "\n".join([*rows, "", note, "", *experimental])


README_START = "<!-- CONFIG-REFERENCE:START -->"
README_END = "<!-- CONFIG-REFERENCE:END -->"


def readme_with_reference(text: str) -> str:
    """README text with the block between the CONFIG-REFERENCE markers regenerated."""
    head, _, rest = text.partition(README_START)
    _, _, tail = rest.partition(README_END)
    return f"{head}{README_START}\n{reference_markdown()}\n{README_END}{tail}"
