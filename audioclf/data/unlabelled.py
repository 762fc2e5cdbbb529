"""Unlabelled audio of the source a model will be deployed to (data.unlabelled).

    clips = load_unlabelled(cfg.data.unlabelled, cfg.features)   # UnlabelledClips
    clips.paths, clips.source, len(clips), clips.pack

`data.unlabelled` is a folder (searched recursively, sorted, for the files the model takes:
audio, or .npy log-mel with features.kind=npy; their paths made absolute) or a sheet (.csv,
.xlsx, .parquet) with a `path` column (relative paths resolved against the sheet's folder) and
optionally a `split` column: rows whose split is empty or `train` are used, the others (e.g. a
held-out half) are not.
The index.parquet of an unlabelled pack (prepare --unlabelled --pack) is such a sheet: its
clips are read from the pack (`clips.pack`, checked as a packed index is; features.kind=npy),
and `clips.paths` are the source files its `clip` column names.
Checked like the index: missing files are named, unreadable audio files too (their header is
read), and the count of usable clips is logged by the trainer.

What an item is for unlabelled audio: every clip is its own item. A pseudo-class (a confident
cluster, audioclf.training.unlabelled) therefore draws `sampler.m` distinct clips, and the
self-supervised views of one clip are two crops of that one clip.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import soundfile as sf

from audioclf.config import FeaturesConfig
from audioclf.data.index.table import PACK_COLUMNS
from audioclf.data.pack.read import PackedFeatures
from audioclf.data.readers import AUDIO_SUFFIXES

SHEET_SUFFIXES = (".csv", ".xlsx", ".xls", ".parquet")
CLIP_COLUMN = "clip"  # an unlabelled pack's index: the source file of each clip
USED_SPLITS = ("", "train")  # rows of a sheet's split column that are used
_SHOWN = 5  # files named in a message


class UnlabelledAudioError(ValueError):
    """data.unlabelled cannot be used: the message names the files and the fix."""


@dataclass(frozen=True)
class UnlabelledClips:
    source: str  # data.unlabelled as given
    paths: tuple[str, ...]  # one clip each, in a fixed (sorted / sheet) order
    pack: PackedFeatures | None = None  # their features, position by position (an unlabelled pack)

    def __len__(self) -> int:
        return len(self.paths)


def load_unlabelled(source: str, features: FeaturesConfig) -> UnlabelledClips:
    """The clips of `source` (a folder or a sheet, see the module), checked: raises
    UnlabelledAudioError naming missing or unreadable files, or an empty source."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".parquet":
        if PACK_COLUMNS[0] in pq.read_schema(path).names:  # the columns, not the rows
            table = _used_rows(pd.read_parquet(path), path)
            return _packed_clips(source, path, table, features)
    paths = list_unlabelled(source, features)
    check_unlabelled(source, paths, features)
    return UnlabelledClips(source=str(source), paths=tuple(paths))


def _packed_clips(
    source: str, sheet: Path, table: pd.DataFrame, features: FeaturesConfig
) -> UnlabelledClips:
    """The clips of an unlabelled pack's index (`table`: its used rows), the pack checked."""
    if CLIP_COLUMN not in table.columns:
        raise UnlabelledAudioError(
            f"data.unlabelled={source} is a labelled feature pack's index (no '{CLIP_COLUMN}' "
            "column); give data.index this one, and data.unlabelled a pack of prepare "
            "--unlabelled SOURCE --pack"
        )
    if table.empty:
        raise UnlabelledAudioError(f"data.unlabelled={source} holds no clips")
    if features.kind != "npy":
        raise UnlabelledAudioError(
            f"data.unlabelled={source} is a feature pack: set features.kind=npy"
        )
    located = pd.DataFrame(
        {
            "path": [str(sheet.parent / p) for p in table["path"].astype(str)],
            "row": table.index.to_numpy() + 1,  # the parquet's row numbers, for its messages
            PACK_COLUMNS[0]: table[PACK_COLUMNS[0]].to_numpy(),
            PACK_COLUMNS[1]: table[PACK_COLUMNS[1]].to_numpy(),
        }
    )
    pack = PackedFeatures.of(located, features)
    clips = table[CLIP_COLUMN].astype(str).tolist()
    return UnlabelledClips(source=str(source), paths=tuple(clips), pack=pack)


def list_unlabelled(source: str, features: FeaturesConfig) -> list[str]:
    """The clips of `source`, not yet checked (`check_unlabelled`); UnlabelledAudioError for a
    source that is neither a folder nor a sheet, or holds none."""
    path = Path(source).expanduser()
    if path.is_dir():
        paths = _search(path, features)
    elif path.is_file() and path.suffix.lower() in SHEET_SUFFIXES:
        paths = _from_sheet(path)
    elif path.exists():
        raise UnlabelledAudioError(
            f"data.unlabelled={source}: not a folder nor a sheet ({', '.join(SHEET_SUFFIXES)}); "
            "give a folder of audio or a sheet with a 'path' column"
        )
    else:
        raise UnlabelledAudioError(f"data.unlabelled={source} does not exist")
    if not paths:
        wanted = "audio" if features.kind == "audio" else ".npy (features.kind=npy)"
        raise UnlabelledAudioError(f"data.unlabelled={source} holds no {wanted} files")
    return paths


def _search(folder: Path, features: FeaturesConfig) -> list[str]:
    """The folder's clips, absolute (a pack's clip column and every message name them so,
    whatever folder a later run starts in)."""
    wanted = AUDIO_SUFFIXES if features.kind == "audio" else frozenset({".npy"})
    found = sorted(
        p for p in folder.absolute().rglob("*") if p.is_file() and p.suffix.lower() in wanted
    )
    return [str(p) for p in found]


def _from_sheet(sheet: Path) -> list[str]:
    suffix = sheet.suffix.lower()
    if suffix == ".csv":
        table = pd.read_csv(sheet, dtype=str, keep_default_na=False)
    elif suffix == ".parquet":
        table = pd.read_parquet(sheet).astype(str)
    else:
        table = pd.read_excel(sheet, dtype=str).fillna("")
    table = _used_rows(table, sheet)
    if CLIP_COLUMN in table.columns and PACK_COLUMNS[0] in table.columns:
        return table[CLIP_COLUMN].tolist()  # an unlabelled pack: its clips' source files
    columns = {str(c).strip().lower(): c for c in table.columns}
    paths = table[columns["path"]].str.strip()
    empty = int((paths == "").sum())
    if empty:
        raise UnlabelledAudioError(
            f"data.unlabelled={sheet}: {empty} row(s) have an empty path; fill or delete them"
        )
    return [str(p if p.is_absolute() else sheet.parent / p) for p in map(Path, paths)]


def _used_rows(table: pd.DataFrame, sheet: Path) -> pd.DataFrame:
    """The rows of a data.unlabelled sheet that are used (its split column's empty and `train`
    rows); UnlabelledAudioError for a sheet without a path column."""
    columns = {str(c).strip().lower(): c for c in table.columns}
    if "path" not in columns:
        raise UnlabelledAudioError(
            f"data.unlabelled={sheet}: the sheet has no 'path' column (columns: "
            f"{', '.join(map(str, table.columns))}); add one with each clip's file"
        )
    if "split" in columns:
        split = table[columns["split"]].astype(str).str.strip().str.lower()
        table = table[split.isin(USED_SPLITS)]
    return table


def check_unlabelled(
    source: str, paths: list[str], features: FeaturesConfig, *, headers: bool = True, fix: str = ""
) -> None:
    """UnlabelledAudioError naming the files of `paths` that are missing or, for audio and
    `headers`, whose header cannot be read (a writer that reads each clip anyway passes False);
    `fix`: another way out, said after "fix or remove them"."""
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise UnlabelledAudioError(
            f"data.unlabelled={source}: {len(missing)} of {len(paths)} files do not exist: "
            f"{_shown(missing)}; fix the paths or remove those rows"
        )
    if features.kind != "audio" or not headers:
        return
    unreadable = []
    for path in paths:
        try:
            sf.info(path)
        except (sf.LibsndfileError, RuntimeError) as exc:
            unreadable.append(f"{path} ({exc})")
    if unreadable:
        raise UnlabelledAudioError(
            f"data.unlabelled={source}: {len(unreadable)} of {len(paths)} files cannot be read "
            f"as audio: {_shown(unreadable)}; fix or remove them{fix}"
        )


def _shown(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more
