"""The index table's layout, its error type, and helpers that quote rows and names."""

from __future__ import annotations

import gc
import logging
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd

log = logging.getLogger("audioclf")


TABLE_COLUMNS = ("cls", "item", "id", "path", "row", "split")
# a sheet's optional segment columns (seconds), after TABLE_COLUMNS in a table of such a sheet
SPAN_COLUMNS = ("start", "end")
# a feature pack's index (audioclf.data.pack): each row's byte offset and frames in its data file
PACK_COLUMNS = ("pack_offset", "pack_frames")
PACK_MANIFEST = "pack.json"  # beside a pack's index: a damaged index's fix is to pack again
SPLITS = ("train", "val", "test")
SUPPORTED_FORMATS = ".xlsx, .xlsm, .csv, .parquet"
# read_table's row at position p is sheet row p + FIRST_DATA_ROW (Excel's row, a csv's line), also
# when the header is lower down: the rows above it and the header itself come back blank
FIRST_DATA_ROW = 2
HEADER_SEARCH_ROWS = 20  # the header is looked for in this many rows unless data.header_row says
SHOW = 5  # rows/values quoted in a message before "and N more"
HEADER_ATTR = "audioclf.header"  # read_table's DataFrame.attrs key holding its SheetHeader


class IndexValidationError(ValueError):
    """An index sheet that cannot be used; the message names the file, the rows and the fix."""


@dataclass(frozen=True)
class SheetHeader:
    """Where read_table took the column names from, and what it assumed on the way.

    how: "given" (by data.header_row), "found" (the first of the first HEADER_SEARCH_ROWS rows
    holding the class, item and id columns), "default" (no such row: row 1 was read), or
    "schema" (a parquet file's names are its schema). notes: what to log once per load (the
    header row found, column names matched ignoring case and spaces).
    """

    row: int = 1  # the sheet row holding the column names
    how: str = "found"
    notes: tuple[str, ...] = ()

    def as_attrs(self) -> dict:
        """A plain dict for DataFrame.attrs (pandas writes attrs into parquet metadata as JSON)."""
        return {**asdict(self), "notes": list(self.notes)}


def sheet_header(raw: pd.DataFrame) -> SheetHeader:
    """The SheetHeader read_table recorded on `raw` (a table from elsewhere: a header on row 1)."""
    attrs = raw.attrs.get(HEADER_ATTR)
    if attrs is None:
        return SheetHeader()
    return SheetHeader(attrs["row"], attrs["how"], tuple(attrs["notes"]))


@dataclass
class Index:
    """The validated table, one row per sample.

    Columns: cls, item, id, path (absolute), split ("" without a split column) as str, and
    row (int64): the row a user sees in Excel, a csv's line number (both counting any title rows
    above the header), or position + 2 in a parquet file.
    start, end (float64 seconds), only when the sheet has start and end columns: the segment
    of the file a row is; NaN in both for a whole file.
    pack_offset, pack_frames (int64), only in a feature pack's index: where the row's frames lie
    in its data file (path).
    """

    table: pd.DataFrame
    source: Path  # the sheet it came from

    def __len__(self) -> int:
        return len(self.table)

    @cached_property
    def codes(self) -> Codes:
        return table_codes(self.table)

    @property
    def classes(self) -> list[str]:
        """Sorted unique class names; a class's code is its position in this list."""
        return self.codes.classes

    def labels(self) -> np.ndarray:
        """int64 class code of every row, by `classes`."""
        return self.codes.class_codes

    def unreadable(self, position: int, reason: str, listing: str, left_out_of: str) -> str:
        """What prepare says of the row at `position` whose file cannot be read: the row, its id,
        `reason`, and the fix (--skip-bad lists it in `listing`, out of `left_out_of`)."""
        row, id_ = int(self.table["row"].iat[position]), self.table["id"].iat[position]
        return (
            f"row {row} of {self.source} (id {id_!r}): {reason}. Fix or remove the row, or pass "
            f"--skip-bad to list it in {listing} and leave it out of the {left_out_of}"
        )

    def subset(self, mask) -> Index:
        """The rows where `mask` is True (its class list is recomputed from those rows)."""
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (len(self),):
            raise ValueError(f"subset mask has shape {mask.shape}, expected ({len(self)},)")
        return Index(self.table[mask].reset_index(drop=True), self.source)


@dataclass(frozen=True)
class Codes:
    """Dense integer codes of a table's classes and items (computed once per table)."""

    class_codes: np.ndarray  # int64 per row: position of its class in `classes`
    classes: list[str]  # sorted class names
    item_codes: np.ndarray  # int64 per row: its (class, item) pair, ordered by class then item


def table_codes(table: pd.DataFrame) -> Codes:
    """Class and item codes of an index table (an item is a recording inside its class, so the
    same item name under two classes is two items)."""
    class_codes, classes = pd.factorize(table["cls"], sort=True)
    item_names, item_name_codes = np.unique(table["item"].to_numpy(dtype=str), return_inverse=True)
    pairs = class_codes.astype(np.int64) * len(item_names) + item_name_codes.reshape(-1)
    _, item_codes = np.unique(pairs, return_inverse=True)
    return Codes(
        class_codes.astype(np.int64), classes.tolist(), item_codes.reshape(-1).astype(np.int64)
    )


def rows_text(rows, limit: int = SHOW) -> str:
    """'rows 4, 9, 12 and 37 more' — the first row numbers a user can find in the sheet."""
    rows = [int(r) for r in rows]
    shown = ", ".join(str(r) for r in rows[:limit])
    more = f" and {len(rows) - limit} more" if len(rows) > limit else ""
    return f"row{'s' if len(rows) != 1 else ''} {shown}{more}"


def names_text(names, limit: int = SHOW) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


@contextmanager
def gc_paused():
    """The cyclic GC off while a parser builds a million cell objects (which hold no cycles):
    otherwise it rescans them again and again, and python-calamine's to_python is 4x slower."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def path_suffixes(paths: pd.Series) -> pd.Series:
    """Each path's suffix, lower-cased ("" without one)."""
    return paths.str.extract(r"(\.[^./\\]*)$", expand=False).fillna("").str.lower()
