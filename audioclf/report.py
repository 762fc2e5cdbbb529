"""Write an evaluation report: report.json, report.md and PNG plots, all written atomically.

``write_report`` takes the metric dicts from ``audioclf.metrics`` plus the embeddings they were
computed on, and writes into one directory:

- ``report.json``: scalar metrics, counts and per-class P@1 as plain JSON (NaN -> null);
- ``report.md``: the same as readable Markdown, per-class table worst first, image links;
- ``per_class_p1.png``, ``projection.png`` (PCA or t-SNE, coloured by class), and, when their
  inputs are given, ``det.png`` (DET curve) and ``confusion.png`` (kNN confusion matrix);
- ``embeddings.tsv`` + ``metadata.tsv`` (class and the given metadata columns, header row): the
  files https://projector.tensorflow.org loads, at most MAX_TSV_POINTS points;
- ``embeddings.html``: a self-contained interactive 2-D PCA scatter (hover: class, item, id;
  click a class to hide it), at most MAX_HTML_POINTS points. Hand-made SVG with a few lines of
  inline JavaScript rather than plotly: no dependency, and under 1 MB at 5,000 points instead
  of the ~4 MB of plotly.js that every self-contained plotly file carries.

Both embedding files take a class-stratified sample when the set is larger (every class while
it lasts); report.md and report.json say how many points of how many each holds.

Each file goes to a temporary name in the same directory and is ``os.replace``d into place, so
a crash never leaves a half-written report file.
"""

from __future__ import annotations

import colorsys
import html
import json
import math
import pathlib

import matplotlib

matplotlib.use("Agg")  # headless: no display on training nodes; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from scipy.stats import norm  # noqa: E402
from sklearn.decomposition import PCA  # noqa: E402
from sklearn.manifold import TSNE  # noqa: E402
from sklearn.metrics import confusion_matrix  # noqa: E402

from audioclf.data.index.splits import stratified_subset  # noqa: E402
from audioclf.fileio import atomic_write  # noqa: E402
from audioclf.metrics import check_embeddings, retrieval_metrics  # noqa: E402

PROJECTIONS = ("pca", "tsne")
# Most points drawn in projection.png; t-SNE cost and overplotting both grow with more.
MAX_PROJECTION_POINTS = 5000
# Above this many classes, plots drop per-class tick labels and legends (they become unreadable).
MAX_LABELLED_CLASSES = 30
# Most points in embeddings.tsv / metadata.tsv (the projector's PCA and t-SNE stay responsive;
# ~10 bytes per value: 25 MB at D = 128) and in embeddings.html (an SVG circle each).
MAX_TSV_POINTS = 20_000
MAX_HTML_POINTS = 5_000
EMBEDDING_FILES = ("embeddings.tsv", "metadata.tsv", "embeddings.html")
_DET_TICKS = (0.001, 0.01, 0.05, 0.2, 0.5, 0.8, 0.95, 0.99)


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
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
    emb, lab = check_embeddings(embeddings, labels)
    class_names = [str(name) for name in class_names]
    _check_class_ids(lab, class_names, "labels")
    if knn_predictions is not None:
        knn_predictions = np.asarray(knn_predictions, dtype=np.int64)
        if knn_predictions.shape != lab.shape:
            raise ValueError(
                f"knn_predictions has shape {knn_predictions.shape} but labels has shape {lab.shape}; "
                f"pass one prediction per labelled sample"
            )
        _check_class_ids(knn_predictions, class_names, "knn_predictions")
    metadata = _check_metadata(metadata, len(lab))
    if tsv_points < 1 or html_points < 1:
        raise ValueError(f"tsv_points ({tsv_points}) and html_points ({html_points}) must be >= 1")

    correct_at_1 = results.get("per_sample_correct_at_1")
    if correct_at_1 is None:
        correct_at_1 = retrieval_metrics(emb, lab, return_per_sample=True)["per_sample_correct_at_1"]
    correct_at_1 = np.asarray(correct_at_1, dtype=bool)
    if correct_at_1.shape != lab.shape:
        raise ValueError(
            f"results['per_sample_correct_at_1'] has shape {correct_at_1.shape} but labels has shape "
            f"{lab.shape}; it must come from the same embeddings"
        )

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = _scalars(results)
    for name, value in _scalars(verification or {}).items():
        metrics.setdefault(name, value)
    per_class = _per_class_p1(lab, correct_at_1, class_names)
    counts = {
        "n_samples": int(len(lab)),
        "n_classes": int(len(per_class)),
        "n_class_names": len(class_names),
        "n_singleton_classes": sum(row["count"] == 1 for row in per_class),
        "embedding_dim": int(emb.shape[1]),
    }

    written: dict[str, pathlib.Path] = {}
    if verification is not None:
        written["det.png"] = _plot_det(out_dir / "det.png", verification)
    written["per_class_p1.png"] = _plot_per_class(out_dir / "per_class_p1.png", per_class, metrics)
    written["projection.png"] = _plot_projection(
        out_dir / "projection.png", emb, lab, class_names, projection, seed
    )
    if knn_predictions is not None:
        written["confusion.png"] = _plot_confusion(out_dir / "confusion.png", lab, knn_predictions, class_names)
    images = list(written)
    embedding_files = _write_embedding_files(out_dir, emb, lab, class_names, metadata, seed,
                                             tsv_points, html_points, title, written)

    markdown = _markdown(title, metrics, counts, per_class, images=images,
                         setup=setup, notes=list(notes), embedding_files=embedding_files)
    written["report.md"] = atomic_write(out_dir / "report.md", lambda f: f.write(markdown.encode()))
    report = {
        "title": title,
        "metrics": metrics,
        "counts": counts,
        "per_class_p1": per_class,
        "embedding_files": embedding_files,
        "files": sorted([*written, "report.json"]),
    }
    if setup is not None:
        report["evaluation"] = {**setup, "notes": list(notes)}
    text = json.dumps(_json_ready(report), indent=2, allow_nan=False) + "\n"
    written["report.json"] = atomic_write(out_dir / "report.json", lambda f: f.write(text.encode()))
    return written


# --------------------------------------------------------------------------------------------
# Data preparation
# --------------------------------------------------------------------------------------------


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
        raise ValueError(f"metadata has {len(metadata)} rows but there are {n} embeddings; "
                         "give one metadata row per embedding, in the same order")
    if "class" in metadata.columns:
        raise ValueError("metadata must not have a 'class' column: the class comes from labels")
    return metadata.reset_index(drop=True).astype(str)


def _is_scalar(value) -> bool:
    if isinstance(value, (bool, int, float, np.number, np.bool_)):
        return True
    return isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 0


def _scalars(metric_dict: dict) -> dict:
    return {str(name): _json_ready(value) for name, value in metric_dict.items() if _is_scalar(value)}


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


def _per_class_p1(labels: np.ndarray, correct_at_1: np.ndarray, class_names: list[str]) -> list[dict]:
    """One row per class present, worst P@1 first; a singleton class has P@1 None (no positive)."""
    class_ids, class_index, counts = np.unique(labels, return_inverse=True, return_counts=True)
    hits = np.bincount(class_index, weights=correct_at_1.astype(np.float64), minlength=len(class_ids))
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
    return sorted(rows, key=lambda row: (row["p_at_1"] is None, row["p_at_1"] or 0.0, row["class_id"]))


def _save_figure(figure, path: pathlib.Path) -> pathlib.Path:
    try:
        figure.tight_layout()
        return atomic_write(path, lambda handle: figure.savefig(handle, format="png", dpi=120))
    finally:
        plt.close(figure)


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def _plot_det(path: pathlib.Path, verification: dict) -> pathlib.Path:
    fpr = np.asarray(verification["fpr"], dtype=np.float64)
    fnr = np.asarray(verification["fnr"], dtype=np.float64)
    if fpr.shape != fnr.shape or fpr.ndim != 1:
        raise ValueError(f"verification fpr {fpr.shape} and fnr {fnr.shape} must be 1-D of one length")
    low, high = _DET_TICKS[0], _DET_TICKS[-1]
    # Probit axes: the DET convention, where Gaussian score distributions give straight lines.
    figure, axes = plt.subplots(figsize=(5.5, 5))
    axes.plot(norm.ppf(np.clip(fpr, low, high)), norm.ppf(np.clip(fnr, low, high)), lw=1.5)
    if "eer" in verification:
        eer = float(np.clip(verification["eer"], low, high))
        axes.plot(norm.ppf(eer), norm.ppf(eer), "o", label=f"EER {100 * float(verification['eer']):.2f}%")
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


def _plot_per_class(path: pathlib.Path, per_class: list[dict], metrics: dict) -> pathlib.Path:
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


def _plot_projection(path, emb: torch.Tensor, labels: np.ndarray, class_names, projection: str, seed: int):
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
        coords = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(points)

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
    axes.set_title(f"{projection.upper()} of {len(keep)} of {len(labels)} embeddings, {len(classes)} classes")
    axes.set_xticks([])
    axes.set_yticks([])
    return _save_figure(figure, path)


def _plot_confusion(path, labels: np.ndarray, predictions: np.ndarray, class_names) -> pathlib.Path:
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


# --------------------------------------------------------------------------------------------
# Embedding files: projector TSVs and the interactive HTML scatter
# --------------------------------------------------------------------------------------------


def _write_embedding_files(out_dir: pathlib.Path, emb: torch.Tensor, labels: np.ndarray,
                           class_names: list[str], metadata: pd.DataFrame, seed: int,
                           tsv_points: int, html_points: int, title: str,
                           written: dict[str, pathlib.Path]) -> dict:
    """embeddings.tsv, metadata.tsv and embeddings.html into out_dir (added to `written`);
    returns {file: {"points", "of", "sampling"}} for report.json and report.md."""
    total = len(labels)
    info = {}
    keep = stratified_subset(labels, tsv_points, seed)
    names = np.asarray(class_names, dtype=object)[labels[keep]]
    table = pd.concat([pd.DataFrame({"class": names}), metadata.iloc[keep].reset_index(drop=True)],
                      axis=1)
    # Plain tab-joined lines: the projector does not undo csv quoting.
    lines = ["\t".join(map(_tsv_cell, row)) for row in [table.columns, *table.itertuples(index=False)]]
    vectors = emb[torch.from_numpy(keep)].numpy()
    written["embeddings.tsv"] = atomic_write(
        out_dir / "embeddings.tsv", lambda f: np.savetxt(f, vectors, fmt="%.5g", delimiter="\t"))
    written["metadata.tsv"] = atomic_write(
        out_dir / "metadata.tsv",
        lambda f: f.write(("\n".join(lines) + "\n").encode()))
    for name in ("embeddings.tsv", "metadata.tsv"):
        info[name] = _sampling(len(keep), total)

    keep = stratified_subset(labels, html_points, seed)
    page = _scatter_html(emb[torch.from_numpy(keep)], labels[keep], class_names,
                         metadata.iloc[keep].reset_index(drop=True), seed, title, total)
    written["embeddings.html"] = atomic_write(out_dir / "embeddings.html",
                                              lambda f: f.write(page.encode()))
    info["embeddings.html"] = _sampling(len(keep), total)
    return info


def _sampling(points: int, total: int) -> dict:
    return {"points": int(points), "of": int(total),
            "sampling": "all" if points == total else "class-stratified"}


def _tsv_cell(text) -> str:
    """One TSV cell: tabs and line breaks would shift the projector's columns and rows; an empty
    cell reads as a missing value."""
    return " ".join(str(text).split()) or "-"


def _class_colours(n: int) -> list[str]:
    if n <= 20:
        palette = plt.get_cmap("tab10" if n <= 10 else "tab20")
        return [to_hex(palette(i)) for i in range(n)]
    # Golden-angle hues with three lightness levels: neighbours in the legend differ clearly.
    return [to_hex(colorsys.hls_to_rgb((i * 0.381966) % 1.0, 0.35 + 0.15 * (i % 3), 0.75))
            for i in range(n)]


_SCATTER_SIZE = (900, 700)
_SCATTER_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>@TITLE@ - embeddings</title>
<style>
body{font:14px system-ui,sans-serif;margin:16px;color:#222}
#wrap{display:flex;gap:16px;align-items:flex-start}
svg{border:1px solid #ccc;width:min(72vw,900px);height:auto;flex:none}
circle{fill-opacity:.75}
circle.off{display:none}
svg.focus circle{fill-opacity:.07}
svg.focus circle.on{fill-opacity:1}
#legend{max-height:80vh;overflow:auto}
#legend div{cursor:pointer;white-space:nowrap;padding:1px 4px}
#legend div.off{opacity:.3}
#legend i{display:inline-block;width:.8em;height:.8em;margin-right:.4em;border-radius:50%}
#tip{position:fixed;pointer-events:none;background:#222;color:#fff;padding:3px 6px;
border-radius:3px;font-size:12px;display:none;white-space:pre}
</style></head><body>
<h2>@TITLE@: embeddings</h2>
<p>@SUBTITLE@</p>
<p><button id="all">show all</button> <button id="none">hide all</button>
Hover a point for its class, item and id; click a class to show or hide it, hover it to
highlight it.</p>
<div id="wrap">
<svg id="plot" viewBox="0 0 @WIDTH@ @HEIGHT@" xmlns="http://www.w3.org/2000/svg">
@POINTS@
</svg>
<div id="legend">
@LEGEND@
</div></div>
<div id="tip"></div>
<script>
(function () {
  var svg = document.getElementById("plot"), tip = document.getElementById("tip");
  var rows = document.querySelectorAll("#legend div");
  svg.querySelectorAll("circle").forEach(function (c) {  // a fast tooltip replaces <title>
    c.dataset.t = c.firstChild.textContent; c.removeChild(c.firstChild);
  });
  function points(k) { return svg.querySelectorAll('circle[data-k="' + k + '"]'); }
  function show(row, on) {
    row.classList.toggle("off", !on);
    points(row.dataset.k).forEach(function (c) { c.classList.toggle("off", !on); });
  }
  rows.forEach(function (row) {
    row.onclick = function () { show(row, row.classList.contains("off")); };
    row.onmouseenter = function () {
      svg.classList.add("focus");
      points(row.dataset.k).forEach(function (c) { c.classList.add("on"); });
    };
    row.onmouseleave = function () {
      svg.classList.remove("focus");
      points(row.dataset.k).forEach(function (c) { c.classList.remove("on"); });
    };
  });
  document.getElementById("all").onclick = function () { rows.forEach(function (r) { show(r, true); }); };
  document.getElementById("none").onclick = function () { rows.forEach(function (r) { show(r, false); }); };
  svg.addEventListener("mousemove", function (e) {
    var t = e.target.dataset && e.target.dataset.t;
    if (!t) { tip.style.display = "none"; return; }
    tip.textContent = t; tip.style.display = "block";
    tip.style.left = (e.clientX + 12) + "px"; tip.style.top = (e.clientY + 12) + "px";
  });
  svg.addEventListener("mouseleave", function () { tip.style.display = "none"; });
})();
</script>
</body></html>
"""


def _scatter_html(emb: torch.Tensor, labels: np.ndarray, class_names: list[str],
                  metadata: pd.DataFrame, seed: int, title: str, total: int) -> str:
    """A self-contained page: SVG scatter of the 2-D PCA of the normalised embeddings."""
    points = F.normalize(emb, p=2, dim=1).numpy().astype(np.float64)
    components = min(2, *points.shape)
    pca = PCA(n_components=components, random_state=seed)
    coords = np.zeros((len(points), 2))
    coords[:, :components] = pca.fit_transform(points)
    explained = [*pca.explained_variance_ratio_.tolist(), 0.0][:2]

    width, height = _SCATTER_SIZE
    margin = 12
    low, span = coords.min(axis=0), np.ptp(coords, axis=0)
    span[span == 0] = 1.0
    scale = min((width - 2 * margin) / span[0], (height - 2 * margin) / span[1])
    x = margin + (coords[:, 0] - low[0]) * scale
    y = height - margin - (coords[:, 1] - low[1]) * scale  # SVG's y axis points down

    present, codes, counts = np.unique(labels, return_inverse=True, return_counts=True)
    colours = _class_colours(len(present))
    columns = [c for c in ("item", "id") if c in metadata.columns] or list(metadata.columns[:2])
    values = {c: metadata[c].tolist() for c in columns}
    esc = html.escape
    circles = []
    # A seeded random drawing order, so that no class is always painted over the others.
    for i in np.random.default_rng(seed).permutation(len(labels)):
        name = class_names[labels[i]]
        hover = "\n".join([f"class: {name}", *(f"{c}: {values[c][i]}" for c in columns)])
        circles.append(f'<circle cx="{x[i]:.1f}" cy="{y[i]:.1f}" r="3" fill="{colours[codes[i]]}" '
                       f'data-k="{codes[i]}"><title>{esc(hover)}</title></circle>')
    legend = [f'<div data-k="{k}"><i style="background:{colours[k]}"></i>'
              f'{esc(class_names[class_id])} ({counts[k]})</div>'
              for k, class_id in enumerate(present)]
    shown = (f"all {total}" if len(labels) == total
             else f"a class-stratified sample of {len(labels)} of {total}")
    subtitle = (f"PCA of the L2-normalised embeddings: {shown} samples, {len(present)} classes; "
                f"the two axes explain {100 * explained[0]:.1f}% and {100 * explained[1]:.1f}% "
                "of the variance.")
    page = _SCATTER_PAGE
    for key, value in (("@WIDTH@", str(width)), ("@HEIGHT@", str(height)),
                       ("@SUBTITLE@", esc(subtitle)), ("@POINTS@", "\n".join(circles)),
                       ("@LEGEND@", "\n".join(legend)), ("@TITLE@", esc(title))):
        page = page.replace(key, value)
    return page


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def _format(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    return f"{value:.4f}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _markdown(title: str, metrics: dict, counts: dict, per_class: list[dict], images: list[str],
              setup: dict | None, notes: list[str], embedding_files: dict) -> str:
    lines = [f"# {title}", ""]
    if setup is not None:
        lines += ["## Setup", "", *(f"- {key}: {value}" for key, value in setup.items()),
                  *(f"- note: {note}" for note in notes), ""]
    lines += [
        f"{counts['n_samples']} samples, {counts['n_classes']} classes "
        f"({counts['n_singleton_classes']} with a single sample, left out of retrieval metrics), "
        f"embedding dimension {counts['embedding_dim']}.",
        "",
        "## Metrics",
        "",
        "| metric | value |",
        "|---|---|",
        *(f"| {_cell(name)} | {_format(value)} |" for name, value in metrics.items()),
        "",
        "## Plots",
        "",
        *(f"![{image.removesuffix('.png')}]({image})\n" for image in images),
        *_embedding_lines(embedding_files),
        "## Per-class P@1 (worst first)",
        "",
        "| class id | name | samples | P@1 |",
        "|---|---|---|---|",
        *(
            f"| {row['class_id']} | {_cell(row['name'])} | {row['count']} | {_format(row['p_at_1'])} |"
            for row in per_class
        ),
        "",
    ]
    return "\n".join(lines)


def _embedding_lines(files: dict) -> list[str]:
    def points(name: str) -> str:
        entry = files[name]
        if entry["sampling"] == "all":
            return f"all {entry['of']} samples"
        return f"a class-stratified sample of {entry['points']} of {entry['of']} samples"

    return [
        "## Embeddings",
        "",
        f"- [embeddings.html](embeddings.html): interactive 2-D PCA, {points('embeddings.html')}, "
        "coloured by class; hover a point for its class, item and id.",
        f"- [embeddings.tsv](embeddings.tsv) + [metadata.tsv](metadata.tsv): "
        f"{points('embeddings.tsv')} for https://projector.tensorflow.org (Load: the vectors, "
        "then the metadata) — PCA, t-SNE, UMAP and nearest neighbours there.",
        "",
    ]
