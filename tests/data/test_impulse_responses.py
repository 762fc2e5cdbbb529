"""augment.ir_dir: measured impulse responses read, checked and applied from the crop's rng.

The responses are generated here (exponentially decaying noise behind a delayed direct path,
written at 8, 16 and 48 kHz with soundfile), not taken from a package.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from audioclf.config import AugmentConfig, ConfigError, FeaturesConfig
from audioclf.data.augment import Augmenter

SR = 16000
FEATURES = FeaturesConfig(sample_rate=SR)
CROP = 8000
OTHER_PIECES = ("speed_prob", "reverb_prob", "eq_prob", "noise_prob", "gain_prob")


def write_response(path: Path, rate: int, seconds: float, delay_s: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    tail = rng.standard_normal(n) * np.exp(-np.arange(n) / (0.05 * rate)) * 0.1
    wave = np.zeros(n + int(delay_s * rate))
    wave[int(delay_s * rate) :] = tail
    wave[int(delay_s * rate)] = 1.0  # the direct path, the largest sample
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(path), wave.astype(np.float32), rate)


@pytest.fixture
def ir_dir(tmp_path) -> Path:
    folder = tmp_path / "irs"
    write_response(folder / "mic_a.wav", 8000, 0.2, 0.01, seed=1)
    write_response(folder / "rooms" / "hall.wav", 48000, 0.5, 0.003, seed=2)
    write_response(folder / "mic_b.wav", SR, 0.1, 0.0, seed=3)
    (folder / "notes.txt").write_text("not audio, not a .wav: ignored")
    return folder


def augmenter(ir_dir: Path | str, **fields) -> Augmenter:
    cfg = AugmentConfig(
        enabled=True,
        ir_dir=str(ir_dir) if ir_dir else "",
        **({name: 0.0 for name in OTHER_PIECES} | fields),
    )
    return Augmenter(cfg, FEATURES, CROP)


def crop(seed: int = 0) -> torch.Tensor:
    t = np.arange(CROP) / SR
    rng = np.random.default_rng(seed)
    x = 0.2 * np.sin(2 * math.pi * 440 * t) + 0.01 * rng.standard_normal(CROP)
    return torch.from_numpy(x.astype(np.float32))


def test_responses_are_read_at_any_rate_resampled_trimmed_and_unit_energy(ir_dir):
    responses = augmenter(ir_dir, ir_prob=1.0).impulse_responses
    assert len(responses) == 3  # the .txt is skipped; sorted: mic_a, mic_b, rooms/hall
    lengths = [r.shape[0] for r in responses]
    # resampled to 16 kHz and cut at the direct path: 0.2 s, 0.1 s and 0.5 s of tail
    assert lengths == pytest.approx([0.2 * SR, 0.1 * SR, 0.5 * SR], abs=40)
    for response in responses:
        assert np.argmax(np.abs(response)) == 0
        assert float(np.sum(response.astype(np.float64) ** 2)) == pytest.approx(1.0, rel=1e-5)


def reference(x: np.ndarray, response: np.ndarray, wet: float) -> np.ndarray:
    """np.convolve, trimmed, mixed wet/dry, brought back to the crop's RMS."""
    wet_signal = np.convolve(x.astype(np.float64), response[: x.shape[0]])[: x.shape[0]]
    y = wet * wet_signal + (1 - wet) * x
    return y * np.sqrt(np.mean(x.astype(np.float64) ** 2) / np.mean(y**2))


def test_a_crop_is_the_drawn_response_mixed_wet_dry_at_its_own_level(ir_dir):
    augment = augmenter(ir_dir, ir_prob=1.0, ir_wet=(0.3, 0.9))
    x = crop()
    out = augment.after_crop(x, np.random.default_rng(7)).numpy()
    rng = np.random.default_rng(7)  # the draws after_crop makes: chance, which, wet
    assert rng.random() < 1.0
    response = augment.impulse_responses[int(rng.integers(3))]
    wet = float(rng.uniform(0.3, 0.9))
    np.testing.assert_allclose(out, reference(x.numpy(), response, wet), atol=1e-5)
    assert not np.allclose(out, x.numpy(), atol=1e-3)


def test_same_rng_same_crop_in_a_pickled_copy_other_seeds_differ(ir_dir):
    augment = augmenter(ir_dir, ir_prob=1.0, reverb_prob=0.5, eq_prob=0.5)
    copy = pickle.loads(pickle.dumps(augment))
    x = crop()
    first = augment.after_crop(x, np.random.default_rng(3))
    torch.testing.assert_close(copy.after_crop(x, np.random.default_rng(3)), first)
    others = [augment.after_crop(x, np.random.default_rng(s)) for s in range(4, 8)]
    assert not any(torch.allclose(first, other) for other in others)


def test_without_ir_dir_the_other_pieces_draw_as_before(ir_dir):
    x = crop()
    plain = augmenter("", reverb_prob=1.0, eq_prob=1.0)
    off = augmenter(ir_dir, ir_prob=0.0, reverb_prob=1.0, eq_prob=1.0)
    assert off.impulse_responses == []
    for seed in range(3):
        torch.testing.assert_close(
            off.after_crop(x, np.random.default_rng(seed)),
            plain.after_crop(x, np.random.default_rng(seed)),
        )


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.write_bytes(b"RIFF not really a wav"), "cannot be used"),
        (lambda p: soundfile.write(str(p), np.zeros(800, np.float32), SR), "is silent"),
    ],
    ids=["undecodable", "silent"],
)
def test_a_bad_response_is_one_line_naming_the_file(ir_dir, make, message):
    bad = ir_dir / "rooms" / "bad.wav"
    make(bad)
    with pytest.raises(ConfigError) as info:
        augmenter(ir_dir, ir_prob=0.5)
    text = str(info.value)
    assert str(bad) in text and message in text and "\n" not in text


def test_a_missing_or_empty_folder_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="augment.ir_dir=.*no such folder"):
        augmenter(tmp_path / "absent", ir_prob=0.5)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="augment.ir_dir=.*no .wav files"):
        augmenter(tmp_path / "empty", ir_prob=0.5)


def test_ir_wet_outside_0_1_names_the_key():
    with pytest.raises(ValueError, match="augment.ir_wet"):
        AugmentConfig(ir_wet=(0.5, 1.5))
