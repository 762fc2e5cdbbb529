"""Embedding evaluation metrics, shared by the training loop and the offline evaluator.

Every function takes float embeddings ``[N, D]`` (numpy or torch) and integer labels ``[N]``
and scores them by cosine similarity: embeddings are L2-normalised here, whatever the model
did. Nothing in this package talks to ``torch.distributed``; callers gather first.

- ``ExactSearch`` (neighbours.py): the one exact cosine top-k, blocked under one memory
  budget, that every neighbour list comes from (``NeighbourIndex``: what a searcher offers).
- ``retrieval_metrics`` (retrieval.py): retrieval inside one set (P@1, MAP@R, R-precision),
  equal to pytorch-metric-learning's ``AccuracyCalculator``, from the lists of any injected
  ``NeighbourIndex``; with ``items``, cross-item (a query never retrieves its own item).
- ``knn_accuracy`` / ``centroid_accuracy`` (classification.py): classify queries against a
  labelled gallery (``knn_vote``: the majority rule over neighbour lists); ``class_centroids``:
  the per-class centroids the latter uses.
- ``verification_metrics`` (verification.py): same/different pairs scored by cosine
  similarity (EER, minDCF), also normalised against a cohort; ``normalised_scores``: S-norm
  and AS-norm of any trials (``asnorm_top``: how many cohort scores AS-norm keeps by default;
  ``resolve_score_norm``: the --score-norm / --cohort / --cohort-top rule of every caller).
- ``clustering_metrics`` (clustering.py): k-means with one cluster per class (NMI, AMI).
- ``check_embeddings`` (checks.py): the input checks all of them run.
"""

from audioclf.metrics.checks import check_embeddings
from audioclf.metrics.classification import (
    centroid_accuracy,
    class_centroids,
    knn_accuracy,
    knn_vote,
)
from audioclf.metrics.clustering import KMEANS_N_INIT, clustering_metrics
from audioclf.metrics.neighbours import LIST_BUDGET, ExactSearch, NeighbourIndex
from audioclf.metrics.retrieval import (
    RETRIEVAL_KEYS,
    neighbour_lists,
    relevance,
    retrieval_metrics,
    retrieval_summary,
)
from audioclf.metrics.verification import (
    COHORT_TOP,
    SCORE_NORMS,
    asnorm_top,
    normalised_scores,
    resolve_score_norm,
    verification_metrics,
    verification_pairs,
)

__all__ = [
    "COHORT_TOP",
    "KMEANS_N_INIT",
    "LIST_BUDGET",
    "RETRIEVAL_KEYS",
    "SCORE_NORMS",
    "ExactSearch",
    "NeighbourIndex",
    "asnorm_top",
    "centroid_accuracy",
    "check_embeddings",
    "class_centroids",
    "clustering_metrics",
    "knn_accuracy",
    "knn_vote",
    "neighbour_lists",
    "normalised_scores",
    "relevance",
    "retrieval_metrics",
    "retrieval_summary",
    "resolve_score_norm",
    "verification_metrics",
    "verification_pairs",
]
