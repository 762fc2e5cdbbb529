"""Measured impulse responses from a folder (`augment.ir_dir`): microphones, loudspeakers, rooms.

Every .wav under the folder (searched recursively) is read once when the Augmenter is built,
mixed to mono and resampled to features.sample_rate, trimmed to start at its largest
absolute sample (the direct path: a response's leading silence would only delay the crop)
and to at most `IR_MAX_SECONDS`, and scaled to unit energy. A file that cannot be read, or that
is silent, stops the run with one line naming it. A crop convolved with a response is mixed
wet/dry by the caller (`wet_dry_kernel`) and brought back to its own RMS level.

Where to get measured responses: microphone and device responses (MicIRP), rooms (OpenAIR, the
MIT IR Survey, the Aachen AIR database, BUT ReverbDB); docs/training.md, "Augmentation".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from audioclf.config import ConfigError
from audioclf.data.readers import load_audio

IR_SUFFIXES = (".wav",)
IR_MAX_SECONDS = 2.0  # a response is cut after this long (a crop's convolution is trimmed anyway)


def load_impulse_responses(folder: str, sample_rate: int) -> list[np.ndarray]:
    """The folder's responses (float32, unit energy, direct path at sample 0), sorted by path."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(
            f"config key augment.ir_dir={folder!r}: no such folder; give a folder of .wav "
            "impulse responses, or set augment.ir_dir to ''"
        )
    paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in IR_SUFFIXES and p.is_file())
    if not paths:
        raise ConfigError(
            f"config key augment.ir_dir={folder!r}: no .wav files in it; add impulse responses "
            "or set augment.ir_dir to ''"
        )
    return [_read_response(path, sample_rate) for path in paths]


def _read_response(path: Path, sample_rate: int) -> np.ndarray:
    try:
        wave = load_audio(path, sample_rate).numpy().astype(np.float32)
    except ValueError as exc:  # AudioReadError: undecodable, empty or non-finite
        raise ConfigError(
            f"augment.ir_dir: impulse response {path} cannot be used ({exc}); remove or fix it"
        ) from exc
    start = int(np.argmax(np.abs(wave)))
    wave = wave[start : start + max(1, int(IR_MAX_SECONDS * sample_rate))]
    energy = float(np.dot(wave.astype(np.float64), wave.astype(np.float64)))
    if not energy > 0.0:
        raise ConfigError(
            f"augment.ir_dir: impulse response {path} is silent; remove it from the folder"
        )
    return (wave / np.sqrt(energy)).astype(np.float32)


def wet_dry_kernel(response: np.ndarray, wet: float) -> np.ndarray:
    """The filter of `wet` · response + (1 - wet) · the dry signal: the response with
    (1 - wet) added at its direct path (sample 0)."""
    kernel = response * np.float32(wet)
    kernel[0] += np.float32(1.0 - wet)
    return kernel
