"""Embed new audio files and rank the classes of a gallery sheet for each of them.

    python -m audioclf.embed --model runs/demo/best.pt --gallery data/demo/index.xlsx clips/
    python -m audioclf.embed --model model.pt --gallery refs.xlsx --top 3 --save out/new a.wav

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
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from audioclf.checkpoint import CheckpointError
from audioclf.cli import ExportSidecar, UsageError, resolve_device, run_cli, sidecar_path
from audioclf.config import DataConfig, FeaturesConfig, from_dict
from audioclf.data.index import load_index
from audioclf.data.readers import AudioReadError, FeatureFileError
from audioclf.fileio import atomic_write_bytes
from audioclf.inference import LOG_MEL, WAVEFORM, describe_checkpoint, embed_files, load_trained
from audioclf.metrics import class_centroids

log = logging.getLogger("audioclf")

PROG = "python -m audioclf.embed"
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")
FEATURE_SUFFIXES = (".npy",)
CACHE_DIR = ".audioclf_cache"
CACHE_VERSION = 1  # bump when the cached gallery layout changes


# ---------------------------------------------------------------------------------------------
# The model: a checkpoint or an export


@dataclass
class Model:
    """What embedding needs from a checkpoint or an export."""

    embed_fn: Callable[[Tensor, Tensor], Tensor]
    features: FeaturesConfig
    input_kind: str  # WAVEFORM or LOG_MEL
    data: DataConfig  # column settings for reading a gallery sheet
    path: Path
    description: str
    device: torch.device


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
            features = from_dict(FeaturesConfig, meta.features, "features.")
            data = from_dict(DataConfig, meta.data_columns, "data.")
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
            return Model(embed_fn, features, kind, data, path, f"{fmt} export, {dim}-d", device)
    if path.suffix.lower() == ".onnx":
        raise UsageError(f"--model {path}: an ONNX export needs its sidecar {sidecar} "
                         "(written by audioclf.export)")
    try:
        net, cfg, ckpt = load_trained(path, device)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc} (a TorchScript export needs its sidecar {sidecar.name} "
                              "next to it)") from None
    kind = WAVEFORM if cfg.features.kind == "audio" else LOG_MEL
    return Model(net.embed, cfg.features, kind, cfg.data, path,
                 describe_checkpoint(ckpt, cfg), device)


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
        dataclasses.asdict(model.features), dataclasses.asdict(model.data),
    ], sort_keys=True, default=str)
    return model.path.parent / CACHE_DIR / f"gallery-{sheet.stem}-{_digest(key.encode())}.npz"


def load_gallery(model: Model, sheet: str | Path, *, root: str | None, batch_size: int,
                 use_cache: bool, progress: bool) -> tuple[np.ndarray, np.ndarray, bool]:
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
    embeddings = embed_files(model.embed_fn, model.features, index.table["path"].tolist(),
                             batch_size=batch_size, device=model.device,
                             input_kind=model.input_kind, progress=progress)
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
# Entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", metavar="AUDIO_OR_DIR",
                        help="audio files or folders (searched recursively)")
    parser.add_argument("--model", required=True, type=Path,
                        help="audioclf checkpoint, or TorchScript/ONNX export with its .json")
    parser.add_argument("--gallery", required=True, type=Path,
                        help="index sheet of labelled reference files")
    parser.add_argument("--root", help="folder that the gallery's relative paths resolve "
                        "against (default: the sheet's folder)")
    parser.add_argument("--top", type=int, default=5, help="classes shown per file (default 5)")
    parser.add_argument("--save", metavar="OUT_PREFIX",
                        help="write OUT_PREFIX.npy (embeddings) and OUT_PREFIX.csv (files)")
    parser.add_argument("--batch-size", type=int, default=16, help="files per batch (default 16)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("--no-cache", action="store_true",
                        help="embed the gallery again instead of using (and writing) the cache")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UsageError(f"--top must be >= 1, got {args.top}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    model = load_model(args.model, resolve_device(args.device))
    files, embeddings, skipped = embed_readable(model, find_files(args.files, model.features),
                                                batch_size=args.batch_size, progress=not args.quiet)
    gallery, gallery_classes, cached = load_gallery(
        model, args.gallery, root=args.root, batch_size=args.batch_size,
        use_cache=not args.no_cache, progress=not args.quiet)
    _check_finite(embeddings, [str(f) for f in files], "the files")
    _check_finite(gallery, [str(c) for c in gallery_classes], f"the gallery {args.gallery}")
    names, scores = class_scores(embeddings, gallery, gallery_classes)
    top = min(args.top, len(names))
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


def embed_readable(model: Model, files: list[Path], *, batch_size: int, progress: bool
                   ) -> tuple[list[Path], np.ndarray, list[tuple[Path, str]]]:
    """(files that could be read, their embeddings, [(file, reason)] of the others). One bad
    file does not cost the call: after a failure the files are embedded one by one."""
    def embed(paths: list[Path], show: bool) -> np.ndarray:
        return embed_files(model.embed_fn, model.features, paths, batch_size=batch_size,
                           device=model.device, input_kind=model.input_kind, progress=show)

    try:
        return files, embed(files, progress), []
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
