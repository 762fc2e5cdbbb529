"""Embed new audio files and rank the classes of a gallery sheet for each of them, or embed
every row of an index sheet into files for a search index.

    python -m audioclf.embed --model runs/demo/best.pt --gallery data/demo/index.xlsx clips/
    python -m audioclf.embed --model model.pt --gallery refs.xlsx --top 3 --save out/new a.wav
    python -m audioclf.embed --model runs/demo/best.pt --index big.xlsx --save out/big --num-workers 8
    torchrun --nproc_per_node=8 -m audioclf.embed --model best.pt --index big.xlsx --save out/big

--model   an audioclf checkpoint (.pt from audioclf.train, or an export --format state_dict),
          or a TorchScript / ONNX export of audioclf.export with its sidecar <model>.json next
          to it (ONNX needs onnxruntime).
FILES     audio files (every format libsndfile reads) or .npy log-mel files for a model of
          precomputed features; folders are searched recursively; embedded as in evaluation.
--gallery an index sheet (.xlsx .csv .parquet) read with the model's column settings; every row
          is used, the split column is ignored. Its embeddings are cached in <model folder>/
          .audioclf_cache/ (keyed by the sheet, the model file and the features settings, not the
          audio files: after replacing them behind an unchanged sheet, pass --no-cache once).
--adapt   a folder (or file) of unlabelled audio of a new source, repeatable: a checkpoint's
          BatchNorm statistics become that audio's (AdaBN) before anything is embedded; the
          model line of the output says so, and the gallery cache and --index parts are the
          adapted model's own. An export cannot be adapted.

For each file the gallery's N best classes are printed, best first: by default (--rank-by knn,
--knn 1) a class scores the cosine of its nearest gallery clip, evaluate's kNN rule; with
--knn K the K nearest clips vote first; --rank-by centroid scores each class centroid (the mean
of its normalised clips: a class whose recordings differ is no one blob). --exclude-own-item:
a file that is a gallery row is ranked without its own item's rows, and a last line counts the
files whose class ranked first (a new recording of a known class). --save PREFIX writes
PREFIX.npy (float32 [files, D], printed order) and PREFIX.csv (file, top class, its score).
Exit status: 0 done; 1 done, but some files could not be read (each named on stderr, the rest
embedded); 2 bad input (no audio files found, a gallery sheet without a class column, no file
readable, a model that gives NaN) with a one-line message.

--index SHEET --save PREFIX (no files, no --gallery): every row of SHEET (--split S: one
split's rows, by the training's rules) into PREFIX.npy (float32 [rows, D]) and PREFIX.parquet
(row, id, class, item, path), in chunks of 4,096 rows kept as part files in PREFIX.parts/, so a
rerun after a crash embeds only the rest. An unreadable file stops the run with one line naming
it and its row (--skip-bad-files: listed in PREFIX.skipped.csv). Under torchrun or srun the
chunks are dealt to the ranks and rank 0 assembles (docs/evaluation.md). Exit status: 0 done;
2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from audioclf import distributed
from audioclf.embedding.gallery import RANK_RULES, RankOptions, check_ranking_request, rank_files
from audioclf.embedding.index import EmbedSheetOptions, check_index_request, embed_sheet
from audioclf.errors import SKIP_HINT, add_adapt_flag, add_trust_flag, run_cli
from audioclf.inference import LoadedEmbedder, load_embedder, resolve_device
from audioclf.inference.adapt import adapt_across_ranks
from audioclf.inference.extract import check_loader_options

PROG = "python -m audioclf.embed"
MISSING_FILES_HINT = "pass --skip-bad-files to leave them out"  # the index check's hint
RANKING = RankOptions()  # the defaults
SHEET_FLAGS = [field.name for field in dataclasses.fields(EmbedSheetOptions)]  # --name each


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
    parser.add_argument("--model", required=True, type=Path, help="checkpoint or export (.json)")
    parser.add_argument("--gallery", type=Path, help="index sheet of labelled files (ranking)")
    parser.add_argument(
        "--index",
        type=Path,
        metavar="SHEET",
        help="embed every row of this index sheet into --save PREFIX.npy / "
        ".parquet (resumable; no files, no --gallery)",
    )
    parser.add_argument("--split", help="with --index: only this split's rows (train/val/test)")
    parser.add_argument("--root", help="folder of the sheet's relative paths (default: its own)")
    parser.add_argument("--top", type=int, help="classes shown per file (default 5; ranking mode)")
    parser.add_argument(
        "--rank-by", choices=RANK_RULES, default=RANKING.rule, help="knn (default), centroid"
    )
    parser.add_argument("--knn", type=int, default=RANKING.k, metavar="K", help="voting clips (1)")
    parser.add_argument(
        "--exclude-own-item", action="store_true", help="rank gallery rows without their own item"
    )
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
        "--skip-bad-files", action="store_true", help="--index: list unreadable files, go on"
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    add_adapt_flag(parser)
    parser.add_argument("--no-cache", action="store_true", help="embed the gallery again")
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
        return run_ranking(args, load_model(args, device))
    with distributed.process_group(device) as env:  # one rank per process under torchrun
        return run_index(args, load_model(args, env.device))


def load_model(args: argparse.Namespace, device) -> LoadedEmbedder:
    """--model, adapted on --adapt's audio when given (its description, on the first line of
    the output, says so; under torchrun rank 0 adapts and the other ranks take its statistics)."""
    model = load_embedder(args.model, device, trust=args.trust_checkpoint)
    return adapt_across_ranks(model, args.adapt) if args.adapt else model


def run_ranking(args: argparse.Namespace, model: LoadedEmbedder) -> int:
    ranking = rank_files(
        model,
        args.files,
        args.gallery,
        RankOptions(
            top=args.top, rule=args.rank_by, k=args.knn, exclude_own_item=args.exclude_own_item
        ),
        root=args.root,
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
    options = EmbedSheetOptions(**{name: getattr(args, name) for name in SHEET_FLAGS})
    summary = embed_sheet(
        model,
        args.index,
        args.save,
        options,
        progress=not args.quiet,
        skip_hint=SKIP_HINT,
        missing_files_hint=MISSING_FILES_HINT,
    )
    if distributed.get_rank() == 0:
        print("\n".join(summary.lines(model)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
