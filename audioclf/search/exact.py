"""Exact inner-product search with torch: blocks of queries against all N rows, on any device.

Needs nothing beyond torch, so search works without faiss; on a CUDA device the products run
on the GPU. Memory is one reused [block, N] float32 buffer of at most `buffer_budget` entries
(512 MiB by default, as audioclf.metrics), never Q x N.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from audioclf.search.base import SearchIndex, unit_rows

# Similarity entries per block (a [block, N] float32 buffer of 512 MiB), as audioclf.metrics.
BUFFER_BUDGET = 2**27


class ExactIndex(SearchIndex):
    """Every query scored against every row: the reference the approximate indexes are
    measured against, and the right choice below ~50k rows or on a GPU."""

    method = "exact"
    data_suffix = ".npy"

    def __init__(
        self,
        embeddings: Any,
        *,
        device: str | torch.device | None = None,
        source: Path | None = None,
        buffer_budget: int = BUFFER_BUDGET,
    ) -> None:
        rows = unit_rows(embeddings, "embeddings")
        super().__init__(rows.shape[1], rows.shape[0], {}, source)
        # An index built from a file keeps only a reference to it; one built from an array
        # writes its rows on save.
        self.data_suffix = None if source is not None else ".npy"
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._rows = torch.from_numpy(rows).to(self.device)
        self._block = max(1, buffer_budget // self.size)

    def _search_chunk(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        chunk = torch.from_numpy(queries).to(self.device)
        rows_t = self._rows.T  # a transposed view: torch.mm needs no copy of the rows
        # One buffer for all blocks of this chunk: a fresh [block, N] tensor per block spends
        # more time in page faults than in the product at N = 100k.
        buffer = torch.empty(min(self._block, len(chunk)), self.size, device=self.device)
        scores = torch.empty(len(chunk), k, device=self.device)
        ids = torch.empty(len(chunk), k, dtype=torch.int64, device=self.device)
        for start in range(0, len(chunk), self._block):
            stop = min(start + self._block, len(chunk))
            similarity = buffer[: stop - start]
            torch.mm(chunk[start:stop], rows_t, out=similarity)
            torch.topk(similarity, k, dim=1, sorted=True, out=(scores[start:stop], ids[start:stop]))
        return scores.cpu().numpy(), ids.cpu().numpy()

    def _write_data(self, handle: IO[bytes]) -> None:
        np.save(handle, self._rows.cpu().numpy())
