"""The exact index of audioclf.search: audioclf.metrics.ExactSearch (the one exact top-k, on any
device, under its memory budget) with what a search index adds, its persistence.

Needs nothing beyond torch, so search works without faiss; on a CUDA device the products run
on the GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from audioclf.metrics import ExactSearch
from audioclf.search.base import SearchIndex, unit_rows


class ExactIndex(SearchIndex):
    """Every query scored against every row: the reference the approximate indexes are
    measured against, and the right choice below ~50k rows or on a GPU. `chunk_size`: queries
    per block (default: ExactSearch's budget)."""

    method = "exact"
    data_suffix = ".npy"

    def __init__(
        self,
        embeddings: Any,
        *,
        device: str | torch.device | None = None,
        source: Path | None = None,
        chunk_size: int | None = None,
    ) -> None:
        rows = unit_rows(embeddings, "embeddings")
        super().__init__(rows.shape[1], rows.shape[0], {}, source)
        # An index built from a file keeps only a reference to it; one built from an array
        # writes its rows on save.
        self.data_suffix = None if source is not None else ".npy"
        self.exact = ExactSearch(rows, chunk_size=chunk_size, device=device)

    def _search_chunk(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.exact.search(queries, k)

    def _write_data(self, handle: IO[bytes]) -> None:
        np.save(handle, self.exact.rows.cpu().numpy())
