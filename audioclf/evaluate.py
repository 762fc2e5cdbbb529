"""Evaluate a trained checkpoint on one split of its index and write a report.

    python -m audioclf.evaluate --checkpoint runs/demo/best.pt
    python -m audioclf.evaluate --checkpoint runs/demo/best.pt --index other.xlsx --split test
    python -m audioclf.evaluate --checkpoint runs/demo/best.pt --gallery enroll.xlsx --out eval_enroll

One process (no torchrun) on CPU or GPU. The model and the data settings come from the
checkpoint's config: the evaluated split (default val) is found with the same split rules as in
training (--index swaps the sheet, not the rules). Embeddings are extracted in batches with a
progress bar; similarities are computed in chunks, so memory stays bounded.

Metrics:
  retrieval       P@1, MAP@R, R-precision inside the evaluated split, cross-item: a query never
                  retrieves clips of its own item (a_item, e.g. the same recording), and R counts
                  the other items' clips of its class; loo_* are the leave-one-out figures
                  (own-item clips allowed), which flatter a model
  classification  kNN top-1 and nearest-centroid accuracy of the evaluated split
  verification    EER and minDCF (p_target 0.01) on same/different-class pairs (--max-pairs),
                  raw and, with score normalisation, also eer_<m> and min_dcf_<m>
  clustering      NMI and AMI of k-means with one cluster per class

Retrieval search (--search): each query's R nearest clips come from an audioclf.search index.
auto (the default) and exact are the exact figures (a full scan); ivf / hnsw (faiss) are faster
at scale, and the report then gives their neighbour recall and each metric's bias against
exact on 1,000 seeded queries.

Classification gallery (--gallery):
  train (default)  the train split of the same index. When it holds every evaluated class the
                   evaluated split is classified against it (closed set). When it lacks some
                   (an open-set split, data.holdout=classes), the evaluated split is divided
                   instead: in each class half of the items (recordings) enroll and the other
                   half query, and the report says so. Classes with one sample are left out.
  PATH             every row of another sheet (same column settings); it must hold every
                   evaluated class.
  none             no classification metrics.

Score normalisation (--score-norm, off by default): each verification score minus each side's
mean score against a cohort, over its standard deviation, averaged over the two sides; snorm
over the whole cohort, asnorm over each side's --cohort-top highest (default 300, or a fifth of
a cohort under 1,500 clips). --cohort train (the default cohort) is the train split: embedded
for it alone in an open-set split, sharing every class in a closed one, hence off by default;
--cohort SHEET is every row of a sheet, ideally of other classes (a shared class is noted).
--cohort alone means asnorm, --score-norm alone the train split.

Adaptation (--adapt DIR, repeatable): the checkpoint's BatchNorm statistics become those of
the unlabelled audio in DIR (AdaBN) before anything is embedded; the printed checkpoint line and
report.json's "adaptation" say on what.

Writes report.json, report.md and PNG plots (DET curve, per-class P@1, PCA/t-SNE projection,
kNN confusion matrix) into --out (default <checkpoint folder>/eval), and prints a summary.
Beside them: embeddings.tsv + metadata.tsv for https://projector.tensorflow.org and
embeddings.html, a 2-D PCA scatter (class-stratified samples of at most 20,000 / 5,000 points).
Exit status: 0 done; 2 bad input (missing or corrupt checkpoint, index errors, an empty split,
a gallery without an evaluated class, a bad --cohort sheet) with a one-line message and no
report written.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from audioclf.config import ModelConfig, choices
from audioclf.errors import SKIP_HINT, add_adapt_flag, add_trust_flag, run_cli
from audioclf.evaluation import EvaluateOptions, evaluate
from audioclf.evaluation.metrics import SEARCH_METHODS
from audioclf.metrics import SCORE_NORMS
from audioclf.training.trackers import attach_report

PROG = "python -m audioclf.evaluate"
DEFAULTS = EvaluateOptions()
OPTION_FLAGS = [field.name for field in dataclasses.fields(EvaluateOptions)]  # --name each


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", required=True, type=Path, help="audioclf checkpoint (runs/<name>/best.pt)"
    )
    parser.add_argument(
        "--index", type=Path, help="evaluate another sheet (replaces data.index; split rules kept)"
    )
    parser.add_argument(
        "--root",
        help="folder that relative paths resolve against (default: "
        "data.root of the checkpoint, or the sheet's folder with --index)",
    )
    parser.add_argument(
        "--split",
        default=DEFAULTS.split,
        help="evaluated: train, val (default), test, or all (every row)",
    )
    parser.add_argument(
        "--gallery",
        default=DEFAULTS.gallery,
        help="classification gallery: train (default), none, or PATH",
    )
    parser.add_argument("--out", type=Path, help="report folder (default <checkpoint folder>/eval)")
    parser.add_argument(
        "--batch-size", type=int, default=DEFAULTS.batch_size, help="clips per batch (default 32)"
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    add_adapt_flag(parser)
    parser.add_argument(
        "--num-workers",
        type=int,
        help="DataLoader workers (default: data.num_workers of the checkpoint)",
    )
    parser.add_argument(
        "--max-pairs",
        type=int,
        default=DEFAULTS.max_pairs,
        help="verification pairs scored at most (default 1000000)",
    )
    parser.add_argument("--score-norm", choices=SCORE_NORMS, help="none (default), snorm, asnorm")
    parser.add_argument("--cohort", help="score normalisation cohort: train (default) or PATH")
    parser.add_argument("--cohort-top", type=int, help="asnorm: top N kept a side (default 300)")
    parser.add_argument(
        "--search",
        choices=SEARCH_METHODS,
        default=DEFAULTS.search,
        help="retrieval neighbour search (default auto = exact; ivf / hnsw on request)",
    )
    parser.add_argument(
        "--projection",
        choices=("pca", "tsne"),
        default=DEFAULTS.projection,
        help="2-D projection (default pca)",
    )
    parser.add_argument(
        "--model-name",
        choices=choices(ModelConfig, "name"),
        help="fail unless the checkpoint holds this model",
    )
    parser.add_argument(
        "--skip-bad-files",
        action="store_true",
        help="skip unreadable files (counted in the log) instead of failing",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULTS.seed,
        help="seed of pairs, k-means and enrollment (default 0)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_trust_flag(parser)
    return parser.parse_intermixed_args(argv)  # options and files in any order


def run(args: argparse.Namespace) -> int:
    values = {name: getattr(args, name) for name in OPTION_FLAGS}
    options = EvaluateOptions(**{**values, "adapt": args.adapt or ()})
    options.check(by_flag=True)
    evaluated = evaluate(
        args.checkpoint,
        options,
        out=args.out,
        device=args.device,
        model_name=args.model_name,
        progress=not args.quiet,
        trust=args.trust_checkpoint,
        skip_hint=SKIP_HINT,
    )
    print("\n".join(evaluated.lines()))
    run_dir = Path(evaluated.setup["checkpoint"]).parent  # a folder given: its best.pt's
    if (tracker := attach_report(run_dir, evaluated.out_dir)) is not None:
        print(f"report.json and report.md added to the training's {tracker} run")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
