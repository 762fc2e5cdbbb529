"""What every search index shares: input checks, chunked top-k search, own-group exclusion, save.

A backend (exact.py, approximate.py) only answers "the k rows of largest inner product for
these unit-norm query rows" for one chunk of queries; everything a caller can get wrong is
checked here once, so each backend sees clean float32 rows and a valid k.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from audioclf.fileio import atomic_write_together, file_stamp
from audioclf.metrics import LIST_BUDGET

# Version of the JSON description written by save(); load() refuses others.
META_FORMAT = 1
# Most query rows handed to a backend at once (faiss parallelises over them).
_MAX_QUERY_CHUNK = 8192


def unit_rows(array: Any, name: str) -> np.ndarray:
    """`array` as C-contiguous float32 [n, d] with L2-normalised rows (cosine = inner product).

    Normalised with torch's F.normalize, as audioclf.metrics does, so exact search ranks
    exactly as retrieval_metrics; a row of zeros stays zeros.
    """
    if isinstance(array, torch.Tensor):
        tensor = array.detach().to("cpu", torch.float32)
    else:
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    if tensor.ndim != 2 or tensor.shape[0] == 0 or tensor.shape[1] == 0:
        raise ValueError(
            f"{name} must be a non-empty 2-D array [rows, dim], got shape {tuple(tensor.shape)}"
        )
    bad_rows = (~torch.isfinite(tensor)).any(dim=1).nonzero().flatten()
    if len(bad_rows):
        raise ValueError(
            f"{name} has NaN/inf values in {len(bad_rows)} of {tensor.shape[0]} rows (first rows: "
            f"{bad_rows[:5].tolist()}); check the model output for these inputs"
        )
    return F.normalize(tensor, p=2, dim=1).contiguous().numpy()


def check_positive(value: Any, name: str) -> None:
    """One ValueError line unless `value` is an integer >= 1 (bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_groups(groups: Any, n_rows: int, name: str) -> np.ndarray:
    array = np.asarray(groups)
    if array.shape != (n_rows,) or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{name} must be 1-D integer group codes, one per row ({n_rows} rows), got shape "
            f"{array.shape} and dtype {array.dtype}; e.g. np.unique(items, return_inverse=True)[1]"
        )
    return array.astype(np.int64, copy=False)


def _excluded_counts(query_groups: np.ndarray, index_groups: np.ndarray) -> np.ndarray:
    """How many index rows share each query's group: the most a query's list can lose."""
    offset = min(int(index_groups.min()), int(query_groups.min()))
    sizes = np.bincount(index_groups - offset)
    shifted = query_groups - offset
    inside = shifted < len(sizes)
    return np.where(inside, sizes[np.where(inside, shifted, 0)], 0)


def _first_kept(scores: np.ndarray, ids: np.ndarray, drop: np.ndarray, k: int):
    """Each row's first k entries that are not dropped, in rank order; short rows padded."""
    order = np.argsort(drop, axis=1, kind="stable")[:, :k]
    kept_scores = np.take_along_axis(scores, order, axis=1)
    kept_ids = np.take_along_axis(ids, order, axis=1)
    dropped = np.take_along_axis(drop, order, axis=1)
    kept_scores[dropped] = -np.inf
    kept_ids[dropped] = -1
    return kept_scores, kept_ids


class SearchIndex(ABC):
    """Top-k inner-product search over L2-normalised rows (so scores are cosine similarities).

    Subclasses set `method` and `data_suffix` and implement `_search_chunk` and `_write_data`.
    """

    method: str  # "exact", "ivf", "hnsw" or "ivfpq"
    # Suffix of the data file written beside the JSON description; None: nothing to write.
    data_suffix: str | None

    def __init__(self, dim: int, size: int, params: dict[str, Any], source: Path | None) -> None:
        self.dim = dim
        self.size = size
        self.params = params
        self.source = source  # the embeddings file the index was built from, if any
        self.path: Path | None = None  # the JSON description, once saved or loaded
        # What the caller knows of the embeddings (e.g. the model that made them): saved in the
        # JSON description and given back by load(), never read by the index itself.
        self.info: dict[str, Any] = {}

    def describe(self) -> str:
        """Which index this is, for error messages: its method and the files behind it."""
        origin = f"{self.path}" if self.path else "an unsaved index"
        built_from = f", built from {self.source}" if self.source else ""
        return f"{origin} ({self.method}, {self.size} rows x {self.dim}{built_from})"

    def search(
        self,
        queries: Any,
        k: int,
        *,
        query_groups: Any = None,
        index_groups: Any = None,
        chunk_size: int | None = None,
        progress: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The k nearest index rows of each query: (scores float32 [Q, k], ids int64 [Q, k]).

        Rows are sorted by decreasing score. With `query_groups` [Q] and `index_groups` [N]
        (integer codes, e.g. item ids), an index row of the query's own group is never
        returned (deduplication, cross-item retrieval): the backend is asked for k plus the
        size of the query's group, so k rows remain whenever the backend finds them. Where
        fewer than k rows exist (k > N, or an approximate index found too few) the list is
        padded with id -1 and score -inf.
        """
        check_positive(k, "k")
        if chunk_size is not None:
            check_positive(chunk_size, "chunk_size")
        rows = self._query_rows(queries)
        if (query_groups is None) != (index_groups is None):
            raise ValueError(
                "pass query_groups and index_groups together (or neither) to exclude own-group rows"
            )
        excluded = np.zeros(len(rows), dtype=np.int64)
        if query_groups is not None:
            query_groups = _check_groups(query_groups, len(rows), "query_groups")
            index_groups = _check_groups(index_groups, self.size, "index_groups")
            excluded = _excluded_counts(query_groups, index_groups)

        scores = np.full((len(rows), k), -np.inf, dtype=np.float32)
        ids = np.full((len(rows), k), -1, dtype=np.int64)
        widest = int(min(self.size, k + excluded.max()))
        step = chunk_size or max(1, min(_MAX_QUERY_CHUNK, LIST_BUDGET // widest))
        with tqdm(
            total=len(rows), unit="query", desc=f"search {self.method}", disable=not progress
        ) as bar:
            for start in range(0, len(rows), step):
                stop = min(start + step, len(rows))
                wanted = int(min(self.size, k + excluded[start:stop].max()))
                chunk_scores, chunk_ids = self._search_chunk(rows[start:stop], wanted)
                drop = chunk_ids < 0
                if query_groups is not None:
                    neighbour_groups = index_groups[np.maximum(chunk_ids, 0)]
                    drop |= neighbour_groups == query_groups[start:stop, None]
                chunk_scores, chunk_ids = _first_kept(chunk_scores, chunk_ids, drop, k)
                scores[start:stop, : chunk_ids.shape[1]] = chunk_scores
                ids[start:stop, : chunk_ids.shape[1]] = chunk_ids
                bar.update(stop - start)
        return scores, ids

    def _query_rows(self, queries: Any) -> np.ndarray:
        rows = unit_rows(queries, "queries")
        if rows.shape[1] != self.dim:
            raise ValueError(
                f"queries have dimension {rows.shape[1]} but the index {self.describe()} has "
                f"dimension {self.dim}; embed the queries with the model that made the index"
            )
        return rows

    @abstractmethod
    def _search_chunk(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, ids) of unit-norm float32 queries [B, dim], 1 <= k <= size; ids -1
        where the backend found fewer than k rows."""

    @abstractmethod
    def _write_data(self, handle: IO[bytes]) -> None:
        """Write what load needs beside the JSON description (only when data_suffix is set)."""

    def data_file(self, meta_path: Path) -> Path | None:
        """Where save(meta_path) writes the index data, or None when there is nothing to write."""
        return None if self.data_suffix is None else meta_path.with_suffix(self.data_suffix)

    def save(self, path: str | Path) -> Path:
        """Write the index as `path` (a JSON description) plus its data file beside it.

        The description records the method, dimension, size, parameters, `info` (plain JSON
        data) and the size and modification time of the embeddings file the index was built
        from, so load() detects an index that no longer matches its embeddings. Both files are
        written atomically, together (fileio.atomic_write_together).
        """
        path = Path(path)
        if path.suffix != ".json":
            raise ValueError(f"index path must end in .json (its data goes beside it), got {path}")
        data = self.data_file(path)
        data_bytes = []

        def write_data(handle: IO[bytes]) -> None:
            self._write_data(handle)
            data_bytes.append(handle.tell())

        def write_meta(handle: IO[bytes]) -> None:
            meta = {
                "format": META_FORMAT,
                "method": self.method,
                "dim": self.dim,
                "size": self.size,
                "params": self.params,
                "data": data.name if data is not None else None,
                # load() checks it: a data file cut short, or of another save, is refused
                "data_bytes": data_bytes[0] if data is not None else None,
                "source": None
                if self.source is None
                else file_stamp(self.source, relative_to=path.parent),
                "info": self.info,
            }
            handle.write(json.dumps(meta, indent=2).encode() + b"\n")

        # together: a description never names a data file of another build
        atomic_write_together({data: write_data, path: write_meta} if data else {path: write_meta})
        self.path = path
        return path
