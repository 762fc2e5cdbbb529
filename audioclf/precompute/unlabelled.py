"""Log-mel features of unlabelled audio (data.unlabelled): the library under `prepare --unlabelled`.

    summary = prepare_unlabelled("new_source/", Path("DIR"), cfg, workers=8, skip_bad=False)
    # then train with data.unlabelled=DIR/unlabelled.csv features.kind=npy
    summary = pack_unlabelled("new_source/", Path("PACK"), cfg, workers=8, skip_bad=False)
    # then train with data.unlabelled=PACK/index.parquet features.kind=npy beside a packed index

The clips are those training would take from the source (audioclf.data.unlabelled: a folder
searched recursively, or a sheet with `path` and an optional `split`), checked the same way
(a rerun checks only the clips it has still to write).
Each gets DIR/unlabelled/<name>-<hash>.npy, the log-mel prepare writes for a labelled row; the
hash is of the clip's resolved path, so clips added to the source later are written by a rerun
and nothing else is. DIR/unlabelled.csv lists the files (`path`, relative to DIR) in the
source's order and is written last. The folder's rules are prepare's: prepare.json holds the
feature settings (a run with others is refused), one run at a time, files written atomically,
a killed run resumed, and labelled features can share DIR.

`pack_unlabelled` (prepare --unlabelled --pack) writes the clips as a feature pack of their
own (audioclf.data.pack: a folder of its own, in the source's order, resumable as prepare
--pack is), whose PACK/index.parquet lists them: `clip` (the source file) and the pack's
columns. Beside a packed data.index every crop of an unlabelled clip is then one positioned
read too; the two packs must hold the same features and dtype.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from functools import partial
from pathlib import Path

import pandas as pd

from audioclf.config import Config
from audioclf.data.index import Index
from audioclf.data.pack.write import PackOptions, PackSource, PackSummary, pack_source
from audioclf.data.unlabelled import CLIP_COLUMN, check_unlabelled, list_unlabelled
from audioclf.fileio import atomic_write_bytes
from audioclf.outputs import write_skipped
from audioclf.precompute.files import make_tasks
from audioclf.precompute.names import quote_name
from audioclf.precompute.run import Shard, Summary, feature_settings, prepare_out_dir, write_files

FOLDER = "unlabelled"  # DIR/unlabelled/: never a class folder, which live under DIR/features/
SHEET = "unlabelled.csv"
SKIPPED_LIST = "skipped-unlabelled.csv"


def feature_name(path: str) -> str:
    """DIR-relative .npy of the clip at `path`: its quoted stem and a hash of its resolved path."""
    resolved = str(Path(path).resolve())
    digest = hashlib.blake2b(resolved.encode("utf-8"), digest_size=6).hexdigest()
    return f"{FOLDER}/{quote_name(Path(path).stem)[:80]}-{digest}.npy"


def prepare_unlabelled(
    source: str, out_dir: Path, cfg: Config, *, workers: int, skip_bad: bool, progress: bool = True
) -> Summary:
    """Write the log-mel of every clip of `source` into `out_dir` and list them in
    DIR/unlabelled.csv (see the module); returns prepare's counts. ValueError on bad input."""
    start = time.perf_counter()
    features = dataclasses.replace(cfg.features, kind="audio")
    paths = list_unlabelled(source, features)
    targets = [feature_name(p) for p in paths]
    # a rerun reads the headers of the clips still to write, not of those written before
    new = [p for p, target in zip(paths, targets, strict=True) if not (out_dir / target).is_file()]
    # with --skip-bad the writer skips what it cannot read
    check_unlabelled(source, new, features, headers=not skip_bad, fix=SKIP_FIX)
    table = pd.DataFrame({"path": paths})
    table["row"], table["id"] = range(len(table)), table["path"]  # for skipped-unlabelled.csv
    sheet = out_dir / SHEET
    whole = Shard(0, 1)
    with prepare_out_dir(out_dir, feature_settings(cfg.features), sheet, Path(source), whole):
        (out_dir / FOLDER).mkdir(exist_ok=True)
        summary = Summary(whole, rows=len(table))
        skipped: dict[int, str] = {}
        tasks = make_tasks(table, targets, range(len(table)), excluded=())
        refuse = None if skip_bad else partial(_unreadable, paths)
        write_files(tasks, out_dir, cfg.features, summary, skipped, workers, progress, refuse)
        summary.skipped = len(skipped)
        summary.skipped_path = write_skipped(out_dir / SKIPPED_LIST, table, skipped)
        kept = [target for position, target in enumerate(targets) if position not in skipped]
        listing = pd.DataFrame({"path": kept}).to_csv(index=False)
        summary.index_path = atomic_write_bytes(sheet, listing.encode("utf-8"))
        summary.index_rows = len(kept)
    summary.elapsed = time.perf_counter() - start
    return summary


def pack_unlabelled(source: str, out_dir: Path, cfg: Config, **options) -> PackSummary:
    """The clips of `source` as a feature pack in `out_dir` (see the module; `options`: those
    of PackOptions); prepare --pack's summary. ValueError on bad input."""
    paths = list_unlabelled(source, cfg.features)
    # missing files named at once; each clip still to pack is read once, by the writer, which
    # refuses an unreadable one (or skips it: --skip-bad)
    check_unlabelled(source, paths, cfg.features, headers=False)
    order = [f"{position:012d}" for position in range(len(paths))]  # the pack keeps this order
    table = pd.DataFrame(
        {"path": paths, "row": range(1, len(paths) + 1), "cls": "", "item": order, "id": paths}
    )
    listing = "\n".join(paths).encode("utf-8")
    pack = PackSource(
        Index(table, Path(source)),
        listing,
        ["unlabelled"],
        lambda: pd.DataFrame({CLIP_COLUMN: paths, "path": ""}),
        "path",
        partial(_unreadable, paths),
    )
    return pack_source(pack, out_dir, cfg, PackOptions(**options))


SKIP_FIX = ", or pass --skip-bad to leave them out"


def _unreadable(paths: list[str], position: int, reason: str) -> str:
    return (
        f"unlabelled clip {paths[position]}: {reason}. Fix or remove it, or pass --skip-bad to "
        "leave it out"
    )


def unlabelled_command(sheet: Path, packed: bool = False) -> str:
    """How to train on what prepare_unlabelled or pack_unlabelled wrote (its `train on it:`
    line)."""
    if packed:
        return (
            f"data.unlabelled={sheet} features.kind=npy, beside a data.index packed with the "
            "same settings and --pack-dtype (python -m audioclf.prepare --index SHEET --out DIR "
            "--pack)"
        )
    return (
        f"data.unlabelled={sheet} features.kind=npy, beside a data.index prepared or packed "
        "with the same settings (python -m audioclf.prepare --index SHEET --out DIR [--pack])"
    )
