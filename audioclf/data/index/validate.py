"""Validation: the raw sheet → the index table, or one IndexValidationError naming the file,
the rows and the fix."""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from audioclf.config import DataConfig
from audioclf.data.index.header import fold, header_hint
from audioclf.data.index.paths import WINDOWS_ROOT, render_template, resolve_paths, template_columns
from audioclf.data.index.table import (
    FIRST_DATA_ROW,
    PACK_COLUMNS,
    SHOW,
    SPAN_COLUMNS,
    SPLITS,
    IndexValidationError,
    SheetHeader,
    gc_paused,
    names_text,
    rows_text,
    sheet_header,
    table_codes,
)
from audioclf.data.readers import audio_seconds

log = logging.getLogger("audioclf")


@dataclass(frozen=True)
class _Columns:
    """The sheet columns validation reads."""

    required: dict[str, str]  # column -> its role ("class", "item", "id", "path", ...), in order
    split: str | None  # the split column, when the sheet has one
    use_template: bool  # paths come from data.path_template (the sheet has no path column)
    span: tuple[str, ...] = ()  # the sheet's start and end columns (segment rows), when it has them
    pack: tuple[str, ...] = ()  # PACK_COLUMNS, in a feature pack's index


def validate_table(
    raw: pd.DataFrame, cfg: DataConfig, source: Path, root: str
) -> tuple[pd.DataFrame, list[str], list[str]]:
    """The raw sheet (from read_table) as the index table, or one IndexValidationError; also
    the warnings to show and the notes on what was assumed about the paths, to log."""
    header = sheet_header(raw)
    columns = _columns(raw, cfg, source, header)
    cells, rows = _data_rows(raw, columns, source, header)
    _check_filled(cells, rows, columns.required, source)
    _check_unique_ids(cells[cfg.id_column], rows, cfg.id_column, source)
    split = _split_values(cells, rows, columns.split, source)
    if columns.use_template:
        paths = render_template(cfg.path_template, cells)
    else:
        paths = cells[cfg.path_column]
    paths, notes = resolve_paths(paths, root)
    table = pd.DataFrame(
        {
            "cls": cells[cfg.class_column],
            "item": cells[cfg.item_column],
            "id": cells[cfg.id_column],
            "path": paths,
            "row": rows,
            "split": split,
            **_span_values(cells, rows, columns.span, source),
            **_pack_values(cells, rows, columns.pack, source),
        }
    ).reset_index(drop=True)
    return table, _small_class_warnings(table, source), list(notes)


def _columns(raw: pd.DataFrame, cfg: DataConfig, source: Path, header: SheetHeader) -> _Columns:
    """The columns to read; raises when the class, item or id column, or the paths, are missing."""
    present = names_text(raw.columns, limit=20) or "(none)"
    keys = {
        "data.class_column": cfg.class_column,
        "data.item_column": cfg.item_column,
        "data.id_column": cfg.id_column,
    }
    missing = [(key, name) for key, name in keys.items() if name not in raw.columns]
    if missing:
        listed = ", ".join(f"{name!r} ({key})" for key, name in missing)
        raise IndexValidationError(
            f"index file {source} has no column {listed}; columns present: {present}. "
            "Rename the column in the sheet or set the config key to its name, "
            f"e.g. {missing[0][0]}=<column>.{header_hint(header, cfg)}"
        )
    required = {cfg.class_column: "class", cfg.item_column: "item", cfg.id_column: "id"}
    use_template = cfg.path_column not in raw.columns
    if use_template:
        for column in _template_columns(raw, cfg, source, present):
            required.setdefault(column, "template field")
    else:
        required[cfg.path_column] = "path"
    split = cfg.split_column if cfg.split_column in raw.columns else None
    pack = PACK_COLUMNS if all(c in raw.columns for c in PACK_COLUMNS) else ()
    return _Columns(required, split, use_template, _span_columns(raw, source), pack)


def _span_columns(raw: pd.DataFrame, source: Path) -> tuple[str, ...]:
    """The sheet's start and end columns (matched ignoring case and spaces), or () without."""
    found = {name: [c for c in raw.columns if fold(c) == name] for name in SPAN_COLUMNS}
    if not any(found.values()):
        return ()
    bad = [f"{name!r} ({len(c)} columns)" for name, c in found.items() if len(c) != 1]
    if bad:
        raise IndexValidationError(
            f"index file {source}: a segment needs one 'start' and one 'end' column (seconds), "
            f"but the header has {', '.join(bad)}; add or rename the columns so each is there once"
        )
    return tuple(found[name][0] for name in SPAN_COLUMNS)


def _template_columns(raw: pd.DataFrame, cfg: DataConfig, source: Path, present: str) -> list[str]:
    """The columns data.path_template names (the sheet has no path column); all must exist."""
    if not cfg.path_template:
        raise IndexValidationError(
            f"index file {source} has no path column {cfg.path_column!r} and "
            f"data.path_template is empty; columns present: {present}. Either add a path "
            "column (or set data.path_column to the column holding paths), or set "
            "data.path_template, e.g. data.path_template='features/{" + cfg.id_column + "}.npy'"
        )
    columns = template_columns(cfg.path_template)
    unknown = [c for c in columns if c not in raw.columns]
    if unknown:
        raise IndexValidationError(
            f"data.path_template {cfg.path_template!r} names column(s) "
            f"{names_text(unknown)} that {source} does not have; columns present: {present}. "
            "Fix the template or add the column"
        )
    return columns


def _data_rows(
    raw: pd.DataFrame, columns: _Columns, source: Path, header: SheetHeader
) -> tuple[pd.DataFrame, np.ndarray]:
    """The used columns' cells, stripped, of the rows that hold data; and their sheet rows."""
    split = [columns.split] if columns.split else []
    used = [*columns.required, *split, *columns.span, *columns.pack]
    cells = pd.DataFrame({name: raw[name].str.strip() for name in dict.fromkeys(used)})
    rows = np.arange(len(cells), dtype=np.int64) + FIRST_DATA_ROW
    blank = (cells == "").all(axis=1).to_numpy()  # trailing/separator rows: not data
    if blank.any():
        cells, rows = cells[~blank], rows[~blank]
    if len(cells) == 0:
        raise IndexValidationError(
            f"index file {source} has no data rows (the header is row {header.row}, data "
            f"starts at row {header.row + 1})"
        )
    return cells, rows


def _check_filled(
    cells: pd.DataFrame, rows: np.ndarray, required: dict[str, str], source: Path
) -> None:
    empty_parts = []
    for name, role in required.items():
        empty = (cells[name] == "").to_numpy()
        if empty.any():
            empty_parts.append(
                f"column {name!r} ({role}) is empty in {int(empty.sum())} {rows_text(rows[empty])}"
            )
    if empty_parts:
        unlabelled = "class" in required.values() and any("(class)" in p for p in empty_parts)
        hint = (
            "; rows without a class are unlabelled audio: list them in their own sheet or folder "
            "and pass it as data.unlabelled"
            if unlabelled
            else ""
        )
        raise IndexValidationError(
            f"index file {source} has empty cells: {'; '.join(empty_parts)}. "
            f"Fill them in or delete those rows{hint}"
        )


def _check_unique_ids(ids: pd.Series, rows: np.ndarray, id_column: str, source: Path) -> None:
    repeated = ids.duplicated(keep=False).to_numpy()
    if not repeated.any():
        return
    where: dict[str, list[int]] = defaultdict(list)
    for value, row in zip(ids[repeated].tolist(), rows[repeated].tolist(), strict=True):
        where[value].append(row)
    shown = "; ".join(f"{v!r} at {rows_text(r)}" for v, r in list(where.items())[:SHOW])
    more = f"; and {len(where) - SHOW} more repeated ids" if len(where) > SHOW else ""
    raise IndexValidationError(
        f"index file {source}: column {id_column!r} (data.id_column) must be unique, "
        f"but {len(where)} id(s) repeat: {shown}{more}. Remove the repeated rows or give "
        "them distinct ids"
    )


def _split_values(
    cells: pd.DataFrame, rows: np.ndarray, split_column: str | None, source: Path
) -> pd.Series:
    """The split column lower-cased, or "" in every row without one (or with an empty one)."""
    none = pd.Series("", index=cells.index, dtype=str)
    if split_column is None:
        return none
    values = cells[split_column].str.lower()
    if (values == "").all():
        return none
    bad = ~values.isin(SPLITS).to_numpy()
    if bad.any():
        bad_values = sorted(set(cells[split_column][bad].tolist()))
        raise IndexValidationError(
            f"index file {source}: column {split_column!r} (data.split_column) must "
            f"hold train, val or test in every row, but has {names_text(bad_values)} at "
            f"{rows_text(rows[bad])}. Fix those cells, or clear the whole column to "
            "split by data.seed/data.val_ratio"
        )
    return values


def _span_values(
    cells: pd.DataFrame, rows: np.ndarray, span: tuple[str, ...], source: Path
) -> dict[str, np.ndarray]:
    """{"start": seconds, "end": seconds} per row (NaN in both for a whole file), {} for a sheet
    without segment columns; raises on a bad segment."""
    if not span:
        return {}
    text = [cells[name] for name in span]
    start, end = (pd.to_numeric(t, errors="coerce").to_numpy(np.float64) for t in text)
    empty = [(t == "").to_numpy() for t in text]
    problems = {
        "hold no number": ~(empty[0] | np.isfinite(start)) | ~(empty[1] | np.isfinite(end)),
        "have only one of start and end": empty[0] != empty[1],
        "start before 0": start < 0,
        "end at or before start": end <= start,
    }
    parts = [f"{rows_text(rows[bad])} {what}" for what, bad in problems.items() if bad.any()]
    if parts:
        raise IndexValidationError(
            f"index file {source}: the segment columns {names_text(span)} (seconds) must hold "
            f"end > start >= 0, or both be empty for the whole file, but {'; '.join(parts)}. "
            "Fix those cells"
        )
    return {"start": start, "end": end}


def _pack_values(
    cells: pd.DataFrame, rows: np.ndarray, pack: tuple[str, ...], source: Path
) -> dict[str, np.ndarray]:
    """{"pack_offset": bytes, "pack_frames": frames} (int64) of a feature pack's index, {} for
    another sheet; raises on a cell that is not a whole number in range."""
    if not pack:
        return {}
    values = {name: pd.to_numeric(cells[name], errors="coerce").to_numpy() for name in pack}
    bad = np.zeros(len(rows), dtype=bool)
    for name, minimum in zip(pack, (0, 1), strict=True):
        number = values[name]
        bad |= ~np.isfinite(number) | (number < minimum) | (number != np.round(number))
    if bad.any():
        raise IndexValidationError(
            f"index file {source} is a feature pack's index, but {rows_text(rows[bad])} hold no "
            f"byte offset >= 0 and frame count >= 1 in {names_text(pack)}; use the index.parquet "
            "that python -m audioclf.prepare --pack wrote"
        )
    return {name: values[name].astype(np.int64) for name in pack}


def check_spans(table: pd.DataFrame) -> list[tuple[int, str]]:
    """(position, what is wrong) of the segment rows whose end lies past their audio file's end,
    by readers.audio_seconds (files it cannot tell about are left to the reader)."""
    if "end" not in table.columns:
        return []
    segments = np.flatnonzero(np.isfinite(table["end"].to_numpy(np.float64)))
    seconds: dict[str, float | None] = {}
    bad = []
    for position in segments.tolist():
        path, end = table["path"].iat[position], float(table["end"].iat[position])
        if path not in seconds:
            try:
                seconds[path] = audio_seconds(path) or None
            except (RuntimeError, OSError, ValueError):  # not audio (.npy) or unreadable
                seconds[path] = None
        length = seconds[path]
        if length is not None and end > length + 1e-3:
            bad.append((position, f"end {end:g} s is past the end of {path} ({length:g} s)"))
    return bad


def _check_spans_in_files(table: pd.DataFrame, source: Path) -> None:
    bad = check_spans(table)
    if bad:
        shown = "; ".join(f"row {table['row'].iat[p]}: {what}" for p, what in bad[:SHOW])
        more = f"; and {len(bad) - SHOW} more" if len(bad) > SHOW else ""
        raise IndexValidationError(
            f"index file {source}: {len(bad)} segment(s) end past their file: {shown}{more}. "
            "Fix the end (seconds) or the path"
        )


def _small_class_warnings(table: pd.DataFrame, source: Path) -> list[str]:
    codes = table_codes(table)
    items_per_class = np.bincount(
        np.unique(np.stack([codes.class_codes, codes.item_codes]), axis=1)[0],
        minlength=len(codes.classes),
    )
    small = np.flatnonzero(items_per_class < 2)
    if len(small) == 0:
        return []
    return [
        f"index file {source}: {len(small)} of {len(codes.classes)} classes have fewer than 2 "
        f"items: {names_text(np.asarray(codes.classes)[small].tolist())}. Their samples give no "
        "positives from another item; add recordings to them or drop them from the sheet"
    ]


def _missing_files(paths: pd.Series) -> np.ndarray:
    """Mask of paths that are not existing files.

    Lists each referenced folder once (os.scandir) and compares names, instead of one stat per
    path: 2.5x faster on a local disk (benchmarks/index_load.py --files), far more on network
    storage. Paths not found that way are confirmed with os.path.isfile, which also covers
    case-insensitive file systems.
    """
    with gc_paused():
        names: list[str] = []
        positions_in: dict[str, list[int]] = defaultdict(list)
        for path in paths.tolist():
            folder, _, name = path.rpartition(os.sep)
            positions_in[folder or os.sep].append(len(names))
            names.append(name)
        found = np.zeros(len(names), dtype=bool)
        for folder, positions in positions_in.items():
            try:
                with os.scandir(folder) as entries:
                    listed = {entry.name for entry in entries if entry.is_file()}
            except OSError:  # missing folder, not a folder, no permission: its files are missing
                continue
            found[positions] = [names[i] in listed for i in positions]
        unconfirmed = np.flatnonzero(~found)
        found[unconfirmed] = [os.path.isfile(p) for p in paths.to_numpy()[unconfirmed]]
    return ~found


def check_files(table: pd.DataFrame, source: Path, root: str) -> None:
    """Raises when files the table names do not exist, or a segment row ends past its audio
    file (one error naming rows, paths, the fix)."""
    missing = _missing_files(table["path"])
    if not missing.any():
        _check_spans_in_files(table, source)
        return
    count = int(missing.sum())
    first = table[missing].iloc[:SHOW]
    shown = "; ".join(f"row {r}: {p}" for r, p in zip(first["row"], first["path"], strict=True))
    more = f"; and {count - SHOW} more" if count > SHOW else ""
    hint = (
        f" None of the {count} files exist: is data.root right (relative paths resolve "
        f"against {root})?"
        if count == len(table)
        else ""
    )
    raise IndexValidationError(
        f"index file {source}: {count} of {len(table)} referenced files do not exist: "
        f"{shown}{more}.{hint}{_windows_hint(table[missing])} Fix the paths or data.root, or set "
        "data.check_files=false to skip this check"
    )


def _windows_hint(missing: pd.DataFrame) -> str:
    """What to add when the missing files' paths were written on Windows (this is not)."""
    if os.sep != "/":
        return ""
    rooted = missing["path"].str.extract(f"/({WINDOWS_ROOT}.*)$")[0].dropna()
    if len(rooted):
        return (
            f" {len(rooted)} paths name a Windows drive or share (row "
            f"{missing['row'].loc[rooted.index[0]]}: {rooted.iloc[0]}), which cannot be resolved "
            "here: write them relative to data.root (e.g. wav/x.wav) and set data.root to the "
            "folder holding them."
        )
    if not (mixed := int(missing["path"].str.contains("\\", regex=False).sum())):
        return ""
    return (
        f" {mixed} paths hold Windows separators ('\\') mixed with '/' (read as '/' only when no "
        "path holds a '/'): write every path with '/'."
    )
