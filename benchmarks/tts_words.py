"""A spoken-word dataset from text-to-speech engines, for benchmarks/quality.py.

    .venv/bin/python benchmarks/tts_words.py --out data/quality     # build (or reuse) it alone
    .venv/bin/python benchmarks/tts_words.py --smoke    # 4 clips a sheet, in a temporary folder

60 common English words, each spoken by espeak-ng voices (an accent combined with a voice
variant, e.g. ``en-gb-scotland+f2``) in 4 variants of random speed and pitch; the held-out
words are also spoken by flite's voices, a different engine. Words are the classes; one item is
one word spoken by one voice (its 4 variants share the voice, as clips of one recording share
the speaker), so cross-item retrieval asks: does this word spoken by another voice come first?

Sheets (columns a_cls = word, a_item = word/voice, a_id, path relative to the sheet):

- ``train.xlsx``: training words x training voices, with a ``split`` column: ``train`` for
  most voices, ``val`` for VAL_VOICES (validation during training is then cross-voice);
- ``known_words_unseen_voices.xlsx``: training words x held-out voices;
- ``unseen_words_unseen_voices.xlsx``: held-out words x held-out voices;
- ``other_engine.xlsx``: held-out words x flite voices (only when flite is installed).

Audio is 16 kHz mono 16-bit wav with leading/trailing silence trimmed. Everything lives in
``<out>/<hash of the parameters>/``, so a rerun with the same parameters reuses it; a sheet is
written after all its files, so an interrupted build is finished by the next run. MBROLA voices
(``mb-*``) are not used: they are often absent, and a dataset that depended on them would
differ between machines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import soundfile
from scipy.signal import resample_poly

VERSION = 1  # bump when the generated audio changes, so old folders are not reused
SAMPLE_RATE = 16000
VARIANTS_PER_VOICE = 4

# Mixed lengths (1 to 4 syllables); no two words sound alike (no butter/button, no rocket/pocket).
TRAIN_WORDS = (
    "dog",
    "fish",
    "house",
    "tree",
    "milk",
    "shoe",
    "clock",
    "bread",
    "cheese",
    "train",
    "apple",
    "basket",
    "window",
    "yellow",
    "river",
    "garden",
    "chicken",
    "music",
    "pencil",
    "orange",
    "table",
    "doctor",
    "monkey",
    "candle",
    "rocket",
    "butter",
    "jacket",
    "ladder",
    "island",
    "zebra",
    "umbrella",
    "elephant",
    "banana",
    "computer",
    "tomato",
    "dinosaur",
    "kangaroo",
    "calendar",
    "vegetable",
    "helicopter",
)
HELD_OUT_WORDS = (
    "cat",
    "sun",
    "book",
    "frog",
    "chair",
    "kitchen",
    "forest",
    "pepper",
    "dragon",
    "pillow",
    "lemon",
    "carpet",
    "guitar",
    "hammer",
    "mirror",
    "potato",
    "octopus",
    "telephone",
    "butterfly",
    "hospital",
)
# espeak-ng accent + voice variant. Held-out voices use variants no training voice uses.
TRAIN_VOICES = (
    "en-us+m1",
    "en-gb+f1",
    "en-gb-scotland+m2",
    "en-gb-x-gbclan+f3",
    "en-gb-x-rp+m4",
    "en-gb-x-gbcwmd+f4",
    "en-029+m5",
    "en-us-nyc+f1",
    "en-us+klatt",
    "en-gb+croak",
    "en-gb-x-rp+m6",
)
VAL_VOICES = ("en-gb-scotland+f3", "en-us-nyc+m4", "en-029+f4")  # in train.xlsx, split=val
HELD_OUT_VOICES = (
    "en-us+m3",
    "en-gb-scotland+f2",
    "en-gb+m7",
    "en-gb-x-rp+klatt2",
    "en-us-nyc+m8",
    "en-029+f5",
)
FLITE_VOICES = ("kal", "awb", "rms", "slt", "kal16")
# Modest ranges around the engines' defaults (espeak-ng: 175 words/min, pitch 50 of 0-99).
SPEED_RANGE = (140, 200)
PITCH_RANGE = (30, 70)
FLITE_STRETCH_RANGE = (0.85, 1.25)  # flite's duration_stretch (>1 is slower)
# Trimming: 10 ms frames; a frame is speech when its RMS is within TRIM_DB of the loudest one.
TRIM_DB = 40.0
TRIM_PAD_SECONDS = 0.03

SHEETS = {
    "train": "train.xlsx",
    "known": "known_words_unseen_voices.xlsx",
    "unseen": "unseen_words_unseen_voices.xlsx",
    "other_engine": "other_engine.xlsx",
}
MANIFEST = "dataset.json"


class ToolMissing(RuntimeError):
    """A text-to-speech program is not installed."""


@dataclass(frozen=True)
class Clip:
    """One clip to synthesise: `word` said by `voice` of `engine`, at one speed/pitch."""

    engine: str  # "espeak-ng" or "flite"
    word: str
    voice: str
    variant: int
    speed: float  # espeak-ng: words per minute; flite: duration_stretch
    pitch: int  # espeak-ng only (0 for flite)

    @property
    def item(self) -> str:
        return f"{self.word}/{self.voice}"

    @property
    def clip_id(self) -> str:
        return f"{self.word}_{self.voice.replace('+', '_')}_{self.variant}"

    @property
    def relative_path(self) -> str:
        return f"wav/{self.word}/{self.voice.replace('+', '_')}/{self.variant}.wav"


def parameters(seed: int) -> dict:
    """Everything the generated audio depends on (its hash names the dataset folder)."""
    return {
        "version": VERSION,
        "seed": seed,
        "sample_rate": SAMPLE_RATE,
        "variants_per_voice": VARIANTS_PER_VOICE,
        "train_words": TRAIN_WORDS,
        "held_out_words": HELD_OUT_WORDS,
        "train_voices": TRAIN_VOICES,
        "val_voices": VAL_VOICES,
        "held_out_voices": HELD_OUT_VOICES,
        "flite_voices": FLITE_VOICES,
        "speed_range": SPEED_RANGE,
        "pitch_range": PITCH_RANGE,
        "flite_stretch_range": FLITE_STRETCH_RANGE,
        "trim_db": TRIM_DB,
        "trim_pad_seconds": TRIM_PAD_SECONDS,
        "espeak_ng": tool_version("espeak-ng"),
    }


def dataset_folder(root: str | Path, seed: int = 0) -> Path:
    digest = hashlib.sha256(json.dumps(parameters(seed), sort_keys=True).encode()).hexdigest()
    return Path(root) / digest[:12]


def tool_version(program: str) -> str | None:
    """The first line of `program --version`, or None when it is not installed."""
    if shutil.which(program) is None:
        return None
    result = subprocess.run([program, "--version"], capture_output=True, text=True)
    lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return lines[0] if lines else "unknown"


def plan(seed: int) -> dict[str, list[tuple[Clip, str]]]:
    """{sheet key: [(clip, split)]}: every clip of every sheet, speeds and pitches drawn."""

    def espeak(words, voices, split_of: Callable[[str], str]):
        clips = []
        for word in words:
            for voice in voices:
                # One generator per (word, voice): adding a word or voice changes no other clip.
                rng = np.random.default_rng([seed, stable_int(word), stable_int(voice)])
                for variant in range(VARIANTS_PER_VOICE):
                    speed = int(rng.integers(SPEED_RANGE[0], SPEED_RANGE[1] + 1))
                    pitch = int(rng.integers(PITCH_RANGE[0], PITCH_RANGE[1] + 1))
                    clips.append(
                        (Clip("espeak-ng", word, voice, variant, speed, pitch), split_of(voice))
                    )
        return clips

    flite = []
    for word in HELD_OUT_WORDS:
        for voice in FLITE_VOICES:
            rng = np.random.default_rng([seed, stable_int(word), stable_int("flite:" + voice)])
            for variant in range(VARIANTS_PER_VOICE):
                stretch = round(float(rng.uniform(*FLITE_STRETCH_RANGE)), 3)
                flite.append((Clip("flite", word, voice, variant, stretch, 0), "test"))
    return {
        "train": espeak(
            TRAIN_WORDS,
            TRAIN_VOICES + VAL_VOICES,
            lambda voice: "val" if voice in VAL_VOICES else "train",
        ),
        "known": espeak(TRAIN_WORDS, HELD_OUT_VOICES, lambda voice: "test"),
        "unseen": espeak(HELD_OUT_WORDS, HELD_OUT_VOICES, lambda voice: "test"),
        "other_engine": flite,
    }


def stable_int(text: str) -> int:
    """A seed from a name that is the same in every process (str hash() is salted)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def synthesise(clip: Clip, target: Path) -> float:
    """Write `clip` as trimmed 16 kHz mono 16-bit wav to `target`; returns its seconds."""
    with tempfile.TemporaryDirectory(prefix="tts_") as tmp:
        raw = Path(tmp) / "raw.wav"
        if clip.engine == "espeak-ng":
            command = [
                "espeak-ng",
                "-v",
                clip.voice,
                "-s",
                str(int(clip.speed)),
                "-p",
                str(clip.pitch),
                "-w",
                str(raw),
                clip.word,
            ]
        else:
            command = [
                "flite",
                "-voice",
                clip.voice,
                "--setf",
                f"duration_stretch={clip.speed}",
                "-t",
                clip.word,
                "-o",
                str(raw),
            ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not raw.exists() or raw.stat().st_size <= 44:
            message = " ".join((result.stderr or result.stdout).split())[:300]
            raise RuntimeError(
                f"{' '.join(command)} produced no audio (exit {result.returncode}): {message}"
            )
        audio, rate = soundfile.read(raw, dtype="float32", always_2d=True)
    audio = audio.mean(axis=1)
    if rate != SAMPLE_RATE:
        divisor = np.gcd(rate, SAMPLE_RATE)
        audio = resample_poly(audio, SAMPLE_RATE // divisor, rate // divisor).astype(np.float32)
    audio = trim_silence(audio, SAMPLE_RATE)
    target.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(target, np.clip(audio, -1.0, 1.0), SAMPLE_RATE, subtype="PCM_16")
    return len(audio) / SAMPLE_RATE


def trim_silence(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """`audio` from the first to the last 10 ms frame within TRIM_DB of the loudest, padded."""
    frame = sample_rate // 100
    n_frames = len(audio) // frame
    if n_frames == 0:
        return audio
    rms = np.sqrt(np.mean(audio[: n_frames * frame].reshape(n_frames, frame) ** 2, axis=1))
    loud = np.flatnonzero(rms >= rms.max() * 10 ** (-TRIM_DB / 20))
    if rms.max() == 0 or len(loud) == 0:
        return audio
    pad = int(TRIM_PAD_SECONDS * sample_rate)
    return audio[max(0, loud[0] * frame - pad) : min(len(audio), (loud[-1] + 1) * frame + pad)]


def check_voices(voices, engine: str) -> None:
    """Say one word with every voice first, so a missing voice fails before minutes of synthesis."""
    with tempfile.TemporaryDirectory(prefix="tts_probe_") as tmp:
        for voice in voices:
            clip = Clip(engine, "hello", voice, 0, 175 if engine == "espeak-ng" else 1.0, 50)
            try:
                synthesise(clip, Path(tmp) / "probe.wav")
            except RuntimeError as exc:
                raise RuntimeError(f"{engine} voice {voice!r} does not work here: {exc}") from None


def build(
    root: str | Path = "data/quality",
    *,
    seed: int = 0,
    jobs: int = 2,
    log: Callable[[str], None] = print,
    limit: int | None = None,
) -> dict[str, Path]:
    """Build (or reuse) the dataset; returns {sheet key: sheet path} of the sheets that exist.
    `limit` (--smoke): only the first clips of each sheet, and its voices alone checked.

    Raises ToolMissing when espeak-ng is not installed. Without flite the other-engine sheet is
    skipped (and built by a later call once flite is installed).
    """
    if tool_version("espeak-ng") is None:
        raise ToolMissing("espeak-ng")
    folder = dataset_folder(root, seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps(parameters(seed), indent=2) + "\n")
    have_flite = tool_version("flite") is not None
    wanted = [key for key in SHEETS if key != "other_engine" or have_flite]
    sheets = {key: folder / SHEETS[key] for key in wanted}
    todo = [key for key in wanted if not sheets[key].exists()]
    if not todo:
        log(f"dataset: reusing {folder}")
        return sheets

    clips = {key: planned[:limit] for key, planned in plan(seed).items()}
    used = {clip.voice for key in todo for clip, _ in clips[key] if key != "other_engine"}
    if any(key != "other_engine" for key in todo):
        check_voices(
            TRAIN_VOICES + VAL_VOICES + HELD_OUT_VOICES if limit is None else used, "espeak-ng"
        )
    if "other_engine" in todo:
        check_voices(FLITE_VOICES, "flite")
    for key in todo:
        rows = _synthesise_sheet(clips[key], folder, jobs, key, log)
        table = pd.DataFrame(rows, columns=["a_cls", "a_item", "a_id", "path", "split", "seconds"])
        if key != "train":
            table = table.drop(columns="split")
        partial = sheets[key].with_name(sheets[key].name + ".partial.xlsx")
        table.to_excel(partial, index=False)
        os.replace(partial, sheets[key])
        log(
            f"dataset: wrote {sheets[key]} ({len(table)} clips, {table.a_cls.nunique()} words, "
            f"{table.a_item.nunique()} word/voice items, {table.seconds.mean():.2f} s per clip)"
        )
    return sheets


def _synthesise_sheet(
    clips: list[tuple[Clip, str]], folder: Path, jobs: int, key: str, log: Callable[[str], None]
) -> list[tuple]:
    # Threads are enough: the work is in the TTS processes and in numpy/scipy, outside the GIL.
    log(f"dataset: synthesising {len(clips)} clips for {SHEETS[key]} ({jobs} at a time)")
    rows = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(synthesise, clip, folder / clip.relative_path) for clip, _ in clips]
        for done, ((clip, split), future) in enumerate(zip(clips, futures), start=1):
            rows.append(
                (clip.word, clip.item, clip.clip_id, clip.relative_path, split, future.result())
            )
            if done % 500 == 0:
                log(f"dataset:   {done}/{len(clips)}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default="data/quality", help="parent folder (default: %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of speeds and pitches (default: 0)"
    )
    parser.add_argument(
        "--jobs", type=int, choices=(1, 2), default=2, help="TTS processes at a time"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the first 4 clips of every sheet, in a temporary folder (removed)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tts_smoke_") as tmp:
        out, limit = (tmp, 4) if args.smoke else (args.out, None)
        try:
            sheets = build(out, seed=args.seed, jobs=args.jobs, limit=limit)
        except ToolMissing:
            print("tts_words: espeak-ng is not installed; run `apt-get install espeak-ng flite`")
            return 2
        for key, path in sheets.items():
            print(f"{key}: {path} ({len(pd.read_excel(path, engine='calamine'))} clips)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
