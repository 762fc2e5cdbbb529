"""Score normalisation of verification trials (S-norm, AS-norm) against a cohort: the vectorised
`normalised_scores` against a loop over trials, its chunking, its input checks, and the
normalised figures of `verification_metrics`."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from audioclf.metrics import normalised_scores, verification_metrics, verification_pairs

# Both in float64 from the same float32 embeddings: only the order of the sums differs.
TOLERANCE = 1e-9


def data(seed: int = 0, n_enrol: int = 7, n_test: int = 9, n_cohort: int = 20, dim: int = 8):
    rng = np.random.default_rng(seed)
    enrol, test, cohort = (
        rng.normal(size=(n, dim)).astype(np.float32) for n in (n_enrol, n_test, n_cohort)
    )
    trials = (rng.integers(0, n_enrol, 40), rng.integers(0, n_test, 40))
    return enrol, test, trials, cohort


def loop_reference(enrol, test, trials, cohort, top_n):
    """The definition, one trial at a time: 0.5 * ((s - mu_e) / sd_e + (s - mu_t) / sd_t)."""

    def unit(vector):
        vector = vector.astype(np.float64)
        return vector / np.linalg.norm(vector)

    scores = []
    for e, t in zip(*trials, strict=True):
        sides = [unit(enrol[e]), unit(test[t])]
        score = float(sides[0] @ sides[1])
        normalised = 0.0
        for side in sides:
            against = sorted((float(side @ unit(c)) for c in cohort), reverse=True)
            kept = against if top_n is None else against[:top_n]
            normalised += (score - statistics.fmean(kept)) / statistics.pstdev(kept)
        scores.append(0.5 * normalised)
    return np.array(scores)


@pytest.mark.parametrize("top_n", [None, 3, 5, 19, 20, 50])
def test_snorm_and_asnorm_equal_a_loop_over_trials(top_n):
    enrol, test, trials, cohort = data()
    np.testing.assert_allclose(
        normalised_scores(enrol, test, trials, cohort, top_n=top_n),
        loop_reference(enrol, test, trials, cohort, top_n),
        rtol=0,
        atol=TOLERANCE,
    )


def test_a_top_n_of_the_whole_cohort_is_snorm_and_a_smaller_one_is_not():
    enrol, test, trials, cohort = data(seed=1)
    snorm = normalised_scores(enrol, test, trials, cohort)
    for top_n in (20, 21, 1000):
        np.testing.assert_array_equal(
            normalised_scores(enrol, test, trials, cohort, top_n=top_n), snorm
        )
    assert np.abs(normalised_scores(enrol, test, trials, cohort, top_n=5) - snorm).max() > 0.1


@pytest.mark.parametrize("top_n", [None, 4])
def test_chunks_give_the_unchunked_scores(top_n):
    enrol, test, trials, cohort = data(seed=2, n_enrol=30, n_test=30)
    whole = normalised_scores(enrol, test, trials, cohort, top_n=top_n, chunk=10_000)
    for chunk in (1, 2, 7):
        chunked = normalised_scores(enrol, test, trials, cohort, top_n=top_n, chunk=chunk)
        # A matrix product of another height may sum in another order: float64 rounding only.
        np.testing.assert_allclose(chunked, whole, rtol=1e-12, atol=0)


def test_trials_inside_one_set_score_as_two_copies_of_it():
    enrol, _, (first, second), cohort = data(seed=3)
    second = second % len(enrol)
    one_set = normalised_scores(enrol, enrol, (first, second), cohort, top_n=5)
    copies = normalised_scores(enrol, enrol.copy(), (first, second), cohort, top_n=5)
    np.testing.assert_allclose(one_set, copies, rtol=1e-12, atol=0)
    from_torch = normalised_scores(torch.from_numpy(enrol), enrol, (first, second), cohort, top_n=5)
    np.testing.assert_array_equal(from_torch, one_set)


def test_a_million_trials_against_ten_thousand_cohort_clips_stay_small():
    # A trials x cohort matrix would be 10**10 floats (40 GB): each embedding is scored once.
    rng = np.random.default_rng(4)
    emb = rng.normal(size=(50, 4)).astype(np.float32)
    cohort = rng.normal(size=(10_000, 4)).astype(np.float32)
    trials = (rng.integers(0, 50, 1_000_000), rng.integers(0, 50, 1_000_000))
    scores = normalised_scores(emb, emb, trials, cohort, top_n=300)
    assert scores.shape == (1_000_000,) and np.isfinite(scores).all()
    few = normalised_scores(emb, emb, (trials[0][:100], trials[1][:100]), cohort, top_n=300)
    np.testing.assert_allclose(scores[:100], few, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "case, message",
    [
        ("top_n of 1", "top_n must be None (S-norm) or an integer >= 2"),
        ("cohort of one", "cohort needs >= 2 finite rows of dimension 8, got (1, 8)"),
        ("cohort of another dimension", "cohort needs >= 2 finite rows of dimension 8"),
        ("NaN in the cohort", "cohort needs >= 2 finite rows"),
        ("test of another dimension", "into enrol and test embeddings of one dimension"),
        ("rows of two lengths", "trials need 1-D rows of one length"),
        ("row out of range", "trial test rows must be in [0, 9), got 0..9"),
        ("cohort all alike", "no spread (or NaN) in their cohort scores"),
    ],
)
def test_bad_input_is_one_clear_error(case, message):
    enrol, test, (first, second), cohort = data()
    top_n = 1 if case == "top_n of 1" else None
    if case == "cohort of one":
        cohort = cohort[:1]
    elif case == "cohort of another dimension":
        cohort = cohort[:, :4]
    elif case == "NaN in the cohort":
        cohort[3, 0] = np.nan
    elif case == "test of another dimension":
        test = test[:, :4]
    elif case == "rows of two lengths":
        second = second[:-1]
    elif case == "row out of range":
        second = np.concatenate([second, [9]])
        first = np.concatenate([first, [0]])
    elif case == "cohort all alike":
        cohort = np.ones_like(cohort)
    with pytest.raises(ValueError) as info:
        normalised_scores(enrol, test, (first, second), cohort, top_n=top_n)
    assert message in str(info.value)


def test_verification_metrics_add_the_normalised_figures_and_keep_the_raw_ones():
    rng = np.random.default_rng(5)
    labels = np.repeat(np.arange(6), 5)
    emb = rng.normal(size=(6, 16))[labels] + 0.8 * rng.normal(size=(30, 16))
    cohort = rng.normal(size=(40, 16))
    raw = verification_metrics(emb, labels)
    asnorm = verification_metrics(emb, labels, cohort=cohort, cohort_top=10)
    snorm = verification_metrics(emb, labels, cohort=cohort)
    for key, value in raw.items():
        np.testing.assert_array_equal(asnorm[key], value, err_msg=key)
    assert set(asnorm) - set(raw) == {"eer_asnorm", "min_dcf_asnorm", "fpr_asnorm", "fnr_asnorm"}
    assert set(snorm) - set(raw) == {"eer_snorm", "min_dcf_snorm", "fpr_snorm", "fnr_snorm"}
    first, second, is_target = verification_pairs(labels)
    scores = normalised_scores(emb, emb, (first, second), cohort, top_n=10)
    # The normalised EER is the raw one's computation on these scores: near the threshold
    # where the larger of miss and false-alarm rates is smallest (within one target pair).
    target, other = scores[is_target], scores[~is_target]
    worse = [max(np.mean(target < t), np.mean(other >= t)) for t in np.sort(scores)]
    assert abs(asnorm["eer_asnorm"] - min(worse)) <= 1 / len(target)
    assert asnorm["eer_asnorm"] != raw["eer"]
