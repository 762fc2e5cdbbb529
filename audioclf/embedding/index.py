"""embed --index: every row of an index sheet into PREFIX.npy + PREFIX.parquet, in resumable
chunks (see `python -m audioclf.embed --help`).

    summary = embed_sheet(model, "big.xlsx", "out/big", EmbedSheetOptions(num_workers=8))
    print("\n".join(summary.lines(model)))

which is select_rows (which rows), then write_index_embeddings (the resumable work):

    index = select_rows(model, "big.xlsx", root=None, split=None, skip_bad_files=False)
    summary = write_index_embeddings(model, index, "out/big", batch_size=16, num_workers=8)

Each chunk of CHUNK_ROWS rows is written as a part file into PREFIX.parts/ when done; a rerun
takes the finished parts that were made by the same model and features for the same rows, and
embeds only the rest. The part files and their manifest are parts.py's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from audioclf import distributed
from audioclf.data.dataset import AudioDataset
from audioclf.data.index import Index, IndexValidationError, load_index, split_index
from audioclf.data.readers import AudioReadError, FeatureFileError
from audioclf.embedding.parts import (
    IndexOutputs,
    assemble,
    open_parts,
    parts_manifest,
    read_part,
    rows_digest,
    write_part,
)
from audioclf.errors import one_line
from audioclf.inference.artefacts import LoadedEmbedder, model_record
from audioclf.inference.extract import check_finite, dataset_for_input, embed_dataset

log = logging.getLogger("audioclf")

CHUNK_ROWS = 4096  # rows per part file: the most work a killed run loses
# What an index error about missing files says to do; select_rows can name a flag instead.
CHECK_FILES_HINT = "set data.check_files=false to skip this check"


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
    source: Path  # the index sheet
    split: str | None = None  # the split embedded (None: every row); set by embed_sheet
    seconds: float = 0.0  # the run's wall time; set by embed_sheet

    def lines(self, model: LoadedEmbedder) -> list[str]:
        """What embed --index prints when done: the rows and chunks, the files, the skipped."""
        out = self.outputs
        where = f", {self.split} split" if self.split is not None else ""
        resumed = f", {self.resumed} finished earlier" if self.resumed else ""
        lines = [
            f"model: {model.path} ({model.description}); index: {self.source}{where}: "
            f"{self.rows} rows in {self.chunks} chunk(s){resumed}",
            f"saved {out.npy} ({self.embedded} x {self.dim} float32) and {out.parquet} "
            f"in {self.seconds:.1f} s",
        ]
        if self.skipped:
            lines.append(f"skipped {self.skipped} unreadable file(s): listed in {out.skipped}")
        return lines


@dataclass(frozen=True)
class EmbedSheetOptions:
    """Which rows `embed_sheet` embeds and how: the options of `python -m audioclf.embed
    --index`, one field a flag (batch_size is --batch-size)."""

    root: str | None = None  # where the sheet's relative paths resolve (None: its own folder)
    split: str | None = None  # only this split's rows (train, val, test); None: every row
    batch_size: int = 16
    num_workers: int | None = None  # None: the model's data.num_workers
    skip_bad_files: bool = False  # unreadable (and missing) files listed, not an error


def embed_sheet(
    model: LoadedEmbedder,
    sheet: str | Path,
    prefix: str | Path,
    options: EmbedSheetOptions | None = None,
    *,
    progress: bool = True,
    skip_hint: str | None = None,
    missing_files_hint: str | None = None,
) -> IndexSummary:
    """Every row of `sheet` (or of one split) into PREFIX.npy + PREFIX.parquet, as `options`
    say (default EmbedSheetOptions()): select_rows, then write_index_embeddings. The summary
    records the split and the time taken."""
    start = time.perf_counter()
    options = options or EmbedSheetOptions()
    index = select_rows(
        model,
        sheet,
        root=options.root,
        split=options.split,
        skip_bad_files=options.skip_bad_files,
        missing_files_hint=missing_files_hint,
    )
    workers = model.data.num_workers if options.num_workers is None else options.num_workers
    summary = write_index_embeddings(
        model,
        index,
        prefix,
        batch_size=options.batch_size,
        num_workers=workers,
        skip_bad_files=options.skip_bad_files,
        progress=progress,
        skip_hint=skip_hint,
    )
    seconds = time.perf_counter() - start
    return dataclasses.replace(summary, split=options.split, seconds=seconds)


# ---------------------------------------------------------------------------------------------
# The rows


def check_index_request(
    save: str | None, *, files: list, gallery: Path | None, top: int | None, no_cache: bool
) -> None:
    """ValueError when embed --index is given the ranking mode's flags (audio files, --gallery,
    --top, --no-cache) or no --save PREFIX, before any work."""
    clashes = [
        flag
        for flag, given in (
            ("audio files", files),
            ("--gallery", gallery is not None),
            ("--top", top is not None),
            ("--no-cache", no_cache),
        )
        if given
    ]
    if clashes:
        raise ValueError(
            f"--index embeds a sheet's rows and ranks nothing: drop "
            f"{', '.join(clashes)} (or drop --index to rank files against "
            "--gallery)"
        )
    if not save:
        raise ValueError(
            "--index needs --save PREFIX (the embeddings go to PREFIX.npy and "
            "the rows to PREFIX.parquet)"
        )


def select_rows(
    model: LoadedEmbedder,
    sheet: str | Path,
    *,
    root: str | None,
    split: str | None,
    skip_bad_files: bool,
    missing_files_hint: str | None = None,
) -> Index:
    """The rows of `sheet` to embed (read with the model's column settings): every row, or
    those of one split. With skip_bad_files missing files are not an index error: they are
    skipped when read, like unreadable ones. `missing_files_hint`: what the error about missing
    files says to do instead of CHECK_FILES_HINT (e.g. the flag that skips them)."""
    try:
        return _rows_to_embed(model, sheet, root=root, split=split, skip_bad_files=skip_bad_files)
    except IndexValidationError as exc:
        if missing_files_hint is None:
            raise
        raise IndexValidationError(str(exc).replace(CHECK_FILES_HINT, missing_files_hint)) from None


def _rows_to_embed(
    model: LoadedEmbedder,
    sheet: str | Path,
    *,
    root: str | None,
    split: str | None,
    skip_bad_files: bool,
) -> Index:
    """select_rows' rows, with the index errors as load_index words them."""
    data = dataclasses.replace(
        model.data,
        index=str(sheet),
        root=root or "",
        split_column=model.data.split_column if split is not None else "",
        check_files=model.data.check_files and not skip_bad_files,
    )
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
                "pass the checkpoint as --model"
            )
        splits = split_index(index, data)
        if split not in splits:
            raise ValueError(
                f"{index.source} has no {split!r} split (it has "
                f"{', '.join(splits)}); use --split {' / '.join(splits)} or drop it"
            )
        index = splits[split]
    if len(index) == 0:
        where = f"the {split} split of " if split is not None else ""
        raise ValueError(f"{where}{index.source} has no rows to embed")
    return index


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


def _index_rows(
    model: LoadedEmbedder, index: Index, skip_bad_files: bool, skip_hint: str | None
) -> _Rows:
    def audio(skip: bool) -> AudioDataset:
        return AudioDataset.from_index(
            index, model.cfg, train=False, skip_bad_files=skip, skip_hint=skip_hint
        )

    table = index.table
    return _Rows(
        dataset_for_input(audio(skip_bad_files), model.input_kind),
        audio(False),
        table["id"].to_numpy(dtype=str),
        table["path"].to_numpy(dtype=str),
    )


def _why_unreadable(strict: AudioDataset, position: int) -> str:
    try:
        strict[position]
    except (AudioReadError, FeatureFileError) as exc:
        return one_line(exc.__cause__ or exc)
    return "could not be read in a DataLoader worker"


def embed_chunk(
    model: LoadedEmbedder,
    rows: _Rows,
    start: int,
    stop: int,
    *,
    batch_size: int,
    num_workers: int,
    progress: bool,
    description: str,
) -> dict[str, np.ndarray]:
    """Embed rows start .. stop; the part file's arrays."""
    emb, _, seen = embed_dataset(
        model.embed_fn,
        rows.dataset,
        batch_size=batch_size,
        device=model.device,
        positions=range(start, stop),
        num_workers=num_workers,
        progress=progress,
        description=description,
    )
    order = np.argsort(seen, kind="stable")
    emb, seen = np.ascontiguousarray(emb[order], dtype=np.float32), seen[order].astype(np.int64)
    check_finite(emb, rows.paths[seen].tolist(), f"rows {start + 1}-{stop} of the sheet")
    skipped = np.setdiff1d(np.arange(start, stop), seen).astype(np.int64)
    reasons = np.array([_why_unreadable(rows.strict, int(p)) for p in skipped], dtype=str)
    digest = rows_digest(rows.ids[start:stop], rows.paths[start:stop])
    return {
        "embeddings": emb,
        "positions": seen,
        "rows": np.array(digest),
        "skipped": skipped,
        "reasons": reasons,
    }


def write_index_embeddings(
    model: LoadedEmbedder,
    index: Index,
    prefix: str | Path,
    *,
    batch_size: int = 16,
    num_workers: int = 0,
    skip_bad_files: bool = False,
    progress: bool = True,
    chunk_rows: int | None = None,
    skip_hint: str | None = None,
) -> IndexSummary:
    """Embed every row of `index` into PREFIX.npy + PREFIX.parquet, through resumable part
    files in PREFIX.parts/ (chunk_rows rows each; default CHUNK_ROWS). `skip_hint`: how an
    unreadable file's message says to skip such files.

    Under a process group (torchrun, srun) the chunks are dealt to the ranks (chunk c to rank
    c % world size; each rank embeds whole chunks on its own device) and rank 0 assembles the
    outputs once every chunk exists: every rank must call it. The part files do not depend on
    the rank, so a rerun with another number of ranks takes every finished one.
    """
    chunk_rows = CHUNK_ROWS if chunk_rows is None else chunk_rows
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    outputs = IndexOutputs.of(prefix)
    lock = outputs.lock() if distributed.get_rank() == 0 else None
    try:
        distributed.primary_first(open_parts, outputs, parts_manifest(model, chunk_rows), lock)
        rows = _index_rows(model, index, skip_bad_files, skip_hint)
        work = _ChunkWork(
            model,
            rows,
            outputs,
            chunk_rows,
            len(index),
            batch_size,
            skip_bad_files,
            num_workers,
        )
        rank, world = distributed.get_rank(), distributed.get_world_size()
        shown = progress and rank == 0
        resumed = 0
        with tqdm(
            total=len(index), unit="rows", desc="embed", disable=not shown, dynamic_ncols=True
        ) as bar:
            for first in range(0, work.chunks, world):  # one round: a chunk per rank
                resumed += work.run_round(first, rank, progress=shown)
                bar.update(work.rows_in(range(first, min(first + world, work.chunks))))
        resumed = int(distributed.all_reduce_sum([resumed]).item())
        try:
            embedded, skipped = distributed.primary_only(
                assemble, outputs, index, work.chunks, model_record(model)
            )
        except RuntimeError as exc:  # rank 0 failed and says why; the others stop quietly
            if rank == 0:
                raise
            raise distributed.PeerFailure(str(exc), reported=True) from None
        return IndexSummary(
            len(index),
            embedded,
            _dim(outputs, embedded),
            work.chunks,
            resumed,
            skipped,
            outputs,
            index.source,
        )
    finally:
        if lock is not None:
            lock.release()


@dataclass
class _ChunkWork:
    """The chunks of one --index run and how each is embedded (or taken from an earlier run)."""

    model: LoadedEmbedder
    rows: _Rows
    outputs: IndexOutputs
    chunk_rows: int
    total: int
    batch_size: int
    skip_bad_files: bool
    num_workers: int

    @property
    def chunks(self) -> int:
        return math.ceil(self.total / self.chunk_rows)

    def bounds(self, chunk: int) -> tuple[int, int]:
        return chunk * self.chunk_rows, min((chunk + 1) * self.chunk_rows, self.total)

    def rows_in(self, chunks: range) -> int:
        return sum(stop - start for start, stop in map(self.bounds, chunks))

    def run_round(self, first: int, rank: int, *, progress: bool) -> int:
        """Embed (or take) chunk first + rank; 1 when an earlier run's part was taken. A
        failure on any rank stops every rank (collective: every rank calls it each round)."""
        chunk, failure, taken = first + rank, None, 0
        if chunk < self.chunks:
            try:
                taken = self.one_chunk(chunk, progress=progress)
            except Exception as exc:  # raised below, after the others know
                failure = exc
        failed = distributed.all_reduce_max(torch.tensor([float(failure is not None)]))
        if failure is not None:
            raise failure
        if failed.item() > 0:
            raise distributed.PeerFailure("another rank's chunk failed (it said why)", True)
        return taken

    def one_chunk(self, chunk: int, *, progress: bool) -> int:
        start, stop = self.bounds(chunk)
        path = self.outputs.part(chunk)
        if _finished_part(path, self.rows, start, stop, self.skip_bad_files) is not None:
            return 1
        part = embed_chunk(
            self.model,
            self.rows,
            start,
            stop,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            progress=progress,
            description=f"chunk {chunk + 1}/{self.chunks}",
        )
        write_part(path, part)
        return 0


def _dim(outputs: IndexOutputs, embedded: int) -> int:
    """The embedding size of the assembled PREFIX.npy (its header)."""
    if not embedded:
        return 0
    return int(np.load(outputs.npy, mmap_mode="r").shape[1])


def _finished_part(
    path: Path, rows: _Rows, start: int, stop: int, skip_bad_files: bool
) -> dict[str, np.ndarray] | None:
    """An earlier run's part for rows start .. stop that this run may take, else None."""
    if not path.is_file():
        return None
    part = read_part(path, rows.ids[start:stop], rows.paths[start:stop], start, None)
    if part is None:
        log.warning("%s is incomplete or was made for other rows: embedding its rows again", path)
    elif len(part["skipped"]) and not skip_bad_files:
        return None  # an earlier --skip-bad-files run left rows out: now they must fail
    return part
