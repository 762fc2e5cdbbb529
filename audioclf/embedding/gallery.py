"""embed's ranking mode: the classes of a gallery sheet ranked for each of some audio files, by
each class's nearest gallery clip (kNN, as evaluate's kNN accuracy) or by cosine to each class
centroid (see `python -m audioclf.embed --help`).

    ranking = rank_files(model, ["clips/"], Path("refs.xlsx"), RankOptions(top=5), root=None,
                         batch_size=16, use_cache=True, progress=True)
    print("\n".join(ranking.lines(model, Path("refs.xlsx"))))

which is, step by step (a `Gallery` opens once and ranks many queries: `audioclf serve` keeps one):

    files = find_files(["clips/"], model.features)
    files, emb, skipped = embed_paths(model, files, skip_bad=True, batch_size=16, progress=True)
    gallery = Gallery.open(model, "refs.xlsx", batch_size=16, progress=True)
    names, scores, votes = gallery.scores(emb)   # kNN
    order = top_classes(scores, 5, votes)        # or gallery.rank(emb, 5): (class, score) lists

A gallery's embeddings are cached in <model folder>/.audioclf_cache/, keyed by the sheet's
content and path, the model file, and the features settings.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from audioclf.data.index import load_index
from audioclf.embedding.parts import digest
from audioclf.fileio import atomic_write_bytes, file_stamp
from audioclf.inference.artefacts import LoadedEmbedder, model_record
from audioclf.inference.extract import check_finite, embed_paths, find_files
from audioclf.metrics import LIST_BUDGET, ExactSearch, class_centroids

log = logging.getLogger("audioclf")

CACHE_DIR = ".audioclf_cache"
CACHE_VERSION = 3  # bump when the cached gallery layout or its key changes
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


def gallery_cache_file(model: LoadedEmbedder, sheet: Path, root: str) -> Path:
    """Where `sheet`'s embeddings by `model` are cached: keyed by the sheet's content and path,
    its root, the model's record (model_record: file, features, clips, adaptation, ...) and the
    settings the sheet is read with."""
    key = json.dumps(
        [
            CACHE_VERSION,
            file_stamp(sheet, content=True),
            root,
            model_record(model),
            dataclasses.asdict(model.data),
        ],
        sort_keys=True,
        default=str,
    )
    return model.path.parent / CACHE_DIR / f"gallery-{sheet.stem}-{digest(key.encode())}.npz"


def load_gallery(
    model: LoadedEmbedder,
    sheet: str | Path,
    *,
    root: str | None,
    batch_size: int,
    use_cache: bool,
    progress: bool,
    num_workers: int = 0,
) -> tuple[np.ndarray, pd.DataFrame, bool]:
    """(embeddings [n, D], the rows' cls / item / path, whether the cache was used)."""
    sheet = Path(sheet)
    data = dataclasses.replace(model.data, index=str(sheet), root=root or "", split_column="")
    with warnings.catch_warnings():
        # "classes with fewer than 2 items" is about training positives; a gallery may well
        # hold one recording per class.
        warnings.filterwarnings("ignore", message=".*fewer than 2 items")
        index = load_index(data)
    rows = index.table[["cls", "item", "path"]].reset_index(drop=True)  # a segment's file path
    classes = rows["cls"].to_numpy(dtype=str)
    cache = gallery_cache_file(model, sheet, data.root) if use_cache else None
    cached = _read_cache(cache, classes) if cache is not None else None
    if cached is not None:
        return cached, rows, True
    table = index.table
    _, embeddings, _ = embed_paths(
        model,
        table["path"].tolist(),
        spans=table[["start", "end"]].to_numpy(np.float64) if "start" in table else None,
        batch_size=batch_size,
        num_workers=num_workers,
        progress=progress,
        what=f"the gallery {sheet}",
    )
    if cache is not None:
        _write_cache(cache, embeddings, classes)
    return embeddings, rows, False


def _read_cache(cache: Path, classes: np.ndarray) -> np.ndarray | None:
    """The cached embeddings when `cache` holds those of these very rows; None otherwise."""
    if not cache.is_file():
        return None
    try:
        with np.load(cache, allow_pickle=False) as stored:
            if not np.array_equal(stored["classes"], classes):
                return None
            embeddings = stored["embeddings"]
        if embeddings.ndim != 2 or len(embeddings) != len(classes):
            raise ValueError(f"embeddings of shape {embeddings.shape}")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        # a cut-short or overwritten cache: rebuilt, as a cache should be
        log.warning("gallery cache %s is damaged (%s); embedding the gallery again", cache, exc)
        return None
    return embeddings


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


RANK_RULES = ("knn", "centroid")
DEFAULT_K = 1  # evaluate's kNN accuracy is the 1-nearest-neighbour rule


def class_scores(
    query: np.ndarray,
    gallery: np.ndarray,
    classes: np.ndarray,
    *,
    rule: str = "knn",
    k: int = DEFAULT_K,
    groups: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(class names, scores [queries, classes], votes [queries, classes]) by cosine similarity.

    rule "knn" (the default, evaluate's kNN rule): a class scores its nearest gallery clip;
    the k nearest clips vote (one vote each), so with k > 1 the majority class ranks first.
    rule "centroid": a class scores its centroid (class_centroids; no votes). `groups`
    (query groups [queries], gallery groups [gallery]): a query never sees a gallery row of its
    own group (its own item)."""
    names, codes = np.unique(classes, return_inverse=True)
    if rule == "centroid":
        _, centroids = class_centroids(gallery, codes)
        queries = torch.nn.functional.normalize(torch.from_numpy(query).float(), dim=1)
        scores = (queries @ centroids.T).numpy()
        return names.tolist(), scores, np.zeros_like(scores)
    index = ExactSearch(gallery)
    scores = np.empty((len(query), len(names)), dtype=np.float32)
    votes = np.empty((len(query), len(names)), dtype=np.float32)
    step = max(1, LIST_BUDGET // len(gallery))  # every gallery row is listed: [step, gallery]
    for start in range(0, len(query), step):
        part = slice(start, start + step)
        grouped = (
            {} if groups is None else {"query_groups": groups[0][part], "index_groups": groups[1]}
        )
        sims, ids = index.search(query[part], len(gallery), **grouped)
        scores[part], votes[part] = class_votes(sims, codes, ids, len(names), k)
    return names.tolist(), scores, votes


def class_votes(
    sims: np.ndarray, codes: np.ndarray, ids: np.ndarray, n_classes: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """From full neighbour lists (sims, ids [Q, gallery], best first; id -1 and score -inf:
    left out) of a gallery with class `codes`: each class's nearest clip's score (-inf without
    one) and the votes of the k nearest clips."""
    found = ids >= 0
    listed = torch.from_numpy(codes[np.maximum(ids, 0)])  # a left-out row adds -inf, no vote
    scores = torch.full((len(ids), n_classes), -np.inf)
    scores = scores.scatter_reduce(1, listed, torch.from_numpy(sims), "amax")
    votes = torch.zeros(len(ids), n_classes).scatter_add_(
        1, listed[:, :k], torch.from_numpy(found[:, :k]).float()
    )
    return scores.numpy(), votes.numpy()


def top_classes(scores: np.ndarray, top: int, votes: np.ndarray | None = None) -> np.ndarray:
    """Column indices of the `top` best classes of each row, best first: most votes, then the
    highest score (ties: lower index)."""
    votes = np.zeros_like(scores) if votes is None else votes
    order = np.lexsort((np.arange(scores.shape[1])[None].repeat(len(scores), 0), -scores, -votes))
    return order[:, :top]


@dataclass
class Gallery:
    """A gallery sheet's embeddings, made (or read from the cache) once and checked finite, to
    rank the classes of many queries against: `rank_files`, `Model.rank` and serve's /rank."""

    sheet: Path
    embeddings: np.ndarray  # [rows, D]
    rows: pd.DataFrame  # cls, item, path
    classes: np.ndarray  # the rows' cls, as str
    cached: bool  # whether the embeddings came from the cache

    @classmethod
    def open(
        cls,
        model: LoadedEmbedder,
        sheet: str | Path,
        *,
        root: str | None = None,
        batch_size: int = 32,
        use_cache: bool = True,
        progress: bool = False,
        num_workers: int = 0,
    ) -> Gallery:
        """`sheet` embedded by `model` (load_gallery); ValueError naming the row of an
        embedding that is not finite."""
        embeddings, rows, cached = load_gallery(
            model,
            sheet,
            root=root,
            batch_size=batch_size,
            use_cache=use_cache,
            progress=progress,
            num_workers=num_workers,
        )
        classes = rows["cls"].to_numpy(dtype=str)
        check_finite(embeddings, [str(c) for c in classes], f"the gallery {sheet}")
        return cls(Path(sheet), embeddings, rows, classes, cached)

    def rows_of(self, files: list[Path]) -> list[int | None]:
        """Each file's gallery row (None for a file that is no row of the gallery)."""
        row_of = {str(Path(p).resolve()): i for i, p in enumerate(self.rows["path"])}
        return [row_of.get(str(Path(f).resolve())) for f in files]

    def scores(
        self,
        query: np.ndarray,
        *,
        rule: str = "knn",
        k: int = DEFAULT_K,
        own_rows: list[int | None] | None = None,
    ) -> tuple[list[str], np.ndarray, np.ndarray]:
        """class_scores of `query` [Q, D] against the gallery; with `own_rows` (rows_of: each
        query's gallery row or None) a query that is a gallery row is scored without the rows
        of its own item (recording)."""
        groups = None
        if own_rows is not None:  # a query that is no gallery row has group -1: nothing left out
            items = pd.factorize(self.rows["cls"] + "\x00" + self.rows["item"])[0]
            groups = (np.array([-1 if r is None else items[r] for r in own_rows]), items)
        return class_scores(query, self.embeddings, self.classes, rule=rule, k=k, groups=groups)

    def rank(self, query: np.ndarray, top: int) -> list[list[tuple[str, float]]]:
        """Each query's `top` classes, best first, with their scores (kNN, k=1)."""
        names, scores, votes = self.scores(query)
        order = top_classes(scores, min(top, len(names)), votes)
        return [[(names[c], float(scores[i, c])) for c in row] for i, row in enumerate(order)]


@dataclass
class Ranking:
    """The gallery's classes ranked for each file that could be read."""

    files: list[Path]  # the files that could be read, in the order given
    embeddings: np.ndarray  # float32 [files, D]
    skipped: list[tuple[Path, str]]  # (file, reason) of the files that could not be read
    names: list[str]  # the gallery's classes
    scores: np.ndarray  # [files, classes]: each class's score by the rule (class_scores)
    order: np.ndarray  # column indices of each file's top classes, best first
    gallery_files: int  # rows of the gallery sheet
    cached: bool  # whether the gallery's embeddings came from the cache
    rule: str = "knn"  # how classes were scored (class_scores)
    k: int = DEFAULT_K
    own_item_left_out: list[bool] | None = None  # per file: it is a gallery row, its item left out
    truth: list[str | None] | None = None  # per file: its class when it is a gallery row

    def describe(self) -> str:
        """The rule, for the output's header."""
        if self.rule == "centroid":
            return "ranked by cosine to each class centroid"
        votes = f", the {self.k} nearest clips voting" if self.k > 1 else ""
        return f"ranked by each class's nearest gallery clip (kNN, k={self.k}{votes})"

    def first_right(self) -> tuple[int, int]:
        """(files whose own class ranked first, files whose class the gallery holds)."""
        known = [(i, t) for i, t in enumerate(self.truth or []) if t is not None]
        right = sum(self.names[self.order[i][0]] == t for i, t in known)
        return right, len(known)

    def lines(self, model: LoadedEmbedder, gallery: Path) -> list[str]:
        """What embed prints: the model and gallery, then each file with its top classes, and
        with own items left out how many files ranked their own class first."""
        cached = ", cached" if self.cached else ""
        own_left_out = any(self.own_item_left_out or [])
        left_out = ", each file's own item left out" if own_left_out else ""
        lines = [
            f"model: {model.path} ({model.description}); gallery: {gallery} "
            f"({self.gallery_files} files, {len(self.names)} classes{cached}); "
            f"{self.describe()}{left_out}"
        ]
        width = max(len(n) for n in self.names)
        for i, path in enumerate(self.files):
            lines.append(str(path))
            lines += [
                f"  {rank:>2}. {self.names[c]:<{width}}  {self.scores[i, c]:.4f}"
                for rank, c in enumerate(self.order[i], start=1)
            ]
        if own_left_out:  # some file is a gallery row
            right, known = self.first_right()
            lines.append(
                f"{right} of {known} files ranked their own class first (own item left out)"
            )
        return lines

    def save(self, prefix: str | Path) -> tuple[Path, Path]:
        """PREFIX.npy (embeddings float32 [files, D]) and PREFIX.csv (file, top class, its
        score), atomically; returns their paths."""
        prefix = Path(prefix)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.save(buffer, self.embeddings.astype(np.float32))
        table = pd.DataFrame(
            {
                "file": [str(p) for p in self.files],
                "top_class": [self.names[o[0]] for o in self.order],
                "top_score": [float(self.scores[i, o[0]]) for i, o in enumerate(self.order)],
            }
        )
        npy = atomic_write_bytes(prefix.with_name(prefix.name + ".npy"), buffer.getvalue())
        csv = atomic_write_bytes(
            prefix.with_name(prefix.name + ".csv"), table.to_csv(index=False).encode()
        )
        return npy, csv


@dataclass(frozen=True)
class RankOptions:
    """How `rank_files` ranks the gallery's classes for each file: embed's --top, --rank-by,
    --knn and --exclude-own-item."""

    top: int | None = None  # classes kept per file (None: DEFAULT_TOP)
    rule: str = "knn"  # class_scores' rule: knn or centroid
    k: int = DEFAULT_K  # the nearest clips that vote (knn)
    # A file that is a gallery row is ranked without the rows of its own item (recording)
    exclude_own_item: bool = False


def rank_files(
    model: LoadedEmbedder,
    inputs: list[str | Path],
    gallery: Path,
    options: RankOptions | None = None,
    *,
    root: str | None,
    batch_size: int,
    use_cache: bool,
    progress: bool,
    num_workers: int = 0,
) -> Ranking:
    """Embed the files of `inputs` (files, folders searched recursively) and the gallery sheet
    (cached), and rank the gallery's classes for each file as `options` say (default
    RankOptions()): its `top` best, by `rule` (class_scores). With `exclude_own_item` a file
    that is a row of the gallery is ranked without the rows of its own item (recording), as
    evaluate's cross-item metrics: how the model does on a new recording of a known class.
    ValueError when no file is found or readable, or an embedding is not finite."""
    options = options or RankOptions()
    files, embeddings, skipped = embed_paths(
        model,
        find_files(inputs, model.features),
        skip_bad=True,
        batch_size=batch_size,
        num_workers=num_workers,
        progress=progress,
    )
    opened = Gallery.open(
        model,
        gallery,
        root=root,
        batch_size=batch_size,
        use_cache=use_cache,
        progress=progress,
        num_workers=num_workers,
    )
    rows = opened.rows_of(files)
    exclude, top = options.exclude_own_item, options.top
    own_rows = rows if exclude else None
    names, scores, votes = opened.scores(
        embeddings, rule=options.rule, k=options.k, own_rows=own_rows
    )
    order = top_classes(scores, min(DEFAULT_TOP if top is None else top, len(names)), votes)
    left_out = [exclude and r is not None for r in rows]
    classes = opened.classes
    truth = [None if r is None else str(classes[r]) for r in rows]
    return Ranking(
        files,
        embeddings,
        skipped,
        names,
        scores,
        order,
        len(classes),
        opened.cached,
        options.rule,
        options.k,
        left_out,
        truth,
    )
