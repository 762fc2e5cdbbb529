"""Augmentation of training crops (audioclf.data.augment): seeded, shape-keeping, in range."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
import torchaudio

from audioclf.config import AugmentConfig, Config, ConfigError, FeaturesConfig, load_config
from audioclf.data.augment import Augmenter, room_impulse_response
from audioclf.data.augment.channel import codec_ratio
from audioclf.data.augment.pitch import time_stretch
from audioclf.spectrogram import DB_TO_LOG_POWER
from tests.helpers import ROOT

SR = 16000
FEATURES = FeaturesConfig(sample_rate=SR)
CROP = 8000  # samples: 0.5 s crops
PIECES = ("speed_prob", "reverb_prob", "eq_prob", "noise_prob", "gain_prob")
SOURCE_PIECES = ("pitch_prob", "stretch_prob", "band_prob", "codec_prob")  # off by default


def only(**fields) -> Augmenter:
    """An enabled Augmenter with every piece off except the probabilities/fields given."""
    cfg = AugmentConfig(enabled=True, **({name: 0.0 for name in PIECES} | fields))
    return Augmenter(cfg, FEATURES, CROP)


def all_on() -> Augmenter:
    """Every piece at probability 1; speed never 1.0, so it always changes the clip."""
    cfg = AugmentConfig(
        enabled=True,
        speed_factors=(0.9, 1.1),
        noise_colors=("pink",),
        **{name: 1.0 for name in PIECES + SOURCE_PIECES},
    )
    return Augmenter(cfg, FEATURES, CROP)


def signal(n: int = 8000, seed: int = 0) -> torch.Tensor:
    """Three tones plus a little noise, peak about 0.3 (no piece needs to limit its peak)."""
    t = np.arange(n) / SR
    rng = np.random.default_rng(seed)
    x = sum(0.08 * np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) for f in (220.0, 1300.0, 4100.0))
    return torch.from_numpy((x + 0.01 * rng.standard_normal(n)).astype(np.float32))


def tone(hz: float, samples: int, amplitude: float = 1.0) -> torch.Tensor:
    wave = amplitude * np.sin(2 * np.pi * hz * np.arange(samples) / SR)
    return torch.from_numpy(wave.astype(np.float32))


def power(x) -> float:
    return float(np.mean(np.square(np.asarray(x, dtype=np.float64))))


def peak_hz(x) -> float:
    spectrum = np.abs(np.fft.rfft(np.asarray(x, dtype=np.float64) * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1.0 / SR)[np.argmax(spectrum)])


def augment_item(augment: Augmenter, wave: torch.Tensor, seed: int) -> torch.Tensor:
    """What the dataset does with a training clip: speed, crop, the rest."""
    rng = np.random.default_rng(seed)
    wave = augment.before_crop(wave, rng)
    start = int(rng.integers(0, max(1, wave.shape[0] - CROP + 1)))
    return augment.after_crop(wave[start : start + CROP], rng)


def test_off_by_default_returns_input_and_draws_nothing():
    augment = Augmenter(Config().augment, FEATURES, CROP)
    assert not AugmentConfig().enabled and not augment.enabled
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    wave, feats = signal(12000), np.ones((20, FEATURES.n_mels), np.float32)
    assert augment.before_crop(wave, rng) is wave
    crop = wave[:8000]
    assert augment.after_crop(crop, rng) is crop
    assert augment.log_mel(feats, 0) is feats and augment.log_mel_offsets([0, 1]) is None
    assert rng.bit_generator.state == state  # so crops stay those of a run without augmentation


def test_same_seed_same_output_other_seed_differs():
    augment, wave = all_on(), signal(12000)
    before = wave.clone()
    first, again, other = (augment_item(augment, wave, seed) for seed in (7, 7, 8))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert torch.equal(wave, before)  # the input is never modified in place
    feats = np.random.default_rng(1).standard_normal((30, FEATURES.n_mels)).astype(np.float32)
    assert np.array_equal(augment.log_mel(feats, 7), augment.log_mel(feats, 7))
    assert not np.array_equal(augment.log_mel(feats, 7), augment.log_mel(feats, 8))


@pytest.mark.slow
def test_pickled_copy_in_another_process_gives_identical_output():
    # Another process with other thread counts (as the main process and a worker can differ).
    augment, wave = all_on(), signal(12000)
    script = (
        "import pickle, sys\n"
        "import numpy as np, torch\n"
        "torch.set_num_threads(3)\n"
        "augment, wave = pickle.load(sys.stdin.buffer)\n"
        "rng = np.random.default_rng(11)\n"
        "wave = augment.before_crop(wave, rng)\n"
        "start = int(rng.integers(0, max(1, wave.shape[0] - 8000 + 1)))\n"
        "out = augment.after_crop(wave[start : start + 8000], rng)\n"
        "sys.stdout.buffer.write(pickle.dumps(out.numpy()))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3"}
    child = subprocess.run(
        [sys.executable, "-c", script],
        input=pickle.dumps((augment, wave)),
        capture_output=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        check=True,
    )
    assert np.array_equal(pickle.loads(child.stdout), augment_item(augment, wave, 11).numpy())


@pytest.mark.parametrize("length", [1, 300, 8000, 12345])
def test_after_crop_keeps_length_and_stays_finite(length):
    augment = all_on()
    for seed in range(4):
        out = augment.after_crop(signal(length, seed), np.random.default_rng(seed))
        assert out.shape == (length,) and out.dtype == torch.float32
        assert torch.isfinite(out).all() and float(out.abs().max()) <= 1.0


@pytest.mark.parametrize("factor", [0.9, 1.1])
def test_speed_changes_length_and_pitch_by_the_factor(factor):
    augment = only(speed_prob=1.0, speed_factors=(factor,))
    out = augment.before_crop(tone(1000.0, 4000), np.random.default_rng(0))
    assert abs(out.shape[0] - 4000 / factor) <= 1
    assert abs(peak_hz(out) - 1000.0 * factor) <= 10.0  # faster is higher, as in Kaldi
    # A clip longer than a crop needs: one crop of speed-changed audio, whatever the clip length.
    out = augment.before_crop(tone(1000.0, 5 * SR), np.random.default_rng(0))
    assert out.shape[0] == CROP
    assert abs(peak_hz(out) - 1000.0 * factor) <= 10.0
    assert float(out[:50].abs().max()) > 0.9 and float(out[-50:].abs().max()) > 0.9  # edges kept


def test_speed_factor_one_returns_the_clip():
    wave = signal(4000)
    augment = only(speed_prob=1.0, speed_factors=(1.0,))
    assert augment.before_crop(wave, np.random.default_rng(0)) is wave


@pytest.mark.parametrize("color", ["white", "pink", "brown"])
def test_generated_noise_snr_within_range(color):
    augment, wave = only(noise_prob=1.0, noise_snr_db=(3.0, 9.0), noise_colors=(color,)), signal()
    snrs = []
    for seed in range(12):
        out = augment.after_crop(wave, np.random.default_rng(seed))
        snrs.append(10 * np.log10(power(wave) / power(out - wave)))
    assert 2.5 <= min(snrs) and max(snrs) <= 9.5, snrs
    assert max(snrs) - min(snrs) > 1.0  # drawn per crop, not fixed


def test_noise_colours_have_their_spectral_slope():
    slopes = {}
    for color in ("white", "pink", "brown"):
        augment = only(noise_prob=1.0, noise_snr_db=(0.0, 0.0), noise_colors=(color,))
        wave = torch.from_numpy(1e-3 * np.random.default_rng(0).random(32000, dtype=np.float32))
        noise = (augment.after_crop(wave, np.random.default_rng(3)) - wave).numpy()
        spectrum = np.abs(np.fft.rfft(noise)) ** 2
        hz = np.fft.rfftfreq(32000, 1.0 / SR)
        low = spectrum[(hz > 200) & (hz < 400)].mean()
        high = spectrum[(hz > 3200) & (hz < 6400)].mean()
        slopes[color] = 10 * np.log10(high / low) / 4  # dB per octave over 4 octaves
    assert abs(slopes["white"]) < 1.0
    assert abs(slopes["pink"] + 3.0) < 1.0
    assert abs(slopes["brown"] + 6.0) < 1.0


def test_gain_within_range_and_peak_limited():
    augment, wave = only(gain_prob=1.0, gain_db=(-4.0, 2.0)), signal()
    gains = [
        10 * np.log10(power(augment.after_crop(wave, np.random.default_rng(s))) / power(wave))
        for s in range(20)
    ]
    assert -4.001 <= min(gains) and max(gains) <= 2.001
    assert max(gains) - min(gains) > 1.0
    # A gain past full scale is scaled back to peak 1.0, not clipped: the waveform keeps its shape.
    loud = only(gain_prob=1.0, gain_db=(20.0, 20.0)).after_crop(wave, np.random.default_rng(0))
    assert float(loud.abs().max()) == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(loud, wave / wave.abs().max(), atol=1e-6)


def test_reverb_keeps_length_and_level_and_smears_a_click():
    augment = only(reverb_prob=1.0, reverb_rt60=(0.3, 0.3), reverb_drr_db=(0.0, 0.0))
    wave = signal()
    out = augment.after_crop(wave, np.random.default_rng(0))
    assert out.shape == wave.shape and torch.isfinite(out).all()
    assert power(out) == pytest.approx(power(wave), rel=1e-4)  # level-matched
    click = torch.zeros(8000)
    click[1000] = 1.0
    tail = augment.after_crop(click, np.random.default_rng(0)).numpy()
    assert np.abs(tail[:1000]).max() < 1e-5 * np.abs(tail).max()  # causal: nothing before the click
    assert np.abs(tail[1100:3000]).max() > 0.01 * np.abs(tail).max()  # energy 6-125 ms later


def test_room_impulse_response_has_its_rt60_and_drr():
    rt60, drr_db = 0.5, 6.0
    h = room_impulse_response(np.random.default_rng(0), SR, rt60, drr_db, early_reflections=0)
    assert h.dtype == np.float32 and h.shape == (int(rt60 * SR),)
    assert np.sum(h.astype(np.float64) ** 2) == pytest.approx(1.0, rel=1e-5)
    energy = h.astype(np.float64) ** 2
    assert 10 * np.log10(energy[0] / energy[1:].sum()) == pytest.approx(drr_db, abs=0.01)

    def energy_db(start: float, stop: float) -> float:
        return 10 * np.log10(energy[int(start * rt60 * SR) : int(stop * rt60 * SR)].sum())

    # The envelope falls 60 dB per rt60: windows 0.4 rt60 apart differ by 24 dB.
    assert energy_db(0.5, 0.6) - energy_db(0.1, 0.2) == pytest.approx(-24.0, abs=2.0)


def test_eq_changes_the_spectrum_not_the_length_or_level():
    augment = only(eq_prob=1.0, eq_gain_db=(-10.0, 10.0))
    wave = torch.from_numpy(0.1 * np.random.default_rng(0).standard_normal(8000).astype(np.float32))
    out = augment.after_crop(wave, np.random.default_rng(2))
    assert out.shape == wave.shape
    assert power(out) == pytest.approx(power(wave), rel=1e-4)
    hz = np.fft.rfftfreq(8000, 1.0 / SR)
    edges = np.geomspace(100, 7000, 9)
    bands_in, bands_out = (
        [
            np.sum(np.abs(np.fft.rfft(x.numpy()))[(hz >= lo) & (hz < hi)] ** 2)
            for lo, hi in zip(edges[:-1], edges[1:])
        ]
        for x in (wave, out)
    )
    change_db = 10 * np.log10(np.array(bands_out) / np.array(bands_in))
    assert change_db.max() - change_db.min() > 3.0


def test_log_mel_eq_matches_the_waveform_eq(monkeypatch):
    # The curve a log-mel crop's seed draws, applied to a waveform (EQ is the only piece on),
    # changes its mel bands as the log-mel offsets say.
    augment = only(eq_prob=1.0)
    drawn, eq_coefficients = [], augment._eq_coefficients
    monkeypatch.setattr(
        augment, "_eq_coefficients", lambda u: drawn.append(eq_coefficients(u)) or drawn[-1]
    )
    monkeypatch.setattr(augment, "_random_eq", lambda rng: drawn[-1][0])
    mel = torchaudio.transforms.MelSpectrogram(
        SR,
        n_fft=FEATURES.n_fft,
        win_length=FEATURES.win_length,
        hop_length=FEATURES.hop_length,
        f_min=FEATURES.f_min,
        n_mels=FEATURES.n_mels,
    )
    wave = torch.from_numpy(0.1 * np.random.default_rng(0).standard_normal(4 * SR, np.float32))
    # Below ~200 Hz a mel band is as wide as the curve's features, and log(mean) != mean(log).
    compared = augment.mel_centres_hz >= 200.0
    for seed in range(5):
        zeros = np.zeros((10, FEATURES.n_mels), np.float32)
        predicted = augment.log_mel(zeros, seed)[0]
        eq_wave = augment.after_crop(wave, np.random.default_rng(seed))
        measured = (torch.log(mel(eq_wave)).mean(1) - torch.log(mel(wave)).mean(1)).numpy()
        assert np.ptp(predicted) > 1.0
        # The waveform is level-matched afterwards, which shifts every band alike.
        error = (measured - measured.mean()) - (predicted - predicted.mean())
        assert np.abs(error[compared]).max() < 0.15, error  # natural-log units (0.15 ≈ 0.65 dB)


def test_log_mel_offsets_of_a_batch_are_each_crops_own_and_drawn_as_configured():
    # A batch reader draws a whole batch at once, the per-file reader one crop: the same bits.
    augment = only(eq_prob=0.4, gain_prob=0.6)
    seeds = np.random.default_rng(0).integers(0, 2**63 - 1, size=3000)
    batch = augment.log_mel_offsets(seeds)
    assert batch.shape == (3000, FEATURES.n_mels) and batch.dtype == np.float32
    for i in range(0, 3000, 97):
        alone = augment.log_mel_offsets([seeds[i]])  # None: neither EQ nor gain
        assert np.array_equal(batch[i], np.zeros(FEATURES.n_mels) if alone is None else alone[0])
    feats = np.ones((5, FEATURES.n_mels), np.float32)
    assert np.array_equal(augment.log_mel(feats, int(seeds[5])), feats + batch[5])
    # EQ bends the curve, gain shifts it: the shares drawn are the probabilities
    eq = np.ptp(batch, axis=1) > 1e-4
    gain_only = ~eq & (np.abs(batch[:, 0]) > 0)
    assert abs(eq.mean() - 0.4) < 0.03 and abs(gain_only.mean() - 0.6 * 0.6) < 0.03
    gain_db = batch[gain_only, 0] / DB_TO_LOG_POWER
    assert gain_db.min() >= -6.0 and gain_db.max() <= 6.0 and np.ptp(gain_db) > 10.0
    # a piece turned off draws as before for the others: gain-only crops keep their gain
    no_eq = only(eq_prob=0.0, gain_prob=0.6).log_mel_offsets(seeds)
    assert np.array_equal(no_eq[~eq], batch[~eq])
    assert only(eq_prob=0.0, gain_prob=0.0).log_mel_offsets(seeds) is None


def test_log_mel_keeps_shape_and_dtype_and_offsets_every_frame_alike():
    augment = only(eq_prob=1.0, gain_prob=1.0)
    feats = np.random.default_rng(0).standard_normal((50, FEATURES.n_mels)).astype(np.float32)
    out = augment.log_mel(feats, 0)
    assert out.shape == feats.shape and out.dtype == np.float32
    offset = out - feats
    assert np.abs(offset).max() > 0.05
    assert np.allclose(offset, offset[0], atol=1e-5)  # a per-bin offset, the same in every frame
    with pytest.raises(ValueError, match="features.n_mels"):
        augment.log_mel(feats[:, :10], 0)


def write_tone(path: Path, hz: float, samples: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(path, tone(hz, samples, amplitude=0.5).numpy(), SR)


def test_noise_files_are_used(tmp_path):
    write_tone(tmp_path / "a.wav", 3000.0, 1000)  # shorter than a crop: tiled
    write_tone(tmp_path / "sub" / "b.flac", 5000.0, 20000)  # found recursively
    (tmp_path / "notes.txt").write_text("not audio")
    augment = only(
        noise_prob=1.0, noise_file_prob=1.0, noise_dir=str(tmp_path), noise_snr_db=(10.0, 10.0)
    )
    assert [Path(p).name for p in augment.noise_files] == ["a.wav", "b.flac"]
    wave = tone(200.0, 8000, amplitude=0.3)
    picked = set()
    for seed in range(12):
        out = augment.after_crop(wave, np.random.default_rng(seed))
        picked.add(round(peak_hz(out - wave), -2))
        assert 10 * np.log10(power(wave) / power(out - wave)) == pytest.approx(10.0, abs=0.01)
    assert picked == {3000.0, 5000.0}


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_missing_or_empty_noise_dir_is_one_clear_error(tmp_path, make):
    folder = tmp_path / "noise"
    if make == "empty":
        folder.mkdir()
        (folder / "readme.txt").write_text("no audio here")
    cfg = AugmentConfig(enabled=True, noise_dir=str(folder))
    with pytest.raises(ConfigError, match="augment.noise_dir") as raised:
        Augmenter(cfg, FEATURES, CROP)
    assert str(folder) in str(raised.value)
    # Not checked while augmentation is off (e.g. evaluating the run on another machine).
    Augmenter(AugmentConfig(enabled=False, noise_dir=str(folder)), FEATURES, CROP)


@pytest.mark.parametrize(
    "override, key",
    [
        ("augment.gain_db=[3, -3]", "augment.gain_db"),
        ("augment.noise_snr_db=[20, 5]", "augment.noise_snr_db"),
        ("augment.reverb_rt60=[0.5]", "augment.reverb_rt60"),
        ("augment.reverb_rt60=[0.0, 0.5]", "augment.reverb_rt60"),
        ("augment.noise_prob=1.5", "augment.noise_prob"),
        ("augment.speed_prob=-0.1", "augment.speed_prob"),
        ("augment.speed_factors=[]", "augment.speed_factors"),
        ("augment.speed_factors=[0.9, 3.0]", "augment.speed_factors"),
        ("augment.eq_bands=1", "augment.eq_bands"),
        ("augment.noise_colors=[red]", "augment.noise_colors"),
        ("augment.noise_colors=[]", "augment.noise_colors"),
    ],
)
def test_invalid_settings_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_settings_load_from_overrides():
    overrides = [
        "augment.enabled=true",
        "augment.gain_db=[-3, 3]",
        "augment.noise_colors=[pink]",
        "augment.speed_factors=[0.95, 1.05]",
    ]
    cfg = load_config(None, overrides).augment
    assert cfg.enabled and cfg.gain_db == (-3.0, 3.0) and cfg.noise_colors == ("pink",)
    assert Augmenter(cfg, FEATURES, CROP).speed_ratios == [(19, 20), (21, 20)]


# ---------------------------------------------------------------------------------------------
# The source and the channel: pitch, stretch, band, codec


def modulated(samples: int, carrier_hz: float = 1000.0, rate_hz: float = 20.0) -> torch.Tensor:
    """A tone whose amplitude swings at `rate_hz`: the carrier tells pitch, the swing tempo."""
    t = np.arange(samples) / SR
    wave = 0.3 * (1.0 + 0.8 * np.sin(2 * np.pi * rate_hz * t)) * np.sin(2 * np.pi * carrier_hz * t)
    return torch.from_numpy(wave.astype(np.float32))


def modulation_hz(x) -> float:
    """The envelope's frequency: the strongest line of x² between 5 and 100 Hz."""
    x = np.asarray(x, dtype=np.float64)
    spectrum = np.abs(np.fft.rfft((x**2 - np.mean(x**2)) * np.hanning(len(x))))
    hz = np.fft.rfftfreq(len(x), 1.0 / SR)
    inside = (hz > 5) & (hz < 100)
    return float(hz[inside][np.argmax(spectrum[inside])])


def level_db(out, reference) -> float:
    return 10 * np.log10(power(out) / power(reference))


@pytest.mark.parametrize(
    "fields",
    [
        {"pitch_prob": 1.0},
        {"stretch_prob": 1.0},
        {"band_prob": 1.0},
        {"codec_prob": 1.0},
        {"pitch_prob": 1.0, "stretch_prob": 1.0, "speed_prob": 1.0, "speed_factors": (1.1,)},
    ],
    ids=["pitch", "stretch", "band", "codec", "speed+pitch+stretch"],
)
def test_source_pieces_are_seeded_and_keep_the_length(fields):
    augment, wave = only(**fields), signal(3 * CROP, seed=1)
    outs = [augment_item(augment, wave, seed) for seed in (3, 3, 4, 5)]
    assert all(out.shape == (CROP,) and out.dtype == torch.float32 for out in outs)
    assert all(torch.isfinite(out).all() for out in outs)
    assert torch.equal(outs[0], outs[1])  # same seed, same crop
    assert not torch.equal(outs[0], outs[2]) and not torch.equal(outs[2], outs[3])
    if "band_prob" in fields or "codec_prob" in fields:  # a crop of any length keeps it
        for length in (1, 300, 12345):
            crop = signal(length, seed=2)
            assert augment.after_crop(crop, np.random.default_rng(0)).shape == (length,)


def test_source_pieces_are_off_by_default_and_leave_other_draws_alone():
    assert all(getattr(AugmentConfig(), name) == 0.0 for name in SOURCE_PIECES)
    augment, wave = only(), signal(3 * CROP)
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    assert augment.before_crop(wave, rng) is wave
    crop = wave[:CROP]
    assert augment.after_crop(crop, rng) is crop
    assert rng.bit_generator.state == state
    # Turning a source piece on leaves the room pieces' draws as they were: with every room
    # piece on and the codec on, the crop before the codec is the crop without it.
    room = AugmentConfig(enabled=True, speed_factors=(0.9, 1.1), **{name: 1.0 for name in PIECES})
    codec = {"codec_prob": 1.0, "codec_kinds": ("quantize",), "codec_bits": (16, 16)}
    room_and_codec = Augmenter(dataclasses.replace(room, **codec), FEATURES, CROP)
    room = Augmenter(room, FEATURES, CROP)
    plain = augment_item(room, wave, 9)
    coded = augment_item(room_and_codec, wave, 9)
    assert not torch.equal(plain, coded)
    assert torch.allclose(plain, coded, atol=1.0 / 2**15 * float(plain.abs().max()) + 1e-7)


def test_before_crop_takes_the_crop_length_per_call():
    for fields in ({"speed_prob": 1.0, "speed_factors": (0.9,)}, {"pitch_prob": 1.0}):
        augment, wave = only(**fields), signal(5 * SR)
        default = augment.before_crop(wave, np.random.default_rng(2))
        explicit = augment.before_crop(wave, np.random.default_rng(2), crop_samples=CROP)
        assert torch.equal(default, explicit) and default.shape == (CROP,)
        longer = augment.before_crop(wave, np.random.default_rng(2), crop_samples=3 * CROP)
        assert longer.shape == (3 * CROP,)
    with pytest.raises(ValueError, match="crop_samples >= 1"):
        augment.before_crop(wave, np.random.default_rng(2), crop_samples=0)


@pytest.mark.parametrize("semitones", [-2.0, 0.5, 2.0])
def test_pitch_shift_moves_the_frequency_and_keeps_the_tempo(semitones):
    augment = only(pitch_prob=1.0, pitch_semitones=(semitones, semitones))
    ratio = 2.0 ** (semitones / 12.0)
    short = modulated(6000)  # shorter than a crop needs: processed whole, length kept exactly
    out = augment.before_crop(short, np.random.default_rng(0))
    assert out.shape == short.shape
    assert abs(peak_hz(out) / (1000.0 * ratio) - 1.0) < 0.008  # snapping: < 0.09 semitones
    # A long clip: one crop (of 2 s here, for a fine modulation frequency), same tempo.
    out = augment.before_crop(modulated(5 * SR), np.random.default_rng(0), crop_samples=2 * SR)
    assert out.shape == (2 * SR,)
    assert abs(peak_hz(out) / (1000.0 * ratio) - 1.0) < 0.006
    assert modulation_hz(out) == pytest.approx(20.0, abs=0.6)
    assert abs(level_db(out, modulated(2 * SR))) < 0.5


@pytest.mark.parametrize("factor", [0.85, 1.15])
def test_stretch_changes_the_tempo_not_the_frequency(factor):
    augment = only(stretch_prob=1.0, stretch_factors=(factor, factor))
    short = modulated(6000)
    out = augment.before_crop(short, np.random.default_rng(0))
    assert abs(out.shape[0] - 6000 / factor) <= 1  # the duration changes before the crop
    out = augment.before_crop(modulated(5 * SR), np.random.default_rng(0), crop_samples=2 * SR)
    assert out.shape == (2 * SR,)
    assert peak_hz(out) == pytest.approx(1000.0, abs=1.0)
    assert modulation_hz(out) == pytest.approx(20.0 * factor, abs=0.6)  # faster swing: faster
    assert abs(level_db(out, modulated(2 * SR))) < 0.5
    # The window's edges are trimmed off: the crop's ends carry a steady tone at full level.
    out = augment.before_crop(tone(1000.0, 5 * SR), np.random.default_rng(0))
    assert out.shape == (CROP,)
    assert float(out[:50].abs().max()) > 0.95 and float(out[-50:].abs().max()) > 0.95


def test_phase_vocoder_keeps_the_level_of_a_tone_between_bins():
    # 1234 Hz lies between two STFT bins: without phase locking their phases drift apart and
    # the stretched tone loses 14 dB; with it the level stays.
    wave = tone(1234.0, 8000)
    for rate in (0.7, 0.85, 1.3):
        out = time_stretch(wave, rate, round(8000 / rate), 512)
        assert out.shape == (round(8000 / rate),)
        assert abs(level_db(out[600:-600], wave)) < 0.2, rate
        assert peak_hz(out) == pytest.approx(1234.0, abs=3.0)


def test_band_limit_passes_the_band_and_attenuates_outside():
    augment = only(band_prob=1.0, band_low_hz=(300.0, 300.0), band_high_hz=(3400.0, 3400.0))
    gains = {
        hz: level_db(
            augment.after_crop(tone(hz, CROP, 0.5), np.random.default_rng(0)), tone(hz, CROP, 0.5)
        )
        for hz in (80.0, 300.0, 1000.0, 3400.0, 7000.0)
    }
    assert abs(gains[1000.0]) < 0.1  # in band: kept, not re-levelled
    assert gains[300.0] == pytest.approx(-3.0, abs=0.5) and gains[3400.0] == pytest.approx(
        -3.0, abs=0.5
    )
    # Order-4 Butterworth edges: -10 log10(1 + (f / fc)^8) dB, 24 dB per octave outside.
    assert gains[7000.0] == pytest.approx(-10 * np.log10(1 + (7000 / 3400) ** 8), abs=1.0)
    assert gains[80.0] < -35.0  # -46 dB in theory; the crop's abrupt ends spread a little
    # Random cut-offs within their ranges: a mid tone always passes, the extremes never do.
    drawn = only(band_prob=1.0)
    for seed in range(6):
        rng = np.random.default_rng(seed)
        assert (
            abs(level_db(drawn.after_crop(tone(1000.0, CROP, 0.5), rng), tone(1000.0, CROP, 0.5)))
            < 0.3
        )
        rng = np.random.default_rng(seed)
        assert level_db(drawn.after_crop(tone(40.0, CROP, 0.5), rng), tone(40.0, CROP, 0.5)) < -20.0


def test_band_cut_offs_that_cross_are_one_clear_error():
    cfg = AugmentConfig(enabled=True, band_prob=0.5, band_low_hz=(100.0, 3500.0))
    with pytest.raises(ConfigError, match=r"augment\.band_low_hz"):
        Augmenter(cfg, FEATURES, CROP)
    Augmenter(AugmentConfig(enabled=True, band_low_hz=(100.0, 3500.0)), FEATURES, CROP)  # off


def noise_crop(seed: int = 0) -> torch.Tensor:
    wave = 0.2 * np.random.default_rng(seed).standard_normal(CROP)
    return torch.from_numpy(np.clip(wave, -1, 1).astype(np.float32))


def test_mulaw_round_trip_changes_the_crop_and_keeps_its_level():
    augment, wave = only(codec_prob=1.0, codec_kinds=("mulaw",)), noise_crop()
    out = augment.after_crop(wave, np.random.default_rng(0))
    snr = -level_db(out - wave, wave)
    assert 30.0 < snr < 45.0, snr  # 8-bit mu-law: ~38 dB, not lossless
    assert abs(level_db(out, wave)) < 0.1
    quiet = augment.after_crop(wave * 0.01, np.random.default_rng(0))  # relative to the peak
    assert torch.allclose(quiet, out * 0.01, atol=1e-6)


@pytest.mark.parametrize("bits", [3, 6])
def test_quantize_round_trip_has_its_levels(bits):
    augment = only(codec_prob=1.0, codec_kinds=("quantize",), codec_bits=(bits, bits))
    wave = noise_crop()
    out = augment.after_crop(wave, np.random.default_rng(0)).numpy()
    assert len(np.unique(out)) <= 2**bits - 1  # mid-tread: 2^(b-1) - 1 levels a side, and 0
    assert len(np.unique(out)) > 2 ** (bits - 1)
    assert abs(level_db(out, wave)) < (1.5 if bits == 3 else 0.1)
    assert -level_db(out - wave.numpy(), wave) < 6.02 * bits + 6  # coarser than the source


def test_resample_round_trip_removes_what_the_lower_rate_cannot_carry():
    augment = only(codec_prob=1.0, codec_kinds=("resample",), codec_rates=(8000.0, 8000.0))
    low, high = tone(1000.0, CROP, 0.4), tone(5000.0, CROP, 0.4)
    assert abs(level_db(augment.after_crop(low, np.random.default_rng(0)), low)) < 0.1
    assert level_db(augment.after_crop(high, np.random.default_rng(0)), high) < -40.0
    out = augment.after_crop(low + high, np.random.default_rng(0))
    assert out.shape == (CROP,) and peak_hz(out) == pytest.approx(1000.0, abs=3.0)
    assert codec_ratio(11025.0, SR) == codec_ratio(11000.0, SR) == 11 / 16  # few kernels
    above = only(codec_prob=1.0, codec_kinds=("resample",), codec_rates=(20000.0, 20000.0))
    assert above.after_crop(low, np.random.default_rng(0)) is low  # nothing above to remove


def test_codec_kinds_are_drawn_per_crop():
    augment, wave = only(codec_prob=1.0), noise_crop()
    kinds = set()
    for seed in range(12):
        out = augment.after_crop(wave, np.random.default_rng(seed)).numpy()
        kinds.add("quantize" if len(np.unique(out)) <= 2**10 else "other")
    assert kinds == {"quantize", "other"}


@pytest.mark.parametrize(
    "override, key",
    [
        ("augment.pitch_semitones=[2, -2]", "augment.pitch_semitones"),
        ("augment.stretch_factors=[0.3, 1.0]", "augment.stretch_factors"),
        ("augment.codec_bits=[1, 8]", "augment.codec_bits"),
        ("augment.codec_kinds=[mp3]", "augment.codec_kinds"),
        ("augment.band_prob=2", "augment.band_prob"),
    ],
)
def test_invalid_source_settings_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])
