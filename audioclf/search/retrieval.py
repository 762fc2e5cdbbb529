"""How far an index's neighbour lists are from exact search: `neighbour_recall` of any two
lists, and `sampled_neighbour_recall`, the recall of the lists audioclf.metrics.retrieval_metrics
scores, measured on a seeded sample of queries so a report can state it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from audioclf.metrics import (
    ExactSearch,
    NeighbourIndex,
    check_embeddings,
    neighbour_lists,
    relevance,
)
from audioclf.search.base import check_positive


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


def sampled_neighbour_recall(
    index: NeighbourIndex,
    embeddings: Any,
    labels: Any,
    *,
    items: Any = None,
    queries: int = 1000,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> tuple[float, int]:
    """(recall, queries sampled): the mean fraction of each query's R exact neighbours outside
    its own item (leave-one-out without `items`) that `index`'s list holds, as
    retrieval_metrics asks `index` for them, on `queries` seeded queries that have a relevant
    sample; the exact lists come from ExactSearch on `device`. (NaN, 0) without such queries.
    """
    check_positive(queries, "queries")
    emb, lab = check_embeddings(embeddings, labels)
    rel = relevance(lab, items)
    scored = rel.queries()
    if not len(scored):
        return float("nan"), 0
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(scored, size=min(queries, len(scored)), replace=False))
    sample = sample[np.argsort(rel.relevant[sample], kind="stable")]
    exact = ExactSearch(emb, device=device)
    recalls, weights = [], []
    for (chunk, found), (_, truth) in zip(
        neighbour_lists(index, emb, sample, rel), neighbour_lists(exact, emb, sample, rel)
    ):
        recalls.append(neighbour_recall(found, truth, rel.relevant[chunk]))
        weights.append(len(chunk))
    return float(np.average(recalls, weights=weights)), len(sample)
