"""Verification: same/different-class pairs scored by cosine similarity (EER, minDCF), raw
and, against a cohort, score-normalised (S-norm, AS-norm)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_curve

from audioclf.metrics.checks import _as_embedding_tensor, as_label_array, check_embeddings

# Pairs scored per step in verification_metrics (bounds the gathered [pairs, D] copies).
_PAIR_CHUNK = 65536
# Cohort scores held at once by normalised_scores (rows x cohort size; 64 MB of float64).
_COHORT_BLOCK = 1 << 23


def verification_pairs(labels, *, max_pairs: int = 1_000_000, seed: int = 0):
    """The (first, second, is_target) index pairs that ``verification_metrics`` scores.

    If all N*(N-1)/2 pairs i < j fit in ``max_pairs`` they are all used, in ``np.triu_indices``
    order. Otherwise ``max_pairs // 2`` same-class (target) pairs and the rest different-class
    pairs are drawn, each uniformly over its kind and independently (with replacement), from a
    generator seeded with ``seed``; the same labels and seed give the same pairs. Balancing
    keeps target pairs from vanishing among millions of non-target ones; EER and minDCF are
    computed from per-kind error rates, so the balance does not bias them.
    """
    lab = as_label_array(labels, "labels")
    n_samples = len(lab)
    if not isinstance(max_pairs, int) or max_pairs < 2:
        raise ValueError(f"max_pairs must be an integer >= 2, got {max_pairs!r}")
    _, class_index, class_counts = np.unique(lab, return_inverse=True, return_counts=True)
    n_target_total = int((class_counts * (class_counts - 1) // 2).sum())
    n_all = n_samples * (n_samples - 1) // 2
    if n_target_total == 0 or n_target_total == n_all:
        missing = "same-class" if n_target_total == 0 else "different-class"
        raise ValueError(
            f"verification needs both same-class and different-class pairs, but the labels "
            f"({n_samples} samples, {len(class_counts)} classes) give no {missing} pairs"
        )

    if n_all <= max_pairs:
        first, second = np.triu_indices(n_samples, k=1)
        return first, second, lab[first] == lab[second]

    rng = np.random.default_rng(seed)
    # Samples sorted by class, so each class is one contiguous block of `order`.
    order = np.argsort(class_index, kind="stable")
    block_start = np.concatenate([[0], np.cumsum(class_counts)[:-1]])
    position_in_order = np.empty(n_samples, dtype=np.int64)
    position_in_order[order] = np.arange(n_samples)

    def draw_anchors(weights: np.ndarray, size: int) -> np.ndarray:
        # An anchor drawn with probability proportional to its number of partners, then a
        # uniform partner, gives a uniform draw over ordered (hence unordered) pairs.
        return rng.choice(n_samples, size=size, p=weights / weights.sum())

    n_target = max_pairs // 2
    anchors = draw_anchors((class_counts[class_index] - 1).astype(np.float64), n_target)
    anchor_class = class_index[anchors]
    # A uniform other member of the anchor's class: skip over the anchor's own slot.
    offset = rng.integers(0, class_counts[anchor_class] - 1)
    anchor_offset = position_in_order[anchors] - block_start[anchor_class]
    offset = offset + (offset >= anchor_offset)
    target_partners = order[block_start[anchor_class] + offset]

    n_nontarget = max_pairs - n_target
    others = draw_anchors((n_samples - class_counts[class_index]).astype(np.float64), n_nontarget)
    other_class = class_index[others]
    # A uniform sample outside the anchor's class: skip over the class's block.
    slot = rng.integers(0, n_samples - class_counts[other_class])
    slot = slot + np.where(slot >= block_start[other_class], class_counts[other_class], 0)
    nontarget_partners = order[slot]

    first = np.concatenate([anchors, others])
    second = np.concatenate([target_partners, nontarget_partners])
    is_target = np.concatenate([np.ones(n_target, dtype=bool), np.zeros(n_nontarget, dtype=bool)])
    return first, second, is_target


def verification_metrics(
    embeddings,
    labels,
    *,
    max_pairs: int = 1_000_000,
    seed: int = 0,
    p_target: float = 0.01,
    c_miss: float = 1.0,
    c_fa: float = 1.0,
    cohort=None,
    cohort_top: int | None = None,
) -> dict:
    """Speaker-verification style scores on same/different-class pairs.

    Pairs come from ``verification_pairs``: all pairs i < j when N*(N-1)/2 <= ``max_pairs``,
    else a seeded sample of ``max_pairs`` pairs, half same-class and half different-class.
    Scores are cosine similarities. From ``sklearn.metrics.roc_curve``:

    - ``eer``: the rate where miss (FNR) and false-alarm (FPR) rates are equal, interpolated
      linearly between the two operating points around the crossing; ``eer_threshold`` is the
      score threshold at the first operating point with FNR <= FPR.
    - ``min_dcf``: NIST normalised minimum detection cost,
      min over thresholds of (c_miss * p_target * FNR + c_fa * (1 - p_target) * FPR)
      / min(c_miss * p_target, c_fa * (1 - p_target)).

    Returns ``{"eer", "eer_threshold", "min_dcf", "fpr", "fnr", "n_pairs", "n_target_pairs"}``
    where ``fpr``/``fnr`` are the ROC operating points (for a DET plot). With ``cohort``
    (embeddings [C, D], ideally of other classes) the same pairs are also scored normalised
    (``normalised_scores``: S-norm, or AS-norm over ``cohort_top`` cohort scores a side), and
    ``eer_<m>``, ``min_dcf_<m>``, ``fpr_<m>``, ``fnr_<m>`` are added, m = snorm or asnorm.
    """
    if not 0.0 < p_target < 1.0:
        raise ValueError(f"p_target must be in (0, 1), got {p_target}")
    if c_miss <= 0 or c_fa <= 0:
        raise ValueError(f"c_miss and c_fa must be positive, got c_miss={c_miss}, c_fa={c_fa}")
    emb, lab = check_embeddings(embeddings, labels)
    first, second, is_target = verification_pairs(lab, max_pairs=max_pairs, seed=seed)
    normed = F.normalize(emb, p=2, dim=1)
    costs = (is_target, p_target, c_miss, c_fa)
    result = _detection(_pair_scores(normed, normed, first, second), *costs)
    result.update(n_pairs=int(len(is_target)), n_target_pairs=int(is_target.sum()))
    if cohort is not None:
        method = "snorm" if cohort_top is None else "asnorm"
        scores = normalised_scores(emb, emb, (first, second), cohort, top_n=cohort_top)
        normalised = _detection(scores, *costs)
        result.update(
            {f"{key}_{method}": normalised[key] for key in ("eer", "min_dcf", "fpr", "fnr")}
        )
    return result


# Verification score normalisations: raw cosines, S-norm (the whole cohort), AS-norm (its top N).
SCORE_NORMS = ("none", "snorm", "asnorm")
# AS-norm's cohort scores kept a side: 300 (WeSpeaker's VoxCeleb recipe), or a fifth of a cohort
# smaller than 1,500 clips, so that it still picks the closest part of the cohort.
COHORT_TOP = 300


def asnorm_top(requested: int | None, n_cohort: int) -> int:
    """AS-norm's cohort scores kept a side: `requested` (at most the cohort: then it is S-norm),
    by default COHORT_TOP or a fifth of a smaller cohort, at least 2."""
    if requested is not None:
        return min(requested, n_cohort)
    return max(2, min(COHORT_TOP, n_cohort // 5))


def resolve_score_norm(
    method: str | None, cohort: Any, top: int | None, *, default_cohort: Any = None
) -> tuple[str, Any]:
    """(the normalisation, its cohort) from --score-norm / --cohort / --cohort-top, each
    defaulting from the others: a cohort (or a top N) alone means asnorm; snorm / asnorm alone
    take the caller's `default_cohort` (evaluate: its train split; None: one must be given);
    none of them, raw scores ("none", None). A ValueError for options that do not fit, before
    any work: evaluate, search and the API all resolve them here."""
    method = method or ("asnorm" if cohort is not None or top is not None else "none")
    if method not in SCORE_NORMS:
        raise ValueError(f"--score-norm {method!r}: use one of {', '.join(SCORE_NORMS)}")
    if top is not None and method != "asnorm":
        raise ValueError(f"--cohort-top {top} is AS-norm's; {method} takes no top N")
    if top is not None and top < 2:
        raise ValueError(f"--cohort-top must be >= 2, got {top}")
    if method == "none":
        if cohort is not None:
            raise ValueError(
                f"--cohort {cohort} is unused with --score-norm none; drop one of them"
            )
        return method, None
    cohort = default_cohort if cohort is None else cohort
    if cohort is None:
        raise ValueError(
            f"score normalisation ({method}) needs a cohort: --cohort C, embeddings of other "
            "clips (e.g. the training set's)"
        )
    return method, cohort


def normalised_scores(
    enrol, test, trials, cohort, *, top_n: int | None = None, chunk: int | None = None
) -> np.ndarray:
    """The cosine scores of the ``trials`` (enrol rows, test rows) normalised against a cohort:
    0.5 * ((s - mu_e) / sd_e + (s - mu_t) / sd_t), where mu / sd are the mean and (population)
    standard deviation of one side's scores against every cohort embedding (S-norm, top_n
    None) or against its top_n highest (AS-norm; top_n >= the cohort size is S-norm), all in
    float64: an AS-norm deviation can be small enough to magnify float32 rounding.

    enrol [E, D], test [T, D] and cohort [C, D] embeddings (numpy or torch); ``test`` may be
    ``enrol`` itself (trials inside one set). Each embedding in a trial is scored against the
    cohort once, ``chunk`` embeddings at a time (default: what keeps a block at 2**23 scores),
    so memory never grows with the number of trials. Returns float64 scores [len(trials[0])].
    """
    one_set = test is enrol
    enrol, cohort = (_unit_rows(enrol, "enrol"), _unit_rows(cohort, "cohort"))
    test = enrol if one_set else _unit_rows(test, "test")
    first, second = (np.ascontiguousarray(rows, dtype=np.int64) for rows in trials)
    if top_n is not None and (not isinstance(top_n, int) or top_n < 2):
        raise ValueError(f"top_n must be None (S-norm) or an integer >= 2, got {top_n!r}")
    if len(cohort) < 2 or not torch.isfinite(cohort).all() or cohort.shape[1] != enrol.shape[1]:
        raise ValueError(
            f"cohort needs >= 2 finite rows of dimension {enrol.shape[1]}, got {tuple(cohort.shape)}"
        )
    if first.shape != second.shape or first.ndim != 1 or test.shape[1] != enrol.shape[1]:
        raise ValueError(
            f"trials need 1-D rows of one length ({first.shape}, {second.shape}) into enrol and "
            f"test embeddings of one dimension ({tuple(enrol.shape)}, {tuple(test.shape)})"
        )
    for rows, side, name in ((first, enrol, "enrol"), (second, test, "test")):
        if len(rows) and (rows.min() < 0 or rows.max() >= len(side)):
            raise ValueError(
                f"trial {name} rows must be in [0, {len(side)}), got {rows.min()}..{rows.max()}"
            )
    top = len(cohort) if top_n is None else min(top_n, len(cohort))
    chunk = chunk or max(1, _COHORT_BLOCK // len(cohort))
    if one_set:  # each embedding's statistics once, whichever side of a trial it is on
        mean, std = _cohort_stats(enrol, np.concatenate([first, second]), cohort, top, chunk)
        (mean_e, mean_t), (std_e, std_t) = np.split(mean, 2), np.split(std, 2)
    else:
        mean_e, std_e = _cohort_stats(enrol, first, cohort, top, chunk)
        mean_t, std_t = _cohort_stats(test, second, cohort, top, chunk)
    if not (np.all(std_e > 0) and np.all(std_t > 0)):
        raise ValueError(
            "some trial embeddings have no spread (or NaN) in their cohort scores; use a cohort "
            "of distinct clips, or a larger top_n"
        )
    raw = _pair_scores(enrol, test, first, second)
    return 0.5 * ((raw - mean_e) / std_e + (raw - mean_t) / std_t)


def _unit_rows(embeddings, name: str) -> torch.Tensor:
    return F.normalize(_as_embedding_tensor(embeddings, name).double(), dim=1)


def _cohort_stats(emb: torch.Tensor, rows: np.ndarray, cohort: torch.Tensor, top: int, chunk: int):
    """Mean and population std of the `top` highest cohort scores of each emb[rows], per row
    of `rows`, each distinct row scored once (`chunk` rows at a time)."""
    distinct, inverse = np.unique(rows, return_inverse=True)
    mean, std = np.empty(len(distinct)), np.empty(len(distinct))
    for start in range(0, len(distinct), chunk):
        block = emb[torch.from_numpy(distinct[start : start + chunk])] @ cohort.T
        if top < len(cohort):
            block = block.topk(top, dim=1).values
        mean[start : start + chunk] = block.mean(dim=1).numpy()
        std[start : start + chunk] = block.std(dim=1, correction=0).numpy()
    return mean[inverse], std[inverse]


def _pair_scores(a: torch.Tensor, b: torch.Tensor, first: np.ndarray, second: np.ndarray):
    """Cosine scores of the pairs (a[first], b[second]) of L2-normalised rows, in chunks."""
    first_t, second_t = torch.from_numpy(first), torch.from_numpy(second)
    scores = np.empty(len(first), dtype=np.float64)
    for start in range(0, len(first), _PAIR_CHUNK):
        stop = start + _PAIR_CHUNK
        scores[start:stop] = (a[first_t[start:stop]] * b[second_t[start:stop]]).sum(dim=1).numpy()
    return scores


def _detection(scores, is_target, p_target: float, c_miss: float, c_fa: float) -> dict:
    """EER (with its threshold), minDCF and the ROC operating points of scored pairs."""
    fpr, tpr, thresholds = roc_curve(is_target, scores)
    fnr = 1.0 - tpr
    # roc_curve starts at (FPR 0, FNR 1) with threshold +inf, so the crossing index is >= 1.
    gap = fnr - fpr
    cross = int(np.argmax(gap <= 0))
    before, after = gap[cross - 1], gap[cross]
    weight = before / (before - after) if before != after else 0.0
    eer = fpr[cross - 1] + weight * (fpr[cross] - fpr[cross - 1])

    detection_cost = c_miss * p_target * fnr + c_fa * (1.0 - p_target) * fpr
    default_cost = min(c_miss * p_target, c_fa * (1.0 - p_target))
    return {
        "eer": float(eer),
        "eer_threshold": float(thresholds[cross]),
        "min_dcf": float(detection_cost.min() / default_cost),
        "fpr": fpr,
        "fnr": fnr,
    }
