"""The header of a sheet: which row holds the column names, and which sheet column is each
configured one (names match ignoring case and spaces; two candidates for one name are an error).

A header below title or notes rows is found as the first of the first HEADER_SEARCH_ROWS rows
that holds the class, item and id columns; `data.header_row` names it outright.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from audioclf.config import DataConfig
from audioclf.data.index.paths import template_columns
from audioclf.data.index.table import (
    HEADER_SEARCH_ROWS,
    IndexValidationError,
    SheetHeader,
    names_text,
)


def fold(name) -> str:
    """A column name as it is matched: case-folded, whitespace runs as one space, stripped."""
    return " ".join(str(name).split()).casefold()


def key_columns(cfg: DataConfig) -> list[str]:
    """The columns a header row must hold: class, item and id."""
    return [cfg.class_column, cfg.item_column, cfg.id_column]


def rows_to_scan(cfg: DataConfig) -> int:
    """How many leading rows locate_header needs."""
    return max(HEADER_SEARCH_ROWS, cfg.header_row or 0)


def locate_header(first_rows: list[list[str]], cfg: DataConfig, path: Path) -> tuple[int, str]:
    """(sheet row of the header, how it was chosen: "given", "found" or "default").

    `first_rows` are the sheet's first rows_to_scan(cfg) rows as text (fewer when it has fewer).
    """
    if cfg.header_row is not None:
        if cfg.header_row > len(first_rows):
            raise IndexValidationError(
                f"index file {path} has {len(first_rows)} row(s), so data.header_row="
                f"{cfg.header_row} names no row; set data.header_row to the row holding the "
                f"column names, or to null to find it among the first {HEADER_SEARCH_ROWS} rows"
            )
        return cfg.header_row, "given"
    wanted = {fold(name) for name in key_columns(cfg)}
    for position, cells in enumerate(first_rows[:HEADER_SEARCH_ROWS]):
        if wanted <= {fold(cell) for cell in cells}:
            return position + 1, "found"
    return 1, "default"


def has_header(first_rows: list[list[str]], cfg: DataConfig) -> bool:
    """Whether data.header_row (else one of the first HEADER_SEARCH_ROWS rows) holds the keys."""
    given = cfg.header_row
    rows = first_rows[given - 1 : given] if given else first_rows[:HEADER_SEARCH_ROWS]
    wanted = {fold(name) for name in key_columns(cfg)}
    return any(wanted <= {fold(cell) for cell in cells} for cells in rows)


def header_hint(header: SheetHeader, cfg: DataConfig) -> str:
    """What to say about the header row when a configured column is missing from it."""
    if header.how == "given":
        return (
            f" data.header_row={header.row} reads row {header.row} as the header: set it "
            "to the row holding the column names, or to null to find that row."
        )
    if header.how == "default":
        return (
            f" No row among the first {HEADER_SEARCH_ROWS} holds all of "
            f"{names_text(key_columns(cfg))}, so row 1 was read as the header: if the "
            "header is further down, set data.header_row=<its row>."
        )
    return ""


def _configured_columns(cfg: DataConfig) -> list[tuple[str, str]]:
    """(config key, column name) of every column audioclf reads, each name once."""
    keys = [
        ("data.class_column", cfg.class_column),
        ("data.item_column", cfg.item_column),
        ("data.id_column", cfg.id_column),
        ("data.path_column", cfg.path_column),
        ("data.split_column", cfg.split_column),
    ]
    if cfg.path_template:
        keys += [("data.path_template", name) for name in template_columns(cfg.path_template)]
    return [(key, name) for key, name in keys if name]


def match_columns(
    columns: list[str], cfg: DataConfig, path: Path, row: int
) -> tuple[dict[str, str], list[str]]:
    """{sheet column: configured name} for the columns that match a configured name only when
    case and spaces are ignored, and a note on each; raises when two columns match one name."""
    by_fold: dict[str, list[str]] = defaultdict(list)
    for column in columns:
        by_fold[fold(column)].append(column)
    renames: dict[str, str] = {}
    notes: list[str] = []
    done: set[str] = set()
    for key, name in _configured_columns(cfg):
        matches = by_fold.get(fold(name), [])
        if fold(name) in done or not matches:
            continue
        done.add(fold(name))
        if len(matches) > 1:
            each = "both" if len(matches) == 2 else "all"
            raise IndexValidationError(
                f"index file {path}: columns {names_text(matches)} of the header (row {row}) "
                f"{each} match {key}={name!r} (column names match ignoring case and spaces); "
                "rename or delete all but one of them"
            )
        if matches[0] != name:
            renames[matches[0]] = name
            notes.append(f"{matches[0]!r} as {name!r} ({key})")
    return renames, notes


def assumption_notes(row: int, how: str, cfg: DataConfig, matched: list[str]) -> tuple[str, ...]:
    """What read_table assumed, for the one log line of a load."""
    notes = []
    if how == "found" and row > 1:
        above = "row 1 above it is" if row == 2 else f"rows 1-{row - 1} above it are"
        notes.append(
            f"the header is row {row}, the first holding {names_text(key_columns(cfg))} "
            f"({above} not read; data.header_row={row} says so outright)"
        )
    if matched:
        notes.append("columns matched ignoring case and spaces: " + ", ".join(matched))
    return tuple(notes)
