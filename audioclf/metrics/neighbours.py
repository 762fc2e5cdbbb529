"""The one exact neighbour search: blocked cosine top-k over a set of rows, handed to every
consumer (as PML's ``knn_func``): retrieval_metrics, knn_accuracy, gallery ranking
(audioclf.embedding.gallery) and search's exact index (audioclf.search.exact), so validation,
evaluate, `embed --gallery` and `search query` find the same neighbours by construction.

    index = ExactSearch(gallery, device="cpu")
    scores, ids = index.search(queries, k=5)                                 # [Q, 5], best first
    scores, ids = index.search(queries, 5, query_groups=qg, index_groups=ig)  # own group never

A faster or approximate searcher is one more class with the same `search` (NeighbourIndex).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from audioclf.metrics.checks import device_or_cpu
from audioclf.precision import exact_arithmetic

# Similarity entries computed per block (a [block, N] float32 buffer: 512 MiB).
SIMILARITY_BUDGET = 2**27
# Neighbour-list entries a caller holds per step (about 100 MiB of ids, scores and flags), so
# memory stays bounded however deep the lists are.
LIST_BUDGET = 2**22


class NeighbourIndex(Protocol):
    """An index over some rows (ExactSearch, an audioclf.search index): `search` gives
    (scores, ids) [Q, k] of each query's k most cosine-similar rows, best first, never a row of
    its own group; id -1 pads a list that found fewer."""

    size: int
    dim: int

    def search(
        self, queries: Any, k: int, *, query_groups: Any = None, index_groups: Any = None
    ) -> tuple[np.ndarray, np.ndarray]: ...


class ExactSearch:
    """Exact cosine top-k over float [N, D] rows on `device` (default cpu), `chunk_size`
    queries at a time (default: SIMILARITY_BUDGET entries, 64-2048 queries) into a reused
    [chunk_size, N] buffer and own-group mask: memory O(chunk_size * N), never Q x N. Safe
    under concurrent callers (a server's threads): each thread has buffers of its own."""

    def __init__(self, embeddings: Any, *, chunk_size: int | None = None, device=None):
        rows = _as_tensor(embeddings)
        self.size, self.dim = rows.shape
        self.device = device_or_cpu(device)
        self.rows = F.normalize(rows.to(self.device, torch.float32), p=2, dim=1)  # [N, D]
        self.block = min(
            self.size, chunk_size or max(64, min(2048, SIMILARITY_BUDGET // self.size))
        )
        self._per_thread = _ThreadBuffers()

    def _buffers_for(self, queries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This thread's similarity and own-group buffers, made on first use and reused after:
        a fresh [block, N] tensor per block spends more time in page faults than in the product
        at N = 100k. One pair per thread: two threads writing one buffer got each other's
        neighbours (issue 42)."""
        rows, held = min(self.block, queries), self._per_thread.buffers
        if held is None or len(held[0]) < rows:
            held = self._per_thread.buffers = (
                torch.empty(rows, self.size, device=self.device),
                torch.empty(rows, self.size, dtype=torch.bool, device=self.device),
            )
        return held

    def search(
        self, queries: Any, k: int, *, query_groups: Any = None, index_groups: Any = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores float32 [Q, k], ids int64 [Q, k]) of each query's k most similar rows, best
        first (1 <= k <= N). With `query_groups` [Q] and `index_groups` [N] (integer codes) a
        row of the query's own group is never listed: id -1, score -inf where fewer remain."""
        dev, rows_t = self.device, self.rows.T  # a transposed view: torch.mm copies nothing
        normed = F.normalize(_as_tensor(queries).to(dev, torch.float32), p=2, dim=1)
        grouped = query_groups is not None
        if grouped:
            q_groups, i_groups = (_as_tensor(g).to(dev) for g in (query_groups, index_groups))
        scores = torch.empty(len(normed), k, device=dev)
        ids = torch.empty(len(normed), k, dtype=torch.int64, device=dev)
        similarity, own_group = self._buffers_for(len(normed))
        with exact_arithmetic():  # IEEE fp32 whatever TF32 a training in this process left on
            for start in range(0, len(normed), self.block):
                stop = min(start + self.block, len(normed))
                sim, same = similarity[: stop - start], own_group[: stop - start]
                torch.mm(normed[start:stop], rows_t, out=sim)
                if grouped:
                    torch.eq(q_groups[start:stop, None], i_groups[None, :], out=same)
                    sim.masked_fill_(same, -torch.inf)
                torch.topk(sim, k, dim=1, sorted=True, out=(scores[start:stop], ids[start:stop]))
        if grouped:
            ids.masked_fill_(scores == -torch.inf, -1)
        return scores.cpu().numpy(), ids.cpu().numpy()


class _ThreadBuffers(threading.local):
    """An ExactSearch's buffers as each thread sees them (none until it first searches)."""

    buffers: tuple[torch.Tensor, torch.Tensor] | None = None


def _as_tensor(array: Any) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array.detach()
    return torch.from_numpy(np.ascontiguousarray(array))
