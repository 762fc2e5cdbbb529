"""Nearest-clip search over the embeddings of `audioclf.embed --index`: build an index beside
them, then ask which clips sound like some audio files, a folder, or another embedded set.

    python -m audioclf.embed --model runs/demo/best.pt --index big.xlsx --save out/big
    python -m audioclf.search build out/big --method ivf --model runs/demo/best.pt
    python -m audioclf.search query out/big clips/ a.wav --model runs/demo/best.pt --k 5
    python -m audioclf.search query out/big --query-prefix out/new --csv hits.csv
    python -m audioclf.search query out/big --query-prefix out/big --exclude-same-item --json dup.json

build PREFIX  index PREFIX.npy (float32 [rows, D]) with PREFIX.parquet (row, id, class, item,
              path), saved beside them as PREFIX.<method>.json (a progress bar while it builds):
                exact  every query scored against every row (torch; on --device when queried)
                ivf    faiss IndexIVFFlat: --nlist k-means lists, --nprobe visited per query
                hnsw   faiss IndexHNSWFlat: --hnsw-m links, --ef-construction, --ef-search
                ivfpq  faiss IndexIVFPQ: rows coded in --pq-m bytes, --rerank x k re-scored
              The approximate ones need faiss (pip install faiss-cpu) and also write
              PREFIX.<method>.faiss. --model MODEL records the model that made the embeddings,
              so that a query with a model of another dimension or other features is refused.
query PREFIX  the --k nearest rows of each query by cosine similarity, best first, with score,
              class, item, id and path: a table, or --csv FILE / --json FILE. The queries are
              audio files and folders (searched recursively), embedded with --model (checkpoint
              or export) as audioclf.embed does, or --query-prefix Q: every row of Q.npy /
              Q.parquet (another embed --index run, or PREFIX itself). --method picks a saved
              index (default: the one saved; exact when none is). --exclude-same-item (with
              --query-prefix) never returns a row of the query's own item (class + item): the
              same sound in other recordings, e.g. to find duplicates.
              --cohort C adds norm_score: each hit's cosine AS-norm-normalised (or
              --score-norm snorm) against every row of C.npy (e.g. the training set embedded),
              as evaluate's --score-norm; one threshold fits every query, ranks stay by cosine.
Memory stays bounded: queries are searched in chunks. Exit status: 0 done; 1 done, but some
audio files could not be read (each named on stderr); 2 bad input (a missing PREFIX file, a
model or dimension that does not match the index, faiss missing) with a one-line message.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from audioclf.errors import UsageError, add_trust_flag, run_cli
from audioclf.inference import load_embedder, resolve_device
from audioclf.metrics import SCORE_NORMS
from audioclf.search.collection import Collection, build_saved, record_for
from audioclf.search.index import BUILD_PARAMS, METHODS
from audioclf.search.queries import (
    Searcher,
    audio_queries,
    prefix_queries,
    table_lines,
    write_csv,
    write_json,
)

PROG = "python -m audioclf.search"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{build,query}")
    more = f"See {PROG} --help for what each does."
    build = commands.add_parser("build", help="index PREFIX.npy beside it", description=more)
    query = commands.add_parser(
        "query", help="the nearest rows of audio or of another PREFIX", description=more
    )
    for sub in (build, query):
        sub.add_argument("prefix", metavar="PREFIX", help="--save PREFIX of embed --index")
        sub.add_argument("--model", type=Path, help="checkpoint or export that made PREFIX")
        sub.add_argument("--quiet", action="store_true", help="no progress bars")
        add_trust_flag(sub)
    build.add_argument("--method", choices=METHODS, default="exact", help="default exact")
    for name in BUILD_PARAMS:
        build.add_argument(f"--{name.replace('_', '-')}", type=int, help="default: the library's")
    build.add_argument("--seed", type=int, default=0, help="k-means sample seed (default 0)")
    query.add_argument("inputs", nargs="*", metavar="AUDIO_OR_DIR", help="query audio")
    query.add_argument("--query-prefix", metavar="Q", help="query with every row of Q.npy")
    query.add_argument("--method", choices=METHODS, help="which saved index (default: the one)")
    query.add_argument("--k", type=int, default=10, help="neighbours per query (default 10)")
    query.add_argument(
        "--exclude-same-item", action="store_true", help="skip rows of the query's own item"
    )
    query.add_argument("--cohort", metavar="C", help="normalise scores against every row of C.npy")
    query.add_argument("--score-norm", choices=SCORE_NORMS, help="default asnorm")
    query.add_argument("--cohort-top", type=int, help="asnorm: top N kept a side (default 300)")
    query.add_argument("--csv", type=Path, metavar="FILE", help="write the table as CSV")
    query.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    query.add_argument("--nprobe", type=int, help="ivf / ivfpq: lists visited per query")
    query.add_argument("--ef-search", type=int, help="hnsw: candidate list length")
    query.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    query.add_argument("--batch-size", type=int, default=16, help="audio files per batch")
    query.add_argument("--num-workers", type=int, default=0, help="DataLoader workers")
    # Options and files in any order: parse_intermixed_args refuses subparsers, so the top
    # parser only picks the command (or answers --help) and that command's parser reads the rest.
    argv = sys.argv[1:] if argv is None else list(argv)
    command = parser.parse_known_args(argv)[0].command
    before, rest = argv[: argv.index(command)], argv[argv.index(command) + 1 :]
    if before:
        parser.error(f"unrecognized arguments: {' '.join(before)}")
    return commands.choices[command].parse_intermixed_args(
        rest, argparse.Namespace(command=command)
    )


def run_build(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    collection = Collection.open(args.prefix)
    record = None
    if args.model is not None:  # the table's own record stays the one the index keeps
        model = load_embedder(args.model, torch.device("cpu"), trust=args.trust_checkpoint)
        record, warning = record_for(model, collection)
        if warning:
            print(f"{PROG}: {warning}", file=sys.stderr)
    params = {name: getattr(args, name) for name in BUILD_PARAMS}
    index = build_saved(
        collection, args.method, model=record, progress=not args.quiet, seed=args.seed, **params
    )
    record = index.info.get("model")
    made_by = f"; embeddings of {record['path']}" if record else ""
    print(f"saved {index.describe()}{made_by} in {time.perf_counter() - start:.1f} s")
    return 0


def check_query_args(args: argparse.Namespace) -> None:
    """One error for query flags that do not fit together, before any work."""
    if bool(args.inputs) == bool(args.query_prefix):
        raise UsageError("give the queries as audio files / folders or as --query-prefix Q")
    if args.inputs and args.model is None:
        raise UsageError("audio queries need --model (the checkpoint or export that made PREFIX)")
    if args.query_prefix and args.model is not None:
        raise UsageError("--model embeds audio queries; --query-prefix rows are embedded already")
    if args.exclude_same_item and not args.query_prefix:
        raise UsageError("--exclude-same-item needs --query-prefix (audio files have no item)")
    for flag, value, low in (("--k", args.k, 1), ("--batch-size", args.batch_size, 1)):
        if value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    if args.num_workers < 0:
        raise UsageError(f"--num-workers must be >= 0, got {args.num_workers}")


def run_query(args: argparse.Namespace) -> int:
    check_query_args(args)
    device = resolve_device(args.device)
    model = None
    if args.inputs:
        model = load_embedder(args.model, device, trust=args.trust_checkpoint)
    searcher = Searcher.open(
        args.prefix,
        model=model,
        method=args.method,
        device=device,
        nprobe=args.nprobe,
        ef_search=args.ef_search,
        cohort=args.cohort,
        score_norm=args.score_norm,
        cohort_top=args.cohort_top,
    )
    if searcher.warning:
        print(f"{PROG}: {searcher.warning}", file=sys.stderr)
    if model is None:
        queries = prefix_queries(Collection.open(args.query_prefix, flag="--query-prefix"))
    else:
        queries = audio_queries(
            model,
            args.inputs,
            batch_size=args.batch_size,
            num_workers=args.num_workers,
            progress=not args.quiet,
        )
    table = searcher.table(
        queries, args.k, exclude_same_item=args.exclude_same_item, progress=not args.quiet
    )
    own = ", own item excluded" if args.exclude_same_item else ""
    index, norm = searcher.index, searcher.norm
    header = f"index {index.describe()}; queries: {queries.source}; top {args.k}{own}"
    print(header + ("" if norm is None else f"; norm_score: {norm.describe()}"))
    if args.csv:
        print(f"wrote {len(table)} rows to {write_csv(table, args.csv)}")
    if args.json:
        saved = index.path or searcher.collection.npy
        about = {"index": str(saved), "method": index.method, "k": args.k}
        about.update({} if norm is None else {"score_norm": norm.record()})
        print(f"wrote {len(queries.labels)} queries to {write_json(table, args.json, about)}")
    if not (args.csv or args.json):
        print("\n".join(table_lines(table)))
    for path, reason in queries.skipped:
        print(f"{PROG}: skipped {path}: {reason}", file=sys.stderr)
    return 1 if queries.skipped else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(PROG, lambda: run_build(args) if args.command == "build" else run_query(args))


if __name__ == "__main__":
    sys.exit(main())
