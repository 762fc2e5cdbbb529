"""The channel a source is heard through: EQ colouring, band-limiting, codec-like round trips.

EQ      a random smooth gain curve: `eq_bands` control points log-spaced from 50 Hz to Nyquist,
        each uniform in `eq_gain_db`, interpolated over log-frequency, plus a random tilt in
        dB/octave around 1 kHz — the colouring of another microphone, channel or synthesiser.
        The same curve, evaluated at the mel band centres, offsets precomputed log-mel features.
band    a telephone-like band-pass: Butterworth magnitude of order BAND_ORDER at each edge
        (24 dB/octave), cut-offs drawn from `band_low_hz` / `band_high_hz`, applied zero-phase
        in one zero-padded FFT pass. Not re-levelled: what passes the band keeps its level, as
        through a real channel. FFT rather than IIR sections: faster than torchaudio's biquads
        and the libraries' band-pass filters (benchmarks/RESULTS.md, "Band-limiting").
codec   one of `codec_kinds`: "resample" down to a rate in `codec_rates` and back (torchaudio's
        windowed-sinc resampler, kernels cached: the rate is snapped to a ratio with a small
        denominator, so there are few kernels and each is cheap — 16 kHz → 11025 Hz exactly
        is 640/441, a round trip about 40x slower); "mulaw", 8-bit mu-law (the continuous
        curve with mu = 255 that G.711 approximates, by torchaudio's `mu_law_encoding` /
        `mu_law_decoding`); or "quantize", a uniform quantiser
        of `codec_bits` bits. Both quantisers work relative to the crop's peak (as a channel's
        automatic gain control would feed them), so the bit depth, not the recording level,
        sets how coarse they are.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import torch
import torchaudio

from audioclf.config import FeaturesConfig
from audioclf.data.augment.common import fft_length
from audioclf.data.augment.pitch import resample

EQ_LOWEST_HZ = 50.0  # the EQ curve is flat below its first control point
EQ_PIVOT_HZ = 1000.0  # the tilt leaves this frequency unchanged
EQ_PAD = 512  # zero padding for the zero-phase EQ filter: < -50 dB of its energy lies further out
BAND_ORDER = 4  # Butterworth order of each band edge: 24 dB/octave, about a telephone mask's slope
BAND_PAD = 1024  # zero padding for the band filter: its ringing at a 100 Hz cut-off is < 60 ms
CODEC_DENOMINATOR = 16  # codec rate / sample rate snapped to a fraction with at most this below
MULAW_CHANNELS = 256  # 8-bit mu-law


def eq_basis(freqs_hz: np.ndarray, sample_rate: int, bands: int) -> np.ndarray:
    """[bands + 1, len(freqs_hz)] float32: an EQ curve in dB is `coefficients @ eq_basis`.

    Rows 0..bands-1 interpolate the control-point gains linearly over log-frequency (control
    points log-spaced from EQ_LOWEST_HZ to Nyquist, flat below); the last row is the tilt, in
    octaves from EQ_PIVOT_HZ (so the tilt coefficient is in dB per octave). Waveforms (FFT bins)
    and log-mel features (mel band centres) share it: one draw is the same curve in both.
    """
    octaves = np.log2(np.maximum(np.asarray(freqs_hz, dtype=np.float64), EQ_LOWEST_HZ))
    controls = np.linspace(math.log2(EQ_LOWEST_HZ), math.log2(sample_rate / 2), bands)
    rows = [np.interp(octaves, controls, unit) for unit in np.eye(bands)]
    return np.stack([*rows, octaves - math.log2(EQ_PIVOT_HZ)]).astype(np.float32)


def curve_db(coefficients: np.ndarray, basis: np.ndarray) -> np.ndarray:
    return np.einsum("k,kf->f", coefficients, basis)  # einsum, not BLAS: see common.power


@functools.lru_cache(maxsize=16)
def eq_basis_rfft(size: int, sample_rate: int, bands: int) -> np.ndarray:
    return eq_basis(np.fft.rfftfreq(size, 1.0 / sample_rate), sample_rate, bands)


def mel_centre_frequencies(features: FeaturesConfig) -> np.ndarray:
    """Centre frequency in Hz of each mel band of the front end (HTK mel scale, as torchaudio)."""
    f_max = features.f_max if features.f_max is not None else features.sample_rate / 2
    low, high = 2595.0 * np.log10(1.0 + np.array([features.f_min, f_max]) / 700.0)
    mels = np.linspace(low, high, features.n_mels + 2)[1:-1]
    return 700.0 * (10.0 ** (mels / 2595.0) - 1.0)


@functools.lru_cache(maxsize=16)
def _rfft_hz(size: int, sample_rate: int) -> np.ndarray:
    hz = np.fft.rfftfreq(size, 1.0 / sample_rate)
    hz[0] = hz[1] / 2  # DC: the high-pass gain there is ~0 either way, without dividing by zero
    return hz


def band_limit(x: np.ndarray, sample_rate: int, low_hz: float, high_hz: float) -> np.ndarray:
    """`x` through a zero-phase band-pass with -3 dB at `low_hz` and `high_hz`; same length."""
    size = fft_length(x.shape[0] + BAND_PAD)
    hz = _rfft_hz(size, sample_rate)
    power_gain = 1.0 / (
        (1.0 + (low_hz / hz) ** (2 * BAND_ORDER)) * (1.0 + (hz / high_hz) ** (2 * BAND_ORDER))
    )
    spectrum = np.fft.rfft(x, size) * np.sqrt(power_gain).astype(np.float32)
    return np.fft.irfft(spectrum, size)[: x.shape[0]].astype(np.float32)


def codec_ratio(rate_hz: float, sample_rate: int) -> Fraction:
    """rate / sample_rate as a fraction with a small denominator (few, cheap resampling kernels)."""
    return Fraction(rate_hz / sample_rate).limit_denominator(CODEC_DENOMINATOR)


def resample_round_trip(x: np.ndarray, ratio: Fraction) -> np.ndarray:
    """Down to `ratio` of the sample rate and back up: what is above its Nyquist frequency goes."""
    wave = torch.from_numpy(x)
    low = resample(wave, ratio.denominator, ratio.numerator)  # reads d samples as n: fewer
    back = resample(low, ratio.numerator, ratio.denominator)
    return back[: x.shape[0]].numpy()


def mulaw_round_trip(x: np.ndarray) -> np.ndarray:
    """8-bit mu-law encoding and decoding, relative to the crop's peak (silence unchanged)."""
    peak = float(np.max(np.abs(x)))
    if peak == 0.0:
        return x
    unit = torch.from_numpy(x / np.float32(peak)).clamp(-1.0, 1.0)
    codes = torchaudio.functional.mu_law_encoding(unit, MULAW_CHANNELS)
    decoded = torchaudio.functional.mu_law_decoding(codes, MULAW_CHANNELS).numpy()
    return decoded.astype(np.float32) * np.float32(peak)


def quantize_round_trip(x: np.ndarray, bits: int) -> np.ndarray:
    """A uniform mid-tread quantiser of `bits` bits over ± the crop's peak (silence stays 0)."""
    peak = float(np.max(np.abs(x)))
    if peak == 0.0:
        return x
    steps = np.float32((2 ** (bits - 1) - 1) / peak)  # levels on each side of zero
    return np.round(x * steps) / steps
