"""Offline evaluation of a model on one split of an index, as one call (see
`python -m audioclf.evaluate --help`, which is parse, this, print):

    evaluated = evaluate("runs/demo/best.pt", split="val", gallery="train")
    print("\n".join(evaluated.lines()))        # evaluated.metrics: report.json's "metrics"
    evaluate("runs/demo/best.pt", adapt=["new_source/"])   # AdaBN on unlabelled audio first

which is: which rows (select_data, select.py), the model adapted (audioclf.inference.adapt) when asked,
their embeddings and every metric (evaluate_split, with metrics.py), the report folder under
its lock (write_evaluation, report.py) and the printed summary.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from audioclf.checkpoint import model_file
from audioclf.data.dataset import AudioDataset
from audioclf.data.index import Index
from audioclf.evaluation.metrics import Evaluation, MetricOptions, check_search, compute_metrics
from audioclf.evaluation.report import out_lock, scalar_metrics, write_evaluation
from audioclf.evaluation.select import EvalData, select_data
from audioclf.inference import LoadedEmbedder, resolve_device
from audioclf.inference.adapt import adapt as adapt_model
from audioclf.inference.extract import check_loader_options, dataset_for_input, embed_dataset
from audioclf.metrics import resolve_score_norm

# The metrics of the printed summary, in its order (report.md and report.json hold them all).
SUMMARY_METRICS = (
    "precision_at_1",
    "map_at_r",
    "r_precision",
    "loo_precision_at_1",
    "loo_map_at_r",
    "knn_accuracy",
    "centroid_accuracy",
    "eer",
    "min_dcf",
    "nmi",
    "ami",
)


# ---------------------------------------------------------------------------------------------
# The job


@dataclass
class Evaluated:
    """What evaluate did: the evaluation, report.json's "evaluation" entry, the report folder."""

    evaluation: Evaluation
    setup: dict
    out_dir: Path

    @property
    def metrics(self) -> dict:
        """The scalar metrics, as report.json's "metrics" holds them."""
        return scalar_metrics(self.evaluation.results, self.evaluation.verification)

    def lines(self) -> list[str]:
        """What evaluate prints: the setup, the notes, the SUMMARY_METRICS table, the files."""
        setup, evaluation = self.setup, self.evaluation
        rows = [
            ("checkpoint", f"{setup['checkpoint']} ({setup['model']})"),
            (
                "evaluated",
                f"{setup['split']} split of {setup['index']}: {setup['n_samples']} "
                f"samples, {setup['n_classes']} classes",
            ),
            ("gallery", setup["gallery"]),
            ("classification", setup["classification"]),
        ]
        if "search" in setup:
            rows.append(("search", search_line(setup)))
        if "score_norm" in setup:
            top = f"top {setup['cohort_top']} of " if "cohort_top" in setup else ""
            cohort = f"{top}{setup['n_cohort']} cohort clips, {setup['cohort']}"
            rows.append(("score norm", f"{setup['score_norm']} ({cohort})"))
        width = max(len(k) for k, _ in rows)
        lines = [f"{key:<{width}}  {value}" for key, value in rows]
        lines += [f"{'note':<{width}}  {note}" for note in evaluation.notes]
        lines += ["", f"{'metric':<18} value"]
        names = list(SUMMARY_METRICS)
        if "score_norm" in setup:  # the normalised verification figures after the raw ones
            at = names.index("min_dcf") + 1
            names[at:at] = [f"eer_{setup['score_norm']}", f"min_dcf_{setup['score_norm']}"]
        for name in names:
            value = evaluation.results.get(name)
            if value is None and evaluation.verification is not None:
                value = evaluation.verification.get(name)
            if value is not None:
                lines.append(f"{name:<18} {float(value):.4f}")
        return [
            *lines,
            "",
            f"report: {self.out_dir / 'report.md'}",
            f"embeddings: {self.out_dir / 'embeddings.html'} (projector files: embeddings.tsv, metadata.tsv)",
        ]


@dataclass(frozen=True)
class EvaluateOptions:
    """What `evaluate` reads, embeds and scores: the options of `python -m audioclf.evaluate`,
    one field a flag (batch_size is --batch-size). `check()` is a ValueError naming the first
    option out of range before anything is loaded: by its name (max_pairs), or by its flag
    (--max-pairs) for the command line."""

    index: str | Path | None = None  # another sheet to evaluate (data.index replaced)
    root: str | None = None  # where its relative paths resolve (None: data.root, or its folder)
    split: str = "val"  # train, val, test or all
    gallery: str = "train"  # classification gallery: train, none or a sheet
    batch_size: int = 32
    num_workers: int | None = None  # None: data.num_workers of the checkpoint
    max_pairs: int = 1_000_000  # verification pairs scored at most
    score_norm: str | None = None  # audioclf.metrics.resolve_score_norm's, with cohort / top
    cohort: str | None = None
    cohort_top: int | None = None
    search: str = "auto"  # retrieval's neighbour search
    projection: str = "pca"  # the report's 2-D projection: pca or tsne
    skip_bad_files: bool = False
    seed: int = 0  # of the pairs, k-means and enrollment
    adapt: Sequence[str | Path] = ()  # unlabelled audio of a new source to adapt on (AdaBN)

    def check(self, *, by_flag: bool = False) -> None:
        try:
            check_search(self.search)
            check_loader_options(self.batch_size, self.num_workers)
            if self.max_pairs < 2:
                raise ValueError(f"--max-pairs must be >= 2, got {self.max_pairs}")
            resolve_score_norm(
                self.score_norm, self.cohort, self.cohort_top, default_cohort="train"
            )
        except ValueError as exc:  # the checks name flags: "--max-pairs" -> "max_pairs"
            if by_flag:
                raise
            raise ValueError(FLAG.sub(_option, str(exc))) from None

    @classmethod
    def of(cls, options: EvaluateOptions | None, settings: dict) -> EvaluateOptions:
        """`options` (default: the defaults) with `settings` (field=value) replaced; a
        TypeError naming a setting that is no option."""
        known = {field.name for field in dataclasses.fields(cls)}
        if unknown := sorted(set(settings) - known):
            raise TypeError(
                f"evaluate() got unknown option(s) {', '.join(unknown)}; EvaluateOptions has "
                f"{', '.join(sorted(known))}"
            )
        return dataclasses.replace(options or cls(), **settings)


FLAG = re.compile(r"--([a-z][a-z-]*)")


def _option(flag: re.Match) -> str:
    return flag.group(1).replace("-", "_")


def evaluate(
    model: str | Path | LoadedEmbedder,
    options: EvaluateOptions | None = None,
    *,
    out: str | Path | None = None,
    device: str | torch.device = "auto",
    model_name: str | None = None,
    progress: bool = True,
    trust: bool = False,
    skip_hint: str | None = None,
    **settings,
) -> Evaluated:
    """Evaluate a checkpoint (a path, or a model loaded from one) as `options` say (an
    EvaluateOptions; any of its fields may also be given by name: split="test") and write the
    report into `out` (default <checkpoint folder>/eval). `options.adapt`: folders or files of
    unlabelled audio of a new source, which the model is adapted on (AdaBN) before it embeds, a
    given model left as it is; report.json's "evaluation" records it ("adaptation"), as it does
    a given model's earlier adaptation. Every option and the data are checked before anything
    is embedded; the out folder is locked from the start. `device` is used to load a path."""
    start = time.perf_counter()
    options = EvaluateOptions.of(options, settings)
    options.check()
    score_norm, cohort = resolve_score_norm(
        options.score_norm, options.cohort, options.cohort_top, default_cohort="train"
    )
    checkpoint = model.path if isinstance(model, LoadedEmbedder) else Path(model)
    if checkpoint.is_dir():  # a run folder: its best.pt, whose folder the report goes into
        checkpoint = model_file(checkpoint)
    if not isinstance(model, LoadedEmbedder):
        device = resolve_device(device)
    out_dir = Path(out) if out is not None else checkpoint.parent / "eval"
    with out_lock(out_dir):  # from the start: a second evaluate into out is refused at once
        if not isinstance(model, LoadedEmbedder):
            model = LoadedEmbedder.from_checkpoint(
                checkpoint, device, model_name=model_name, trust=trust
            )
        model = _evaluable(model, options.skip_bad_files)
        data = select_data(
            model.cfg,
            index=options.index,
            root=options.root,
            split=options.split,
            gallery=options.gallery,
            cohort=cohort,
        )
        if options.adapt:
            model = adapt_model(model, options.adapt)
        evaluation, rows = evaluate_split(
            model,
            data,
            dataclasses.replace(options, score_norm=score_norm),
            progress=progress,
            skip_hint=skip_hint,
        )
        seconds = time.perf_counter() - start
        setup = evaluation_setup(checkpoint, model, data, evaluation, seconds=seconds)
        write_evaluation(
            out_dir,
            evaluation,
            projection=options.projection,
            seed=options.seed,
            setup=setup,
            rows=rows,
            locked=True,
        )
    return Evaluated(evaluation, setup, out_dir)


def _evaluable(model: LoadedEmbedder, skip_bad_files: bool) -> LoadedEmbedder:
    """The model with data.skip_bad_files set by the caller too; ValueError for an export,
    which does not record the training's split rules (data.val_ratio, holdout, seed)."""
    if not model.knows_splits:
        raise ValueError(
            f"{model.path} is an export ({model.description}); evaluate needs the checkpoint it "
            "was exported from (its config holds the split rules and the data settings)"
        )
    data = dataclasses.replace(
        model.data, skip_bad_files=model.data.skip_bad_files or skip_bad_files
    )
    return dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, data=data))


# ---------------------------------------------------------------------------------------------
# Embedding and scoring


def embed_index(
    model: LoadedEmbedder,
    index: Index,
    *,
    batch_size: int,
    num_workers: int,
    progress: bool,
    description: str,
    skip_hint: str | None = None,
) -> tuple[np.ndarray, pd.DataFrame]:
    """Embeddings [n, D] of the rows of `index` that could be read, and those rows of its table
    (fewer than all only with data.skip_bad_files=true). `skip_hint`: how an unreadable file's
    message says to skip such files (default: the config key)."""
    dataset = AudioDataset.from_index(index, model.cfg, train=False, skip_hint=skip_hint)
    emb, _, positions = embed_dataset(
        model.embed_fn,
        dataset_for_input(dataset, model.input_kind),
        batch_size=batch_size,
        device=model.device,
        num_workers=num_workers,
        progress=progress,
        description=description,
    )
    return emb, index.table.iloc[positions].reset_index(drop=True)


def evaluate_split(
    model: LoadedEmbedder,
    data: EvalData,
    options: EvaluateOptions,
    *,
    progress: bool,
    skip_hint: str | None = None,
) -> tuple[Evaluation, pd.DataFrame]:
    """Embed the evaluated split (and the gallery, and the cohort), then every metric
    (retrieval searched with `search`, verification also normalised by `score_norm` against
    data.cohort, see compute_metrics), with `options`' batch size, workers (None: data's),
    pairs, seed, search, score_norm (resolved: "none" for none) and cohort_top; returns the
    evaluation and the index rows of its embeddings. ValueError when fewer than 2 files could
    be read."""
    workers = model.data.num_workers if options.num_workers is None else options.num_workers
    common = dict(
        batch_size=options.batch_size, num_workers=workers, progress=progress, skip_hint=skip_hint
    )
    emb, rows = embed_index(model, data.evaluated, description=f"embed {data.split}", **common)
    gallery_emb, gallery_names, cohort_emb, cohort_note = _gallery_and_cohort(
        model, data, rows, common
    )
    if len(rows) < 2:
        raise ValueError(
            f"only {len(rows)} file(s) of the {data.split} split could be read; "
            "evaluation needs at least 2"
        )
    scoring = MetricOptions(
        search=options.search,
        max_pairs=options.max_pairs,
        seed=options.seed,
        score_norm=options.score_norm or "none",
        cohort_top=options.cohort_top,
    )
    evaluation = compute_metrics(
        emb,
        rows["cls"].to_numpy(dtype=object),
        scoring,
        classification=data.classification,
        items=rows["item"].to_numpy(dtype=object),
        gallery_emb=gallery_emb,
        gallery_names=gallery_names,
        cohort_emb=cohort_emb,
        device=model.device,
        progress=progress,
    )
    if cohort_note:
        evaluation.notes.append(cohort_note)
    skipped = len(data.evaluated) - len(rows)
    if skipped:
        evaluation.notes.append(
            f"{skipped} unreadable file(s) of the {data.split} split were "
            "skipped (--skip-bad-files / data.skip_bad_files)"
        )
    if data.missing_classes:
        evaluation.notes.insert(
            0,
            (
                f"open-set split: {len(data.missing_classes)} of {evaluation.setup['n_classes']} "
                "evaluated classes are not in the train split, so kNN and centroid accuracy use a "
                "half/half enrollment split of the evaluated samples (by item) instead of the train "
                "gallery"
            ),
        )
    return evaluation, rows


def _gallery_and_cohort(model: LoadedEmbedder, data: EvalData, rows: pd.DataFrame, common: dict):
    """(gallery embeddings, their classes, cohort embeddings, a note or None) of evaluate_split:
    a train cohort reuses a train gallery's embeddings; the note says when the cohort shares
    classes with the evaluated `rows`."""
    gallery = cohort = (None, None)
    if data.gallery is not None:
        gallery = embed_index(model, data.gallery, description="embed gallery", **common)
    if data.cohort is data.gallery:
        cohort = gallery
    elif data.cohort is not None:
        cohort = embed_index(model, data.cohort, description="embed cohort", **common)
    names = None if gallery[1] is None else gallery[1]["cls"].to_numpy(dtype=object)
    shared = set() if cohort[1] is None else set(cohort[1]["cls"]) & set(rows["cls"])
    note = (
        f"the cohort shares {len(shared)} of the {rows['cls'].nunique()} evaluated classes; "
        "score normalisation expects a cohort of other classes (--cohort SHEET)"
    )
    return gallery[0], names, cohort[0], note if shared else None


# ---------------------------------------------------------------------------------------------
# The report folder and the printed summary


def evaluation_setup(
    checkpoint: Path, model: LoadedEmbedder, data: EvalData, evaluation: Evaluation, *, seconds
) -> dict:
    """report.json's "evaluation" entry: what was evaluated how, where, and in how long."""
    return {
        "checkpoint": str(checkpoint),
        "model": model.description,
        "index": str(data.evaluated.source),
        "split": data.split,
        "gallery": data.gallery_source,
        **({} if data.cohort is None else {"cohort": data.cohort_source}),
        **({} if model.adaptation is None else {"adaptation": model.adaptation}),
        **evaluation.setup,
        "device": str(model.device),
        "seconds": round(seconds, 2),
    }


def search_line(setup: dict) -> str:
    """How the retrieval metrics were searched, in words: method, k, neighbour recall."""
    line = f"{setup['search']} (--search {setup['search_requested']}), k = {setup['search_k']}"
    if "search_neighbour_recall" in setup:
        line += (
            f", neighbour recall {setup['search_neighbour_recall']:.4f} against exact search "
            f"on {setup['search_recall_queries']} queries"
        )
    return line
