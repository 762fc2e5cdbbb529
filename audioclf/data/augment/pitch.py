"""Tempo and pitch of the source, before the crop: speed, pitch shift, time stretch.

speed    resampling by a factor from `speed_factors` (0.9 → `resample(orig=9, new=10)`), so
         tempo and pitch change together, as Kaldi's/WeSpeaker's speed perturbation.
pitch    a shift by a number of semitones drawn from `pitch_semitones`, tempo unchanged: the
         clip is resampled by the pitch ratio (pitch and tempo change), then time-stretched
         back to its duration. The ratio 2^(semitones / 12) is snapped to a fraction with a
         denominator of at most PITCH_DENOMINATOR (off by < 0.09 semitones), which keeps each
         resampling kernel small (0.1 ms a crop, 0.2 ms to build; a per-process cache keeps
         the last RESAMPLER_CACHE). `torchaudio.functional.pitch_shift` instead resamples from
         int(sample_rate / ratio) to sample_rate: a new, huge kernel for nearly every draw
         (9 s for one call at 16 kHz, measured in `benchmarks/augment_cost.py`).
stretch  tempo times a factor drawn from `stretch_factors`, pitch unchanged.

Pitch and stretch share one phase vocoder pass (`time_stretch`: torch.stft / istft, windows of
about 32 ms with 75 % overlap), at the rate that makes the clip's duration what stretch asks.
Own code on torch's STFT rather than `torchaudio.functional.phase_vocoder` or librosa's: both are
the plain vocoder, in which the bins of one partial drift apart after any onset and cancel (see
`time_stretch`); this one adds identity phase locking and costs less (benchmarks/RESULTS.md,
"Pitch and stretch").

On a clip longer than one crop needs, only a random window (crop × the duration factor, plus a
margin for the resampler's filter and the STFT's edges) is processed and exactly one crop, the
middle of the result, is returned: the cost stays bounded by the crop, not the clip length (on
10 s clips: pitch + stretch 2.3 ms per crop, 10.7 ms on the whole clip). A shorter clip is
processed whole and comes out len × the duration factor long.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import torch
import torchaudio

SPEED_MARGIN = 32  # input samples kept on each side of a speed window (resampler filter support)
PITCH_DENOMINATOR = 100  # pitch ratios snapped to fractions p / q with q <= this
RESAMPLER_CACHE = 128  # resampling kernels kept per process (each < 50 kB)
STFT_SECONDS = 0.032  # phase vocoder window: 512 samples at 16 kHz, a common choice for speech
TWO_PI = 2.0 * math.pi


def ratio_of(factor: float, denominator: int) -> tuple[int, int]:
    """`factor` as (orig, new) with small integers: 0.9 → (9, 10) reads 9 samples as 10."""
    return Fraction(factor).limit_denominator(denominator).as_integer_ratio()


def stft_size(sample_rate: int) -> int:
    """The phase vocoder's window: the power of two nearest STFT_SECONDS (at least 64)."""
    return 1 << max(6, round(math.log2(STFT_SECONDS * sample_rate)))


@functools.lru_cache(maxsize=RESAMPLER_CACHE)
def _resampler(orig: int, new: int) -> torchaudio.transforms.Resample:
    return torchaudio.transforms.Resample(orig, new)  # kernels built once per process


def resample(wave: torch.Tensor, orig: int, new: int) -> torch.Tensor:
    """`wave` read as `orig` samples for every `new` (length × new / orig, pitch × orig / new)."""
    with torch.no_grad():
        return _resampler(orig, new)(wave.float()).contiguous()


def speed_perturb(
    wave: torch.Tensor, orig: int, new: int, crop: int, rng: np.random.Generator
) -> torch.Tensor:
    """Speed by orig / new: the whole clip if short, else one `crop` of a random window."""
    window = math.ceil(crop * orig / new) + 2 * SPEED_MARGIN
    if wave.shape[0] <= window:
        return resample(wave, orig, new)
    start = int(rng.integers(0, wave.shape[0] - window + 1))
    resampled = resample(wave[start : start + window], orig, new)
    skip = SPEED_MARGIN * new // orig  # drop the window edges the filter saw zeros past
    return resampled[skip : skip + crop]


def shift_and_stretch(
    wave: torch.Tensor,
    speed: tuple[int, int] | None,
    pitch: tuple[int, int] | None,
    rate: float | None,
    crop: int,
    rng: np.random.Generator,
    n_fft: int,
) -> torch.Tensor:
    """Speed (orig, new), pitch ratio (orig, new: pitch × orig / new, same tempo) and tempo ×
    `rate` (same pitch), each optional: the whole clip if short, else one `crop` of a window."""
    speed_factor = speed[0] / speed[1] if speed is not None else 1.0
    pitch_factor = pitch[0] / pitch[1] if pitch is not None else 1.0
    tempo = speed_factor * (rate if rate is not None else 1.0)  # the duration is divided by it
    margin = SPEED_MARGIN + n_fft
    window = math.ceil(crop * tempo) + 2 * margin
    long = wave.shape[0] > window
    if long:
        start = int(rng.integers(0, wave.shape[0] - window + 1))
        wave = wave[start : start + window]
    length = max(1, round(wave.shape[0] / tempo))
    if speed is not None:
        wave = resample(wave, *speed)
    if pitch is not None:
        wave = resample(wave, *pitch)  # pitch and tempo × pitch_factor
    # The stretch that brings the duration to `length`: undo the pitch's tempo, apply `rate`.
    stretch = (rate if rate is not None else 1.0) / pitch_factor
    if stretch != 1.0:
        wave = time_stretch(wave, stretch, length, n_fft)
    if not long:
        return wave
    skip = (wave.shape[0] - crop) // 2  # the middle: the edges saw the window's boundaries
    return wave[skip : skip + crop]


@functools.lru_cache(maxsize=8)
def _vocoder_tables(n_fft: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Window; each bin's expected phase advance per hop, mod 2π, as [1, bins]; bin indices."""
    hop = n_fft // 4
    advance = 2.0 * math.pi * hop * torch.arange(n_fft // 2 + 1, dtype=torch.float64) / n_fft
    wrapped = torch.remainder(advance, TWO_PI).float().unsqueeze(0)
    return torch.hann_window(n_fft), wrapped, torch.arange(n_fft // 2 + 1)


def time_stretch(wave: torch.Tensor, rate: float, length: int, n_fft: int) -> torch.Tensor:
    """`wave` played `rate` times as fast at the same pitch, `length` samples (phase vocoder).

    Output frame k reads the input at frame k · rate: magnitudes interpolated linearly between
    the two nearest frames, phase advanced by each bin's measured advance between them (the
    last input frame is held past the end, so the output has no fade-out). Then identity phase
    locking (Laroche & Dolson, 1999): each bin keeps its phase relation, in the input frame, to
    the spectral peak it belongs to, and only peaks carry the accumulated phase. Without it the
    bins of one partial drift apart after any onset and cancel: a 1234 Hz tone stretched by
    0.85 came out 14 dB quieter with the plain vocoder (as `torchaudio.functional.
    phase_vocoder` and librosa's), 0.0 dB with locking.
    """
    window, advance, bins = _vocoder_tables(n_fft)
    hop = n_fft // 4
    pad_mode = "reflect" if wave.shape[0] > n_fft // 2 else "constant"
    spec = torch.stft(wave, n_fft, hop, window=window, pad_mode=pad_mode, return_complex=True)
    spec = spec.T  # [frames, bins]: the gathers below then copy whole rows
    frames = spec.shape[0]
    steps = torch.arange(-(-length // hop) + 1, dtype=torch.float64) * rate
    first = steps.floor().long().clamp(max=frames - 1)
    second = (first + 1).clamp(max=frames - 1)
    alpha = (steps - steps.floor()).float().clamp(max=1.0).unsqueeze(1)
    magnitude, angle = spec.abs().contiguous(), spec.angle().contiguous()
    magnitude = torch.lerp(magnitude[first], magnitude[second], alpha)
    angle_first = angle[first]
    # The advance first → second as its deviation from the bin's expected advance, wrapped to
    # [-π, π], plus that advance mod 2π: the same angle mod 2π, small enough to sum in float32.
    deviation = angle[second] - angle_first - advance
    deviation -= TWO_PI * torch.round(deviation / TWO_PI)
    phase = torch.cumsum(torch.cat([angle[:1], (deviation + advance)[:-1]]), dim=0)
    peak = _peak_of_each_bin(magnitude, bins)
    phase = phase.gather(1, peak) + (angle_first - angle_first.gather(1, peak))
    # cos and sin, not torch.polar: measured 3x cheaper here.
    stretched = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    return torch.istft(stretched.T, n_fft, hop, window=window, length=length)


def _peak_of_each_bin(magnitude: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """[frames, bins] index of the local maximum each bin climbs to within 3 steps of ±1 bin
    (a Hann window's main lobe is ±2 bins wide). Comparisons and gathers, not max_pool1d's
    indices, which took half of the vocoder's time."""
    below = torch.cat([magnitude[:, :1], magnitude[:, :-1]], dim=1)
    above = torch.cat([magnitude[:, 1:], magnitude[:, -1:]], dim=1)
    up = above > torch.maximum(magnitude, below)
    down = (below > magnitude) & (below >= above)
    peak = bins + up.long() - down.long()
    peak = peak.gather(1, peak)
    return peak.gather(1, peak)
