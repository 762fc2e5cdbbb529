"""Embed new audio files and rank the classes of a gallery sheet for each of them, or embed
every row of an index sheet into files for a search index.

    python -m audioclf.embed --model runs/demo/best.pt --gallery data/demo/index.xlsx clips/
    python -m audioclf.embed --model model.pt --gallery refs.xlsx --top 3 --save out/new a.wav
    python -m audioclf.embed --model runs/demo/best.pt --index big.xlsx --save out/big --num-workers 8

--model   an audioclf checkpoint (.pt from audioclf.train, or an export --format state_dict),
          or a TorchScript / ONNX export of audioclf.export with its sidecar <model>.json next
          to it (ONNX needs onnxruntime).
FILES     audio files (.wav .flac .ogg; any format soundfile reads when named directly), or
          .npy log-mel files for a model trained on precomputed features; folders are searched
          recursively. Each file is embedded whole, as in evaluation (features.eval_crop).
--gallery an index sheet (.xlsx .csv .parquet) read with the model's column settings
          (data.class_column, data.path_column, ...); every row is used, the split column is
          ignored. Its embeddings are cached in <model folder>/.audioclf_cache/, keyed by the
          sheet's content and path, the model file's mtime and size, and the features settings,
          so a second call only embeds the new files. The key does not cover the gallery's audio
          files: after replacing them behind an unchanged sheet, pass --no-cache once.

For each file the N classes with the highest cosine similarity to the class centroid (the mean
of the class's normalised gallery embeddings, renormalised) are printed, best first.
--save PREFIX writes PREFIX.npy (embeddings float32 [files, D], in the printed order) and
PREFIX.csv (file, top class, its score).
Exit status: 0 done; 1 done, but some files could not be read (each named on stderr, the rest
embedded); 2 bad input (no audio files found, a gallery sheet without a class column, no file
readable, a model that gives NaN) with a one-line message.

--index SHEET --save PREFIX (no files, no --gallery): every row of SHEET (read with the model's
column settings; --split S keeps the rows of one split, found by the training's rules) is
embedded in batches, with --num-workers DataLoader workers (default: the model's
data.num_workers) and a progress bar, into
  PREFIX.npy      float32 [rows, D]
  PREFIX.parquet  row (the sheet's row number), id, class, item, path: one row per .npy row.
The work goes in chunks of 4,096 rows, each written as a part file into PREFIX.parts/ when done;
a rerun (after a crash, a kill, a full disk) checks the finished parts (same model and
features, same ids and paths at those rows, whole files) and embeds only the rest. At the end
PREFIX.npy and PREFIX.parquet are assembled and PREFIX.parts/ is removed. An unreadable or
missing file stops the run with one line naming it and its sheet row (finished parts are kept);
with --skip-bad-files it is left out and listed in PREFIX.skipped.csv (row, id, path, reason).
Prints a summary instead of rankings. Exit status: 0 done; 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import logging
import math
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm import tqdm

from audioclf.checkpoint import CheckpointError
from audioclf.cli import (
    ExportSidecar,
    UsageError,
    one_line,
    resolve_device,
    run_cli,
    sidecar_config,
    sidecar_path,
)
from audioclf.config import Config, DataConfig, FeaturesConfig
from audioclf.data.dataset import AudioDataset
from audioclf.data.index import Index, IndexValidationError, load_index, split_index
from audioclf.data.loader import loader_kwargs
from audioclf.data.readers import AudioReadError, FeatureFileError
from audioclf.fileio import atomic_write, atomic_write_bytes
from audioclf.inference import (
    LOG_MEL,
    WAVEFORM,
    _LogMelDataset,
    describe_checkpoint,
    embed_files,
    extract_embeddings,
    load_trained,
)
from audioclf.metrics import class_centroids

log = logging.getLogger("audioclf")

PROG = "python -m audioclf.embed"
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")
FEATURE_SUFFIXES = (".npy",)
CACHE_DIR = ".audioclf_cache"
CACHE_VERSION = 1  # bump when the cached gallery layout changes
CHUNK_ROWS = 4096  # rows per part file with --index: the most work a killed run loses
PARTS_VERSION = 1  # bump when the part files' layout changes


# ---------------------------------------------------------------------------------------------
# The model: a checkpoint or an export


@dataclass
class Model:
    """What embedding needs from a checkpoint or an export."""

    embed_fn: Callable[[Tensor, Tensor], Tensor]
    cfg: Config  # features and clips to read files as evaluation does; data: the sheet columns
    input_kind: str  # WAVEFORM or LOG_MEL
    path: Path
    description: str
    device: torch.device
    # A checkpoint's data settings hold the training's split rules (data.val_ratio, holdout,
    # seed); an export's sidecar holds only the column names.
    knows_splits: bool = False

    @property
    def features(self) -> FeaturesConfig:
        return self.cfg.features

    @property
    def data(self) -> DataConfig:
        return self.cfg.data


def load_model(path: str | Path, device: torch.device) -> Model:
    """An audioclf checkpoint, or an export with its sidecar <path>.json."""
    from audioclf.export import load_onnx, load_torchscript

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--model {path} does not exist")
    sidecar = sidecar_path(path)
    if sidecar.is_file():
        try:
            meta = ExportSidecar.read(sidecar)
            fmt, kind = meta.format, meta.input_kind
            cfg = sidecar_config(meta)
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"the sidecar {sidecar} of --model {path} cannot be read "
                             f"({type(exc).__name__}: {exc}); export the model again") from None
        if fmt in ("torchscript", "onnx"):
            if fmt == "onnx":
                device = torch.device("cpu")  # the onnxruntime session runs on the CPU
            loader = load_torchscript if fmt == "torchscript" else load_onnx
            try:
                run = loader(path, device)
            except (RuntimeError, ValueError) as exc:
                raise UsageError(f"--model {path} is not a loadable {fmt} export ({exc})") from None

            def embed_fn(x: Tensor, lengths: Tensor) -> Tensor:
                return run(x, lengths)[0].to(x.device)  # the embeddings (logits come second)

            dim = meta.embedding_dim
            return Model(embed_fn, cfg, kind, path, f"{fmt} export, {dim}-d", device)
    if path.suffix.lower() == ".onnx":
        raise UsageError(f"--model {path}: an ONNX export needs its sidecar {sidecar} "
                         "(written by audioclf.export)")
    try:
        net, cfg, ckpt = load_trained(path, device)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc} (a TorchScript export needs its sidecar {sidecar.name} "
                              "next to it)") from None
    kind = WAVEFORM if cfg.features.kind == "audio" else LOG_MEL
    return Model(net.embed, cfg, kind, path, describe_checkpoint(ckpt, cfg), device,
                 knows_splits=True)


# ---------------------------------------------------------------------------------------------
# Files


def find_files(inputs: list[str | Path], features: FeaturesConfig) -> list[Path]:
    """The files to embed: named files as given, folders searched recursively (sorted)."""
    wanted = AUDIO_SUFFIXES if features.kind == "audio" else FEATURE_SUFFIXES
    other = FEATURE_SUFFIXES if features.kind == "audio" else AUDIO_SUFFIXES
    what = "audio" if features.kind == "audio" else ".npy log-mel features (features.kind=npy)"
    files: list[Path] = []
    skipped = 0
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file())
            files += [p for p in found if p.suffix.lower() in wanted]
            skipped += sum(p.suffix.lower() in other for p in found)
        elif path.is_file():
            if path.suffix.lower() in other:
                raise UsageError(f"{path}: the model takes {what}, not {path.suffix} files")
            files.append(path)
        else:
            raise UsageError(f"{path} does not exist")
    if not files:
        hint = (f" (found {skipped} {'/'.join(other)} file(s), but the model takes {what})"
                if skipped else "")
        raise UsageError(f"no {' / '.join(wanted)} files found in {', '.join(map(str, inputs))}"
                         f"{hint}")
    return files


# ---------------------------------------------------------------------------------------------
# Gallery


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def gallery_cache_file(model: Model, sheet: Path, root: str) -> Path:
    stat = model.path.stat()
    key = json.dumps([
        CACHE_VERSION, str(sheet.resolve()), _digest(sheet.read_bytes()), root,
        str(model.path.resolve()), stat.st_mtime_ns, stat.st_size, model.input_kind,
        dataclasses.asdict(model.features), dataclasses.asdict(model.cfg.clips),
        dataclasses.asdict(model.data),
    ], sort_keys=True, default=str)
    return model.path.parent / CACHE_DIR / f"gallery-{sheet.stem}-{_digest(key.encode())}.npz"


def load_gallery(model: Model, sheet: str | Path, *, root: str | None, batch_size: int,
                 use_cache: bool, progress: bool, num_workers: int = 0
                 ) -> tuple[np.ndarray, np.ndarray, bool]:
    """(embeddings [n, D], class name per row, whether the cache was used)."""
    sheet = Path(sheet)
    data = dataclasses.replace(model.data, index=str(sheet), root=root or "", split_column="")
    with warnings.catch_warnings():
        # "classes with fewer than 2 items" is about training positives; a gallery may well
        # hold one recording per class.
        warnings.filterwarnings("ignore", message=".*fewer than 2 items")
        index = load_index(data)
    classes = index.table["cls"].to_numpy(dtype=str)
    cache = gallery_cache_file(model, sheet, data.root) if use_cache else None
    if cache is not None and cache.is_file():
        try:
            with np.load(cache, allow_pickle=False) as stored:
                if np.array_equal(stored["classes"], classes):
                    return stored["embeddings"], classes, True
        except (OSError, ValueError, KeyError) as exc:
            log.warning("gallery cache %s is unreadable (%s); embedding the gallery again",
                        cache, exc)
    embeddings = embed_files(model.embed_fn, model.cfg, index.table["path"].tolist(),
                             batch_size=batch_size, device=model.device,
                             input_kind=model.input_kind, progress=progress,
                             num_workers=num_workers)
    if cache is not None:
        buffer = io.BytesIO()
        np.savez(buffer, embeddings=embeddings, classes=classes)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(cache, buffer.getvalue())
        except OSError as exc:  # a read-only model folder: work without the cache
            log.warning("could not write the gallery cache %s (%s)", cache, exc)
    return embeddings, classes, False


def class_scores(query: np.ndarray, gallery: np.ndarray, classes: np.ndarray
                 ) -> tuple[list[str], np.ndarray]:
    """(class names, cosine similarity [queries, classes] to each class centroid)."""
    names, codes = np.unique(classes, return_inverse=True)
    _, centroids = class_centroids(gallery, codes)
    queries = torch.nn.functional.normalize(torch.from_numpy(query).float(), dim=1)
    return names.tolist(), (queries @ centroids.T).numpy()


# ---------------------------------------------------------------------------------------------
# --index: every row of a sheet into PREFIX.npy + PREFIX.parquet, in resumable chunks


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


def select_rows(model: Model, sheet: str | Path, *, root: str | None, split: str | None,
                skip_bad_files: bool) -> Index:
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
        try:
            index = load_index(data)
        except IndexValidationError as exc:  # the config key's hint, as this tool's flag
            raise IndexValidationError(str(exc).replace(
                "set data.check_files=false to skip this check",
                "pass --skip-bad-files to leave them out")) from None
    if split is not None:
        if not (index.table["split"] != "").any() and not model.knows_splits:
            raise UsageError(
                f"--split {split}: {index.source} has no split column ({data.split_column!r}) "
                f"and {model.path} is an export, which does not record how training generated "
                "its split (data.val_ratio, holdout, seed); add a split column to the sheet or "
                "pass the checkpoint as --model")
        splits = split_index(index, data)
        if split not in splits:
            raise UsageError(f"{index.source} has no {split!r} split (it has "
                             f"{', '.join(splits)}); use --split {' / '.join(splits)} or drop it")
        index = splits[split]
    if len(index) == 0:
        where = f"the {split} split of " if split is not None else ""
        raise UsageError(f"{where}{index.source} has no rows to embed")
    return index


def _parts_manifest(model: Model, chunk_rows: int) -> dict:
    """What every part file of a run depends on besides its own rows' ids and paths."""
    stat = model.path.stat()
    return {"version": PARTS_VERSION, "model": str(model.path.resolve()),
            "model_mtime_ns": stat.st_mtime_ns, "model_size": stat.st_size,
            "input_kind": model.input_kind, "features": dataclasses.asdict(model.features),
            "clips": dataclasses.asdict(model.cfg.clips), "chunk_rows": chunk_rows}


def _open_parts(outputs: IndexOutputs, manifest: dict) -> None:
    """Create PREFIX.parts/ with its manifest, or check that an earlier run's parts were made
    by the same model, features and chunk size."""
    path = outputs.parts / "manifest.json"
    if path.is_file():
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            earlier = {}
        changed = sorted(k for k in manifest.keys() | earlier.keys()
                         if manifest.get(k) != earlier.get(k))
        if changed:
            raise UsageError(
                f"{outputs.parts} holds the unfinished work of another run (its "
                f"{', '.join(changed)} differ{'s' if len(changed) == 1 else ''}); delete it to "
                "start over, or choose another --save PREFIX")
        return
    if outputs.parts.is_dir() and any(outputs.parts.glob("chunk-*.npz")):
        raise UsageError(f"{outputs.parts} holds part files but no manifest.json, so their model "
                         "is unknown; delete the folder to start over")
    try:
        atomic_write_bytes(path, (json.dumps(manifest, indent=2) + "\n").encode())
    except OSError as exc:
        raise UsageError(f"--save {outputs.parts.parent}: cannot write {outputs.parts} "
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
            part = {key: stored[key] for key in ("embeddings", "positions", "rows", "skipped",
                                                 "reasons")}
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


def _index_dataset(model: Model, table: pd.DataFrame, skip_bad_files: bool
                   ) -> tuple[torch.utils.data.Dataset, AudioDataset]:
    """(what the model reads, in evaluation mode; the same files read strictly, for the reason
    a skipped file could not be read)."""
    def audio(skip: bool) -> AudioDataset:
        return AudioDataset(table["path"].tolist(), np.zeros(len(table), np.int64),
                            model.features, model.cfg.clips, train=False,
                            rows=table["row"].tolist(), skip_bad_files=skip)

    dataset = audio(skip_bad_files)
    if model.input_kind == LOG_MEL and model.features.kind == "audio":
        dataset = _LogMelDataset(dataset)  # an export without the front end: log-mel here
    return dataset, audio(False)


def _why_unreadable(strict: AudioDataset, position: int) -> str:
    try:
        strict[position]
    except (AudioReadError, FeatureFileError) as exc:
        return one_line(exc.__cause__ or exc)
    return "could not be read in a DataLoader worker"


def embed_chunk(model: Model, dataset, strict: AudioDataset, start: int, stop: int, *,
                ids: np.ndarray, paths: np.ndarray, batch_size: int, loader_options: dict,
                progress: bool, description: str) -> dict[str, np.ndarray]:
    """Embed rows start .. stop; the part file's arrays."""
    try:
        emb, _, seen = extract_embeddings(
            model.embed_fn, dataset, batch_size=batch_size, device=model.device,
            positions=range(start, stop), loader_options=loader_options, progress=progress,
            description=description)
    except (AudioReadError, FeatureFileError) as exc:
        message = one_line(exc).replace("set data.skip_bad_files=true", "pass --skip-bad-files")
        raise type(exc)(message) from None
    order = np.argsort(seen, kind="stable")
    emb, seen = np.ascontiguousarray(emb[order], dtype=np.float32), seen[order].astype(np.int64)
    _check_finite(emb, paths[seen - start].tolist(), f"rows {start + 1}-{stop} of the sheet")
    skipped = np.setdiff1d(np.arange(start, stop), seen).astype(np.int64)
    reasons = np.array([_why_unreadable(strict, int(p)) for p in skipped], dtype=str)
    return {"embeddings": emb, "positions": seen, "rows": np.array(rows_digest(ids, paths)),
            "skipped": skipped, "reasons": reasons}


def embed_index(model: Model, index: Index, prefix: str | Path, *, batch_size: int = 16,
                num_workers: int = 0, skip_bad_files: bool = False, progress: bool = True,
                chunk_rows: int = CHUNK_ROWS) -> IndexSummary:
    """Embed every row of `index` into PREFIX.npy + PREFIX.parquet, through resumable part
    files in PREFIX.parts/ (see the module docstring)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    outputs = IndexOutputs.of(prefix)
    table = index.table
    _open_parts(outputs, _parts_manifest(model, chunk_rows))
    dataset, strict = _index_dataset(model, table, skip_bad_files)
    options = loader_kwargs(num_workers, True, False, 2, model.device)
    ids, paths = table["id"].to_numpy(dtype=str), table["path"].to_numpy(dtype=str)
    chunks = math.ceil(len(table) / chunk_rows)
    dim, resumed = None, 0
    with tqdm(total=len(table), unit="rows", desc="embed", disable=not progress,
              dynamic_ncols=True) as bar:
        for chunk in range(chunks):
            start, stop = chunk * chunk_rows, min((chunk + 1) * chunk_rows, len(table))
            rows = slice(start, stop)
            part = None
            if outputs.part(chunk).is_file():
                part = read_part(outputs.part(chunk), ids[rows], paths[rows], start, dim)
                if part is None:
                    log.warning("%s is incomplete or was made for other rows: embedding its rows "
                                "again", outputs.part(chunk))
                elif len(part["skipped"]) and not skip_bad_files:
                    part = None  # an earlier --skip-bad-files run left rows out: now they must fail
            if part is not None:
                resumed += 1
            else:
                part = embed_chunk(model, dataset, strict, start, stop, ids=ids[rows],
                                   paths=paths[rows], batch_size=batch_size,
                                   loader_options=options, progress=progress,
                                   description=f"chunk {chunk + 1}/{chunks}")
                write_part(outputs.part(chunk), part)
            if len(part["positions"]):
                dim = part["embeddings"].shape[1]
            bar.update(stop - start)
    embedded, skipped = _assemble(outputs, index, chunks, dim)
    return IndexSummary(len(table), embedded, dim or 0, chunks, resumed, skipped, outputs)


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
    if len(skipped):
        rows = table.iloc[skipped]
        listing = pd.DataFrame({"row": rows["row"].to_numpy(), "id": rows["id"].to_numpy(),
                                "path": rows["path"].to_numpy(),
                                "reason": np.concatenate(reasons)})
        atomic_write_bytes(outputs.skipped, listing.to_csv(index=False).encode())
    else:
        outputs.skipped.unlink(missing_ok=True)  # a stale list of an earlier run
    if not len(positions):
        raise UsageError(f"none of the {len(table)} rows of {index.source} could be read "
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


def run_index(args: argparse.Namespace, model: Model) -> int:
    start = time.perf_counter()
    index = select_rows(model, args.index, root=args.root, split=args.split,
                        skip_bad_files=args.skip_bad_files)
    workers = model.data.num_workers if args.num_workers is None else args.num_workers
    summary = embed_index(model, index, args.save, batch_size=args.batch_size,
                          num_workers=workers, skip_bad_files=args.skip_bad_files,
                          progress=not args.quiet, chunk_rows=CHUNK_ROWS)
    out = summary.outputs
    split = f", {args.split} split" if args.split is not None else ""
    resumed = f", {summary.resumed} finished earlier" if summary.resumed else ""
    print(f"model: {model.path} ({model.description}); index: {index.source}{split}: "
          f"{summary.rows} rows in {summary.chunks} chunk(s){resumed}")
    print(f"saved {out.npy} ({summary.embedded} x {summary.dim} float32) and {out.parquet} "
          f"in {time.perf_counter() - start:.1f} s")
    if summary.skipped:
        print(f"skipped {summary.skipped} unreadable file(s): listed in {out.skipped}")
    return 0


# ---------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", metavar="AUDIO_OR_DIR",
                        help="audio files or folders (searched recursively); not with --index")
    parser.add_argument("--model", required=True, type=Path,
                        help="audioclf checkpoint, or TorchScript/ONNX export with its .json")
    parser.add_argument("--gallery", type=Path,
                        help="index sheet of labelled reference files (ranking mode)")
    parser.add_argument("--index", type=Path, metavar="SHEET",
                        help="embed every row of this index sheet into --save PREFIX.npy / "
                        ".parquet (resumable; no files, no --gallery)")
    parser.add_argument("--split", help="with --index: only the rows of this split (train, "
                        "val, test), by the sheet's split column or the training's rules")
    parser.add_argument("--root", help="folder that the sheet's relative paths resolve "
                        "against (default: the sheet's folder)")
    parser.add_argument("--top", type=int,
                        help="classes shown per file (default 5; ranking mode)")
    parser.add_argument("--save", metavar="OUT_PREFIX",
                        help="ranking mode: write OUT_PREFIX.npy (embeddings) and OUT_PREFIX.csv "
                        "(files); --index: OUT_PREFIX.npy and OUT_PREFIX.parquet (rows)")
    parser.add_argument("--batch-size", type=int, default=16, help="files per batch (default 16)")
    parser.add_argument("--num-workers", type=int,
                        help="DataLoader worker processes (default: data.num_workers of the "
                        "model with --index, 0 otherwise)")
    parser.add_argument("--skip-bad-files", action="store_true",
                        help="with --index: leave unreadable or missing files out (listed in "
                        "OUT_PREFIX.skipped.csv) instead of stopping")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("--no-cache", action="store_true",
                        help="embed the gallery again instead of using (and writing) the cache")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """One UsageError for flags that do not fit together (before the model is loaded)."""
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.num_workers is not None and args.num_workers < 0:
        raise UsageError(f"--num-workers must be >= 0, got {args.num_workers}")
    if args.index is not None:
        clashes = [flag for flag, given in (
            ("audio files", args.files), ("--gallery", args.gallery is not None),
            ("--top", args.top is not None), ("--no-cache", args.no_cache)) if given]
        if clashes:
            raise UsageError(f"--index embeds a sheet's rows and ranks nothing: drop "
                             f"{', '.join(clashes)} (or drop --index to rank files against "
                             "--gallery)")
        if not args.save:
            raise UsageError("--index needs --save PREFIX (the embeddings go to PREFIX.npy and "
                             "the rows to PREFIX.parquet)")
        return
    if args.split is not None or args.skip_bad_files:
        flag = "--split" if args.split is not None else "--skip-bad-files"
        raise UsageError(f"{flag} applies to --index SHEET (ranking mode names unreadable files "
                         "and goes on)")
    if not args.files or args.gallery is None:
        raise UsageError("give audio files or folders and --gallery SHEET to rank classes, or "
                         "--index SHEET --save PREFIX to embed a sheet's rows")
    if args.top is not None and args.top < 1:
        raise UsageError(f"--top must be >= 1, got {args.top}")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    model = load_model(args.model, resolve_device(args.device))
    if args.index is not None:
        return run_index(args, model)
    top = 5 if args.top is None else args.top
    workers = args.num_workers or 0
    files, embeddings, skipped = embed_readable(model, find_files(args.files, model.features),
                                                batch_size=args.batch_size, progress=not args.quiet,
                                                num_workers=workers)
    gallery, gallery_classes, cached = load_gallery(
        model, args.gallery, root=args.root, batch_size=args.batch_size,
        use_cache=not args.no_cache, progress=not args.quiet, num_workers=workers)
    _check_finite(embeddings, [str(f) for f in files], "the files")
    _check_finite(gallery, [str(c) for c in gallery_classes], f"the gallery {args.gallery}")
    names, scores = class_scores(embeddings, gallery, gallery_classes)
    top = min(top, len(names))
    order = np.argsort(-scores, axis=1, kind="stable")[:, :top]

    print(f"model: {model.path} ({model.description}); gallery: {args.gallery} "
          f"({len(gallery_classes)} files, {len(names)} classes{', cached' if cached else ''})")
    width = max(len(n) for n in names)
    for i, path in enumerate(files):
        print(path)
        for rank, c in enumerate(order[i], start=1):
            print(f"  {rank:>2}. {names[c]:<{width}}  {scores[i, c]:.4f}")
    if args.save:
        prefix = Path(args.save)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.save(buffer, embeddings.astype(np.float32))
        table = pd.DataFrame({"file": [str(p) for p in files],
                              "top_class": [names[o[0]] for o in order],
                              "top_score": [float(scores[i, o[0]]) for i, o in enumerate(order)]})
        npy = atomic_write_bytes(prefix.with_name(prefix.name + ".npy"), buffer.getvalue())
        csv = atomic_write_bytes(prefix.with_name(prefix.name + ".csv"),
                                 table.to_csv(index=False).encode())
        print(f"saved {npy} and {csv}")
    for path, reason in skipped:
        print(f"{PROG}: skipped {path}: {reason}", file=sys.stderr)
    return 1 if skipped else 0


def embed_readable(model: Model, files: list[Path], *, batch_size: int, progress: bool,
                   num_workers: int = 0
                   ) -> tuple[list[Path], np.ndarray, list[tuple[Path, str]]]:
    """(files that could be read, their embeddings, [(file, reason)] of the others). One bad
    file does not cost the call: after a failure the files are embedded one by one."""
    def embed(paths: list[Path], show: bool, workers: int = 0) -> np.ndarray:
        return embed_files(model.embed_fn, model.cfg, paths, batch_size=batch_size,
                           device=model.device, input_kind=model.input_kind, progress=show,
                           num_workers=workers)

    try:
        return files, embed(files, progress, num_workers), []
    except (AudioReadError, FeatureFileError):
        pass
    kept, rows, skipped = [], [], []
    for path in files:
        try:
            rows.append(embed([path], False))
            kept.append(path)
        except (AudioReadError, FeatureFileError) as exc:
            skipped.append((path, str(exc)))
    if not kept:
        raise UsageError(f"none of the {len(files)} file(s) could be read; the first: "
                         f"{skipped[0][1]}")
    return kept, np.concatenate(rows), skipped


def _check_finite(embeddings: np.ndarray, names: list[str], what: str) -> None:
    bad = np.flatnonzero(~np.isfinite(embeddings).all(axis=1))
    if len(bad):
        raise UsageError(f"the model gives NaN/inf embeddings for {len(bad)} of {len(names)} of "
                         f"{what} (first: {names[bad[0]]}): the model is broken (did training "
                         "diverge?); use another checkpoint or export")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
