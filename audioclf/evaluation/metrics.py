"""Every metric of one evaluated set: retrieval (cross-item and leave-one-out), kNN and
nearest-centroid classification against a gallery or a half/half enrollment split, verification
(raw, and S-norm / AS-norm against a cohort) and clustering (see
`python -m audioclf.evaluate --help`).

    evaluation = compute_metrics(emb, names, MetricOptions(search="exact"), classification="gallery",
                                 items=items, gallery_emb=gallery_emb, gallery_names=gallery_names)

Retrieval is scored by audioclf.metrics.retrieval_metrics from the neighbour lists of the
audioclf.search index chosen by `options.search`: exact (on the evaluation's device, so on the GPU
under CUDA; the default) or, on request, approximate (faiss IVF / HNSW), whose neighbour recall
and metric bias against exact search on a seeded sample the setup and notes record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from audioclf.metrics import (
    RETRIEVAL_KEYS,
    SCORE_NORMS,
    asnorm_top,
    centroid_accuracy,
    clustering_metrics,
    knn_accuracy,
    relevance,
    retrieval_metrics,
    verification_metrics,
)
from audioclf.search import build, faiss_available, sampled_neighbour_recall

CLASSIFICATIONS = ("gallery", "enrollment", "none")
SEARCH_METHODS = ("auto", "exact", "ivf", "hnsw")
# Queries of the seeded sample on which an approximate search is scored against exact search.
BIAS_QUERIES = 1000


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


@dataclass(frozen=True)
class MetricOptions:
    """How `compute_metrics` scores: evaluate's --search, --max-pairs, --seed, --score-norm
    (resolved) and --cohort-top."""

    search: str = "auto"  # how retrieval finds neighbours: one of SEARCH_METHODS (resolve_search)
    max_pairs: int = 1_000_000  # verification pairs scored at most
    seed: int = 0  # of the pairs, k-means, the enrollment split and the search's sample
    score_norm: str = "none"  # snorm / asnorm: verification also normalised against a cohort
    cohort_top: int | None = None  # asnorm's cohort scores per side (asnorm_top)


def compute_metrics(
    emb: np.ndarray,
    names: np.ndarray,
    options: MetricOptions | None = None,
    *,
    classification: str = "none",
    items: np.ndarray | None = None,
    gallery_emb: np.ndarray | None = None,
    gallery_names: np.ndarray | None = None,
    cohort_emb: np.ndarray | None = None,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> Evaluation:
    """Every metric of one evaluated set (embeddings and class name per row), scored as
    `options` say (default MetricOptions()).

    classification: "gallery" (against gallery_emb / gallery_names, which hold every evaluated
    class), "enrollment" (half/half split of the set by `items`), or "none".
    options.search: how retrieval finds each query's neighbours, one of SEARCH_METHODS (see
    resolve_search); the setup records the method, the list depth k and, for approximate
    search, the neighbour recall against exact search on 1,000 seeded queries.
    options.score_norm: "snorm" or "asnorm" scores the verification pairs against `cohort_emb`
    too (see asnorm_top for `options.cohort_top`); "none" (the default) only raw.
    """
    options = options or MetricOptions()
    search, seed = options.search, options.seed
    if classification not in CLASSIFICATIONS:
        raise ValueError(f"classification={classification!r}: use gallery, enrollment or none")
    gallery_list = gallery_names.tolist() if classification == "gallery" else []
    class_names = sorted(set(names.tolist()) | set(gallery_list))
    code = {name: i for i, name in enumerate(class_names)}
    labels = np.array([code[n] for n in names.tolist()], dtype=np.int64)
    n_classes = len(set(names.tolist()))
    evaluation = Evaluation(
        {}, emb, labels, class_names, None, None, {"n_samples": len(labels), "n_classes": n_classes}
    )
    # the score norm and its cohort are checked first, before any work
    norm = _score_norm(evaluation.setup, options.score_norm, cohort_emb, options.cohort_top)
    evaluation.results = _retrieval(evaluation, items, device, search, seed, progress)
    if classification == "gallery":
        sets = _gallery_sets(evaluation, names, gallery_emb, gallery_list, code)
    elif classification == "enrollment":
        sets = _enrollment_sets(evaluation, names, items, seed)
    else:
        evaluation.setup["classification"] = "none"
        sets = None
    if sets is not None:
        _classify(evaluation, *sets, per_sample=classification == "gallery", device=device)
    _verification_and_clustering(evaluation, n_classes, options.max_pairs, seed, norm)
    return evaluation


def _score_norm(setup: dict, score_norm: str, cohort_emb, cohort_top: int | None) -> dict:
    """verification_metrics' cohort arguments for `score_norm`, recorded in the setup."""
    if score_norm not in SCORE_NORMS or (score_norm != "none") != (cohort_emb is not None):
        raise ValueError(f"score_norm={score_norm!r}: use none, or snorm / asnorm with cohort_emb")
    if score_norm == "none":
        return {}
    top = None if score_norm == "snorm" else asnorm_top(cohort_top, len(cohort_emb))
    setup.update(score_norm=score_norm, n_cohort=len(cohort_emb))
    setup.update({} if top is None else {"cohort_top": top})
    return {"cohort": cohort_emb, "cohort_top": top}


def check_search(search: str) -> None:
    """ValueError for an unknown method, or an approximate one without faiss, before any work."""
    if search not in SEARCH_METHODS:
        raise ValueError(f"--search {search!r}: use one of {', '.join(SEARCH_METHODS)}")
    if search not in ("auto", "exact") and not faiss_available():
        raise ValueError(
            f"--search {search} needs faiss, which is not installed: pip install faiss-cpu "
            "(or faiss-gpu), or use --search exact"
        )


def resolve_search(search: str) -> str:
    """The method retrieval uses. "auto" (the default) is exact at every size and on every
    device: the approximate methods flatter MAP@R (IVF +0.03, HNSW +0.05 at 100k,
    benchmarks/search.py), so they are used only on request, their bias against exact measured
    and noted (`_approximate_bias`)."""
    check_search(search)
    return "exact" if search == "auto" else search


def _retrieval(
    evaluation: Evaluation, items: np.ndarray | None, device, search: str, seed: int, progress
) -> dict:
    """Cross-item retrieval with items (leave-one-out without), plus the loo_* figures, from
    the neighbour lists of one search index over the embeddings, handed to the scorer."""
    emb, labels, notes = evaluation.embeddings, evaluation.labels, evaluation.notes
    method = resolve_search(search)
    index = build(emb, method, device=device, progress=progress, seed=seed)
    common = dict(index=index, progress=progress, return_per_sample=True)
    leave_one_out = retrieval_metrics(emb, labels, **common)
    results = leave_one_out
    if items is not None:
        results = retrieval_metrics(emb, labels, items=items, **common)
        _note_cross_item(evaluation, results)
    if leave_one_out["n_queries"] == 0:
        notes.append("every class has a single sample: retrieval metrics are undefined")
    setup = evaluation.setup
    setup["search"], setup["search_requested"] = method, search
    setup["search_k"] = relevance(labels, items).depth()
    if method != "exact" and results["n_queries"]:
        recall, queries = sampled_neighbour_recall(
            index, emb, labels, items=items, seed=seed, device=device
        )
        setup["search_neighbour_recall"] = round(recall, 4)
        setup["search_recall_queries"] = queries
        _approximate_bias(evaluation, index, items, method, seed, device)
    return {
        **{k: v for k, v in results.items() if k != "n_queries_without_other_item"},
        **{f"loo_{k}": leave_one_out[k] for k in RETRIEVAL_KEYS},
    }


def _approximate_bias(evaluation: Evaluation, index, items, method: str, seed: int, device):
    """Score BIAS_QUERIES seeded queries with `index` and with exact search; the differences
    go into the setup (search_bias) and a note beside the figures."""
    emb, labels = evaluation.embeddings, evaluation.labels
    rows = np.random.default_rng(seed).permutation(len(labels))[:BIAS_QUERIES]
    rows = np.sort(rows)
    approximate = retrieval_metrics(emb, labels, items=items, index=index, query_rows=rows)
    exact = retrieval_metrics(emb, labels, items=items, query_rows=rows, device=device)
    bias = {key: round(float(approximate[key] - exact[key]), 4) for key in RETRIEVAL_KEYS}
    evaluation.setup["search_bias"] = {**bias, "queries": len(rows)}
    shown = ", ".join(f"{key} {value:+.4f}" for key, value in bias.items())
    evaluation.notes.append(
        f"--search {method} is approximate: on {len(rows)} seeded queries its figures minus "
        f"exact search's are {shown}; --search exact (the default) gives the exact figures"
    )


def _note_cross_item(evaluation: Evaluation, results: dict) -> None:
    """The setup and notes that say what cross-item retrieval scored and left out."""
    evaluation.setup["retrieval"] = (
        "cross-item: a query never retrieves clips of its own item "
        "(recording); R counts the other items' clips of its class"
    )
    evaluation.setup["n_retrieval_queries"] = results["n_queries"]
    if results["n_queries_without_other_item"]:
        evaluation.notes.append(
            f"{results['n_queries_without_other_item']} sample(s) have no clip of "
            "another item in their class: left out of the cross-item metrics"
        )
    if results["n_queries"] == 0:
        evaluation.notes.append(
            "no class has clips of two items: cross-item retrieval is undefined "
            "(the loo_* figures are leave-one-out)"
        )


def _gallery_sets(
    evaluation: Evaluation,
    names: np.ndarray,
    gallery_emb: np.ndarray,
    gallery_list: list,
    code: dict,
) -> tuple[tuple, tuple]:
    """(queries, gallery) of a closed-set classification: every evaluated sample queries."""
    missing = sorted(set(names.tolist()) - set(gallery_list))
    if missing:  # only when data.skip_bad_files dropped a class's every gallery file
        raise ValueError(
            f"no gallery file of class(es) {', '.join(map(repr, missing[:5]))} "
            "could be read; fix the files or use --gallery none"
        )
    g_labels = np.array([code[n] for n in gallery_list], dtype=np.int64)
    evaluation.setup["classification"] = "closed set: every evaluated sample against the gallery"
    evaluation.setup["n_gallery_samples"] = len(g_labels)
    return (evaluation.embeddings, evaluation.labels), (gallery_emb, g_labels)


def _enrollment_sets(
    evaluation: Evaluation, names: np.ndarray, items: np.ndarray | None, seed: int
) -> tuple[tuple, tuple] | None:
    """(queries, gallery) of a half/half enrollment split of the set by item; None when no
    class has two samples."""
    if items is None:
        raise ValueError("an enrollment split needs the item of every evaluated row")
    emb, labels = evaluation.embeddings, evaluation.labels
    enroll = enrollment_split(names, items, seed)
    query = ~enroll & np.isin(names, list(set(names[enroll].tolist())))
    evaluation.setup["classification"] = (
        "enrollment: in each evaluated class half of the items enroll, the other half query"
    )
    evaluation.setup["n_enrollment_samples"] = int(enroll.sum())
    left_out = int((~enroll & ~query).sum())
    if left_out:
        evaluation.notes.append(
            f"{left_out} sample(s) of single-sample classes are left out of "
            "classification (nothing to enroll them with)"
        )
    if not query.any():
        evaluation.notes.append("no class has two samples: classification metrics skipped")
        return None
    return (emb[query], labels[query]), (emb[enroll], labels[enroll])


def _classify(
    evaluation: Evaluation, queries: tuple, gallery: tuple, *, per_sample: bool, device
) -> None:
    """kNN and nearest-centroid accuracy; with one query per evaluated sample (per_sample),
    the kNN predictions too (a confusion plot)."""
    knn = knn_accuracy(*queries, *gallery, k=1, device=device)
    evaluation.results["knn_accuracy"] = knn["knn_accuracy"]
    evaluation.results["centroid_accuracy"] = centroid_accuracy(*queries, *gallery)[
        "centroid_accuracy"
    ]
    evaluation.setup["n_classification_queries"] = len(queries[1])
    if per_sample:
        evaluation.knn_predictions = knn["predictions"]


def _verification_and_clustering(
    evaluation: Evaluation, n_classes: int, max_pairs: int, seed: int, norm: dict
) -> None:
    emb, labels = evaluation.embeddings, evaluation.labels
    _verification(evaluation, emb, labels, max_pairs=max_pairs, seed=seed, norm=norm)
    if n_classes >= 2:
        evaluation.results.update(clustering_metrics(emb, labels, seed=seed))
    else:
        evaluation.notes.append("a single class: clustering metrics skipped")


def _verification(evaluation: Evaluation, emb, labels, *, max_pairs, seed, norm: dict) -> None:
    """The verification figures, raw and normalised against `norm`'s cohort. A cohort that
    cannot normalise (no spread: copies of one clip) keeps the raw EER / minDCF; the report's
    setup says why the normalised ones are not there (score_norm_skipped), and a note too."""
    try:
        evaluation.verification = verification_metrics(
            emb, labels, max_pairs=max_pairs, seed=seed, **norm
        )
        return
    except ValueError as exc:
        reason = str(exc)
    try:
        if not norm:
            raise ValueError(reason)
        evaluation.verification = verification_metrics(emb, labels, max_pairs=max_pairs, seed=seed)
    except ValueError as exc:  # the raw figures fail alike: nothing to keep
        evaluation.notes.append(f"verification skipped: {exc}")
        return
    evaluation.setup["score_norm_skipped"] = reason
    evaluation.notes.append(
        f"score normalisation ({evaluation.setup['score_norm']}) skipped: {reason}; the raw EER "
        "and minDCF are kept"
    )


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
