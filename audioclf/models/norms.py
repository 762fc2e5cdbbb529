"""Frequency-aware normalisation for the early blocks of the CNN / ResNet (model.early_norm).

    batch:        BatchNorm2d (the default; SyncBatchNorm under multi-GPU DDP).
    rfn:          relaxed instance frequency-wise normalisation (Kim et al., Interspeech 2022):
                  lam · IFN(x) + (1 - lam) · LN(x), IFN normalising each example's every
                  frequency bin over channels and valid frames, LN each example over channels,
                  valid frames and bins; then a learnt per-channel scale and shift. Per
                  example, with no running statistics: training and inference compute alike,
                  and padding (frames >= lengths[b]) never enters the statistics.
    subspectral:  SubSpectral Norm (Chang et al., ICASSP 2021): BatchNorm per frequency
                  sub-band, the bins split into `groups` equal bands, each with its own
                  statistics and affine parameters. Its inner BatchNorm2d is converted to
                  SyncBatchNorm like any other.

The maps are [B, C, T, F] (time before frequency, as in audioclf's CNN and ResNet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from audioclf.config import ModelConfig
from audioclf.models.pooling import lengths_to_mask


class RelaxedFrequencyNorm(nn.Module):
    """forward(x [B, C, T, F], lengths [B]) → lam · IFN(x) + (1 - lam) · LN(x), then weight·x + bias
    per channel; statistics over the valid frames only, padded frames come out as zeros."""

    def __init__(self, channels: int, lam: float = 0.5, eps: float = 1e-5):
        super().__init__()
        self.lam = float(lam)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        feats = x.float()
        keep = lengths_to_mask(lengths, x.shape[2])[:, None, :, None].to(torch.float32)
        frames = keep.sum(dim=2, keepdim=True)  # [B, 1, 1, 1]
        per_bin = (frames * x.shape[1]).clamp(min=1.0)
        mean_f = (feats * keep).sum(dim=(1, 2), keepdim=True) / per_bin  # [B, 1, 1, F]
        var_f = (((feats - mean_f) * keep) ** 2).sum(dim=(1, 2), keepdim=True) / per_bin
        per_example = per_bin * x.shape[3]
        mean = (feats * keep).sum(dim=(1, 2, 3), keepdim=True) / per_example
        var = (((feats - mean) * keep) ** 2).sum(dim=(1, 2, 3), keepdim=True) / per_example
        ifn = (feats - mean_f) / torch.sqrt(var_f + self.eps)
        layer = (feats - mean) / torch.sqrt(var + self.eps)
        out = self.lam * ifn + (1.0 - self.lam) * layer
        out = out * self.weight[None, :, None, None] + self.bias[None, :, None, None]
        return (out * keep).to(x.dtype)


class SubSpectralNorm(nn.Module):
    """forward(x [B, C, T, F], lengths) → BatchNorm over each of `groups` equal frequency bands
    (lengths unused: BatchNorm's batch statistics include padding, as everywhere in training)."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.groups = groups
        self.bn = nn.BatchNorm2d(channels * groups)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        batch, channels, frames, bins = x.shape
        band = bins // self.groups
        bands = x.reshape(batch, channels, frames, self.groups, band).permute(0, 1, 3, 2, 4)
        bands = self.bn(bands.reshape(batch, channels * self.groups, frames, band))
        bands = bands.reshape(batch, channels, self.groups, frames, band).permute(0, 1, 3, 2, 4)
        return bands.reshape(batch, channels, frames, bins)


@dataclass(frozen=True)
class EarlyNorm:
    """model.early_norm and its keys: which norm the first `blocks` blocks use."""

    kind: str = "batch"
    blocks: int = 1
    rfn_lambda: float = 0.5
    groups: int = 4

    @classmethod
    def of(cls, cfg: ModelConfig) -> EarlyNorm:
        return cls(cfg.early_norm, cfg.early_norm_blocks, cfg.rfn_lambda, cfg.subspectral_groups)

    def build(
        self, block: int, channels: int, bins: int
    ) -> tuple[nn.Module | None, nn.Module | None]:
        """(BatchNorm2d, None) where BatchNorm stays, else (None, the frequency-aware norm) for
        block `block` (0 = first) with `channels` maps of `bins` frequency bins."""
        if self.kind == "batch" or block >= self.blocks:
            return nn.BatchNorm2d(channels), None
        if self.kind == "rfn":
            return None, RelaxedFrequencyNorm(channels, self.rfn_lambda)
        if bins % self.groups:
            raise ValueError(
                f"model.subspectral_groups={self.groups} does not divide the {bins} frequency bins "
                f"of early block {block + 1}: use a divisor of {bins} or fewer model.early_norm_blocks"
            )
        return None, SubSpectralNorm(channels, self.groups)
