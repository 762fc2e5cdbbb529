"""The validated sample index: a sheet (.xlsx, .csv, .parquet) → one checked, cached table.

A sheet has a class column, an item column (a source/recording inside the class), an id column
(one sample), a path column or a `data.path_template`, and optionally a train/val/test column.
`load_index` reads it, validates it (one `IndexValidationError` naming the file, the rows and
the fix) and caches the validated table next to it, so the next run re-reads it in milliseconds.

Forgiving about the header, strict about the content: column names match the configured ones
ignoring case and spaces (`A_CLS`, ` a_cls `; two columns matching one name are an error), and
a header below title or notes rows is found (data.header_row names it outright); so are a
CSV's delimiter, the one worksheet holding the columns, and paths written with Windows
separators (reader.py, paths.py); each load logs what was assumed in one INFO line. Row
numbers in messages and in the table's row column are the sheet's own, title rows included.

    index = load_index(cfg.data)
    splits = split_index(index, cfg.data)  # {"train": Index, "val": Index[, "test": Index]}

Cache. The table is stored as an uncompressed Arrow IPC (feather) file in `data.cache_dir` or
`<sheet folder>/.audioclf_cache/` (the fastest of the formats measured: benchmarks/RESULTS.md,
"Large datasets"), named by the sheet's path and the header/column/root/template config,
and stamped with the sheet's size, mtime_ns and blake2b content hash; any change to the sheet or
that config makes it stale, and it is rebuilt. A file-existence check that passed is recorded in
the cache and not repeated on a hit (re-checking 400k files would defeat the cache): a file
deleted after the first run is reported when it is read, not here. Delete the cache folder to
force a full check.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from audioclf.config import DataConfig
from audioclf.data.index.cache import cache_path, data_root, read_cache, sheet_stamp, write_cache
from audioclf.data.index.reader import read_table
from audioclf.data.index.splits import split_index, stratified_subset
from audioclf.data.index.table import (
    TABLE_COLUMNS,
    Index,
    IndexValidationError,
    sheet_header,
)
from audioclf.data.index.validate import check_files, validate_table

log = logging.getLogger("audioclf")

__all__ = [
    "TABLE_COLUMNS",
    "Index",
    "IndexValidationError",
    "load_index",
    "read_table",
    "split_index",
    "stratified_subset",
]


def load_index(cfg: DataConfig, *, use_cache: bool | None = None) -> Index:
    """Read, validate and cache the sheet `cfg.index` (use_cache=None follows `cfg.cache`).

    Raises IndexValidationError (and writes no cache) when the sheet cannot be used. What was
    assumed about the header is logged (INFO), and classes with fewer than 2 items are reported
    with warnings.warn, on every load.
    """
    use_cache = cfg.cache if use_cache is None else use_cache
    source = Path(os.path.abspath(cfg.index))
    root = data_root(cfg, source)
    cache_file = stamp = None
    if use_cache and source.is_file():
        cache_file, stamp = cache_path(cfg, source, root), sheet_stamp(source)
        cached = read_cache(cache_file, stamp)
        if cached is not None:
            table, meta = cached
            _log_assumptions(meta["notes"], source)
            if cfg.check_files and not meta["files_checked"]:
                check_files(table, source, root)
                write_cache(cache_file, table, {**meta, "files_checked": True})
            _warn(meta["warnings"], source)
            return Index(table, source)

    raw = read_table(source, cfg)
    notes = list(sheet_header(raw).notes)
    try:
        table, messages, path_notes = validate_table(raw, cfg, source, root)
    except IndexValidationError:
        _log_assumptions(notes, source)  # before the error, which they may explain
        raise
    notes += path_notes
    _log_assumptions(notes, source)
    if cfg.check_files:
        check_files(table, source, root)
    if cache_file is not None:
        meta = {
            "stamp": stamp,
            "files_checked": cfg.check_files,
            "warnings": messages,
            "notes": notes,
        }
        write_cache(cache_file, table, meta)
    _warn(messages, source)
    return Index(table, source)


def _log_assumptions(notes: list[str], source: Path) -> None:
    """One line for everything read_table and validate_table assumed about the sheet."""
    if notes:
        log.info("index file %s: %s", source, "; ".join(notes))


def _warn(messages: list[str], source: Path) -> None:
    """warnings.warn attributed to the sheet (not to whichever module called load_index)."""
    for message in messages:
        warnings.warn_explicit(
            message, UserWarning, filename=str(source), lineno=1, module="audioclf.data.index"
        )
