"""Nearest-neighbour search over embeddings (cosine similarity = inner product of unit rows).

- ``build(embeddings, method)``: an index over an [N, D] array or an .npy file (PREFIX.npy of
  ``audioclf.embed --index``): "exact" (torch, any device, no extra dependency), or with faiss
  installed (``pip install faiss-cpu``) the approximate "ivf", "hnsw" and "ivfpq".
- ``SearchIndex.search(queries, k, query_groups=, index_groups=)``: top-k (scores, ids), in
  bounded-memory chunks, optionally never returning rows of the query's own group (item).
- ``SearchIndex.save(path.json)`` / ``load(path.json)``: the index beside its embeddings; a
  stale index (embeddings rewritten since) is an error.
- ``knn_retrieval_metrics``: retrieval_metrics' P@1 / MAP@R / R-precision from neighbour
  lists, with the recall of an approximate index against exact search.
"""

from audioclf.search.approximate import FaissIndex, faiss_available
from audioclf.search.base import SearchIndex
from audioclf.search.exact import ExactIndex
from audioclf.search.index import METHODS, build, load, read_embeddings
from audioclf.search.retrieval import knn_retrieval_metrics, neighbour_recall

__all__ = [
    "METHODS",
    "ExactIndex",
    "FaissIndex",
    "SearchIndex",
    "build",
    "faiss_available",
    "knn_retrieval_metrics",
    "load",
    "neighbour_recall",
    "read_embeddings",
]
