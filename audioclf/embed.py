"""Embed new audio files and rank the classes of a gallery sheet for each of them, or embed
every row of an index sheet into files for a search index.

    python -m audioclf.embed --model runs/demo/best.pt --gallery data/demo/index.xlsx clips/
    python -m audioclf.embed --model model.pt --gallery refs.xlsx --top 3 --save out/new a.wav
    python -m audioclf.embed --model runs/demo/best.pt --index big.xlsx --save out/big --num-workers 8
    torchrun --nproc_per_node=8 -m audioclf.embed --model best.pt --index big.xlsx --save out/big

--model   an audioclf checkpoint (.pt from audioclf.train, or an export --format state_dict),
          or a TorchScript / ONNX export of audioclf.export with its sidecar <model>.json next
          to it (ONNX needs onnxruntime).
FILES     audio files (.wav .flac .ogg .aiff .mp3 ..., every format libsndfile reads, as for
          prepare), or .npy log-mel files for a model trained on precomputed features; folders
          are searched recursively. Each file is embedded whole, as in evaluation
          (clips.eval_crop).
--gallery an index sheet (.xlsx .csv .parquet) read with the model's column settings; every row
          is used, the split column is ignored. Its embeddings are cached in <model folder>/
          .audioclf_cache/ (keyed by the sheet, the model file and the features settings, not the
          audio files: after replacing them behind an unchanged sheet, pass --no-cache once).

For each file the N classes with the highest cosine similarity to the class centroid (mean of
the normalised gallery embeddings) are printed, best first. --save PREFIX writes PREFIX.npy
(float32 [files, D], printed order) and PREFIX.csv (file, top class, its score).
Exit status: 0 done; 1 done, but some files could not be read (each named on stderr, the rest
embedded); 2 bad input (no audio files found, a gallery sheet without a class column, no file
readable, a model that gives NaN) with a one-line message.

--index SHEET --save PREFIX (no files, no --gallery): every row of SHEET (read with the model's
column settings; --split S keeps the rows of one split, found by the training's rules) is
embedded in batches, with --num-workers DataLoader workers (default: the model's
data.num_workers) and a progress bar, into
  PREFIX.npy      float32 [rows, D]
  PREFIX.parquet  row (the sheet's row number), id, class, item, path: one row per .npy row.
The work goes in chunks of 4,096 rows, each written as a part file into PREFIX.parts/ when done;
a rerun (after a crash, a kill, a full disk) takes the finished parts of the same model, features
and rows and embeds only the rest; at the end PREFIX.npy and .parquet are assembled. An
unreadable or missing file stops the run with one line naming it and its sheet row; with
--skip-bad-files it is left out and listed in PREFIX.skipped.csv (row, id, path, reason).
Under torchrun or srun the chunks are dealt to the ranks, each on its own GPU, and rank 0
assembles the outputs (a rerun with another number of ranks takes every finished chunk); plain
python is one process. Prints a summary instead of rankings. Exit status: 0 done; 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from audioclf import distributed
from audioclf.cli import add_trust_flag, resolve_device
from audioclf.embedding.gallery import check_ranking_request, rank_files
from audioclf.embedding.index import check_index_request, embed_sheet
from audioclf.errors import run_cli
from audioclf.inference import LoadedEmbedder, load_embedder
from audioclf.inference.extract import check_loader_options

PROG = "python -m audioclf.embed"
SKIP_HINT = "pass --skip-bad-files"  # how an unreadable file's message says to skip them
MISSING_FILES_HINT = "pass --skip-bad-files to leave them out"  # the index check's hint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "files",
        nargs="*",
        metavar="AUDIO_OR_DIR",
        help="audio files or folders (searched recursively); not with --index",
    )
    parser.add_argument(
        "--model",
        required=True,
        type=Path,
        help="audioclf checkpoint, or TorchScript/ONNX export with its .json",
    )
    parser.add_argument("--gallery", type=Path, help="index sheet of labelled files (ranking)")
    parser.add_argument(
        "--index",
        type=Path,
        metavar="SHEET",
        help="embed every row of this index sheet into --save PREFIX.npy / "
        ".parquet (resumable; no files, no --gallery)",
    )
    parser.add_argument(
        "--split",
        help="with --index: only the rows of this split (train, "
        "val, test), by the sheet's split column or the training's rules",
    )
    parser.add_argument("--root", help="folder of the sheet's relative paths (default: its own)")
    parser.add_argument("--top", type=int, help="classes shown per file (default 5; ranking mode)")
    parser.add_argument(
        "--save",
        metavar="OUT_PREFIX",
        help="ranking mode: write OUT_PREFIX.npy (embeddings) and OUT_PREFIX.csv "
        "(files); --index: OUT_PREFIX.npy and OUT_PREFIX.parquet (rows)",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="files per batch (default 16)")
    parser.add_argument(
        "--num-workers",
        type=int,
        help="DataLoader worker processes (default: data.num_workers of the "
        "model with --index, 0 otherwise)",
    )
    parser.add_argument(
        "--skip-bad-files",
        action="store_true",
        help="with --index: leave unreadable or missing files out (listed in "
        "OUT_PREFIX.skipped.csv) instead of stopping",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="embed the gallery again instead of using (and writing) the cache",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_trust_flag(parser)
    return parser.parse_intermixed_args(argv)  # options and files in any order


def check_args(args: argparse.Namespace) -> None:
    """One error for flags that do not fit together (before the model is loaded)."""
    check_loader_options(args.batch_size, args.num_workers)
    if args.index is not None:
        check_index_request(
            args.save, files=args.files, gallery=args.gallery, top=args.top, no_cache=args.no_cache
        )
    else:
        check_ranking_request(
            args.files,
            args.gallery,
            top=args.top,
            split=args.split,
            skip_bad_files=args.skip_bad_files,
        )


def run(args: argparse.Namespace) -> int:
    check_args(args)
    device = resolve_device(args.device)
    if args.index is None:
        return run_ranking(args, load_embedder(args.model, device, trust=args.trust_checkpoint))
    with distributed.process_group(device) as env:  # one rank per process under torchrun
        return run_index(args, load_embedder(args.model, env.device, trust=args.trust_checkpoint))


def run_ranking(args: argparse.Namespace, model: LoadedEmbedder) -> int:
    ranking = rank_files(
        model,
        args.files,
        args.gallery,
        root=args.root,
        top=args.top,
        batch_size=args.batch_size,
        use_cache=not args.no_cache,
        progress=not args.quiet,
        num_workers=args.num_workers or 0,
    )
    print("\n".join(ranking.lines(model, args.gallery)))
    if args.save:
        npy, csv = ranking.save(args.save)
        print(f"saved {npy} and {csv}")
    for path, reason in ranking.skipped:
        print(f"{PROG}: skipped {path}: {reason}", file=sys.stderr)
    return 1 if ranking.skipped else 0


def run_index(args: argparse.Namespace, model: LoadedEmbedder) -> int:
    start = time.perf_counter()
    summary = embed_sheet(
        model,
        args.index,
        args.save,
        root=args.root,
        split=args.split,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        skip_bad_files=args.skip_bad_files,
        progress=not args.quiet,
        skip_hint=SKIP_HINT,
        missing_files_hint=MISSING_FILES_HINT,
    )
    if distributed.get_rank() == 0:
        print(
            "\n".join(summary.lines(model, split=args.split, seconds=time.perf_counter() - start))
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
