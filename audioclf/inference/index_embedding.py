"""embed --index: every row of an index sheet into PREFIX.npy + PREFIX.parquet, in resumable
chunks (see `python -m audioclf.embed --help`).

    index = select_rows(model, "big.xlsx", root=None, split=None, skip_bad_files=False)
    summary = write_index_embeddings(model, index, "out/big", batch_size=16, num_workers=8)

Each chunk of CHUNK_ROWS rows is written as a part file into PREFIX.parts/ when done; a rerun
takes the finished parts that were made by the same model and features for the same rows, and
embeds only the rest. The folder's manifest is checked by audioclf.outputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import math
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from audioclf.cli import one_line
from audioclf.data.dataset import AudioDataset
from audioclf.data.index import Index, load_index, split_index
from audioclf.data.loader import loader_kwargs
from audioclf.data.readers import AudioReadError, FeatureFileError
from audioclf.fileio import atomic_write, atomic_write_bytes
from audioclf.inference.artefacts import LoadedEmbedder
from audioclf.inference.extract import check_finite, extract_embeddings, model_input
from audioclf.outputs import ManifestMismatch, check_manifest, write_manifest, write_skipped

log = logging.getLogger("audioclf")

CHUNK_ROWS = 4096  # rows per part file: the most work a killed run loses
PARTS_VERSION = 1  # bump when the part files' layout changes
PART_KEYS = ("embeddings", "positions", "rows", "skipped", "reasons")


@dataclass(frozen=True)
class IndexOutputs:
    """The files of one --index run, all named after --save PREFIX."""

    npy: Path
    parquet: Path
    skipped: Path
    parts: Path  # folder of finished chunks while the run is unfinished

    @classmethod
    def of(cls, prefix: str | Path) -> IndexOutputs:
        prefix = Path(prefix)
        name = prefix.name
        return cls(prefix.with_name(name + ".npy"), prefix.with_name(name + ".parquet"),
                   prefix.with_name(name + ".skipped.csv"), prefix.with_name(name + ".parts"))

    def part(self, chunk: int) -> Path:
        return self.parts / f"chunk-{chunk:06d}.npz"


@dataclass
class IndexSummary:
    """What an --index run did."""

    rows: int  # rows of the sheet (or split) to embed
    embedded: int  # rows in PREFIX.npy
    dim: int
    chunks: int
    resumed: int  # chunks taken from PREFIX.parts of an earlier run
    skipped: int  # unreadable rows left out (--skip-bad-files)
    outputs: IndexOutputs


# ---------------------------------------------------------------------------------------------
# The rows


def select_rows(model: LoadedEmbedder, sheet: str | Path, *, root: str | None,
                split: str | None, skip_bad_files: bool) -> Index:
    """The rows of `sheet` to embed (read with the model's column settings): every row, or
    those of one split. With skip_bad_files missing files are not an index error: they are
    skipped when read, like unreadable ones."""
    data = dataclasses.replace(
        model.data, index=str(sheet), root=root or "",
        split_column=model.data.split_column if split is not None else "",
        check_files=model.data.check_files and not skip_bad_files)
    with warnings.catch_warnings():
        # "classes with fewer than 2 items" is about training positives, not embedding.
        warnings.filterwarnings("ignore", message=".*fewer than 2 items")
        index = load_index(data)
    if split is not None:
        if not (index.table["split"] != "").any() and not model.knows_splits:
            raise ValueError(
                f"--split {split}: {index.source} has no split column ({data.split_column!r}) "
                f"and {model.path} is an export, which does not record how training generated "
                "its split (data.val_ratio, holdout, seed); add a split column to the sheet or "
                "pass the checkpoint as --model")
        splits = split_index(index, data)
        if split not in splits:
            raise ValueError(f"{index.source} has no {split!r} split (it has "
                             f"{', '.join(splits)}); use --split {' / '.join(splits)} or drop it")
        index = splits[split]
    if len(index) == 0:
        where = f"the {split} split of " if split is not None else ""
        raise ValueError(f"{where}{index.source} has no rows to embed")
    return index


# ---------------------------------------------------------------------------------------------
# Part files


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def parts_manifest(model: LoadedEmbedder, chunk_rows: int) -> dict:
    """What every part file of a run depends on besides its own rows' ids and paths."""
    stat = model.path.stat()
    return {"version": PARTS_VERSION, "model": str(model.path.resolve()),
            "model_mtime_ns": stat.st_mtime_ns, "model_size": stat.st_size,
            "input_kind": model.input_kind, "features": dataclasses.asdict(model.features),
            "clips": dataclasses.asdict(model.cfg.clips), "chunk_rows": chunk_rows}


def open_parts(outputs: IndexOutputs, manifest: dict) -> None:
    """Create PREFIX.parts/ with its manifest, or check that an earlier run's parts were made
    by the same model, features and chunk size."""
    path = outputs.parts / "manifest.json"
    try:
        if check_manifest(path, manifest):
            return
    except ManifestMismatch as exc:
        what = (f"its {', '.join(exc.changed)} differ{'s' if len(exc.changed) == 1 else ''}"
                if exc.earlier is not None else f"its {path.name} is {exc.reason}")
        raise ValueError(f"{outputs.parts} holds the unfinished work of another run ({what}); "
                         "delete it to start over, or choose another --save PREFIX") from None
    if outputs.parts.is_dir() and any(outputs.parts.glob("chunk-*.npz")):
        raise ValueError(f"{outputs.parts} holds part files but no manifest.json, so their model "
                         "is unknown; delete the folder to start over")
    try:
        write_manifest(path, manifest)
    except OSError as exc:
        raise ValueError(f"--save {outputs.parts.parent}: cannot write {outputs.parts} "
                         f"({exc.strerror or exc})") from None


def write_part(path: Path, part: dict[str, np.ndarray]) -> Path:
    """One finished chunk as an .npz, atomically: a killed run leaves whole parts only."""
    buffer = io.BytesIO()
    np.savez(buffer, **part)
    return atomic_write_bytes(path, buffer.getvalue())


def rows_digest(ids: np.ndarray, paths: np.ndarray) -> str:
    """What a part's rows were: their ids and paths (a digest; paths can be long)."""
    return _digest("\0".join([*ids.tolist(), *paths.tolist()]).encode())


def read_part(path: Path, ids: np.ndarray, paths: np.ndarray, start: int,
              dim: int | None) -> dict[str, np.ndarray] | None:
    """A finished chunk of rows start .. start + len(ids), if `path` holds one that is whole
    and was made for these very rows (same ids and paths); None otherwise."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            part = {key: stored[key] for key in PART_KEYS}
    except (OSError, ValueError, KeyError, EOFError):
        return None
    emb, positions, skipped = part["embeddings"], part["positions"], part["skipped"]
    expected = np.arange(start, start + len(ids))
    whole = (
        str(part["rows"]) == rows_digest(ids, paths)
        and emb.dtype == np.float32 and emb.ndim == 2 and len(emb) == len(positions)
        and len(part["reasons"]) == len(skipped)
        and np.array_equal(np.union1d(positions, skipped), expected)
        and len(positions) + len(skipped) == len(expected)
        and (len(emb) == 0 or dim is None or emb.shape[1] == dim)
        and bool(np.isfinite(emb).all())
    )
    return part if whole else None


# ---------------------------------------------------------------------------------------------
# Embedding the chunks


@dataclass
class _Rows:
    """What every chunk reads from: the model's dataset, the same files read strictly (for the
    reason a skipped file could not be read), and the rows' ids and paths."""

    dataset: torch.utils.data.Dataset
    strict: AudioDataset
    ids: np.ndarray
    paths: np.ndarray


def _index_rows(model: LoadedEmbedder, index: Index, skip_bad_files: bool,
                skip_hint: str | None) -> _Rows:
    def audio(skip: bool) -> AudioDataset:
        return AudioDataset.from_index(index, model.cfg, train=False, skip_bad_files=skip,
                                       skip_hint=skip_hint)

    table = index.table
    return _Rows(model_input(audio(skip_bad_files), model.input_kind), audio(False),
                 table["id"].to_numpy(dtype=str), table["path"].to_numpy(dtype=str))


def _why_unreadable(strict: AudioDataset, position: int) -> str:
    try:
        strict[position]
    except (AudioReadError, FeatureFileError) as exc:
        return one_line(exc.__cause__ or exc)
    return "could not be read in a DataLoader worker"


def embed_chunk(model: LoadedEmbedder, rows: _Rows, start: int, stop: int, *, batch_size: int,
                loader_options: dict, progress: bool, description: str) -> dict[str, np.ndarray]:
    """Embed rows start .. stop; the part file's arrays."""
    emb, _, seen = extract_embeddings(
        model.embed_fn, rows.dataset, batch_size=batch_size, device=model.device,
        positions=range(start, stop), loader_options=loader_options, progress=progress,
        description=description)
    order = np.argsort(seen, kind="stable")
    emb, seen = np.ascontiguousarray(emb[order], dtype=np.float32), seen[order].astype(np.int64)
    check_finite(emb, rows.paths[seen].tolist(), f"rows {start + 1}-{stop} of the sheet")
    skipped = np.setdiff1d(np.arange(start, stop), seen).astype(np.int64)
    reasons = np.array([_why_unreadable(rows.strict, int(p)) for p in skipped], dtype=str)
    digest = rows_digest(rows.ids[start:stop], rows.paths[start:stop])
    return {"embeddings": emb, "positions": seen, "rows": np.array(digest),
            "skipped": skipped, "reasons": reasons}


def write_index_embeddings(model: LoadedEmbedder, index: Index, prefix: str | Path, *,
                           batch_size: int = 16, num_workers: int = 0,
                           skip_bad_files: bool = False, progress: bool = True,
                           chunk_rows: int | None = None,
                           skip_hint: str | None = None) -> IndexSummary:
    """Embed every row of `index` into PREFIX.npy + PREFIX.parquet, through resumable part
    files in PREFIX.parts/ (chunk_rows rows each; default CHUNK_ROWS). `skip_hint`: how an
    unreadable file's message says to skip such files."""
    chunk_rows = CHUNK_ROWS if chunk_rows is None else chunk_rows
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    outputs = IndexOutputs.of(prefix)
    total = len(index)
    open_parts(outputs, parts_manifest(model, chunk_rows))
    rows = _index_rows(model, index, skip_bad_files, skip_hint)
    options = loader_kwargs(num_workers, True, False, 2, model.device)
    chunks = math.ceil(total / chunk_rows)
    dim, resumed = None, 0
    with tqdm(total=total, unit="rows", desc="embed", disable=not progress,
              dynamic_ncols=True) as bar:
        for chunk in range(chunks):
            start, stop = chunk * chunk_rows, min((chunk + 1) * chunk_rows, total)
            part = _finished_part(outputs.part(chunk), rows, start, stop, dim, skip_bad_files)
            if part is not None:
                resumed += 1
            else:
                part = embed_chunk(model, rows, start, stop, batch_size=batch_size,
                                   loader_options=options, progress=progress,
                                   description=f"chunk {chunk + 1}/{chunks}")
                write_part(outputs.part(chunk), part)
            if len(part["positions"]):
                dim = part["embeddings"].shape[1]
            bar.update(stop - start)
    embedded, skipped = _assemble(outputs, index, chunks, dim)
    return IndexSummary(total, embedded, dim or 0, chunks, resumed, skipped, outputs)


def _finished_part(path: Path, rows: _Rows, start: int, stop: int, dim: int | None,
                   skip_bad_files: bool) -> dict[str, np.ndarray] | None:
    """An earlier run's part for rows start .. stop that this run may take, else None."""
    if not path.is_file():
        return None
    part = read_part(path, rows.ids[start:stop], rows.paths[start:stop], start, dim)
    if part is None:
        log.warning("%s is incomplete or was made for other rows: embedding its rows again", path)
    elif len(part["skipped"]) and not skip_bad_files:
        return None  # an earlier --skip-bad-files run left rows out: now they must fail
    return part


# ---------------------------------------------------------------------------------------------
# Assembling the outputs


def _assemble(outputs: IndexOutputs, index: Index, chunks: int, dim: int | None
              ) -> tuple[int, int]:
    """PREFIX.npy, PREFIX.parquet and PREFIX.skipped.csv from the part files (streamed, never
    all in memory at once), then PREFIX.parts/ removed. Returns (rows embedded, skipped)."""
    positions, skipped, reasons = [], [], []
    for chunk in range(chunks):
        with np.load(outputs.part(chunk), allow_pickle=False) as part:
            positions.append(part["positions"])
            skipped.append(part["skipped"])
            reasons.append(part["reasons"])
    positions, skipped = np.concatenate(positions), np.concatenate(skipped)
    table = index.table
    write_skipped(outputs.skipped, table,
                  dict(zip(skipped.tolist(), np.concatenate(reasons).tolist(), strict=True)))
    if not len(positions):
        raise ValueError(f"none of the {len(table)} rows of {index.source} could be read "
                         f"(listed in {outputs.skipped})")

    def write_npy(handle) -> None:
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype("<f4")),
                  "fortran_order": False, "shape": (len(positions), dim)}
        np.lib.format.write_array_header_1_0(handle, header)
        for chunk in range(chunks):
            with np.load(outputs.part(chunk), allow_pickle=False) as part:
                handle.write(part["embeddings"].astype("<f4", copy=False).tobytes())

    atomic_write(outputs.npy, write_npy)
    rows = table.iloc[positions]
    frame = pd.DataFrame({"row": rows["row"].to_numpy(dtype=np.int64),
                          "id": rows["id"].to_numpy(), "class": rows["cls"].to_numpy(),
                          "item": rows["item"].to_numpy(), "path": rows["path"].to_numpy()})
    atomic_write(outputs.parquet, lambda handle: frame.to_parquet(handle, index=False))
    shutil.rmtree(outputs.parts)
    return len(positions), len(skipped)
