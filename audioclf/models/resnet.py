"""Thin ResNet embedder (WeSpeaker / VoxCeleb ResNet-34) over log-mel as a 1-channel image.

    log-mel [B, T, F] → [B, 1, T, F] → conv3x3 (stride 1) → stages of BasicBlocks with
    width × (1, 2, 4, 8, ...) channels, stages after the first stride 2 in time and frequency
    → frequency flattened into channels [B, T', C·F'] → masked (attentive) statistics pooling
    over time → Linear → L2-normalised embedding.

Padding never changes an embedding (in eval mode): frames at or past each clip's length are
zeroed before every 3×3 convolution, so the batch's padding reads as the zeros a lone clip gets
from the convolution's own padding; lengths are carried through the strides
(ceil(length / 2), the output length of a kernel-3, padding-1, stride-2 convolution), and the
pooling ignores frames past them. A stride-2 convolution turns 1 frame into 1 frame, so clips of
any length ≥ 1 frame need no extra padding. In training mode BatchNorm uses batch statistics,
which include padded frames.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from audioclf.config import ResNetConfig
from audioclf.models.mixstyle import MixStyle
from audioclf.models.norms import EarlyNorm
from audioclf.models.pooling import build_pooling, lengths_to_mask, valid_lengths


def _zero_padding(x: Tensor, lengths: Tensor) -> Tensor:
    """x [B, C, T, F] with frames t >= lengths[b] set to zero."""
    return x * lengths_to_mask(lengths, x.shape[2])[:, None, :, None].to(x.dtype)


def _strided(lengths: Tensor, stride: int) -> Tensor:
    """Output length of a kernel-3, padding-1 convolution with `stride`: ceil(length / stride)."""
    return torch.div(lengths + stride - 1, stride, rounding_mode="floor")


class BasicBlock(nn.Module):
    """conv3x3 (stride) + BN + ReLU → conv3x3 + BN, plus the shortcut (1×1 conv + BN when the
    shape changes), then ReLU; the ResNet-18/34 block. With a frequency-aware `norm`
    (norms.EarlyNorm) for block `index` of `bins` output bins, that norm in place of the two
    BatchNorms of the residual branch (the shortcut's stays)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        stride: int,
        norm: EarlyNorm | None = None,
        index: int = 0,
        bins: int = 0,
    ):
        super().__init__()
        norm = norm or EarlyNorm()
        self.stride = stride
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1, self.fn1 = norm.build(index, out_channels, bins)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2, self.fn2 = norm.build(index, out_channels, bins)
        self.shortcut: nn.Sequential | None = None
        if stride != 1 or in_channels != out_channels:
            # A 1×1 stride-s convolution: output frame i reads input frame s·i only, which is
            # valid for every valid output frame, so its input needs no masking.
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        out_lengths = _strided(lengths, self.stride)
        out = self.conv1(_zero_padding(x, lengths))
        if self.fn1 is not None:
            out = self.fn1(out, out_lengths)
        else:
            out = self.bn1(out)
        out = self.conv2(_zero_padding(F.relu(out), out_lengths))
        if self.fn2 is not None:
            out = self.fn2(out, out_lengths)
        else:
            out = self.bn2(out)
        residual = x if self.shortcut is None else self.shortcut(x)
        return F.relu(out + residual), out_lengths


class ResNetEmbedder(nn.Module):
    """Log-mel [B, T, n_mels] → L2-normalised embedding [B, embedding_dim].

    `len(blocks)` stages of BasicBlocks (ResNet-34: [3, 4, 6, 3]) with `width * 2**i` channels;
    the first stage keeps the resolution, each later one halves time and frequency. `norm` is
    the early blocks' norm (model.early_norm; the stem is early block 0); `style` (MixStyle of
    augment.mixstyle) mixes after the stem and the first blocks when forward is given style
    partners (training only).
    """

    def __init__(
        self,
        n_mels: int,
        cfg: ResNetConfig,
        embedding_dim: int,
        norm: EarlyNorm | None = None,
        style: MixStyle | None = None,
    ):
        super().__init__()
        norm = norm or EarlyNorm()
        self.conv1 = nn.Conv2d(1, cfg.width, 3, padding=1, bias=False)
        self.bn1, self.fn1 = norm.build(0, cfg.width, n_mels)  # the stem is early block 0
        blocks = []
        in_channels, freq = cfg.width, n_mels
        for stage, count in enumerate(cfg.blocks):
            out_channels = cfg.width * 2**stage
            stride = 1 if stage == 0 else 2
            freq = (freq + stride - 1) // stride
            for i in range(count):
                index = len(blocks) + 1
                block_stride = stride if i == 0 else 1
                blocks.append(
                    BasicBlock(in_channels, out_channels, block_stride, norm, index, freq)
                )
                in_channels = out_channels
        self.blocks = nn.ModuleList(blocks)
        self.pooling = build_pooling(cfg.pooling, in_channels * freq)
        self.embedding = nn.Linear(self.pooling.output_dim, embedding_dim)
        self.embedding_dim = embedding_dim
        self.style = style or MixStyle()

    def forward(
        self, feats: Tensor, lengths: Tensor | None = None, partners: Tensor | None = None
    ) -> Tensor:
        lengths = valid_lengths(feats, lengths)
        x = _zero_padding(feats.unsqueeze(1), lengths)  # [B, 1, T, F]
        x = self.conv1(x)
        if self.fn1 is not None:
            x = self.fn1(x, lengths)
        else:
            x = self.bn1(x)
        x = self.style.after(0, F.relu(x), lengths, partners)
        for index, block in enumerate(self.blocks):
            x, lengths = block(x, lengths)
            x = self.style.after(index + 1, x, lengths, partners)
        batch, channels, frames, freq = x.shape
        x = x.permute(0, 2, 1, 3).reshape(batch, frames, channels * freq)  # [B, T', C·F']
        pooled = self.pooling(x, lengths_to_mask(lengths, frames))
        return F.normalize(self.embedding(pooled), dim=1)
