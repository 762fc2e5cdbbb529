"""A non-speech dataset: recorded instrument notes from four General-MIDI sound banks.

For benchmarks/quality.py (its "sounds" domain). Needs Debian packages:

    apt-get install fluidsynth timidity fluid-soundfont-gm minuet-data timgm6mb-soundfont freepats
    .venv/bin/python benchmarks/sound_sources.py --out data/quality/sounds   # build (or reuse) it
    .venv/bin/python benchmarks/sound_sources.py --smoke   # 2 items x 2 notes a sheet, in a temp dir

A General-MIDI sound bank is a library of recorded notes (real instruments, multi-sampled), and
each bank was recorded or collected by other people, with other instruments, rooms and
microphones. The four banks used, none a copy of another (see "How the instruments were chosen"):

- ``fluidr3``: FluidR3_GM.sf2 by Frank Wen (package fluid-soundfont-gm; MIT licence), played by
  fluidsynth;
- ``generaluser``: GeneralUser GS 1.47 by S. Christian Collins (package minuet-data, the KDE ear
  trainer's data; GeneralUser GS licence v2.0: free use and modification), played by fluidsynth;
- ``timgm6mb``: TimGM6mb.sf2 by Tim Brechbill (package timgm6mb-soundfont; GPL-2), played by
  fluidsynth;
- ``freepats``: the 2006 FreePats GUS patches (package freepats; GPL-2+ with an exception for
  compositions), played by timidity, another synthesiser.

Instruments (GM programs) are the classes; one item is one instrument in one bank; a clip is one
note (15 pitches over the instrument's range, each moved by up to a semitone, x 3 draws of
velocity and duration, all drawn per item). Cross-item retrieval therefore asks: is the same
instrument, recorded for another bank, the nearest clip? Every evaluated class is played by all
four banks, so a bank's recording chain says nothing about the class. Sheets (columns a_cls,
a_item = instrument/source, a_id, path relative to the sheet, and source, key, velocity, seconds):

- ``train.xlsx``: TRAIN_INSTRUMENTS (18) and TRAIN_ONLY_INSTRUMENTS (19) x TRAIN_SOURCES
  (fluidr3, generaluser), with a ``split`` column: ``val`` for 4 of each item's 15 pitches
  (VAL_PITCHES), ``train`` for the rest; an instrument's validation clips come from both banks,
  so validation is cross-source (on pitches training did not play);
- ``known_classes_unseen_source.xlsx``: TRAIN_INSTRUMENTS x HELD_OUT_SOURCES (timgm6mb, freepats);
- ``unseen_classes_train_source.xlsx``: HELD_OUT_INSTRUMENTS (15) x TRAIN_SOURCES;
- ``unseen_classes_unseen_source.xlsx``: HELD_OUT_INSTRUMENTS x HELD_OUT_SOURCES.

How the instruments were chosen (once, by hand, from the packages' Debian 12 versions):
(1) real recorded instruments only (no synth leads or pads, no sound effects); (2) none shares a
sample with another chosen instrument inside any bank that plays it (read from each bank's
preset -> instrument -> sample tables; e.g. TimGM6mb's drawbar and church organs are one sample
set, GeneralUser GS's finger, fretless and slap basses too); (3) no instrument whose notes in
two banks look like one recording (the same note rendered by both, high-passed at 1.5 kHz,
still correlating above ~0.5 at the best lag, where unrelated recordings give 0.05-0.35):
GeneralUser GS and FreePats share the clean guitar, acoustic bass and jazz guitar, FluidR3 and
GeneralUser GS the celesta, muted guitar, harp, kalimba and music box, FluidR3 and FreePats the
harp; those are out, or training-only where only FreePats repeats another bank. The 33
evaluated instruments are GM programs that the 2006 FreePats set has; the 19 training-only ones
(FluidR3 and GeneralUser GS only) bring the training classes to 37, about the spoken words' 40.
Other Debian banks were left out for the same reason: csound-soundfont's sf_GMbank.sf2 is mostly
TimGM6mb's samples, denemo-data's A320U.sf2 repeats many of them too (and one sample serves its
oboe, English horn, bassoon and clarinet), and the MuseScore General banks are largely FluidR3
(their own sample-sources list says so).

Notes are rendered one item at a time (one MIDI file, one fluidsynth or timidity process, reverb
and chorus off, 44.1 kHz), cut at the note-off plus TAIL_SECONDS, resampled to 16 kHz mono,
silence-trimmed like the spoken words, and peak-normalised (so loudness tells nothing). As with
benchmarks/tts_words.py, everything lives in ``<out>/<hash of the parameters>/`` so a rerun
reuses it, and a sheet is written after all its files.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tts_words, when run from anywhere

from tts_words import SAMPLE_RATE, stable_int, trim_silence  # noqa: E402

VERSION = 1  # bump when the generated audio changes, so old folders are not reused
RENDER_RATE = 44100
PITCHES_PER_ITEM = 15
VARIANTS_PER_PITCH = 3
VAL_PITCHES = (1, 5, 9, 13)  # indices into an item's pitches that train.xlsx marks split=val
VELOCITY_RANGE = (50, 120)
DURATION_RANGE = (0.25, 1.0)  # seconds between note-on and note-off
TAIL_SECONDS = 0.4  # release kept after the note-off
SLOT_SECONDS = 2.0  # note-on to the next note-on in the rendered MIDI file (> duration + tail)
FADE_SECONDS = 0.02
PEAK = 0.5  # every clip is scaled to this peak
SILENT_PEAK = 1e-4  # a rendered note quieter than this is an error (the bank lacks that key)
INSTALL = (
    "apt-get install fluidsynth timidity fluid-soundfont-gm minuet-data timgm6mb-soundfont freepats"
)


@dataclass(frozen=True)
class Source:
    """One sound bank: where its file is, which Debian package ships it, which program plays it."""

    name: str
    package: str
    renderer: str  # "fluidsynth" (a .sf2 file) or "timidity" (a timidity .cfg of GUS patches)
    pattern: str  # glob of the bank's file; the first match in sorted order is used


SOURCES = (
    Source("fluidr3", "fluid-soundfont-gm", "fluidsynth", "/usr/share/sounds/sf2/FluidR3_GM.sf2"),
    Source(
        "generaluser", "minuet-data", "fluidsynth", "/usr/share/minuet/soundfonts/GeneralUser*.sf2"
    ),
    Source("timgm6mb", "timgm6mb-soundfont", "fluidsynth", "/usr/share/sounds/sf2/TimGM6mb.sf2"),
    Source("freepats", "freepats", "timidity", "/etc/timidity/freepats.cfg"),
)
TRAIN_SOURCES = ("fluidr3", "generaluser")
HELD_OUT_SOURCES = ("timgm6mb", "freepats")

# name: (GM program, 0-based; lowest and highest MIDI key played). Ranges are the instruments'
# usual ones, inside what every bank sounds.
TRAIN_INSTRUMENTS = {
    "piano": (0, 33, 96),
    "harpsichord": (6, 41, 84),
    "church_organ": (19, 36, 84),
    "glockenspiel": (9, 72, 103),
    "timpani": (47, 36, 57),
    "steel_guitar": (25, 40, 84),
    "sitar": (104, 48, 77),
    "pick_bass": (34, 28, 64),
    "pizzicato_strings": (45, 36, 84),
    "violin": (40, 55, 96),
    "string_ensemble": (48, 36, 96),
    "trumpet": (56, 55, 82),
    "brass_section": (61, 36, 84),
    "alto_sax": (65, 49, 80),
    "oboe": (68, 58, 91),
    "clarinet": (71, 50, 91),
    "flute": (73, 60, 96),
    "pan_flute": (75, 60, 96),
}
HELD_OUT_INSTRUMENTS = {
    "electric_piano": (4, 36, 88),
    "clavinet": (7, 41, 84),
    "accordion": (21, 48, 84),
    "tubular_bells": (14, 55, 79),
    "wood_block": (115, 60, 84),
    "overdriven_guitar": (29, 40, 84),
    "fretless_bass": (35, 28, 64),
    "cello": (42, 36, 76),
    "voice_oohs": (53, 48, 79),
    "trombone": (57, 40, 72),
    "tenor_sax": (66, 44, 75),
    "baritone_sax": (67, 36, 68),
    "english_horn": (69, 52, 81),
    "piccolo": (72, 74, 102),
    "ocarina": (79, 60, 84),
}
# Only in train.xlsx: FreePats lacks them, or repeats another bank's recording of them.
TRAIN_ONLY_INSTRUMENTS = {
    "vibraphone": (11, 53, 89),
    "dulcimer": (15, 48, 84),
    "drawbar_organ": (16, 36, 96),
    "harmonica": (22, 60, 84),
    "jazz_guitar": (26, 40, 84),
    "clean_guitar": (27, 40, 84),
    "distortion_guitar": (30, 40, 84),
    "acoustic_bass": (32, 28, 60),
    "viola": (41, 48, 84),
    "choir_aahs": (52, 48, 79),
    "french_horn": (60, 34, 77),
    "shakuhachi": (77, 55, 84),
    "whistle": (78, 72, 96),
    "bagpipe": (109, 55, 79),
    "shanai": (111, 60, 84),
    "tinkle_bell": (112, 72, 96),
    "agogo": (113, 60, 79),
    "taiko": (116, 36, 60),
    "melodic_tom": (117, 40, 64),
}
EVALUATED_INSTRUMENTS = {**TRAIN_INSTRUMENTS, **HELD_OUT_INSTRUMENTS}  # played by all four banks
INSTRUMENTS = {**EVALUATED_INSTRUMENTS, **TRAIN_ONLY_INSTRUMENTS}

SHEETS = {  # key (file name without .xlsx) -> (instruments, sources)
    "train": ({**TRAIN_INSTRUMENTS, **TRAIN_ONLY_INSTRUMENTS}, TRAIN_SOURCES),
    "known_classes_unseen_source": (TRAIN_INSTRUMENTS, HELD_OUT_SOURCES),
    "unseen_classes_train_source": (HELD_OUT_INSTRUMENTS, TRAIN_SOURCES),
    "unseen_classes_unseen_source": (HELD_OUT_INSTRUMENTS, HELD_OUT_SOURCES),
}
MANIFEST = "dataset.json"
COLUMNS = ["a_cls", "a_item", "a_id", "path", "split", "source", "key", "velocity", "seconds"]


class ToolMissing(RuntimeError):
    """A renderer or a sound bank is not installed; the message says what to install."""


@dataclass(frozen=True)
class Note:
    """One clip: `instrument` played by `source` at `key`, one draw of velocity and duration."""

    instrument: str
    source: str
    pitch_index: int
    variant: int
    key: int
    velocity: int
    duration: float  # seconds

    @property
    def item(self) -> str:
        return f"{self.instrument}/{self.source}"

    @property
    def clip_id(self) -> str:
        return f"{self.instrument}_{self.source}_{self.pitch_index:02d}_{self.variant}"

    @property
    def relative_path(self) -> str:
        return f"wav/{self.source}/{self.instrument}/{self.pitch_index:02d}_{self.variant}.wav"

    @property
    def split(self) -> str:
        return "val" if self.pitch_index in VAL_PITCHES else "train"


# --------------------------------------------------------------------------------------------
# What the dataset depends on


def find_sources() -> dict[str, Path]:
    """{source name: bank file}; raises ToolMissing naming every missing program or package."""
    missing = [program for program in ("fluidsynth", "timidity") if shutil.which(program) is None]
    found = {}
    for source in SOURCES:
        matches = sorted(glob.glob(source.pattern))
        if matches:
            found[source.name] = Path(matches[0])
        else:
            missing.append(source.package)
    if missing:
        raise ToolMissing(f"the sounds domain needs {', '.join(missing)} (run `{INSTALL}`)")
    check_freepats_programs(found["freepats"])
    return found


def check_freepats_programs(config: Path) -> None:
    """Timidity falls back to another bank (often FluidR3) for a program its config lacks, which
    would quietly turn a held-out source into a training one: every program must be there."""
    programs, bank = set(), None
    for line in config.read_text(errors="replace").splitlines():
        header = re.match(r"\s*(bank|drumset)\s+(\d+)", line)
        if header:
            bank = (header.group(1), int(header.group(2)))
            continue
        patch = re.match(r"\s*(\d+)\s+\S+\.pat\b", line)
        if patch and bank == ("bank", 0):
            programs.add(int(patch.group(1)))
    absent = sorted(
        name for name, (program, _, _) in EVALUATED_INSTRUMENTS.items() if program not in programs
    )
    if absent:
        raise ToolMissing(
            f"{config} has no patch for {', '.join(absent)}; reinstall freepats "
            f"(apt-get install --reinstall freepats)"
        )


def parameters(seed: int, banks: dict[str, Path]) -> dict:
    """Everything the generated audio depends on (its hash names the dataset folder)."""
    return {
        "version": VERSION,
        "seed": seed,
        "sample_rate": SAMPLE_RATE,
        "render_rate": RENDER_RATE,
        "pitches_per_item": PITCHES_PER_ITEM,
        "variants_per_pitch": VARIANTS_PER_PITCH,
        "val_pitches": VAL_PITCHES,
        "velocity_range": VELOCITY_RANGE,
        "duration_range": DURATION_RANGE,
        "tail_seconds": TAIL_SECONDS,
        "slot_seconds": SLOT_SECONDS,
        "fade_seconds": FADE_SECONDS,
        "peak": PEAK,
        "train_instruments": TRAIN_INSTRUMENTS,
        "held_out_instruments": HELD_OUT_INSTRUMENTS,
        "train_only_instruments": TRAIN_ONLY_INSTRUMENTS,
        "train_sources": TRAIN_SOURCES,
        "held_out_sources": HELD_OUT_SOURCES,
        "banks": {name: [str(path), path.stat().st_size] for name, path in sorted(banks.items())},
        "fluidsynth": tool_version("fluidsynth"),
        "timidity": tool_version("timidity"),
    }


def dataset_folder(root: str | Path, seed: int, banks: dict[str, Path]) -> Path:
    text = json.dumps(parameters(seed, banks), sort_keys=True)
    return Path(root) / hashlib.sha256(text.encode()).hexdigest()[:12]


def tool_version(program: str) -> str | None:
    """The first line of `program --version` that names a version, or None when not installed."""
    if shutil.which(program) is None:
        return None
    result = subprocess.run([program, "--version"], capture_output=True, text=True)
    lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    versioned = [line for line in lines if re.search(r"\d+\.\d+", line)]
    return (versioned or lines or ["unknown"])[0]


def plan(seed: int, instrument: str, source: str) -> list[Note]:
    """The notes of one item: PITCHES_PER_ITEM keys spread over the instrument's range, each
    moved by up to a semitone, and VARIANTS_PER_PITCH velocities and durations for each. All are
    drawn per item, so two banks never play one instrument's exact same notes (a model that
    matched the key and the note length would otherwise find the other bank's clip)."""
    program, low, high = INSTRUMENTS[instrument]
    rng = np.random.default_rng([seed, stable_int(instrument), stable_int(source)])
    centres = np.linspace(low, high, PITCHES_PER_ITEM)
    moved = np.round(centres + rng.uniform(-1.0, 1.0, PITCHES_PER_ITEM))
    keys = np.clip(moved, low, high).astype(int)
    notes = []
    for pitch_index, key in enumerate(keys):
        for variant in range(VARIANTS_PER_PITCH):
            velocity = int(rng.integers(VELOCITY_RANGE[0], VELOCITY_RANGE[1] + 1))
            duration = round(float(rng.uniform(*DURATION_RANGE)), 3)
            notes.append(
                Note(instrument, source, pitch_index, variant, int(key), velocity, duration)
            )
    return notes


# --------------------------------------------------------------------------------------------
# Rendering


def midi_file(program: int, notes: list[Note]) -> bytes:
    """A format-0 MIDI file: the program, then note k on at k * SLOT_SECONDS (1 tick = 1 ms).

    The first note starts at 0: timidity drops leading silence, fluidsynth does not."""
    slot_ms = int(SLOT_SECONDS * 1000)
    events = [(0, 0, bytes([0xC0, program]))]  # (ms, order at equal times, message)
    for index, note in enumerate(notes):
        start = index * slot_ms
        events.append((start, 2, bytes([0x90, note.key, note.velocity])))
        events.append((start + int(note.duration * 1000), 1, bytes([0x80, note.key, 0])))
    events.sort(key=lambda event: event[:2])
    track = b"\x00\xff\x51\x03" + (480000).to_bytes(3, "big")  # 480 ms a quarter, 480 ticks
    now = 0
    for when, _, message in events:
        track += _variable_length(when - now) + message
        now = when
    track += _variable_length(slot_ms) + b"\xff\x2f\x00"
    return (
        b"MThd"
        + (6).to_bytes(4, "big")
        + (0).to_bytes(2, "big")
        + (1).to_bytes(2, "big")
        + (480).to_bytes(2, "big")
        + b"MTrk"
        + len(track).to_bytes(4, "big")
        + track
    )


def _variable_length(value: int) -> bytes:
    out = [value & 0x7F]
    value >>= 7
    while value:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    return bytes(reversed(out))


def render_command(source: Source, bank: Path, midi: Path, wav: Path) -> list[str]:
    if source.renderer == "fluidsynth":
        return [
            "fluidsynth",
            "-ni",
            "-q",
            "-R",
            "0",
            "-C",
            "0",
            "-g",
            "0.5",
            "-r",
            str(RENDER_RATE),
            "-F",
            str(wav),
            str(bank),
            str(midi),
        ]
    return [
        "timidity",
        "-c",
        str(bank),
        "-OwM",
        "-s",
        str(RENDER_RATE),
        "-EFreverb=0",
        "-EFchorus=0",
        "-o",
        str(wav),
        str(midi),
    ]


def render_item(source: Source, bank: Path, notes: list[Note]) -> list[np.ndarray]:
    """The item's notes as 16 kHz mono float clips (trimmed, faded out, peak-normalised)."""
    program = INSTRUMENTS[notes[0].instrument][0]
    with tempfile.TemporaryDirectory(prefix="sounds_") as tmp:
        midi, wav = Path(tmp) / "notes.mid", Path(tmp) / "notes.wav"
        midi.write_bytes(midi_file(program, notes))
        command = render_command(source, bank, midi, wav)
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not wav.exists() or wav.stat().st_size <= 44:
            message = " ".join((result.stderr or result.stdout).split())[:300]
            raise RuntimeError(
                f"{' '.join(command)} produced no audio (exit {result.returncode}): {message}"
            )
        audio, rate = soundfile.read(wav, dtype="float32", always_2d=True)
    audio = audio.mean(axis=1)
    slot = int(SLOT_SECONDS * rate)
    audio = np.pad(audio, (0, max(0, slot * len(notes) - len(audio))))
    return [
        _clip(
            audio[index * slot : index * slot + int((note.duration + TAIL_SECONDS) * rate)],
            rate,
            note,
        )
        for index, note in enumerate(notes)
    ]


def _clip(audio: np.ndarray, rate: int, note: Note) -> np.ndarray:
    peak = float(np.abs(audio).max()) if len(audio) else 0.0
    if peak < SILENT_PEAK:
        raise RuntimeError(f"{note.source} played no sound for {note.instrument} at key {note.key}")
    fade = int(FADE_SECONDS * rate)
    audio = audio.copy()
    audio[-fade:] *= np.linspace(1.0, 0.0, fade, dtype=np.float32)
    divisor = np.gcd(rate, SAMPLE_RATE)
    audio = resample_poly(audio, SAMPLE_RATE // divisor, rate // divisor).astype(np.float32)
    audio = trim_silence(audio, SAMPLE_RATE)
    return audio * (PEAK / float(np.abs(audio).max()))


# --------------------------------------------------------------------------------------------
# Building the sheets


def build(
    root: str | Path = "data/quality/sounds",
    *,
    seed: int = 0,
    jobs: int = 2,
    log: Callable[[str], None] = print,
    limit: int | None = None,
) -> dict[str, Path]:
    """Build (or reuse) the dataset; returns {sheet key: sheet path}. `limit` (--smoke): only
    that many items a sheet and notes an item.

    Raises ToolMissing when fluidsynth, timidity or a bank is not installed."""
    banks = find_sources()
    folder = dataset_folder(root, seed, banks)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps(parameters(seed, banks), indent=2) + "\n")
    sheets = {key: folder / f"{key}.xlsx" for key in SHEETS}
    todo = [key for key in SHEETS if not sheets[key].exists()]
    if not todo:
        log(f"dataset: reusing {folder}")
        return sheets
    for key in todo:
        table = _render_sheet(key, seed, banks, folder, jobs, log, limit)
        if key != "train":
            table = table.drop(columns="split")
        partial = sheets[key].with_name(sheets[key].name + ".partial.xlsx")
        table.to_excel(partial, index=False)
        os.replace(partial, sheets[key])
        log(
            f"dataset: wrote {sheets[key]} ({len(table)} clips, {table.a_cls.nunique()} "
            f"instruments x {table.source.nunique()} sources, "
            f"{table.seconds.mean():.2f} s per clip)"
        )
    return sheets


def _render_sheet(
    key: str,
    seed: int,
    banks: dict[str, Path],
    folder: Path,
    jobs: int,
    log: Callable[[str], None],
    limit: int | None = None,
) -> pd.DataFrame:
    instruments, source_names = SHEETS[key]
    sources = {source.name: source for source in SOURCES}
    items = [plan(seed, instrument, name) for instrument in instruments for name in source_names]
    if limit is not None:
        items = [notes[:limit] for notes in items[:limit]]
    log(
        f"dataset: rendering {sum(map(len, items))} notes ({len(items)} instrument/source items) "
        f"for {key}.xlsx ({jobs} at a time)"
    )

    def render_and_write(notes: list[Note]) -> list[tuple]:
        source = sources[notes[0].source]
        rows = []
        for note, audio in zip(notes, render_item(source, banks[source.name], notes)):
            target = folder / note.relative_path
            target.parent.mkdir(parents=True, exist_ok=True)
            soundfile.write(target, np.clip(audio, -1.0, 1.0), SAMPLE_RATE, subtype="PCM_16")
            rows.append(
                (
                    note.instrument,
                    note.item,
                    note.clip_id,
                    note.relative_path,
                    note.split,
                    note.source,
                    note.key,
                    note.velocity,
                    len(audio) / SAMPLE_RATE,
                )
            )
        return rows

    # Threads are enough: the work is in the renderer processes and in numpy/scipy.
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = [row for item_rows in pool.map(render_and_write, items) for row in item_rows]
    return pd.DataFrame(rows, columns=COLUMNS)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default="data/quality/sounds", help="parent folder (default: %(default)s)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the keys, velocities and durations (default: 0)",
    )
    parser.add_argument(
        "--jobs", type=int, choices=(1, 2), default=2, help="renderer processes at a time"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="2 items of 2 notes a sheet, every sheet, in a temporary folder (removed)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sounds_smoke_") as tmp:
        out, limit = (tmp, 2) if args.smoke else (args.out, None)
        try:
            sheets = build(out, seed=args.seed, jobs=args.jobs, limit=limit)
        except ToolMissing as exc:
            print(f"sound_sources: {exc}")
            return 2
        for key, path in sheets.items():
            print(f"{key}: {path} ({len(pd.read_excel(path, engine='calamine'))} clips)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
