"""write_report: report.json, report.md, the plots and the embedding files of one evaluation.

See the package docstring (audioclf.evaluation) for what each file holds.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pandas as pd
import torch

from audioclf.evaluation.embedding_files import (
    EMBEDDING_FILES,
    MAX_HTML_POINTS,
    MAX_TSV_POINTS,
    write_embedding_files,
)
from audioclf.evaluation.markdown import markdown
from audioclf.evaluation.plots import plot_confusion, plot_det, plot_per_class, plot_projection
from audioclf.fileio import atomic_write
from audioclf.metrics import check_embeddings, retrieval_metrics

PROJECTIONS = ("pca", "tsne")
PLOT_FILES = ("det.png", "per_class_p1.png", "projection.png", "confusion.png")
# Every file write_report may write (which ones depends on its inputs).
REPORT_FILES = ("report.json", "report.md", *PLOT_FILES, *EMBEDDING_FILES)


def write_report(
    out_dir,
    *,
    results: dict,
    embeddings,
    labels,
    class_names: list[str],
    knn_predictions=None,
    verification: dict | None = None,
    projection: str = "pca",
    seed: int = 0,
    title: str = "audioclf evaluation",
    setup: dict | None = None,
    notes: list[str] = (),
    metadata: pd.DataFrame | None = None,
    tsv_points: int = MAX_TSV_POINTS,
    html_points: int = MAX_HTML_POINTS,
) -> dict[str, pathlib.Path]:
    """Write the report files into ``out_dir`` (created if missing).

    results: metric dict(s) merged by the caller; its scalar entries go into the report. If it
        holds ``"per_sample_correct_at_1"`` (from ``retrieval_metrics(..., return_per_sample=True)``)
        that is used for per-class P@1; otherwise retrieval_metrics is run on ``embeddings``.
    embeddings, labels: [N, D] floats and [N] integer class ids indexing ``class_names``.
    knn_predictions: predicted class id per sample of ``labels`` (e.g. ``knn_accuracy(...)
        ["predictions"]``); draws confusion.png.
    verification: the dict from ``verification_metrics``; draws det.png, scalars are reported.
    projection: "pca" or "tsne" for projection.png, on a seeded subsample of at most
        MAX_PROJECTION_POINTS points.
    setup, notes: what was evaluated how, and remarks; a "Setup" section of report.md and
        report.json's "evaluation" entry (setup + notes) when given.
    metadata: one row per embedding (e.g. columns item, id, path), written after the class
        into metadata.tsv and shown on hover in embeddings.html; without it the position of
        each sample is.
    tsv_points, html_points: most points in embeddings.tsv / embeddings.html.

    Returns file name -> path for every file written.
    """
    emb, lab, class_names, knn_predictions, metadata = _checked_inputs(
        embeddings,
        labels,
        class_names,
        knn_predictions,
        metadata,
        projection,
        tsv_points,
        html_points,
    )
    correct_at_1 = _correct_at_1(results, emb, lab)

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = _report_metrics(results, verification)
    per_class = _per_class_p1(lab, correct_at_1, class_names)
    written = _write_plots(
        out_dir,
        emb,
        lab,
        class_names,
        per_class,
        metrics,
        verification,
        knn_predictions,
        projection,
        seed,
    )
    images = list(written)
    embedding_files = write_embedding_files(
        out_dir, emb, lab, class_names, metadata, seed, tsv_points, html_points, title, written
    )
    report = {
        "title": title,
        "metrics": metrics,
        "counts": _counts(lab, per_class, class_names, emb),
        "per_class_p1": per_class,
        "embedding_files": embedding_files,
    }
    _write_summaries(out_dir, report, written, images=images, setup=setup, notes=list(notes))
    return written


def _write_summaries(
    out_dir: pathlib.Path,
    report: dict,
    written: dict[str, pathlib.Path],
    *,
    images: list[str],
    setup: dict | None,
    notes: list[str],
) -> None:
    """report.md, then report.json (which lists every file written, itself included); both
    are added to `written`."""
    page = markdown(
        report["title"],
        report["metrics"],
        report["counts"],
        report["per_class_p1"],
        images=images,
        setup=setup,
        notes=notes,
        embedding_files=report["embedding_files"],
    )
    written["report.md"] = atomic_write(out_dir / "report.md", lambda f: f.write(page.encode()))
    report = {**report, "files": sorted([*written, "report.json"])}
    if setup is not None:
        report["evaluation"] = {**setup, "notes": notes}
    text = json.dumps(_json_ready(report), indent=2, allow_nan=False) + "\n"
    written["report.json"] = atomic_write(out_dir / "report.json", lambda f: f.write(text.encode()))


def _report_metrics(results: dict, verification: dict | None) -> dict:
    """The scalar metrics of the results, then those of the verification not already there."""
    metrics = _scalars(results)
    for name, value in _scalars(verification or {}).items():
        metrics.setdefault(name, value)
    return metrics


def _counts(
    lab: np.ndarray, per_class: list[dict], class_names: list[str], emb: torch.Tensor
) -> dict:
    return {
        "n_samples": int(len(lab)),
        "n_classes": int(len(per_class)),
        "n_class_names": len(class_names),
        "n_singleton_classes": sum(row["count"] == 1 for row in per_class),
        "embedding_dim": int(emb.shape[1]),
    }


def _write_plots(
    out_dir: pathlib.Path,
    emb: torch.Tensor,
    lab: np.ndarray,
    class_names: list[str],
    per_class: list[dict],
    metrics: dict,
    verification: dict | None,
    knn_predictions,
    projection: str,
    seed: int,
) -> dict[str, pathlib.Path]:
    """The PNG plots whose inputs are given, in report order: file name -> path."""
    written: dict[str, pathlib.Path] = {}
    if verification is not None:
        written["det.png"] = plot_det(out_dir / "det.png", verification)
    written["per_class_p1.png"] = plot_per_class(out_dir / "per_class_p1.png", per_class, metrics)
    written["projection.png"] = plot_projection(
        out_dir / "projection.png", emb, lab, class_names, projection, seed
    )
    if knn_predictions is not None:
        written["confusion.png"] = plot_confusion(
            out_dir / "confusion.png", lab, knn_predictions, class_names
        )
    return written


# --------------------------------------------------------------------------------------------
# Checking the inputs
# --------------------------------------------------------------------------------------------


def _checked_inputs(
    embeddings,
    labels,
    class_names: list,
    knn_predictions,
    metadata,
    projection: str,
    tsv_points: int,
    html_points: int,
) -> tuple[torch.Tensor, np.ndarray, list[str], np.ndarray | None, pd.DataFrame]:
    """(embeddings, labels, class names as str, kNN predictions, metadata), each validated;
    one ValueError naming the first bad input, before anything is written."""
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
    emb, lab = check_embeddings(embeddings, labels)
    class_names = [str(name) for name in class_names]
    knn_predictions = _check_predictions(knn_predictions, lab, class_names)
    metadata = _check_metadata(metadata, len(lab))
    if tsv_points < 1 or html_points < 1:
        raise ValueError(f"tsv_points ({tsv_points}) and html_points ({html_points}) must be >= 1")
    return emb, lab, class_names, knn_predictions, metadata


def _check_predictions(knn_predictions, lab: np.ndarray, class_names: list[str]):
    _check_class_ids(lab, class_names, "labels")
    if knn_predictions is None:
        return None
    knn_predictions = np.asarray(knn_predictions, dtype=np.int64)
    if knn_predictions.shape != lab.shape:
        raise ValueError(
            f"knn_predictions has shape {knn_predictions.shape} but labels has shape {lab.shape}; "
            f"pass one prediction per labelled sample"
        )
    _check_class_ids(knn_predictions, class_names, "knn_predictions")
    return knn_predictions


def _correct_at_1(results: dict, emb: torch.Tensor, lab: np.ndarray) -> np.ndarray:
    """Whether each sample's nearest neighbour has its class: from the results, else computed."""
    correct_at_1 = results.get("per_sample_correct_at_1")
    if correct_at_1 is None:
        correct_at_1 = retrieval_metrics(emb, lab, return_per_sample=True)[
            "per_sample_correct_at_1"
        ]
    correct_at_1 = np.asarray(correct_at_1, dtype=bool)
    if correct_at_1.shape != lab.shape:
        raise ValueError(
            f"results['per_sample_correct_at_1'] has shape {correct_at_1.shape} but labels has shape "
            f"{lab.shape}; it must come from the same embeddings"
        )
    return correct_at_1


def _check_class_ids(ids: np.ndarray, class_names: list[str], name: str) -> None:
    if len(ids) and (ids.min() < 0 or ids.max() >= len(class_names)):
        bad = ids[(ids < 0) | (ids >= len(class_names))]
        raise ValueError(
            f"{name} holds class id {int(bad[0])} ({len(bad)} entries out of range) but class_names "
            f"has {len(class_names)} entries; ids must index class_names"
        )


def _check_metadata(metadata, n: int) -> pd.DataFrame:
    """The metadata columns as strings, one row per sample; the position when none is given."""
    if metadata is None:
        return pd.DataFrame({"sample": np.arange(n).astype(str)})
    if not isinstance(metadata, pd.DataFrame):
        raise ValueError(f"metadata must be a pandas DataFrame, got {type(metadata).__name__}")
    if len(metadata) != n:
        raise ValueError(
            f"metadata has {len(metadata)} rows but there are {n} embeddings; "
            "give one metadata row per embedding, in the same order"
        )
    if "class" in metadata.columns:
        raise ValueError("metadata must not have a 'class' column: the class comes from labels")
    return metadata.reset_index(drop=True).astype(str)


def _is_scalar(value) -> bool:
    if isinstance(value, (bool, int, float, np.number, np.bool_)):
        return True
    return isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 0


def _scalars(metric_dict: dict) -> dict:
    return {
        str(name): _json_ready(value) for name, value in metric_dict.items() if _is_scalar(value)
    }


def _json_ready(value):
    """Plain-Python copy of value for json: numpy/torch scalars unwrapped, NaN/inf -> None."""
    if isinstance(value, dict):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(item) for item in value]
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return _json_ready(value.tolist())
    if isinstance(value, (np.generic,)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _per_class_p1(
    labels: np.ndarray, correct_at_1: np.ndarray, class_names: list[str]
) -> list[dict]:
    """One row per class present, worst P@1 first; a singleton class has P@1 None (no positive)."""
    class_ids, class_index, counts = np.unique(labels, return_inverse=True, return_counts=True)
    hits = np.bincount(
        class_index, weights=correct_at_1.astype(np.float64), minlength=len(class_ids)
    )
    rows = [
        {
            "class_id": int(class_id),
            "name": class_names[class_id],
            "count": int(count),
            "p_at_1": float(hit / count) if count > 1 else None,
        }
        for class_id, count, hit in zip(class_ids, counts, hits, strict=True)
    ]
    # Worst first; classes without a P@1 go last, ties by class id for a stable order.
    return sorted(
        rows, key=lambda row: (row["p_at_1"] is None, row["p_at_1"] or 0.0, row["class_id"])
    )
