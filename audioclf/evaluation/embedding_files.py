"""The report's files for looking at the embedding space: embeddings.tsv + metadata.tsv (what
https://projector.tensorflow.org loads) and embeddings.html, a self-contained interactive 2-D
PCA scatter (hover: class, item, id; click a class to hide it).

The page is hand-made SVG with a few lines of inline JavaScript (embeddings.html beside this
module, package data) rather than plotly: no dependency, and under 1 MB at 5,000 points instead
of the ~4 MB of plotly.js that every self-contained plotly file carries.
"""

from __future__ import annotations

import html
import importlib.resources
import pathlib

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from sklearn.decomposition import PCA

from audioclf.data.index.splits import stratified_subset
from audioclf.evaluation.plots import class_colours
from audioclf.fileio import atomic_write, tsv_cell

# Most points in embeddings.tsv / metadata.tsv (the projector's PCA and t-SNE stay responsive;
# ~10 bytes per value: 25 MB at D = 128) and in embeddings.html (an SVG circle each).
MAX_TSV_POINTS = 20_000
MAX_HTML_POINTS = 5_000
EMBEDDING_FILES = ("embeddings.tsv", "metadata.tsv", "embeddings.html")
_SCATTER_SIZE = (900, 700)
_TEMPLATE = "embeddings.html"  # @TITLE@, @SUBTITLE@, @WIDTH@, @HEIGHT@, @POINTS@, @LEGEND@


def write_embedding_files(
    out_dir: pathlib.Path,
    emb: torch.Tensor,
    labels: np.ndarray,
    class_names: list[str],
    metadata: pd.DataFrame,
    seed: int,
    tsv_points: int,
    html_points: int,
    title: str,
    written: dict[str, pathlib.Path],
) -> dict:
    """embeddings.tsv, metadata.tsv and embeddings.html into out_dir (added to `written`);
    returns {file: {"points", "of", "sampling"}} for report.json and report.md."""
    total = len(labels)
    info = {}
    keep = stratified_subset(labels, tsv_points, seed)
    names = np.asarray(class_names, dtype=object)[labels[keep]]
    table = pd.concat(
        [pd.DataFrame({"class": names}), metadata.iloc[keep].reset_index(drop=True)], axis=1
    )
    # Plain tab-joined lines: the projector does not undo csv quoting.
    lines = [
        "\t".join(map(tsv_cell, row)) for row in [table.columns, *table.itertuples(index=False)]
    ]
    vectors = emb[torch.from_numpy(keep)].numpy()
    written["embeddings.tsv"] = atomic_write(
        out_dir / "embeddings.tsv", lambda f: np.savetxt(f, vectors, fmt="%.5g", delimiter="\t")
    )
    written["metadata.tsv"] = atomic_write(
        out_dir / "metadata.tsv", lambda f: f.write(("\n".join(lines) + "\n").encode())
    )
    for name in ("embeddings.tsv", "metadata.tsv"):
        info[name] = _sampling(len(keep), total)

    keep = stratified_subset(labels, html_points, seed)
    page = _scatter_html(
        emb[torch.from_numpy(keep)],
        labels[keep],
        class_names,
        metadata.iloc[keep].reset_index(drop=True),
        seed,
        title,
        total,
    )
    written["embeddings.html"] = atomic_write(
        out_dir / "embeddings.html", lambda f: f.write(page.encode())
    )
    info["embeddings.html"] = _sampling(len(keep), total)
    return info


def _sampling(points: int, total: int) -> dict:
    return {
        "points": int(points),
        "of": int(total),
        "sampling": "all" if points == total else "class-stratified",
    }


def _scatter_html(
    emb: torch.Tensor,
    labels: np.ndarray,
    class_names: list[str],
    metadata: pd.DataFrame,
    seed: int,
    title: str,
    total: int,
) -> str:
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
    colours = class_colours(len(present))
    columns = [c for c in ("item", "id") if c in metadata.columns] or list(metadata.columns[:2])
    values = {c: metadata[c].tolist() for c in columns}
    esc = html.escape
    circles = []
    # A seeded random drawing order, so that no class is always painted over the others.
    for i in np.random.default_rng(seed).permutation(len(labels)):
        name = class_names[labels[i]]
        hover = "\n".join([f"class: {name}", *(f"{c}: {values[c][i]}" for c in columns)])
        circles.append(
            f'<circle cx="{x[i]:.1f}" cy="{y[i]:.1f}" r="3" fill="{colours[codes[i]]}" '
            f'data-k="{codes[i]}"><title>{esc(hover)}</title></circle>'
        )
    legend = [
        f'<div data-k="{k}"><i style="background:{colours[k]}"></i>'
        f"{esc(class_names[class_id])} ({counts[k]})</div>"
        for k, class_id in enumerate(present)
    ]
    shown = (
        f"all {total}"
        if len(labels) == total
        else f"a class-stratified sample of {len(labels)} of {total}"
    )
    subtitle = (
        f"PCA of the L2-normalised embeddings: {shown} samples, {len(present)} classes; "
        f"the two axes explain {100 * explained[0]:.1f}% and {100 * explained[1]:.1f}% "
        "of the variance."
    )
    page = importlib.resources.files(__package__).joinpath(_TEMPLATE).read_text("utf-8")
    for key, value in (
        ("@WIDTH@", str(width)),
        ("@HEIGHT@", str(height)),
        ("@SUBTITLE@", esc(subtitle)),
        ("@POINTS@", "\n".join(circles)),
        ("@LEGEND@", "\n".join(legend)),
        ("@TITLE@", esc(title)),
    ):
        page = page.replace(key, value)
    return page
