"""Which rows an evaluation embeds and scores: the evaluated split of the checkpoint's index or
of another sheet, the gallery its classification ranks against and the cohort of score
normalisation (select_data → EvalData). Part of `evaluate` (run.py)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from audioclf.config import Config, DataConfig
from audioclf.data.index import Index, load_index, split_index

SHEET_SUFFIXES = (".xlsx", ".xlsm", ".csv", ".parquet")


@dataclass
class EvalData:
    evaluated: Index
    split: str
    classification: str  # "gallery", "enrollment" or "none"
    gallery: Index | None  # with classification="gallery"
    gallery_source: str  # "train split of <sheet>", "<sheet>", or "none"
    missing_classes: list[str] = field(default_factory=list)  # evaluated, absent from the gallery
    cohort: Index | None = None  # of score normalisation; the gallery itself when both are train
    cohort_source: str = "none"


def data_config(cfg: Config, index: Path | None, root: str | None) -> DataConfig:
    """The checkpoint's data section with --index / --root applied."""
    data = cfg.data
    if index is not None:
        data = dataclasses.replace(data, index=str(index), root=root or "")
    elif root is not None:
        data = dataclasses.replace(data, root=root)
    if index is None and not Path(data.index).is_file():
        raise ValueError(
            f"the index sheet {data.index} named in the checkpoint's config (data.index) is not "
            f"found from {os.getcwd()}; pass --index PATH (and --root if paths are relative to "
            "another folder)"
        )
    return data


def select_data(
    cfg: Config,
    *,
    index: Path | None = None,
    root: str | None = None,
    split: str = "val",
    gallery: str = "train",
    cohort: str | None = None,
) -> EvalData:
    """The evaluated split, how it is classified and the score-normalisation cohort (None,
    "train" or a sheet); ValueError / IndexValidationError on bad input, all before anything is
    embedded."""
    data = data_config(cfg, index, root)
    full = load_index(data)
    splits = split_index(full, data)
    evaluated = _evaluated_split(full, splits, split, data)
    chosen = {}
    if cohort is not None:
        rows, source = _train_or_sheet("--cohort", cohort, full, splits, split, data, root)
        if len(rows) < 2:
            raise ValueError(f"the cohort ({source}) has {len(rows)} row(s); it needs at least 2")
        chosen = {"cohort": rows, "cohort_source": source}
    if gallery == "none":
        return EvalData(evaluated, split, "none", None, "none", **chosen)
    gallery_index, source = _train_or_sheet("--gallery", gallery, full, splits, split, data, root)
    missing = sorted(set(evaluated.classes) - set(gallery_index.classes))
    if not missing:
        return EvalData(evaluated, split, "gallery", gallery_index, source, **chosen)
    if gallery != "train":
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"the gallery {source} lacks {len(missing)} of the {len(evaluated.classes)} evaluated "
            f"classes ({shown}{more}); give a gallery sheet with every class, --gallery train or "
            "--gallery none"
        )
    # An open-set split: the train split cannot classify these classes; enroll from the split.
    return EvalData(evaluated, split, "enrollment", None, source, missing, **chosen)


def _train_or_sheet(flag: str, value: str, full: Index, splits, split: str, data, root):
    """(rows, where they come from) of a --gallery / --cohort value: the train split, or every
    row of a sheet, read with the model's column settings."""
    other = "--gallery none, " if flag == "--gallery" else ""
    if value == "train":
        if split in ("train", "all"):
            raise ValueError(
                f"--split {split} overlaps the train {flag[2:]}; pass {other}{flag} SHEET"
            )
        return splits["train"], f"train split of {full.source}"
    if Path(value).suffix.lower() not in SHEET_SUFFIXES or not Path(value).is_file():
        raise ValueError(
            f"{flag} {value}: no such sheet; use {flag} train, {other}or a sheet that exists "
            "(.xlsx, .csv, .parquet)"
        )
    try:
        sheet = load_index(dataclasses.replace(data, index=value, root=root or ""))
    except ValueError as exc:
        raise ValueError(f"{flag} {value}: {exc}") from None
    return sheet, str(sheet.source)


def _evaluated_split(full: Index, splits: dict[str, Index], split: str, data: DataConfig) -> Index:
    if split == "all":
        evaluated = full
    elif split in splits:
        evaluated = splits[split]
    else:
        raise ValueError(
            f"{full.source} has no {split!r} split (it has {', '.join(splits)}); "
            f"use --split {' / '.join([*splits, 'all'])}"
        )
    if len(evaluated) < 2:
        state = "is empty" if len(evaluated) == 0 else "has a single sample"
        raise ValueError(
            f"the {split} split of {full.source} {state} (split rules: data.split_column="
            f"{data.split_column!r}, data.holdout={data.holdout}, data.val_ratio={data.val_ratio}"
            "); evaluation needs at least 2 samples: choose another --split or --index"
        )
    return evaluated
