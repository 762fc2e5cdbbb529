"""Retrieval inside one set: every sample queries all the others (P@1, MAP@R, R-precision),
leave-one-out or cross-item."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from audioclf.metrics.checks import check_chunk_size, check_embeddings, resolve_device

RETRIEVAL_KEYS = ("precision_at_1", "map_at_r", "r_precision")
# Similarity entries computed per retrieval step (a [chunk, N] float32 buffer: 512 MiB).
_SIMILARITY_BUDGET = 2**27


def item_groups(items, n_samples: int, class_index: np.ndarray) -> np.ndarray:
    """One int64 code per (class, item) pair: the same item id under two classes is two items."""
    array = items.detach().cpu().numpy() if isinstance(items, torch.Tensor) else np.asarray(items)
    problem = None
    if array.ndim != 1 or len(array) != n_samples:
        problem = f"got shape {array.shape}"
    else:
        try:
            _, item_index = np.unique(array, return_inverse=True)
        except TypeError:  # e.g. an object array mixing str and None
            problem = f"got values of mixed types that cannot be sorted ({array.dtype})"
    if problem:
        raise ValueError(
            f"items must be 1-D with one sortable item id (int or str) per embedding row "
            f"({n_samples} rows), {problem}; pass e.g. the index's a_item column, or items=None "
            f"for leave-one-out retrieval"
        )
    pairs = np.stack([class_index, item_index.reshape(-1)], axis=1)
    return np.unique(pairs, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)


def retrieval_metrics(
    embeddings,
    labels,
    *,
    items=None,
    chunk_size: int | None = None,
    device=None,
    return_per_sample: bool = False,
) -> dict:
    """Retrieval inside one set: every sample queries all the others (or all other items).

    Follows pytorch-metric-learning 2.9 ``AccuracyCalculator`` with query = reference
    (``ref_includes_query=True``), and returns the same numbers:

    - a query never retrieves itself;
    - R for a query is the number of *other* samples of its class (class count - 1);
    - a query whose class has a single sample has no relevant item, so it is left out of all
      three averages (PML's "lone query"); if every class is a singleton the metrics are NaN;
    - ``precision_at_1``: fraction of queries whose nearest neighbour has the same label;
    - ``r_precision``: mean over queries of (same-label items among the top R) / R;
    - ``map_at_r``: mean over queries of (1/R) * sum over ranks i <= R that hold a same-label
      item of precision@i.

    Cross-item retrieval, with ``items`` (one item id per row, e.g. the recording a clip was
    cut from; an item belongs to its class, so the same id under two classes is two items):

    - a query never retrieves a sample of its own item (itself included): those samples are
      removed from its ranking, so they are neither hits nor misses;
    - R is the number of samples of the query's class in *other* items;
    - a query whose class has no other item is left out of all three averages and counted in
      ``"n_queries_without_other_item"``.

    This measures whether the embedding finds the class in another recording, not the
    recording itself (clips of one item share speaker, channel, room ...).

    Similarities are computed ``chunk_size`` query rows at a time against all N samples into
    one reused ``[chunk_size, N]`` buffer (plus a ``[chunk_size, N]`` boolean own-item mask
    with ``items``), keeping only each row's top k = (largest R) neighbours, so memory is
    O(chunk_size * N), never N x N. The default chunk keeps the buffer near 512 MiB (2,048 rows
    up to N = 65k; 335 rows at N = 400k).

    Returns ``{"precision_at_1", "map_at_r", "r_precision"}`` (floats in [0, 1]) and
    ``"n_queries"`` (queries that entered the averages); with ``items`` also
    ``"n_queries_without_other_item"``. With ``return_per_sample=True`` also
    ``"per_sample_correct_at_1"``: np.bool_ [N], whether each sample's nearest retrievable
    sample has its label (always False for a query left out of the averages).
    """
    if chunk_size is None:
        chunk_size = max(64, min(2048, _SIMILARITY_BUDGET // max(len(labels), 1)))
    check_chunk_size(chunk_size)
    emb, lab = check_embeddings(embeddings, labels)
    class_index, item_group, relevant_per_query = _relevant_counts(lab, items)
    correct_at_1, average_precision, r_precision = _per_query_scores(
        emb, class_index, relevant_per_query, item_group, chunk_size, device
    )
    has_relevant = relevant_per_query > 0
    n_queries = int(has_relevant.sum())

    def mean_over_queries(values: np.ndarray) -> float:
        return float(values[has_relevant].mean()) if n_queries else float("nan")

    result = {
        "precision_at_1": mean_over_queries(correct_at_1.astype(np.float64)),
        "map_at_r": mean_over_queries(average_precision),
        "r_precision": mean_over_queries(r_precision),
        "n_queries": n_queries,
    }
    if items is not None:
        result["n_queries_without_other_item"] = len(lab) - n_queries
    if return_per_sample:
        result["per_sample_correct_at_1"] = correct_at_1
    return result


def _relevant_counts(lab: np.ndarray, items) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(class index per sample, (class, item) group per sample or None, R per query): R is the
    number of other samples of the query's class, or of its class in other items."""
    _, class_index, class_counts = np.unique(lab, return_inverse=True, return_counts=True)
    if items is None:
        return class_index, None, class_counts[class_index] - 1  # 0 for a singleton class
    item_group = item_groups(items, len(lab), class_index)
    return class_index, item_group, class_counts[class_index] - np.bincount(item_group)[item_group]


def _per_query_scores(
    emb: torch.Tensor,
    class_index: np.ndarray,
    relevant_per_query: np.ndarray,
    item_group: np.ndarray | None,
    chunk_size: int,
    device,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(correct at 1, average precision at R, R-precision) of every query; zeros for a query
    without a relevant sample (the device is only used when some query has one)."""
    n_samples = len(class_index)
    correct_at_1 = np.zeros(n_samples, dtype=np.bool_)
    average_precision = np.zeros(n_samples, dtype=np.float64)
    r_precision = np.zeros(n_samples, dtype=np.float64)
    if (relevant_per_query > 0).any():
        _score_queries(
            emb,
            class_index,
            relevant_per_query,
            item_group,
            chunk_size,
            resolve_device(device),
            correct_at_1,
            average_precision,
            r_precision,
        )
    return correct_at_1, average_precision, r_precision


def _score_queries(
    emb: torch.Tensor,
    class_index: np.ndarray,
    relevant_per_query: np.ndarray,
    item_group: np.ndarray | None,
    chunk_size: int,
    dev: torch.device,
    correct_at_1: np.ndarray,
    average_precision: np.ndarray,
    r_precision: np.ndarray,
) -> None:
    """Fill the three per-query arrays, `chunk_size` queries at a time (see retrieval_metrics)."""
    n_samples = len(class_index)
    # Every query has at least R candidates that are not excluded (its class's other
    # samples), so its first R ranks never reach a -inf entry; ranks past R are not scored.
    k = int(relevant_per_query.max())
    normed = F.normalize(emb.to(dev), p=2, dim=1)
    normed_t = normed.T.contiguous()
    class_t = torch.from_numpy(class_index).to(dev)
    relevant_t = torch.from_numpy(relevant_per_query).to(dev)
    ranks = torch.arange(1, k + 1, device=dev)
    # One buffer reused for every chunk: a fresh [chunk, N] tensor per chunk spends more
    # time in page faults than in the matmul at N = 100k.
    buffer = torch.empty(min(chunk_size, n_samples), n_samples, device=dev)
    if item_group is not None:
        group_t = torch.from_numpy(item_group).to(dev)
        own_item_buffer = torch.empty(len(buffer), n_samples, dtype=torch.bool, device=dev)
    for start in range(0, n_samples, chunk_size):
        stop = min(start + chunk_size, n_samples)
        sim = buffer[: stop - start]
        torch.mm(normed[start:stop], normed_t, out=sim)
        if item_group is None:
            rows = torch.arange(stop - start, device=dev)
            sim[rows, rows + start] = -torch.inf  # leave the query itself out
        else:  # leave the query's whole item out (the query included)
            own_item = own_item_buffer[: stop - start]
            torch.eq(group_t[start:stop, None], group_t[None, :], out=own_item)
            sim.masked_fill_(own_item, -torch.inf)
        neighbours = torch.topk(sim, k, dim=1, sorted=True).indices
        is_match = class_t[neighbours] == class_t[start:stop, None]
        relevant = relevant_t[start:stop, None]
        hit = is_match & (ranks[None, :] <= relevant)
        hits_so_far = hit.cumsum(dim=1)
        precision_at_hits = (hits_so_far * hit).to(torch.float64) / ranks
        denom = relevant.clamp(min=1).to(torch.float64).squeeze(1)
        average_precision[start:stop] = (precision_at_hits.sum(dim=1) / denom).cpu().numpy()
        r_precision[start:stop] = (hit.sum(dim=1).to(torch.float64) / denom).cpu().numpy()
        correct_at_1[start:stop] = is_match[:, 0].cpu().numpy()


def retrieval_summary(embeddings, labels, items=None, *, device=None) -> dict[str, float]:
    """P@1, MAP@R and R-precision as plain floats: cross-item when `items` are given and some
    query has a positive of another item, else leave-one-out ({} with fewer than 2 samples).

    Also `n_queries`, and with items `cross_item` (1.0 when the figures are cross-item).
    """
    if len(labels) < 2:
        return {}
    result = (
        retrieval_metrics(embeddings, labels, items=items, device=device)
        if items is not None
        else None
    )
    cross_item = result is not None and result["n_queries"] > 0
    if not cross_item:
        result = retrieval_metrics(embeddings, labels, device=device)
    summary = {k: float(result[k]) for k in RETRIEVAL_KEYS}
    summary["n_queries"] = float(result["n_queries"])
    if items is not None:
        summary["cross_item"] = float(cross_item)
    return summary
