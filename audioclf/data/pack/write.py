"""Writing a feature pack (its format: audioclf.data.pack): the library under `prepare --pack`.

    summary = pack_features(Path("in.xlsx"), Path("DIR"), cfg, workers=8, skip_bad=False)

The sheet's rows are packed class-major (sorted by class, item, id). With features.kind=audio
each file goes through the front end (the log-mel prepare writes); with features.kind=npy each
.npy file is packed as it is (clips.npy_layout says its axis order; stored as frames × bins). A
pool of workers reads and converts samples in order; this process appends them to the data
files, each at most `file_bytes` long.

Durable and resumable: after every chunk of rows the data file and DIR/.pack-rows.bin (each
packed row's record) are fsynced and DIR/.pack-progress.json is replaced, naming the rows done
and the data files' sizes. A killed run (kill -9, a full disk, a reboot) is continued by the
next run with the same sheet and settings: it cuts the files back to the recorded sizes and
goes on from the next row. Until the end DIR has no index.parquet, so nothing can train on a
half pack; pack.json and then index.parquet are the last files written. A run with another
sheet (or the same sheet changed since) or other settings into an unfinished or finished pack
is refused, as is a second packer on the same folder (a lock).

Each packed row records its source file's size and mtime (rows.npy): a run into a pack (finished
or not) some of whose sources changed since they were packed is refused with one line naming the
first such file, instead of keeping the old frames. A full disk or a read-only folder is one line
naming the file (fileio.write_failure_message); the rows packed so far are kept for the rerun.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from audioclf.config import Config
from audioclf.data.index import Index, load_index, read_table
from audioclf.data.index.table import (
    FIRST_DATA_ROW,
    PACK_COLUMNS,
    SPAN_COLUMNS,
    path_suffixes,
    rows_text,
)
from audioclf.data.pack.format import (
    DTYPES,
    FORMAT,
    INDEX,
    MANIFEST,
    ROW_FIELDS,
    ROWS,
    VERSION,
    checksum,
    data_file_name,
    feature_settings,
    manifest_checksum,
    read_manifest,
    read_rows,
)
from audioclf.data.readers import AUDIO_SUFFIXES, AudioReadError, load_audio
from audioclf.fileio import DiskWriteError, atomic_write_bytes, file_stamp, write_failure_message
from audioclf.outputs import FolderLock, in_workers, write_skipped
from audioclf.spectrogram import log_mel

PROGRESS = ".pack-progress.json"
# int64 per packed row, appended: rows.npy's row (file, offset, frames, sheet position, source
# bytes, source mtime_ns)
RECORDS = ".pack-rows.bin"
RECORD_BYTES = ROW_FIELDS * 8
KEPT = "the rows packed so far are kept: run the same command again to continue"
SKIPPED = "skipped.csv"
CHUNK_ROWS = 32  # rows per worker task; the progress is made durable after each
DEFAULT_FILE_BYTES = 64 << 30  # a data file is started anew past this size


@dataclass
class PackSummary:
    rows: int = 0  # rows of the sheet
    packed: int = 0  # rows in the pack (this run and before)
    resumed_at: int = 0  # rows a killed run had packed already
    skipped: int = 0
    frames: int = 0
    bytes: int = 0  # of the data files
    files: int = 0
    elapsed: float = 0.0
    already_complete: bool = False
    index_path: Path | None = None
    skipped_path: Path | None = None

    def lines(self, command: str) -> list[str]:
        """What prepare --pack prints: the counts, the files, and `command` to train on it."""
        done = []
        if self.already_complete:
            done.append(f"{self.index_path.parent} already holds this pack (nothing to do)")
        elif self.resumed_at:
            done.append(f"continued a pack that had {self.resumed_at} of {self.rows} rows done")
        done.append(
            f"{self.rows} rows: {self.packed} packed ({self.frames:,} frames, "
            f"{self.bytes / 1e9:.3g} GB in {self.files} data file(s)), {self.skipped} skipped; "
            f"{self.elapsed:.1f} s"
        )
        if self.skipped_path is not None:
            done.append(f"skipped files: {self.skipped_path}")
        return [*done, f"index: {self.index_path}", f"train on it: {command}"]


@dataclass
class _Progress:
    """What has been packed so far (DIR/.pack-progress.json)."""

    key: str
    rows_done: int = 0  # positions of the class-major order handled (packed or skipped)
    files: list[int] = field(default_factory=list)  # sizes of data-00000.bin, ...
    records: int = 0  # records in .pack-rows.bin
    skipped: dict[int, str] = field(default_factory=dict)  # table position -> reason


def pack_features(
    index_path: Path,
    out_dir: Path,
    cfg: Config,
    *,
    workers: int,
    skip_bad: bool,
    dtype: str = "float16",
    file_bytes: int = DEFAULT_FILE_BYTES,
    progress: bool = True,
    on_chunk: Callable[[int], None] | None = None,
) -> PackSummary:
    """Pack the rows of `index_path` into `out_dir` (see the module docstring); `on_chunk(rows
    done)` is called after each durable chunk. Raises ValueError on bad input."""
    data = dataclasses.replace(
        cfg.data, index=str(index_path), check_files=cfg.data.check_files and not skip_bad
    )
    index = load_index(data)

    def columns() -> pd.DataFrame:  # the sheet's own columns, per table position
        raw = read_table(index.source, data)
        out = raw.iloc[index.table["row"].to_numpy() - FIRST_DATA_ROW].reset_index(drop=True)
        return out.drop(columns=[c for c in out.columns if c.strip().lower() in SPAN_COLUMNS])

    table_settings = [
        [data.sheet, data.class_column, data.item_column, data.id_column, data.path_column],
        [data.path_template, data.split_column, data.root],
    ]
    source = PackSource(
        index,
        index.source.read_bytes(),
        table_settings,
        columns,
        data.path_column,
        partial(index.unreadable, listing=SKIPPED, left_out_of="pack"),
    )
    options = PackOptions(workers, skip_bad, dtype, file_bytes, progress, on_chunk)
    return pack_source(source, out_dir, cfg, options)


@dataclass(frozen=True)
class PackSource:
    """What a pack is written from: `index` (its table's path, row, cls, item, id[, start, end]
    columns; its source names it in messages), the bytes and settings that name the pack
    (its key), the pack index's columns per table position (read when the pack is done) and
    the one of them that names the data file, and the message for a row that cannot be read
    (position, reason -> the line)."""

    index: Index
    content: bytes
    settings: list
    columns: Callable[[], pd.DataFrame]
    path_column: str
    refuse: Callable[[int, str], str]


@dataclass(frozen=True)
class PackOptions:
    workers: int
    skip_bad: bool
    dtype: str = "float16"
    file_bytes: int = DEFAULT_FILE_BYTES
    progress: bool = True
    on_chunk: Callable[[int], None] | None = None


def pack_source(source: PackSource, out_dir: Path, cfg: Config, options: PackOptions):
    """Pack the rows of `source.index` into `out_dir` (class-major; see the module docstring)."""
    start = time.perf_counter()
    dtype = options.dtype
    if dtype not in DTYPES:
        raise ValueError(f"--pack-dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if options.workers < 1:
        raise ValueError(f"workers must be >= 1, got {options.workers}")
    index = source.index
    not_readable = _check_sources(index, cfg.features.kind, options.skip_bad)
    order = class_major(index.table)
    key = _pack_key(source, cfg, dtype)
    summary = PackSummary(rows=len(order))
    with _pack_lock(out_dir):
        state = _start(out_dir, key, index)
        if state is None:
            summary.already_complete = True
            return _finished(summary, out_dir, start)
        summary.resumed_at = state.rows_done
        samples = _samples(index, order, state, cfg, dtype, options.workers, options.progress)
        with _DataWriter(out_dir, state, options.file_bytes) as writer:
            for chunk in samples:
                for position, sample, reason, stamp in chunk:
                    if position in not_readable:
                        state.skipped[position] = not_readable[position]
                    elif sample is None:
                        if not options.skip_bad:
                            raise AudioReadError(source.refuse(position, reason))
                        state.skipped[position] = reason
                    else:
                        writer.append(position, sample, stamp)
                state.rows_done += len(chunk)
                writer.commit()
                if options.on_chunk is not None:
                    options.on_chunk(state.rows_done)
        summary.skipped_path = write_skipped(out_dir / SKIPPED, index.table, state.skipped)
        _write_pack(source, cfg, dtype, out_dir, state)
    return _finished(summary, out_dir, start)


def class_major(table: pd.DataFrame) -> np.ndarray:
    """Table positions sorted by (class, item, id): the order samples lie in a pack."""
    return np.lexsort((table["id"].to_numpy(), table["item"].to_numpy(), table["cls"].to_numpy()))


# ---------------------------------------------------------------------------------------------
# Input and settings


def _check_sources(index: Index, kind: str, skip_bad: bool) -> dict[int, str]:
    """Positions of rows that are not files of `kind` → reason (refused unless `skip_bad`)."""
    table = index.table
    if PACK_COLUMNS[0] in table.columns:
        raise ValueError(f"index file {index.source} is a feature pack's index already")
    suffixes = path_suffixes(table["path"])
    if kind == "npy":
        good, wanted = (suffixes == ".npy").to_numpy(), ".npy feature files (features.kind=npy)"
    else:
        good, wanted = suffixes.isin(AUDIO_SUFFIXES).to_numpy(), "audio files (features.kind=audio)"
    if good.all():
        return {}
    if not skip_bad:
        raise ValueError(
            f"index file {index.source}: {int((~good).sum())} file(s) are not {wanted} "
            f"({rows_text(table['row'][~good])}, e.g. {table['path'][~good].iloc[0]}); set "
            "features.kind to what the sheet lists, fix the sheet, or pass --skip-bad"
        )
    return {int(p): f"not one of the {wanted}" for p in np.flatnonzero(~good)}


def _pack_key(source: PackSource, cfg: Config, dtype: str) -> str:
    """Names one pack: the source's content and settings, the features, the dtype."""
    shaping = [
        VERSION,
        dtype,
        cfg.features.kind,
        cfg.clips.npy_layout,
        feature_settings(cfg.features),
        *source.settings,
    ]
    digest = hashlib.blake2b(source.content, digest_size=16)
    digest.update(json.dumps(shaping, sort_keys=True).encode())
    return digest.hexdigest()


def _pack_lock(out_dir: Path) -> FolderLock:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} exists and is not a folder")
    with _disk_errors(out_dir, "nothing was written"):
        out_dir.mkdir(parents=True, exist_ok=True)
    return FolderLock(
        out_dir / ".pack.lock",
        what=f"--out {out_dir}",
        by="another prepare --pack",
        fix="wait for it to finish, or choose another --out",
    )


def _start(out_dir: Path, key: str, index: Index) -> _Progress | None:
    """The progress to continue (a fresh one for an empty folder); None when the pack with this
    key is complete. Raises for a folder holding anything else, or a pack some of whose source
    files changed since they were packed."""
    manifest, progress = out_dir / MANIFEST, out_dir / PROGRESS
    if manifest.is_file() and not progress.is_file():
        if _complete_pack_key(out_dir) != key or not (out_dir / INDEX).is_file():
            raise ValueError(
                f"--out {out_dir} holds a feature pack of another sheet or settings (or of "
                f"{index.source} before it changed); {OTHER_OUT.format(out_dir=out_dir)}"
            )
        _check_sources_unchanged(index, out_dir, np.load(out_dir / ROWS, allow_pickle=False))
        return None
    if progress.is_file():
        state = _read_progress(progress, out_dir)
        if state.key != key:
            raise ValueError(
                f"--out {out_dir} holds an unfinished pack of another sheet or settings (or of "
                f"{index.source} before it changed); {OTHER_OUT.format(out_dir=out_dir)}"
            )
        done = np.fromfile(out_dir / RECORDS, dtype="<i8", count=state.records * ROW_FIELDS)
        _check_sources_unchanged(index, out_dir, done.reshape(-1, ROW_FIELDS))
        return state
    if any(not p.name.startswith(".") for p in out_dir.iterdir()):
        raise ValueError(
            f"--out {out_dir} is not empty and holds no pack; {OTHER_OUT.format(out_dir=out_dir)}"
        )
    return _Progress(key)


OTHER_OUT = "choose another --out, or delete {out_dir} to pack it anew"


def _complete_pack_key(out_dir: Path) -> str | None:
    """The key of the complete pack in `out_dir` (checked: read_manifest and read_rows); a
    pack of an older audioclf is refused, one that cannot be read has none."""
    try:
        earlier = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    version = earlier.get("version") if isinstance(earlier, dict) else None
    if isinstance(version, int) and version < VERSION:
        raise ValueError(
            f"--out {out_dir} holds a feature pack made by an older audioclf (format version "
            f"{version}); {OTHER_OUT.format(out_dir=out_dir)}"
        )
    read_rows(out_dir, read_manifest(out_dir))  # damaged: one line naming the file
    return earlier.get("source", {}).get("key")


def _read_progress(progress: Path, out_dir: Path) -> _Progress:
    try:
        saved = json.loads(progress.read_text())
        return _Progress(
            saved["key"],
            saved["rows_done"],
            saved["files"],
            saved["records"],
            {int(p): r for p, r in saved["skipped"].items()},
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{progress} is damaged ({exc}); {OTHER_OUT.format(out_dir=out_dir)}"
        ) from None


def _check_sources_unchanged(index: Index, out_dir: Path, records: np.ndarray) -> None:
    """ValueError naming the first packed source file whose size or mtime differs from when it
    was packed (`records`: rows.npy's rows); a source gone since is not a change (the pack
    holds its frames)."""
    paths = index.table["path"].to_numpy()
    seen: dict[str, bool] = {}
    changed = []
    for position, size, mtime in records[:, 3:].tolist():
        path = str(paths[position])
        if path not in seen:
            try:
                now = file_stamp(Path(path))
                seen[path] = (now["bytes"], now["mtime_ns"]) != (size, mtime)
            except OSError:
                seen[path] = False
            if seen[path]:
                changed.append(position)
    if changed:
        row = int(index.table["row"].iat[changed[0]])
        raise ValueError(
            f"--out {out_dir} holds frames of {len(changed)} source file(s) that changed since "
            f"they were packed (first: {paths[changed[0]]}, row {row} of {index.source}): the "
            f"pack would keep the old frames; delete {out_dir} (or choose another --out) and run "
            "prepare --pack again"
        )


# ---------------------------------------------------------------------------------------------
# Reading samples, in order, in a pool of workers


@dataclass(frozen=True)
class _Reader:
    """How a worker turns one row into the pack's bytes."""

    features: object  # FeaturesConfig
    layout: str  # clips.npy_layout of .npy sources
    dtype: str

    def sample(self, path: str, span) -> tuple[np.ndarray | None, str, tuple[int, int] | None]:
        """(frames [T, bins] in the pack's dtype, "", the source's (bytes, mtime_ns) before it
        was read) or (None, why it cannot be packed, None)."""
        try:
            stamp = file_stamp(Path(path))
            frames = self._float_frames(path, span)
        except (AudioReadError, OSError, ValueError, EOFError) as exc:
            return None, str(exc), None
        packed, reason = self._checked(path, frames)
        return packed, reason, None if packed is None else (stamp["bytes"], stamp["mtime_ns"])

    def _checked(self, path: str, frames: np.ndarray) -> tuple[np.ndarray | None, str]:
        """(the frames in the pack's dtype, "") or (None, why they cannot be packed)."""
        bins = self.features.n_mels
        if frames.ndim != 2 or frames.shape[1] != bins or frames.shape[0] == 0:
            return None, (
                f"{path} holds an array of shape {frames.shape}, not [frames, {bins}] "
                f"(features.n_mels={bins}, clips.npy_layout={self.layout})"
            )
        if not np.isfinite(frames).all():
            return None, f"{path} has non-finite values (NaN or inf)"
        with np.errstate(over="ignore"):  # an overflow to inf is the check below
            packed = frames.astype(self.dtype)
        if not np.isfinite(packed).all():
            return None, (
                f"{path} has values beyond float16's range (±65504); pack with --pack-dtype float32"
            )
        return packed, ""

    def _float_frames(self, path: str, span) -> np.ndarray:
        if self.features.kind == "audio":
            return log_mel(load_audio(path, self.features.sample_rate, span), self.features)
        array = np.load(path, allow_pickle=False)
        if array.dtype.kind != "f":
            raise ValueError(f"{path} holds {array.dtype} values, not floats")
        if array.ndim == 2 and self.layout == "bins_frames":
            array = array.T
        return np.ascontiguousarray(array, dtype=np.float32)


_WORKER: dict = {}


def _init_worker(reader: _Reader) -> None:
    torch.set_num_threads(1)  # one clip is too small to share between threads
    _WORKER["reader"] = reader


def _read_chunk(tasks: list[tuple[int, str, object]]) -> list[tuple[int, object, str, object]]:
    reader = _WORKER["reader"]
    return [(position, *reader.sample(path, span)) for position, path, span in tasks]


def _samples(
    index: Index, order: np.ndarray, state: _Progress, cfg: Config, dtype, workers, progress
) -> Iterator[list[tuple[int, object, str]]]:
    """Chunks of (position, frames or None, reason, source stamp) in pack order, from
    state.rows_done on."""
    table = index.table
    paths = table["path"].to_numpy()
    spans = table[list(SPAN_COLUMNS)].to_numpy(np.float64) if "start" in table else None

    def span(p: int):
        return None if spans is None or np.isnan(spans[p, 0]) else tuple(map(float, spans[p]))

    todo = order[state.rows_done :].tolist()
    chunks = [
        [(p, str(paths[p]), span(p)) for p in todo[i : i + CHUNK_ROWS]]
        for i in range(0, len(todo), CHUNK_ROWS)
    ]
    reader = _Reader(cfg.features, cfg.clips.npy_layout, dtype)
    bar = tqdm(
        total=len(order),
        initial=state.rows_done,
        desc="pack",
        unit="row",
        disable=None if progress else True,
        dynamic_ncols=True,
    )
    # in order: the pack is sequential
    yield from in_workers(_read_chunk, chunks, workers, _init_worker, (reader,), bar, True)


# ---------------------------------------------------------------------------------------------
# The data files


@contextlib.contextmanager
def _disk_errors(path: Path, kept: str = KEPT) -> Iterator[None]:
    """An OSError of a write under `path` (a full disk, a read-only folder) as the one line every
    writer gives (fileio.write_failure_message): the file or folder, why, and the fix."""
    try:
        yield
    except DiskWriteError:
        raise
    except OSError as exc:
        raise DiskWriteError(
            exc.errno, write_failure_message(Path(exc.filename or path), exc.strerror, kept)
        ) from exc


class _DataWriter:
    """Appends samples to the data files and makes the progress durable (`commit`); an OSError
    (a full disk) is one line naming the file (_disk_errors)."""

    def __init__(self, out_dir: Path, state: _Progress, file_bytes: int):
        self.out_dir, self.state, self.file_bytes = out_dir, state, file_bytes
        if not state.files:
            state.files.append(0)
        with _disk_errors(out_dir):
            _cut_back(out_dir, state)
            self.handle = open(self._data_path(), "r+b")
            self.handle.seek(state.files[-1])
            self.records = open(out_dir / RECORDS, "r+b")
            self.records.seek(state.records * RECORD_BYTES)
        if not (out_dir / PROGRESS).is_file():  # a stop before the first chunk leaves a resumable
            self.commit()  # folder, not files a rerun takes for another's

    def _data_path(self) -> Path:
        return self.out_dir / data_file_name(len(self.state.files) - 1)

    def append(self, position: int, frames: np.ndarray, stamp: tuple[int, int]) -> None:
        """One sample's frames, read from a source of `stamp` (bytes, mtime_ns)."""
        data = memoryview(frames).cast("B")
        with _disk_errors(self._data_path()):
            if self.state.files[-1] and self.state.files[-1] + len(data) > self.file_bytes:
                self._sync()
                self.handle.close()
                self.state.files.append(0)
                self.handle = open(self._data_path(), "w+b")
            record = (
                len(self.state.files) - 1,
                self.state.files[-1],
                frames.shape[0],
                position,
                *stamp,
            )
            self.handle.write(data)
            self.records.write(np.asarray(record, dtype="<i8").tobytes())
        self.state.files[-1] += len(data)
        self.state.records += 1

    def commit(self) -> None:
        """The data and the records on disk, then the progress that names them."""
        with _disk_errors(self._data_path()):
            self._sync()
        state = self.state
        saved = dataclasses.asdict(state)
        saved["skipped"] = {str(p): r for p, r in state.skipped.items()}
        atomic_write_bytes(self.out_dir / PROGRESS, json.dumps(saved).encode(), sync=True)

    def _sync(self) -> None:
        for handle in (self.handle, self.records):
            handle.flush()
            os.fsync(handle.fileno())

    def __enter__(self) -> _DataWriter:
        return self

    def __exit__(self, *exc) -> None:
        for handle in (self.handle, self.records):
            try:
                handle.close()
            except OSError:  # a full disk cannot flush: the error being raised is the one to tell
                pass


def _cut_back(out_dir: Path, state: _Progress) -> None:
    """Files as the progress recorded them: longer ones cut back (a killed run wrote past its
    last commit), later ones removed, missing ones created empty."""
    for number, size in enumerate(state.files):
        path = out_dir / data_file_name(number)
        with open(path, "ab") as handle:
            handle.truncate(size)
    for path in out_dir.glob("data-*.bin"):
        if int(path.stem.split("-")[1]) >= len(state.files):
            path.unlink()
    with open(out_dir / RECORDS, "ab") as handle:
        handle.truncate(state.records * RECORD_BYTES)
    for stale in (MANIFEST, INDEX, ROWS):
        (out_dir / stale).unlink(missing_ok=True)


def _write_pack(source: PackSource, cfg: Config, dtype: str, out_dir: Path, state: _Progress):
    """rows.npy, pack.json and, last, index.parquet; then the progress files go."""
    records = np.fromfile(out_dir / RECORDS, dtype="<i8").reshape(-1, ROW_FIELDS)
    rows = _npy_bytes(records)
    atomic_write_bytes(out_dir / ROWS, rows, sync=True)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "bins": cfg.features.n_mels,
        "layout": "frames_bins",
        "features": feature_settings(cfg.features) if cfg.features.kind == "audio" else None,
        "rows": len(records),
        "frames": int(records[:, 2].sum()),
        "files": [_data_file(out_dir, i, size) for i, size in enumerate(state.files)],
        "source": {"sheet": str(source.index.source), "kind": cfg.features.kind, "key": state.key},
        "rows_checksum": checksum(rows),
    }
    manifest["checksum"] = manifest_checksum(manifest)
    atomic_write_bytes(out_dir / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    out = source.columns().iloc[records[:, 3]].reset_index(drop=True)
    out[source.path_column] = [data_file_name(int(f)) for f in records[:, 0]]
    out[PACK_COLUMNS[0]] = records[:, 1]
    out[PACK_COLUMNS[1]] = records[:, 2]
    buffer = io.BytesIO()
    out.to_parquet(buffer, index=False)
    atomic_write_bytes(out_dir / INDEX, buffer.getvalue(), sync=True)
    (out_dir / PROGRESS).unlink()
    (out_dir / RECORDS).unlink()


def _data_file(out_dir: Path, number: int, size: int) -> dict:
    """A data file's manifest entry: its name, size and mtime (a reader that finds both
    unchanged need not check its frames again)."""
    name = data_file_name(number)
    return {"name": name, "bytes": size, "mtime_ns": os.stat(out_dir / name).st_mtime_ns}


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array, dtype=np.int64))
    return buffer.getvalue()


def _finished(summary: PackSummary, out_dir: Path, start: float) -> PackSummary:
    manifest = json.loads((out_dir / MANIFEST).read_text())
    summary.packed, summary.frames = manifest["rows"], manifest["frames"]
    summary.files = len(manifest["files"])
    summary.bytes = sum(f["bytes"] for f in manifest["files"])
    summary.skipped = summary.rows - summary.packed
    summary.index_path = out_dir / INDEX
    summary.elapsed = time.perf_counter() - start
    return summary
