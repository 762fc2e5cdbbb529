"""The validated table, cached as an uncompressed Arrow IPC file stamped with the sheet's
size, mtime and content hash (see the package docstring)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pandas as pd
import pyarrow as pa

from audioclf.config import DataConfig
from audioclf.data.index.table import PACK_COLUMNS, SPAN_COLUMNS, TABLE_COLUMNS
from audioclf.fileio import atomic_write, file_stamp

log = logging.getLogger("audioclf")


# bump when the cached table's layout, its metadata or the validation rules change
# (2: headers found, names matched loosely, "notes" in the metadata; 4: Windows paths as "/";
# 5: start/end columns of segment rows; 6: a feature pack's pack_offset/pack_frames)
CACHE_VERSION = 6
_CACHE_META_KEY = b"audioclf.index"


def data_root(cfg: DataConfig, source: Path) -> str:
    """The folder relative paths resolve against: data.root, or else the sheet's folder."""
    return os.path.abspath(cfg.root) if cfg.root else str(source.parent)


def cache_path(cfg: DataConfig, source: Path, root: str) -> Path:
    """One cache file per (sheet, config that shapes the table); the sheet's stamp goes inside."""
    key = json.dumps(
        [
            str(source),
            cfg.sheet,
            cfg.header_row,
            cfg.class_column,
            cfg.item_column,
            cfg.id_column,
            cfg.path_column,
            cfg.path_template,
            cfg.split_column,
            root,
            os.sep,
        ]
    )
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    folder = Path(cfg.cache_dir) if cfg.cache_dir else source.parent / ".audioclf_cache"
    return folder / f"{source.stem}-{digest}.arrow"


def sheet_stamp(source: Path) -> dict:
    """What the cache records of the sheet: its path, size, mtime_ns and content hash."""
    return {"version": CACHE_VERSION, **file_stamp(source, content=True)}


def read_cache(path: Path, stamp: dict) -> tuple[pd.DataFrame, dict] | None:
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
        layouts = (TABLE_COLUMNS, TABLE_COLUMNS + SPAN_COLUMNS, TABLE_COLUMNS + PACK_COLUMNS)
        if tuple(table.columns) not in layouts:
            raise ValueError(f"columns {list(table.columns)}")
        return table, meta
    except Exception as exc:  # a torn or foreign file: rebuild it
        log.warning(
            "index cache %s is unreadable (%s: %s); rebuilding it", path, type(exc).__name__, exc
        )
        return None


def write_cache(path: Path, table: pd.DataFrame, meta: dict) -> None:
    """Atomically (temp file + os.replace); a cache that cannot be written is only logged."""
    try:
        arrow = pa.Table.from_pandas(table, preserve_index=False)
        arrow = arrow.replace_schema_metadata({_CACHE_META_KEY: json.dumps(meta).encode()})

        def write(sink) -> None:
            with pa.ipc.new_file(sink, arrow.schema) as writer:
                writer.write_table(arrow)

        atomic_write(path, write)
    except OSError as exc:
        log.warning(
            "could not write the index cache %s (%s); the sheet is parsed on every run "
            "(set data.cache_dir to a writable folder)",
            path,
            exc,
        )
