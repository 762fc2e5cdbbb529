"""write_report: report.json, report.md, the plots and the embedding files of one evaluation.

See the package docstring (audioclf.evaluation) for what each file holds.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import shutil
from collections.abc import Iterator
from pathlib import Path

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
from audioclf.evaluation.metrics import Evaluation
from audioclf.evaluation.plots import plot_confusion, plot_det, plot_per_class, plot_projection
from audioclf.fileio import atomic_write
from audioclf.outputs import FolderLock

PROJECTIONS = ("pca", "tsne")
PLOT_FILES = ("det.png", "per_class_p1.png", "projection.png", "confusion.png")
# Every file write_report may write (which ones depends on its inputs).
REPORT_FILES = ("report.json", "report.md", *PLOT_FILES, *EMBEDDING_FILES)


def write_report(
    out_dir,
    evaluation: Evaluation,
    *,
    projection: str = "pca",
    seed: int = 0,
    title: str = "audioclf evaluation",
    setup: dict | None = None,
    metadata: pd.DataFrame | None = None,
    tsv_points: int = MAX_TSV_POINTS,
    html_points: int = MAX_HTML_POINTS,
) -> dict[str, pathlib.Path]:
    """Write the report files of `evaluation` (from compute_metrics) into ``out_dir`` (created
    if missing).

    The scalar entries of its results and verification go into the report; its
    ``results["per_sample_correct_at_1"]`` gives per-class P@1; its kNN predictions, when
    given, draw confusion.png, and its verification det.png.
    projection: "pca" or "tsne" for projection.png, on a seeded subsample of at most
        MAX_PROJECTION_POINTS points.
    setup: what was evaluated how; with it, a "Setup" section of report.md (with the
        evaluation's notes) and report.json's "evaluation" entry (setup + notes).
    metadata: one row per embedding, in order (e.g. columns item, id, path), written after
        the class into metadata.tsv and shown on hover in embeddings.html; without it the
        position of each sample is.
    tsv_points, html_points: most points in embeddings.tsv / embeddings.html.

    Returns file name -> path for every file written.
    """
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
    emb = torch.from_numpy(np.ascontiguousarray(evaluation.embeddings, dtype=np.float32))
    lab, class_names = evaluation.labels, evaluation.class_names
    if metadata is None:
        metadata = pd.DataFrame({"sample": np.arange(len(lab)).astype(str)})
    metadata = metadata.reset_index(drop=True).astype(str)

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = scalar_metrics(evaluation.results, evaluation.verification)
    correct_at_1 = np.asarray(evaluation.results["per_sample_correct_at_1"], dtype=bool)
    per_class = _per_class_p1(lab, correct_at_1, class_names)
    written = _write_plots(out_dir, evaluation, emb, per_class, metrics, projection, seed)
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
    _write_summaries(
        out_dir, report, written, images=images, setup=setup, notes=list(evaluation.notes)
    )
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


def scalar_metrics(results: dict, verification: dict | None) -> dict:
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
    evaluation: Evaluation,
    emb: torch.Tensor,
    per_class: list[dict],
    metrics: dict,
    projection: str,
    seed: int,
) -> dict[str, pathlib.Path]:
    """The PNG plots whose inputs are given, in report order: file name -> path."""
    lab, class_names, verification = (
        evaluation.labels,
        evaluation.class_names,
        evaluation.verification,
    )
    written: dict[str, pathlib.Path] = {}
    if verification is not None:
        written["det.png"] = plot_det(out_dir / "det.png", verification)
    written["per_class_p1.png"] = plot_per_class(out_dir / "per_class_p1.png", per_class, metrics)
    written["projection.png"] = plot_projection(
        out_dir / "projection.png", emb, lab, class_names, projection, seed
    )
    if evaluation.knn_predictions is not None:
        written["confusion.png"] = plot_confusion(
            out_dir / "confusion.png", lab, evaluation.knn_predictions, class_names
        )
    return written


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


# ---------------------------------------------------------------------------------------------
# The report folder of evaluate: written whole under its lock


@contextlib.contextmanager
def out_lock(out_dir: Path) -> Iterator[None]:
    """Holds the lock of an --out folder (one evaluate writes it; evaluate takes it at its
    start); a folder made for the lock alone is removed again when nothing was written."""
    made = not Path(out_dir).exists()
    try:
        with FolderLock(
            Path(out_dir) / ".evaluate.lock",
            what=f"--out {out_dir}",
            by="another evaluate",
            fix="wait for it to finish, or choose another --out",
        ):
            yield
    finally:
        if made:
            with contextlib.suppress(OSError):
                Path(out_dir).rmdir()  # only when empty


def write_evaluation(
    out_dir: Path,
    evaluation: Evaluation,
    *,
    projection: str,
    seed: int,
    setup: dict,
    rows: pd.DataFrame | None = None,
    locked: bool = False,
) -> Path:
    """write_report into a staging folder, then each file into out_dir, under its lock (held
    by the caller when `locked`). `rows`: the evaluated rows (metadata.tsv's item, id, path)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    with contextlib.ExitStack() as held:
        if not locked:
            held.enter_context(out_lock(out_dir))
        for stale in out_dir.parent.glob(f".{out_dir.name}.partial-*"):  # of killed runs
            shutil.rmtree(stale, ignore_errors=True)  # the lock holder is the only writer
        held.callback(shutil.rmtree, staging, ignore_errors=True)  # before the lock's release
        written = write_report(
            staging,
            evaluation,
            projection=projection,
            seed=seed,
            setup=setup,
            metadata=None if rows is None else rows[["item", "id", "path"]],
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in REPORT_FILES:  # a stale plot of an earlier run must not pass for this one
            if name not in written:
                (out_dir / name).unlink(missing_ok=True)
        for name in written:
            os.replace(staging / name, out_dir / name)
    return out_dir
