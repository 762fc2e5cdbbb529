"""A generated demo dataset: procedural audio that a small CNN can learn to tell apart.

    python -m audioclf.data.demo --out data/demo                # 32 classes x 6 items x 8 ids
    python -m audioclf.data.demo --out data/demo --features     # also log-mel .npy files

Each class has its own sound: a set of harmonic partials over a fundamental that sweeps up or
down (a repeating chirp), an amplitude-modulation rate and depth, and a band of noise. Each item
(a "recording" of the class) shifts the pitch by up to 2 semitones, passes the sound through its
own EQ and reverb tail and adds its own background noise band; these are drawn alike for every
class, so they are nuisances an embedding must learn to ignore. Each id is a different 1-2 s
segment of that recording with its own level and white noise at a random SNR. So a class is
recognisable across items (after training), but no two samples of a class are alike.

Writes wav/<cls>/<item>/<id>.wav (16-bit PCM), index.xlsx (a_cls, a_item, a_id, path relative
to the sheet) and demo.json (the parameters; a rerun with the same parameters does nothing).
With --features also features/<cls>/<item>/<id>.npy (log-mel, frames x bins, float32, from
audioclf.spectrogram.log_mel with FeaturesConfig defaults at the demo's sample rate) and
index_features.xlsx. Everything is generated in a temp folder that is renamed into place, so an
interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import shutil
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pandas as pd
import soundfile
import torch
from tqdm import tqdm

from audioclf.config import FeaturesConfig
from audioclf.spectrogram import log_mel, one_torch_thread

MANIFEST = "demo.json"
INDEX = "index.xlsx"
FEATURES_INDEX = "index_features.xlsx"
VERSION = 3  # bump when the generated audio changes, so old folders are regenerated

MIN_SECONDS, MAX_SECONDS = 1.0, 2.0  # length of one id
CHIRP_PERIOD = 2.0  # seconds; the fundamental sweeps over one period, then starts again
MAX_PARTIALS = 8
REVERB_SECONDS = 0.5  # longest reverb tail


@dataclasses.dataclass(frozen=True)
class ClassSound:
    """What makes a class recognisable."""

    f0: float  # fundamental in Hz at the middle of a sweep
    harmonics: np.ndarray  # [MAX_PARTIALS] harmonic numbers
    amplitudes: np.ndarray  # [MAX_PARTIALS] partial amplitudes (0 = unused)
    sweep: float  # octaves per second of the chirp (sign = direction)
    am_rate: float  # Hz of the amplitude modulation
    am_depth: float  # 0..1
    noise_centre: float  # Hz, centre of the noise band
    noise_octaves: float  # width of the noise band
    noise_level: float  # noise band RMS relative to the tonal part


def _streams(
    seed: int, cls: int, items: int
) -> tuple[np.random.Generator, list[np.random.Generator], np.random.Generator]:
    """Independent random streams of one class: its sound, each item's room, its ids' clips.

    They depend only on (seed, class), so class 3 sounds the same in a demo of 4 or 32 classes.
    """
    sound, rooms, clips = np.random.SeedSequence([seed, cls]).spawn(3)
    return (
        np.random.default_rng(sound),
        [np.random.default_rng(s) for s in rooms.spawn(items)],
        np.random.default_rng(clips),
    )


def class_sound(rng: np.random.Generator, sample_rate: int) -> ClassSound:
    """Draw one class's sound; every partial and the noise band stay below the Nyquist rate."""
    nyquist = sample_rate / 2
    n_partials = int(rng.integers(3, MAX_PARTIALS + 1))
    harmonics = np.sort(rng.choice(np.arange(1, 13), size=MAX_PARTIALS, replace=False))
    tilt = rng.uniform(0.3, 1.5)
    amplitudes = harmonics.astype(float) ** -tilt * rng.uniform(0.3, 1.0, MAX_PARTIALS)
    amplitudes[rng.permutation(MAX_PARTIALS)[n_partials:]] = 0.0
    return ClassSound(
        f0=float(np.exp(rng.uniform(np.log(110.0), np.log(min(880.0, nyquist / 8))))),
        harmonics=harmonics.astype(float),
        amplitudes=amplitudes,
        sweep=float(rng.uniform(0.2, 1.0) * rng.choice([-1.0, 1.0])),
        am_rate=float(np.exp(rng.uniform(np.log(0.5), np.log(14.0)))),
        am_depth=float(rng.uniform(0.2, 0.9)),
        noise_centre=float(np.exp(rng.uniform(np.log(300.0), np.log(0.75 * nyquist)))),
        noise_octaves=float(rng.uniform(0.3, 1.5)),
        noise_level=float(10 ** (rng.uniform(-18.0, -3.0) / 20)),
    )


def _item_response(rng: np.random.Generator, n_fft: int, sample_rate: int) -> np.ndarray:
    """Frequency response [n_fft // 2 + 1] of one recording: an EQ (tilt, two peaks or notches,
    a low-pass) and a reverb tail. Drawn the same way for every class, so it is a nuisance that
    an embedding must learn to ignore."""
    freqs = np.fft.rfftfreq(n_fft, 1 / sample_rate)
    octaves = np.log2(np.maximum(freqs, 50.0) / 1000.0)
    gain_db = rng.uniform(-6.0, 3.0) * octaves
    for _ in range(2):
        centre = rng.uniform(np.log2(200 / 1000), np.log2(0.4 * sample_rate / 1000))
        width = rng.uniform(0.2, 0.6)  # octaves
        gain_db += rng.uniform(-10.0, 10.0) * np.exp(-0.5 * ((octaves - centre) / width) ** 2)
    cutoff = rng.uniform(0.2, 0.45) * sample_rate
    gain = 10 ** (gain_db / 20) / np.sqrt(1 + (freqs / cutoff) ** 4)
    decay = rng.uniform(0.05, REVERB_SECONDS)  # seconds to fall by 60 dB
    tail_len = int(decay * sample_rate)
    tail = rng.standard_normal(tail_len) * 10 ** (-3 * np.arange(tail_len) / tail_len)
    tail *= rng.uniform(0.1, 0.6) / np.sqrt(np.sum(tail**2))
    impulse = np.zeros(n_fft)
    impulse[0] = 1.0
    impulse[1 : 1 + tail_len] += tail[: n_fft - 1]
    return gain * np.fft.rfft(impulse)


def _background(rng: np.random.Generator, sample_rate: int) -> tuple[float, float, float]:
    """One recording's background noise band: centre Hz, width in octaves, level (RMS)."""
    centre = float(np.exp(rng.uniform(np.log(150.0), np.log(0.4 * sample_rate))))
    return centre, float(rng.uniform(0.5, 3.0)), float(10 ** (rng.uniform(-20.0, -6.0) / 20))


def _band_noise(
    rng: np.random.Generator,
    shape: tuple[int, int],
    sample_rate: int,
    centre: float,
    octaves: float,
) -> np.ndarray:
    """Gaussian noise [waves, samples] in a band `octaves` wide around `centre` Hz, unit RMS."""
    n = shape[1]
    freqs = np.fft.rfftfreq(n, 1 / sample_rate)
    distance = np.log2(np.maximum(freqs, 1.0) / centre) / (octaves / 2)
    bins = (shape[0], len(freqs))
    spectrum = rng.standard_normal(bins) + 1j * rng.standard_normal(bins)
    band = np.fft.irfft(spectrum * np.exp(-0.5 * distance**2), n=n, axis=1)
    return band / (np.sqrt(np.mean(band**2, axis=1, keepdims=True)) + 1e-8)


def render_class(
    seed: int, cls: int, items: int, ids: int, sample_rate: int
) -> list[list[np.ndarray]]:
    """The float32 waveforms of one class, [item][id], each 1-2 s long, peak below 1."""
    sound_rng, item_rngs, id_rng = _streams(seed, cls, items)
    sound = class_sound(sound_rng, sample_rate)
    n = int(MAX_SECONDS * sample_rate)
    n_fft = int(np.ceil((n + REVERB_SECONDS * sample_rate) / 4096) * 4096)  # fast, no wrap-around
    t = np.arange(n) / sample_rate
    shifts = np.array([2 ** (r.uniform(-2.0, 2.0) / 12) for r in item_rngs])  # +-2 semitones
    responses = np.stack([_item_response(r, n_fft, sample_rate) for r in item_rngs])
    backgrounds = [_background(r, sample_rate) for r in item_rngs]
    waves = items * ids

    # Tonal part: partials over a fundamental that sweeps through a repeating chirp.
    start = id_rng.uniform(0, 2 * CHIRP_PERIOD, waves)[:, None]  # where in the sound each id starts
    position = np.mod(start + t, CHIRP_PERIOD) - CHIRP_PERIOD / 2
    f0 = sound.f0 * np.repeat(shifts, ids)[:, None] * 2 ** (sound.sweep * position)  # [W, N]
    # wrapped in float64 so that harmonic * phase stays exact enough in float32
    phase = np.mod(2 * np.pi * np.cumsum(f0, axis=1) / sample_rate, 2 * np.pi).astype(np.float32)
    tonal = np.zeros((waves, n), dtype=np.float32)
    for harmonic, amplitude in zip(sound.harmonics, sound.amplitudes, strict=True):
        if amplitude > 0:
            audible = harmonic * f0 < 0.45 * sample_rate  # no aliasing at the top of a sweep
            offset = id_rng.uniform(0, 2 * np.pi, (waves, 1)).astype(np.float32)
            tonal += np.float32(amplitude) * audible * np.sin(np.float32(harmonic) * phase + offset)
    tonal /= np.sqrt(np.mean(tonal**2, axis=1, keepdims=True)) + 1e-8

    # The class's noise band, amplitude-modulated with the partials; then each item's background.
    band = _band_noise(id_rng, (waves, n), sample_rate, sound.noise_centre, sound.noise_octaves)
    modulation = 1 - sound.am_depth / 2 * (
        1
        + np.sin(2 * np.pi * sound.am_rate * (start + t) + id_rng.uniform(0, 2 * np.pi, (waves, 1)))
    )
    source = (tonal + sound.noise_level * band) * modulation
    for item, (centre, octaves, level) in enumerate(backgrounds):
        rows = slice(item * ids, (item + 1) * ids)
        source[rows] += level * _band_noise(id_rng, (ids, n), sample_rate, centre, octaves)

    # Each recording's filter and reverb, then the id's length, noise and level.
    spectra = np.fft.rfft(source, n=n_fft, axis=1).reshape(items, ids, -1) * responses[:, None, :]
    heard = np.fft.irfft(spectra, n=n_fft, axis=2)[..., :n].reshape(waves, n)
    lengths = id_rng.integers(int(MIN_SECONDS * sample_rate), n + 1, waves)
    snr_db = id_rng.uniform(0.0, 20.0, waves)
    peaks = 10 ** (id_rng.uniform(-12.0, -1.0, waves) / 20)
    out: list[list[np.ndarray]] = [[] for _ in range(items)]
    for w in range(waves):
        clip = heard[w, : lengths[w]]
        power = np.mean(clip**2)
        clip = clip + id_rng.standard_normal(len(clip)) * np.sqrt(power / 10 ** (snr_db[w] / 10))
        clip = clip * peaks[w] / (np.max(np.abs(clip)) + 1e-8)
        out[w // ids].append(clip.astype(np.float32))
    return out


def _names(classes: int, items: int, ids: int) -> list[tuple[str, str, str]]:
    width = max(2, len(str(classes - 1)))
    return [
        (f"c{c:0{width}d}", f"c{c:0{width}d}_i{i}", f"c{c:0{width}d}_i{i}_{k:02d}")
        for c in range(classes)
        for i in range(items)
        for k in range(ids)
    ]


def _parameters(classes, items, ids, seed, sample_rate) -> dict:
    return {
        "version": VERSION,
        "classes": classes,
        "items": items,
        "ids": ids,
        "seed": seed,
        "sample_rate": sample_rate,
    }


def _features_parameters(sample_rate: int) -> dict:
    """The FeaturesConfig fields that shape the precomputed log-mel files."""
    cfg = FeaturesConfig(sample_rate=sample_rate)
    return {
        name: getattr(cfg, name)
        for name in ("sample_rate", "n_fft", "win_length", "hop_length", "n_mels", "f_min", "f_max")
    }


def _existing(out: Path, wanted: dict, features: bool) -> bool:
    """True when `out` already holds a complete demo with these parameters (and features)."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("parameters") != wanted or not (out / INDEX).is_file():
        return False
    return not features or (
        manifest.get("features_config") == _features_parameters(wanted["sample_rate"])
        and (out / FEATURES_INDEX).is_file()
    )


def generate_demo(
    out: Path,
    *,
    classes: int = 32,
    items: int = 6,
    ids: int = 8,
    seed: int = 0,
    sample_rate: int = 16000,
    features: bool = False,
    force: bool = False,
) -> Path:
    """Generate the demo dataset into `out` (skipped when it is already there); returns index.xlsx.

    With features=True the index of the .npy files is `out / "index_features.xlsx"`.
    """
    for name, value, low in (
        ("classes", classes, 2),
        ("items", items, 1),
        ("ids", ids, 1),
        ("sample_rate", sample_rate, 8000),
    ):
        if value < low:
            raise ValueError(f"generate_demo: {name}={value} must be >= {low}")
    out = Path(out)
    wanted = _parameters(classes, items, ids, seed, sample_rate)
    if not force and _existing(out, wanted, features):
        print(
            f"{out} already holds the demo dataset ({classes} classes x {items} items x {ids} "
            f"ids, seed {seed}); pass --force to regenerate it"
        )
        return out / INDEX
    if out.exists() and not force and not (out / MANIFEST).exists() and any(out.iterdir()):
        raise FileExistsError(
            f"{out} exists and is not a demo dataset (no {MANIFEST}); choose "
            "another --out or pass --force to replace it"
        )

    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        _write_dataset(partial, wanted, features)
        _move_into_place(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out / INDEX


def _write_dataset(folder: Path, parameters: dict, features: bool) -> None:
    with one_torch_thread() if features else nullcontext():
        rows, feature_rows = _write_clips(folder, parameters, features)
    columns = ["a_cls", "a_item", "a_id", "path"]
    pd.DataFrame(rows, columns=columns).to_excel(folder / INDEX, index=False, engine="openpyxl")
    manifest = {"parameters": parameters, "features": features, "samples": len(rows)}
    if features:
        pd.DataFrame(feature_rows, columns=columns).to_excel(
            folder / FEATURES_INDEX, index=False, engine="openpyxl"
        )
        manifest["features_config"] = _features_parameters(parameters["sample_rate"])
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _write_clips(folder: Path, parameters: dict, features: bool) -> tuple[list, list]:
    """Render and write every clip (and its features); returns the rows of both index sheets."""
    classes, items, ids = parameters["classes"], parameters["items"], parameters["ids"]
    seed, sample_rate = parameters["seed"], parameters["sample_rate"]
    names = _names(classes, items, ids)
    features_cfg = FeaturesConfig(sample_rate=sample_rate)
    rows, feature_rows = [], []
    for cls in tqdm(range(classes), desc="demo classes", unit="class", disable=None):
        waves = render_class(seed, cls, items, ids, sample_rate)
        for item in range(items):
            for k in range(ids):
                cls_name, item_name, sample_id = names[(cls * items + item) * ids + k]
                rel = Path("wav", cls_name, item_name, f"{sample_id}.wav")
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                pcm = np.round(waves[item][k] * 32767).astype(np.int16)
                _write_wav(folder / rel, pcm, sample_rate)
                rows.append((cls_name, item_name, sample_id, rel.as_posix()))
                if features:
                    # from the 16-bit samples, as a reader of the wav file would see them
                    mel = log_mel(torch.from_numpy(pcm.astype(np.float32) / 32768), features_cfg)
                    rel_npy = Path("features", cls_name, item_name, f"{sample_id}.npy")
                    (folder / rel_npy).parent.mkdir(parents=True, exist_ok=True)
                    np.save(folder / rel_npy, np.ascontiguousarray(mel, dtype=np.float32))
                    feature_rows.append((cls_name, item_name, sample_id, rel_npy.as_posix()))
    return rows, feature_rows


def _write_wav(path: Path, pcm: np.ndarray, sample_rate: int) -> None:
    """16-bit PCM wav; encoded in memory because soundfile fsyncs every file it closes."""
    buffer = io.BytesIO()
    soundfile.write(buffer, pcm, sample_rate, subtype="PCM_16", format="WAV")
    path.write_bytes(buffer.getvalue())


def _move_into_place(partial: Path, out: Path) -> None:
    """Replace `out` by `partial` with renames only, so `out` is never half-written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(partial, out)
        shutil.rmtree(old)
    else:
        os.replace(partial, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m audioclf.data.demo",
        description="Generate the procedural demo dataset (wav files + index.xlsx). Each class "
        "has its own partials, chirp direction, modulation rate and noise band; items shift "
        "pitch and room; ids are different noisy segments. A rerun with the same parameters "
        "does nothing.",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("data/demo"), help="output folder (default: data/demo)"
    )
    parser.add_argument("--classes", type=int, default=32, help="number of classes (default 32)")
    parser.add_argument(
        "--items", type=int, default=6, help="items (recordings) per class (default 6)"
    )
    parser.add_argument("--ids", type=int, default=8, help="ids (clips) per item (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--sample-rate", type=int, default=16000, help="sample rate in Hz (default 16000)"
    )
    parser.add_argument(
        "--features",
        action="store_true",
        help="also write log-mel features/*.npy and index_features.xlsx",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="regenerate even if the folder already holds this dataset",
    )
    args = parser.parse_args(argv)
    try:
        index = generate_demo(
            args.out,
            classes=args.classes,
            items=args.items,
            ids=args.ids,
            seed=args.seed,
            sample_rate=args.sample_rate,
            features=args.features,
            force=args.force,
        )
    except (ValueError, FileExistsError) as exc:
        parser.error(str(exc))
    print(f"index: {index}")
    if args.features:
        print(f"features index: {index.parent / FEATURES_INDEX}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
