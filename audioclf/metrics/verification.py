"""Verification: same/different-class pairs scored by cosine similarity (EER, minDCF)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_curve

from audioclf.metrics.checks import as_label_array, check_embeddings

# Pairs scored per step in verification_metrics (bounds the gathered [pairs, D] copies).
_PAIR_CHUNK = 65536


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
    where ``fpr``/``fnr`` are the ROC operating points (for a DET plot).
    """
    if not 0.0 < p_target < 1.0:
        raise ValueError(f"p_target must be in (0, 1), got {p_target}")
    if c_miss <= 0 or c_fa <= 0:
        raise ValueError(f"c_miss and c_fa must be positive, got c_miss={c_miss}, c_fa={c_fa}")
    emb, lab = check_embeddings(embeddings, labels)
    first, second, is_target = verification_pairs(lab, max_pairs=max_pairs, seed=seed)

    normed = F.normalize(emb, p=2, dim=1)
    first_t, second_t = torch.from_numpy(first), torch.from_numpy(second)
    scores = np.empty(len(first), dtype=np.float64)
    for start in range(0, len(first), _PAIR_CHUNK):
        stop = start + _PAIR_CHUNK
        pair_scores = (normed[first_t[start:stop]] * normed[second_t[start:stop]]).sum(dim=1)
        scores[start:stop] = pair_scores.numpy()

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
        "n_pairs": int(len(is_target)),
        "n_target_pairs": int(is_target.sum()),
    }
