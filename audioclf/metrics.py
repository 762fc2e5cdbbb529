"""Embedding evaluation metrics, shared by the training loop and the offline evaluator.

Every function takes float embeddings ``[N, D]`` (numpy or torch) and integer labels ``[N]``
and scores them by cosine similarity: embeddings are L2-normalised here, whatever the model
did. Nothing in this module talks to ``torch.distributed``; callers gather first.

- ``retrieval_metrics``: leave-one-out retrieval inside one set (P@1, MAP@R, R-precision),
  equal to pytorch-metric-learning's ``AccuracyCalculator`` with query = reference; with
  ``items``, cross-item retrieval (a query never retrieves its own item).
- ``knn_accuracy`` / ``centroid_accuracy``: classify queries against a labelled gallery;
  ``class_centroids``: the per-class centroids the latter uses.
- ``verification_metrics``: same/different pairs scored by cosine similarity (EER, minDCF).
- ``clustering_metrics``: k-means with one cluster per class (NMI, AMI).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_mutual_info_score, normalized_mutual_info_score, roc_curve

# Number of k-means restarts; fixed so that clustering scores are comparable between runs.
KMEANS_N_INIT = 3
# Pairs scored per step in verification_metrics (bounds the gathered [pairs, D] copies).
_PAIR_CHUNK = 65536


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------


def _as_embedding_tensor(embeddings, name: str) -> torch.Tensor:
    """A 2-D float32 CPU tensor (float32 is what PML compares in, so ties break alike)."""
    if isinstance(embeddings, torch.Tensor):
        tensor = embeddings.detach().to("cpu", torch.float32)
    else:
        tensor = torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32))
    if tensor.ndim != 2:
        raise ValueError(f"{name} must be 2-D [N, D], got shape {tuple(tensor.shape)}")
    return tensor.contiguous()


def _as_label_array(labels, name: str) -> np.ndarray:
    array = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {array.shape}")
    if array.size and not (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_):
        raise ValueError(f"{name} must be integer class ids, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.int64)  # torch.from_numpy rejects negative strides


def check_embeddings(
    embeddings, labels, *, emb_name: str = "embeddings", label_name: str = "labels", min_samples: int = 2
) -> tuple[torch.Tensor, np.ndarray]:
    """Validated (float32 CPU tensor [N, D], int64 array [N]); one clear ValueError otherwise."""
    emb = _as_embedding_tensor(embeddings, emb_name)
    lab = _as_label_array(labels, label_name)
    if emb.shape[0] != lab.shape[0]:
        raise ValueError(
            f"{emb_name} has shape {tuple(emb.shape)} but {label_name} has shape {lab.shape}; "
            f"they need one label per embedding row"
        )
    if emb.shape[0] < min_samples:
        raise ValueError(f"{emb_name} has {emb.shape[0]} samples; at least {min_samples} are needed")
    bad_rows = (~torch.isfinite(emb)).any(dim=1).nonzero().flatten()
    if len(bad_rows):
        first = bad_rows[:5].tolist()
        raise ValueError(
            f"{emb_name} has non-finite values (NaN/inf) in {len(bad_rows)} of {emb.shape[0]} rows "
            f"(first rows: {first}); check the model output for these inputs"
        )
    return emb, lab


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")


def _resolve_device(device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


# --------------------------------------------------------------------------------------------
# Retrieval
# --------------------------------------------------------------------------------------------


def _item_groups(items, n_samples: int, class_index: np.ndarray) -> np.ndarray:
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


# Similarity entries computed per retrieval step (a [chunk, N] float32 buffer: 512 MiB).
_SIMILARITY_BUDGET = 2**27


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
    _check_chunk_size(chunk_size)
    emb, lab = check_embeddings(embeddings, labels)
    n_samples = len(lab)
    _, class_index, class_counts = np.unique(lab, return_inverse=True, return_counts=True)
    if items is None:
        item_group = None
        relevant_per_query = class_counts[class_index] - 1  # R; 0 for a singleton class
    else:
        item_group = _item_groups(items, n_samples, class_index)
        relevant_per_query = class_counts[class_index] - np.bincount(item_group)[item_group]
    has_relevant = relevant_per_query > 0

    correct_at_1 = np.zeros(n_samples, dtype=np.bool_)
    average_precision = np.zeros(n_samples, dtype=np.float64)
    r_precision = np.zeros(n_samples, dtype=np.float64)

    if has_relevant.any():
        dev = _resolve_device(device)
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
        result["n_queries_without_other_item"] = n_samples - n_queries
    if return_per_sample:
        result["per_sample_correct_at_1"] = correct_at_1
    return result


RETRIEVAL_KEYS = ("precision_at_1", "map_at_r", "r_precision")


def retrieval_summary(embeddings, labels, items=None, *, device=None) -> dict[str, float]:
    """P@1, MAP@R and R-precision as plain floats: cross-item when `items` are given and some
    query has a positive of another item, else leave-one-out ({} with fewer than 2 samples).

    Also `n_queries`, and with items `cross_item` (1.0 when the figures are cross-item).
    """
    if len(labels) < 2:
        return {}
    result = retrieval_metrics(embeddings, labels, items=items, device=device) if items is not None else None
    cross_item = result is not None and result["n_queries"] > 0
    if not cross_item:
        result = retrieval_metrics(embeddings, labels, device=device)
    summary = {k: float(result[k]) for k in RETRIEVAL_KEYS}
    summary["n_queries"] = float(result["n_queries"])
    if items is not None:
        summary["cross_item"] = float(cross_item)
    return summary


# --------------------------------------------------------------------------------------------
# Classification against a gallery
# --------------------------------------------------------------------------------------------


def _check_query_gallery(query, query_labels, gallery, gallery_labels):
    q_emb, q_lab = check_embeddings(query, query_labels, emb_name="query", label_name="query_labels", min_samples=1)
    if len(gallery) == 0 or len(gallery_labels) == 0:
        raise ValueError("gallery is empty; it needs at least one labelled embedding (one class)")
    g_emb, g_lab = check_embeddings(
        gallery, gallery_labels, emb_name="gallery", label_name="gallery_labels", min_samples=1
    )
    if q_emb.shape[1] != g_emb.shape[1]:
        raise ValueError(
            f"query has shape {tuple(q_emb.shape)} but gallery has shape {tuple(g_emb.shape)}; "
            f"the embedding dimensions must match"
        )
    return q_emb, q_lab, g_emb, g_lab


def knn_accuracy(
    query,
    query_labels,
    gallery,
    gallery_labels,
    *,
    k: int = 1,
    chunk_size: int = 2048,
    device=None,
) -> dict:
    """Classify each query by its k nearest gallery embeddings (cosine similarity).

    The prediction is the majority label among the k neighbours; a tie between labels goes to
    the one whose first occurrence is nearest. A query whose label is absent from the gallery
    is allowed and simply counts as wrong.

    Returns ``{"knn_accuracy": float, "predictions": np.ndarray[int64] [n_query]}``.
    """
    _check_chunk_size(chunk_size)
    q_emb, q_lab, g_emb, g_lab = _check_query_gallery(query, query_labels, gallery, gallery_labels)
    if not isinstance(k, int) or not 1 <= k <= len(g_lab):
        raise ValueError(f"k must be an integer in [1, gallery size = {len(g_lab)}], got {k!r}")

    dev = _resolve_device(device)
    q_normed = F.normalize(q_emb.to(dev), p=2, dim=1)
    g_normed_t = F.normalize(g_emb.to(dev), p=2, dim=1).T.contiguous()
    g_labels_t = torch.from_numpy(g_lab).to(dev)
    predictions = np.empty(len(q_lab), dtype=np.int64)
    for start in range(0, len(q_lab), chunk_size):
        stop = min(start + chunk_size, len(q_lab))
        neighbours = torch.topk(q_normed[start:stop] @ g_normed_t, k, dim=1, sorted=True).indices
        neighbour_labels = g_labels_t[neighbours]  # [rows, k], nearest first
        votes = (neighbour_labels[:, :, None] == neighbour_labels[:, None, :]).sum(dim=2)
        # argmax returns the first maximum, i.e. the nearest neighbour among the tied labels.
        winner = (votes == votes.max(dim=1, keepdim=True).values).to(torch.uint8).argmax(dim=1)
        predictions[start:stop] = neighbour_labels.gather(1, winner[:, None]).squeeze(1).cpu().numpy()
    return {"knn_accuracy": float(np.mean(predictions == q_lab)), "predictions": predictions}


def class_centroids(embeddings, labels) -> tuple[np.ndarray, torch.Tensor]:
    """(sorted distinct labels int64 [C], their centroids float32 [C, D], L2-normalised).

    A centroid is the mean of the class's L2-normalised embeddings, renormalised, so every
    member weighs the same whatever its norm. Row i of the centroids belongs to label i.
    """
    emb, lab = check_embeddings(embeddings, labels, min_samples=1)
    classes, class_index = np.unique(lab, return_inverse=True)
    normed = F.normalize(emb, p=2, dim=1)
    sums = torch.zeros(len(classes), emb.shape[1]).index_add_(0, torch.from_numpy(class_index), normed)
    return classes, F.normalize(sums, p=2, dim=1)


def centroid_accuracy(query, query_labels, gallery, gallery_labels) -> dict:
    """Classify each query by the nearest class centroid of the gallery (cosine similarity).

    Centroids come from ``class_centroids``. Ties go to the smallest label. A query label
    absent from the gallery counts as wrong.

    Returns ``{"centroid_accuracy": float, "predictions": np.ndarray[int64] [n_query]}``.
    """
    q_emb, q_lab, g_emb, g_lab = _check_query_gallery(query, query_labels, gallery, gallery_labels)
    classes, centroids = class_centroids(g_emb, g_lab)
    centroids_t = centroids.T.contiguous()
    q_normed = F.normalize(q_emb, p=2, dim=1)
    nearest = np.empty(len(q_lab), dtype=np.int64)
    for start in range(0, len(q_lab), 2048):  # bounds the [queries, classes] block
        nearest[start : start + 2048] = (q_normed[start : start + 2048] @ centroids_t).argmax(dim=1).numpy()
    predictions = classes[nearest]
    return {"centroid_accuracy": float(np.mean(predictions == q_lab)), "predictions": predictions}


# --------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------


def verification_pairs(labels, *, max_pairs: int = 1_000_000, seed: int = 0):
    """The (first, second, is_target) index pairs that ``verification_metrics`` scores.

    If all N*(N-1)/2 pairs i < j fit in ``max_pairs`` they are all used, in ``np.triu_indices``
    order. Otherwise ``max_pairs // 2`` same-class (target) pairs and the rest different-class
    pairs are drawn, each uniformly over its kind and independently (with replacement), from a
    generator seeded with ``seed``; the same labels and seed give the same pairs. Balancing
    keeps target pairs from vanishing among millions of non-target ones; EER and minDCF are
    computed from per-kind error rates, so the balance does not bias them.
    """
    lab = _as_label_array(labels, "labels")
    n_samples = len(lab)
    if not isinstance(max_pairs, int) or max_pairs < 2:
        raise ValueError(f"max_pairs must be an integer >= 2, got {max_pairs!r}")
    _, class_index, class_counts = np.unique(lab, return_inverse=True, return_counts=True)
    n_target_total = int((class_counts * (class_counts - 1) // 2).sum())
    n_all = n_samples * (n_samples - 1) // 2
    if n_target_total == 0 or n_target_total == n_all:
        missing = "same-class" if n_target_total == 0 else "different-class"
        raise ValueError(
            f"verification needs both same-class and different-class pairs, but the labels "
            f"({n_samples} samples, {len(class_counts)} classes) give no {missing} pairs"
        )

    if n_all <= max_pairs:
        first, second = np.triu_indices(n_samples, k=1)
        return first, second, lab[first] == lab[second]

    rng = np.random.default_rng(seed)
    # Samples sorted by class, so each class is one contiguous block of `order`.
    order = np.argsort(class_index, kind="stable")
    block_start = np.concatenate([[0], np.cumsum(class_counts)[:-1]])
    position_in_order = np.empty(n_samples, dtype=np.int64)
    position_in_order[order] = np.arange(n_samples)

    def draw_anchors(weights: np.ndarray, size: int) -> np.ndarray:
        # An anchor drawn with probability proportional to its number of partners, then a
        # uniform partner, gives a uniform draw over ordered (hence unordered) pairs.
        return rng.choice(n_samples, size=size, p=weights / weights.sum())

    n_target = max_pairs // 2
    anchors = draw_anchors((class_counts[class_index] - 1).astype(np.float64), n_target)
    anchor_class = class_index[anchors]
    # A uniform other member of the anchor's class: skip over the anchor's own slot.
    offset = rng.integers(0, class_counts[anchor_class] - 1)
    anchor_offset = position_in_order[anchors] - block_start[anchor_class]
    offset = offset + (offset >= anchor_offset)
    target_partners = order[block_start[anchor_class] + offset]

    n_nontarget = max_pairs - n_target
    others = draw_anchors((n_samples - class_counts[class_index]).astype(np.float64), n_nontarget)
    other_class = class_index[others]
    # A uniform sample outside the anchor's class: skip over the class's block.
    slot = rng.integers(0, n_samples - class_counts[other_class])
    slot = slot + np.where(slot >= block_start[other_class], class_counts[other_class], 0)
    nontarget_partners = order[slot]

    first = np.concatenate([anchors, others])
    second = np.concatenate([target_partners, nontarget_partners])
    is_target = np.concatenate([np.ones(n_target, dtype=bool), np.zeros(n_nontarget, dtype=bool)])
    return first, second, is_target


def verification_metrics(
    embeddings,
    labels,
    *,
    max_pairs: int = 1_000_000,
    seed: int = 0,
    p_target: float = 0.01,
    c_miss: float = 1.0,
    c_fa: float = 1.0,
) -> dict:
    """Speaker-verification style scores on same/different-class pairs.

    Pairs come from ``verification_pairs``: all pairs i < j when N*(N-1)/2 <= ``max_pairs``,
    else a seeded sample of ``max_pairs`` pairs, half same-class and half different-class.
    Scores are cosine similarities. From ``sklearn.metrics.roc_curve``:

    - ``eer``: the rate where miss (FNR) and false-alarm (FPR) rates are equal, interpolated
      linearly between the two operating points around the crossing; ``eer_threshold`` is the
      score threshold at the first operating point with FNR <= FPR.
    - ``min_dcf``: NIST normalised minimum detection cost,
      min over thresholds of (c_miss * p_target * FNR + c_fa * (1 - p_target) * FPR)
      / min(c_miss * p_target, c_fa * (1 - p_target)).

    Returns ``{"eer", "eer_threshold", "min_dcf", "fpr", "fnr", "n_pairs", "n_target_pairs"}``
    where ``fpr``/``fnr`` are the ROC operating points (for a DET plot).
    """
    if not 0.0 < p_target < 1.0:
        raise ValueError(f"p_target must be in (0, 1), got {p_target}")
    if c_miss <= 0 or c_fa <= 0:
        raise ValueError(f"c_miss and c_fa must be positive, got c_miss={c_miss}, c_fa={c_fa}")
    emb, lab = check_embeddings(embeddings, labels)
    first, second, is_target = verification_pairs(lab, max_pairs=max_pairs, seed=seed)

    normed = F.normalize(emb, p=2, dim=1)
    first_t, second_t = torch.from_numpy(first), torch.from_numpy(second)
    scores = np.empty(len(first), dtype=np.float64)
    for start in range(0, len(first), _PAIR_CHUNK):
        stop = start + _PAIR_CHUNK
        pair_scores = (normed[first_t[start:stop]] * normed[second_t[start:stop]]).sum(dim=1)
        scores[start:stop] = pair_scores.numpy()

    fpr, tpr, thresholds = roc_curve(is_target, scores)
    fnr = 1.0 - tpr
    # roc_curve starts at (FPR 0, FNR 1) with threshold +inf, so the crossing index is >= 1.
    gap = fnr - fpr
    cross = int(np.argmax(gap <= 0))
    before, after = gap[cross - 1], gap[cross]
    weight = before / (before - after) if before != after else 0.0
    eer = fpr[cross - 1] + weight * (fpr[cross] - fpr[cross - 1])

    detection_cost = c_miss * p_target * fnr + c_fa * (1.0 - p_target) * fpr
    default_cost = min(c_miss * p_target, c_fa * (1.0 - p_target))
    return {
        "eer": float(eer),
        "eer_threshold": float(thresholds[cross]),
        "min_dcf": float(detection_cost.min() / default_cost),
        "fpr": fpr,
        "fnr": fnr,
        "n_pairs": int(len(is_target)),
        "n_target_pairs": int(is_target.sum()),
    }


# --------------------------------------------------------------------------------------------
# Clustering
# --------------------------------------------------------------------------------------------


def clustering_metrics(embeddings, labels, *, seed: int = 0) -> dict:
    """k-means on the L2-normalised embeddings with one cluster per distinct label.

    sklearn ``KMeans(n_init=KMEANS_N_INIT, random_state=seed)``; returns ``{"nmi", "ami"}`` of
    the cluster assignment against the labels.
    """
    emb, lab = check_embeddings(embeddings, labels)
    n_clusters = len(np.unique(lab))
    normed = F.normalize(emb, p=2, dim=1).numpy()
    clusters = KMeans(n_clusters=n_clusters, n_init=KMEANS_N_INIT, random_state=seed).fit_predict(normed)
    return {
        "nmi": float(normalized_mutual_info_score(lab, clusters)),
        "ami": float(adjusted_mutual_info_score(lab, clusters)),
    }
