"""Clustering: k-means with one cluster per class, scored against the labels (NMI, AMI)."""

from __future__ import annotations

import numpy as np
import torch.nn.functional as F
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_mutual_info_score, normalized_mutual_info_score

from audioclf.metrics.checks import check_embeddings

# Number of k-means restarts; fixed so that clustering scores are comparable between runs.
KMEANS_N_INIT = 3


def clustering_metrics(embeddings, labels, *, seed: int = 0) -> dict:
    """k-means on the L2-normalised embeddings with one cluster per distinct label.

    sklearn ``KMeans(n_init=KMEANS_N_INIT, random_state=seed)``; returns ``{"nmi", "ami"}`` of
    the cluster assignment against the labels.
    """
    emb, lab = check_embeddings(embeddings, labels)
    n_clusters = len(np.unique(lab))
    normed = F.normalize(emb, p=2, dim=1).numpy()
    clusters = KMeans(n_clusters=n_clusters, n_init=KMEANS_N_INIT, random_state=seed).fit_predict(
        normed
    )
    return {
        "nmi": float(normalized_mutual_info_score(lab, clusters)),
        "ami": float(adjusted_mutual_info_score(lab, clusters)),
    }
