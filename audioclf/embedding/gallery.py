"""embed's ranking mode: the classes of a gallery sheet ranked for each of some audio files by
cosine similarity to each class centroid (see `python -m audioclf.embed --help`).

    ranking = rank_files(model, ["clips/"], Path("refs.xlsx"), root=None, top=5, batch_size=16,
                         use_cache=True, progress=True)
    print("\n".join(ranking.lines(model, Path("refs.xlsx"))))

which is, step by step:

    files = find_files(["clips/"], model.features)
    files, emb, skipped = embed_readable(model, files, batch_size=16, progress=True)
    gallery, classes, cached = load_gallery(model, "refs.xlsx", root=None, batch_size=16,
                                            use_cache=True, progress=True)
    names, scores = class_scores(emb, gallery, classes)
    order = top_classes(scores, 5)

A gallery's embeddings are cached in <model folder>/.audioclf_cache/, keyed by the sheet's
content and path, the model file, and the features settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from audioclf.data.index import load_index
from audioclf.fileio import atomic_write_bytes, file_stamp
from audioclf.inference.artefacts import LoadedEmbedder
from audioclf.inference.extract import check_finite, embed_files
from audioclf.inference.inputs import embed_inputs
from audioclf.metrics import class_centroids

log = logging.getLogger("audioclf")

CACHE_DIR = ".audioclf_cache"
CACHE_VERSION = 2  # bump when the cached gallery layout changes
DEFAULT_TOP = 5  # classes shown per file


# ---------------------------------------------------------------------------------------------
# The files to rank


def check_ranking_request(
    files: list, gallery: Path | None, *, top: int | None, split: str | None, skip_bad_files: bool
) -> None:
    """ValueError when embed's ranking mode is given --index's flags (--split,
    --skip-bad-files), no files or no --gallery, or a --top below 1, before any work."""
    if split is not None or skip_bad_files:
        flag = "--split" if split is not None else "--skip-bad-files"
        raise ValueError(
            f"{flag} applies to --index SHEET (ranking mode names unreadable files and goes on)"
        )
    if not files or gallery is None:
        raise ValueError(
            "give audio files or folders and --gallery SHEET to rank classes, or "
            "--index SHEET --save PREFIX to embed a sheet's rows"
        )
    if top is not None and top < 1:
        raise ValueError(f"--top must be >= 1, got {top}")


# ---------------------------------------------------------------------------------------------
# The gallery


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def gallery_cache_file(model: LoadedEmbedder, sheet: Path, root: str) -> Path:
    key = json.dumps(
        [
            CACHE_VERSION,
            file_stamp(sheet, content=True),
            root,
            file_stamp(model.path),
            model.input_kind,
            dataclasses.asdict(model.features),
            dataclasses.asdict(model.cfg.clips),
            dataclasses.asdict(model.data),
        ],
        sort_keys=True,
        default=str,
    )
    return model.path.parent / CACHE_DIR / f"gallery-{sheet.stem}-{_digest(key.encode())}.npz"


def load_gallery(
    model: LoadedEmbedder,
    sheet: str | Path,
    *,
    root: str | None,
    batch_size: int,
    use_cache: bool,
    progress: bool,
    num_workers: int = 0,
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
    cached = _read_cache(cache, classes) if cache is not None else None
    if cached is not None:
        return cached, classes, True
    embeddings = embed_files(
        model.embed_fn,
        model.cfg,
        index.table["path"].tolist(),
        batch_size=batch_size,
        device=model.device,
        input_kind=model.input_kind,
        progress=progress,
        num_workers=num_workers,
    )
    if cache is not None:
        _write_cache(cache, embeddings, classes)
    return embeddings, classes, False


def _read_cache(cache: Path, classes: np.ndarray) -> np.ndarray | None:
    """The cached embeddings when `cache` holds those of these very rows; None otherwise."""
    if not cache.is_file():
        return None
    try:
        with np.load(cache, allow_pickle=False) as stored:
            if np.array_equal(stored["classes"], classes):
                return stored["embeddings"]
    except (OSError, ValueError, KeyError) as exc:
        log.warning("gallery cache %s is unreadable (%s); embedding the gallery again", cache, exc)
    return None


def _write_cache(cache: Path, embeddings: np.ndarray, classes: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, embeddings=embeddings, classes=classes)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cache, buffer.getvalue())
    except OSError as exc:  # a read-only model folder: work without the cache
        log.warning("could not write the gallery cache %s (%s)", cache, exc)


# ---------------------------------------------------------------------------------------------
# Ranking


def class_scores(
    query: np.ndarray, gallery: np.ndarray, classes: np.ndarray
) -> tuple[list[str], np.ndarray]:
    """(class names, cosine similarity [queries, classes] to each class centroid)."""
    names, codes = np.unique(classes, return_inverse=True)
    _, centroids = class_centroids(gallery, codes)
    queries = torch.nn.functional.normalize(torch.from_numpy(query).float(), dim=1)
    return names.tolist(), (queries @ centroids.T).numpy()


def top_classes(scores: np.ndarray, top: int) -> np.ndarray:
    """Column indices of the `top` best classes of each row, best first (ties: lower index)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :top]


def save_rankings(
    prefix: str | Path,
    files: list[Path],
    embeddings: np.ndarray,
    names: list[str],
    scores: np.ndarray,
    order: np.ndarray,
) -> tuple[Path, Path]:
    """PREFIX.npy (embeddings float32 [files, D]) and PREFIX.csv (file, top class, its score),
    atomically; returns their paths."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.save(buffer, embeddings.astype(np.float32))
    table = pd.DataFrame(
        {
            "file": [str(p) for p in files],
            "top_class": [names[o[0]] for o in order],
            "top_score": [float(scores[i, o[0]]) for i, o in enumerate(order)],
        }
    )
    npy = atomic_write_bytes(prefix.with_name(prefix.name + ".npy"), buffer.getvalue())
    csv = atomic_write_bytes(
        prefix.with_name(prefix.name + ".csv"), table.to_csv(index=False).encode()
    )
    return npy, csv


@dataclass
class Ranking:
    """The gallery's classes ranked for each file that could be read."""

    files: list[Path]  # the files that could be read, in the order given
    embeddings: np.ndarray  # float32 [files, D]
    skipped: list[tuple[Path, str]]  # (file, reason) of the files that could not be read
    names: list[str]  # the gallery's classes
    scores: np.ndarray  # cosine similarity [files, classes] to each class centroid
    order: np.ndarray  # column indices of each file's top classes, best first
    gallery_files: int  # rows of the gallery sheet
    cached: bool  # whether the gallery's embeddings came from the cache

    def lines(self, model: LoadedEmbedder, gallery: Path) -> list[str]:
        """What embed prints: the model and gallery, then each file with its top classes."""
        cached = ", cached" if self.cached else ""
        lines = [
            f"model: {model.path} ({model.description}); gallery: {gallery} "
            f"({self.gallery_files} files, {len(self.names)} classes{cached})"
        ]
        width = max(len(n) for n in self.names)
        for i, path in enumerate(self.files):
            lines.append(str(path))
            lines += [
                f"  {rank:>2}. {self.names[c]:<{width}}  {self.scores[i, c]:.4f}"
                for rank, c in enumerate(self.order[i], start=1)
            ]
        return lines

    def save(self, prefix: str | Path) -> tuple[Path, Path]:
        """PREFIX.npy and PREFIX.csv (see save_rankings); returns their paths."""
        return save_rankings(
            prefix, self.files, self.embeddings, self.names, self.scores, self.order
        )


def rank_files(
    model: LoadedEmbedder,
    inputs: list[str | Path],
    gallery: Path,
    *,
    root: str | None,
    top: int | None,
    batch_size: int,
    use_cache: bool,
    progress: bool,
    num_workers: int = 0,
) -> Ranking:
    """Embed the files of `inputs` (files, folders searched recursively) and the gallery sheet
    (cached), and rank the gallery's classes for each file: its `top` best (default
    DEFAULT_TOP). ValueError when no file is found or readable, or an embedding is not finite."""
    files, embeddings, skipped = embed_inputs(
        model,
        inputs,
        "the files",
        batch_size=batch_size,
        progress=progress,
        num_workers=num_workers,
    )
    gallery_emb, gallery_classes, cached = load_gallery(
        model,
        gallery,
        root=root,
        batch_size=batch_size,
        use_cache=use_cache,
        progress=progress,
        num_workers=num_workers,
    )
    check_finite(gallery_emb, [str(c) for c in gallery_classes], f"the gallery {gallery}")
    names, scores = class_scores(embeddings, gallery_emb, gallery_classes)
    order = top_classes(scores, min(DEFAULT_TOP if top is None else top, len(names)))
    return Ranking(files, embeddings, skipped, names, scores, order, len(gallery_classes), cached)
