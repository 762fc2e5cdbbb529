"""Building a search index from embeddings, and loading a saved one (checked against its
embeddings file, so a stale index is an error rather than wrong neighbours)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from audioclf.fileio import file_stamp
from audioclf.search.approximate import APPROXIMATE_METHODS, FaissIndex
from audioclf.search.base import META_FORMAT, SearchIndex
from audioclf.search.exact import ExactIndex

METHODS = ("exact", *APPROXIMATE_METHODS)
_META_KEYS = ("format", "method", "dim", "size", "params", "data", "source")


def read_embeddings(path: str | Path) -> np.ndarray:
    """The float [N, D] array of an embeddings .npy file (e.g. PREFIX.npy of audioclf.embed)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"embeddings file {path} not found; write it with python -m audioclf.embed --index SHEET --save PREFIX"
        )
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ValueError(
            f"{path} is not a readable .npy array ({exc}); rewrite it with audioclf.embed"
        ) from None
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.floating):
        raise ValueError(
            f"{path} holds a {array.dtype} array of shape {array.shape}; expected float [rows, dim]"
        )
    return array


# The approximate methods' build parameters, by name (approximate.METHOD_PARAMS: which each takes)
BUILD_PARAMS = ("nlist", "nprobe", "pq_m", "rerank", "hnsw_m", "ef_construction", "ef_search")


def build(
    embeddings: Any,
    method: str = "exact",
    *,
    device: str | torch.device | None = None,
    progress: bool = True,
    seed: int = 0,
    **params: int | None,
) -> SearchIndex:
    """A search index over `embeddings` (an array [N, D], or the path of an .npy file; rows are
    L2-normalised, so scores are cosine similarities).

    `method`: "exact" (torch, on `device`; the only one that needs no faiss), "ivf"
    (IndexIVFFlat: `nlist` k-means lists, `nprobe` of them visited per query), "hnsw"
    (IndexHNSWFlat: `hnsw_m` links per node, `ef_construction`, `ef_search`) or "ivfpq"
    (IndexIVFPQ: rows coded in `pq_m` bytes, whose `rerank` * k best candidates are re-scored
    exactly from the float rows it also keeps; rerank=1 keeps only the codes, a fraction of
    the memory at a lower recall): `params`, by name (BUILD_PARAMS). Parameters left None take
    the defaults of
    audioclf.search.approximate; faiss indexes run on the CPU whatever `device` is. An index
    built from a file remembers it, so save() can record it and load() can check it.
    """
    if method not in METHODS:
        raise ValueError(f"unknown search method {method!r}; choose one of {', '.join(METHODS)}")
    source = None
    if isinstance(embeddings, (str, Path)):
        source = Path(embeddings)
        embeddings = read_embeddings(source)
    if unknown := sorted(set(params) - set(BUILD_PARAMS)):
        raise TypeError(
            f"build() got unknown parameter(s) {', '.join(unknown)}; the methods take "
            f"{', '.join(BUILD_PARAMS)}"
        )
    params = {name: params.get(name) for name in BUILD_PARAMS}
    if method == "exact":
        given = [name for name, value in params.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} do not apply to method 'exact' (it has no parameters)"
            )
        return ExactIndex(embeddings, device=device, source=source)
    return FaissIndex.build(
        embeddings, method, source=source, progress=progress, seed=seed, **params
    )


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(
            f"search index {path} not found; build and save one with audioclf.search.build(...).save(path)"
        )
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"search index {path} is not valid JSON ({exc}); rebuild it") from None
    missing = [key for key in _META_KEYS if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise ValueError(
            f"search index {path} lacks {', '.join(missing)}; it was not written by audioclf.search, rebuild it"
        )
    if meta["format"] != META_FORMAT or meta["method"] not in METHODS:
        raise ValueError(
            f"search index {path} has format {meta['format']!r} and method {meta['method']!r}; this "
            f"version reads format {META_FORMAT} with methods {', '.join(METHODS)}; rebuild it"
        )
    return meta


def _checked_source(meta: dict[str, Any], path: Path) -> Path | None:
    """The embeddings file the index was built from, if it recorded one and it is unchanged."""
    if meta["source"] is None:
        return None
    recorded = meta["source"]
    source = path.parent / recorded["path"]  # an absolute recorded path stays absolute
    if not source.is_file():
        raise FileNotFoundError(
            f"search index {path} was built from {source}, which is missing; keep the index beside "
            f"its embeddings or rebuild it"
        )
    now = file_stamp(source, relative_to=path.parent)
    if (now["bytes"], now["mtime_ns"]) != (recorded["bytes"], recorded["mtime_ns"]):
        raise ValueError(
            f"search index {path} is stale: {source} changed since it was built (size "
            f"{recorded['bytes']} -> {now['bytes']} bytes, or modified); rebuild the index"
        )
    return source


def load(path: str | Path, *, device: str | torch.device | None = None) -> SearchIndex:
    """The index that save(path) wrote; an exact index's rows go to `device`.

    Raises one clear error when the description or its data file is missing, or when the
    embeddings file the index was built from is missing or changed since (size or mtime).
    """
    path = Path(path)
    meta = _read_meta(path)
    source = _checked_source(meta, path)
    data = None if meta["data"] is None else path.parent / meta["data"]
    if data is not None and not data.is_file():
        raise FileNotFoundError(
            f"search index {path} names data file {data}, which is missing; rebuild the index"
        )
    recorded = meta.get("data_bytes")  # absent from descriptions written before it existed
    if data is not None and recorded is not None and data.stat().st_size != recorded:
        raise ValueError(
            f"search index data {data} holds {data.stat().st_size} bytes but {path} records "
            f"{recorded} (cut short, or of another build); rebuild the index with "
            "python -m audioclf.search build"
        )
    if meta["method"] == "exact":
        index: SearchIndex = ExactIndex(
            read_embeddings(data or source), device=device, source=source
        )
    else:
        index = FaissIndex.read(meta["method"], data, meta["params"], source)
    if (index.size, index.dim) != (meta["size"], meta["dim"]):
        raise ValueError(
            f"search index {path} describes {meta['size']} rows x {meta['dim']} but its data "
            f"{data or source} holds {index.size} x {index.dim}; rebuild the index"
        )
    index.path = path
    index.info = meta.get("info") or {}  # absent from descriptions written before it existed
    return index
