import json

import numpy as np
import pytest

from audioclf.metrics import knn_accuracy, retrieval_metrics, verification_metrics
from audioclf.report import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic(n_classes=4, per_class=12, dim=16, seed=0):
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(n_classes), per_class)
    centres = rng.normal(size=(n_classes, dim))
    embeddings = centres[labels] + 0.9 * rng.normal(size=(len(labels), dim))
    labels[-1] = n_classes  # one singleton class: its P@1 is undefined
    return embeddings.astype(np.float32), labels, [f"class|{i}" for i in range(n_classes + 1)]


def full_report(tmp_path, **overrides):
    embeddings, labels, class_names = synthetic()
    retrieval = retrieval_metrics(embeddings, labels, return_per_sample=True)
    knn = knn_accuracy(embeddings, labels, embeddings, labels, k=1)
    verification = verification_metrics(embeddings, labels)
    results = {**retrieval, "knn_accuracy": knn["knn_accuracy"], "epoch": np.int64(3)}
    kwargs = dict(
        results=results,
        embeddings=embeddings,
        labels=labels,
        class_names=class_names,
        knn_predictions=knn["predictions"],
        verification=verification,
        title="test report",
    )
    kwargs.update(overrides)
    written = write_report(tmp_path / "report", **kwargs)
    return written, results, verification, labels


def test_write_report_writes_every_file(tmp_path):
    written, _, _, _ = full_report(tmp_path)
    expected = {"report.json", "report.md", "det.png", "per_class_p1.png", "projection.png", "confusion.png"}
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


def test_report_markdown_lists_metrics_and_images(tmp_path):
    written, results, _, _ = full_report(tmp_path)
    markdown = written["report.md"].read_text()
    assert markdown.startswith("# test report")
    assert f"| precision_at_1 | {results['precision_at_1']:.4f} |" in markdown
    for image in ("det.png", "per_class_p1.png", "projection.png", "confusion.png"):
        assert f"]({image})" in markdown
    assert "class\\|0" in markdown  # pipes in class names are escaped for the table


def test_optional_plots_skipped_and_per_class_computed_when_absent(tmp_path):
    embeddings, labels, class_names = synthetic()
    written = write_report(
        tmp_path,
        results={"precision_at_1": 0.5},
        embeddings=embeddings,
        labels=labels,
        class_names=class_names,
        projection="tsne",
    )
    assert set(written) == {"report.json", "report.md", "per_class_p1.png", "projection.png"}
    report = json.loads(written["report.json"].read_text())
    expected = retrieval_metrics(embeddings, labels, return_per_sample=True)["per_sample_correct_at_1"]
    row = next(row for row in report["per_class_p1"] if row["class_id"] == 0)
    assert row["p_at_1"] == pytest.approx(expected[labels == 0].mean())


def test_many_classes_and_large_projection_subsample(tmp_path):
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 60, size=6000)
    embeddings = rng.normal(size=(60, 8))[labels] + 0.5 * rng.normal(size=(6000, 8))
    names = [f"c{i}" for i in range(60)]
    predictions = knn_accuracy(embeddings[:3000], labels[:3000], embeddings[3000:], labels[3000:])["predictions"]
    written = write_report(
        tmp_path,
        results={},
        embeddings=embeddings[:3000],
        labels=labels[:3000],
        class_names=names,
        knn_predictions=predictions,
    )
    assert written["confusion.png"].read_bytes().startswith(PNG_MAGIC)
    big = write_report(tmp_path / "big", results={}, embeddings=embeddings, labels=labels, class_names=names)
    assert big["projection.png"].read_bytes().startswith(PNG_MAGIC)


def test_report_validates_inputs(tmp_path):
    embeddings, labels, class_names = synthetic()
    with pytest.raises(ValueError, match="class_names has 4 entries"):
        write_report(tmp_path, results={}, embeddings=embeddings, labels=labels, class_names=class_names[:4])
    with pytest.raises(ValueError, match="knn_predictions has shape"):
        write_report(
            tmp_path,
            results={},
            embeddings=embeddings,
            labels=labels,
            class_names=class_names,
            knn_predictions=labels[:3],
        )
    with pytest.raises(ValueError, match="projection"):
        write_report(
            tmp_path, results={}, embeddings=embeddings, labels=labels, class_names=class_names, projection="umap"
        )
    assert list(tmp_path.iterdir()) == []  # nothing written before validation passes


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    import matplotlib.figure

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    embeddings, labels, class_names = synthetic()
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        write_report(tmp_path, results={}, embeddings=embeddings, labels=labels, class_names=class_names)
    assert list(tmp_path.iterdir()) == []
