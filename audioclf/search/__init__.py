"""Nearest-neighbour search over embeddings (cosine similarity = inner product of unit rows).

- ``build(embeddings, method)``: an index over an [N, D] array or an .npy file (PREFIX.npy of
  ``audioclf.embed --index``): "exact" (torch, any device, no extra dependency), or with faiss
  installed (``pip install faiss-cpu``) the approximate "ivf", "hnsw" and "ivfpq".
- ``SearchIndex.search(queries, k, query_groups=, index_groups=)``: top-k (scores, ids), in
  bounded-memory chunks, optionally never returning rows of the query's own group (item).
- ``SearchIndex.save(path.json)`` / ``load(path.json)``: the index beside its embeddings; a
  stale index (embeddings rewritten since) is an error.
- ``sampled_neighbour_recall``: the recall against exact search of the neighbour lists that
  audioclf.metrics.retrieval_metrics scores when handed an index (``index=``).
"""

from audioclf.search.approximate import FaissIndex, faiss_available
from audioclf.search.base import SearchIndex
from audioclf.search.exact import ExactIndex
from audioclf.search.index import METHODS, build, load, read_embeddings
from audioclf.search.retrieval import neighbour_recall, sampled_neighbour_recall

__all__ = [
    "METHODS",
    "ExactIndex",
    "FaissIndex",
    "SearchIndex",
    "build",
    "faiss_available",
    "load",
    "neighbour_recall",
    "read_embeddings",
    "sampled_neighbour_recall",
]
