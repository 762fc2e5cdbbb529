"""Additive noise: generated white / pink / brown, or segments of recordings (`augment.noise_*`).

Coloured noise is shaped in the frequency domain, with nothing below 20 Hz (where brown noise
would put half its energy, outside the mel range). A file segment is a random window of a
random file under `noise_dir` (tiled from a random offset if shorter than the crop); a file is
picked uniformly, not by duration. Either is scaled to a random SNR over the whole crop.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

from audioclf.config import ConfigError
from audioclf.data.augment.common import power, zero_mean_uniform

NOISE_SUFFIXES = (".wav", ".flac", ".ogg")
NOISE_LOWEST_HZ = 20.0  # coloured noise has no energy below this (brown would be mostly drift)
NOISE_EXPONENTS = {"white": 0.0, "pink": 1.0, "brown": 2.0}  # power spectrum ∝ 1 / f^exponent


def add_noise(x: np.ndarray, noise: np.ndarray, snr_db: float) -> np.ndarray:
    """x + noise scaled so that power(x) / power(noise) is `snr_db` over the whole crop.

    A silent crop or silent noise segment is returned unchanged (no SNR is defined).
    """
    power_x, power_noise = power(x), power(noise)
    if power_x == 0.0 or power_noise == 0.0:
        return x
    scale = math.sqrt(power_x / (power_noise * 10.0 ** (snr_db / 10.0)))
    return x + noise * np.float32(scale)


def colored_noise(
    color: str, length: int, sample_rate: int, rng: np.random.Generator
) -> np.ndarray:
    """float32 noise of `length` samples, power spectrum ∝ 1/f^k (white 0, pink 1, brown 2)."""
    exponent = NOISE_EXPONENTS[color]
    if exponent == 0.0:
        return zero_mean_uniform(rng, length)
    spectrum = zero_mean_uniform(rng, 2 * (length // 2 + 1)).view(np.complex64)  # white, complex
    spectrum *= _noise_amplitudes(exponent, length, sample_rate)
    return np.fft.irfft(spectrum, length)


@functools.lru_cache(maxsize=16)
def _noise_amplitudes(exponent: float, length: int, sample_rate: int) -> np.ndarray:
    """Amplitude f^(-exponent/2) of each rfft bin; zero below NOISE_LOWEST_HZ (and at DC)."""
    hz = np.fft.rfftfreq(length, 1.0 / sample_rate)
    amplitudes = np.maximum(hz, NOISE_LOWEST_HZ) ** (-exponent / 2.0)
    amplitudes[hz < NOISE_LOWEST_HZ] = 0.0
    return amplitudes.astype(np.float32)


def segment(source: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    """A random `length`-sample window of `source`, tiled from a random offset if it is shorter."""
    if source.shape[0] >= length:
        start = int(rng.integers(0, source.shape[0] - length + 1))
        return source[start : start + length]
    offset = int(rng.integers(source.shape[0]))
    copies = -(-(offset + length) // source.shape[0])
    return np.tile(source, copies)[offset : offset + length]


def find_noise_files(folder: str | Path) -> list[str]:
    """Audio files under `folder` (recursive, sorted): the recordings of `augment.noise_dir`."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(
            f"config key augment.noise_dir={str(folder)!r}: folder {root} does not exist; point it "
            'at a folder of noise recordings, or set augment.noise_dir="" for generated noise'
        )
    files = sorted(
        str(p) for p in root.rglob("*") if p.suffix.lower() in NOISE_SUFFIXES and p.is_file()
    )
    if not files:
        raise ConfigError(
            f"config key augment.noise_dir={str(folder)!r}: folder {root} holds no "
            f"{', '.join(NOISE_SUFFIXES)} files (searched recursively); add noise recordings, or "
            'set augment.noise_dir="" for generated noise only'
        )
    return files
