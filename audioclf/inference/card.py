"""The model card of an exported model folder (README.md), written from the run's own files.

    text = model_card(cfg, ckpt, "runs/demo_cnn/best.pt")   # report: runs/demo_cnn/eval/report.json

What it says, and where each fact comes from:
- the front matter the Hugging Face Hub reads: library name, tags, the metrics (model-index),
  their values exactly as the evaluation's report.json holds them;
- what the model embeds: the config's model and features sections;
- its training data: the index sheet (config data.index) with its split counts, as the sheet
  reads at export; the training time and epochs: the run's metrics.csv;
- its evaluation: report.json (the split, its counts, cross-item P@1, MAP@R, EER) when that
  report evaluated this very checkpoint; else the card says it was not evaluated;
- its known limits: the adaptation record, and what the evaluation did not measure.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import yaml

from audioclf.config import Config
from audioclf.inference.artefacts import describe_adaptation

# report.json metrics the card quotes: (key, the name a reader knows, the Hub's metric type).
CARD_METRICS = (
    ("precision_at_1", "cross-item P@1", "precision_at_1"),
    ("map_at_r", "cross-item MAP@R", "map_at_r"),
    ("eer", "EER (verification pairs)", "eer"),
    ("knn_accuracy", "kNN accuracy", "accuracy"),
)
REPORT = Path("eval") / "report.json"  # where `./run.sh demo` and the docs put the evaluation


def model_card(
    cfg: Config, ckpt: dict, checkpoint_path: Path, *, report: str | Path | None = None
) -> str:
    """README.md of a model folder: the front matter and a short body (see the module doc).
    `report`: an evaluation's report.json (default: eval/report.json in the checkpoint's run
    folder); it is quoted only when it evaluated `checkpoint_path` itself."""
    run_dir = checkpoint_path.parent
    evaluation = read_report(Path(report) if report else run_dir / REPORT, checkpoint_path)
    metrics = card_metrics(evaluation)
    front = front_matter(cfg, metrics, evaluation)
    body = [
        f"# {cfg.train.name}",
        "",
        *what_it_embeds(cfg, ckpt),
        "",
        *training_facts(cfg, ckpt, run_dir),
        "",
        *evaluation_facts(metrics, evaluation, checkpoint_path),
        "",
        *limits(ckpt, evaluation),
        "",
        *usage(),
    ]
    return "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n\n" + "\n".join(body) + "\n"


def read_report(path: Path, checkpoint_path: Path) -> dict[str, Any] | None:
    """report.json when it is there, readable and of this checkpoint; else None."""
    try:
        report = json.loads(path.read_text())
        evaluated = Path(report["evaluation"]["checkpoint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        same = evaluated.resolve() == checkpoint_path.resolve() or evaluated.samefile(
            checkpoint_path
        )
    except OSError:
        same = False
    return {**report, "path": str(path)} if same else None


def card_metrics(evaluation: dict | None) -> list[tuple[str, str, str, float]]:
    """(key, name, Hub type, value) of each quoted metric the report holds, finite ones only."""
    if evaluation is None:
        return []
    values = evaluation.get("metrics", {})
    return [
        (key, name, kind, values[key])
        for key, name, kind in CARD_METRICS
        if isinstance(values.get(key), (int, float)) and math.isfinite(values[key])
    ]


def front_matter(cfg: Config, metrics: list, evaluation: dict | None) -> dict[str, Any]:
    """The YAML the Hub reads: library, tags, and model-index with the report's values."""
    front: dict[str, Any] = {
        "library_name": "audioclf",
        "pipeline_tag": "feature-extraction",
        "tags": ["audio", "audio-embedding", "metric-learning", "triplet-loss", cfg.model.name],
    }
    if metrics and evaluation is not None:
        setup = evaluation.get("evaluation", {})
        front["model-index"] = [
            {
                "name": cfg.train.name,
                "results": [
                    {
                        "task": {"type": "feature-extraction", "name": "cross-item retrieval"},
                        "dataset": {
                            "name": Path(str(setup.get("index", cfg.data.index))).name,
                            "type": "audioclf-index",
                            "split": str(setup.get("split", "")),
                        },
                        "metrics": [
                            {"type": kind, "value": value, "name": name}
                            for _, name, kind, value in metrics
                        ],
                    }
                ],
            }
        ]
    return front


def what_it_embeds(cfg: Config, ckpt: dict) -> list[str]:
    features = cfg.features
    if features.kind == "npy":
        heard = f"precomputed log-mel features ({features.n_mels} mel bands, .npy)"
    else:
        heard = f"mono audio at {features.sample_rate} Hz (the log-mel front end is inside)"
    classes = list(ckpt.get("classes") or [])
    head = f"; a classifier head over {len(classes)} classes" if cfg.model.head != "none" else ""
    return [
        f"A {cfg.model.name} audio embedding model trained by audioclf with triplet loss: it "
        f"maps {heard} to {cfg.model.embedding_dim}-d L2-normalised embeddings, compared by "
        f"cosine similarity{head}.",
    ]


def training_facts(cfg: Config, ckpt: dict, run_dir: Path) -> list[str]:
    lines = ["## Training data", ""]
    counts = index_counts(cfg)
    if counts is None:
        lines.append(f"- index sheet `{cfg.data.index}` (not readable at export: no counts)")
    else:
        lines.append(f"- index sheet `{cfg.data.index}`, as it read at export:")
        lines += [
            f"  - {split}: {n['clips']} clips, {n['classes']} classes, {n['items']} items"
            for split, n in counts.items()
        ]
    epochs, seconds = training_time(run_dir)
    if ckpt.get("epoch") is not None:
        lines.append(f"- these weights: epoch {ckpt['epoch']}, step {ckpt.get('step')}")
    if epochs:
        lines.append(f"- the run: {epochs} epochs in {seconds / 60:.1f} min of training")
    return lines


def index_counts(cfg: Config) -> dict[str, dict[str, int]] | None:
    """Clips, classes and items of each split of the run's index sheet; None when unreadable."""
    from audioclf.data.index import load_index  # noqa: PLC0415 - the sheet only for a card
    from audioclf.data.index.splits import split_index  # noqa: PLC0415

    try:
        splits = split_index(load_index(cfg.data), cfg.data)
    except Exception:  # noqa: BLE001 - a moved or edited sheet: the card says so, export goes on
        return None
    return {
        name: {
            "clips": len(part.table),
            "classes": int(part.table["cls"].nunique()),
            "items": len(part.table[["cls", "item"]].drop_duplicates()),
        }
        for name, part in splits.items()
        if len(part.table)
    }


def training_time(run_dir: Path) -> tuple[int, float]:
    """(epochs, seconds) that the run's metrics.csv records; (0, 0) without it."""
    try:
        with open(run_dir / "metrics.csv", newline="") as handle:
            rows = list(csv.DictReader(handle))
        return len(rows), sum(float(row["epoch_seconds"]) for row in rows)
    except (OSError, KeyError, ValueError):
        return 0, 0.0


def evaluation_facts(metrics: list, evaluation: dict | None, checkpoint_path: Path) -> list[str]:
    lines = ["## Evaluation", ""]
    if evaluation is None:
        return [
            *lines,
            "Not evaluated: no evaluation report of this checkpoint was found (run `python -m "
            f"audioclf.evaluate --checkpoint {checkpoint_path} --out "
            f"{checkpoint_path.parent / 'eval'}` before exporting).",
        ]
    setup = evaluation.get("evaluation", {})
    lines.append(
        f"On the `{setup.get('split')}` split of `{Path(str(setup.get('index'))).name}` "
        f"({setup.get('n_samples')} clips, {setup.get('n_classes')} classes; "
        f"report: `{evaluation['path']}`):"
    )
    lines += ["", "| metric | value |", "|---|---|"]
    lines += [f"| {name} | {value:.4f} |" for _, name, _, value in metrics]
    if setup.get("retrieval"):
        lines += ["", f"Retrieval is {setup['retrieval']}."]
    return lines


def limits(ckpt: dict, evaluation: dict | None) -> list[str]:
    lines = ["## Known limits", ""]
    adaptation = ckpt.get("adaptation")
    if adaptation:
        lines.append(f"- BatchNorm statistics{describe_adaptation(adaptation).removeprefix(',')}.")
    if evaluation is not None:
        lines.append(
            "- Measured on the training source only (a split of the same sheet): audio from "
            "another source (other microphones, engines, rooms) may score much lower."
        )
    notes = (evaluation or {}).get("evaluation", {}).get("notes") or []
    lines += [f"- {note}" for note in notes]
    return lines if len(lines) > 2 else [*lines, "- none recorded"]


def usage() -> list[str]:
    return [
        "## Use",
        "",
        "```python",
        "import audioclf",
        "",
        'model = audioclf.load("path/to/this/folder")   # no pickle: safetensors + config.json',
        'files, embeddings = model.embed(["clip.wav"])',
        "```",
    ]
