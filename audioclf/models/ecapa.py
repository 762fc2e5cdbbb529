"""ECAPA-TDNN (Desplanques et al., Interspeech 2020), the baseline of the speaker toolkits.

    log-mel [B, T, F] → Conv1d(k=5) + ReLU + BN → 3 SE-Res2Blocks (k=3, dilation 2, 3, 4;
    residual) → multi-layer feature aggregation: the blocks' outputs concatenated → Conv1d(k=1)
    + ReLU → attentive statistics pooling with global context → BN → Linear → L2-normalised
    embedding.

As published: channels C (512 or 1024), Res2Net scale 8, SE bottleneck 128, attention 128,
the aggregation 3·C wide (1536 at C = 512). Where this differs: the last BN after the linear
layer is left out (the embedding is L2-normalised), and padding is exact: frames past each
clip's length are zeroed before every convolution and left out of the SE means, the pooling
statistics and the attention's softmax, so a padded clip embeds as it does alone (in eval mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from audioclf.config import ECAPAConfig
from audioclf.models.pooling import lengths_to_mask, valid_lengths


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """x [B, C, T] with frames past each clip's length zeroed (mask [B, T])."""
    return x * mask[:, None, :].to(x.dtype)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x [B, C, T] over the valid frames → [B, C], in fp32 (or fp64): a sum over a long
    clip overflows fp16 (65504) at activations of a few units."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    weights = mask[:, None, :].to(x.dtype)
    return (x * weights).sum(dim=2) / weights.sum(dim=2).clamp_min(1.0)


class ConvBlock(nn.Module):
    """Conv1d (zero-padded to keep the length) + ReLU + BatchNorm, the TDNN layer."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, dilation: int = 1):
        super().__init__()
        padding = dilation * (kernel - 1) // 2
        self.conv = nn.Conv1d(in_channels, out_channels, kernel, padding=padding, dilation=dilation)
        self.bn = nn.BatchNorm1d(out_channels)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.bn(F.relu(self.conv(_masked(x, mask))))


class SERes2Block(nn.Module):
    """1x1 ConvBlock → Res2Net dilated ConvBlocks over `scale` channel groups (each group sees
    the previous group's output) → 1x1 ConvBlock → squeeze-excitation → + the input."""

    def __init__(self, channels: int, scale: int, dilation: int, se_bottleneck: int):
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.conv_in = ConvBlock(channels, channels, 1)
        self.res2 = nn.ModuleList(ConvBlock(width, width, 3, dilation) for _ in range(scale - 1))
        self.conv_out = ConvBlock(channels, channels, 1)
        self.se_down = nn.Linear(channels, se_bottleneck)
        self.se_up = nn.Linear(se_bottleneck, channels)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        out = self.conv_in(x, mask)
        groups = list(out.chunk(self.scale, dim=1))
        previous = None
        for i, conv in enumerate(self.res2, start=1):
            previous = conv(groups[i] if previous is None else groups[i] + previous, mask)
            groups[i] = previous
        out = self.conv_out(torch.cat(groups, dim=1), mask)
        squeeze = torch.sigmoid(self.se_up(F.relu(self.se_down(_masked_mean(out, mask)))))
        return out * squeeze[:, :, None] + x


class AttentiveStatistics(nn.Module):
    """Channel- and context-dependent attentive statistics pooling: the attention over time
    sees each frame with the clip's mean and standard deviation; returns [mean, std] [B, 2C].

    The statistics are computed in fp32 (or fp64) even under fp16 autocast, as pooling.py's:
    in fp16, x * x and its sum over a 30 s clip overflow to inf at activations of about 5."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.attention = nn.Sequential(
            nn.Conv1d(channels * 3, attention_channels, 1),
            nn.ReLU(),
            nn.BatchNorm1d(attention_channels),
            nn.Tanh(),
            nn.Conv1d(attention_channels, channels, 1),
        )

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        frames = x.shape[2]
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        mean = _masked_mean(x, mask)
        std = (_masked_mean(x * x, mask) - mean * mean).clamp_min(1e-6).sqrt()
        context = torch.cat(
            [x, mean[:, :, None].expand(-1, -1, frames), std[:, :, None].expand(-1, -1, frames)],
            dim=1,
        )
        scores = self.attention(_masked(context, mask)).to(x.dtype)
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))  # lengths >= 1
        weights = torch.softmax(scores, dim=2)
        mean = (weights * x).sum(dim=2)
        std = ((weights * x * x).sum(dim=2) - mean * mean).clamp_min(1e-6).sqrt()
        return torch.cat([mean, std], dim=1)


class ECAPAEmbedder(nn.Module):
    """Log-mel [B, T, n_mels] → L2-normalised embedding [B, embedding_dim]."""

    def __init__(self, n_mels: int, cfg: ECAPAConfig, embedding_dim: int):
        super().__init__()
        channels = cfg.channels
        aggregated = cfg.mfa_channels or 3 * channels
        self.stem = ConvBlock(n_mels, channels, 5)
        self.blocks = nn.ModuleList(
            SERes2Block(channels, cfg.scale, dilation, cfg.se_bottleneck) for dilation in (2, 3, 4)
        )
        self.mfa = nn.Conv1d(3 * channels, aggregated, 1)
        self.pooling = AttentiveStatistics(aggregated, cfg.attention_channels)
        self.pooled_bn = nn.BatchNorm1d(2 * aggregated)
        self.embedding = nn.Linear(2 * aggregated, embedding_dim)
        self.embedding_dim = embedding_dim

    def forward(self, feats: Tensor, lengths: Tensor | None = None) -> Tensor:
        lengths = valid_lengths(feats, lengths)
        mask = lengths_to_mask(lengths, feats.shape[1])
        x = self.stem(feats.transpose(1, 2), mask)  # [B, C, T]
        outputs = []
        for block in self.blocks:
            x = block(x, mask)
            outputs.append(x)
        x = F.relu(self.mfa(_masked(torch.cat(outputs, dim=1), mask)))
        pooled = self.pooled_bn(self.pooling(x, mask))
        return F.normalize(self.embedding(pooled), dim=1)
