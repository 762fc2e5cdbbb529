"""The batched log-mel front end, part of the model (so an export carries it) and run on the
training device, not in data workers.

    FeatureFrontend = [LogMel] → UtteranceNorm → SpecAugment, with lengths carried along so
    padding never changes an utterance's statistics (LogMel: audioclf.spectrogram).
"""

from __future__ import annotations

import torch
import torchaudio
from torch import Tensor, nn

from audioclf.config import FeaturesConfig, SpecAugmentConfig, choices
from audioclf.models.pooling import lengths_to_mask
from audioclf.spectrogram import LogMel

NORM_MODES = choices(FeaturesConfig, "norm")


class UtteranceNorm(nn.Module):
    """Per-utterance mean/variance normalisation over the valid frames only.

    mode="utterance" (default): one mean and variance over all valid frames and bins, which
    removes the recording gain but keeps the spectral envelope (often what tells classes apart).
    mode="utterance_bin": per mel bin (CMVN), which also removes the envelope / channel.
    mode="none": no normalisation. Statistics use frames < lengths[b], so padding does not change
    them; padded frames come out as zeros. Computed in fp32.
    """

    def __init__(self, mode: str = "utterance", eps: float = 1e-5):
        super().__init__()
        if mode not in NORM_MODES:
            raise ValueError(
                f"features.norm={mode!r} is invalid: use one of {', '.join(map(repr, NORM_MODES))}"
            )
        self.mode = mode
        self.eps = eps

    def forward(self, feats: Tensor, lengths: Tensor) -> Tensor:
        feats = feats.float()
        mask = lengths_to_mask(lengths, feats.shape[1]).unsqueeze(-1).to(feats.dtype)  # [B, T, 1]
        if self.mode == "none":
            return feats * mask
        dims = [1] if self.mode == "utterance_bin" else [1, 2]
        bins = 1.0 if self.mode == "utterance_bin" else float(feats.shape[2])
        count = (mask.sum(dim=1, keepdim=True) * bins).clamp(min=1.0)
        mean = (feats * mask).sum(dim=dims, keepdim=True) / count
        var = (((feats - mean) * mask) ** 2).sum(dim=dims, keepdim=True) / count
        return (feats - mean) / torch.sqrt(var + self.eps) * mask


class SpecAugment(nn.Module):
    """`num_masks` frequency and time masks per example (independent per example); training only.

    Masks write 0, which after UtteranceNorm is the utterance mean.
    """

    def __init__(self, freq_mask: int, time_mask: int, num_masks: int):
        super().__init__()
        self.freq_masks = nn.ModuleList(
            [
                torchaudio.transforms.FrequencyMasking(freq_mask, iid_masks=True)
                for _ in range(num_masks)
            ]
        )
        self.time_masks = nn.ModuleList(
            [torchaudio.transforms.TimeMasking(time_mask, iid_masks=True) for _ in range(num_masks)]
        )

    def forward(self, feats: Tensor) -> Tensor:
        if not self.training:
            return feats
        spec = feats.transpose(1, 2)  # torchaudio masks expect (..., freq, time)
        for freq_mask in self.freq_masks:
            spec = freq_mask(spec)
        for time_mask in self.time_masks:
            spec = time_mask(spec)
        return spec.transpose(1, 2)


class FeatureFrontend(nn.Module):
    """Batched front end run on the training device, not in data workers.

    kind="audio": waveforms [B, S] + sample lengths → LogMel → UtteranceNorm → SpecAugment.
    kind="npy":   log-mel [B, T, F] + frame lengths →          UtteranceNorm → SpecAugment.
    `forward` returns (feats [B, T, n_mels] float32, feat_lengths [B]). SpecAugment masks (in
    training mode only) come from `spec_augment`; without it there are none.
    """

    def __init__(self, cfg: FeaturesConfig, spec_augment: SpecAugmentConfig | None = None):
        super().__init__()
        self.kind = cfg.kind
        self.n_mels = cfg.n_mels
        self.log_mel = LogMel(cfg) if cfg.kind == "audio" else None
        self.norm = UtteranceNorm(cfg.norm)
        masks = spec_augment or SpecAugmentConfig(enabled=False)
        self.spec_augment = SpecAugment(
            masks.freq_mask, masks.time_mask, masks.num_masks if masks.enabled else 0
        )

    def forward(self, x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        if self.log_mel is not None:
            if x.dim() != 2:
                raise ValueError(
                    f"features.kind=audio expects waveforms [batch, samples], got shape {list(x.shape)}"
                )
            feats, lengths = self.log_mel(x, lengths)
        else:
            if x.dim() != 3 or x.shape[2] != self.n_mels:
                raise ValueError(
                    f"features.kind=npy expects features [batch, frames, {self.n_mels}], "
                    f"got shape {list(x.shape)}"
                )
            feats = x
        feats = self.norm(feats, lengths)
        return self.spec_augment(feats), lengths
