"""NeMo JSONL manifests: audio_filepath, duration, label, and optional offset (a segment)."""

from __future__ import annotations

import os
from pathlib import Path

from audioclf.data.formats.records import Entry, FormatError, field, json_lines, resolve

NUMBER = (int, float)


def read_nemo(manifest: Path, base: Path, *, commands=None) -> list[Entry]:  # noqa: ARG001
    """One Entry per manifest line. Ids are the audio paths relative to the folder all of them
    share, without their suffix (`spk/video/utt`), plus `@<offset>` for a segment; a segment's
    item is its audio file (the recording)."""
    if manifest.is_dir():
        raise FormatError(f"{manifest} is a folder: give the NeMo manifest (.json / .jsonl)")
    lines = list(json_lines(manifest))
    paths = [resolve(field(r, "audio_filepath", where), base) for where, r in lines]
    if not paths:
        raise FormatError(f"{manifest} holds no manifest lines")
    common = os.path.commonpath([os.path.dirname(p) for p in paths])
    entries = []
    for (where, record), path in zip(lines, paths, strict=True):
        label = field(record, "label", where, (str, int), hint=" (the class of the clip)")
        name = os.path.splitext(os.path.relpath(path, common))[0].replace(os.sep, "/")
        entry = Entry(str(label), name, path, where)
        if record.get("offset") is not None:
            offset = field(record, "offset", where, NUMBER)
            duration = field(record, "duration", where, NUMBER, hint=" (with an offset)")
            if offset < 0 or duration <= 0:
                raise FormatError(
                    f"{where}: a segment needs offset >= 0 and duration > 0, got offset "
                    f"{offset} and duration {duration}"
                )
            entry.id, entry.item = f"{name}@{offset:g}", name
            entry.start, entry.end = float(offset), float(offset + duration)
        entries.append(entry)
    return entries
