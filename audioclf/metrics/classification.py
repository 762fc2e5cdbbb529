"""Classification against a labelled gallery: k nearest neighbours and nearest class centroid
(cosine similarity)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from audioclf.metrics.checks import check_chunk_size, check_embeddings
from audioclf.metrics.neighbours import ExactSearch


def _check_query_gallery(query, query_labels, gallery, gallery_labels):
    q_emb, q_lab = check_embeddings(
        query, query_labels, emb_name="query", label_name="query_labels", min_samples=1
    )
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
    check_chunk_size(chunk_size)
    q_emb, q_lab, g_emb, g_lab = _check_query_gallery(query, query_labels, gallery, gallery_labels)
    if not isinstance(k, int) or not 1 <= k <= len(g_lab):
        raise ValueError(f"k must be an integer in [1, gallery size = {len(g_lab)}], got {k!r}")

    index = ExactSearch(g_emb, chunk_size=chunk_size, device=device)
    _, neighbours = index.search(q_emb, k)
    predictions = knn_vote(g_lab[neighbours])
    return {"knn_accuracy": float(np.mean(predictions == q_lab)), "predictions": predictions}


def knn_vote(neighbour_labels: np.ndarray) -> np.ndarray:
    """Each row's majority label among its neighbours' labels [Q, k] (nearest first); a tie
    goes to the label whose first occurrence is nearest."""
    labels = torch.from_numpy(np.ascontiguousarray(neighbour_labels))
    votes = (labels[:, :, None] == labels[:, None, :]).sum(dim=2)
    # argmax returns the first maximum, i.e. the nearest neighbour among the tied labels.
    winner = (votes == votes.max(dim=1, keepdim=True).values).to(torch.uint8).argmax(dim=1)
    return labels.gather(1, winner[:, None]).squeeze(1).numpy()


def class_centroids(embeddings, labels) -> tuple[np.ndarray, torch.Tensor]:
    """(sorted distinct labels int64 [C], their centroids float32 [C, D], L2-normalised).

    A centroid is the mean of the class's L2-normalised embeddings, renormalised, so every
    member weighs the same whatever its norm. Row i of the centroids belongs to label i.
    """
    emb, lab = check_embeddings(embeddings, labels, min_samples=1)
    classes, class_index = np.unique(lab, return_inverse=True)
    normed = F.normalize(emb, p=2, dim=1)
    sums = torch.zeros(len(classes), emb.shape[1]).index_add_(
        0, torch.from_numpy(class_index), normed
    )
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
        nearest[start : start + 2048] = (
            (q_normed[start : start + 2048] @ centroids_t).argmax(dim=1).numpy()
        )
    predictions = classes[nearest]
    return {"centroid_accuracy": float(np.mean(predictions == q_lab)), "predictions": predictions}
