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
  verification    EER and minDCF (p_target 0.01) on same/different-class pairs (--max-pairs)
  clustering      NMI and AMI of k-means with one cluster per class

Classification gallery (--gallery):
  train (default)  the train split of the same index. When it holds every evaluated class the
                   evaluated split is classified against it (closed set). When it lacks some
                   (an open-set split, data.holdout=classes), the evaluated split is divided
                   instead: in each class half of the items (recordings) enroll and the other
                   half query, and the report says so. Classes with one sample are left out.
  PATH             every row of another sheet (same column settings); it must hold every
                   evaluated class.
  none             no classification metrics.

Writes report.json, report.md and PNG plots (DET curve, per-class P@1, PCA/t-SNE projection,
kNN confusion matrix) into --out (default <checkpoint folder>/eval), and prints a summary.
Beside them, to look at the embedding space: embeddings.tsv + metadata.tsv (class, item, id,
path) for https://projector.tensorflow.org, and embeddings.html, an interactive 2-D PCA scatter
(hover: class / item / id); class-stratified samples of at most 20,000 and 5,000 points.
Exit status: 0 done; 2 bad input (missing or corrupt checkpoint, index errors, an empty split,
a gallery without an evaluated class) with a one-line message and no report written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from audioclf.cli import UsageError, one_line, resolve_device, run_cli
from audioclf.config import Config, DataConfig, ModelConfig, choices
from audioclf.data.dataset import AudioDataset
from audioclf.data.index import Index, load_index, split_index
from audioclf.data.loader import loader_kwargs
from audioclf.data.readers import AudioReadError, FeatureFileError
from audioclf.inference import describe_checkpoint, extract_embeddings, load_trained

PROG = "python -m audioclf.evaluate"
REPORT_FILES = ("report.json", "report.md", "det.png", "per_class_p1.png", "projection.png",
                "confusion.png", "embeddings.tsv", "metadata.tsv", "embeddings.html")
SUMMARY_METRICS = ("precision_at_1", "map_at_r", "r_precision", "loo_precision_at_1",
                   "loo_map_at_r", "knn_accuracy", "centroid_accuracy", "eer", "min_dcf", "nmi",
                   "ami")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="audioclf checkpoint (e.g. runs/<name>/best.pt)")
    parser.add_argument("--index", type=Path,
                        help="evaluate another sheet (replaces data.index; split rules kept)")
    parser.add_argument("--root", help="folder that relative paths resolve against (default: "
                        "data.root of the checkpoint, or the sheet's folder with --index)")
    parser.add_argument("--split", default="val",
                        help="split to evaluate: train, val, test, or all (every row); default val")
    parser.add_argument("--gallery", default="train",
                        help="classification gallery: train (default), none, or PATH to a sheet")
    parser.add_argument("--out", type=Path, help="report folder (default <checkpoint folder>/eval)")
    parser.add_argument("--batch-size", type=int, default=32, help="clips per batch (default 32)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("--num-workers", type=int,
                        help="DataLoader workers (default: data.num_workers of the checkpoint)")
    parser.add_argument("--max-pairs", type=int, default=1_000_000,
                        help="verification pairs scored at most (default 1000000)")
    parser.add_argument("--projection", choices=("pca", "tsne"), default="pca",
                        help="2-D projection plot (default pca)")
    parser.add_argument("--model-name", choices=choices(ModelConfig, "name"),
                        help="fail unless the checkpoint holds this model")
    parser.add_argument("--skip-bad-files", action="store_true",
                        help="skip unreadable files (counted in the log) instead of failing")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of pair sampling, k-means and the enrollment split (default 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Choosing the data


@dataclass
class EvalData:
    evaluated: Index
    split: str
    classification: str  # "gallery", "enrollment" or "none"
    gallery: Index | None  # with classification="gallery"
    gallery_source: str  # "train split of <sheet>", "<sheet>", or "none"
    missing_classes: list[str] = field(default_factory=list)  # evaluated, absent from the gallery


def data_config(cfg: Config, index: Path | None, root: str | None) -> DataConfig:
    """The checkpoint's data section with --index / --root applied."""
    data = cfg.data
    if index is not None:
        data = dataclasses.replace(data, index=str(index), root=root or "")
    elif root is not None:
        data = dataclasses.replace(data, root=root)
    if index is None and not Path(data.index).is_file():
        raise UsageError(
            f"the index sheet {data.index} named in the checkpoint's config (data.index) is not "
            f"found from {os.getcwd()}; pass --index PATH (and --root if paths are relative to "
            "another folder)"
        )
    return data


def select_data(cfg: Config, *, index: Path | None = None, root: str | None = None,
                split: str = "val", gallery: str = "train") -> EvalData:
    """The evaluated split and how it is classified; UsageError / IndexValidationError on bad
    input, all before anything is embedded."""
    data = data_config(cfg, index, root)
    full = load_index(data)
    splits = split_index(full, data)
    if split == "all":
        evaluated = full
    elif split in splits:
        evaluated = splits[split]
    else:
        raise UsageError(f"{full.source} has no {split!r} split (it has {', '.join(splits)}); "
                         f"use --split {' / '.join([*splits, 'all'])}")
    if len(evaluated) < 2:
        state = "is empty" if len(evaluated) == 0 else "has a single sample"
        raise UsageError(
            f"the {split} split of {full.source} {state} (split rules: data.split_column="
            f"{data.split_column!r}, data.holdout={data.holdout}, data.val_ratio={data.val_ratio}"
            "); evaluation needs at least 2 samples: choose another --split or --index"
        )

    if gallery == "none":
        return EvalData(evaluated, split, "none", None, "none")
    if gallery == "train":
        if split in ("train", "all"):
            raise UsageError(f"--split {split} overlaps the train gallery; pass --gallery none "
                             "or --gallery PATH")
        gallery_index, source = splits["train"], f"train split of {full.source}"
    else:
        path = Path(gallery)
        if path.suffix.lower() not in (".xlsx", ".xlsm", ".csv", ".parquet"):
            raise UsageError(f"--gallery {gallery!r}: use train, none, or a sheet "
                             "(.xlsx, .csv, .parquet)")
        gallery_index = load_index(dataclasses.replace(data, index=str(path), root=root or ""))
        source = str(gallery_index.source)
    missing = sorted(set(evaluated.classes) - set(gallery_index.classes))
    if not missing:
        return EvalData(evaluated, split, "gallery", gallery_index, source)
    if gallery != "train":
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise UsageError(
            f"the gallery {source} lacks {len(missing)} of the {len(evaluated.classes)} evaluated "
            f"classes ({shown}{more}); give a gallery sheet with every class, --gallery train or "
            "--gallery none"
        )
    # An open-set split: the train split cannot classify these classes; enroll from the split.
    return EvalData(evaluated, split, "enrollment", None, source, missing)


# ---------------------------------------------------------------------------------------------
# Embedding and metrics


def embed_index(net, index: Index, cfg: Config, *, batch_size: int, device: torch.device,
                num_workers: int, progress: bool, description: str
                ) -> tuple[np.ndarray, pd.DataFrame]:
    """Embeddings [n, D] of the rows of `index` that could be read, and those rows of its table
    (fewer than all only with data.skip_bad_files=true)."""
    table = index.table
    dataset = AudioDataset.from_index(index, cfg, train=False)
    options = loader_kwargs(num_workers, True, False, 2, device)
    emb, _, positions = extract_embeddings(net, dataset, batch_size=batch_size, device=device,
                                           loader_options=options, progress=progress,
                                           description=description)
    return emb, table.iloc[positions].reset_index(drop=True)


def enrollment_split(classes: np.ndarray, items: np.ndarray, seed: int) -> np.ndarray:
    """True for enrollment rows: per class half of the items (at least one) enroll; a class
    with a single item splits its samples half/half; a class with one sample only queries."""
    rng = np.random.default_rng(seed)
    enroll = np.zeros(len(classes), dtype=bool)
    for cls in sorted(set(classes.tolist())):
        rows = np.flatnonzero(classes == cls)
        class_items = sorted(set(items[rows].tolist()))
        if len(class_items) >= 2:
            chosen = rng.permutation(len(class_items))[: len(class_items) // 2]
            enroll[rows] = np.isin(items[rows], [class_items[i] for i in chosen])
        elif len(rows) >= 2:
            enroll[rng.permutation(rows)[: len(rows) // 2]] = True
    return enroll


@dataclass
class Evaluation:
    results: dict  # metric name -> value (report scalars + per_sample_correct_at_1)
    embeddings: np.ndarray
    labels: np.ndarray  # class ids into class_names
    class_names: list[str]
    knn_predictions: np.ndarray | None
    verification: dict | None
    setup: dict = field(default_factory=dict)  # what was evaluated how (report.json "evaluation")
    notes: list[str] = field(default_factory=list)


def compute_metrics(emb: np.ndarray, names: np.ndarray, *, classification: str = "none",
                    items: np.ndarray | None = None, gallery_emb: np.ndarray | None = None,
                    gallery_names: np.ndarray | None = None, max_pairs: int = 1_000_000,
                    seed: int = 0, device: torch.device | str = "cpu") -> Evaluation:
    """Every metric of one evaluated set (embeddings and class name per row).

    classification: "gallery" (against gallery_emb / gallery_names, which hold every evaluated
    class), "enrollment" (half/half split of the set by `items`), or "none".
    """
    from audioclf.metrics import (
        centroid_accuracy,
        clustering_metrics,
        knn_accuracy,
        retrieval_metrics,
        verification_metrics,
    )

    if classification not in ("gallery", "enrollment", "none"):
        raise ValueError(f"classification={classification!r}: use gallery, enrollment or none")
    gallery_list = gallery_names.tolist() if classification == "gallery" else []
    class_names = sorted(set(names.tolist()) | set(gallery_list))
    code = {name: i for i, name in enumerate(class_names)}
    labels = np.array([code[n] for n in names.tolist()], dtype=np.int64)
    n_classes = len(set(names.tolist()))
    notes: list[str] = []
    setup: dict = {"n_samples": len(labels), "n_classes": n_classes}

    leave_one_out = retrieval_metrics(emb, labels, device=device, return_per_sample=True)
    results = leave_one_out
    if items is not None:
        results = retrieval_metrics(emb, labels, items=items, device=device, return_per_sample=True)
        setup["retrieval"] = ("cross-item: a query never retrieves clips of its own item "
                              "(recording); R counts the other items' clips of its class")
        setup["n_retrieval_queries"] = results["n_queries"]
        if results["n_queries_without_other_item"]:
            notes.append(f"{results['n_queries_without_other_item']} sample(s) have no clip of "
                         "another item in their class: left out of the cross-item metrics")
        if results["n_queries"] == 0:
            notes.append("no class has clips of two items: cross-item retrieval is undefined "
                         "(the loo_* figures are leave-one-out)")
    if leave_one_out["n_queries"] == 0:
        notes.append("every class has a single sample: retrieval metrics are undefined")
    results = {**{k: v for k, v in results.items() if k != "n_queries_without_other_item"},
               **{f"loo_{k}": leave_one_out[k] for k in ("precision_at_1", "map_at_r",
                                                          "r_precision")}}

    knn_predictions = None
    queries = gallery = None
    if classification == "gallery":
        missing = sorted(set(names.tolist()) - set(gallery_list))
        if missing:  # only when data.skip_bad_files dropped a class's every gallery file
            raise UsageError(f"no gallery file of class(es) {', '.join(map(repr, missing[:5]))} "
                             "could be read; fix the files or use --gallery none")
        g_labels = np.array([code[n] for n in gallery_list], dtype=np.int64)
        queries = (emb, labels)
        gallery = (gallery_emb, g_labels)
        setup["classification"] = "closed set: every evaluated sample against the gallery"
        setup["n_gallery_samples"] = len(g_labels)
    elif classification == "enrollment":
        if items is None:
            raise ValueError("an enrollment split needs the item of every evaluated row")
        enroll = enrollment_split(names, items, seed)
        query = ~enroll & np.isin(names, list(set(names[enroll].tolist())))
        setup["classification"] = ("enrollment: in each evaluated class half of the items "
                                   "enroll, the other half query")
        setup["n_enrollment_samples"] = int(enroll.sum())
        left_out = int((~enroll & ~query).sum())
        if left_out:
            notes.append(f"{left_out} sample(s) of single-sample classes are left out of "
                         "classification (nothing to enroll them with)")
        if query.any():
            queries = (emb[query], labels[query])
            gallery = (emb[enroll], labels[enroll])
        else:
            notes.append("no class has two samples: classification metrics skipped")
    else:
        setup["classification"] = "none"
    if queries is not None:
        knn = knn_accuracy(*queries, *gallery, k=1, device=device)
        results["knn_accuracy"] = knn["knn_accuracy"]
        results["centroid_accuracy"] = centroid_accuracy(*queries, *gallery)["centroid_accuracy"]
        setup["n_classification_queries"] = len(queries[1])
        if classification == "gallery":  # one prediction per evaluated sample: a confusion plot
            knn_predictions = knn["predictions"]

    verification = None
    try:
        verification = verification_metrics(emb, labels, max_pairs=max_pairs, seed=seed)
    except ValueError as exc:
        notes.append(f"verification skipped: {exc}")
    if n_classes >= 2:
        results.update(clustering_metrics(emb, labels, seed=seed))
    else:
        notes.append("a single class: clustering metrics skipped")
    return Evaluation(results, emb, labels, class_names, knn_predictions, verification, setup, notes)


# ---------------------------------------------------------------------------------------------
# Report


def write_evaluation(out_dir: Path, evaluation: Evaluation, *, projection: str, seed: int,
                     setup: dict, rows: pd.DataFrame | None = None) -> Path:
    """write_report into a staging folder, then move each file into out_dir. `rows`: the
    index rows of the evaluated embeddings (their item, id and path go into metadata.tsv)."""
    from audioclf.report import write_report

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        written = write_report(
            staging, results=evaluation.results, embeddings=evaluation.embeddings,
            labels=evaluation.labels, class_names=evaluation.class_names,
            knn_predictions=evaluation.knn_predictions, verification=evaluation.verification,
            projection=projection, seed=seed, setup=setup, notes=evaluation.notes,
            metadata=None if rows is None else rows[["item", "id", "path"]],
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in REPORT_FILES:  # a stale plot of an earlier run must not pass for this one
            if name not in written:
                (out_dir / name).unlink(missing_ok=True)
        for name in written:
            os.replace(staging / name, out_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def print_summary(evaluation: Evaluation, setup: dict, out_dir: Path) -> None:
    rows = [("checkpoint", f"{setup['checkpoint']} ({setup['model']})"),
            ("evaluated", f"{setup['split']} split of {setup['index']}: {setup['n_samples']} "
                          f"samples, {setup['n_classes']} classes"),
            ("gallery", setup["gallery"]),
            ("classification", setup["classification"])]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for note in evaluation.notes:
        print(f"{'note':<{width}}  {note}")
    print()
    print(f"{'metric':<18} value")
    for name in SUMMARY_METRICS:
        value = evaluation.results.get(name)
        if value is None and evaluation.verification is not None:
            value = evaluation.verification.get(name)
        if value is not None:
            print(f"{name:<18} {float(value):.4f}")
    print()
    print(f"report: {out_dir / 'report.md'}")
    print(f"embeddings: {out_dir / 'embeddings.html'} (projector files: embeddings.tsv, "
          "metadata.tsv)")


# ---------------------------------------------------------------------------------------------
# Entry point


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_pairs < 2:
        raise UsageError(f"--max-pairs must be >= 2, got {args.max_pairs}")
    if args.num_workers is not None and args.num_workers < 0:
        raise UsageError(f"--num-workers must be >= 0, got {args.num_workers}")
    device = resolve_device(args.device)
    net, cfg, ckpt = load_trained(args.checkpoint, device, model_name=args.model_name)
    if args.skip_bad_files:
        cfg.data.skip_bad_files = True
    data = select_data(cfg, index=args.index, root=args.root, split=args.split,
                       gallery=args.gallery)
    out_dir = args.out if args.out is not None else args.checkpoint.parent / "eval"
    num_workers = cfg.data.num_workers if args.num_workers is None else args.num_workers
    common = dict(batch_size=args.batch_size, device=device, num_workers=num_workers,
                  progress=not args.quiet)

    try:
        emb, rows = embed_index(net, data.evaluated, cfg, description=f"embed {data.split}",
                                **common)
        gallery_emb = gallery_names = None
        if data.gallery is not None:
            gallery_emb, gallery_rows = embed_index(net, data.gallery, cfg,
                                                    description="embed gallery", **common)
            gallery_names = gallery_rows["cls"].to_numpy(dtype=object)
    except (AudioReadError, FeatureFileError) as exc:
        # The dataset's hint names the config key; here the flag is the way to set it.
        message = one_line(exc).replace("set data.skip_bad_files=true", "pass --skip-bad-files")
        raise type(exc)(message) from None
    if len(rows) < 2:
        raise UsageError(f"only {len(rows)} file(s) of the {data.split} split could be read; "
                         "evaluation needs at least 2")
    evaluation = compute_metrics(emb, rows["cls"].to_numpy(dtype=object),
                                 classification=data.classification,
                                 items=rows["item"].to_numpy(dtype=object),
                                 gallery_emb=gallery_emb, gallery_names=gallery_names,
                                 max_pairs=args.max_pairs, seed=args.seed, device=device)
    skipped = len(data.evaluated) - len(rows)
    if skipped:
        evaluation.notes.append(f"{skipped} unreadable file(s) of the {data.split} split were "
                                "skipped (--skip-bad-files / data.skip_bad_files)")
    if data.missing_classes:
        evaluation.notes.insert(0, (
            f"open-set split: {len(data.missing_classes)} of {evaluation.setup['n_classes']} "
            "evaluated classes are not in the train split, so kNN and centroid accuracy use a "
            "half/half enrollment split of the evaluated samples (by item) instead of the train "
            "gallery"))
    setup = {
        "checkpoint": str(args.checkpoint),
        "model": describe_checkpoint(ckpt, cfg),
        "index": str(data.evaluated.source),
        "split": data.split,
        "gallery": data.gallery_source,
        **evaluation.setup,
        "device": str(device),
        "seconds": round(time.perf_counter() - start, 2),
    }
    write_evaluation(out_dir, evaluation, projection=args.projection, seed=args.seed, setup=setup,
                     rows=rows)
    print_summary(evaluation, setup, out_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
