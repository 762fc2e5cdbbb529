import numpy as np
import pytest
import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from pytorch_metric_learning.utils.inference import CustomKNN

from audioclf.metrics import (
    centroid_accuracy,
    class_centroids,
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


def test_retrieval_searches_in_ieee_fp32_whatever_the_process_left_on(monkeypatch):
    # A training in the process turns TF32 on (configure_backends); validation's retrieval,
    # which picks best.pt, must rank as evaluate's does. On a CPU the flags are plain
    # attributes: what the search saw is what a GPU's matmul would use.
    from audioclf.metrics.retrieval import ExactSearch
    from audioclf.precision import EXACT, BackendFlags

    seen, search = [], ExactSearch.search

    def spy(self, *args, **kwargs):
        seen.append(BackendFlags.current())
        return search(self, *args, **kwargs)

    monkeypatch.setattr(ExactSearch, "search", spy)
    saved = BackendFlags.current()
    try:
        BackendFlags(True, True, True).apply()
        embeddings, labels = separated_clusters()
        assert retrieval_metrics(embeddings, labels)["precision_at_1"] == 1.0
        after = BackendFlags.current()
    finally:
        saved.apply()
    assert seen and set(seen) == {EXACT}
    assert after == BackendFlags(True, True, True)  # put back after


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
    np.testing.assert_array_equal(
        result["per_sample_correct_at_1"], [True, True, False, False, False, False]
    )
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
    np.testing.assert_array_equal(
        chunked.pop("per_sample_correct_at_1"), whole.pop("per_sample_correct_at_1")
    )
    assert chunked == pytest.approx(whole, abs=1e-12)


def test_retrieval_all_singletons_is_nan():
    embeddings, _ = clustered([5], seed=0)
    result = retrieval_metrics(embeddings, np.arange(5))
    assert result["n_queries"] == 0
    assert np.isnan(result["precision_at_1"]) and np.isnan(result["map_at_r"])


# --------------------------------------------------------------------------------------------
# retrieval_metrics with items (cross-item retrieval)
# --------------------------------------------------------------------------------------------


def clustered_items(items_per_class, clips_per_item=(1, 5), dim=12, seed=0):
    """Classes made of items (class centre + item offset + clip noise), in shuffled order.

    Item ids restart at 0 in every class, so equal ids under different classes must still be
    told apart. The item offset is as large as the class spread: an item's own clips are the
    easy neighbours that cross-item retrieval has to do without.
    """
    rng = np.random.default_rng(seed)
    labels, items, points = [], [], []
    for cls, n_items in enumerate(items_per_class):
        centre = rng.normal(size=dim)
        for item in range(n_items):
            item_centre = centre + 0.8 * rng.normal(size=dim)
            n_clips = int(rng.integers(clips_per_item[0], clips_per_item[1] + 1))
            points.append(item_centre + 0.4 * rng.normal(size=(n_clips, dim)))
            labels += [cls] * n_clips
            items += [item] * n_clips
    order = rng.permutation(len(labels))
    embeddings = np.concatenate(points)[order].astype(np.float32)
    return embeddings, np.array(labels)[order], np.array(items)[order]


def brute_force_cross_item(embeddings, labels, items):
    """Plain O(N^2) reference: per query, rank every sample of another (class, item) pair."""
    normed = embeddings.astype(np.float64)
    normed /= np.linalg.norm(normed, axis=1, keepdims=True)
    similarity = normed @ normed.T
    correct, average_precision, r_precision = [], [], []
    per_sample = np.zeros(len(labels), dtype=bool)
    for query in range(len(labels)):
        own_item = (labels == labels[query]) & (items == items[query])
        candidates = np.flatnonzero(~own_item)
        relevant = int((labels[candidates] == labels[query]).sum())
        if relevant == 0:
            continue
        ranked = candidates[np.argsort(-similarity[query, candidates], kind="stable")]
        hits = labels[ranked[:relevant]] == labels[query]
        precision_at_i = np.cumsum(hits) / np.arange(1, relevant + 1)
        per_sample[query] = hits[0]
        correct.append(float(hits[0]))
        r_precision.append(hits.sum() / relevant)
        average_precision.append((precision_at_i * hits).sum() / relevant)
    return {
        "precision_at_1": float(np.mean(correct)) if correct else float("nan"),
        "map_at_r": float(np.mean(average_precision)) if correct else float("nan"),
        "r_precision": float(np.mean(r_precision)) if correct else float("nan"),
        "n_queries": len(correct),
        "n_queries_without_other_item": len(labels) - len(correct),
    }, per_sample


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cross_item_matches_brute_force(seed):
    # Classes with 1 item (left out), 2 items and up to 6 items of 1-5 clips each.
    embeddings, labels, items = clustered_items([1, 2, 3, 6, 4, 2, 1, 5, 3], seed=seed)
    n_samples = len(labels)
    uneven = next(size for size in range(7, n_samples) if n_samples % size)  # last chunk shorter
    expected, expected_per_sample = brute_force_cross_item(embeddings, labels, items)
    for chunk_size in (1, uneven, n_samples + 5):
        result = retrieval_metrics(
            embeddings, labels, items=items, chunk_size=chunk_size, return_per_sample=True
        )
        np.testing.assert_array_equal(result.pop("per_sample_correct_at_1"), expected_per_sample)
        assert result == pytest.approx(expected, abs=1e-9), chunk_size
    assert 0 < result["n_queries_without_other_item"] < len(labels)
    assert 0.0 < result["map_at_r"] < 1.0 and 0.0 < result["precision_at_1"] < 1.0
    # Clips of one item are each other's easiest neighbours: leaving them in scores higher.
    assert retrieval_metrics(embeddings, labels)["precision_at_1"] > result["precision_at_1"]


def test_cross_item_hand_computed_case():
    # Points on the unit circle at various norms; (class, item) pairs:
    #   class 0: item "a" = a0 at 0 deg, a1 at 10;  item "b" = b0 at 30, b1 at 200
    #   class 1: item "a" = c0 at 14 (same item id as class 0's, but another item); "d" = d0 at 65
    #   class 2: item "a" = e0 at 270;  item "f" = f0 at 280
    # Each query ranks the samples of other items (angular distance), R = other-item class mates:
    #   a0 (R=2: b0 b1): c0 14, b0 30 (hit) ...          P@1 0, R-prec 1/2, AP@R (1/2)/2 = 1/4
    #   a1 (R=2):        c0 4, b0 20 (hit) ...           0, 1/2, 1/4
    #   b0 (R=2: a0 a1): c0 16, a1 20 (hit), a0 30 ...   0, 1/2, 1/4
    #   b1 (R=2):        e0 70, f0 80, d0 135 ...        0, 0, 0
    #   c0 (R=1: d0):    a1 4 ...                        0, 0, 0
    #   d0 (R=1: c0):    b0 35, c0 51 ...                0, 0, 0
    #   e0 (R=1: f0):    f0 10 (hit)                     1, 1, 1
    #   f0 (R=1: e0):    e0 10 (hit)                     1, 1, 1
    # Means over 8 queries: P@1 2/8, R-precision 3.5/8, MAP@R 2.75/8. (Taking items without
    # their class would hide c0 from a0 and a1 and give them P@1 1.)
    embeddings = on_circle([0, 10, 30, 200, 14, 65, 270, 280], scales=[1, 2, 0.5, 3, 1, 4, 1, 2])
    labels = np.array([0, 0, 0, 0, 1, 1, 2, 2])
    items = np.array(["a", "a", "b", "b", "a", "d", "a", "f"])
    result = retrieval_metrics(
        embeddings, labels, items=items, return_per_sample=True, chunk_size=3
    )
    assert result["precision_at_1"] == pytest.approx(2 / 8, abs=1e-12)
    assert result["r_precision"] == pytest.approx(3.5 / 8, abs=1e-12)
    assert result["map_at_r"] == pytest.approx(2.75 / 8, abs=1e-12)
    assert result["n_queries"] == 8 and result["n_queries_without_other_item"] == 0
    np.testing.assert_array_equal(result["per_sample_correct_at_1"], [False] * 6 + [True, True])


def test_cross_item_leaves_out_classes_with_one_item():
    # Class 0 has one item of three tight clips: leave-one-out finds them perfectly, but they
    # have nothing to find in another item, so they leave the averages and are counted.
    embeddings = on_circle([0, 1, 2, 90, 95, 180, 185, 270])
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    items = np.array([7, 7, 7, 0, 1, 0, 1, 2])
    result = retrieval_metrics(embeddings, labels, items=items, return_per_sample=True)
    assert result["n_queries"] == 5 and result["n_queries_without_other_item"] == 3
    # The other five find a class mate of another item first (90 <-> 95, 180 <-> 185, 270 -> 185).
    assert result["precision_at_1"] == 1.0
    np.testing.assert_array_equal(result["per_sample_correct_at_1"], [False] * 3 + [True] * 5)
    loo = retrieval_metrics(embeddings, labels, return_per_sample=True)
    assert loo["n_queries"] == 8 and loo["per_sample_correct_at_1"][:3].all()

    every_class_one_item = retrieval_metrics(embeddings, labels, items=labels)
    assert every_class_one_item["n_queries"] == 0
    assert every_class_one_item["n_queries_without_other_item"] == 8
    assert np.isnan(every_class_one_item["precision_at_1"]) and np.isnan(
        every_class_one_item["map_at_r"]
    )


@pytest.mark.parametrize("chunk_size", [5, 10_000])
def test_items_none_is_leave_one_out_and_one_item_per_sample_equals_it(chunk_size):
    embeddings, labels = clustered([3, 8, 15, 1, 30, 6], seed=5)
    loo = retrieval_metrics(embeddings, labels, chunk_size=chunk_size, return_per_sample=True)
    # The leave-one-out result keeps its keys and its PML-equal values.
    assert sorted(loo) == [
        "map_at_r",
        "n_queries",
        "per_sample_correct_at_1",
        "precision_at_1",
        "r_precision",
    ]
    for name, value in pml_retrieval(embeddings, labels).items():
        assert loo[name] == pytest.approx(value, abs=1e-6), name
    # Leave-one-out is cross-item retrieval where every sample is its own item.
    one_per_sample = retrieval_metrics(
        embeddings,
        labels,
        items=np.arange(len(labels)),
        chunk_size=chunk_size,
        return_per_sample=True,
    )
    np.testing.assert_array_equal(
        one_per_sample.pop("per_sample_correct_at_1"), loo.pop("per_sample_correct_at_1")
    )
    assert one_per_sample.pop("n_queries_without_other_item") == 1  # the singleton class
    assert one_per_sample == pytest.approx(loo, abs=1e-12)


def test_cross_item_accepts_torch_and_string_items():
    embeddings, labels, items = clustered_items([3, 4, 2], seed=7)
    from_numpy = retrieval_metrics(embeddings, labels, items=items)
    from_torch = retrieval_metrics(
        torch.from_numpy(embeddings), torch.from_numpy(labels), items=torch.from_numpy(items)
    )
    as_strings = retrieval_metrics(embeddings, labels, items=[f"rec{i}" for i in items])
    assert from_torch == pytest.approx(from_numpy, abs=1e-12)
    assert as_strings == pytest.approx(from_numpy, abs=1e-12)


def test_error_bad_items():
    embeddings, labels = np.eye(4), np.array([0, 0, 1, 1])
    for bad in (np.zeros(3), np.zeros((4, 1)), 5):
        with pytest.raises(ValueError, match=r"items must be 1-D .* \(4 rows\), got shape"):
            retrieval_metrics(embeddings, labels, items=bad)
    with pytest.raises(ValueError, match="mixed types"):
        retrieval_metrics(embeddings, labels, items=np.array(["a", None, "b", "b"], dtype=object))


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


def test_the_four_consumers_get_their_neighbours_from_the_one_kernel(monkeypatch):
    # retrieval, kNN accuracy, gallery ranking and search's exact index each list neighbours
    # through ExactSearch.search (a private loop of their own fails the spy), and what each
    # returns follows from the kernel's own lists.
    from audioclf.embedding.gallery import class_scores
    from audioclf.metrics import ExactSearch, knn_vote
    from audioclf.search import build

    embeddings, labels = clustered([9, 7, 8, 6], spread=1.2, seed=4)
    rows, k = np.arange(len(labels)), 3
    sims, ids = ExactSearch(embeddings).search(embeddings, k)
    _, loo_ids = ExactSearch(embeddings).search(embeddings, 1, query_groups=rows, index_groups=rows)
    calls = []
    search = ExactSearch.search

    def spy(self, queries, k, **groups):
        calls.append(k)
        return search(self, queries, k, **groups)

    monkeypatch.setattr(ExactSearch, "search", spy)

    retrieval = retrieval_metrics(embeddings, labels, return_per_sample=True)
    assert len(calls) >= 1 and calls[-1] >= 1
    np.testing.assert_array_equal(
        retrieval["per_sample_correct_at_1"], labels[loo_ids[:, 0]] == labels
    )
    before = len(calls)
    knn = knn_accuracy(embeddings, labels, embeddings, labels, k=k)
    assert calls[before:] == [k]
    np.testing.assert_array_equal(knn["predictions"], knn_vote(labels[ids]))
    before = len(calls)
    names, scores, votes = class_scores(embeddings, embeddings, labels.astype(str), k=k)
    assert calls[before:] == [len(labels)]  # every gallery row listed, best first
    want_votes = np.stack([np.bincount(labels[row], minlength=4) for row in ids])
    np.testing.assert_array_equal(votes, want_votes)
    np.testing.assert_array_equal(scores[rows, labels], sims[:, 0])  # each finds itself
    before = len(calls)
    found_sims, found = build(embeddings, "exact").search(embeddings, k)
    assert len(calls) > before
    np.testing.assert_array_equal(found, ids)
    np.testing.assert_allclose(found_sims, sims, atol=1e-6)


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
    result = centroid_accuracy(
        query, [0, 1], np.concatenate([gallery, on_circle([180])]), [0, 0, 1]
    )
    assert result["predictions"].tolist() == [0, 1]


def test_class_centroids_are_normalised_means_of_normalised_members():
    # Class 3: 0 and 90 deg (one ten times longer) -> 45 deg; class 1: 180 deg alone.
    embeddings = on_circle([0, 90, 180], scales=[1.0, 10.0, 2.0])
    classes, centroids = class_centroids(embeddings, np.array([3, 3, 1]))
    np.testing.assert_array_equal(classes, [1, 3])
    assert isinstance(centroids, torch.Tensor) and centroids.shape == (2, 2)
    expected = np.array([[-1.0, 0.0], [np.sqrt(0.5), np.sqrt(0.5)]])
    np.testing.assert_allclose(centroids.numpy(), expected, atol=1e-6)


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
