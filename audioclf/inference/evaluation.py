"""Offline evaluation of a model on one split of an index: which rows, their embeddings, every
metric, and the report folder (see `python -m audioclf.evaluate --help`).

    data = select_data(cfg, split="val", gallery="train")
    emb, rows = embed_index(net, data.evaluated, cfg, batch_size=32, device=device, ...)
    evaluation = compute_metrics(emb, rows["cls"].to_numpy(dtype=object), items=...)
    write_evaluation(out_dir, evaluation, projection="pca", seed=0, setup=setup, rows=rows)
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from audioclf.config import Config, DataConfig
from audioclf.data.dataset import AudioDataset
from audioclf.data.index import Index, load_index, split_index
from audioclf.data.loader import loader_kwargs
from audioclf.inference.extract import extract_embeddings
from audioclf.metrics import (
    centroid_accuracy,
    clustering_metrics,
    knn_accuracy,
    retrieval_metrics,
    verification_metrics,
)
from audioclf.report import REPORT_FILES, write_report

CLASSIFICATIONS = ("gallery", "enrollment", "none")
SHEET_SUFFIXES = (".xlsx", ".xlsm", ".csv", ".parquet")


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
        raise ValueError(
            f"the index sheet {data.index} named in the checkpoint's config (data.index) is not "
            f"found from {os.getcwd()}; pass --index PATH (and --root if paths are relative to "
            "another folder)"
        )
    return data


def select_data(cfg: Config, *, index: Path | None = None, root: str | None = None,
                split: str = "val", gallery: str = "train") -> EvalData:
    """The evaluated split and how it is classified; ValueError / IndexValidationError on bad
    input, all before anything is embedded."""
    data = data_config(cfg, index, root)
    full = load_index(data)
    splits = split_index(full, data)
    evaluated = _evaluated_split(full, splits, split, data)
    if gallery == "none":
        return EvalData(evaluated, split, "none", None, "none")
    if gallery == "train":
        if split in ("train", "all"):
            raise ValueError(f"--split {split} overlaps the train gallery; pass --gallery none "
                             "or --gallery PATH")
        gallery_index, source = splits["train"], f"train split of {full.source}"
    else:
        if Path(gallery).suffix.lower() not in SHEET_SUFFIXES:
            raise ValueError(f"--gallery {gallery!r}: use train, none, or a sheet "
                             "(.xlsx, .csv, .parquet)")
        gallery_index = load_index(dataclasses.replace(data, index=str(Path(gallery)),
                                                       root=root or ""))
        source = str(gallery_index.source)
    missing = sorted(set(evaluated.classes) - set(gallery_index.classes))
    if not missing:
        return EvalData(evaluated, split, "gallery", gallery_index, source)
    if gallery != "train":
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"the gallery {source} lacks {len(missing)} of the {len(evaluated.classes)} evaluated "
            f"classes ({shown}{more}); give a gallery sheet with every class, --gallery train or "
            "--gallery none"
        )
    # An open-set split: the train split cannot classify these classes; enroll from the split.
    return EvalData(evaluated, split, "enrollment", None, source, missing)


def _evaluated_split(full: Index, splits: dict[str, Index], split: str, data: DataConfig) -> Index:
    if split == "all":
        evaluated = full
    elif split in splits:
        evaluated = splits[split]
    else:
        raise ValueError(f"{full.source} has no {split!r} split (it has {', '.join(splits)}); "
                         f"use --split {' / '.join([*splits, 'all'])}")
    if len(evaluated) < 2:
        state = "is empty" if len(evaluated) == 0 else "has a single sample"
        raise ValueError(
            f"the {split} split of {full.source} {state} (split rules: data.split_column="
            f"{data.split_column!r}, data.holdout={data.holdout}, data.val_ratio={data.val_ratio}"
            "); evaluation needs at least 2 samples: choose another --split or --index"
        )
    return evaluated


# ---------------------------------------------------------------------------------------------
# Embedding


def embed_index(net, index: Index, cfg: Config, *, batch_size: int, device: torch.device,
                num_workers: int, progress: bool, description: str,
                skip_hint: str | None = None) -> tuple[np.ndarray, pd.DataFrame]:
    """Embeddings [n, D] of the rows of `index` that could be read, and those rows of its table
    (fewer than all only with data.skip_bad_files=true). `skip_hint`: how an unreadable file's
    message says to skip such files (default: the config key)."""
    table = index.table
    dataset = AudioDataset.from_index(index, cfg, train=False, skip_hint=skip_hint)
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


def evaluate_split(net, cfg: Config, data: EvalData, *, batch_size: int, device: torch.device,
                   num_workers: int, progress: bool, max_pairs: int, seed: int,
                   skip_hint: str | None = None) -> tuple[Evaluation, pd.DataFrame]:
    """Embed the evaluated split (and the gallery), then every metric; returns the evaluation
    and the index rows of its embeddings. ValueError when fewer than 2 files could be read."""
    common = dict(batch_size=batch_size, device=device, num_workers=num_workers,
                  progress=progress, skip_hint=skip_hint)
    emb, rows = embed_index(net, data.evaluated, cfg, description=f"embed {data.split}", **common)
    gallery_emb = gallery_names = None
    if data.gallery is not None:
        gallery_emb, gallery_rows = embed_index(net, data.gallery, cfg,
                                                description="embed gallery", **common)
        gallery_names = gallery_rows["cls"].to_numpy(dtype=object)
    if len(rows) < 2:
        raise ValueError(f"only {len(rows)} file(s) of the {data.split} split could be read; "
                         "evaluation needs at least 2")
    evaluation = compute_metrics(emb, rows["cls"].to_numpy(dtype=object),
                                 classification=data.classification,
                                 items=rows["item"].to_numpy(dtype=object),
                                 gallery_emb=gallery_emb, gallery_names=gallery_names,
                                 max_pairs=max_pairs, seed=seed, device=device)
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
    return evaluation, rows


# ---------------------------------------------------------------------------------------------
# Metrics


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
    if classification not in CLASSIFICATIONS:
        raise ValueError(f"classification={classification!r}: use gallery, enrollment or none")
    gallery_list = gallery_names.tolist() if classification == "gallery" else []
    class_names = sorted(set(names.tolist()) | set(gallery_list))
    code = {name: i for i, name in enumerate(class_names)}
    labels = np.array([code[n] for n in names.tolist()], dtype=np.int64)
    n_classes = len(set(names.tolist()))
    evaluation = Evaluation({}, emb, labels, class_names, None, None,
                            {"n_samples": len(labels), "n_classes": n_classes})
    evaluation.results = _retrieval(evaluation, items, device)
    if classification == "gallery":
        sets = _gallery_sets(evaluation, names, gallery_emb, gallery_list, code)
    elif classification == "enrollment":
        sets = _enrollment_sets(evaluation, names, items, seed)
    else:
        evaluation.setup["classification"] = "none"
        sets = None
    if sets is not None:
        _classify(evaluation, *sets, per_sample=classification == "gallery", device=device)
    _verification_and_clustering(evaluation, n_classes, max_pairs, seed)
    return evaluation


def _retrieval(evaluation: Evaluation, items: np.ndarray | None, device) -> dict:
    """Cross-item retrieval with items (leave-one-out without), plus the loo_* figures."""
    emb, labels, setup, notes = (evaluation.embeddings, evaluation.labels, evaluation.setup,
                                 evaluation.notes)
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
    return {**{k: v for k, v in results.items() if k != "n_queries_without_other_item"},
            **{f"loo_{k}": leave_one_out[k] for k in ("precision_at_1", "map_at_r",
                                                       "r_precision")}}


def _gallery_sets(evaluation: Evaluation, names: np.ndarray, gallery_emb: np.ndarray,
                  gallery_list: list, code: dict) -> tuple[tuple, tuple]:
    """(queries, gallery) of a closed-set classification: every evaluated sample queries."""
    missing = sorted(set(names.tolist()) - set(gallery_list))
    if missing:  # only when data.skip_bad_files dropped a class's every gallery file
        raise ValueError(f"no gallery file of class(es) {', '.join(map(repr, missing[:5]))} "
                         "could be read; fix the files or use --gallery none")
    g_labels = np.array([code[n] for n in gallery_list], dtype=np.int64)
    evaluation.setup["classification"] = "closed set: every evaluated sample against the gallery"
    evaluation.setup["n_gallery_samples"] = len(g_labels)
    return (evaluation.embeddings, evaluation.labels), (gallery_emb, g_labels)


def _enrollment_sets(evaluation: Evaluation, names: np.ndarray, items: np.ndarray | None,
                     seed: int) -> tuple[tuple, tuple] | None:
    """(queries, gallery) of a half/half enrollment split of the set by item; None when no
    class has two samples."""
    if items is None:
        raise ValueError("an enrollment split needs the item of every evaluated row")
    emb, labels = evaluation.embeddings, evaluation.labels
    enroll = enrollment_split(names, items, seed)
    query = ~enroll & np.isin(names, list(set(names[enroll].tolist())))
    evaluation.setup["classification"] = ("enrollment: in each evaluated class half of the items "
                                          "enroll, the other half query")
    evaluation.setup["n_enrollment_samples"] = int(enroll.sum())
    left_out = int((~enroll & ~query).sum())
    if left_out:
        evaluation.notes.append(f"{left_out} sample(s) of single-sample classes are left out of "
                                "classification (nothing to enroll them with)")
    if not query.any():
        evaluation.notes.append("no class has two samples: classification metrics skipped")
        return None
    return (emb[query], labels[query]), (emb[enroll], labels[enroll])


def _classify(evaluation: Evaluation, queries: tuple, gallery: tuple, *, per_sample: bool,
              device) -> None:
    """kNN and nearest-centroid accuracy; with one query per evaluated sample (per_sample),
    the kNN predictions too (a confusion plot)."""
    knn = knn_accuracy(*queries, *gallery, k=1, device=device)
    evaluation.results["knn_accuracy"] = knn["knn_accuracy"]
    evaluation.results["centroid_accuracy"] = centroid_accuracy(*queries, *gallery)["centroid_accuracy"]
    evaluation.setup["n_classification_queries"] = len(queries[1])
    if per_sample:
        evaluation.knn_predictions = knn["predictions"]


def _verification_and_clustering(evaluation: Evaluation, n_classes: int, max_pairs: int,
                                 seed: int) -> None:
    emb, labels = evaluation.embeddings, evaluation.labels
    try:
        evaluation.verification = verification_metrics(emb, labels, max_pairs=max_pairs, seed=seed)
    except ValueError as exc:
        evaluation.notes.append(f"verification skipped: {exc}")
    if n_classes >= 2:
        evaluation.results.update(clustering_metrics(emb, labels, seed=seed))
    else:
        evaluation.notes.append("a single class: clustering metrics skipped")


# ---------------------------------------------------------------------------------------------
# Report


def write_evaluation(out_dir: Path, evaluation: Evaluation, *, projection: str, seed: int,
                     setup: dict, rows: pd.DataFrame | None = None) -> Path:
    """write_report into a staging folder, then move each file into out_dir. `rows`: the
    index rows of the evaluated embeddings (their item, id and path go into metadata.tsv)."""
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
