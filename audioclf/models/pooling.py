"""Masked pooling over time: padded frames never contribute to an utterance's vector."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def lengths_to_mask(lengths: Tensor, max_len: int) -> Tensor:
    """Boolean [B, max_len] mask, True on the first lengths[b] frames of row b."""
    positions = torch.arange(max_len, device=lengths.device)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)


def valid_lengths(feats: Tensor, lengths: Tensor | None) -> Tensor:
    """Valid frames per row of feats [B, T, F], clamped to [1, T]; every frame when lengths is None."""
    if lengths is None:
        lengths = torch.full(
            (feats.shape[0],), feats.shape[1], dtype=torch.long, device=feats.device
        )
    return lengths.clamp(min=1, max=feats.shape[1])


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x [B, T, D] over the frames where mask [B, T] is True → [B, D], in fp32 (or
    fp64) even from half precision: a sum over a long clip overflows fp16 (65504)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    weights = mask.unsqueeze(-1).to(x.dtype)
    return (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max of x [B, T, D] over the frames where mask [B, T] is True → [B, D] (needs >= 1 frame)."""
    return x.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(dim=1)


class AttentiveStatsPooling(nn.Module):
    """Attentive statistics pooling (Okabe et al. 2018; channel-wise weights as in ECAPA-TDNN).

    A small MLP scores every frame and channel; the softmax over valid frames weights a mean
    and a standard deviation, concatenated to [B, 2 * in_dim]. Computed in fp32 (or fp64) even from half precision.
    """

    def __init__(self, in_dim: int, attention_dim: int = 128):
        super().__init__()
        self.attention = nn.Sequential(
            nn.Linear(in_dim, attention_dim),
            nn.Tanh(),
            nn.Linear(attention_dim, in_dim),
        )
        self.output_dim = 2 * in_dim

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x.to(torch.promote_types(x.dtype, torch.float32)).masked_fill(~mask.unsqueeze(-1), 0.0)
        scores = self.attention(x).to(x.dtype).masked_fill(~mask.unsqueeze(-1), float("-inf"))
        weights = torch.softmax(scores, dim=1)  # [B, T, D]; zero on padded frames
        mean = (weights * x).sum(dim=1)
        var = (weights * x * x).sum(dim=1) - mean * mean
        std = torch.sqrt(var.clamp(min=1e-6))
        return torch.cat([mean, std], dim=1)


class StatsPooling(nn.Module):
    """Masked mean and standard deviation over time (WeSpeaker's TSTP) → [B, 2 * in_dim].

    Population statistics over the valid frames (a one-frame clip has std sqrt(1e-6) rather
    than NaN); computed in fp32 (or fp64) even from half precision.
    """

    def __init__(self, in_dim: int):
        super().__init__()
        self.output_dim = 2 * in_dim

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x.to(torch.promote_types(x.dtype, torch.float32)).masked_fill(~mask.unsqueeze(-1), 0.0)
        weights = mask.unsqueeze(-1).to(x.dtype)  # [B, T, 1]
        count = weights.sum(dim=1).clamp(min=1.0)
        mean = (x * weights).sum(dim=1) / count
        var = (((x - mean.unsqueeze(1)) * weights) ** 2).sum(dim=1) / count
        return torch.cat([mean, torch.sqrt(var.clamp(min=1e-6))], dim=1)


class MeanMaxPooling(nn.Module):
    """Masked mean + masked max over time, summed (PANNs) → [B, in_dim]."""

    def __init__(self, in_dim: int):
        super().__init__()
        self.output_dim = in_dim

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return masked_mean(x, mask) + masked_max(x, mask)


def build_pooling(kind: str, in_dim: int) -> nn.Module:
    """The pooling named by a model's `pooling` key; every one has forward(x [B, T, D], mask
    [B, T]) and `output_dim`."""
    if kind == "attentive_stats":
        return AttentiveStatsPooling(in_dim)
    if kind == "stats":
        return StatsPooling(in_dim)
    if kind == "mean_max":
        return MeanMaxPooling(in_dim)
    raise ValueError(f"pooling {kind!r} is unknown: use attentive_stats, stats or mean_max")
