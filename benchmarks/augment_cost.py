"""Cost of training-crop augmentation in one data-loader worker, against no augmentation.

    python benchmarks/augment_cost.py [--clips 48] [--rounds 15] [--seconds 0.2]
    python benchmarks/augment_cost.py --smoke   # 4 clips, one short round: every line, no verdict

Writes `--clips` wav files of 1-2 s at 16 kHz, a few 10 s clips and a few 5 s noise files in a
temporary folder, then loops as one DataLoader worker does (one process, one torch thread):
load_audio → Augmenter.before_crop → crop_or_pad to 2 s → Augmenter.after_crop, with a fresh
numpy Generator per item. Measured in many short rounds that interleave the configurations,
keeping each one's best round, so bursts of load from other processes on the machine hit all of
them alike:

  off                 augment.enabled=false: the baseline every ratio is taken against
  each piece alone    at probability 1 (speed with factors 0.9 / 1.1 only, so it always runs);
                      the source pieces (pitch, stretch, band, codec kinds) too
  all on              the five room pieces at probability 1 (the issue-15 target below)
  everything on       every piece, room and source, at probability 1 (the worst case)
  default recipe      augment.enabled=true with the default probabilities
  libraries           in the same loop, what they offer for the same pieces: torchaudio's plain
                      phase vocoder in place of ours, its biquad band-pass, and, where installed,
                      audiomentations and torch-audiomentations transforms after the crop
                      (numpy / tensor in and out), with comparable settings
  10 s clips          off, and pitch + stretch on a window around the crop against the same on
                      the whole clip (crop_samples large enough that no window is taken)
  log-mel             Augmenter.log_mel on 201 × 64 crops read with read_npy_crop, against the
                      read alone

`torchaudio.functional.pitch_shift` is timed once, outside the rounds: each call builds a
resampling kernel for int(16000 / ratio) → 16000, which takes seconds.

PASS when "all on" keeps one worker at >= 300 crops/s (the issue's target for the room pieces).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile
import torch
import torchaudio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from audioclf.config import AugmentConfig, FeaturesConfig  # noqa: E402
from audioclf.data.augment import Augmenter  # noqa: E402
from audioclf.data.augment import pitch as pitch_module  # noqa: E402
from audioclf.data.readers import crop_or_pad, load_audio, read_npy_crop  # noqa: E402

SR = 16000
CROP_SAMPLES = 2 * SR  # 2-second training crops
TARGET_CROPS_PER_SECOND = 300.0
PIECES = ("speed_prob", "reverb_prob", "eq_prob", "noise_prob", "gain_prob")
SOURCE_PIECES = ("pitch_prob", "stretch_prob", "band_prob", "codec_prob")
OFF = "off (augment.enabled=false)"


def write_clips(folder: Path, n: int, low_s: float, high_s: float, seed: int) -> list[Path]:
    """`n` wav files of random length: a few tones with vibrato plus a little noise."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        t = np.arange(int(rng.uniform(low_s, high_s) * SR)) / SR
        vibrato = 3 * np.sin(2 * np.pi * 5 * t)
        tones = sum(np.sin(2 * np.pi * f * t + vibrato) for f in rng.uniform(100, 4000, 3))
        wave = 0.1 * tones + 0.01 * rng.standard_normal(t.shape[0])
        paths.append(folder / f"clip_{i:03d}.wav")
        soundfile.write(paths[-1], wave.astype(np.float32), SR)
    return paths


def augmenter(features: FeaturesConfig, **fields) -> Augmenter:
    return Augmenter(AugmentConfig(**fields), features, CROP_SAMPLES)


def alone(features: FeaturesConfig, **fields) -> Augmenter:
    """Enabled, every piece off except the probabilities/fields given."""
    return augmenter(features, enabled=True, **({name: 0.0 for name in PIECES} | fields))


def waveform_loop(augment: Augmenter, extra=None, before_crop_samples=None, stretch=None):
    """The dataset's training path for one item. `extra`: a library transform after the crop
    (numpy in and out); `before_crop_samples`: crop_samples for before_crop; `stretch`: a
    stand-in for the phase vocoder (`pitch.time_stretch`) while the item runs."""
    crop = augment.crop_samples

    def item(path: Path, seed: int) -> torch.Tensor:
        rng = np.random.default_rng(seed)
        own_stretch = pitch_module.time_stretch
        if stretch is not None:
            pitch_module.time_stretch = stretch
        try:
            wave = augment.before_crop(load_audio(path, SR), rng, before_crop_samples)
        finally:
            pitch_module.time_stretch = own_stretch
        wave = augment.after_crop(crop_or_pad(wave, crop, rng, "repeat"), rng)
        if extra is not None:
            wave = torch.from_numpy(np.ascontiguousarray(extra(wave.numpy(), sample_rate=SR)))
        assert wave.shape == (crop,), (tuple(wave.shape), crop)
        return wave

    return item


def items_per_second(item, paths: list[Path], seconds: float) -> float:
    """Items/s of `item` cycling over `paths` for at least `seconds` (and at least 3 items)."""
    count, start = 0, time.perf_counter()
    while True:
        item(paths[count % len(paths)], count)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and count >= 3:
            return count / elapsed


def our_augmenters(features: FeaturesConfig, noise_dir: Path) -> dict[str, Augmenter]:
    return {
        OFF: augmenter(features),
        "speed 0.9/1.1": alone(features, speed_prob=1.0, speed_factors=(0.9, 1.1)),
        "reverb (synthetic RIR)": alone(features, reverb_prob=1.0),
        "EQ (smooth random curve)": alone(features, eq_prob=1.0),
        "noise, generated white/pink/brown": alone(features, noise_prob=1.0),
        "noise, files": alone(
            features, noise_prob=1.0, noise_dir=str(noise_dir), noise_file_prob=1.0
        ),
        "gain": alone(features, gain_prob=1.0),
        "pitch ±2 st (resample + phase-locked vocoder)": alone(features, pitch_prob=1.0),
        "stretch 0.85-1.15 (phase-locked vocoder)": alone(features, stretch_prob=1.0),
        "pitch + stretch (one vocoder pass)": alone(features, pitch_prob=1.0, stretch_prob=1.0),
        "band-limit 100-400 / 3000-7000 Hz (FFT)": alone(features, band_prob=1.0),
        "codec: resample round trip 6-11 kHz": alone(
            features, codec_prob=1.0, codec_kinds=("resample",)
        ),
        "codec: 8-bit mu-law": alone(features, codec_prob=1.0, codec_kinds=("mulaw",)),
        "codec: quantise 6-10 bits": alone(features, codec_prob=1.0, codec_kinds=("quantize",)),
        "all on (room pieces p=1)": augmenter(
            features, enabled=True, speed_factors=(0.9, 1.1), **{name: 1.0 for name in PIECES}
        ),
        "everything on (room + source pieces p=1)": augmenter(
            features,
            enabled=True,
            speed_factors=(0.9, 1.1),
            **{name: 1.0 for name in PIECES + SOURCE_PIECES},
        ),
        "default recipe (enabled=true)": augmenter(features, enabled=True),
    }


def torchaudio_time_stretch(wave: torch.Tensor, rate: float, length: int, n_fft: int):
    """Our call, done by torchaudio.functional.phase_vocoder (the plain vocoder)."""
    hop = n_fft // 4
    window = torch.hann_window(n_fft)
    spec = torch.stft(wave, n_fft, hop, window=window, return_complex=True)
    advance = torch.linspace(0, math.pi * hop, n_fft // 2 + 1).unsqueeze(1)
    stretched = torchaudio.functional.phase_vocoder(spec, rate, advance)
    return torch.istft(stretched, n_fft, hop, window=window, length=length)


def torchaudio_band(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    wave = torchaudio.functional.highpass_biquad(torch.from_numpy(samples), sample_rate, 250.0)
    return torchaudio.functional.lowpass_biquad(wave, sample_rate, 5000.0).numpy()


def library_loops(features: FeaturesConfig, noise_dir: Path) -> tuple[dict, dict]:
    """{name: loop} of library transforms for our pieces, and {library: version} found."""
    off = augmenter(features)
    stretch = alone(features, stretch_prob=1.0)
    loops = {
        "torchaudio phase_vocoder as our stretch (plain)": waveform_loop(
            stretch, stretch=torchaudio_time_stretch
        ),
        "torchaudio highpass + lowpass biquad": waveform_loop(off, torchaudio_band),
    }
    versions = {"torchaudio": torchaudio.__version__}
    for name, transforms, version in (
        audiomentations_transforms(noise_dir),
        torch_audiomentations_transforms(),
    ):
        if transforms:
            versions[name] = version
            loops |= {f"{name} {label}": waveform_loop(off, t) for label, t in transforms.items()}
    return loops, versions


def audiomentations_transforms(noise_dir: Path) -> tuple[str, dict, str]:
    try:
        import audiomentations as am
    except ImportError:
        return "audiomentations", {}, ""
    snr = {"min_snr_db": 5, "max_snr_db": 20}
    room = {}
    if importlib.util.find_spec("pyroomacoustics") is not None:  # its optional dependency
        room = {
            "RoomSimulator (pyroomacoustics, defaults)": am.RoomSimulator(
                leave_length_unchanged=True, p=1.0
            )
        }
    return (
        "audiomentations",
        room
        | {
            "AddColorNoise (white..brown, SNR 5-20 dB)": am.AddColorNoise(
                **snr, min_f_decay=-6, max_f_decay=0, p=1.0
            ),
            "AddBackgroundNoise (files, SNR 5-20 dB)": am.AddBackgroundNoise(
                sounds_path=str(noise_dir), **snr, p=1.0
            ),
            "Gain (-6..6 dB)": am.Gain(min_gain_db=-6, max_gain_db=6, p=1.0),
            "SevenBandParametricEQ (-6..6 dB)": am.SevenBandParametricEQ(
                min_gain_db=-6, max_gain_db=6, p=1.0
            ),
            "PitchShift ±2 st (signalsmith)": am.PitchShift(-2, 2, p=1.0),
            "PitchShift ±2 st (librosa_phase_vocoder)": am.PitchShift(
                -2, 2, method="librosa_phase_vocoder", p=1.0
            ),
            "TimeStretch 0.85-1.15 (signalsmith)": am.TimeStretch(
                0.85, 1.15, leave_length_unchanged=True, p=1.0
            ),
            "TimeStretch 0.85-1.15 (librosa_phase_vocoder)": am.TimeStretch(
                0.85, 1.15, leave_length_unchanged=True, method="librosa_phase_vocoder", p=1.0
            ),
            "BandPassFilter (scipy butter + sosfilt)": am.BandPassFilter(p=1.0),
            "BitCrush 6-10 bits": am.BitCrush(6, 10, p=1.0),
        },
        am.__version__,
    )


def torch_audiomentations_transforms() -> tuple[str, dict, str]:
    try:
        import torch_audiomentations as tam
    except ImportError:
        return "torch-audiomentations", {}, ""

    def numpy_io(transform):
        def apply(samples: np.ndarray, sample_rate: int) -> np.ndarray:
            batch = torch.from_numpy(samples).reshape(1, 1, -1)
            return transform(batch, sample_rate=sample_rate)[0, 0].numpy()

        return apply

    tensor = {"p": 1.0, "output_type": "tensor"}
    return (
        "torch-audiomentations",
        {
            "PitchShift ±2 st": numpy_io(tam.PitchShift(-2.0, 2.0, sample_rate=SR, **tensor)),
            "BandPassFilter": numpy_io(tam.BandPassFilter(sample_rate=SR, **tensor)),
        },
        getattr(tam, "__version__", "?"),
    )


def long_clip_loops(features: FeaturesConfig) -> dict:
    """Pitch + stretch on 10 s clips: on a window around the crop, or on the whole clip."""
    source = alone(features, pitch_prob=1.0, stretch_prob=1.0)
    return {
        "10 s clips: off": waveform_loop(augmenter(features)),
        "10 s clips: pitch + stretch, window around the crop": waveform_loop(source),
        "10 s clips: pitch + stretch, whole clip": waveform_loop(
            source, before_crop_samples=20 * SR
        ),
    }


def measure(groups: list[tuple[dict, list[Path]]], rounds: int, seconds: float) -> dict:
    """Best items/s of every loop over `rounds` interleaved rounds (after a warm-up)."""
    for loops, paths in groups:  # warm-up: resampling kernels, FFT plans, cached tables
        for loop in loops.values():
            for seed in range(4):
                loop(paths[seed % len(paths)], seed)
    best: dict[str, float] = {}
    for _ in range(rounds):
        for loops, paths in groups:
            for name, loop in loops.items():
                rate = items_per_second(loop, paths, seconds)
                best[name] = max(best.get(name, 0.0), rate)
    return best


def time_torchaudio_pitch_shift() -> float:
    wave = torch.from_numpy(np.random.default_rng(0).standard_normal(CROP_SAMPLES, np.float32))
    start = time.perf_counter()
    torchaudio.functional.pitch_shift(wave * 0.1, SR, 1.3)
    return time.perf_counter() - start


def print_rows(best: dict, names, baseline: str) -> None:
    base = best[baseline]
    for name in names:
        rate = best[name]
        print(f"{name:62s} {rate:9.1f} {rate / base:6.2f}x {1e3 / rate - 1e3 / base:9.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clips", type=int, default=48, help="number of generated 1-2 s clips")
    parser.add_argument(
        "--rounds",
        type=int,
        default=15,
        help="rounds over all configurations (each one's best is kept)",
    )
    parser.add_argument(
        "--seconds", type=float, default=0.2, help="time per configuration per round"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="4 clips, one round of 0.01 s, no pitch_shift timing: every line is printed, the "
        "exit status does not hold the verdict",
    )
    args = parser.parse_args()
    if args.smoke:
        args.clips, args.rounds, args.seconds = 4, 1, 0.01
    torch.set_num_threads(1)  # as in a DataLoader worker

    features = FeaturesConfig(sample_rate=SR)
    with tempfile.TemporaryDirectory() as tmp:
        clips = write_clips(Path(tmp) / "clips", args.clips, 1.0, 2.0, seed=0)
        long_clips = write_clips(Path(tmp) / "long", 6, 10.0, 10.0, seed=2)
        noise_dir = Path(tmp) / "noise"
        write_clips(noise_dir, 4, 5.0, 5.0, seed=1)
        npy_paths = []
        for i in range(16):
            npy_paths.append(Path(tmp) / f"feats_{i:02d}.npy")
            feats = np.random.default_rng(i).standard_normal((1000, 64), dtype=np.float32)
            np.save(npy_paths[-1], feats)

        ours = {name: waveform_loop(a) for name, a in our_augmenters(features, noise_dir).items()}
        libraries, versions = library_loops(features, noise_dir)
        long_loops = long_clip_loops(features)
        mel_augment = alone(features, eq_prob=1.0, gain_prob=1.0)

        def npy_read(path: Path, seed: int) -> np.ndarray:
            return read_npy_crop(path, 201, seed, "frames_bins", 64)

        def npy_read_augment(path: Path, seed: int) -> np.ndarray:
            return mel_augment.log_mel(read_npy_crop(path, 201, seed, "frames_bins", 64), seed)

        npy_loops = {
            "log-mel read_npy_crop alone": npy_read,
            "log-mel read + Augmenter.log_mel (EQ, gain)": npy_read_augment,
        }
        groups = [(ours | libraries, clips), (long_loops, long_clips), (npy_loops, npy_paths)]
        best = measure(groups, args.rounds, args.seconds)
    pitch_shift_s = float("nan") if args.smoke else time_torchaudio_pitch_shift()

    print(
        f"one worker (1 process, 1 torch thread): {args.clips} clips of 1-2 s at {SR} Hz, "
        f"2 s crops; best of {args.rounds} rounds of >= {args.seconds:g} s; "
        + ", ".join(f"{name} {version}" for name, version in versions.items())
    )
    missing = {"audiomentations", "torch-audiomentations"} - set(versions)
    if missing:
        print(f"not installed, their comparison lines skipped: {', '.join(sorted(missing))}")
    print(f"{'configuration':62s} {'crops/s':>9s} {'vs off':>7s} {'+ms/crop':>9s}")
    print_rows(best, [*ours, *libraries], OFF)
    print_rows(best, long_loops, "10 s clips: off")
    print_rows(best, npy_loops, "log-mel read_npy_crop alone")
    print(
        f"torchaudio.functional.pitch_shift, 1.3 semitones, one 2 s crop: {pitch_shift_s:.1f} s "
        "(one call, outside the rounds)"
    )

    all_on = best["all on (room pieces p=1)"]
    verdict = "PASS" if all_on >= TARGET_CROPS_PER_SECOND else "FAIL"
    print(
        f"{verdict}: all on {all_on:.0f} crops/s in one worker ({all_on / best[OFF]:.2f}x of no "
        f"augmentation; target >= {TARGET_CROPS_PER_SECOND:.0f})"
    )
    return 0 if verdict == "PASS" or args.smoke else 1


if __name__ == "__main__":
    raise SystemExit(main())
