"""Building blocks shared by the augmentation pieces: seeded draws, signal level, FFT lengths.

Every function that draws takes the item's `numpy.random.Generator`, never global state.
"""

from __future__ import annotations

import math

import numpy as np


def chance(rng: np.random.Generator, probability: float) -> bool:
    """True with `probability`; draws nothing when it is 0, so a piece that is off leaves the
    generator (and so every later draw of the item) as it was."""
    return probability > 0.0 and rng.random() < probability


def uniform(rng: np.random.Generator, low_high: tuple[float, float]) -> float:
    return float(rng.uniform(low_high[0], low_high[1]))


def power(x: np.ndarray) -> float:
    """Mean square. einsum, not BLAS: no thread pool in the workers, and the same bits for any
    thread setting of the process (float32 partial sums, ~1e-7 relative error)."""
    return float(np.einsum("i,i->", x, x)) / max(1, x.shape[0])


def zero_mean_uniform(rng: np.random.Generator, length: int) -> np.ndarray:
    """float32 noise uniform in [-0.5, 0.5). Drawing it is ~3x cheaper than Gaussian noise, and
    only its flat spectrum matters: each mel band sums many bins, which makes it Gaussian."""
    return rng.random(length, dtype=np.float32) - np.float32(0.5)


def fft_length(n: int) -> int:
    """Smallest c · 2^k >= n with c in (8, 10, 12, 15): fast for pocketfft, and only four
    lengths per octave, so the per-length tables (EQ basis, band frequencies) stay cached."""
    k = max(0, n.bit_length() - 5)
    while True:
        for c in (8, 10, 12, 15):
            if c << k >= n:
                return c << k
        k += 1


def match_level(y: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """`y` scaled to the RMS level of `reference` (unchanged if either is silent)."""
    power_y, power_ref = power(y), power(reference)
    if power_y == 0.0 or power_ref == 0.0:
        return y
    return y * np.float32(math.sqrt(power_ref / power_y))
