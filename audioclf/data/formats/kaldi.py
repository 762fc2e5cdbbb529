"""Kaldi data dirs (wav.scp, utt2spk, optional segments; spk2utt is not needed) and WeSpeaker's
raw lists (the same wav.scp + utt2spk, or data.list JSON lines of key, wav, spk)."""

from __future__ import annotations

import os
from pathlib import Path

from audioclf.data.formats.commands import CommandSources
from audioclf.data.formats.records import (
    Entry,
    FormatError,
    field,
    json_lines,
    resolve,
    seconds,
    text_lines,
)
from audioclf.data.readers import AUDIO_SUFFIXES, audio_seconds


def read_kaldi(
    folder: Path,
    base: Path,
    *,
    strip_suffix: bool = False,
    commands: CommandSources | None = None,
) -> list[Entry]:
    """One Entry per utterance of a Kaldi data dir; with `segments`, a segment of its recording
    (item: the recording id). `strip_suffix`: keys lose an audio suffix (WeSpeaker's keys).
    wav.scp pipes (`cmd |`) become the files `commands` will write (refused without it)."""
    if not folder.is_dir():
        raise FormatError(f"{folder} is not a folder: give the Kaldi data dir (wav.scp, utt2spk)")
    commands = commands or CommandSources(None)
    wavs = _table(folder / "wav.scp", base, strip_suffix, commands)
    speakers = _table(folder / "utt2spk", base, strip_suffix)
    segments = folder / "segments"
    if segments.is_file():
        entries = _segments(segments, wavs)
    else:
        entries = [Entry("", utt, path, where) for utt, (path, where) in wavs.items()]
    for entry in entries:
        if entry.id not in speakers:
            raise FormatError(
                f"{entry.where}: utterance {entry.id!r} has no line in {folder / 'utt2spk'}; "
                "add it (utt2spk: '<utterance> <speaker>') or remove the utterance"
            )
        entry.cls = speakers[entry.id][0]
    known = {entry.id for entry in entries}
    for utt, (_, where) in speakers.items():
        if utt not in known:
            listed = "segments" if segments.is_file() else "wav.scp"
            raise FormatError(f"{where}: utterance {utt!r} is not in {folder / listed}")
    return entries


def _table(
    path: Path, base: Path, strip_suffix: bool, commands: CommandSources | None = None
) -> dict:
    """{key: (value, "file:line")} of a two-column Kaldi file (wav.scp, with `commands`: its
    values resolved)."""
    paths = commands is not None
    table: dict[str, tuple[str, str]] = {}
    for where, fields in text_lines(path):
        if len(fields) < 2 or (len(fields) > 2 and not paths):
            raise FormatError(
                f"{where}: expected '<id> <{'path' if paths else 'speaker'}>', got "
                f"{' '.join(fields)!r}"
            )
        key, value = fields[0], " ".join(fields[1:])
        if paths:
            value = _wav_path(key, value, where, base, commands)
        if strip_suffix and os.path.splitext(key)[1].lower() in AUDIO_SUFFIXES:
            key = os.path.splitext(key)[0]
        if key in table:
            raise FormatError(f"{where}: {key!r} is listed twice (also at {table[key][1]})")
        table[key] = (value, where)
    return table


def _wav_path(key: str, value: str, where: str, base: Path, commands: CommandSources) -> str:
    if value.endswith("|"):
        return commands.audio_file(key, value[:-1].strip(), where)
    if ".ark:" in value:
        raise FormatError(
            f"{where}: the entry points into a Kaldi archive ({value!r}): write the audio to "
            "files (e.g. wav-copy) and list their paths in wav.scp"
        )
    return resolve(value, base)


def _segments(path: Path, wavs: dict) -> list[Entry]:
    """Entries of a segments file: '<utterance> <recording> <start> <end>' (end -1: the end)."""
    entries = []
    for where, fields in text_lines(path):
        if len(fields) != 4:
            raise FormatError(
                f"{where}: expected '<utterance> <recording> <start> <end>', got "
                f"{' '.join(fields)!r}"
            )
        utt, recording = fields[:2]
        if recording not in wavs:
            raise FormatError(f"{where}: recording {recording!r} is not in {path.parent}/wav.scp")
        audio = wavs[recording][0]
        start, end = seconds(fields[2], where, "start"), seconds(fields[3], where, "end")
        if end == -1:  # Kaldi: to the end of the recording
            end = _duration(audio, where)
        entries.append(Entry("", utt, audio, where, item=recording, start=start, end=end))
    return entries


def _duration(audio: str, where: str) -> float:
    try:
        return audio_seconds(audio)
    except (RuntimeError, OSError) as exc:
        raise FormatError(
            f"{where}: end -1 needs the length of {audio}, unreadable: {exc}"
        ) from None


def read_wespeaker(
    source: Path, base: Path, *, commands: CommandSources | None = None
) -> list[Entry]:
    """A WeSpeaker data dir (wav.scp + utt2spk, keys without their audio suffix, as
    tools/make_raw_list.py reads them) or its raw list (data.list: JSON lines key, wav, spk)."""
    if source.is_dir():
        if (source / "wav.scp").is_file():
            return read_kaldi(source, base, strip_suffix=True, commands=commands)
        for name in ("data.list", "raw.list"):
            if (source / name).is_file():
                return read_wespeaker(source / name, base)
        raise FormatError(f"{source} holds no wav.scp + utt2spk, data.list or raw.list")
    entries = []
    for where, record in json_lines(source):
        hint = " (a WeSpeaker raw list line: {'key': ..., 'wav': ..., 'spk': ...}; shard lists of tar files cannot be read)"
        key = field(record, "key", where, hint=hint)
        speaker = record.get("spk", record.get("speaker"))
        speaker = field({"spk": speaker}, "spk", where, hint=hint)
        wav = field(record, "wav", where, hint=hint)
        entries.append(Entry(speaker, key, resolve(wav, base), where))
    return entries
