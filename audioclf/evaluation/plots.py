"""The report's PNG plots: DET curve, per-class P@1, 2-D projection, kNN confusion matrix."""

from __future__ import annotations

import colorsys
import pathlib

import matplotlib

matplotlib.use("Agg")  # headless: no display on training nodes; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from scipy.stats import norm  # noqa: E402
from sklearn.decomposition import PCA  # noqa: E402
from sklearn.manifold import TSNE  # noqa: E402
from sklearn.metrics import confusion_matrix  # noqa: E402

from audioclf.fileio import atomic_write  # noqa: E402

# Most points drawn in projection.png; t-SNE cost and overplotting both grow with more.
MAX_PROJECTION_POINTS = 5000
# Above this many classes, plots drop per-class tick labels and legends (they become unreadable).
MAX_LABELLED_CLASSES = 30
_DET_TICKS = (0.001, 0.01, 0.05, 0.2, 0.5, 0.8, 0.95, 0.99)


def _save_figure(figure, path: pathlib.Path) -> pathlib.Path:
    try:
        figure.tight_layout()
        return atomic_write(path, lambda handle: figure.savefig(handle, format="png", dpi=120))
    finally:
        plt.close(figure)


def plot_det(path: pathlib.Path, verification: dict) -> pathlib.Path:
    fpr = np.asarray(verification["fpr"], dtype=np.float64)
    fnr = np.asarray(verification["fnr"], dtype=np.float64)
    if fpr.shape != fnr.shape or fpr.ndim != 1:
        raise ValueError(
            f"verification fpr {fpr.shape} and fnr {fnr.shape} must be 1-D of one length"
        )
    low, high = _DET_TICKS[0], _DET_TICKS[-1]
    # Probit axes: the DET convention, where Gaussian score distributions give straight lines.
    figure, axes = plt.subplots(figsize=(5.5, 5))
    normalised = [method for method in ("snorm", "asnorm") if f"fpr_{method}" in verification]
    raw = norm.ppf(np.clip(fpr, low, high)), norm.ppf(np.clip(fnr, low, high))
    axes.plot(*raw, lw=1.5, label="raw" if normalised else None)
    for method in normalised:  # the score-normalised curve, dashed
        rates = [np.clip(verification[f"{rate}_{method}"], low, high) for rate in ("fpr", "fnr")]
        eer = 100 * float(verification[f"eer_{method}"])
        axes.plot(*norm.ppf(rates), "--", lw=1.5, label=f"{method}, EER {eer:.2f}%")
    if "eer" in verification:
        eer = float(np.clip(verification["eer"], low, high))
        axes.plot(
            norm.ppf(eer), norm.ppf(eer), "o", label=f"EER {100 * float(verification['eer']):.2f}%"
        )
        axes.legend(loc="upper right")
    ticks = norm.ppf(_DET_TICKS)
    tick_labels = [f"{100 * t:g}" for t in _DET_TICKS]
    axes.set_xticks(ticks, tick_labels)
    axes.set_yticks(ticks, tick_labels)
    axes.set_xlim(ticks[0], ticks[-1])
    axes.set_ylim(ticks[0], ticks[-1])
    axes.set_xlabel("false alarm rate (%)")
    axes.set_ylabel("miss rate (%)")
    axes.set_title("DET curve")
    axes.grid(True, alpha=0.3)
    return _save_figure(figure, path)


def plot_per_class(path: pathlib.Path, per_class: list[dict], metrics: dict) -> pathlib.Path:
    rows = [row for row in per_class if row["p_at_1"] is not None]  # already worst first
    values = [row["p_at_1"] for row in rows]
    if len(rows) <= MAX_LABELLED_CLASSES:
        figure, axes = plt.subplots(figsize=(7, max(2.5, 0.3 * len(rows) + 1)))
        positions = np.arange(len(rows))
        axes.barh(positions, values)
        axes.set_yticks(positions, [row["name"] for row in rows])
        axes.invert_yaxis()  # worst at the top
        axes.set_xlim(0, 1)
        axes.set_xlabel("P@1")
    else:
        figure, axes = plt.subplots(figsize=(10, 4))
        axes.bar(np.arange(len(rows)), values, width=1.0)
        axes.set_xticks([])
        axes.set_xlabel(f"{len(rows)} classes, sorted by P@1")
        axes.set_ylim(0, 1)
        axes.set_ylabel("P@1")
    overall = metrics.get("precision_at_1")
    if overall is not None:
        line = axes.axvline if len(rows) <= MAX_LABELLED_CLASSES else axes.axhline
        line(overall, color="black", ls="--", lw=1, label=f"overall {overall:.3f}")
        axes.legend(loc="best")
    axes.set_title("Per-class P@1 (leave-one-out retrieval)")
    return _save_figure(figure, path)


def plot_projection(
    path, emb: torch.Tensor, labels: np.ndarray, class_names, projection: str, seed: int
):
    rng = np.random.default_rng(seed)
    if len(labels) > MAX_PROJECTION_POINTS:
        keep = np.sort(rng.choice(len(labels), size=MAX_PROJECTION_POINTS, replace=False))
    else:
        keep = np.arange(len(labels))
    points = F.normalize(emb[torch.from_numpy(keep)], p=2, dim=1).numpy()
    shown_labels = labels[keep]
    if projection == "pca":
        coords = PCA(n_components=2, random_state=seed).fit_transform(points)
    else:
        perplexity = min(30.0, max(1.0, (len(points) - 1) / 3))
        coords = TSNE(
            n_components=2, perplexity=perplexity, init="pca", random_state=seed
        ).fit_transform(points)

    classes = np.unique(shown_labels)
    figure, axes = plt.subplots(figsize=(7, 6))
    if len(classes) <= 20:
        palette = plt.get_cmap("tab10" if len(classes) <= 10 else "tab20")
        for position, class_id in enumerate(classes):
            mask = shown_labels == class_id
            axes.scatter(*coords[mask].T, s=6, color=palette(position), label=class_names[class_id])
        axes.legend(markerscale=2, fontsize="small", loc="best")
    else:
        colour = np.searchsorted(classes, shown_labels)
        axes.scatter(*coords.T, s=3, c=colour, cmap="nipy_spectral", alpha=0.7)
    axes.set_title(
        f"{projection.upper()} of {len(keep)} of {len(labels)} embeddings, {len(classes)} classes"
    )
    axes.set_xticks([])
    axes.set_yticks([])
    return _save_figure(figure, path)


def plot_confusion(path, labels: np.ndarray, predictions: np.ndarray, class_names) -> pathlib.Path:
    class_ids = np.union1d(labels, predictions)
    matrix = confusion_matrix(labels, predictions, labels=class_ids).astype(np.float64)
    # Row-normalised: each row shows where one true class's samples went (per-class recall).
    row_totals = matrix.sum(axis=1, keepdims=True)
    matrix = np.divide(matrix, row_totals, out=np.zeros_like(matrix), where=row_totals > 0)
    size = 8 if len(class_ids) > MAX_LABELLED_CLASSES else max(4.0, 0.35 * len(class_ids) + 2)
    figure, axes = plt.subplots(figsize=(size, size))
    image = axes.imshow(matrix, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    if len(class_ids) <= MAX_LABELLED_CLASSES:
        names = [class_names[class_id] for class_id in class_ids]
        axes.set_xticks(np.arange(len(class_ids)), names, rotation=90)
        axes.set_yticks(np.arange(len(class_ids)), names)
    else:
        axes.set_xticks([])
        axes.set_yticks([])
    axes.set_xlabel("kNN prediction")
    axes.set_ylabel("true class")
    axes.set_title(f"kNN confusion (row-normalised)\naccuracy {np.mean(labels == predictions):.3f}")
    figure.colorbar(image, ax=axes, fraction=0.046)
    return _save_figure(figure, path)


def class_colours(n: int) -> list[str]:
    if n <= 20:
        palette = plt.get_cmap("tab10" if n <= 10 else "tab20")
        return [to_hex(palette(i)) for i in range(n)]
    # Golden-angle hues with three lightness levels: neighbours in the legend differ clearly.
    return [
        to_hex(colorsys.hls_to_rgb((i * 0.381966) % 1.0, 0.35 + 0.15 * (i % 3), 0.75))
        for i in range(n)
    ]
