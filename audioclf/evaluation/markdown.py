"""report.md: the metrics, the plots and the per-class table as readable Markdown."""

from __future__ import annotations


def _format(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    return f"{value:.4f}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(
    title: str,
    metrics: dict,
    counts: dict,
    per_class: list[dict],
    images: list[str],
    setup: dict | None,
    notes: list[str],
    embedding_files: dict,
) -> str:
    lines = [f"# {title}", ""]
    if setup is not None:
        lines += [
            "## Setup",
            "",
            *(f"- {key}: {value}" for key, value in setup.items()),
            *(f"- note: {note}" for note in notes),
            "",
        ]
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
