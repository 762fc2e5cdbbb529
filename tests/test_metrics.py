import numpy as np
import pytest
import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from pytorch_metric_learning.utils.inference import CustomKNN

from audioclf.metrics import (
    centroid_accuracy,
    clustering_metrics,
    knn_accuracy,
    retrieval_metrics,
    verification_metrics,
    verification_pairs,
)


def separated_clusters(n_classes=4, per_class=5, dim=8, seed=0):
    """Tight clusters around orthogonal directions: every metric should be perfect."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(n_classes), per_class)
    embeddings = 5.0 * np.eye(dim)[labels] + 0.01 * rng.normal(size=(len(labels), dim))
    return embeddings.astype(np.float32), labels


def clustered(sizes, dim=16, spread=0.8, seed=0):
    """Overlapping clusters with the given class sizes, in shuffled order."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    centres = rng.normal(size=(len(sizes), dim))
    embeddings = centres[labels] + spread * rng.normal(size=(len(labels), dim))
    return embeddings.astype(np.float32), labels


def on_circle(degrees, scales=None):
    radians = np.deg2rad(np.asarray(degrees, dtype=np.float64))
    points = np.stack([np.cos(radians), np.sin(radians)], axis=1)
    if scales is not None:
        points *= np.asarray(scales)[:, None]  # norms must not matter: cosine similarity
    return points.astype(np.float32)


def pml_retrieval(embeddings, labels, k="max_bin_count"):
    calculator = AccuracyCalculator(
        include=("precision_at_1", "mean_average_precision_at_r", "r_precision"),
        k=k,
        device=torch.device("cpu"),
        knn_func=CustomKNN(CosineSimilarity()),  # PML's default FaissKNN needs faiss
    )
    result = calculator.get_accuracy(embeddings, labels)
    return {
        "precision_at_1": result["precision_at_1"],
        "map_at_r": result["mean_average_precision_at_r"],
        "r_precision": result["r_precision"],
    }


# --------------------------------------------------------------------------------------------
# retrieval_metrics
# --------------------------------------------------------------------------------------------


def test_retrieval_perfect_for_separated_clusters():
    embeddings, labels = separated_clusters()
    result = retrieval_metrics(embeddings, labels, return_per_sample=True)
    assert result["precision_at_1"] == 1.0
    assert result["map_at_r"] == 1.0
    assert result["r_precision"] == 1.0
    assert result["n_queries"] == len(labels)
    assert result["per_sample_correct_at_1"].dtype == np.bool_
    assert result["per_sample_correct_at_1"].all()


def test_retrieval_hand_computed_case():
    # Points on the unit circle (cosine ranks by angular distance), scaled to various norms.
    #   class 0: a0 at 0 deg, a1 at 10, a2 at 55;  class 1: b0 at 25, b1 at 120;
    #   class 2: c0 at 200 (a singleton: no relevant item, left out of every average).
    # Neighbours by angle, R = other members of the class:
    #   a0 (R=2): a1 10 (hit), b0 25, a2 55 ...   P@1 1, top-R hits 1 -> R-prec 1/2, AP@R (1/1)/2 = 1/2
    #   a1 (R=2): a0 10 (hit), b0 15, a2 45 ...   P@1 1, R-prec 1/2, AP@R 1/2
    #   a2 (R=2): b0 30, a1 45 (hit), a0 55 ...   P@1 0, R-prec 1/2, AP@R (1/2)/2 = 1/4
    #   b0 (R=1): a1 15 ...                        0, 0, 0
    #   b1 (R=1): a2 65, c0 80, b0 95 ...           0, 0, 0
    # Means over the 5 non-singleton queries: P@1 2/5, R-precision 1.5/5, MAP@R 1.25/5.
    embeddings = on_circle([0, 10, 55, 25, 120, 200], scales=[1.0, 3.0, 0.5, 2.0, 7.0, 1.5])
    labels = np.array([0, 0, 0, 1, 1, 2])
    result = retrieval_metrics(embeddings, labels, return_per_sample=True)
    assert result["precision_at_1"] == pytest.approx(0.4, abs=1e-12)
    assert result["r_precision"] == pytest.approx(0.3, abs=1e-12)
    assert result["map_at_r"] == pytest.approx(0.25, abs=1e-12)
    assert result["n_queries"] == 5
    np.testing.assert_array_equal(result["per_sample_correct_at_1"], [True, True, False, False, False, False])
    assert pml_retrieval(embeddings, labels) == pytest.approx(
        {"precision_at_1": 0.4, "map_at_r": 0.25, "r_precision": 0.3}, abs=1e-12
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("pml_k", ["max_bin_count", None])
def test_retrieval_matches_pml_accuracy_calculator(seed, pml_k):
    sizes = [1, 2, 3, 7, 12, 1, 25, 5, 9, 40]  # includes singleton classes
    embeddings, labels = clustered(sizes, seed=seed)
    ours = retrieval_metrics(embeddings, labels)
    theirs = pml_retrieval(embeddings, labels, k=pml_k)
    for name, value in theirs.items():
        assert ours[name] == pytest.approx(value, abs=1e-6), name
    assert 0.0 < ours["map_at_r"] < ours["r_precision"] < 1.0  # a non-trivial case


def test_retrieval_accepts_torch_inputs_like_numpy():
    embeddings, labels = clustered([4, 6, 9], seed=3)
    from_numpy = retrieval_metrics(embeddings, labels)
    from_torch = retrieval_metrics(torch.from_numpy(embeddings).double(), torch.from_numpy(labels))
    assert from_torch == pytest.approx(from_numpy, abs=1e-12)
    # Reversed numpy views (negative strides) are fine too.
    assert retrieval_metrics(embeddings[::-1], labels[::-1]) == pytest.approx(from_numpy, abs=1e-12)
    result = knn_accuracy(embeddings[::-1], labels[::-1], embeddings[::-1], labels[::-1])
    assert result["knn_accuracy"] == 1.0  # each query finds itself in the gallery


@pytest.mark.parametrize("chunk_size", [1, 7, 50])
def test_retrieval_chunked_equals_unchunked(chunk_size):
    embeddings, labels = clustered([3, 8, 15, 1, 30, 6], seed=4)
    assert chunk_size < len(labels)
    whole = retrieval_metrics(embeddings, labels, chunk_size=10_000, return_per_sample=True)
    chunked = retrieval_metrics(embeddings, labels, chunk_size=chunk_size, return_per_sample=True)
    np.testing.assert_array_equal(chunked.pop("per_sample_correct_at_1"), whole.pop("per_sample_correct_at_1"))
    assert chunked == pytest.approx(whole, abs=1e-12)


def test_retrieval_all_singletons_is_nan():
    embeddings, _ = clustered([5], seed=0)
    result = retrieval_metrics(embeddings, np.arange(5))
    assert result["n_queries"] == 0
    assert np.isnan(result["precision_at_1"]) and np.isnan(result["map_at_r"])


# --------------------------------------------------------------------------------------------
# knn_accuracy / centroid_accuracy
# --------------------------------------------------------------------------------------------


def test_knn_majority_vote_and_nearest_tie_break():
    gallery = on_circle([0, 5, 10, 90, 95])
    gallery_labels = np.array([0, 1, 1, 2, 2])
    query = on_circle([1, 1, 92, 8])
    # k=3 at 1 deg: neighbours 0 (lab 0), 5 (1), 10 (1) -> majority 1.
    assert knn_accuracy(query[:1], [1], gallery, gallery_labels, k=3)["predictions"].tolist() == [1]
    # k=1 at 1 deg: nearest is label 0.
    assert knn_accuracy(query[:1], [0], gallery, gallery_labels, k=1)["knn_accuracy"] == 1.0
    # k=2 at 8 deg: neighbours 10 (lab 1) then 5 (lab 1) -> 1; at 1 deg: 0 (lab 0), 5 (lab 1) tie -> nearest 0.
    result = knn_accuracy(query, np.array([0, 0, 2, 1]), gallery, gallery_labels, k=2)
    assert result["predictions"].tolist() == [0, 0, 2, 1]
    assert result["knn_accuracy"] == 1.0


def test_knn_query_label_absent_from_gallery_counts_wrong():
    gallery, gallery_labels = separated_clusters(n_classes=2, per_class=3)
    query = gallery[[0, 3]]
    result = knn_accuracy(query, np.array([0, 7]), gallery, gallery_labels, k=1, chunk_size=1)
    assert result["predictions"].tolist() == [0, 1]
    assert result["knn_accuracy"] == 0.5


def test_knn_perfect_on_separated_clusters():
    embeddings, labels = separated_clusters(n_classes=5, per_class=6)
    result = knn_accuracy(embeddings[::2], labels[::2], embeddings[1::2], labels[1::2], k=3)
    assert result["knn_accuracy"] == 1.0
    np.testing.assert_array_equal(result["predictions"], labels[::2])


def test_centroid_accuracy_known_case():
    # Class 0 around 0 deg (centroid 0), class 1 at 80 and 100 deg (centroid 90).
    gallery = on_circle([-10, 10, 80, 100], scales=[1, 5, 2, 1])
    gallery_labels = np.array([0, 0, 1, 1])
    # 40 deg is nearer centroid 0 (true 0, correct); 50 deg nearer 90 (true 0, wrong); 170 -> 1.
    query = on_circle([40, 50, 170])
    result = centroid_accuracy(query, np.array([0, 0, 1]), gallery, gallery_labels)
    assert result["predictions"].tolist() == [0, 1, 1]
    assert result["centroid_accuracy"] == pytest.approx(2 / 3)


def test_centroid_uses_normalised_members():
    # An unnormalised mean would be dragged to 80 deg by the long vector; normalised mean is 45.
    gallery = on_circle([10, 80], scales=[1.0, 100.0])
    query = on_circle([40, 190])
    result = centroid_accuracy(query, [0, 1], np.concatenate([gallery, on_circle([180])]), [0, 0, 1])
    assert result["predictions"].tolist() == [0, 1]


# --------------------------------------------------------------------------------------------
# verification_metrics
# --------------------------------------------------------------------------------------------


def test_verification_separable_has_zero_eer():
    embeddings, labels = separated_clusters(n_classes=4, per_class=6)
    result = verification_metrics(embeddings, labels)
    n = len(labels)
    assert result["n_pairs"] == n * (n - 1) // 2
    assert result["n_target_pairs"] == 4 * (6 * 5 // 2)
    assert result["eer"] == 0.0
    assert result["min_dcf"] == 0.0
    assert 0.0 < result["eer_threshold"] <= 1.0


def test_verification_random_embeddings_eer_near_half():
    rng = np.random.default_rng(0)
    embeddings = rng.normal(size=(400, 32))
    labels = rng.integers(0, 10, size=400)
    result = verification_metrics(embeddings, labels, max_pairs=40_000, seed=1)
    assert 0.4 < result["eer"] < 0.6
    assert result["n_pairs"] == 40_000 and result["n_target_pairs"] == 20_000
    assert result["min_dcf"] > 0.9  # a useless system costs about as much as always rejecting
    fpr, fnr = result["fpr"], result["fnr"]
    assert fpr.shape == fnr.shape and np.all(np.diff(fpr) >= 0) and np.all(np.diff(fnr) <= 0)


def test_verification_hand_computed_eer_and_min_dcf():
    # Class 0: p at 0 deg, q at 60; class 1: r at 100. All 3 pairs, cosine scores:
    #   q-r cos 40 = 0.77 (non-target), p-q cos 60 = 0.5 (target), p-r cos 100 = -0.17 (non-target).
    # Operating points (FPR, FNR) as the threshold drops: (0, 1), (1/2, 1), (1/2, 0), (1, 0).
    # FNR - FPR goes 1, 1/2, -1/2: the crossing lies on the vertical step at FPR 1/2 -> EER 1/2,
    # reached at threshold 0.5 (the target's score).
    # minDCF with p_target 1/2: min over points of (FNR + FPR) = 1/2 at (1/2, 0).
    # minDCF with p_target 0.01: min of (FNR + 99 FPR) = 1 at (0, 1), i.e. reject everything.
    embeddings = on_circle([0, 60, 100])
    labels = np.array([0, 0, 1])
    result = verification_metrics(embeddings, labels, p_target=0.5)
    assert result["eer"] == pytest.approx(0.5)
    assert result["eer_threshold"] == pytest.approx(0.5, abs=1e-6)
    assert result["min_dcf"] == pytest.approx(0.5)
    assert result["n_pairs"] == 3 and result["n_target_pairs"] == 1
    assert verification_metrics(embeddings, labels, p_target=0.01)["min_dcf"] == pytest.approx(1.0)


def test_verification_pairs_deterministic_for_a_seed_and_balanced():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 50, size=600)
    labels[:3] = [1000, 1001, 1002]  # singletons: never in a target pair
    first, second, is_target = verification_pairs(labels, max_pairs=5001, seed=7)
    again = verification_pairs(labels, max_pairs=5001, seed=7)
    other = verification_pairs(labels, max_pairs=5001, seed=8)
    for mine, repeat in zip((first, second, is_target), again, strict=True):
        np.testing.assert_array_equal(mine, repeat)
    assert not np.array_equal(first, other[0])
    assert len(first) == 5001 and is_target.sum() == 2500
    assert np.all(first != second)
    np.testing.assert_array_equal(labels[first] == labels[second], is_target)
    assert not np.isin(np.concatenate([first[is_target], second[is_target]]), [0, 1, 2]).any()


def test_verification_all_pairs_when_they_fit():
    labels = np.array([0, 0, 1, 1, 2])
    first, second, is_target = verification_pairs(labels, max_pairs=10)
    assert len(first) == 10 and is_target.sum() == 2
    assert np.all(first < second)


# --------------------------------------------------------------------------------------------
# clustering_metrics
# --------------------------------------------------------------------------------------------


def test_clustering_perfect_for_separated_clusters():
    embeddings, labels = separated_clusters(n_classes=5, per_class=8)
    result = clustering_metrics(embeddings, labels, seed=0)
    assert result["nmi"] == pytest.approx(1.0)
    assert result["ami"] == pytest.approx(1.0)


def test_clustering_random_labels_score_low():
    rng = np.random.default_rng(0)
    embeddings = rng.normal(size=(300, 8))
    result = clustering_metrics(embeddings, rng.integers(0, 5, size=300), seed=0)
    assert result["ami"] < 0.1


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------


def test_error_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(5, 3\).*\(4,\)"):
        retrieval_metrics(np.zeros((5, 3)), np.zeros(4, dtype=int))


def test_error_fewer_than_two_samples():
    with pytest.raises(ValueError, match="1 samples; at least 2"):
        retrieval_metrics(np.ones((1, 3)), [0])
    with pytest.raises(ValueError, match="at least 2"):
        verification_metrics(np.ones((1, 3)), [0])


def test_error_non_finite_embeddings_counts_rows():
    embeddings, labels = separated_clusters()
    embeddings[[2, 7]] = np.nan
    embeddings[7, 0] = np.inf
    with pytest.raises(ValueError, match=r"non-finite .* in 2 of 20 rows .*\[2, 7\]"):
        clustering_metrics(embeddings, labels)


def test_error_non_integer_labels_and_wrong_ndim():
    with pytest.raises(ValueError, match="integer"):
        retrieval_metrics(np.ones((3, 2)), np.array([0.0, 1.0, 0.5]))
    with pytest.raises(ValueError, match="2-D"):
        retrieval_metrics(np.ones(3), [0, 1, 0])


def test_error_empty_gallery():
    with pytest.raises(ValueError, match="gallery is empty"):
        knn_accuracy(np.ones((2, 3)), [0, 1], np.empty((0, 3)), np.empty(0, dtype=int))
    with pytest.raises(ValueError, match="gallery is empty"):
        centroid_accuracy(np.ones((2, 3)), [0, 1], np.empty((0, 3)), [])


def test_error_gallery_dimension_and_k():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        knn_accuracy(np.ones((2, 3)), [0, 1], np.ones((2, 4)), [0, 1])
    with pytest.raises(ValueError, match="gallery size = 2"):
        knn_accuracy(np.ones((2, 3)), [0, 1], np.ones((2, 3)), [0, 1], k=3)


def test_error_verification_needs_both_pair_kinds():
    with pytest.raises(ValueError, match="no same-class pairs"):
        verification_metrics(np.eye(4), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="no different-class pairs"):
        verification_metrics(np.eye(4), [5, 5, 5, 5])
    with pytest.raises(ValueError, match="p_target"):
        verification_metrics(np.eye(4), [0, 0, 1, 1], p_target=1.0)


def test_error_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        retrieval_metrics(np.eye(4), [0, 0, 1, 1], chunk_size=0)
