"""Approximate inner-product search with faiss: IVF-Flat, HNSW-Flat and IVF-PQ.

faiss is an optional dependency (`pip install faiss-cpu`): it is imported only when one of
these methods is asked for, and its absence is one clear error. The default parameters were
chosen from benchmarks/search.py runs at 100k and 400k x 256 (top-10 recall >= 0.95 while a
search visits a small part of the rows). Indexes run on the CPU; a faiss-gpu build works too,
on the CPU.
"""

from __future__ import annotations

import importlib.util
import math
import threading
from pathlib import Path
from typing import IO, Any

import numpy as np
from tqdm import tqdm

from audioclf.search.base import SearchIndex, check_positive, unit_rows

APPROXIMATE_METHODS = ("ivf", "hnsw", "ivfpq")
# Which build() parameters each method takes.
METHOD_PARAMS = {
    "ivf": ("nlist", "nprobe"),
    "ivfpq": ("nlist", "nprobe", "pq_m", "rerank"),
    "hnsw": ("hnsw_m", "ef_construction", "ef_search"),
}
DEFAULT_NPROBE = 32
DEFAULT_HNSW_M = 32
DEFAULT_EF_CONSTRUCTION = 80
DEFAULT_EF_SEARCH = 128
# IVF-PQ re-scores rerank * k candidates exactly; 1 keeps only the codes (compressed, lower recall).
DEFAULT_RERANK = 8
# k-means trains on at most this many rows per list (faiss warns below 39).
_TRAIN_ROWS_PER_LIST = 64
# PQ codebooks have 2**8 centroids per sub-vector; faiss trains them on up to 256 rows per
# centroid and warns below 39, so IVF-PQ needs at least 39 * 256 rows.
_PQ_BITS = 8
_PQ_TRAIN_ROWS = 256 * 2**_PQ_BITS
PQ_MIN_ROWS = 39 * 2**_PQ_BITS
# Rows added per step (the progress bar moves once per step).
_ADD_CHUNK = 65536


def import_faiss(method: str) -> Any:
    """The faiss module, or one ImportError line saying how to install it."""
    try:
        import faiss  # noqa: PLC0415 - optional: only the approximate methods need it
    except ImportError:
        raise ImportError(
            f"search method {method!r} needs faiss, which is not installed: pip install faiss-cpu "
            f"(or faiss-gpu), or use method='exact'"
        ) from None
    return faiss


def faiss_available() -> bool:
    """Whether faiss can be imported (checked without importing it)."""
    return importlib.util.find_spec("faiss") is not None


def default_nlist(size: int) -> int:
    """About 4 sqrt(N) inverted lists, but at least 39 training rows per list."""
    return max(1, min(round(4 * math.sqrt(size)), size // 39))


def default_pq_m(dim: int) -> int:
    """Sub-quantizers for IVF-PQ: the largest divisor of dim up to dim / 8 (32 B per 256-d row;
    faiss trains 4-dim sub-vectors about 40x slower than 8-dim ones)."""
    return max(m for m in range(1, max(1, dim // 8) + 1) if dim % m == 0)


def _check_given(method: str, given: dict[str, int | None]) -> None:
    allowed = METHOD_PARAMS[method]
    for name, value in given.items():
        if value is None:
            continue
        if name not in allowed:
            raise ValueError(
                f"{name} does not apply to method {method!r} (its parameters: {', '.join(allowed)})"
            )
        check_positive(value, name)


def resolve_params(
    method: str, size: int, dim: int, given: dict[str, int | None]
) -> dict[str, int]:
    """The method's parameters: the given ones checked, the others at their defaults."""
    _check_given(method, given)
    allowed = METHOD_PARAMS[method]
    defaults = {
        "nlist": default_nlist(size),
        "nprobe": DEFAULT_NPROBE,
        "pq_m": default_pq_m(dim),
        "hnsw_m": DEFAULT_HNSW_M,
        "ef_construction": DEFAULT_EF_CONSTRUCTION,
        "ef_search": DEFAULT_EF_SEARCH,
        "rerank": DEFAULT_RERANK,
    }
    params = {
        name: int(given[name]) if given.get(name) is not None else defaults[name]
        for name in allowed
    }
    if "nlist" in params and params["nlist"] > size:
        raise ValueError(
            f"nlist={params['nlist']} exceeds the {size} rows to index; pass nlist <= {size}"
        )
    if "pq_m" in params and dim % params["pq_m"]:
        raise ValueError(f"pq_m={params['pq_m']} must divide the embedding dimension {dim}")
    if method == "ivfpq" and size < PQ_MIN_ROWS:
        raise ValueError(
            f"ivfpq needs at least {PQ_MIN_ROWS} rows to train its codebooks, got {size}; use 'ivf' or 'exact'"
        )
    return params


def _new_faiss_index(faiss: Any, method: str, dim: int, params: dict[str, int]) -> Any:
    if method == "hnsw":
        index = faiss.IndexHNSWFlat(dim, params["hnsw_m"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = params["ef_construction"]
        return index
    quantizer = faiss.IndexFlatIP(dim)  # faiss's Python wrapper keeps it alive with the index
    if method == "ivf":
        return faiss.IndexIVFFlat(quantizer, dim, params["nlist"], faiss.METRIC_INNER_PRODUCT)
    index = faiss.IndexIVFPQ(
        quantizer, dim, params["nlist"], params["pq_m"], _PQ_BITS, faiss.METRIC_INNER_PRODUCT
    )
    if params["rerank"] == 1:
        return index
    refined = faiss.IndexRefineFlat(index)  # keeps the float rows to re-score the shortlist
    refined.k_factor = params["rerank"]
    return refined


def _train_rows(method: str, rows: np.ndarray, params: dict[str, int], seed: int) -> np.ndarray:
    """A seeded sample big enough for k-means (and PQ codebooks), small enough to train fast."""
    wanted = _TRAIN_ROWS_PER_LIST * params["nlist"]
    if method == "ivfpq":
        wanted = max(wanted, _PQ_TRAIN_ROWS)
    if wanted >= len(rows):
        return rows
    chosen = np.random.default_rng(seed).choice(len(rows), size=wanted, replace=False)
    return rows[np.sort(chosen)]


class FaissIndex(SearchIndex):
    """An IVF-Flat, HNSW-Flat or IVF-PQ faiss index with inner-product metric (CPU)."""

    data_suffix = ".faiss"

    def __init__(
        self, method: str, faiss_index: Any, params: dict[str, int], source: Path | None
    ) -> None:
        super().__init__(faiss_index.d, faiss_index.ntotal, params, source)
        self.method = method
        self._index = faiss_index
        self._knob = threading.Lock()
        self.set_search_params()

    @classmethod
    def build(
        cls,
        embeddings: Any,
        method: str,
        *,
        source: Path | None = None,
        progress: bool = True,
        seed: int = 0,
        **given: int | None,
    ) -> FaissIndex:
        """Train (IVF) and fill a new index with `embeddings`, rows added in chunks under a
        progress bar; `given` holds the method's parameters (METHOD_PARAMS), None = default."""
        faiss = import_faiss(method)
        rows = unit_rows(embeddings, "embeddings")
        params = resolve_params(method, rows.shape[0], rows.shape[1], given)
        index = _new_faiss_index(faiss, method, rows.shape[1], params)
        with tqdm(total=len(rows), unit="row", desc=f"build {method}", disable=not progress) as bar:
            if method != "hnsw":
                bar.set_postfix_str("training")
                index.train(_train_rows(method, rows, params, seed))
                bar.set_postfix_str("adding")
            for start in range(0, len(rows), _ADD_CHUNK):
                index.add(rows[start : start + _ADD_CHUNK])
                bar.update(min(_ADD_CHUNK, len(rows) - start))
        return cls(method, index, params, source)

    @classmethod
    def read(
        cls, method: str, data: Path, params: dict[str, int], source: Path | None
    ) -> FaissIndex:
        """An index written by save(), with the search parameters it was saved with."""
        faiss = import_faiss(method)
        try:
            index = faiss.read_index(str(data))
        except RuntimeError as exc:  # faiss's C++ error: a damaged file
            raise ValueError(
                f"search index data {data} is damaged ({str(exc).splitlines()[-1][:120]}); "
                "rebuild the index with python -m audioclf.search build"
            ) from None
        return cls(method, index, params, source)

    def set_search_params(self, *, nprobe: int | None = None, ef_search: int | None = None) -> None:
        """Change how much of the index a search visits: more lists (IVF `nprobe`) or a longer
        candidate list (HNSW `ef_search`, raised to k when smaller) give higher recall, slower."""
        given = {"nprobe": nprobe, "ef_search": ef_search}
        _check_given(self.method, given)
        self.params.update({name: int(value) for name, value in given.items() if value is not None})
        if "nprobe" in self.params:
            faiss = import_faiss(self.method)
            faiss.extract_index_ivf(self._index).nprobe = min(
                self.params["nprobe"], self.params["nlist"]
            )

    def _search_chunk(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self.method != "hnsw":
            return self._index.search(queries, k)
        # efSearch is the faiss index's own knob, set per call: under the lock, or a server's
        # thread asking k=1 searches with another's k=64 (faiss's per-call SearchParameters
        # are lost when faiss.contrib.torch_utils, which pytorch-metric-learning imports,
        # has replaced Index.search)
        with self._knob:
            self._index.hnsw.efSearch = max(self.params["ef_search"], k)
            return self._index.search(queries, k)

    def _write_data(self, handle: IO[bytes]) -> None:
        faiss = import_faiss(self.method)
        faiss.write_index(self._index, faiss.PyCallbackIOWriter(handle.write))
