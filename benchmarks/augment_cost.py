"""Cost of training-crop augmentation in one data-loader worker, against no augmentation.

    python benchmarks/augment_cost.py [--clips 48] [--rounds 15] [--seconds 0.2]

Writes `--clips` wav files of 1-2 s at 16 kHz and a few 5 s noise files in a temporary folder,
then loops as one DataLoader worker does (one process, one torch thread): load_audio →
Augmenter.before_crop → crop_or_pad to 2 s → Augmenter.after_crop, with a fresh numpy Generator
per item. Measured in many short rounds that interleave the configurations, keeping each one's
best round, so bursts of load from other processes on the machine hit all of them alike:

  off                 augment.enabled=false: the baseline every ratio is taken against
  each piece alone    at probability 1 (speed with factors 0.9 / 1.1 only, so it always runs)
  all on              every piece at probability 1 (the worst case)
  default recipe      augment.enabled=true with the default probabilities
  audiomentations     if it is installed: its transforms for the same pieces, in the same loop
                      after the crop (numpy in and out), with comparable settings
  log-mel             Augmenter.log_mel on 201 × 64 crops read with read_npy_crop, against the
                      read alone

PASS when "all on" keeps one worker at >= 300 crops/s (the issue's target).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from audioclf.config import AugmentConfig, FeaturesConfig  # noqa: E402
from audioclf.data.augment import Augmenter  # noqa: E402
from audioclf.data.readers import crop_or_pad, load_audio, read_npy_crop  # noqa: E402

SR = 16000
CROP_SAMPLES = 2 * SR  # 2-second training crops
TARGET_CROPS_PER_SECOND = 300.0
PIECES = ("speed_prob", "reverb_prob", "eq_prob", "noise_prob", "gain_prob")


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


def waveform_loop(augment: Augmenter, extra=None):
    """The dataset's training path for one item; `extra` is an audiomentations transform."""
    crop = augment.crop_samples

    def item(path: Path, seed: int) -> torch.Tensor:
        rng = np.random.default_rng(seed)
        wave = augment.before_crop(load_audio(path, SR), rng)
        wave = augment.after_crop(crop_or_pad(wave, crop, rng, "repeat"), rng)
        if extra is not None:
            wave = torch.from_numpy(extra(wave.numpy(), sample_rate=SR))
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


def audiomentations_loops(features: FeaturesConfig, noise_dir: Path) -> tuple[str, dict]:
    """Its transforms for our pieces, with comparable ranges, or ("", {}) if not installed."""
    try:
        import audiomentations as am
    except ImportError:
        return "", {}
    off = augmenter(features)
    snr = {"min_snr_db": 5, "max_snr_db": 20}
    transforms = {
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
        "RoomSimulator (pyroomacoustics, defaults)": am.RoomSimulator(
            leave_length_unchanged=True, p=1.0
        ),
    }
    return am.__version__, {name: waveform_loop(off, t) for name, t in transforms.items()}


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
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in a DataLoader worker

    features = FeaturesConfig(sample_rate=SR)
    with tempfile.TemporaryDirectory() as tmp:
        clips = write_clips(Path(tmp) / "clips", args.clips, 1.0, 2.0, seed=0)
        noise_dir = Path(tmp) / "noise"
        write_clips(noise_dir, 4, 5.0, 5.0, seed=1)
        npy_paths = []
        for i in range(16):
            npy_paths.append(Path(tmp) / f"feats_{i:02d}.npy")
            feats = np.random.default_rng(i).standard_normal((1000, 64), dtype=np.float32)
            np.save(npy_paths[-1], feats)

        ours = {
            "off (augment.enabled=false)": augmenter(features),
            "speed 0.9/1.1": alone(features, speed_prob=1.0, speed_factors=(0.9, 1.1)),
            "reverb (synthetic RIR)": alone(features, reverb_prob=1.0),
            "EQ (smooth random curve)": alone(features, eq_prob=1.0),
            "noise, generated white/pink/brown": alone(features, noise_prob=1.0),
            "noise, files": alone(
                features, noise_prob=1.0, noise_dir=str(noise_dir), noise_file_prob=1.0
            ),
            "gain": alone(features, gain_prob=1.0),
            "all on (every piece p=1)": augmenter(
                features, enabled=True, speed_factors=(0.9, 1.1), **{name: 1.0 for name in PIECES}
            ),
            "default recipe (enabled=true)": augmenter(features, enabled=True),
        }
        loops = {name: waveform_loop(augment) for name, augment in ours.items()}
        am_version, am_loops = audiomentations_loops(features, noise_dir)
        loops |= {f"audiomentations {name}": loop for name, loop in am_loops.items()}

        mel_augment = alone(features, eq_prob=1.0, gain_prob=1.0)

        def npy_read(path: Path, seed: int) -> np.ndarray:
            return read_npy_crop(path, 201, np.random.default_rng(seed), "frames_bins", 64)

        def npy_read_augment(path: Path, seed: int) -> np.ndarray:
            rng = np.random.default_rng(seed)
            return mel_augment.log_mel(read_npy_crop(path, 201, rng, "frames_bins", 64), rng)

        npy_loops = {
            "log-mel read_npy_crop alone": npy_read,
            "log-mel read + Augmenter.log_mel (EQ, gain)": npy_read_augment,
        }

        for loop in loops.values():  # warm-up: resampling kernels, FFT plans, cached tables
            for seed in range(4):
                loop(clips[seed % len(clips)], seed)
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, loop in loops.items():
                best[name] = max(best.get(name, 0.0), items_per_second(loop, clips, args.seconds))
            for name, loop in npy_loops.items():
                rate = items_per_second(loop, npy_paths, args.seconds)
                best[name] = max(best.get(name, 0.0), rate)

    print(
        f"one worker (1 process, 1 torch thread): {args.clips} clips of 1-2 s at {SR} Hz, "
        f"2 s crops; best of {args.rounds} rounds of >= {args.seconds:g} s"
    )
    if not am_loops:
        print("audiomentations is not installed: its comparison lines are skipped")
    baseline = best["off (augment.enabled=false)"]
    print(f"{'configuration':58s} {'crops/s':>9s} {'vs off':>7s} {'+ms/crop':>9s}")
    for name in loops:
        label = name.replace("audiomentations ", f"audiomentations {am_version}: ")
        rate = best[name]
        print(f"{label:58s} {rate:9.1f} {rate / baseline:6.2f}x {1e3 / rate - 1e3 / baseline:9.3f}")
    npy_base = best["log-mel read_npy_crop alone"]
    for name in npy_loops:
        rate = best[name]
        print(f"{name:58s} {rate:9.1f} {rate / npy_base:6.2f}x {1e3 / rate - 1e3 / npy_base:9.3f}")

    all_on = best["all on (every piece p=1)"]
    verdict = "PASS" if all_on >= TARGET_CROPS_PER_SECOND else "FAIL"
    print(
        f"{verdict}: all on {all_on:.0f} crops/s in one worker ({all_on / baseline:.2f}x of no "
        f"augmentation; target >= {TARGET_CROPS_PER_SECOND:.0f})"
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
