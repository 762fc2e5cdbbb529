"""An embedded collection on disk, as `python -m audioclf.search` uses it: PREFIX.npy and
PREFIX.parquet of `audioclf.embed --index SHEET --save PREFIX`, and the search indexes saved
beside them as PREFIX.<method>.json (plus PREFIX.<method>.faiss for the approximate ones).

    collection = Collection.open("out/big")
    index = build_saved(collection, "ivf", progress=True)  # records collection.made_by
    index = open_index(collection, None, device="cpu")   # the saved one; exact when none is
    warning = check_model(index, model, collection)      # ValueError when they cannot match

An index remembers in its `info` what is known of the embeddings: their rows and dimension,
and the model that made them (file, size, mtime, features, dimension, adaptation: the one
build is given, else the one embed --index recorded in PREFIX.parquet), so a query with
another model, or with the same one adapted otherwise, is one clear line instead of
meaningless neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from audioclf.errors import one_line
from audioclf.fileio import remove_temporaries
from audioclf.inference.artefacts import LoadedEmbedder, model_record
from audioclf.outputs import FolderLock, read_made_by
from audioclf.search.approximate import APPROXIMATE_METHODS, FaissIndex, faiss_available
from audioclf.search.base import SearchIndex
from audioclf.search.index import METHODS, build, load

# The columns embed --index writes into PREFIX.parquet, one row per PREFIX.npy row.
ROW_COLUMNS = ("row", "id", "class", "item", "path")


@dataclass
class Collection:
    """PREFIX.npy + PREFIX.parquet: the embeddings [size, dim] and one table row per embedding."""

    prefix: Path
    npy: Path
    parquet: Path
    rows: pd.DataFrame
    size: int
    dim: int
    # model_record of the model that embedded the rows, as embed --index wrote it into
    # PREFIX.parquet (None: a table written before it did, or by other code)
    made_by: dict[str, Any] | None = None

    @classmethod
    def open(cls, prefix: str | Path, *, flag: str = "PREFIX") -> Collection:
        """Both files of `prefix` (a PREFIX.npy / PREFIX.parquet path names its prefix too),
        checked to match; `flag` is how messages name the prefix."""
        prefix = Path(prefix)
        if prefix.suffix in (".npy", ".parquet"):
            prefix = prefix.with_suffix("")
        npy, parquet = (prefix.with_name(prefix.name + suffix) for suffix in (".npy", ".parquet"))
        missing = [str(path) for path in (npy, parquet) if not path.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{flag} {prefix}: {' and '.join(missing)} not found; write both with "
                f"python -m audioclf.embed --model MODEL --index SHEET --save {prefix}"
            )
        again = f"write {prefix} again with python -m audioclf.embed --index"
        shape = _npy_shape(npy, again)
        try:
            rows = pd.read_parquet(parquet)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{parquet} is not a readable parquet table ({one_line(exc)}); {again}"
            ) from None
        lacking = [column for column in ROW_COLUMNS if column not in rows.columns]
        if lacking:
            raise ValueError(
                f"{parquet} lacks column(s) {', '.join(lacking)}; it was not written by "
                f"audioclf.embed --index: write {prefix} again"
            )
        if len(rows) != shape[0]:
            raise ValueError(
                f"{parquet} has {len(rows)} rows but {npy} has {shape[0]}: they are not one "
                f"run's files; write {prefix} again with audioclf.embed --index"
            )
        rows = rows.reset_index(drop=True)
        return cls(prefix, npy, parquet, rows, shape[0], shape[1], read_made_by(parquet))

    def embeddings(self) -> np.ndarray:
        return np.load(self.npy, allow_pickle=False)

    def index_file(self, method: str) -> Path:
        """Where the index of `method` is saved: PREFIX.<method>.json."""
        return self.prefix.with_name(f"{self.prefix.name}.{method}.json")

    def saved_methods(self) -> list[str]:
        return [method for method in METHODS if self.index_file(method).is_file()]


def _npy_shape(npy: Path, again: str) -> tuple[int, int]:
    try:
        array = np.load(npy, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{npy} is not a readable .npy array ({one_line(exc)}); {again}") from None
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.floating) or 0 in array.shape:
        raise ValueError(
            f"{npy} holds a {array.dtype} array of shape {array.shape}; expected float "
            "[rows, dim] as audioclf.embed --index writes"
        )
    return int(array.shape[0]), int(array.shape[1])


def check_method(method: str) -> None:
    """ValueError for an unknown method, or an approximate one without faiss installed."""
    if method not in METHODS:
        raise ValueError(f"unknown search method {method!r}; choose one of {', '.join(METHODS)}")
    if method in APPROXIMATE_METHODS and not faiss_available():
        raise ValueError(
            f"search method {method!r} needs faiss, which is not installed: pip install "
            "faiss-cpu (or faiss-gpu), or use --method exact"
        )


def build_saved(
    collection: Collection,
    method: str,
    *,
    model: dict[str, Any] | None = None,
    progress: bool = True,
    **params: int | None,
) -> SearchIndex:
    """Build the `method` index of the collection's embeddings (build()'s `params`) and save it
    as collection.index_file(method), recording the embeddings' shape and `model`
    (model_record of the model that made them; None: the one the collection recorded, if any)."""
    check_method(method)
    path = collection.index_file(method)
    with FolderLock(
        path.with_suffix(".lock"),
        what=f"the {method} index of {collection.prefix}",
        by="another search build",
        fix="wait for it to finish (its index is the same), or build another --method",
    ):
        # what a killed build left (held by this lock, no other live writer has them)
        remove_temporaries(path, *(path.with_suffix(s) for s in (".faiss", ".npy")))
        index = build(collection.npy, method, progress=progress, **params)
        embeddings = {
            "rows": collection.size,
            "dim": collection.dim,
            "table": collection.parquet.name,
        }
        index.info = {"embeddings": embeddings, "model": model or collection.made_by}
        index.save(path)
    return index


def open_index(
    collection: Collection,
    method: str | None,
    *,
    device: str | torch.device | None = None,
    nprobe: int | None = None,
    ef_search: int | None = None,
) -> SearchIndex:
    """The saved index of `method` (None: the only one saved, else exact built on the fly:
    an exact index needs no building), with search-time `nprobe` / `ef_search` applied."""
    saved = collection.saved_methods()
    if method is None:
        if len(saved) > 1:
            raise ValueError(
                f"{collection.prefix} has {len(saved)} saved indexes ({', '.join(saved)}); "
                "pick one with --method"
            )
        method = saved[0] if saved else "exact"
    check_method(method)
    path = collection.index_file(method)
    if path.is_file():
        index = load(path, device=device)
    elif method == "exact":
        index = build(collection.npy, "exact", device=device, progress=False)
    else:
        raise FileNotFoundError(
            f"no {method} index of {collection.prefix} ({path} not found); build it with "
            f"python -m audioclf.search build {collection.prefix} --method {method}"
        )
    if index.size != collection.size:
        raise ValueError(
            f"the index {index.describe()} has {index.size} rows but {collection.parquet} has "
            f"{collection.size}; rebuild it with python -m audioclf.search build"
        )
    if isinstance(index, FaissIndex):
        index.set_search_params(nprobe=nprobe, ef_search=ef_search)
    elif nprobe is not None or ef_search is not None:
        raise ValueError("--nprobe and --ef-search apply to ivf, ivfpq and hnsw indexes, not exact")
    return index


def made_by(collection: Collection, index: SearchIndex | None = None) -> dict[str, Any] | None:
    """The one record of the model that made the collection's embeddings, which every check
    reads (search query, Model.search, serve, search build --model): embed --index's, written
    into PREFIX.parquet with the embeddings; for a table without one (an older audioclf's), the
    record a `search build --model` gave the index; None when neither is known."""
    if collection.made_by:
        return collection.made_by
    return None if index is None else index.info.get("model")


def record_for(model: LoadedEmbedder, collection: Collection) -> tuple[dict[str, Any], str | None]:
    """(the record a `search build --model` index keeps, a warning line or None): the
    collection's own record (made_by) when it has one, `model` checked against it as a query
    model is; else model_record of `model`, given as the one that made the embeddings. A
    ValueError when it makes embeddings of another dimension or from other features."""
    warning = _check_against(model, collection.dim, made_by(collection), collection)
    return collection.made_by or model_record(model), warning


def check_model(index: SearchIndex, model: LoadedEmbedder, collection: Collection) -> str | None:
    """ValueError when `model` cannot make embeddings comparable with the index's (another
    dimension or other features than the recorded model's: made_by); a warning line when the
    recorded model's BatchNorm statistics differ (another --adapt, or none) or it is another
    file (e.g. the checkpoint of this export: fine if so); else None."""
    return _check_against(model, index.dim, made_by(collection, index), collection)


def _check_against(
    model: LoadedEmbedder, dim: int, recorded: dict[str, Any] | None, collection: Collection
) -> str | None:
    """check_model against `recorded` (made_by) and embeddings of dimension `dim`."""
    made = f" (made by {recorded['path']}, {recorded['description']})" if recorded else ""
    mine = model_record(model)
    if mine["dim"] is not None and mine["dim"] != dim:
        raise ValueError(
            f"--model {model.path} ({model.description}) makes {mine['dim']}-d embeddings but "
            f"{collection.npy} holds {dim}-d ones{made}; pass the model that embedded "
            f"{collection.prefix}"
        )
    if not recorded:
        return None
    if mine["features"] != recorded["features"] or mine["input_kind"] != recorded["input_kind"]:
        raise ValueError(
            f"--model {model.path} reads audio with other features than the model that embedded "
            f"{collection.prefix}{made}; pass that model, or embed the collection again with "
            "this one"
        )
    if _statistics(mine.get("adaptation")) != _statistics(recorded.get("adaptation")):
        return (
            f"warning: {collection.prefix} was embedded by {recorded['path']} "
            f"({recorded['description']}) and --model {model.path} is {model.description}: "
            "their BatchNorm statistics differ (--adapt), so the queries and the rows come from "
            "two networks; query with the model that embedded it (export --adapt DIR writes an "
            "adapted model)"
        )
    if [mine[key] for key in ("path", "bytes", "mtime_ns")] != [
        recorded[key] for key in ("path", "bytes", "mtime_ns")
    ]:
        return (
            f"warning: {collection.prefix} was embedded by {recorded['path']} "
            f"({recorded['description']}), not by --model {model.path}: the neighbours mean "
            "something only if both are the same trained model (e.g. a checkpoint and its export)"
        )
    return None


def _statistics(adaptation: dict | None) -> str | None:
    """Which adaptation made embeddings (its statistics digest); None: the model's own."""
    return None if not adaptation else adaptation.get("statistics")
