"""Retrieval inside one set (P@1, MAP@R, R-precision), leave-one-out or cross-item, scored
from the neighbour lists of the index handed in (as PML's ``AccuracyCalculator(knn_func=)``),
so validation and evaluate score with one implementation whichever index ranks:

    retrieval_metrics(emb, labels, items=items)               # exact torch search (ExactSearch)
    retrieval_metrics(emb, labels, items=items, index=index)  # e.g. an audioclf.search index
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from audioclf.metrics.checks import check_chunk_size, check_embeddings
from audioclf.metrics.neighbours import LIST_BUDGET, ExactSearch, NeighbourIndex
from audioclf.precision import exact_arithmetic

RETRIEVAL_KEYS = ("precision_at_1", "map_at_r", "r_precision")
# Most queries ranked per step (their lists: at most LIST_BUDGET entries a step).
_QUERY_CHUNK = 4096


class Relevance(NamedTuple):
    """Per sample: class code, group code (its item, or itself for leave-one-out: what it never
    retrieves), how many samples share its group, and R (same-class samples outside it)."""

    classes: np.ndarray
    groups: np.ndarray
    own_group: np.ndarray
    relevant: np.ndarray

    def queries(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The rows (default all) that have a relevant sample, sorted by R (stable), so a
        chunk of neighbour lists is about as deep as its queries' R."""
        rows = np.arange(len(self.relevant)) if rows is None else rows
        scored = rows[self.relevant[rows] > 0]
        return scored[np.argsort(self.relevant[scored], kind="stable")]

    def depth(self) -> int:
        """The deepest list an index is asked for (R plus the query's own group); 0 if none."""
        scored = self.relevant > 0
        return int((self.relevant + self.own_group)[scored].max()) if scored.any() else 0


def relevance(labels: np.ndarray, items: Any = None) -> Relevance:
    """Relevance of int labels [N]: leave-one-out without `items`, else cross-item, where one
    (class, item) pair is one group: the same item id under two classes is two items."""
    _, classes, class_counts = np.unique(labels, return_inverse=True, return_counts=True)
    groups = np.arange(len(labels))
    if items is not None:
        array = items.cpu().numpy() if isinstance(items, torch.Tensor) else np.asarray(items)
        problem = f"got shape {array.shape}" if array.shape != labels.shape else None
        try:
            item_index = np.unique(array, return_inverse=True)[1].reshape(-1)
        except TypeError:  # e.g. an object array mixing str and None
            problem = f"got values of mixed types that cannot be sorted ({array.dtype})"
        if problem:
            raise ValueError(
                f"items must be 1-D with one sortable item id (int or str) per embedding row "
                f"({len(labels)} rows), {problem}; pass e.g. the index's a_item column, or "
                "items=None for leave-one-out retrieval"
            )
        pairs = np.stack([classes, item_index], axis=1)
        groups = np.unique(pairs, axis=0, return_inverse=True)[1].reshape(-1)
    own_group = np.bincount(groups)[groups]
    return Relevance(classes, groups, own_group, class_counts[classes] - own_group)


def neighbour_lists(
    index: NeighbourIndex, emb: torch.Tensor, queries: np.ndarray, rel: Relevance
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(query rows, neighbour ids [B, largest R in the chunk]) chunk by chunk, own group
    excluded. `queries` must be sorted by R (Relevance.queries)."""
    start = 0
    while start < len(queries):
        window_end = min(start + _QUERY_CHUNK, len(queries))
        deepest = int(rel.relevant[queries[window_end - 1]])
        step = max(1, min(window_end - start, LIST_BUDGET // deepest))
        chunk = queries[start : start + step]
        _, ids = index.search(
            emb[torch.from_numpy(chunk)],
            int(rel.relevant[chunk].max()),
            query_groups=rel.groups[chunk],
            index_groups=rel.groups,
        )
        yield chunk, ids
        start += step


def retrieval_metrics(
    embeddings,
    labels,
    *,
    items=None,
    index: NeighbourIndex | None = None,
    query_rows=None,
    chunk_size: int | None = None,
    device=None,
    progress: bool = False,
    return_per_sample: bool = False,
) -> dict:
    """Every sample (or each of `query_rows`) queries all the others, ranked by `index`, which
    must hold `embeddings` (default: ExactSearch on `device`, `chunk_size` queries a block),
    searched in IEEE fp32 whatever the process's TF32 flags (precision.exact_arithmetic).

    The numbers of pytorch-metric-learning 2.9 ``AccuracyCalculator`` with query = reference
    (``ref_includes_query=True``): a query never retrieves itself; R is the number of other
    samples of its class; a query with R = 0 (PML's "lone query") is left out of the averages
    (NaN if every query is); ``precision_at_1``: the share of queries whose nearest neighbour
    has their label; ``r_precision``: mean of (same-label among the top R) / R; ``map_at_r``:
    mean of (1/R) * the sum of precision@i over the ranks i <= R that hold a same-label sample.

    Cross-item, with ``items`` (one item id per row, e.g. the recording a clip was cut from;
    the same id under two classes is two items): a query never retrieves a sample of its own
    item, R counts its class's samples in other items, and a query whose class has no other
    item is left out and counted in ``"n_queries_without_other_item"``. It measures whether
    the embedding finds the class in another recording, not the recording itself.

    Returns floats ``"precision_at_1"``, ``"map_at_r"``, ``"r_precision"`` and ``"n_queries"``
    (queries averaged); with ``items`` also ``"n_queries_without_other_item"``; with
    ``return_per_sample=True`` also ``"per_sample_correct_at_1"``, np.bool_ [N] (False for a
    sample left out).
    """
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    emb, lab = check_embeddings(embeddings, labels)
    if index is None:
        index = ExactSearch(emb, chunk_size=chunk_size, device=device)
    elif (index.size, index.dim) != tuple(emb.shape):
        raise ValueError(
            f"embeddings are {tuple(emb.shape)} but the index holds {index.size} rows x "
            f"{index.dim}; build it from these embeddings"
        )
    rel = relevance(lab, items)
    rows = _query_selection(query_rows, len(lab))
    scored = rel.queries(rows)
    # IEEE fp32 similarities whatever a training in this process left on (TF32): validation's
    # figures, which pick best.pt, are evaluate's.
    with exact_arithmetic():
        correct, average_precision, r_precision = _score_queries(index, emb, scored, rel, progress)
    # Averaged in row order, so the figures do not depend on the order queries were ranked in
    # (the sum of the same values in another order can differ by an ulp).
    in_row_order = np.sort(scored)
    per_query = (correct.astype(np.float64), average_precision, r_precision)
    result: dict = {
        key: float(values[in_row_order].mean()) if len(scored) else float("nan")
        for key, values in zip(RETRIEVAL_KEYS, per_query, strict=True)
    }
    result["n_queries"] = len(scored)
    if items is not None:
        result["n_queries_without_other_item"] = len(rows) - len(scored)
    if return_per_sample:
        result["per_sample_correct_at_1"] = correct
    return result


def _query_selection(query_rows: Any, n_samples: int) -> np.ndarray:
    if query_rows is None:
        return np.arange(n_samples)
    rows = np.unique(np.asarray(query_rows))
    if (
        rows.ndim != 1
        or not np.issubdtype(rows.dtype, np.integer)
        or (rows.size and (rows[0] < 0 or rows[-1] >= n_samples))
    ):
        raise ValueError(
            f"query_rows must be 1-D integer row numbers in [0, {n_samples}), got {rows.dtype} {rows.shape}"
        )
    return rows


def _score_queries(index, emb, scored, rel: Relevance, progress: bool):
    """(correct at 1, average precision at R, R-precision) per sample, zero where it did not
    query; in torch float64 over rows as wide as the largest R of the set (a sum of the same
    terms grouped otherwise can differ by an ulp), at most LIST_BUDGET entries a slice."""
    width = max(1, int(rel.relevant.max()))
    correct = np.zeros(len(rel.relevant), dtype=np.bool_)
    average_precision, r_precision = np.zeros(len(rel.relevant)), np.zeros(len(rel.relevant))
    ranks, rows = torch.arange(1, width + 1), max(1, LIST_BUDGET // width)
    with tqdm(total=len(scored), unit="query", desc="retrieval", disable=not progress) as bar:
        for chunk, ids in neighbour_lists(index, emb, scored, rel):
            is_match = (ids >= 0) & (rel.classes[np.maximum(ids, 0)] == rel.classes[chunk][:, None])
            correct[chunk] = is_match[:, 0]
            for start in range(0, len(chunk), rows):
                part = chunk[start : start + rows]
                hit = torch.zeros(len(part), width, dtype=torch.bool)
                hit[:, : ids.shape[1]] = torch.from_numpy(is_match[start : start + rows])
                relevant_t = torch.from_numpy(rel.relevant[part])[:, None]
                hit &= ranks[None, :] <= relevant_t
                precision_at_hits = (hit.cumsum(dim=1) * hit).to(torch.float64) / ranks
                denom = relevant_t.clamp(min=1).to(torch.float64).squeeze(1)
                average_precision[part] = (precision_at_hits.sum(dim=1) / denom).numpy()
                r_precision[part] = (hit.sum(dim=1).to(torch.float64) / denom).numpy()
            bar.update(len(chunk))
    return correct, average_precision, r_precision


def retrieval_summary(embeddings, labels, items=None, *, device=None) -> dict[str, float]:
    """P@1, MAP@R, R-precision and `n_queries` as floats: cross-item when `items` are given and
    some query has a positive of another item (then `cross_item` is 1.0), else leave-one-out;
    {} with fewer than 2 samples."""
    if len(labels) < 2:
        return {}
    result = (
        None if items is None else retrieval_metrics(embeddings, labels, items=items, device=device)
    )
    cross_item = result is not None and result["n_queries"] > 0
    if not cross_item:
        result = retrieval_metrics(embeddings, labels, device=device)
    summary = {k: float(result[k]) for k in (*RETRIEVAL_KEYS, "n_queries")}
    if items is not None:
        summary["cross_item"] = float(cross_item)
    return summary
