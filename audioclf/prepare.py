"""Precompute log-mel features: an index of audio files → .npy files + an index to train on.

    python -m audioclf.prepare --index data/train/index.xlsx --out data/train_feats
    python -m audioclf.prepare --index IN --out DIR --config configs/cnn.yaml --workers 16
    python -m audioclf.prepare --index IN --out DIR --shard 3/8       # one of 8 machines/jobs
    python -m audioclf.prepare --from kaldi data/train --out train.csv  # import (docs/data.md)
    python -m audioclf.prepare --index IN --out DIR --pack             # one feature pack
    python -m audioclf.prepare --index FEATS.xlsx --out DIR --pack features.kind=npy
    python -m audioclf.prepare --unlabelled new_source/ --out DIR [--pack]  # data.unlabelled

--pack writes a feature pack instead of one .npy per row (audioclf.data.pack; docs/data.md,
"Large datasets"): a few large data files of float16 frames (--pack-dtype float32 keeps fp32),
class-major, with DIR/index.parquet to train on (data.index=DIR/index.parquet features.kind=npy):
each training crop is then one positioned read. From audio it runs the front end as below; with
features.kind=npy it packs the sheet's existing .npy files as they are (clips.npy_layout gives
their axis order). Resumable after a kill; no --shard. With --unlabelled: the clips as a pack,
for data.unlabelled=DIR/index.parquet beside a packed index of the same features and dtype.

--from kaldi|nemo|lhotse|wespeaker SOURCE writes the index sheet --out (.csv .xlsx .parquet) of
another toolkit's dataset, segments as start/end seconds (audioclf.data.formats), and stops.

Reads the index sheet IN (.xlsx .csv .parquet; columns and data.root from --config, checked as
in training) and writes, for every row, the log-mel of its audio file to
    DIR/features/<class>/<id>.npy      float32 [frames, n_mels], un-normalised
exactly what audioclf.spectrogram.log_mel returns (the training front end's LogMel, valid
frames only), so `features.kind=npy` on these files trains like `features.kind=audio` on the
audio (normalisation and SpecAugment still run in the model). Class folders and file names are
the class and id with every character other than letters, digits, '-', '_' and '.' written as
%XX (e.g. 'a/b:c' → 'a%2Fb%3Ac'; a leading '.' too); names that would still meet on a
case-insensitive file system, or longer than 200 bytes, get '~' + a hash of the exact name.
Feature settings (features.sample_rate, n_fft, win_length, hop_length, n_mels, f_min, f_max)
come from --config and the key=value overrides (default: the built-in defaults). They are
recorded in DIR/prepare.json; a later run with other settings into the same DIR is refused.

DIR/index.<suffix of IN> (.xlsm is written as .xlsx) has the same columns and rows as IN (blank
rows dropped), with the path column (data.path_column; added when IN uses data.path_template)
pointing to the feature files, relative to DIR. Train on it with the command printed at the end:
    ./run.sh --nproc 4 configs/cnn.yaml data.index=DIR/index.xlsx features.kind=npy ...

Parallel: --workers N processes (default: all cores; 1 = in this process), one torch thread
each, files handed out in chunks; a progress bar with ETA.

Resumable: every file is written to DIR/features/<class>/.<id>.npy.tmp and renamed into
place, so a killed run leaves no half file. A rerun skips files that are complete (a valid .npy
header for [frames, n_mels] float32 and the size it promises), rewrites the others, removes the
temporary files a killed run left, and says how many files were already present.

Sharded: --shard i/n (0-based i) processes the data rows whose position in the sheet (blank
rows not counted) modulo n is i; the n shards together write every file, byte for byte as one
unsharded run. Every finished shard writes DIR/shards/<i>-of-<n>.json (its skipped rows; it
also names the sheet's content and the settings). The index is written by the run that finds
all n records of the same sheet and settings present (the last shard to finish, or any rerun
after that); it leaves out the skipped rows of every shard, so it is the same whichever shard
finished last. Before that, DIR has no index (an older one stays until then).

Unreadable audio: stops the run with one line naming the file and its sheet row. With
--skip-bad the file is listed in DIR/skipped.csv (with --shard: skipped-<i>-of-<n>.csv;
columns row, id, path, reason) and left out of the index; missing files and files that are not
audio (by suffix) are then skipped too. Readable suffixes: those of libsndfile (wav, flac, ogg,
mp3, aiff, ...).

At the end: files written / already present / skipped, hours of audio, bytes written, elapsed
time, and the command to train on DIR.
Exit status: 0 done; 2 bad input (a missing or invalid sheet, a bad --shard, an unknown config
key, non-audio or .npy files in IN, DIR not writable or holding other settings, an unreadable
audio file without --skip-bad) with one line `python -m audioclf.prepare: error: ...`; the
index is then not written and files already written stay complete.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from audioclf.config import load_config
from audioclf.data.formats import add_import_arguments, import_sheet
from audioclf.data.pack.format import DTYPES
from audioclf.data.pack.write import pack_features
from audioclf.errors import UsageError, run_cli
from audioclf.precompute import Shard, prepare, train_command
from audioclf.precompute.unlabelled import pack_unlabelled, prepare_unlabelled, unlabelled_command

PROG = "python -m audioclf.prepare"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--index", type=Path, help="the audio files' index (.xlsx .csv .parquet)")
    parser.add_argument(
        "--unlabelled",
        metavar="SOURCE",
        help="unlabelled audio (a folder, or a sheet with a path column) for data.unlabelled "
        "(features.kind=npy): DIR/unlabelled/*.npy and DIR/unlabelled.csv, or a pack (--pack)",
    )
    parser.add_argument(
        "--out",
        required=True,
        type=Path,
        help="output folder: features/, index.<suffix>, prepare.json, shards/",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="YAML config for the feature and column settings (default: built-in defaults)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, as for training (e.g. features.n_mels=80)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help=f"worker processes (default: all cores, {os.cpu_count()}; 1 = in this process)",
    )
    parser.add_argument(
        "--shard",
        default="0/1",
        metavar="i/n",
        help="process only rows whose position %% n == i (0-based); the last of "
        "the n shards to finish writes the index (default 0/1: everything)",
    )
    parser.add_argument(
        "--skip-bad",
        action="store_true",
        help="list unreadable, missing and non-audio files in skipped.csv and "
        "leave them out of the index, instead of stopping",
    )
    parser.add_argument(
        "--root",
        help="folder that relative paths in the sheet resolve against "
        "(default: data.root of the config, else the sheet's folder)",
    )
    parser.add_argument(
        "--pack",
        action="store_true",
        help="write a feature pack (a few large files, one read per crop) instead of one .npy "
        "per row; features.kind=npy packs a sheet of .npy features as they are",
    )
    parser.add_argument(
        "--pack-dtype",
        choices=DTYPES,
        default="float16",
        help="with --pack: how frames are stored (default float16: half the bytes)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_import_arguments(parser)
    return parser.parse_intermixed_args(argv)  # options and files in any order


def run(args: argparse.Namespace) -> int:
    shard = Shard.parse(args.shard)
    cfg = load_config(args.config, args.overrides)
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if args.source is not None:
        summary = import_sheet(*args.source, args.out, cfg.data, args.item_pattern, args.root,
                               run_commands=args.run_commands, progress=not args.quiet)  # fmt: skip
        print("\n".join(summary.lines()))
        return 0
    if (args.index is None) == (args.unlabelled is None):
        raise UsageError("give one of --index SHEET, --unlabelled SOURCE or --from FORMAT SOURCE")
    if args.root is not None:
        cfg.data.root = args.root
    if shard.count > 1 and (args.pack or args.unlabelled is not None):
        what = "--pack writes one pack" if args.pack else "--unlabelled writes its files"
        raise UsageError(f"{what} in one run: drop --shard")
    common = dict(workers=args.workers, skip_bad=args.skip_bad, progress=not args.quiet)
    if args.pack:
        common["dtype"] = args.pack_dtype
    if args.unlabelled is not None:
        write = pack_unlabelled if args.pack else prepare_unlabelled
        summary = write(args.unlabelled, args.out, cfg, **common)
    elif args.pack:
        summary = pack_features(args.index, args.out, cfg, **common)
    else:
        summary = prepare(args.index, args.out, cfg, shard=shard, **common)
    # the last shard to finish writes the index: before that there is nothing to train on
    command = train_command(summary.index_path, cfg, args.config) if summary.index_path else ""
    if args.unlabelled is not None:
        command = unlabelled_command(summary.index_path, packed=args.pack)
    print("\n".join(summary.lines(command)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
