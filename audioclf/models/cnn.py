"""PANNs-style 2-D CNN embedder over log-mel features."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from audioclf.config import CNNConfig
from audioclf.models.mixstyle import MixStyle
from audioclf.models.norms import EarlyNorm
from audioclf.models.pooling import build_pooling, lengths_to_mask, valid_lengths


class ConvBlock(nn.Module):
    """2 × (conv3x3 + BatchNorm + ReLU), then 2×2 average pooling; with a frequency-aware
    `norm` (norms.EarlyNorm) for block `index` of `bins` bins, that norm in place of BatchNorm.

    Frames at or past `lengths` are zeroed before every convolution, so (in eval mode) the
    padding of a batch never reaches the valid frames through the 3×3 receptive fields.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        norm: EarlyNorm | None = None,
        index: int = 0,
        bins: int = 0,
    ):
        super().__init__()
        norm = norm or EarlyNorm()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn1, self.fn1 = norm.build(index, out_channels, bins)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2, self.fn2 = norm.build(index, out_channels, bins)

    def forward(self, x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        keep = lengths_to_mask(lengths, x.shape[2])[:, None, :, None].to(x.dtype)  # [B,1,T,1]
        x = self.conv1(x * keep)
        if self.fn1 is not None:
            x = self.fn1(x, lengths)
        else:
            x = self.bn1(x)
        x = self.conv2(F.relu(x) * keep)
        if self.fn2 is not None:
            x = self.fn2(x, lengths)
        else:
            x = self.bn2(x)
        x = F.relu(x)
        # Floor pooling: pooled frame i < len // 2 covers only valid frames 2i and 2i + 1.
        x = F.avg_pool2d(x, kernel_size=2)
        return x, torch.div(lengths, 2, rounding_mode="floor").clamp(min=1)


class CNNEmbedder(nn.Module):
    """Log-mel [B, T, n_mels] → L2-normalised embedding [B, embedding_dim].

    `depth` blocks with `width * 2**i` channels; then mean over frequency, masked pooling over
    time (`pooling`: mean + max summed, as in PANNs, or attentive mean + std), dropout, Linear.
    Clips shorter than 2**depth frames are zero-padded up to it (their length still counts only
    the real frames). `norm` is the early blocks' norm (model.early_norm); `style` (MixStyle of
    augment.mixstyle) mixes after the first blocks when forward is given style partners
    (training only).
    """

    def __init__(
        self,
        n_mels: int,
        cfg: CNNConfig,
        embedding_dim: int,
        norm: EarlyNorm | None = None,
        style: MixStyle | None = None,
    ):
        super().__init__()
        if n_mels < 2**cfg.depth:
            raise ValueError(
                f"model.cnn.depth={cfg.depth} halves the {n_mels} mel bins {cfg.depth} times: "
                f"use features.n_mels >= {2**cfg.depth} or a smaller depth"
            )
        channels = [1] + [cfg.width * 2**i for i in range(cfg.depth)]
        self.blocks = nn.ModuleList(
            [
                ConvBlock(channels[i], channels[i + 1], norm, i, n_mels // 2**i)
                for i in range(cfg.depth)
            ]
        )
        self.min_frames = 2**cfg.depth
        self.pooling = build_pooling(cfg.pooling, channels[-1])
        self.dropout = nn.Dropout(cfg.dropout)
        self.embedding = nn.Linear(self.pooling.output_dim, embedding_dim)
        self.embedding_dim = embedding_dim
        self.style = style or MixStyle()

    def forward(
        self, feats: Tensor, lengths: Tensor | None = None, partners: Tensor | None = None
    ) -> Tensor:
        lengths = valid_lengths(feats, lengths)
        keep = lengths_to_mask(lengths, feats.shape[1]).unsqueeze(-1).to(feats.dtype)
        feats = F.pad(feats * keep, (0, 0, 0, max(0, self.min_frames - feats.shape[1])))
        x = feats.unsqueeze(1)  # [B, 1, T, F], padded frames zeroed
        for index, block in enumerate(self.blocks):
            x, lengths = block(x, lengths)
            x = self.style.after(index, x, lengths, partners)
        x = x.mean(dim=3).transpose(1, 2)  # [B, T', C]
        mask = lengths_to_mask(lengths, x.shape[1])
        pooled = self.pooling(x, mask)
        return F.normalize(self.embedding(self.dropout(pooled)), dim=1)
