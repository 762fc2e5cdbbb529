import json

import numpy as np
import pytest

from audioclf.evaluation.metrics import Evaluation
from audioclf.evaluation.report import write_report
from audioclf.metrics import knn_accuracy, retrieval_metrics, verification_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic(n_classes=4, per_class=12, dim=16, seed=0):
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(n_classes), per_class)
    centres = rng.normal(size=(n_classes, dim))
    embeddings = centres[labels] + 0.9 * rng.normal(size=(len(labels), dim))
    labels[-1] = n_classes  # one singleton class: its P@1 is undefined
    return embeddings.astype(np.float32), labels, [f"class|{i}" for i in range(n_classes + 1)]


def evaluated(
    embeddings, labels, class_names, results=None, knn_predictions=None, verification=None
):
    """An Evaluation as compute_metrics makes it: its results hold per-sample P@1."""
    correct = retrieval_metrics(embeddings, labels, return_per_sample=True)
    results = {"per_sample_correct_at_1": correct["per_sample_correct_at_1"], **(results or {})}
    return Evaluation(
        results, embeddings, labels, class_names, knn_predictions, verification, notes=[]
    )


def full_report(tmp_path, **overrides):
    embeddings, labels, class_names = synthetic()
    retrieval = retrieval_metrics(embeddings, labels, return_per_sample=True)
    knn = knn_accuracy(embeddings, labels, embeddings, labels, k=1)
    verification = verification_metrics(embeddings, labels)
    results = {**retrieval, "knn_accuracy": knn["knn_accuracy"], "epoch": np.int64(3)}
    evaluation = evaluated(
        embeddings, labels, class_names, results, knn["predictions"], verification
    )
    kwargs = dict(title="test report")
    kwargs.update(overrides)
    written = write_report(tmp_path / "report", evaluation, **kwargs)
    return written, results, verification, labels


def test_write_report_writes_every_file(tmp_path):
    written, _, _, _ = full_report(tmp_path)
    expected = {
        "report.json",
        "report.md",
        "det.png",
        "per_class_p1.png",
        "projection.png",
        "confusion.png",
        "embeddings.tsv",
        "metadata.tsv",
        "embeddings.html",
    }
    assert set(written) == expected
    out_dir = tmp_path / "report"
    assert {path.name for path in out_dir.iterdir()} == expected  # no temporary files left
    for name, path in written.items():
        assert path == out_dir / name
        if name.endswith(".png"):
            content = path.read_bytes()
            assert content.startswith(PNG_MAGIC) and len(content) > 1000, name


def test_report_json_holds_the_given_numbers(tmp_path):
    written, results, verification, labels = full_report(tmp_path)
    report = json.loads(written["report.json"].read_text())
    metrics = report["metrics"]
    for name in ("precision_at_1", "map_at_r", "r_precision", "knn_accuracy"):
        assert metrics[name] == pytest.approx(results[name], abs=1e-12)
    assert metrics["epoch"] == 3 and isinstance(metrics["epoch"], int)
    assert metrics["eer"] == pytest.approx(verification["eer"])
    assert metrics["n_pairs"] == verification["n_pairs"]
    assert "per_sample_correct_at_1" not in metrics and "fpr" not in metrics  # arrays stay out
    assert report["counts"] == {
        "n_samples": len(labels),
        "n_classes": 5,
        "n_class_names": 5,
        "n_singleton_classes": 1,
        "embedding_dim": 16,
    }

    per_class = report["per_class_p1"]
    correct = results["per_sample_correct_at_1"]
    for row in per_class[:-1]:
        assert row["p_at_1"] == pytest.approx(correct[labels == row["class_id"]].mean())
    assert per_class[-1] == {"class_id": 4, "name": "class|4", "count": 1, "p_at_1": None}
    scores = [row["p_at_1"] for row in per_class[:-1]]
    assert scores == sorted(scores)  # worst first


def test_normalised_verification_goes_beside_the_raw_figures(tmp_path):
    embeddings, labels, class_names = synthetic()
    cohort = np.random.default_rng(1).normal(size=(30, 16))
    verification = verification_metrics(embeddings, labels, cohort=cohort, cohort_top=10)
    evaluation = evaluated(embeddings, labels, class_names, verification=verification)
    written = write_report(tmp_path / "report", evaluation)
    metrics = json.loads(written["report.json"].read_text())["metrics"]
    assert metrics["eer_asnorm"] == pytest.approx(verification["eer_asnorm"])
    assert metrics["min_dcf_asnorm"] == pytest.approx(verification["min_dcf_asnorm"])
    assert metrics["eer"] == pytest.approx(verification["eer"])
    assert "fpr_asnorm" not in metrics and "fnr_asnorm" not in metrics  # arrays stay out
    markdown = written["report.md"].read_text()
    assert "| eer_asnorm | " in markdown and "| min_dcf_asnorm | " in markdown
    assert written["det.png"].read_bytes().startswith(PNG_MAGIC)  # raw and asnorm curves


def test_report_markdown_lists_metrics_and_images(tmp_path):
    written, results, _, _ = full_report(tmp_path)
    markdown = written["report.md"].read_text()
    assert markdown.startswith("# test report")
    assert f"| precision_at_1 | {results['precision_at_1']:.4f} |" in markdown
    for image in ("det.png", "per_class_p1.png", "projection.png", "confusion.png"):
        assert f"]({image})" in markdown
    assert "class\\|0" in markdown  # pipes in class names are escaped for the table


def test_optional_plots_skipped_when_their_inputs_are_absent(tmp_path):
    embeddings, labels, class_names = synthetic()
    written = write_report(
        tmp_path,
        evaluated(embeddings, labels, class_names, {"precision_at_1": 0.5}),
        projection="tsne",
    )
    assert set(written) == {
        "report.json",
        "report.md",
        "per_class_p1.png",
        "projection.png",
        "embeddings.tsv",
        "metadata.tsv",
        "embeddings.html",
    }
    report = json.loads(written["report.json"].read_text())
    expected = retrieval_metrics(embeddings, labels, return_per_sample=True)[
        "per_sample_correct_at_1"
    ]
    row = next(row for row in report["per_class_p1"] if row["class_id"] == 0)
    assert row["p_at_1"] == pytest.approx(expected[labels == 0].mean())


def test_many_classes_and_large_projection_subsample(tmp_path):
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 60, size=6000)
    embeddings = rng.normal(size=(60, 8))[labels] + 0.5 * rng.normal(size=(6000, 8))
    names = [f"c{i}" for i in range(60)]
    predictions = knn_accuracy(embeddings[:3000], labels[:3000], embeddings[3000:], labels[3000:])[
        "predictions"
    ]
    written = write_report(
        tmp_path,
        evaluated(embeddings[:3000], labels[:3000], names, knn_predictions=predictions),
    )
    assert written["confusion.png"].read_bytes().startswith(PNG_MAGIC)
    big = write_report(tmp_path / "big", evaluated(embeddings, labels, names))
    assert big["projection.png"].read_bytes().startswith(PNG_MAGIC)


def test_report_validates_its_options(tmp_path):
    embeddings, labels, class_names = synthetic()
    with pytest.raises(ValueError, match="projection"):
        write_report(tmp_path, evaluated(embeddings, labels, class_names), projection="umap")
    assert list(tmp_path.iterdir()) == []  # nothing written before validation passes


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    import matplotlib.figure

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    embeddings, labels, class_names = synthetic()
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        write_report(tmp_path, evaluated(embeddings, labels, class_names))
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Embedding files: projector TSVs and the HTML scatter


def read_tsv(path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def item_metadata(labels):
    import pandas as pd

    return pd.DataFrame(
        {
            "item": [f"rec{i % 3}" for i in range(len(labels))],
            "id": [f"id{i:04d}" for i in range(len(labels))],
            "path": [f"/data/clip {i}.wav" for i in range(len(labels))],
        }
    )


def test_embedding_files_parse_and_describe_every_sample(tmp_path):
    embeddings, labels, class_names = synthetic()
    metadata = item_metadata(labels)
    written, _, _, _ = full_report(tmp_path, metadata=metadata)
    vectors = np.loadtxt(written["embeddings.tsv"], delimiter="\t", ndmin=2)
    rows = read_tsv(written["metadata.tsv"])
    assert rows[0] == ["class", "item", "id", "path"]
    assert len(rows) == len(vectors) + 1 == len(labels) + 1  # small set: every sample
    assert all(len(row) == 4 for row in rows)
    # Row by row the same sample: its class, its metadata, its vector (to the 5 digits written).
    for row, vector in zip(rows[1:], vectors, strict=True):
        position = int(row[2].removeprefix("id"))
        assert row[0] == class_names[labels[position]] and row[3] == metadata["path"][position]
        np.testing.assert_allclose(vector, embeddings[position], rtol=1e-4, atol=1e-5)

    page = written["embeddings.html"].read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" in page and "src=" not in page
    assert page.count("<circle ") == len(labels)
    for name in class_names:  # every class in the legend and on its points' hover text
        assert f"{name} (" in page and f"class: {name}" in page
    assert "id: id0007" in page and "item: rec1" in page
    markdown = written["report.md"].read_text()
    for name in ("embeddings.html", "embeddings.tsv", "metadata.tsv"):
        assert f"]({name})" in markdown
    assert f"all {len(labels)} samples" in markdown
    report = json.loads(written["report.json"].read_text())
    assert report["embedding_files"]["embeddings.tsv"] == {
        "points": len(labels),
        "of": len(labels),
        "sampling": "all",
    }


def test_large_sets_are_sampled_by_class_and_the_report_says_so(tmp_path):
    rng = np.random.default_rng(2)
    labels = np.repeat(np.arange(6), [400, 200, 100, 50, 20, 5])
    embeddings = rng.normal(size=(len(labels), 8)).astype(np.float32)
    names = [f"c{i}" for i in range(6)]
    written = write_report(
        tmp_path, evaluated(embeddings, labels, names), tsv_points=300, html_points=60
    )
    rows = read_tsv(written["metadata.tsv"])
    assert rows[0] == ["class", "sample"] and len(rows) == 301
    assert len(np.loadtxt(written["embeddings.tsv"], delimiter="\t", ndmin=2)) == 300
    shown = [row[0] for row in rows[1:]]
    # Small classes whole (5 + 20 + 50), the other 225 points shared evenly by the big ones.
    assert [shown.count(f"c{i}") for i in range(6)] == [75, 75, 75, 50, 20, 5]
    page = written["embeddings.html"].read_text()
    assert page.count("<circle ") == 60 and all(f"class: {n}" in page for n in names)
    markdown = written["report.md"].read_text()
    assert "a class-stratified sample of 60 of 775 samples" in markdown
    assert "a class-stratified sample of 300 of 775 samples" in markdown


@pytest.mark.filterwarnings("ignore:Glyph")  # a tab in a class name, drawn in the PNG plots
def test_names_cannot_break_the_files(tmp_path):
    import pandas as pd

    embeddings, labels, _ = synthetic()
    names = ["<script>alert(1)</script>", "tab\there", "line\nbreak", 'quote"s', "&amp;"]
    metadata = pd.DataFrame({"item": ["it\tem"] * len(labels), "id": [""] * len(labels)})
    written = write_report(tmp_path, evaluated(embeddings, labels, names), metadata=metadata)
    rows = read_tsv(written["metadata.tsv"])
    assert all(len(row) == 3 for row in rows) and len(rows) == len(labels) + 1
    assert {row[0] for row in rows[1:]} == {
        "<script>alert(1)</script>",
        "tab here",
        "line break",
        'quote"s',
        "&amp;",
    }
    assert {row[1] for row in rows[1:]} == {"it em"} and {row[2] for row in rows[1:]} == {"-"}
    page = written["embeddings.html"].read_text()
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)" in page
    assert "&amp;amp;" in page
