"""The validated sample index: a sheet (.xlsx, .csv, .parquet) → one checked, cached table.

A sheet has a class column, an item column (a source/recording inside the class), an id column
(one sample), a path column or a `data.path_template`, and optionally a train/val/test column.
`load_index` reads it, validates it (one `IndexValidationError` naming the file, the rows and
the fix) and caches the validated table next to it, so the next run re-reads it in milliseconds.

    index = load_index(cfg.data)          # or load_index_distributed(cfg.data) under DDP
    splits = split_index(index, cfg.data)  # {"train": Index, "val": Index[, "test": Index]}

Cache. The table is stored as an uncompressed Arrow IPC (feather) file in `data.cache_dir` or
`<sheet folder>/.audioclf_cache/` (for 383k rows: 43 MB, re-read in ~4 ms; lz4 feather 11 ms,
parquet 19 ms, npz 110 ms), named by the sheet's path and the column/root/template config,
and stamped with the sheet's size, mtime_ns and blake2b content hash; any change to the sheet or
that config makes it stale, and it is rebuilt. A file-existence check that passed is recorded in
the cache and not repeated on a hit (re-checking 400k files would defeat the cache): a file
deleted after the first run is reported when it is read, not here. Delete the cache folder to
force a full check.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import importlib.util
import json
import logging
import os
import re
import string
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from audioclf import distributed
from audioclf.config import DataConfig
from audioclf.fileio import atomic_write

log = logging.getLogger("audioclf")

TABLE_COLUMNS = ("cls", "item", "id", "path", "row", "split")
SPLITS = ("train", "val", "test")
SUPPORTED_FORMATS = ".xlsx, .xlsm, .csv, .parquet"
FIRST_DATA_ROW = 2  # the header is row 1 in Excel (line 1 in a csv)
CACHE_VERSION = 1  # bump when the cached table's layout or the validation rules change
_CACHE_META_KEY = b"audioclf.index"
_SHOW = 5  # rows/values quoted in a message before "and N more"


class IndexValidationError(ValueError):
    """An index sheet that cannot be used; the message names the file, the rows and the fix."""


@dataclass
class Index:
    """The validated table, one row per sample.

    Columns: cls, item, id, path (absolute), split ("" without a split column) as str, and
    row (int64): the row a user sees in Excel (header = row 1), a csv's line number, or
    position + 2 in a parquet file.
    """

    table: pd.DataFrame
    source: Path  # the sheet it came from

    def __len__(self) -> int:
        return len(self.table)

    @cached_property
    def classes(self) -> list[str]:
        """Sorted unique class names; a class's code is its position in this list."""
        return sorted(self.table["cls"].unique().tolist())

    def labels(self) -> np.ndarray:
        """int64 class code of every row, by `classes`."""
        codes = pd.Categorical(self.table["cls"], categories=self.classes).codes
        return codes.astype(np.int64)

    def subset(self, mask) -> Index:
        """The rows where `mask` is True (its class list is recomputed from those rows)."""
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (len(self),):
            raise ValueError(f"subset mask has shape {mask.shape}, expected ({len(self)},)")
        return Index(self.table[mask].reset_index(drop=True), self.source)


# ---------------------------------------------------------------------------------------------
# Reading


def _excel_engine() -> str:
    return "calamine" if importlib.util.find_spec("python_calamine") else "openpyxl"


def read_table(path: str | Path, cfg: DataConfig) -> pd.DataFrame:
    """The sheet as a table of strings: empty cells are "", ids like "007" stay text.

    Column names are stripped of surrounding spaces; rows are kept in sheet order, blank ones
    included, so position + FIRST_DATA_ROW is the row number a user sees.
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
        with _gc_paused():
            raw = _parse(path, suffix, cfg.sheet)
    except IndexValidationError:
        raise
    except Exception as exc:  # every parser has its own error types; all mean "unreadable"
        raise IndexValidationError(
            f"index file {path} could not be read as {suffix} ({type(exc).__name__}: {exc}); "
            f"save it as one of {SUPPORTED_FORMATS} (csv as UTF-8)"
        ) from None
    raw.columns = [str(name).strip() for name in raw.columns]
    return raw


def _parse(path: Path, suffix: str, sheet: int | str) -> pd.DataFrame:
    if suffix == ".csv":
        # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark
        return pd.read_csv(path, dtype=str, keep_default_na=False, skip_blank_lines=False,
                           encoding="utf-8-sig")
    if suffix == ".parquet":
        raw = pd.read_parquet(path)
        return pd.DataFrame({name: _as_text(raw[name]) for name in raw.columns})
    if _excel_engine() == "calamine":
        return _read_excel_calamine(path, sheet)
    return pd.read_excel(path, sheet_name=sheet, engine="openpyxl", dtype=str,
                         keep_default_na=False)


@contextmanager
def _gc_paused():
    """The cyclic GC off while a parser builds a million cell objects (which hold no cycles):
    otherwise it rescans them again and again, and python-calamine's to_python is 4x slower."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read_excel_calamine(path: Path, sheet: int | str) -> pd.DataFrame:
    """What `pd.read_excel(engine="calamine", dtype=str, keep_default_na=False)` returns.

    Calls python-calamine directly: on a 383k-row sheet this parses in ~0.95 s of CPU where
    pandas' per-cell conversion and text parser take ~1.25 s (both with the GC paused; pandas
    alone, GC on: ~2.1 s). Cells convert as pandas converts them: integral floats print as ints,
    everything else as str(value).
    """
    import python_calamine

    with python_calamine.CalamineWorkbook.from_path(str(path)) as book:
        try:
            if isinstance(sheet, int):
                worksheet = book.get_sheet_by_index(sheet)
            else:
                worksheet = book.get_sheet_by_name(sheet)
        except python_calamine.WorksheetNotFound:
            raise IndexValidationError(
                f"index file {path} has no sheet {sheet!r}; its sheets are "
                f"{_names_text(book.sheet_names, limit=20)} (set data.sheet to a name or position)"
            ) from None
        rows = worksheet.to_python(skip_empty_area=False)
    if not rows:
        return pd.DataFrame()
    header = _header_names([_cell_text(cell).strip() for cell in rows[0]])
    raw = pd.DataFrame(rows[1:], columns=range(len(header)), dtype=object)
    return pd.DataFrame({name: _as_text(raw[i]) for i, name in enumerate(header)})


def _header_names(cells: list[str]) -> list[str]:
    """Header cells named as pandas names them: "Unnamed: 3" for blanks, "a_id.1" for repeats."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for position, cell in enumerate(cells):
        name = cell or f"Unnamed: {position}"
        if name in seen:
            seen[name] += 1
            name = f"{name}.{seen[name]}"
        seen.setdefault(name, 0)
        names.append(name)
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
    values = ["" if gap else _cell_text(value)
              for value, gap in zip(column.tolist(), missing, strict=True)]
    return pd.Series(values, index=column.index, dtype=str)


# ---------------------------------------------------------------------------------------------
# Validation


def _rows_text(rows, limit: int = _SHOW) -> str:
    """'rows 4, 9, 12 and 37 more' — the first row numbers a user can find in the sheet."""
    rows = [int(r) for r in rows]
    shown = ", ".join(str(r) for r in rows[:limit])
    more = f" and {len(rows) - limit} more" if len(rows) > limit else ""
    return f"row{'s' if len(rows) != 1 else ''} {shown}{more}"


def _names_text(names, limit: int = _SHOW) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _template_fields(template: str) -> tuple[list[tuple[str, str | None]], bool]:
    """The template's (literal text, column) pieces, and whether plain concatenation renders it
    (no format spec, conversion, attribute or index access)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise IndexValidationError(
            f"data.path_template {template!r} is not a valid format string ({exc}); "
            "write columns in braces, e.g. features/{a_id}.npy"
        ) from None
    pieces, simple = [], True
    for literal, field, spec, conversion in parsed:
        column = None
        if field is not None:
            column = re.split(r"[.\[]", field, maxsplit=1)[0]
            if not column or column.isdigit():
                raise IndexValidationError(
                    f"data.path_template {template!r} has a field {{{field}}} without a column "
                    "name; name a column in the braces, e.g. features/{a_id}.npy"
                )
            simple = simple and column == field and not spec and not conversion
        pieces.append((literal, column))
    return pieces, simple


def _render_template(template: str, cells: pd.DataFrame) -> pd.Series:
    pieces, simple = _template_fields(template)
    if not simple:  # format specs or attribute access: row by row
        rendered = [template.format(**record) for record in cells.to_dict("records")]
        return pd.Series(rendered, index=cells.index, dtype=str)
    out = pd.Series("", index=cells.index, dtype=str)
    for literal, column in pieces:
        out = out + literal
        if column is not None:
            out = out + cells[column]
    return out


def _resolve_paths(paths: pd.Series, root: str) -> pd.Series:
    """Absolute paths: relative ones are joined to `root`; '.', '..' and '//' are normalised."""
    is_abs = paths.str.startswith("/")
    if os.name == "nt":  # pragma: no cover - drive letters and UNC shares
        is_abs = is_abs | paths.str.match(r"^[A-Za-z]:[\\/]|^\\\\")
    prefix = root.rstrip("/\\") + os.sep
    if not is_abs.any():
        paths = prefix + paths
    elif not is_abs.all():
        paths = pd.Series(np.where(is_abs, paths, prefix + paths), index=paths.index, dtype=str)
    messy = paths.str.contains(r"//|/\.\.?(?:/|$)", regex=True)
    if messy.any():
        paths = paths.copy()
        paths[messy] = [os.path.normpath(p) for p in paths[messy]]
    return paths


def _validate(
    raw: pd.DataFrame, cfg: DataConfig, source: Path, root: str
) -> tuple[pd.DataFrame, list[str]]:
    """The raw sheet as the index table, or one IndexValidationError; also the warnings to show."""
    present = _names_text(raw.columns, limit=20) or "(none)"
    keys = {"data.class_column": cfg.class_column, "data.item_column": cfg.item_column,
            "data.id_column": cfg.id_column}
    missing = [(key, name) for key, name in keys.items() if name not in raw.columns]
    if missing:
        listed = ", ".join(f"{name!r} ({key})" for key, name in missing)
        raise IndexValidationError(
            f"index file {source} has no column {listed}; columns present: {present}. "
            "Rename the column in the sheet or set the config key to its name, "
            f"e.g. {missing[0][0]}=<column>"
        )

    use_template = cfg.path_column not in raw.columns
    template_columns: list[str] = []
    if use_template:
        if not cfg.path_template:
            raise IndexValidationError(
                f"index file {source} has no path column {cfg.path_column!r} and "
                f"data.path_template is empty; columns present: {present}. Either add a path "
                "column (or set data.path_column to the column holding paths), or set "
                "data.path_template, e.g. data.path_template='features/{" + cfg.id_column + "}.npy'"
            )
        pieces, _ = _template_fields(cfg.path_template)
        template_columns = list(dict.fromkeys(f for _, f in pieces if f is not None))
        unknown = [c for c in template_columns if c not in raw.columns]
        if unknown:
            raise IndexValidationError(
                f"data.path_template {cfg.path_template!r} names column(s) "
                f"{_names_text(unknown)} that {source} does not have; columns present: {present}. "
                "Fix the template or add the column"
            )

    required = {cfg.class_column: "class", cfg.item_column: "item", cfg.id_column: "id"}
    if not use_template:
        required[cfg.path_column] = "path"
    for column in template_columns:
        required.setdefault(column, "template field")
    has_split = cfg.split_column in raw.columns
    used = list(required) + ([cfg.split_column] if has_split else [])
    cells = pd.DataFrame({name: raw[name].str.strip() for name in dict.fromkeys(used)})
    rows = np.arange(len(cells), dtype=np.int64) + FIRST_DATA_ROW

    blank = (cells == "").all(axis=1).to_numpy()  # trailing/separator rows: not data
    if blank.any():
        cells, rows = cells[~blank], rows[~blank]
    if len(cells) == 0:
        raise IndexValidationError(
            f"index file {source} has no data rows (the header is row 1, data starts at row 2)"
        )

    empty_parts = []
    for name, role in required.items():
        empty = (cells[name] == "").to_numpy()
        if empty.any():
            empty_parts.append(
                f"column {name!r} ({role}) is empty in {int(empty.sum())} {_rows_text(rows[empty])}"
            )
    if empty_parts:
        raise IndexValidationError(
            f"index file {source} has empty cells: {'; '.join(empty_parts)}. "
            "Fill them in or delete those rows"
        )

    ids = cells[cfg.id_column]
    repeated = ids.duplicated(keep=False).to_numpy()
    if repeated.any():
        where: dict[str, list[int]] = defaultdict(list)
        for value, row in zip(ids[repeated].tolist(), rows[repeated].tolist(), strict=True):
            where[value].append(row)
        shown = "; ".join(f"{v!r} at {_rows_text(r)}" for v, r in list(where.items())[:_SHOW])
        more = f"; and {len(where) - _SHOW} more repeated ids" if len(where) > _SHOW else ""
        raise IndexValidationError(
            f"index file {source}: column {cfg.id_column!r} (data.id_column) must be unique, "
            f"but {len(where)} id(s) repeat: {shown}{more}. Remove the repeated rows or give "
            "them distinct ids"
        )

    split = pd.Series("", index=cells.index, dtype=str)
    if has_split:
        values = cells[cfg.split_column].str.lower()
        if (values != "").any():
            bad = ~values.isin(SPLITS).to_numpy()
            if bad.any():
                bad_values = sorted(set(cells[cfg.split_column][bad].tolist()))
                raise IndexValidationError(
                    f"index file {source}: column {cfg.split_column!r} (data.split_column) must "
                    f"hold train, val or test in every row, but has {_names_text(bad_values)} at "
                    f"{_rows_text(rows[bad])}. Fix those cells, or clear the whole column to "
                    "split by data.seed/data.val_ratio"
                )
            split = values

    if use_template:
        paths = _render_template(cfg.path_template, cells)
    else:
        paths = cells[cfg.path_column]
    table = pd.DataFrame({
        "cls": cells[cfg.class_column],
        "item": cells[cfg.item_column],
        "id": ids,
        "path": _resolve_paths(paths, root),
        "row": rows,
        "split": split,
    }).reset_index(drop=True)
    return table, _small_class_warnings(table, source)


def _small_class_warnings(table: pd.DataFrame, source: Path) -> list[str]:
    cls_codes, classes = pd.factorize(table["cls"], sort=True)
    item_codes, _ = pd.factorize(table["item"])
    pairs = np.unique(cls_codes.astype(np.int64) * (int(item_codes.max()) + 1) + item_codes)
    items_per_class = np.bincount(pairs // (int(item_codes.max()) + 1), minlength=len(classes))
    small = np.flatnonzero(items_per_class < 2)
    if len(small) == 0:
        return []
    return [
        f"index file {source}: {len(small)} of {len(classes)} classes have fewer than 2 items: "
        f"{_names_text(classes[small].tolist())}. Their samples give no positives from another "
        "item; add recordings to them or drop them from the sheet"
    ]


def _missing_files(paths: pd.Series) -> np.ndarray:
    """Mask of paths that are not existing files.

    Lists each referenced folder once (os.scandir) and compares names, instead of one stat per
    path: 2.5x faster on a local disk (benchmarks/index_load.py --files), far more on network
    storage. Paths not found that way are confirmed with os.path.isfile, which also covers
    case-insensitive file systems.
    """
    with _gc_paused():
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


def _check_files(table: pd.DataFrame, source: Path, root: str) -> None:
    missing = _missing_files(table["path"])
    if not missing.any():
        return
    count = int(missing.sum())
    first = table[missing].iloc[:_SHOW]
    shown = "; ".join(f"row {r}: {p}" for r, p in zip(first["row"], first["path"], strict=True))
    more = f"; and {count - _SHOW} more" if count > _SHOW else ""
    hint = (f" None of the {count} files exist: is data.root right (relative paths resolve "
            f"against {root})?" if count == len(table) else "")
    raise IndexValidationError(
        f"index file {source}: {count} of {len(table)} referenced files do not exist: "
        f"{shown}{more}.{hint} Fix the paths or data.root, or set data.check_files=false to "
        "skip this check"
    )


# ---------------------------------------------------------------------------------------------
# Cache


def _root(cfg: DataConfig, source: Path) -> str:
    return os.path.abspath(cfg.root) if cfg.root else str(source.parent)


def _cache_file(cfg: DataConfig, source: Path, root: str) -> Path:
    """One cache file per (sheet, config that shapes the table); the sheet's stamp goes inside."""
    key = json.dumps([str(source), cfg.sheet, cfg.class_column, cfg.item_column, cfg.id_column,
                      cfg.path_column, cfg.path_template, cfg.split_column, root, os.sep])
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    folder = Path(cfg.cache_dir) if cfg.cache_dir else source.parent / ".audioclf_cache"
    return folder / f"{source.stem}-{digest}.arrow"


def _stamp(source: Path) -> dict:
    """The sheet's size, mtime_ns and content hash (a 10 MB sheet hashes in ~5 ms)."""
    stat = source.stat()
    content = hashlib.blake2b(source.read_bytes(), digest_size=16).hexdigest()
    return {"version": CACHE_VERSION, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "content": content}


def _read_cache(path: Path, stamp: dict) -> tuple[pd.DataFrame, dict] | None:
    """The cached table and its metadata, or None when absent, stale or unreadable."""
    if not path.is_file():
        return None
    try:
        # read into memory, not memory-mapped: the table must outlive the file being replaced
        with pa.OSFile(str(path)) as source:
            reader = pa.ipc.open_file(source)
            meta = json.loads(reader.schema.metadata[_CACHE_META_KEY])
            if meta["stamp"] != stamp:
                return None
            table = reader.read_all().to_pandas()
        if tuple(table.columns) != TABLE_COLUMNS:
            raise ValueError(f"columns {list(table.columns)}")
        return table, meta
    except Exception as exc:  # a torn or foreign file: rebuild it
        log.warning("index cache %s is unreadable (%s: %s); rebuilding it",
                    path, type(exc).__name__, exc)
        return None


def _write_cache(path: Path, table: pd.DataFrame, meta: dict) -> None:
    """Atomically (temp file + os.replace); a cache that cannot be written is only logged."""
    try:
        arrow = pa.Table.from_pandas(table, preserve_index=False)
        arrow = arrow.replace_schema_metadata({_CACHE_META_KEY: json.dumps(meta).encode()})

        def write(sink) -> None:
            with pa.ipc.new_file(sink, arrow.schema) as writer:
                writer.write_table(arrow)

        atomic_write(path, write)
    except OSError as exc:
        log.warning("could not write the index cache %s (%s); the sheet is parsed on every run "
                    "(set data.cache_dir to a writable folder)", path, exc)


# ---------------------------------------------------------------------------------------------
# Loading


def load_index(cfg: DataConfig, *, use_cache: bool | None = None) -> Index:
    """Read, validate and cache the sheet `cfg.index` (use_cache=None follows `cfg.cache`).

    Raises IndexValidationError (and writes no cache) when the sheet cannot be used. Classes
    with fewer than 2 items are reported with warnings.warn, on every load.
    """
    use_cache = cfg.cache if use_cache is None else use_cache
    source = Path(os.path.abspath(cfg.index))
    root = _root(cfg, source)
    cache_file = stamp = None
    if use_cache and source.is_file():
        cache_file, stamp = _cache_file(cfg, source, root), _stamp(source)
        cached = _read_cache(cache_file, stamp)
        if cached is not None:
            table, meta = cached
            if cfg.check_files and not meta["files_checked"]:
                _check_files(table, source, root)
                _write_cache(cache_file, table, {**meta, "files_checked": True})
            _warn(meta["warnings"])
            return Index(table, source)

    table, messages = _validate(read_table(source, cfg), cfg, source, root)
    if cfg.check_files:
        _check_files(table, source, root)
    if cache_file is not None:
        meta = {"stamp": stamp, "files_checked": cfg.check_files, "warnings": messages}
        _write_cache(cache_file, table, meta)
    _warn(messages)
    return Index(table, source)


def _warn(messages: list[str]) -> None:
    for message in messages:
        warnings.warn(message, stacklevel=3)


def load_index_distributed(cfg: DataConfig) -> Index:
    """load_index on rank 0 first (it builds the cache), then on the other ranks (they read it).

    A validation error on rank 0 is raised on every rank at once, not after a timeout.
    """
    return distributed.primary_first(load_index, cfg)


# ---------------------------------------------------------------------------------------------
# Splits


def split_index(index: Index, cfg: DataConfig) -> dict[str, Index]:
    """{"train", "val"[, "test"]}: by the split column when the sheet has one, else generated.

    Generated splits depend only on cfg.seed, cfg.val_ratio, cfg.holdout and the set of
    class/item names (not on row order): holdout="classes" holds out whole classes (open-set,
    at least one class on each side when there are two or more); holdout="items" holds out
    items inside each class (closed-set; a class with a single item stays in train).
    """
    split = index.table["split"]
    if (split != "").any():
        names = ["train", "val"] + (["test"] if (split == "test").any() else [])
        return {name: index.subset((split == name).to_numpy()) for name in names}
    if cfg.holdout == "classes":
        held_out = _held_out_classes(index.table, cfg.val_ratio, cfg.seed)
    else:
        held_out = _held_out_items(index.table, cfg.val_ratio, cfg.seed)
    return {"train": index.subset(~held_out), "val": index.subset(held_out)}


def _holdout_count(n: np.ndarray | int, ratio: float) -> np.ndarray:
    """round(ratio * n), but at least 1 and at most n - 1 when ratio > 0 and n >= 2."""
    n = np.asarray(n, dtype=np.int64)
    if ratio <= 0:
        return np.zeros_like(n)
    count = np.floor(ratio * n + 0.5).astype(np.int64)
    return np.where(n >= 2, np.clip(count, 1, n - 1), 0)


def _held_out_classes(table: pd.DataFrame, ratio: float, seed: int) -> np.ndarray:
    codes, classes = pd.factorize(table["cls"], sort=True)
    order = np.random.default_rng(seed).permutation(len(classes))
    held = np.zeros(len(classes), dtype=bool)
    held[order[: int(_holdout_count(len(classes), ratio))]] = True
    return held[codes]


def _held_out_items(table: pd.DataFrame, ratio: float, seed: int) -> np.ndarray:
    pairs = table[["cls", "item"]].drop_duplicates().sort_values(["cls", "item"], ignore_index=True)
    pairs["draw"] = np.random.default_rng(seed).random(len(pairs))
    pairs = pairs.sort_values(["cls", "draw"], kind="stable")
    rank = pairs.groupby("cls", sort=False).cumcount().to_numpy()
    size = pairs.groupby("cls", sort=False)["item"].transform("size").to_numpy()
    pairs["held"] = rank < _holdout_count(size, ratio)
    merged = table[["cls", "item"]].merge(pairs[["cls", "item", "held"]], on=["cls", "item"],
                                          how="left")
    return merged["held"].to_numpy(dtype=bool)
