"""Lhotse manifests (JSONL, or JSONL.gz): recordings + supervisions, or cuts of the plain kind
(MonoCut, its recording of one file source, its supervisions of one speaker)."""

from __future__ import annotations

from pathlib import Path

from audioclf.data.formats.commands import CommandSources
from audioclf.data.formats.records import Entry, FormatError, field, json_lines, resolve

NUMBER = (int, float)
KINDS = ("recordings", "supervisions", "cuts")


def read_lhotse(source: Path, base: Path, *, commands: CommandSources | None = None) -> list[Entry]:
    """A cuts manifest, a supervisions or recordings manifest (its partner found by the same
    name with 'supervisions' <-> 'recordings'), or a folder holding one pair or one cuts file.
    Sources of type `command` become the files `commands` will write (refused without it)."""
    commands = commands or CommandSources(None)
    found = _manifests(source)
    if "cuts" in found:
        return [_cut(where, record, base, commands) for where, record in json_lines(found["cuts"])]
    recordings = {}
    for where, record in json_lines(found["recordings"]):
        recordings[field(record, "id", where)] = _recording_path(record, where, base, commands)
    entries = []
    for where, record in json_lines(found["supervisions"]):
        recording = field(record, "recording_id", where)
        if recording not in recordings:
            raise FormatError(f"{where}: recording {recording!r} is not in {found['recordings']}")
        entries.append(_segment(record, where, recording, recordings[recording], 0.0))
    return entries


def _kind(path: Path) -> str:
    """Which manifest a file is, by its first record's keys."""
    for where, record in json_lines(path):
        if "recording_id" in record:
            return "supervisions"
        if "sources" in record:
            return "recordings"
        if "recording" in record or str(record.get("type", "")).endswith("Cut"):
            return "cuts"
        raise FormatError(
            f"{where}: not a Lhotse recording, supervision or cut (keys {sorted(record)})"
        )
    raise FormatError(f"{path} holds no manifest lines")


def _manifests(source: Path) -> dict[str, Path]:
    """{kind: file} of the manifests to read: {"cuts": ...} or recordings and supervisions."""
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))
        found: dict[str, list[Path]] = {kind: [] for kind in KINDS}
        for path in files:
            found[_kind(path)].append(path)
        if len(found["cuts"]) == 1 and not found["supervisions"]:
            return {"cuts": found["cuts"][0]}
        if len(found["recordings"]) == 1 and len(found["supervisions"]) == 1:
            return {kind: found[kind][0] for kind in ("recordings", "supervisions")}
        counts = ", ".join(f"{len(found[k])} {k}" for k in KINDS)
        raise FormatError(
            f"{source} holds {counts} manifests: give one cuts manifest, or one recordings "
            "and one supervisions manifest (or name the file to read)"
        )
    kind = _kind(source)
    if kind == "cuts":
        return {"cuts": source}
    other = "recordings" if kind == "supervisions" else "supervisions"
    partner = source.with_name(source.name.replace(kind, other))
    if partner == source or not partner.is_file():
        raise FormatError(
            f"{source} is a {kind} manifest, and its {other} manifest ({partner.name}) is not "
            "beside it: give the folder holding both, or a cuts manifest"
        )
    return {kind: source, other: partner}


def _recording_path(recording: dict, where: str, base: Path, commands: CommandSources) -> str:
    """The one audio file of a recording (a `command` source: the file `commands` will write);
    refuses other sources (url, memory, several channels' files, ...)."""
    sources = field(recording, "sources", where, list)
    kinds = [s.get("type") if isinstance(s, dict) else None for s in sources]
    if kinds == ["command"]:
        command = field(sources[0], "source", where)
        return commands.audio_file(field(recording, "id", where), command, where, "command source")
    if kinds != ["file"]:
        raise FormatError(
            f"{where}: recording {recording.get('id')!r} has sources of type {kinds}; only "
            "one source of type 'file' (or 'command', with --run-commands) can be read (save "
            "the audio to a file per recording)"
        )
    return resolve(field(sources[0], "source", where), base)


def _segment(record: dict, where: str, recording: str, path: str, offset: float) -> Entry:
    """The Entry of a supervision (its start is relative to `offset`: a cut's start)."""
    start = field(record, "start", where, NUMBER) + offset
    duration = field(record, "duration", where, NUMBER)
    speaker = field(record, "speaker", where, hint=" (the class of the segment)")
    return Entry(
        speaker, field(record, "id", where), path, where, recording, start, start + duration
    )


def _cut(where: str, cut: dict, base: Path, commands: CommandSources) -> Entry:
    """A MonoCut as one segment of its recording, its class the speaker of its supervisions."""
    if cut.get("type", "MonoCut") != "MonoCut" or not isinstance(cut.get("recording"), dict):
        raise FormatError(
            f"{where}: cut {cut.get('id')!r} is a {cut.get('type', 'cut without a recording')}; "
            "only MonoCuts with a recording can be read (save mixed or padded cuts as audio "
            "files, or give the recordings and supervisions manifests)"
        )
    recording = cut["recording"]
    path = _recording_path(recording, where, base, commands)
    speakers = {s.get("speaker") for s in cut.get("supervisions") or [] if isinstance(s, dict)}
    if len(speakers) != 1 or None in speakers:
        raise FormatError(
            f"{where}: cut {cut.get('id')!r} has supervisions of {len(speakers)} speakers "
            f"({sorted(map(str, speakers))}); a cut needs one speaker to be one class"
        )
    start = field(cut, "start", where, NUMBER)
    record = {
        "id": cut.get("id"),
        "start": 0,
        "duration": cut.get("duration"),
        "speaker": speakers.pop(),
    }
    return _segment(record, where, field(recording, "id", where), path, start)
