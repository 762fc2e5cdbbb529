"""The batched log-mel front end, part of the model (so an export carries it) and run on the
training device, not in data workers.

    FeatureFrontend = [LogMel] → SpectralJitter → UtteranceNorm → Freq-MixStyle → SpecAugment,
    with lengths carried along so padding never changes an utterance's statistics (LogMel:
    audioclf.spectrogram). SpectralJitter, Freq-MixStyle (audioclf.models.mixstyle; only given
    style partners) and SpecAugment act in training mode only.
"""

from __future__ import annotations

import torch
import torchaudio
from torch import Tensor, nn

from audioclf.config import AugmentConfig, FeaturesConfig, SpecAugmentConfig, choices
from audioclf.models.mixstyle import MixStyle
from audioclf.models.pooling import lengths_to_mask
from audioclf.spectrogram import DB_TO_LOG_POWER, LogMel

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


class SpectralJitter(nn.Module):
    """Per-example random spectral tilt and mel-axis warp of log-mel [B, T, F]; training only.

    warp: bin f of the output reads the input at f / w (linear interpolation between bins, the
    top bin held past the end), w uniform in [1 - freq_warp, 1 + freq_warp], so a peak at bin
    p moves to about p · w: another filterbank's, or another vocal tract's, placement of the
    same spectrum (as VTLP). tilt: t uniform in [-tilt_db, tilt_db] dB added linearly across
    the bins, -t/2 at the lowest and +t/2 at the highest: another microphone's or channel's
    slope. One draw of each per example, from torch's generator on the features' device (as
    SpecAugment), so a seeded run repeats and a resumed run, which restores that generator,
    repeats bit for bit; a key at 0 draws nothing. Applied before UtteranceNorm: the tilt and
    warp change the spectrum as a different source or channel would, and the normalisation
    that follows then treats jittered and clean crops alike (padding still comes out as zeros,
    masks still write the utterance mean). With features.norm="utterance_bin" the per-bin
    normalisation removes any tilt again (it removes every stationary per-bin offset), so
    there tilt does nothing and only the warp acts.
    """

    def __init__(self, tilt_db: float = 0.0, freq_warp: float = 0.0):
        super().__init__()
        self.tilt = float(tilt_db) * DB_TO_LOG_POWER
        self.freq_warp = float(freq_warp)

    def forward(self, feats: Tensor) -> Tensor:
        if not self.training or (self.tilt == 0.0 and self.freq_warp == 0.0):
            return feats
        feats = feats.float()
        if self.freq_warp > 0.0:
            feats = self._warp(feats)
        if self.tilt > 0.0:
            feats = self._tilt(feats)
        return feats

    def _warp(self, feats: Tensor) -> Tensor:
        batch, frames, bins = feats.shape
        draw = torch.rand(batch, 1, device=feats.device)
        factor = 1.0 + self.freq_warp * (2.0 * draw - 1.0)  # [B, 1]
        source = torch.arange(bins, device=feats.device, dtype=torch.float32) / factor
        source = source.clamp(max=float(bins - 1))
        low = source.floor().long()
        high = (low + 1).clamp(max=bins - 1)
        weight = (source - low.float()).unsqueeze(1)  # [B, 1, F]
        low = low.unsqueeze(1).expand(batch, frames, bins)
        high = high.unsqueeze(1).expand(batch, frames, bins)
        return torch.lerp(feats.gather(2, low), feats.gather(2, high), weight)

    def _tilt(self, feats: Tensor) -> Tensor:
        batch, bins = feats.shape[0], feats.shape[2]
        draw = torch.rand(batch, 1, 1, device=feats.device)
        slope = self.tilt * (2.0 * draw - 1.0)  # [B, 1, 1], log units from lowest to highest
        position = torch.arange(bins, device=feats.device, dtype=torch.float32)
        position = position / float(max(bins - 1, 1)) - 0.5
        return feats + slope * position


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

    kind="audio": waveforms [B, S] + sample lengths → LogMel → jitter → norm → SpecAugment.
    kind="npy":   log-mel [B, T, F] + frame lengths →          jitter → norm → SpecAugment.
    `forward` returns (feats [B, T, n_mels] float32, feat_lengths [B]). SpecAugment masks and
    the spectral jitter (tilt_db, freq_warp; in training mode only) come from `spec_augment`;
    without it there are none. `spec_augment.enabled` switches the masks only: the jitter is
    on whenever its keys are above 0. Freq-MixStyle (augment.freq_mixstyle) mixes the
    normalised log-mel's per-bin statistics with those of `partners` (training only).
    """

    def __init__(
        self,
        cfg: FeaturesConfig,
        spec_augment: SpecAugmentConfig | None = None,
        augment: AugmentConfig | None = None,
    ):
        super().__init__()
        self.kind = cfg.kind
        self.n_mels = cfg.n_mels
        self.log_mel = LogMel(cfg) if cfg.kind == "audio" else None
        self.norm = UtteranceNorm(cfg.norm)
        masks = spec_augment or SpecAugmentConfig(enabled=False)
        self.jitter = SpectralJitter(masks.tilt_db, masks.freq_warp)
        self.spec_augment = SpecAugment(
            masks.freq_mask, masks.time_mask, masks.num_masks if masks.enabled else 0
        )
        styles = augment or AugmentConfig()
        self.style = MixStyle(styles.freq_mixstyle, styles.freq_mixstyle_alpha, frequency=True)

    def forward(
        self, x: Tensor, lengths: Tensor, partners: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
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
        feats = self.style(self.norm(self.jitter(feats), lengths), lengths, partners)
        return self.spec_augment(feats), lengths
