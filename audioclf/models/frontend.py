"""The batched log-mel front end, part of the model (so an export carries it) and run on the
training device, not in data workers.

    FeatureFrontend = [LogMel] → UtteranceNorm → SpecAugment, with lengths carried along so
    padding never changes an utterance's statistics.
    log_mel         the same log-mel offline, for one waveform (to precompute .npy features)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
import torchaudio
from torch import Tensor, nn

from audioclf.config import FeaturesConfig, choices
from audioclf.models.pooling import lengths_to_mask

LOG_OFFSET = 1e-6  # added to mel power before the log, so silence gives log(1e-6), not -inf
NORM_MODES = choices(FeaturesConfig, "norm")


class LogMel(nn.Module):
    """Waveforms [B, S] → log-mel [B, T, n_mels], computed in fp32 even under autocast.

    Frames are centred (torchaudio's `center=True`): a clip of S samples gives S // hop + 1
    frames, which is how `frame_lengths` is derived from sample lengths.
    """

    def __init__(self, cfg: FeaturesConfig):
        super().__init__()
        self.n_fft = cfg.n_fft
        self.hop_length = cfg.hop_length
        self.log_offset = LOG_OFFSET
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=cfg.sample_rate,
            n_fft=cfg.n_fft,
            win_length=cfg.win_length,
            hop_length=cfg.hop_length,
            f_min=cfg.f_min,
            f_max=cfg.f_max,
            n_mels=cfg.n_mels,
            power=2.0,
        )

    def forward(self, waves: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        # Reflect padding needs more than n_fft // 2 samples; very short batches get zeros.
        waves = F.pad(waves.float(), (0, max(0, self.n_fft - waves.shape[-1])))
        if torch.jit.is_scripting():  # TorchScript cannot take the device type at run time
            feats = torch.log(self.mel(waves) + self.log_offset)
        else:
            # The mel matmul would run in fp16 under CUDA autocast, where power spectra overflow.
            with torch.autocast(device_type=waves.device.type, enabled=False):
                feats = torch.log(self.mel(waves) + self.log_offset)
        feats = feats.transpose(1, 2)
        # Valid frames are those whose window ends inside the clip: the last centred frames of a
        # short clip would see the batch's zero padding (alone they would see reflection), so
        # counting them would make an embedding depend on what else is in the batch.
        inside = torch.div(lengths - self.n_fft // 2, self.hop_length, rounding_mode="floor") + 1
        return feats, inside.clamp(min=1, max=feats.shape[1])


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the block: log_mel of one clip is too small to share between
    threads, and on a busy machine idle OpenMP threads spinning made it 100x slower (demo,
    prepare)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_LOG_MEL_CACHE: dict[tuple, LogMel] = {}


def log_mel(wave: Tensor, cfg: FeaturesConfig) -> np.ndarray:
    """Un-normalised log-mel of one waveform [S] as float32 [T, n_mels] (for offline .npy files).

    Gives the same frames as the training front end's LogMel, so precomputed features and
    on-the-fly features are interchangeable (normalisation happens later, per utterance).
    """
    key = (cfg.sample_rate, cfg.n_fft, cfg.win_length, cfg.hop_length, cfg.n_mels, cfg.f_min, cfg.f_max)
    if key not in _LOG_MEL_CACHE:
        _LOG_MEL_CACHE[key] = LogMel(cfg)
    wave = torch.as_tensor(wave, dtype=torch.float32)
    if wave.dim() != 1:
        raise ValueError(f"log_mel expects a 1-D waveform, got shape {tuple(wave.shape)}")
    with torch.no_grad():
        feats, frames = _LOG_MEL_CACHE[key](wave.unsqueeze(0), torch.tensor([wave.shape[0]]))
    return feats[0, : int(frames[0])].numpy()  # only the valid frames, as the front end counts them


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
            [torchaudio.transforms.FrequencyMasking(freq_mask, iid_masks=True) for _ in range(num_masks)]
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
    `forward` returns (feats [B, T, n_mels] float32, feat_lengths [B]).
    """

    def __init__(self, cfg: FeaturesConfig):
        super().__init__()
        self.kind = cfg.kind
        self.n_mels = cfg.n_mels
        self.log_mel = LogMel(cfg) if cfg.kind == "audio" else None
        self.norm = UtteranceNorm(cfg.norm)
        num_masks = cfg.num_masks if cfg.spec_augment else 0
        self.spec_augment = SpecAugment(cfg.freq_mask, cfg.time_mask, num_masks)

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


def frames_for_samples(n_samples: int, hop_length: int, n_fft: int = 0) -> int:
    """Valid frames LogMel counts for `n_samples` samples (centred frames whose window ends
    inside the clip; with n_fft=0, every centred frame)."""
    return max(1, (n_samples - n_fft // 2) // hop_length + 1)


def eval_max_frames(cfg: FeaturesConfig) -> int:
    """Longest evaluation clip in feature frames (features.eval_max_seconds)."""
    return frames_for_samples(int(round(cfg.eval_max_seconds * cfg.sample_rate)), cfg.hop_length)
