"""audioclf.search: exact and faiss indexes, own-group exclusion, save/load, k-NN retrieval metrics."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from audioclf.metrics import relevance, retrieval_metrics
from audioclf.search import ExactIndex, build, load, neighbour_recall, sampled_neighbour_recall
from audioclf.search.approximate import PQ_MIN_ROWS
from tests.helpers import answers_in_threads

APPROXIMATE = ("ivf", "hnsw", "ivfpq")


@pytest.fixture
def faiss_installed():
    return pytest.importorskip("faiss")


def clustered(n: int, dim: int = 16, n_classes: int = 20, noise: float = 0.3, seed: int = 0):
    """Rows around random class centres (float32) and their labels."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_classes, size=n)
    centres = rng.normal(size=(n_classes, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    rows = centres[labels] + noise * rng.normal(size=(n, dim))
    return rows.astype(np.float32), labels


def unit(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def brute_force(queries, rows, k, query_groups=None, row_groups=None):
    """numpy reference: (ids, scores) of the k largest cosine similarities, own group masked."""
    sims = unit(queries) @ unit(rows).T
    if query_groups is not None:
        sims[np.asarray(query_groups)[:, None] == np.asarray(row_groups)[None, :]] = -np.inf
    ids = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return ids, np.take_along_axis(sims, ids, axis=1)


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# --------------------------------------------------------------------------------------------
# Exact search
# --------------------------------------------------------------------------------------------


def test_exact_index_returns_the_brute_force_neighbours():
    rows, _ = clustered(700, noise=1.0)
    queries, _ = clustered(60, noise=1.0, seed=1)
    # A budget of 7 rows per block and chunks of 25 queries: many blocks and chunks.
    index = ExactIndex(rows, chunk_size=7)
    scores, ids = index.search(queries, 10, chunk_size=25)
    want_ids, want_scores = brute_force(queries, rows, 10)
    assert ids.shape == scores.shape == (60, 10)
    assert ids.dtype == np.int64 and scores.dtype == np.float32
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)
    assert np.all(np.diff(scores, axis=1) <= 0)


def test_k_beyond_the_index_size_pads_with_minus_one():
    rows, _ = clustered(20)
    scores, ids = build(rows).search(rows[:3], 25)
    assert ids.shape == (3, 25)
    for row in ids:
        assert sorted(row[:20]) == list(range(20))
    assert np.all(ids[:, 20:] == -1) and np.all(scores[:, 20:] == -np.inf)
    assert np.all(np.isfinite(scores[:, :20]))


def test_exclusion_drops_the_own_group_and_still_returns_k():
    rows, _ = clustered(600, noise=0.8)
    groups = np.random.default_rng(3).integers(0, 40, size=600)
    scores, ids = build(rows).search(rows, 12, query_groups=groups, index_groups=groups)
    want_ids, want_scores = brute_force(rows, rows, 12, groups, groups)
    assert not np.any(groups[ids] == groups[:, None])
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)


def test_exclusion_of_a_group_that_fills_the_index_leaves_padding():
    rows, _ = clustered(10)
    groups = np.array([0] * 8 + [1] * 2)
    _, ids = build(rows).search(rows[:1], 5, query_groups=[0], index_groups=groups)
    assert sorted(ids[0, :2]) == [8, 9] and list(ids[0, 2:]) == [-1, -1, -1]


def test_exact_searches_in_four_threads_each_get_their_own_neighbours():
    # serve's worker threads search one collection at once: four threads over 20k rows got
    # other queries' neighbours, written into one shared similarity buffer (issue 42)
    rows, _ = clustered(20_000, dim=32)
    index = ExactIndex(rows)
    queries = [clustered(8, dim=32, seed=seed)[0] for seed in range(1, 9)]
    serial = [index.search(q, 10) for q in queries]
    for answers in answers_in_threads(lambda q: index.search(q, 10), queries):
        for (scores, ids), (want_scores, want_ids) in zip(answers, serial * 10, strict=True):
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_allclose(scores, want_scores, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_exact_index_on_cuda_matches_cpu():
    rows, _ = clustered(2000, noise=1.0)
    cpu_scores, cpu_ids = build(rows).search(rows[:100], 10)
    gpu_scores, gpu_ids = build(rows, device="cuda").search(rows[:100], 10)
    np.testing.assert_array_equal(gpu_ids, cpu_ids)
    np.testing.assert_allclose(gpu_scores, cpu_scores, atol=1e-5)


# --------------------------------------------------------------------------------------------
# faiss indexes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", APPROXIMATE)
def test_approximate_index_recall_on_clustered_rows(faiss_installed, method):
    n = PQ_MIN_ROWS if method == "ivfpq" else 3000
    rows, _ = clustered(n, dim=32, n_classes=30, noise=0.1)
    queries, _ = clustered(200, dim=32, n_classes=30, noise=0.1, seed=1)
    index = build(rows, method, progress=False)
    scores, ids = index.search(queries, 10)
    truth, _ = brute_force(queries, rows, 10)
    assert neighbour_recall(ids, truth) >= 0.9
    assert np.all(ids >= 0) and np.all(np.diff(scores, axis=1) <= 1e-6)


def test_ivfpq_without_rerank_keeps_only_the_codes(faiss_installed, tmp_path):
    rows, _ = clustered(PQ_MIN_ROWS, dim=32, noise=0.1)
    sizes = {}
    for rerank in (1, 8):
        build(rows, "ivfpq", rerank=rerank, progress=False).save(tmp_path / f"r{rerank}.json")
        sizes[rerank] = (tmp_path / f"r{rerank}.faiss").stat().st_size
    assert sizes[1] < rows.nbytes / 4 < rows.nbytes < sizes[8]


def test_ivf_probing_every_list_is_exact(faiss_installed):
    rows, _ = clustered(1500, noise=1.0)
    index = build(rows, "ivf", nlist=16, nprobe=1, progress=False)
    index.set_search_params(nprobe=16)
    _, ids = index.search(rows[:50], 10)
    np.testing.assert_array_equal(ids, brute_force(rows[:50], rows, 10)[0])


@pytest.mark.parametrize("method", ("ivf", "hnsw"))
def test_approximate_exclusion_never_returns_the_own_group(faiss_installed, method):
    rows, _ = clustered(2000, noise=0.3)
    groups = np.random.default_rng(1).integers(0, 100, size=2000)
    _, ids = build(rows, method, progress=False).search(
        rows[:300], 10, query_groups=groups[:300], index_groups=groups
    )
    assert np.all(ids >= 0)
    assert not np.any(groups[ids] == groups[:300, None])


def test_hnsw_searches_in_four_threads_get_the_serial_answers(faiss_installed):
    # efSearch (raised to k) is written onto the one faiss index per call: a thread asking
    # k=64 changed what a thread asking k=1 searched with
    rows, _ = clustered(2000, dim=32, noise=1.0)
    index = build(rows, "hnsw", ef_search=16, progress=False)
    asks = [(clustered(32, 32, noise=1.0, seed=s)[0], k) for s, k in enumerate((1, 64, 5, 32))]
    serial = [index.search(q, k) for q, k in asks]
    for answers in answers_in_threads(lambda ask: index.search(*ask), asks):
        for (scores, ids), (want_scores, want_ids) in zip(answers, serial * 10, strict=True):
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_allclose(scores, want_scores, atol=1e-6)


def test_search_params_are_checked_per_method(faiss_installed):
    rows, _ = clustered(500)
    with pytest.raises(ValueError) as excinfo:
        build(rows, "hnsw", progress=False).set_search_params(nprobe=4)
    assert "nprobe does not apply to method 'hnsw'" in one_line_error(excinfo)


# --------------------------------------------------------------------------------------------
# Recall
# --------------------------------------------------------------------------------------------


def test_neighbour_recall_counts_shared_ids_per_row():
    found = np.array([[1, 2, 3], [4, 5, -1]])
    truth = np.array([[3, 2, 9], [4, 6, 7]])
    assert neighbour_recall(found, truth) == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert neighbour_recall(found, truth, lengths=np.array([1, 3])) == pytest.approx(
        (0 + 1 / 3) / 2
    )
    assert neighbour_recall(found, truth, lengths=np.array([3, 1])) == pytest.approx(
        (2 / 3 + 1) / 2
    )


# --------------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ("exact", *APPROXIMATE))
def test_save_load_round_trip(tmp_path, method):
    if method != "exact":
        pytest.importorskip("faiss")
    rows, _ = clustered(PQ_MIN_ROWS if method == "ivfpq" else 1200)
    np.save(tmp_path / "emb.npy", rows)
    index = build(tmp_path / "emb.npy", method, progress=False)
    want = index.search(rows[:40], 7)
    meta_path = index.save(tmp_path / f"emb.{method}.json")
    loaded = load(meta_path)
    got = loaded.search(rows[:40], 7)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], atol=1e-6)
    assert (loaded.method, loaded.size, loaded.dim, loaded.path) == (
        method,
        len(rows),
        rows.shape[1],
        meta_path,
    )
    meta = json.loads(meta_path.read_text())
    assert (
        meta["source"]["path"] == "emb.npy"
        and meta["source"]["bytes"] == (tmp_path / "emb.npy").stat().st_size
    )
    # An exact index built from a file only refers to it; a faiss index writes its data.
    assert (meta["data"] is None) == (method == "exact")


def test_exact_index_from_an_array_saves_its_rows(tmp_path):
    rows, _ = clustered(300)
    meta_path = build(rows).save(tmp_path / "index.json")
    assert (tmp_path / "index.npy").is_file()
    np.testing.assert_array_equal(
        load(meta_path).search(rows[:5], 3)[1], build(rows).search(rows[:5], 3)[1]
    )


def test_loading_after_the_embeddings_changed_is_one_line(tmp_path):
    rows, _ = clustered(300)
    np.save(tmp_path / "emb.npy", rows)
    meta_path = build(tmp_path / "emb.npy").save(tmp_path / "emb.exact.json")
    np.save(tmp_path / "emb.npy", rows[::-1].copy())  # same size, new content
    stat = (tmp_path / "emb.npy").stat()
    os.utime(tmp_path / "emb.npy", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(ValueError) as excinfo:
        load(meta_path)
    message = one_line_error(excinfo)
    assert "stale" in message and "emb.npy" in message and "rebuild" in message
    (tmp_path / "emb.npy").unlink()
    with pytest.raises(FileNotFoundError) as excinfo:
        load(meta_path)
    assert "emb.npy, which is missing" in one_line_error(excinfo)


def test_query_dimension_mismatch_is_one_line_naming_both(tmp_path):
    rows, _ = clustered(300, dim=16)
    np.save(tmp_path / "emb.npy", rows)
    index = load(build(tmp_path / "emb.npy").save(tmp_path / "emb.exact.json"))
    with pytest.raises(ValueError) as excinfo:
        index.search(np.ones((2, 8), dtype=np.float32), 3)
    message = one_line_error(excinfo)
    assert "dimension 8" in message and "dimension 16" in message
    assert "emb.exact.json" in message and "emb.npy" in message


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("not json", "not valid JSON"),
        ('{"format": 1}', "lacks method"),
        (
            '{"format": 9, "method": "exact", "dim": 1, "size": 1, "params": {}, "data": null, "source": null}',
            "format 9",
        ),
    ],
)
def test_unreadable_index_descriptions_are_one_line(tmp_path, content, expected):
    (tmp_path / "index.json").write_text(content)
    with pytest.raises(ValueError) as excinfo:
        load(tmp_path / "index.json")
    assert expected in one_line_error(excinfo)


# --------------------------------------------------------------------------------------------
# Retrieval metrics from neighbour lists
# --------------------------------------------------------------------------------------------


def reference_retrieval(rows, labels, items=None, query_rows=None):
    """P@1 / MAP@R / R-precision by a plain loop over queries (float64 cosine similarities)."""
    sims = unit(rows) @ unit(rows).T
    groups = (
        np.arange(len(labels))
        if items is None
        else np.unique(np.stack([labels, items], axis=1), axis=0, return_inverse=True)[1].reshape(
            -1
        )
    )
    p1, ap, rp = [], [], []
    for q in range(len(labels)) if query_rows is None else query_rows:
        candidates = np.flatnonzero(groups != groups[q])
        ranked = candidates[np.argsort(-sims[q, candidates], kind="stable")]
        r = int(np.sum(labels[candidates] == labels[q]))
        if r == 0:
            continue
        hits = labels[ranked[:r]] == labels[q]
        p1.append(labels[ranked[0]] == labels[q])
        ap.append(np.sum(np.cumsum(hits)[hits] / (np.flatnonzero(hits) + 1)) / r)
        rp.append(hits.sum() / r)
    return {
        "precision_at_1": np.mean(p1),
        "map_at_r": np.mean(ap),
        "r_precision": np.mean(rp),
        "n_queries": len(p1),
    }


def retrieval_case(name: str):
    rows, labels = clustered(400, dim=12, n_classes=15, noise=0.3, seed=5)
    items = np.random.default_rng(50).integers(0, 4, size=400)
    if name == "lone":  # a singleton class, and a class with a single item
        labels, items = labels.copy(), items.copy()
        labels[:1], labels[1:6], items[1:6] = 99, 98, 0
    return rows, labels, None if name == "leave-one-out" else items


KEYS = ("precision_at_1", "map_at_r", "r_precision", "n_queries")


@pytest.mark.parametrize("case", ["leave-one-out", "cross-item", "lone"])
def test_retrieval_with_the_exact_index_equals_the_default_search(case):
    rows, labels, items = retrieval_case(case)
    index = build(rows)
    got = retrieval_metrics(rows, labels, items=items, index=index)
    want = retrieval_metrics(rows, labels, items=items)
    reference = reference_retrieval(rows, labels, items)
    for key in KEYS:
        assert got[key] == pytest.approx(want[key], abs=1e-6), key
        assert got[key] == pytest.approx(reference[key], abs=1e-6), key
    assert 0.2 < got["map_at_r"] < 0.9  # not a trivial set
    assert index.method == "exact" and "neighbour_recall" not in got
    if case == "lone":
        assert got["n_queries_without_other_item"] == want["n_queries_without_other_item"] == 6


def test_retrieval_on_a_subset_of_queries():
    rows, labels, items = retrieval_case("cross-item")
    subset = np.arange(0, 400, 3)
    got = retrieval_metrics(rows, labels, items=items, index=build(rows), query_rows=subset)
    want = reference_retrieval(rows, labels, items, query_rows=subset)
    for key in KEYS:
        assert got[key] == pytest.approx(want[key], abs=1e-6), key


def test_an_approximate_index_scores_close_and_measures_its_recall(faiss_installed):
    rows, labels = clustered(3000, dim=32, n_classes=30, noise=0.15)
    items = np.random.default_rng(2).integers(0, 5, size=3000)
    exact = retrieval_metrics(rows, labels, items=items, index=build(rows))
    index = build(rows, "ivf", progress=False)
    approx = retrieval_metrics(rows, labels, items=items, index=index)
    recall, recall_queries = sampled_neighbour_recall(index, rows, labels, items=items, queries=300)
    assert index.method == "ivf" and recall_queries == 300
    assert 0.9 <= recall <= 1.0
    assert abs(approx["map_at_r"] - exact["map_at_r"]) < 0.02
    assert relevance(labels, items).depth() >= max(np.bincount(labels))


# --------------------------------------------------------------------------------------------
# Invalid inputs: one clear line each
# --------------------------------------------------------------------------------------------

ROWS, _ = clustered(50)
NAN_ROWS = ROWS.copy()
NAN_ROWS[[3, 7], 0] = np.nan


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda: build(ROWS[0]), "2-D"),
        (lambda: build(NAN_ROWS), "NaN/inf values in 2 of 50 rows (first rows: [3, 7])"),
        (lambda: build(ROWS, "annoy"), "unknown search method 'annoy'"),
        (lambda: build(ROWS, nprobe=4), "do not apply to method 'exact'"),
        (lambda: build(ROWS).search(ROWS, 0), "k must be a positive integer"),
        (lambda: build(ROWS).search(ROWS, 2.5), "k must be a positive integer"),
        (lambda: build(ROWS).search(NAN_ROWS, 3), "queries has NaN/inf"),
        (lambda: build(ROWS).search(ROWS, 3, query_groups=np.zeros(50, int)), "together"),
        (
            lambda: build(ROWS).search(
                ROWS, 3, query_groups=np.zeros(50, int), index_groups=np.zeros(7, int)
            ),
            "index_groups must be 1-D integer group codes",
        ),
        (lambda: build(ROWS).save("index.npy"), "must end in .json"),
        (
            lambda: retrieval_metrics(ROWS, np.arange(50) % 5, index=build(ROWS[:40])),
            "build it from these embeddings",
        ),
        (
            lambda: retrieval_metrics(ROWS, np.arange(50) % 5, query_rows=[0, 50]),
            "query_rows must be",
        ),
    ],
)
def test_invalid_inputs_raise_one_line_value_errors(call, expected):
    with pytest.raises(ValueError) as excinfo:
        call()
    assert expected in one_line_error(excinfo)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"method": "ivf", "nlist": 51}, "nlist=51 exceeds the 50 rows"),
        ({"method": "ivfpq"}, f"at least {PQ_MIN_ROWS} rows"),
        ({"method": "hnsw", "ef_search": 0}, "ef_search must be a positive integer"),
    ],
)
def test_invalid_faiss_parameters_raise_one_line(faiss_installed, kwargs, expected):
    with pytest.raises(ValueError) as excinfo:
        build(ROWS, progress=False, **kwargs)
    assert expected in one_line_error(excinfo)


def test_an_approximate_method_without_faiss_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` now raises ImportError
    with pytest.raises(ImportError) as excinfo:
        build(ROWS, "hnsw")
    assert "pip install faiss-cpu" in one_line_error(excinfo)
    assert build(ROWS).search(ROWS[:2], 1)[1].tolist() == [[0], [1]]  # exact needs no faiss


def test_build_names_a_misspelt_parameter_and_the_ones_it_takes():
    from audioclf.search.index import build

    with pytest.raises(TypeError, match=r"unknown parameter\(s\) nlists; the methods take nlist, "):
        build(np.eye(4, dtype=np.float32), "ivf", nlists=4)
    with pytest.raises(ValueError, match="nlist do not apply to method 'exact'"):
        build(np.eye(4, dtype=np.float32), "exact", nlist=4)
