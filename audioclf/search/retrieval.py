"""Retrieval metrics (P@1, MAP@R, R-precision) from the k-nearest-neighbour lists of an index.

The definitions and numbers are those of audioclf.metrics.retrieval_metrics (equal, up to
float ties, with an exact index), but each query is ranked only as deep as it is scored:
its R relevant samples plus the samples of its own item, which the list skips. With an
approximate index that avoids the full N x N scan that makes 400k-sample evaluation take
24 minutes on two cores; the recall of its neighbours against exact search is measured on a
sample of queries so a report can state it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from audioclf.metrics import check_embeddings, item_groups
from audioclf.search.base import SearchIndex, check_positive
from audioclf.search.exact import ExactIndex

# Most queries ranked per step, and most neighbour-list entries per step (about 100 MiB of
# ids, scores and flags), so memory stays bounded however deep the lists are.
_QUERY_CHUNK = 4096
_LIST_BUDGET = 2**22


def neighbour_recall(
    found_ids: np.ndarray, true_ids: np.ndarray, lengths: np.ndarray | None = None
) -> float:
    """Mean over queries of the fraction of each query's first L true neighbours found among
    its first L returned ones (L = `lengths[q]`, default every column); id -1 is padding.

    Rows whose first L true entries are all padding are left out; NaN if every row is.
    """
    found_ids, true_ids = np.asarray(found_ids), np.asarray(true_ids)
    if found_ids.shape != true_ids.shape or found_ids.ndim != 2:
        raise ValueError(
            f"found_ids {found_ids.shape} and true_ids {true_ids.shape} must be 2-D of one shape"
        )
    n_rows, width = true_ids.shape
    if lengths is not None and np.shape(lengths) != (n_rows,):
        raise ValueError(
            f"lengths must hold one depth per row ({n_rows}), got shape {np.shape(lengths)}"
        )
    if true_ids.size == 0:
        return float("nan")
    depth = np.full(n_rows, width) if lengths is None else np.minimum(np.asarray(lengths), width)
    in_depth = np.arange(width)[None, :] < depth[:, None]
    row = np.broadcast_to(np.arange(n_rows)[:, None], true_ids.shape)
    true_mask = in_depth & (true_ids >= 0)
    found_mask = in_depth & (found_ids >= 0)
    # (row, id) pairs as single keys, so one isin call intersects every row at once.
    stride = int(max(true_ids.max(), found_ids.max())) + 2
    true_keys = row[true_mask] * stride + true_ids[true_mask]
    found_keys = row[found_mask] * stride + found_ids[found_mask]
    hits = np.bincount(row[true_mask][np.isin(true_keys, found_keys)], minlength=n_rows)
    wanted = true_mask.sum(axis=1)
    scored = wanted > 0
    return float((hits[scored] / wanted[scored]).mean()) if scored.any() else float("nan")


def _neighbour_lists(
    index: SearchIndex,
    emb: torch.Tensor,
    queries: np.ndarray,
    relevant: np.ndarray,
    groups: np.ndarray,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(query rows, neighbour ids [B, largest R in the chunk]) chunk by chunk, own item
    excluded. `queries` must be sorted by R so a chunk's depth stays near its queries' R."""
    start = 0
    while start < len(queries):
        window_end = min(start + _QUERY_CHUNK, len(queries))
        step = max(
            1, min(window_end - start, _LIST_BUDGET // int(relevant[queries[window_end - 1]]))
        )
        chunk = queries[start : start + step]
        k = int(relevant[chunk].max())
        _, ids = index.search(
            emb[torch.from_numpy(chunk)], k, query_groups=groups[chunk], index_groups=groups
        )
        yield chunk, ids
        start += step


def _score_lists(
    ids: np.ndarray,
    queries: np.ndarray,
    class_index: np.ndarray,
    relevant: np.ndarray,
    width: int,
):
    """Per query: correct at 1, average precision at R, R-precision.

    Scored as retrieval_metrics scores them, in torch float64 over lists `width` (its k, the
    largest R) wide, so an exact index gives its figures to the last bit: a sum of the same
    terms grouped otherwise (numpy, or a narrower row) can differ by an ulp. Rows go in slices
    of at most _LIST_BUDGET entries, so memory stays bounded however wide the lists are.
    """
    r = relevant[queries]
    is_match = (ids >= 0) & (class_index[np.maximum(ids, 0)] == class_index[queries][:, None])
    correct = is_match[:, 0]
    average_precision = np.empty(len(queries))
    r_precision = np.empty(len(queries))
    ranks = torch.arange(1, width + 1)
    depth = ids.shape[1]
    rows = max(1, _LIST_BUDGET // width)
    for start in range(0, len(queries), rows):
        stop = min(start + rows, len(queries))
        hit = torch.zeros(stop - start, width, dtype=torch.bool)
        hit[:, :depth] = torch.from_numpy(is_match[start:stop])
        relevant_t = torch.from_numpy(r[start:stop])[:, None]
        hit &= ranks[None, :] <= relevant_t
        precision_at_hits = (hit.cumsum(dim=1) * hit).to(torch.float64) / ranks
        denom = relevant_t.clamp(min=1).to(torch.float64).squeeze(1)
        average_precision[start:stop] = (precision_at_hits.sum(dim=1) / denom).numpy()
        r_precision[start:stop] = (hit.sum(dim=1).to(torch.float64) / denom).numpy()
    return correct, average_precision, r_precision


def _score_queries(index, emb, scored, class_index, groups, relevant, progress: bool):
    """(correct at 1, average precision, R-precision) per sample, zero where it did not query."""
    width = max(1, int(relevant.max()))  # retrieval_metrics' k: every list is scored this wide
    correct = np.zeros(len(relevant), dtype=np.bool_)
    average_precision = np.zeros(len(relevant))
    r_precision = np.zeros(len(relevant))
    with tqdm(
        total=len(scored), unit="query", desc=f"retrieval {index.method}", disable=not progress
    ) as bar:
        for chunk, ids in _neighbour_lists(index, emb, scored, relevant, groups):
            correct[chunk], average_precision[chunk], r_precision[chunk] = _score_lists(
                ids, chunk, class_index, relevant, width
            )
            bar.update(len(chunk))
    return correct, average_precision, r_precision


def _sampled_recall(
    index, emb, scored, relevant, groups, n_sample: int, seed: int, device
) -> tuple[float, int]:
    """Recall of the index's first-R neighbour lists against exact search on a seeded sample."""
    sample = np.sort(
        np.random.default_rng(seed).choice(scored, size=min(n_sample, len(scored)), replace=False)
    )
    sample = sample[np.argsort(relevant[sample], kind="stable")]
    exact = ExactIndex(emb, device=device)
    recalls, weights = [], []
    for (chunk, found), (_, truth) in zip(
        _neighbour_lists(index, emb, sample, relevant, groups),
        _neighbour_lists(exact, emb, sample, relevant, groups),
    ):
        recalls.append(neighbour_recall(found, truth, relevant[chunk]))
        weights.append(len(chunk))
    return float(np.average(recalls, weights=weights)), len(sample)


def _relevance(labels: np.ndarray, items: Any):
    """Per sample: class code, group code (its item, or itself for leave-one-out), how many
    samples share its group (skipped in its list) and R (same-class samples outside it)."""
    _, class_index, class_counts = np.unique(labels, return_inverse=True, return_counts=True)
    if items is None:
        groups = np.arange(len(labels))
    else:
        groups = item_groups(items, len(labels), class_index)
    own_group = np.bincount(groups)[groups]
    return class_index, groups, own_group, class_counts[class_index] - own_group


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


def knn_retrieval_metrics(
    embeddings: Any,
    labels: Any,
    *,
    items: Any = None,
    index: SearchIndex | None = None,
    query_rows: Any = None,
    device: str | torch.device | None = None,
    recall_queries: int = 1000,
    seed: int = 0,
    progress: bool = False,
    return_per_sample: bool = False,
) -> dict[str, Any]:
    """retrieval_metrics' P@1, MAP@R and R-precision, from `index`'s neighbour lists.

    Every sample (or each of `query_rows`) queries `index`, which must hold `embeddings`
    (default: an exact index on `device`). Leave-one-out without `items`; with `items`,
    cross-item: a query never retrieves its own item, R = samples of its class in other items,
    queries whose class has no other item are left out (see audioclf.metrics.retrieval_metrics).
    Each query's list is R deep after dropping its own item (k = R + own-item samples).

    Returns "precision_at_1", "map_at_r", "r_precision", "n_queries" (and with items
    "n_queries_without_other_item"), "method" and "k" (the deepest list searched). For an
    approximate index also "neighbour_recall": the mean fraction of each query's R exact
    neighbours that its list holds, on `recall_queries` seeded queries ("recall_queries").
    With ``return_per_sample=True`` also "per_sample_correct_at_1", as retrieval_metrics
    (False for a sample that did not query).

    With an exact index on the CPU the figures equal retrieval_metrics' to the last bit, but
    for rows of exactly equal score (duplicate clips), which torch.topk may order otherwise.
    """
    check_positive(recall_queries, "recall_queries")
    emb, lab = check_embeddings(embeddings, labels)
    index = ExactIndex(emb, device=device) if index is None else index
    if (index.size, index.dim) != tuple(emb.shape):
        raise ValueError(
            f"embeddings are {tuple(emb.shape)} but the index {index.describe()} holds other "
            f"rows; build it from these embeddings"
        )
    class_index, groups, own_group, relevant = _relevance(lab, items)
    rows = _query_selection(query_rows, len(lab))
    scored = rows[relevant[rows] > 0]
    scored = scored[np.argsort(relevant[scored], kind="stable")]
    correct, average_precision, r_precision = _score_queries(
        index, emb, scored, class_index, groups, relevant, progress
    )
    # Averaged in row order, as retrieval_metrics does, so an exact index gives its figures
    # to the last bit (the sum of the same values in another order can differ by an ulp).
    in_row_order = np.sort(scored)

    def mean_over_queries(values: np.ndarray) -> float:
        return float(values[in_row_order].mean()) if len(scored) else float("nan")

    result: dict[str, Any] = {
        "precision_at_1": mean_over_queries(correct.astype(np.float64)),
        "map_at_r": mean_over_queries(average_precision),
        "r_precision": mean_over_queries(r_precision),
        "n_queries": len(scored),
        "method": index.method,
        "k": int((relevant[scored] + own_group[scored]).max()) if len(scored) else 0,
    }
    if items is not None:
        result["n_queries_without_other_item"] = len(rows) - len(scored)
    if return_per_sample:
        result["per_sample_correct_at_1"] = correct
    if index.method != "exact" and len(scored):
        result["neighbour_recall"], result["recall_queries"] = _sampled_recall(
            index, emb, scored, relevant, groups, recall_queries, seed, device
        )
    return result
