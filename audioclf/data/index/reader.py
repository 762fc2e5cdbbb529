"""Reading a sheet (.xlsx with python-calamine or openpyxl, .csv, .parquet) as a table of
strings, named by its header row (see header.py). A CSV's delimiter is found from its first
rows; a workbook whose data.sheet lacks the columns is read from the one worksheet that has them."""

from __future__ import annotations

import csv
import datetime
import importlib.util
import io
import itertools
import logging
from collections import defaultdict
from pathlib import Path

import pandas as pd

from audioclf.config import DataConfig
from audioclf.data.index.header import (
    assumption_notes,
    has_header,
    header_hint,
    key_columns,
    locate_header,
    match_columns,
    rows_to_scan,
)
from audioclf.data.index.table import (
    HEADER_ATTR,
    PACK_MANIFEST,
    SUPPORTED_FORMATS,
    IndexValidationError,
    SheetHeader,
    gc_paused,
    names_text,
)

log = logging.getLogger("audioclf")

CSV_DELIMITERS = {",": "commas", ";": "semicolons", "\t": "tabs"}  # tried in this order
CSV_HEAD_CHARS = 1 << 16  # the delimiter is found in the file's first 64k characters
Parsed = tuple[pd.DataFrame, int, str, tuple[str, ...]]  # rows, header row, how found, notes


def _excel_engine() -> str:
    return "calamine" if importlib.util.find_spec("python_calamine") else "openpyxl"


def read_table(path: str | Path, cfg: DataConfig) -> pd.DataFrame:
    """The sheet as a table of strings: empty cells are "", ids like "007" stay text.

    The header is data.header_row, or else the first of the first HEADER_SEARCH_ROWS rows that
    holds the class, item and id columns (row 1 when none does). Column names are stripped, and
    a column matching a configured one ignoring case and spaces takes the configured name (two
    such columns are an error). Rows are kept in sheet order, blank ones included, and the rows
    above the header come back blank, so position + FIRST_DATA_ROW is the row a user sees.
    `sheet_header(table)` tells where the header was and what was assumed.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".xlsx", ".xlsm", ".csv", ".parquet"):
        raise IndexValidationError(
            f"index file {path} has an unsupported format {suffix or '(no extension)'!r}; "
            f"use one of {SUPPORTED_FORMATS} (set data.index)"
        )
    if not path.is_file():
        raise IndexValidationError(
            f"index file {path} does not exist; set data.index to your sheet "
            "(or generate the demo data: python -m audioclf.data.demo --out data/demo)"
        )
    try:
        with gc_paused():
            parsed = _parse(path, suffix, cfg)
    except IndexValidationError:
        raise
    except Exception as exc:  # every parser has its own error types; all mean "unreadable"
        fix = f"save it as one of {SUPPORTED_FORMATS} (csv as UTF-8)"
        if (path.parent / PACK_MANIFEST).is_file():  # a feature pack's own index, damaged
            fix = "it is a feature pack's index, cut short or edited: pack again with python -m "
            fix += "audioclf.prepare --pack into a new folder"
        raise IndexValidationError(
            f"index file {path} could not be read as {suffix} ({type(exc).__name__}: {exc}); {fix}"
        ) from None
    return _named(parsed, path, cfg)


def _named(parsed: Parsed, path: Path, cfg: DataConfig) -> pd.DataFrame:
    """The parsed rows below the header with their final names, padded and annotated."""
    raw, row, how, notes = parsed
    raw.columns = [str(name).strip() for name in raw.columns]
    renames, matched = match_columns(list(raw.columns), cfg, path, row)
    if renames:
        raw = raw.rename(columns=renames)
    if row > 1:  # blank rows for sheet rows 2..row: position + FIRST_DATA_ROW stays the sheet row
        blank = pd.DataFrame({name: [""] * (row - 1) for name in raw.columns}, dtype=str)
        raw = pd.concat([blank, raw], ignore_index=True)
    header = SheetHeader(row, how, notes + assumption_notes(row, how, cfg, matched))
    raw.attrs[HEADER_ATTR] = header.as_attrs()
    return raw


def _parse(path: Path, suffix: str, cfg: DataConfig) -> Parsed:
    """The rows below the header, named by it; the header's row and how it was chosen; notes on
    what was assumed about the file (its delimiter, its worksheet)."""
    if suffix == ".csv":
        return _read_csv(path, cfg)
    if suffix == ".parquet":
        return _read_parquet(path, cfg), 1, "schema", ()
    if _excel_engine() == "calamine":
        return _read_excel_calamine(path, cfg)
    return _read_excel_openpyxl(path, cfg)


def _csv_delimiter(path: Path, cfg: DataConfig) -> str:
    """The first of CSV_DELIMITERS under which the header row holds the key columns, else
    csv.Sniffer's guess among them, else ','; from the file's head (utf-8-sig: Excel's BOM)."""
    with open(path, newline="", encoding="utf-8-sig") as handle:
        head = handle.read(CSV_HEAD_CHARS)
    for delimiter in CSV_DELIMITERS:
        rows = csv.reader(io.StringIO(head, newline=""), delimiter=delimiter)
        if has_header(list(itertools.islice(rows, rows_to_scan(cfg))), cfg):
            return delimiter
    sample = "\n".join(head.splitlines()[: rows_to_scan(cfg)])
    try:
        return csv.Sniffer().sniff(sample, delimiters="".join(CSV_DELIMITERS)).delimiter
    except csv.Error:  # one column, or no consistent delimiter
        return ","


def _read_csv(path: Path, cfg: DataConfig) -> Parsed:
    delimiter = _csv_delimiter(path, cfg)
    # csv.reader counts records as pandas' skiprows does (a quoted cell spanning lines is one row)
    with open(path, newline="", encoding="utf-8-sig") as handle:
        rows = csv.reader(handle, delimiter=delimiter)
        first = list(itertools.islice(rows, rows_to_scan(cfg)))
    row, how = locate_header(first, cfg, path)
    try:
        raw = pd.read_csv(
            path,
            sep=delimiter,
            skiprows=row - 1,
            dtype=str,
            keep_default_na=False,
            skip_blank_lines=False,
            encoding="utf-8-sig",
        )
    except pd.errors.ParserError as exc:
        if how != "default":
            raise
        hint = header_hint(SheetHeader(row, how), cfg)  # most likely a title row read as one
        raise IndexValidationError(
            f"index file {path} could not be read as .csv (ParserError: {str(exc).strip()}).{hint}"
        ) from None
    named = CSV_DELIMITERS[delimiter]
    notes = () if delimiter == "," else (f"columns separated by {named} (found in the first rows)",)
    return raw, row, how, notes


def _read_parquet(path: Path, cfg: DataConfig) -> pd.DataFrame:
    if cfg.header_row not in (None, 1):
        raise IndexValidationError(
            f"index file {path} is a parquet file, whose column names are its schema, not a "
            f"row: data.header_row={cfg.header_row} does not apply; set data.header_row=null"
        )
    raw = pd.read_parquet(path)
    return pd.DataFrame({name: _as_text(raw[name]) for name in raw.columns})


def _other_worksheet(
    path: Path, cfg: DataConfig, names: list[str], head_of
) -> tuple[str | None, tuple[str, ...]]:
    """The worksheet to read instead of data.sheet: the one other worksheet holding the class,
    item and id columns when data.sheet does not (None: read data.sheet); raises when several
    do. `head_of(name or position)` is a worksheet's first rows; others are read only if needed."""
    if has_header(head_of(cfg.sheet), cfg):
        return None, ()
    chosen = cfg.sheet if isinstance(cfg.sheet, str) else names[cfg.sheet]
    holding = [name for name in names if name != chosen and has_header(head_of(name), cfg)]
    columns = names_text(key_columns(cfg))
    if len(holding) > 1:
        each = "both" if len(holding) == 2 else "all"
        raise IndexValidationError(
            f"index file {path}: worksheet {chosen!r} (data.sheet={cfg.sheet!r}) does not hold "
            f"{columns}, and worksheets {names_text(holding)} {each} do; set data.sheet=NAME "
            f"to the one to read, e.g. data.sheet={holding[0]!r}"
        )
    if not holding:
        return None, ()
    return holding[0], (
        f"worksheet {holding[0]!r} read, the one holding {columns} (worksheet {chosen!r}, "
        f"data.sheet={cfg.sheet!r}, does not; data.sheet={holding[0]!r} says so outright)",
    )


def _read_excel_openpyxl(path: Path, cfg: DataConfig) -> Parsed:
    """What `pd.read_excel(engine="openpyxl", header=row - 1, dtype=str)` returns, with the row
    found from one read of the worksheet (see _other_worksheet for which)."""
    with pd.ExcelFile(path, engine="openpyxl") as book:

        def grid_of(name, nrows: int | None = None) -> pd.DataFrame:
            options = {"header": None, "dtype": str, "keep_default_na": False}
            return pd.read_excel(book, sheet_name=name, nrows=nrows, **options)

        def head_of(name) -> list[list[str]]:
            return grid_of(name, rows_to_scan(cfg)).to_numpy().tolist()

        name, notes = _other_worksheet(path, cfg, book.sheet_names, head_of)
        grid = grid_of(cfg.sheet if name is None else name)
    row, how = locate_header(grid.head(rows_to_scan(cfg)).to_numpy().tolist(), cfg, path)
    if grid.empty:
        return pd.DataFrame(), row, how, notes
    header = _header_names([str(cell).strip() for cell in grid.iloc[row - 1]])
    return grid.iloc[row:].set_axis(header, axis=1).reset_index(drop=True), row, how, notes


def _read_excel_calamine(path: Path, cfg: DataConfig) -> Parsed:
    """What `pd.read_excel(engine="calamine", header=row - 1, dtype=str, keep_default_na=False)`
    returns, with the row found from one read of the sheet.

    Calls python-calamine directly: on a 383k-row sheet this parses in ~0.95 s of CPU where
    pandas' per-cell conversion and text parser take ~1.25 s (both with the GC paused; pandas
    alone, GC on: ~2.1 s). Cells convert as pandas converts them: integral floats print as ints,
    everything else as str(value); cells stored as text (an id "00123", "2026-01-02") stay text.
    """
    import python_calamine  # noqa: PLC0415 - the optional fast engine, only when used

    with python_calamine.CalamineWorkbook.from_path(str(path)) as book:
        try:
            if isinstance(cfg.sheet, int):
                worksheet = book.get_sheet_by_index(cfg.sheet)
            else:
                worksheet = book.get_sheet_by_name(cfg.sheet)
        except python_calamine.WorksheetNotFound:
            raise IndexValidationError(
                f"index file {path} has no sheet {cfg.sheet!r}; its sheets are "
                f"{names_text(book.sheet_names, limit=20)} (set data.sheet to a name or position)"
            ) from None
        parsed = {cfg.sheet: worksheet.to_python(skip_empty_area=False)}

        def head_of(name) -> list[list[str]]:  # others parsed in full: calamine reads no less
            if name not in parsed:
                parsed[name] = book.get_sheet_by_name(name).to_python(skip_empty_area=False)
            return _head_text(parsed[name], cfg)

        name, notes = _other_worksheet(path, cfg, book.sheet_names, head_of)
        rows = parsed[cfg.sheet if name is None else name]
    first = _head_text(rows, cfg)
    row, how = locate_header(first, cfg, path)
    if not rows:
        return pd.DataFrame(), row, how, notes
    header = _header_names([cell.strip() for cell in first[row - 1]])
    raw = pd.DataFrame(rows[row:], columns=range(len(header)), dtype=object)
    return pd.DataFrame({name: _as_text(raw[i]) for i, name in enumerate(header)}), row, how, notes


def _head_text(rows: list[list], cfg: DataConfig) -> list[list[str]]:
    """The first rows_to_scan rows of a calamine worksheet as text."""
    return [[_cell_text(cell) for cell in cells] for cells in rows[: rows_to_scan(cfg)]]


def _header_names(cells: list[str]) -> list[str]:
    """Header cells named as pandas names them: "Unnamed: 3" for blanks, "a_id.1" for repeats."""
    names = [cell or f"Unnamed: {position}" for position, cell in enumerate(cells)]
    counts: dict[str, int] = defaultdict(int)
    for position, name in enumerate(names):  # pandas' _dedup_names
        count = counts[name]
        while count > 0:
            counts[name] = count + 1
            name = f"{name}.{count}"
            count = counts[name]
        names[position] = name
        counts[name] = count + 1
    return names


def _cell_text(value) -> str:
    """A cell as pandas' Excel readers print it: integral floats as ints, dates as datetimes."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, datetime.date) and not isinstance(value, datetime.datetime):
        value = datetime.datetime(value.year, value.month, value.day)
    return "" if value is None else str(value)


def _as_text(column: pd.Series) -> pd.Series:
    """A column of any dtype as str with "" for missing cells."""
    if pd.api.types.infer_dtype(column, skipna=False) == "string":
        return column.astype(str)
    missing = column.isna().to_numpy()
    values = [
        "" if gap else _cell_text(value)
        for value, gap in zip(column.tolist(), missing, strict=True)
    ]
    return pd.Series(values, index=column.index, dtype=str)
