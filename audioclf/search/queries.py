"""A collection opened once to answer many queries (`Searcher`: what `python -m audioclf.search
query`, `Model.search` and `audioclf serve` search with), the queries, and how hits are shown.

    searcher = Searcher.open("out/big", model=model, cohort="out/train")  # warning: searcher.warning
    queries = audio_queries(model, ["clips/", "a.wav"], batch_size=16, progress=True)
    queries = prefix_queries(Collection.open("out/new"))
    hits = searcher.neighbours(queries, k=10)   # arrays: query, rank, score, row (norm_score)
    table = searcher.table(queries, k=10)       # one row per (query, rank), as search query prints
    print("\n".join(table_lines(table)))      # or write_csv(table, path) / write_json(...)

Audio files are found and embedded as `audioclf.embed` does (audioclf.embedding.gallery:
folders searched recursively, unreadable files named and left out). The neighbour table has one
row per (query, rank): the query's columns, then rank, score (and with a ScoreNorm norm_score)
and the index row's class, item, id and path.

Normalised scores are for verification-style questions ("is this hit the query's class?"): a
hit's cosine minus each side's mean score against a cohort (embeddings of other clips, ideally
of other classes), over its standard deviation, averaged over both sides (S-norm over the whole
cohort, AS-norm over each side's top N: audioclf.metrics.normalised_scores, as evaluate's
--score-norm). They make one threshold fit every query; the ranking stays by cosine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from audioclf.fileio import atomic_write_bytes
from audioclf.inference.artefacts import LoadedEmbedder
from audioclf.inference.extract import embed_paths, find_files
from audioclf.metrics import asnorm_top, normalised_scores, resolve_score_norm
from audioclf.search.base import SearchIndex
from audioclf.search.collection import Collection, check_model, open_index

NEIGHBOUR_COLUMNS = ("rank", "score", "class", "item", "id", "path")
NORM_COLUMN = "norm_score"  # after score, when the scores are normalised


@dataclass
class Queries:
    """Query embeddings [Q, D] and what names each query (a `query` column, and for rows of
    a PREFIX also query_class, query_item and query_path)."""

    embeddings: np.ndarray
    labels: pd.DataFrame
    source: str  # what the queries are, for messages
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # unreadable audio files

    @property
    def has_items(self) -> bool:
        return "query_item" in self.labels.columns


def audio_queries(
    model: LoadedEmbedder,
    inputs: list[str | Path],
    *,
    batch_size: int = 16,
    num_workers: int = 0,
    progress: bool = True,
) -> Queries:
    """The audio files of `inputs` (folders searched recursively) embedded by `model`; files
    that cannot be read are listed in `skipped` (ValueError when none can be)."""
    files, embeddings, skipped = embed_paths(
        model,
        find_files(inputs, model.features),
        skip_bad=True,
        batch_size=batch_size,
        num_workers=num_workers,
        progress=progress,
        what="the query files",
    )
    labels = pd.DataFrame({"query": [str(f) for f in files]})
    return Queries(embeddings, labels, f"{len(files)} audio file(s)", skipped)


def prefix_queries(collection: Collection) -> Queries:
    """Every row of another embedded collection (or of the indexed one) as a query."""
    rows = collection.rows
    labels = pd.DataFrame(
        {
            "query": rows["id"].to_numpy(),
            "query_class": rows["class"].to_numpy(),
            "query_item": rows["item"].to_numpy(),
            "query_path": rows["path"].to_numpy(),
        }
    )
    source = f"{collection.size} rows of {collection.npy}"
    return Queries(collection.embeddings(), labels, source)


@dataclass(frozen=True)
class ScoreNorm:
    """How search_neighbours normalises its hits' scores: against `cohort` [C, D] (unit rows),
    over the whole cohort (top None: S-norm) or each side's `top` highest scores (AS-norm)."""

    cohort: np.ndarray
    top: int | None
    source: str  # what the cohort is, for messages
    prefix: str = ""  # the cohort collection's PREFIX, as given

    @classmethod
    def from_options(
        cls,
        cohort: str | Path | None,
        method: str | None = None,
        top: int | None = None,
        *,
        index: SearchIndex | None = None,
    ) -> ScoreNorm | None:
        """search query's --cohort / --score-norm / --cohort-top (and Model.search's), resolved
        by audioclf.metrics.resolve_score_norm with no default cohort: None without a cohort,
        else the cohort PREFIX's rows, checked against `index` when given; a ValueError for
        options that do not fit, before any query is embedded."""
        method, cohort = resolve_score_norm(method, cohort, top)
        if method == "none":
            return None
        norm = cls.of(Collection.open(cohort, flag="--cohort"), method, top)
        if index is not None:
            norm.check_dim(index)
        return norm

    @classmethod
    def of(cls, collection: Collection, method: str, top: int | None = None) -> ScoreNorm:
        """S-norm or AS-norm (`top` by default audioclf.metrics.asnorm_top: 300, or a fifth
        of a smaller cohort) against every row of an embedded collection."""
        if collection.size < 2:
            raise ValueError(
                f"the cohort {collection.npy} has {collection.size} row(s); it needs >= 2"
            )
        top = None if method == "snorm" else asnorm_top(top, collection.size)
        source = f"{collection.size} rows of {collection.npy}"
        return cls(collection.embeddings(), top, source, str(collection.prefix))

    @property
    def method(self) -> str:
        return "snorm" if self.top is None else "asnorm"

    def check_dim(self, index: SearchIndex) -> None:
        """One line naming both sides when the cohort and the index differ in dimension."""
        if self.cohort.shape[1] != index.dim:
            raise ValueError(
                f"the cohort ({self.source}) is {self.cohort.shape[1]}-d but the index "
                f"{index.describe()} is {index.dim}-d; embed both with the same model"
            )

    def record(self) -> dict[str, Any]:
        """What a --json result records of the normalisation: method, cohort (and top)."""
        return {
            "method": self.method,
            "cohort": self.prefix,
            **({} if self.top is None else {"top": self.top}),
        }

    def describe(self) -> str:
        top = "" if self.top is None else f"top {self.top} of "
        return f"{self.method} ({top}{self.source})"


def check_query_dim(queries: Queries, index: SearchIndex) -> None:
    """One line naming both sides when the queries and the index differ in dimension."""
    dim = queries.embeddings.shape[1]
    if dim != index.dim:
        raise ValueError(
            f"the queries ({queries.source}) are {dim}-d but the index {index.describe()} is "
            f"{index.dim}-d; embed both with the same model"
        )


def _group_codes(queries: Queries, collection: Collection) -> tuple[np.ndarray, np.ndarray]:
    """One code per (class, item) pair, shared by the queries and the index rows."""
    if not queries.has_items:
        raise ValueError(
            "--exclude-same-item needs queries with an item: give them as --query-prefix "
            "PREFIX (rows of embed --index), not as audio files"
        )

    def keys(classes: pd.Series, items: pd.Series) -> pd.Series:
        return classes.astype(str) + "\x1f" + items.astype(str)

    both = pd.concat(
        [
            keys(queries.labels["query_class"], queries.labels["query_item"]),
            keys(collection.rows["class"], collection.rows["item"]),
        ],
        ignore_index=True,
    )
    codes = pd.factorize(both)[0].astype(np.int64)
    return codes[: len(queries.labels)], codes[len(queries.labels) :]


@dataclass
class Neighbours:
    """Hits of some queries, best first within each query, as arrays of one length: `query`
    (the query's position), `rank` (1-based), `score` (cosine), `row` (the collection's row)
    and `norm_score` (None without a ScoreNorm)."""

    query: np.ndarray
    rank: np.ndarray
    score: np.ndarray
    row: np.ndarray
    norm_score: np.ndarray | None = None


@dataclass
class Searcher:
    """An embedded collection opened once, with its index and its cohort normalisation, that
    answers many queries; `warning` is the check of the query model against the model that
    embedded the collection (None when they match, or when no model was given)."""

    collection: Collection
    index: SearchIndex
    norm: ScoreNorm | None = None
    warning: str | None = None

    @classmethod
    def open(
        cls,
        prefix: str | Path,
        *,
        model: LoadedEmbedder | None = None,
        method: str | None = None,
        device: str | Any = None,
        nprobe: int | None = None,
        ef_search: int | None = None,
        cohort: str | Path | None = None,
        score_norm: str | None = None,
        cohort_top: int | None = None,
        flag: str = "PREFIX",
    ) -> Searcher:
        """The collection PREFIX of `embed --index --save`, its index of `method` (None: the
        one saved, else exact; open_index), `model` checked against the model that embedded it
        (check_model: a ValueError when it cannot have, else `warning`), and the cohort
        normalisation (ScoreNorm.from_options); `flag` names PREFIX in messages."""
        collection = Collection.open(prefix, flag=flag)
        index = open_index(collection, method, device=device, nprobe=nprobe, ef_search=ef_search)
        warning = None if model is None else check_model(index, model, collection)
        norm = ScoreNorm.from_options(cohort, score_norm, cohort_top, index=index)
        return cls(collection, index, norm, warning)

    def neighbours(
        self, queries: Queries, k: int, *, exclude_same_item: bool = False, progress: bool = False
    ) -> Neighbours:
        """The k nearest rows of each query, best first (fewer where the index has fewer). With
        `exclude_same_item` a query never gets a row of its own item (class + item); with a
        cohort each hit also gets its normalised score (float64), computed for the hits only."""
        check_query_dim(queries, self.index)
        groups: dict[str, Any] = {}
        if exclude_same_item:
            groups["query_groups"], groups["index_groups"] = _group_codes(queries, self.collection)
        scores, ids = self.index.search(queries.embeddings, k, progress=progress, **groups)
        query_at, rank_at = np.nonzero(ids >= 0)  # row-major: by query, then by rank
        found = ids[query_at, rank_at]
        norm = None
        if self.norm is not None:
            norm = _normalised(queries, self.collection, query_at, found, self.norm)
        return Neighbours(query_at, rank_at + 1, scores[query_at, rank_at], found, norm)

    def table(self, queries: Queries, k: int, **options) -> pd.DataFrame:
        """neighbours() as one table row per (query, rank): the query's columns, then rank,
        score (norm_score) and the row's class, item, id and path."""
        hits = self.neighbours(queries, k, **options)
        table = queries.labels.iloc[hits.query].reset_index(drop=True)
        table["rank"] = hits.rank
        table["score"] = hits.score.astype(np.float64)
        if hits.norm_score is not None:
            table[NORM_COLUMN] = hits.norm_score
        rows = self.collection.rows.iloc[hits.row][["class", "item", "id", "path"]]
        return pd.concat([table, rows.reset_index(drop=True)], axis=1)


def _normalised(
    queries: Queries,
    collection: Collection,
    query_at: np.ndarray,
    found: np.ndarray,
    norm: ScoreNorm,
) -> np.ndarray:
    """The normalised scores of the hits (query_at[i], found[i]): only the hit rows of the
    index are read (memory-mapped) and scored against the cohort."""
    hit_rows, hit_at = np.unique(found, return_inverse=True)
    hits = np.load(collection.npy, mmap_mode="r", allow_pickle=False)[hit_rows]
    return normalised_scores(
        queries.embeddings, hits, (query_at, hit_at.reshape(-1)), norm.cohort, top_n=norm.top
    )


def neighbour_columns(table: pd.DataFrame) -> tuple[str, ...]:
    """The neighbour columns of `table`: NEIGHBOUR_COLUMNS, with norm_score after score."""
    if NORM_COLUMN not in table.columns:
        return NEIGHBOUR_COLUMNS
    return ("rank", "score", NORM_COLUMN, *NEIGHBOUR_COLUMNS[2:])


def _by_query(table: pd.DataFrame) -> list[dict[str, Any]]:
    """Per query (in order): its columns, and "neighbours", its table rows' neighbour columns.
    A query's rows start at rank 1, so two queries of one name stay apart."""
    query_columns = [c for c in table.columns if c.startswith("query")]
    columns = neighbour_columns(table)
    queries: list[dict[str, Any]] = []
    for record in table.to_dict("records"):  # plain Python values
        if record["rank"] == 1:
            queries.append({**{c: record[c] for c in query_columns}, "neighbours": []})
        queries[-1]["neighbours"].append({c: record[c] for c in columns})
    return queries


def table_lines(table: pd.DataFrame) -> list[str]:
    """The neighbours as text: a line per query, then its neighbours in aligned columns."""
    if table.empty:
        return ["no neighbours found"]

    def cell(column: str, value: Any) -> str:
        return f"{value:.4f}" if column in ("score", NORM_COLUMN) else str(value)

    columns = neighbour_columns(table)
    widths = {
        c: max(len(c), int(table[c].map(lambda v, c=c: len(cell(c, v))).max())) for c in columns
    }
    header = ("  " + "  ".join(f"{c:<{widths[c]}}" for c in columns)).rstrip()
    lines = []
    for query in _by_query(table):
        about = ", ".join(
            f"{c.removeprefix('query_')} {v}" for c, v in query.items() if c.startswith("query_")
        )
        lines += [f"query {query['query']}" + (f" ({about})" if about else ""), header]
        lines += [
            ("  " + "  ".join(f"{cell(c, row[c]):<{widths[c]}}" for c in columns)).rstrip()
            for row in query["neighbours"]
        ]
    return lines


def write_csv(table: pd.DataFrame, path: str | Path) -> Path:
    """The table as CSV, one row per (query, rank), written atomically."""
    return atomic_write_bytes(Path(path), table.to_csv(index=False).encode())


def write_json(table: pd.DataFrame, path: str | Path, about: dict[str, Any]) -> Path:
    """`about` (the index, k, ...) and "queries": per query its columns and "neighbours"."""
    text = json.dumps({**about, "queries": _by_query(table)}, indent=2) + "\n"
    return atomic_write_bytes(Path(path), text.encode())
