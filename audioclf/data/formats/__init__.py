"""Import the peer toolkits' dataset formats as an index sheet (`prepare --from FORMAT SOURCE`).

    kaldi      a data dir: wav.scp (id -> path), utt2spk (class), optional segments
               (utt rec start end: the recording's path, start/end set, item = recording id)
    nemo       a JSONL manifest: audio_filepath, label, duration, optional offset (a segment)
    lhotse     recordings + supervisions JSONL(.gz) (a folder, or one of the two files), or a
               cuts manifest of MonoCuts (item = recording_id, start/end from the segment)
    wespeaker  wav.scp + utt2spk (keys lose their audio suffix) or data.list (key, wav, spk)

    summary = import_sheet("kaldi", Path("data/train"), Path("train.csv"), cfg.data)

The sheet has the data.class/item/id/path columns and, when any row is a segment, start and end
(seconds). The item comes from the source's recording column where it has one, else from
--item-pattern (one group) over the id, by default the middle of VoxCeleb-style ids
(spk/video/utt or spk-video-utt); ids it does not fit at all are each their own item. The rows
are checked (files exist, segments inside them) before the sheet is written, atomically;
malformed input is one FormatError naming the file and line.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from audioclf.config import DataConfig
from audioclf.data.formats.commands import CommandSources
from audioclf.data.formats.kaldi import read_kaldi, read_wespeaker
from audioclf.data.formats.lhotse import read_lhotse
from audioclf.data.formats.nemo import read_nemo
from audioclf.data.formats.records import Entry, FormatError
from audioclf.data.index.validate import check_spans, validate_table
from audioclf.fileio import atomic_write

log = logging.getLogger("audioclf")

READERS = {
    "kaldi": read_kaldi,
    "nemo": read_nemo,
    "lhotse": read_lhotse,
    "wespeaker": read_wespeaker,
}
# VoxCeleb-style ids: the video between the speaker and the utterance
VOXCELEB_PATTERNS = (r"^[^/]+/(.+)/[^/]+$", r"^[^/-]+-(.+)-[^/-]+$")
SHEET_SUFFIXES = (".csv", ".xlsx", ".parquet")

__all__ = ["READERS", "FormatError", "ImportSummary", "add_import_arguments", "import_sheet"]


@dataclass(frozen=True)
class ImportSummary:
    sheet: Path
    rows: int
    classes: int
    items: int
    segments: int
    item_rule: str  # how the item column was filled, in words

    def lines(self) -> list[str]:
        return [
            f"{self.sheet}: {self.rows} rows ({self.segments} segments), {self.classes} "
            f"classes, {self.items} items",
            f"item: {self.item_rule}",
            f"train on it: ./run.sh configs/cnn.yaml data.index={self.sheet}",
        ]


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    """prepare's --from and --item-pattern flags."""
    parser.add_argument(
        "--from",
        dest="source",
        nargs=2,
        metavar=("FORMAT", "SOURCE"),
        help=f"import a dataset of another toolkit ({'|'.join(READERS)}) as the index sheet "
        "--out (.csv .xlsx .parquet), instead of writing features",
    )
    parser.add_argument(
        "--item-pattern",
        metavar="REGEX",
        help="with --from: the item is this regex's one group over the utterance id "
        "(default: the recording where the source has one, else the middle of VoxCeleb ids)",
    )
    parser.add_argument(
        "--run-commands",
        action="store_true",
        help="with --from kaldi|wespeaker|lhotse: run the data dir's commands (wav.scp pipes "
        "'sox ... |', Lhotse command sources) once each, in parallel, writing their audio to "
        "OUT_audio/ beside the sheet, which lists those files (off: such entries are refused)",
    )


def import_sheet(
    kind: str,
    source: Path,
    out: Path,
    data: DataConfig,
    item_pattern: str | None = None,
    root: str | None = None,
    *,
    run_commands: bool = False,
    progress: bool = True,
) -> ImportSummary:
    """Read `source` in format `kind`, write the checked sheet `out`; relative audio paths
    resolve against `root` (default: the source's folder). `run_commands`: the source's
    command entries are run once each into files under <out's folder>/<out's stem>_audio/."""
    source, out = Path(source), Path(out)
    if kind not in READERS:
        raise FormatError(f"--from {kind!r} is not a format: use one of {', '.join(READERS)}")
    if out.suffix.lower() not in SHEET_SUFFIXES:
        raise FormatError(f"--out {out} must end in one of {', '.join(SHEET_SUFFIXES)}")
    base = Path(root) if root else (source if source.is_dir() else source.parent)
    audio = out.absolute().parent / f"{out.stem}_audio" if run_commands else None
    commands = CommandSources(audio, cwd=base.absolute())
    entries = READERS[kind](source, base.absolute(), commands=commands)
    if not entries:
        raise FormatError(f"{source} lists no utterances")
    if commands.run(progress):
        log.info("ran %d commands of %s into %s", len(commands.pending), source, audio)
    rule = _assign_items(entries, item_pattern)
    log.info("import %s %s: item %s", kind, source, rule)
    _check_entries(entries)
    frame = _frame(entries, data)
    validate_table(frame, data, out.absolute(), str(out.absolute().parent))  # the final guard
    atomic_write(out, lambda handle: _write(frame, out, handle))
    segments = sum(e.start is not None for e in entries)
    classes, items = frame[data.class_column], frame[data.item_column]
    return ImportSummary(
        out,
        len(frame),
        classes.nunique(),
        len(set(zip(classes, items, strict=True))),
        segments,
        rule,
    )


def _assign_items(entries: list[Entry], pattern: str | None) -> str:
    """Fill every entry's item; the rule used, in words."""
    if pattern is not None:
        compiled = re.compile(pattern)
        if compiled.groups != 1:
            raise FormatError(f"--item-pattern {pattern!r} needs exactly one (group)")
        for entry in entries:
            match = compiled.search(entry.id)
            if match is None:
                raise FormatError(
                    f"{entry.where}: id {entry.id!r} does not match --item-pattern {pattern!r}"
                )
            entry.item = match.group(1)
        return f"group 1 of --item-pattern {pattern!r} over the id"
    column = [entry for entry in entries if entry.item is not None]
    entries = [entry for entry in entries if entry.item is None]
    by_column = "the recording id of each segment (the source's column)"
    if not entries:
        return by_column
    rule = _pattern_items(entries)
    return f"{by_column}; other rows: {rule}" if column else rule


def _pattern_items(entries: list[Entry]) -> str:
    """Fill the items of entries without a recording column from their VoxCeleb-style ids."""
    matches = [_voxceleb_item(entry.id) for entry in entries]
    if not any(matches):
        for entry in entries:
            entry.item = entry.id
        return (
            "each id its own item (no recording column, and the ids are not VoxCeleb-style "
            "spk/video/utt: set --item-pattern to take the recording from the id)"
        )
    for entry, item in zip(entries, matches, strict=True):
        if item is None:
            raise FormatError(
                f"{entry.where}: id {entry.id!r} is not VoxCeleb-style (spk/video/utt or "
                "spk-video-utt) as the others are; set --item-pattern REGEX (one group)"
            )
        entry.item = item
    return "the middle part of VoxCeleb-style ids (spk/video/utt or spk-video-utt)"


def _voxceleb_item(utterance: str) -> str | None:
    for pattern in VOXCELEB_PATTERNS:
        match = re.search(pattern, utterance)
        if match:
            return match.group(1)
    return None


def _check_entries(entries: list[Entry]) -> None:
    """Ids unique, files present, segments inside their files: else one line naming the line."""
    seen: dict[str, str] = {}
    for entry in entries:
        if entry.id in seen:
            raise FormatError(f"{entry.where}: id {entry.id!r} repeats {seen[entry.id]}")
        seen[entry.id] = entry.where
        if not Path(entry.path).is_file():
            raise FormatError(f"{entry.where}: audio file {entry.path} does not exist")
        if entry.start is not None and not 0 <= entry.start < entry.end:
            raise FormatError(
                f"{entry.where}: a segment needs end > start >= 0, got {entry.start:g}-"
                f"{entry.end:g} s"
            )
    spans = pd.DataFrame(
        {
            "path": [e.path for e in entries],
            "end": [np.nan if e.end is None else e.end for e in entries],
        }
    )
    for position, what in check_spans(spans)[:1]:
        raise FormatError(f"{entries[position].where}: {what}")


def _frame(entries: list[Entry], data: DataConfig) -> pd.DataFrame:
    columns = {
        data.class_column: [e.cls for e in entries],
        data.item_column: [e.item for e in entries],
        data.id_column: [e.id for e in entries],
        data.path_column: [e.path for e in entries],
    }
    if any(e.start is not None for e in entries):
        columns["start"] = [_seconds_text(e.start) for e in entries]
        columns["end"] = [_seconds_text(e.end) for e in entries]
    return pd.DataFrame(columns, dtype=str)


def _seconds_text(value: float | None) -> str:
    """Seconds to the microsecond, without trailing zeros ("" for a whole file)."""
    return "" if value is None else f"{value:.6f}".rstrip("0").rstrip(".")


def _write(frame: pd.DataFrame, out: Path, handle) -> None:
    suffix = out.suffix.lower()
    if suffix == ".csv":
        handle.write(frame.to_csv(index=False).encode("utf-8"))
    elif suffix == ".parquet":
        frame.to_parquet(handle, index=False)
    else:
        frame.to_excel(handle, index=False)
