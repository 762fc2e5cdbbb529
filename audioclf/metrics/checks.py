"""Input checks shared by every metric: embeddings [N, D] and integer labels [N]."""

from __future__ import annotations

import numpy as np
import torch


def _as_embedding_tensor(embeddings, name: str) -> torch.Tensor:
    """A 2-D float32 CPU tensor (float32 is what PML compares in, so ties break alike)."""
    if isinstance(embeddings, torch.Tensor):
        tensor = embeddings.detach().to("cpu", torch.float32)
    else:
        tensor = torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32))
    if tensor.ndim != 2:
        raise ValueError(f"{name} must be 2-D [N, D], got shape {tuple(tensor.shape)}")
    return tensor.contiguous()


def as_label_array(labels, name: str) -> np.ndarray:
    array = (
        labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    )
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {array.shape}")
    if array.size and not (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_):
        raise ValueError(f"{name} must be integer class ids, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.int64)  # torch.from_numpy rejects negative strides


def check_embeddings(
    embeddings,
    labels,
    *,
    emb_name: str = "embeddings",
    label_name: str = "labels",
    min_samples: int = 2,
) -> tuple[torch.Tensor, np.ndarray]:
    """Validated (float32 CPU tensor [N, D], int64 array [N]); one clear ValueError otherwise."""
    emb = _as_embedding_tensor(embeddings, emb_name)
    lab = as_label_array(labels, label_name)
    if emb.shape[0] != lab.shape[0]:
        raise ValueError(
            f"{emb_name} has shape {tuple(emb.shape)} but {label_name} has shape {lab.shape}; "
            f"they need one label per embedding row"
        )
    if emb.shape[0] < min_samples:
        raise ValueError(
            f"{emb_name} has {emb.shape[0]} samples; at least {min_samples} are needed"
        )
    bad_rows = (~torch.isfinite(emb)).any(dim=1).nonzero().flatten()
    if len(bad_rows):
        first = bad_rows[:5].tolist()
        raise ValueError(
            f"{emb_name} has non-finite values (NaN/inf) in {len(bad_rows)} of {emb.shape[0]} rows "
            f"(first rows: {first}); check the model output for these inputs"
        )
    return emb, lab


def check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")


def device_or_cpu(device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)
