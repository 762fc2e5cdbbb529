"""Conformer embedder: conv2d subsampling (×4 in time) → torchaudio Conformer → masked pooling.

Padding never changes an embedding (in eval mode): padded input frames are zeroed, the
subsampling output is re-masked after each convolution, attention ignores padded keys, and the
depthwise convolution inside every Conformer block sees zeros past the end of each utterance,
exactly as it does for a clip alone (its own zero padding). In training mode the BatchNorm of
the Conformer convolution module uses batch statistics, which include padded frames.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchaudio
from torch import Tensor, nn

from audioclf.config import ConformerConfig
from audioclf.models.pooling import (
    AttentiveStatsPooling,
    lengths_to_mask,
    masked_mean,
    valid_lengths,
)


def _halve(lengths: Tensor) -> Tensor:
    """Output length of a kernel-3, stride-2, padding-1 convolution: ceil(length / 2)."""
    return torch.div(lengths + 1, 2, rounding_mode="floor")


def _zero_padding(x: Tensor, lengths: Tensor) -> Tensor:
    """x [B, C, T, F] with frames t >= lengths[b] set to zero."""
    return x * lengths_to_mask(lengths, x.shape[2])[:, None, :, None].to(x.dtype)


class ConvSubsampling(nn.Module):
    """Two stride-2 conv3x3 + ReLU over (time, mel) → Linear to d_model; [B, T, F] → [B, T/4, d]."""

    def __init__(self, n_mels: int, d_model: int):
        super().__init__()
        self.conv1 = nn.Conv2d(1, d_model, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(d_model, d_model, 3, stride=2, padding=1)
        freq = (((n_mels + 1) // 2) + 1) // 2
        self.proj = nn.Linear(d_model * freq, d_model)

    def forward(self, feats: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        x = _zero_padding(feats.unsqueeze(1), lengths)  # [B, 1, T, F]
        # Each conv's bias makes frames past the end non-zero: re-zero them before going on.
        lengths = _halve(lengths)
        x = _zero_padding(F.relu(self.conv1(x)), lengths)  # [B, C, T/2, F/2]
        lengths = _halve(lengths)
        x = _zero_padding(F.relu(self.conv2(x)), lengths)  # [B, C, T/4, F/4]
        batch, channels, frames, freq = x.shape
        x = x.permute(0, 2, 1, 3).reshape(batch, frames, channels * freq)
        return self.proj(x), lengths


class ConformerEmbedder(nn.Module):
    """Log-mel [B, T, n_mels] → L2-normalised embedding [B, embedding_dim].

    `self.conformer` is a stock `torchaudio.models.Conformer` (its BatchNorm is what SyncBN
    converts); `forward` runs its blocks itself, following torchaudio's ConformerLayer.forward
    but zeroing padded frames right before the depthwise convolution, the one place where
    frames past the end would leak into valid ones.
    """

    def __init__(self, n_mels: int, cfg: ConformerConfig, embedding_dim: int):
        super().__init__()
        self.subsampling = ConvSubsampling(n_mels, cfg.d_model)
        self.conformer = torchaudio.models.Conformer(
            input_dim=cfg.d_model,
            num_heads=cfg.num_heads,
            ffn_dim=cfg.ffn_dim,
            num_layers=cfg.num_layers,
            depthwise_conv_kernel_size=cfg.kernel_size,
            dropout=cfg.dropout,
        )
        if cfg.pooling == "attentive_stats":
            self.attentive_pooling: AttentiveStatsPooling | None = AttentiveStatsPooling(
                cfg.d_model
            )
            pooled_dim = 2 * cfg.d_model
        else:  # "mean"
            self.attentive_pooling = None
            pooled_dim = cfg.d_model
        self.embedding = nn.Linear(pooled_dim, embedding_dim)
        self.embedding_dim = embedding_dim

    def forward(self, feats: Tensor, lengths: Tensor | None = None) -> Tensor:
        lengths = valid_lengths(feats, lengths)
        x, lengths = self.subsampling(feats, lengths)  # [B, T', d]
        mask = lengths_to_mask(lengths, x.shape[1])  # True on valid frames
        padding = ~mask
        keep = mask.unsqueeze(1).to(x.dtype)  # [B, 1, T'] for the [B, d, T'] conv input
        x = x.transpose(0, 1)  # torchaudio's blocks work on [T, B, d]
        # torchaudio's ConformerLayer.forward (convolution after attention), written out so
        # padded frames can be zeroed right before the depthwise convolution.
        for layer in self.conformer.conformer_layers:
            residual = x
            x = layer.ffn1(x) * 0.5 + residual

            residual = x
            y = layer.self_attn_layer_norm(x)
            y, _ = layer.self_attn(y, y, y, key_padding_mask=padding, need_weights=False)
            x = layer.self_attn_dropout(y) + residual

            conv = layer.conv_module
            y = conv.layer_norm(x).permute(1, 2, 0)  # [B, d, T]
            y = conv.sequential[1](conv.sequential[0](y))  # pointwise conv, GLU
            y = y * keep  # zeros past the end, as a lone clip's "same" padding gives
            y = conv.sequential[2](y)  # depthwise conv
            y = conv.sequential[4](conv.sequential[3](y))  # BatchNorm, SiLU
            y = conv.sequential[6](conv.sequential[5](y))  # pointwise conv, dropout
            x = x + y.permute(2, 0, 1)

            residual = x
            x = layer.ffn2(x) * 0.5 + residual
            x = layer.final_layer_norm(x)
        x = x.transpose(0, 1)
        if self.attentive_pooling is not None:
            pooled = self.attentive_pooling(x, mask)
        else:
            pooled = masked_mean(x, mask)
        return F.normalize(self.embedding(pooled), dim=1)
