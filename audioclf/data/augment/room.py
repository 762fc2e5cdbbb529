"""Reverberation: a synthetic room impulse response (config `augment.reverb_*`).

Unit direct path, a few discrete early echoes, and a diffuse tail of white noise decaying by
60 dB in RT60 seconds, scaled to a random direct-to-reverberant ratio and normalised to unit
energy. Own code, not pyroomacoustics: its image-source responses cost orders of magnitude more
(benchmarks/RESULTS.md, "Room responses").
"""

from __future__ import annotations

import math

import numpy as np

from audioclf.data.augment.common import power, uniform, zero_mean_uniform

EARLY_REFLECTIONS_S = (0.002, 0.040)  # window of the discrete early echoes after the direct path
TAIL_ONSET_S = (0.002, 0.010)  # the diffuse tail starts this long after the direct path


def room_impulse_response(
    rng: np.random.Generator,
    sample_rate: int,
    rt60: float,
    drr_db: float,
    early_reflections: int,
    max_length: int | None = None,
) -> np.ndarray:
    """A synthetic room impulse response, float32 with unit energy, direct path at sample 0.

    Diffuse tail: white noise under an exponential envelope that falls by 60 dB in `rt60`
    seconds, starting 2-10 ms after the direct path. Early reflections: `early_reflections`
    taps of random sign 2-40 ms after the direct path, 2-6 times the tail's envelope there.
    Tail and reflections together are scaled so that direct / reverberant energy is `drr_db`.
    The response is `rt60` seconds long, or `max_length` samples if shorter (a longer one would
    only add to what is trimmed off after the convolution).
    """
    length = max(2, int(round(rt60 * sample_rate)))
    if max_length is not None:
        length = max(2, min(length, max_length))
    decay = 3.0 * math.log(10.0) / (rt60 * sample_rate)  # amplitude: 10^-3 (= -60 dB) at rt60
    # The tail's RMS at each sample (sqrt(12): unit variance of the zero-mean uniform noise).
    envelope = np.float32(math.sqrt(12.0)) * np.exp(-decay * np.arange(length, dtype=np.float32))
    reverberant = zero_mean_uniform(rng, length) * envelope
    onset = max(1, int(round(uniform(rng, TAIL_ONSET_S) * sample_rate)))
    reverberant[:onset] = 0.0
    if early_reflections:
        delays = rng.uniform(*EARLY_REFLECTIONS_S, size=early_reflections) * sample_rate
        delays = np.clip(np.round(delays).astype(np.int64), 1, length - 1)
        signs = np.where(rng.random(early_reflections) < 0.5, -1.0, 1.0)
        amplitudes = rng.uniform(2.0, 6.0, size=early_reflections) * signs
        np.add.at(reverberant, delays, (amplitudes * envelope[delays]).astype(np.float32))
    energy = power(reverberant) * length
    if energy > 0.0:
        reverberant *= np.float32(math.sqrt(10.0 ** (-drr_db / 10.0) / energy))
    reverberant[0] = 1.0  # the direct path
    return reverberant / np.float32(math.sqrt(power(reverberant) * length))
