"""Log-mel spectrograms: the LogMel module the model's front end runs on the device, and the
same computation offline for one clip (to precompute .npy features: prepare, the demo).

A layer below both data/ and models/, so either may use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
import torchaudio
from torch import Tensor, nn

from audioclf.config import FeaturesConfig

LOG_OFFSET = 1e-6  # added to mel power before the log, so silence gives log(1e-6), not -inf
DB_TO_LOG_POWER = math.log(10.0) / 10.0  # log-mel is the natural log of power: 1 dB in its units


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

    Gives the same frames as the training front end's LogMel (T: its valid frames, those whose
    window ends inside the clip), so precomputed and on-the-fly features are interchangeable
    (normalisation happens later, per utterance, in the model).
    """
    key = (
        cfg.sample_rate,
        cfg.n_fft,
        cfg.win_length,
        cfg.hop_length,
        cfg.n_mels,
        cfg.f_min,
        cfg.f_max,
    )
    if key not in _LOG_MEL_CACHE:
        _LOG_MEL_CACHE[key] = LogMel(cfg)
    wave = torch.as_tensor(wave, dtype=torch.float32)
    if wave.dim() != 1:
        raise ValueError(f"log_mel expects a 1-D waveform, got shape {tuple(wave.shape)}")
    with torch.no_grad():
        feats, frames = _LOG_MEL_CACHE[key](wave.unsqueeze(0), torch.tensor([wave.shape[0]]))
    return feats[0, : int(frames[0])].numpy()  # only the valid frames, as the front end counts them
