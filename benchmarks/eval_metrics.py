"""Benchmark: audioclf.metrics.retrieval_metrics against pytorch-metric-learning's AccuracyCalculator.

Run from the repository root:

    .venv/bin/python benchmarks/eval_metrics.py            # 100k x 128; several minutes on 2 cores (--repeats 1 to shorten)
    .venv/bin/python benchmarks/eval_metrics.py --n 5000   # a quicker run
    .venv/bin/python benchmarks/eval_metrics.py --smoke    # 2,000 x 32, cross-item too, seconds
    .venv/bin/python benchmarks/eval_metrics.py --scale --skip-pml   # 400k x 256, cross-item

Both sides get the same seeded embeddings (n samples, n / 50 classes with random sizes, class
centres plus Gaussian noise so the metrics are far from 0 and 1) and compute P@1, MAP@R and
R-precision by cosine similarity. Without faiss, PML's default FaissKNN cannot be built, so PML
runs its own torch k-NN (``CustomKNN(CosineSimilarity(), batch_size=...)``; unbatched it would
build the full N x N matrix). Each side runs in a forked child process so that its peak
resident memory (``ru_maxrss`` at the end minus at the start) is its own; each side first makes
an untimed warm-up call on a few hundred rows, then --repeats timed calls of which the fastest
counts (the machine may be shared).

Prints both timings, the values side by side, the speed ratio, and PASS if audioclf is at
least as fast as PML and every value agrees within --tolerance, else FAIL (exit status 1).
"""

from __future__ import annotations

import argparse
import multiprocessing
import pathlib
import resource
import sys
import time

import numpy as np
import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from pytorch_metric_learning.utils.inference import CustomKNN

sys.path.insert(
    0, str(pathlib.Path(__file__).resolve().parents[1])
)  # run as a script from anywhere

from audioclf.metrics import retrieval_metrics  # noqa: E402

# audioclf name -> PML AccuracyCalculator name
METRIC_NAMES = {
    "precision_at_1": "precision_at_1",
    "map_at_r": "mean_average_precision_at_r",
    "r_precision": "r_precision",
}
# Rows in the untimed warm-up call, so one-off start-up costs do not land on either side.
WARMUP_ROWS = 512


def make_embeddings(n: int, dim: int, items_per_class: int, noise: float, seed: int):
    rng = np.random.default_rng(seed)
    n_classes = max(2, n // items_per_class)
    labels = rng.integers(0, n_classes, size=n)
    centres = rng.normal(size=(n_classes, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    embeddings = centres[labels] + rng.normal(scale=noise, size=(n, dim))
    return embeddings.astype(np.float32), labels.astype(np.int64)


def run_audioclf(embeddings, labels, chunk_size):
    result = retrieval_metrics(embeddings, labels, chunk_size=chunk_size)
    return {name: result[name] for name in METRIC_NAMES}


def items_of(labels: np.ndarray, items_per_class: int) -> np.ndarray:
    """Item ids: each class's rows dealt round-robin to `items_per_class` items."""
    order = np.argsort(labels, kind="stable")
    first = np.searchsorted(labels[order], labels[order], side="left")
    items = np.empty(len(labels), dtype=np.int64)
    items[order] = (np.arange(len(labels)) - first) % items_per_class
    return items


def run_cross_item(embeddings, labels, chunk_size, items):
    result = retrieval_metrics(embeddings, labels, items=items, chunk_size=chunk_size)
    return {name: result[name] for name in METRIC_NAMES}


def run_pml(embeddings, labels, chunk_size):
    calculator = AccuracyCalculator(
        include=tuple(METRIC_NAMES.values()),
        k="max_bin_count",
        device=torch.device("cpu"),
        knn_func=CustomKNN(CosineSimilarity(), batch_size=chunk_size),
    )
    result = calculator.get_accuracy(embeddings, labels)
    return {ours: result[theirs] for ours, theirs in METRIC_NAMES.items()}


def _child(fn, args, repeats, conn):
    embeddings, labels, chunk_size, *rest = args
    rest = [r[:WARMUP_ROWS] for r in rest]
    fn(embeddings[:WARMUP_ROWS], labels[:WARMUP_ROWS], chunk_size, *rest)  # torch/BLAS start-up
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        values = fn(*args)
        seconds = min(seconds, time.perf_counter() - start)
    peak_delta_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kib) / 1024
    conn.send((values, seconds, peak_delta_mib))
    conn.close()


def timed_in_child(fn, args, repeats):
    """(values, fastest of `repeats` seconds, peak extra RSS in MiB) of fn(*args), run in a
    forked process after an untimed warm-up call on the first WARMUP_ROWS rows."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(fn, args, repeats, sender))
    process.start()
    sender.close()
    try:
        outcome = receiver.recv()
    except EOFError:
        process.join()
        raise RuntimeError(
            f"{fn.__name__} died with exit code {process.exitcode} (out of memory?)"
        ) from None
    process.join()
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100_000, help="number of embeddings")
    parser.add_argument("--dim", type=int, default=128, help="embedding dimension")
    parser.add_argument("--items-per-class", type=int, default=50, help="mean class size")
    parser.add_argument(
        "--noise", type=float, default=0.15, help="per-dimension noise std around class centres"
    )
    parser.add_argument(
        "--chunk-size", type=int, default=2048, help="query rows per step, both sides"
    )
    parser.add_argument(
        "--tolerance", type=float, default=1e-6, help="max |audioclf - PML| per metric"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed calls per side; the fastest counts"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cross-item",
        type=int,
        default=0,
        metavar="ITEMS",
        help="also time cross-item retrieval with this many items per class",
    )
    parser.add_argument(
        "--skip-pml",
        action="store_true",
        help="no PML side (it has no cross-item metric; at 400k it takes long)",
    )
    parser.add_argument(
        "--scale",
        action="store_true",
        help="the seed-scale case: 400k x 256, 5 items per class, cross-item, "
        "one timed call per side",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="2,000 x 32, cross-item too, one call per side: the exit status holds the values' "
        "agreement, not the speed (a run this small times nothing)",
    )
    args = parser.parse_args()
    if args.scale:
        args.n, args.dim, args.items_per_class, args.cross_item = 400_000, 256, 200, 5
        args.repeats = 1
    if args.smoke:
        args.n, args.dim, args.items_per_class, args.cross_item, args.repeats = 2000, 32, 20, 2, 1

    embeddings, labels = make_embeddings(
        args.n, args.dim, args.items_per_class, args.noise, args.seed
    )
    counts = np.bincount(labels)
    print(
        f"data: {args.n} x {args.dim} float32, {np.count_nonzero(counts)} classes "
        f"(size {counts[counts > 0].min()}..{counts.max()}), chunk_size={args.chunk_size}, "
        f"torch threads={torch.get_num_threads()}, time = fastest of {args.repeats}"
    )

    inputs = (embeddings, labels, args.chunk_size)
    if args.cross_item:
        items = items_of(labels, args.cross_item)
        cross, cross_s, cross_mib = timed_in_child(run_cross_item, (*inputs, items), args.repeats)
        print(
            f"cross-item ({args.cross_item} items per class): "
            + ", ".join(f"{k} {v:.4f}" for k, v in cross.items())
            + f"; {cross_s:.1f} s, peak +RSS {cross_mib:.0f} MiB "
            f"(embeddings {embeddings.nbytes / 2**20:.0f} MiB)",
            flush=True,
        )
    ours, ours_s, ours_mib = timed_in_child(run_audioclf, inputs, args.repeats)
    print(f"leave-one-out: {ours_s:.1f} s, peak +RSS {ours_mib:.0f} MiB", flush=True)
    if args.skip_pml:
        print("PML skipped (--skip-pml)")
        return 0
    theirs, theirs_s, theirs_mib = timed_in_child(run_pml, inputs, args.repeats)

    print(f"{'metric':<16}{'audioclf':>20}{'PML':>20}{'|diff|':>12}")
    values_equal = True
    for name in METRIC_NAMES:
        diff = abs(ours[name] - theirs[name])
        values_equal &= diff <= args.tolerance
        print(f"{name:<16}{ours[name]:>20.12f}{theirs[name]:>20.12f}{diff:>12.2e}")
    print(f"{'time (s)':<16}{ours_s:>20.2f}{theirs_s:>20.2f}")
    print(f"{'peak +RSS (MiB)':<16}{ours_mib:>20.0f}{theirs_mib:>20.0f}")
    speedup = theirs_s / ours_s
    print(f"speed ratio: PML time / audioclf time = {speedup:.2f}x")

    faster = ours_s <= theirs_s
    verdict = "PASS" if faster and values_equal else "FAIL"
    print(
        f"{verdict}: audioclf at least as fast as PML: {faster}; "
        f"values equal within {args.tolerance:g}: {values_equal}"
    )
    return 0 if verdict == "PASS" or (args.smoke and values_equal) else 1


if __name__ == "__main__":
    sys.exit(main())
