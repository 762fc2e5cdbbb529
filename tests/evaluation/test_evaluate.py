"""The offline evaluator: reports from a trained checkpoint, --split/--index/--gallery, errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from audioclf.checkpoint import CheckpointError
from audioclf.data.index import load_index
from audioclf.evaluate import main
from audioclf.evaluation.metrics import enrollment_split
from audioclf.evaluation.report import REPORT_FILES
from audioclf.evaluation.run import SUMMARY_METRICS
from audioclf.evaluation.select import select_data
from audioclf.inference import LoadedEmbedder, embed_paths, load_trained
from tests.helpers import ROOT, tiny_config

METRICS = (
    "precision_at_1",
    "map_at_r",
    "r_precision",
    "knn_accuracy",
    "centroid_accuracy",
    "eer",
    "min_dcf",
    "nmi",
    "ami",
)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, tiny_demo):
    """A checkpoint written by the real trainer (1 short epoch of the tiny CNN)."""
    from audioclf.training.trainer import fit

    runs = tmp_path_factory.mktemp("runs")
    cfg = tiny_config(
        tiny_demo, runs, "cnn", "train.epochs=1", "train.limit_batches=4", "eval.every=0"
    )
    run_dir = Path(fit(cfg)["run_dir"])
    return run_dir / "best.pt"


@pytest.fixture(scope="session")
def closed_set_sheet(tmp_path_factory, tiny_demo):
    """The demo rows with a split column: per item, id 00 → val, id 01 → test, others → train,
    so every class is in every split (closed set)."""
    table = pd.read_excel(tiny_demo, dtype=str, engine="openpyxl")
    table["path"] = [str(tiny_demo.parent / p) for p in table["path"]]
    suffix = table["a_id"].str[-2:]
    table["split"] = np.select([suffix == "00", suffix == "01"], ["val", "test"], "train")
    path = tmp_path_factory.mktemp("sheets") / "closed.csv"
    table.to_csv(path, index=False)
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def read_report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


def test_default_evaluation_writes_a_complete_report(trained, tmp_path, capsys):
    out = tmp_path / "eval"
    code, stdout, err = run_cli(
        capsys,
        "--checkpoint",
        trained,
        "--out",
        out,
        "--num-workers",
        0,
        "--quiet",
        "--device",
        "cpu",
    )
    assert code == 0, err
    for name in ("report.json", "report.md", "det.png", "per_class_p1.png", "projection.png"):
        assert (out / name).stat().st_size > 0, name
    report = read_report(out)
    for name in METRICS:
        assert math.isfinite(report["metrics"][name]), name
    setup = report["evaluation"]
    # The tiny demo's generated split holds out whole classes: 3 of 12 classes x 12 samples.
    assert setup["split"] == "val" and setup["n_samples"] == 36 and setup["n_classes"] == 3
    assert setup["classification"].startswith("enrollment")
    assert any("open-set" in note for note in setup["notes"])
    assert "open-set" in (out / "report.md").read_text()
    assert not (out / "confusion.png").exists()  # queries are a subset: no per-sample kNN
    assert "precision_at_1" in stdout and str(out / "report.md") in stdout
    assert not list(tmp_path.glob(".eval.partial*"))
    # The embedding space: projector files and the HTML scatter, every sample of this small set.
    rows = [line.split("\t") for line in (out / "metadata.tsv").read_text().splitlines()]
    assert rows[0] == ["class", "item", "id", "path"] and len(rows) == 36 + 1
    assert len(np.loadtxt(out / "embeddings.tsv", delimiter="\t", ndmin=2)) == 36
    assert {row[0] for row in rows[1:]} == set(report["per_class_p1"][i]["name"] for i in range(3))
    assert all(Path(row[3]).is_file() for row in rows[1:])
    page = (out / "embeddings.html").read_text()
    assert page.count("<circle ") == 36
    assert all(f"class: {row[0]}\nitem: {row[1]}\nid: {row[2]}" in page for row in rows[1:])
    markdown = (out / "report.md").read_text()
    assert "](embeddings.html)" in markdown and "](metadata.tsv)" in markdown
    assert str(out / "embeddings.html") in stdout


def test_default_out_is_next_to_the_checkpoint(trained, capsys):
    code, _, err = run_cli(
        capsys, "--checkpoint", trained, "--num-workers", 0, "--quiet", "--gallery", "none"
    )
    assert code == 0, err
    report = read_report(trained.parent / "eval")
    assert report["evaluation"]["classification"] == "none"
    assert "knn_accuracy" not in report["metrics"]


def test_adapt_is_recorded_in_the_report_and_the_summary(trained, tiny_demo, tmp_path, capsys):
    source = tiny_demo.parent / "wav" / "c00"
    out = tmp_path / "eval"
    code, stdout, err = run_cli(
        capsys, "--checkpoint", trained, "--out", out, "--num-workers", 0, "--quiet",
        "--gallery", "none", "--adapt", source,
    )  # fmt: skip
    assert code == 0, err
    adaptation = read_report(out)["evaluation"]["adaptation"]
    assert adaptation["method"] == "adabn" and adaptation["source"] == [str(source)]
    assert adaptation["clips"] == len(list(source.rglob("*.wav")))
    assert adaptation["batchnorm_layers"] > 0
    said = f"adapted by adabn on {adaptation['clips']} unlabelled clips of {source}"
    assert said in stdout and said in (out / "report.md").read_text()


def test_index_and_split_are_honoured_closed_set(trained, closed_set_sheet, tmp_path, capsys):
    for split, expected in (("val", 36), ("test", 36)):
        out = tmp_path / split
        code, stdout, err = run_cli(
            capsys,
            "--checkpoint",
            trained,
            "--index",
            closed_set_sheet,
            "--split",
            split,
            "--out",
            out,
            "--num-workers",
            0,
            "--quiet",
            "--projection",
            "tsne",
        )
        assert code == 0, err
        for name in SUMMARY_METRICS:  # the summary table has a row per metric
            assert any(line.split()[:1] == [name] for line in stdout.splitlines()), name
        setup = read_report(out)["evaluation"]
        assert setup["index"] == str(closed_set_sheet)
        assert setup["split"] == split and setup["n_samples"] == expected
        assert setup["n_classes"] == 12
        # Every evaluated class is in the train split: classified against it, kNN confusion.
        assert setup["classification"].startswith("closed set")
        assert setup["n_gallery_samples"] == 144 - 72
        assert (out / "confusion.png").is_file()
        assert math.isfinite(read_report(out)["metrics"]["knn_accuracy"])


def test_a_later_evaluation_leaves_nothing_of_an_earlier_one(
    trained, closed_set_sheet, tmp_path, capsys
):
    out = tmp_path / "eval"
    common = ["--checkpoint", trained, "--out", out, "--num-workers", 0, "--quiet"]
    code, _, err = run_cli(capsys, *common, "--index", closed_set_sheet)  # closed set: confusion
    assert code == 0, err
    assert (out / "confusion.png").is_file()
    first_ids = {
        line.split("\t")[2] for line in (out / "metadata.tsv").read_text().splitlines()[1:]
    }
    code, _, err = run_cli(capsys, *common)  # the open-set val split of the checkpoint's sheet
    assert code == 0, err
    assert not (out / "confusion.png").exists()  # a stale plot does not pass for this run
    cfg = load_trained(trained)[1]
    val_ids = set(select_data(cfg).evaluated.table["id"])
    rows = (out / "metadata.tsv").read_text().splitlines()
    assert {line.split("\t")[2] for line in rows[1:]} == val_ids != first_ids
    page = (out / "embeddings.html").read_text()
    assert all(f"id: {i}\n" not in page and f"id: {i}<" not in page for i in first_ids - val_ids)
    assert set(read_report(out)["files"]) == set(REPORT_FILES) - {"confusion.png"}
    assert {p.name for p in out.iterdir()} == set(REPORT_FILES) - {"confusion.png"}


def test_gallery_sheet(trained, closed_set_sheet, tmp_path, capsys):
    table = pd.read_csv(closed_set_sheet, dtype=str)
    full = tmp_path / "gallery.csv"
    table[table["split"] == "train"].drop(columns="split").to_csv(full, index=False)
    code, _, err = run_cli(
        capsys,
        "--checkpoint",
        trained,
        "--index",
        closed_set_sheet,
        "--gallery",
        full,
        "--out",
        tmp_path / "ok",
        "--num-workers",
        0,
        "--quiet",
    )
    assert code == 0, err
    assert read_report(tmp_path / "ok")["evaluation"]["gallery"] == str(full)

    partial = tmp_path / "partial.csv"
    table[table["a_cls"] != "c03"].to_csv(partial, index=False)
    code, out, err = run_cli(
        capsys,
        "--checkpoint",
        trained,
        "--index",
        closed_set_sheet,
        "--gallery",
        partial,
        "--out",
        tmp_path / "bad",
        "--num-workers",
        0,
        "--quiet",
    )
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "lacks 1 of the 12 evaluated classes ('c03')" in err
    assert not (tmp_path / "bad").exists()


def corrupt_checkpoint(trained: Path, tmp_path: Path) -> Path:
    path = tmp_path / "corrupt.pt"
    path.write_bytes(trained.read_bytes()[:2000])
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing checkpoint", "does not exist"),
        ("corrupt checkpoint", "cannot be read"),
        ("empty split", "the val split of"),
        ("absent split", "has no 'test' split"),
        ("index without class column", "has no column 'a_cls'"),
        ("wrong model name", "--model-name conformer was requested but"),
        ("no cuda", "CUDA is not available"),
    ],
)
def test_errors_exit_2_with_one_line_and_write_nothing(
    trained, closed_set_sheet, tmp_path, capsys, case, message
):
    if case == "no cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    table = pd.read_csv(closed_set_sheet, dtype=str)
    out = tmp_path / "out"
    args = ["--checkpoint", trained, "--out", out, "--num-workers", 0, "--quiet"]
    if case == "missing checkpoint":
        args[1] = tmp_path / "nope.pt"
    elif case == "corrupt checkpoint":
        args[1] = corrupt_checkpoint(trained, tmp_path)
    elif case == "empty split":
        sheet = tmp_path / "all_train.csv"
        table.assign(split="train").to_csv(sheet, index=False)
        args += ["--index", sheet]
    elif case == "absent split":
        sheet = tmp_path / "no_test.csv"
        table.assign(split=table["split"].replace("test", "val")).to_csv(sheet, index=False)
        args += ["--index", sheet, "--split", "test"]
    elif case == "index without class column":
        sheet = tmp_path / "no_class.csv"
        table.drop(columns="a_cls").to_csv(sheet, index=False)
        args += ["--index", sheet]
    elif case == "wrong model name":
        args += ["--model-name", "conformer"]
    else:
        args += ["--device", "cuda"]
    code, stdout, err = run_cli(capsys, *args)
    assert code == 2 and stdout == ""
    assert err.startswith("python -m audioclf.evaluate: error: ") and err.count("\n") == 1
    assert message in err
    if case == "wrong model name":
        assert "holds a cnn model" in err
    assert not out.exists()


def test_unreadable_file_is_named_or_skipped(trained, closed_set_sheet, tmp_path, capsys):
    table = pd.read_csv(closed_set_sheet, dtype=str)
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF, but not audio")
    first_val = table.index[table["split"] == "val"][0]
    table.loc[first_val, "path"] = str(broken)
    sheet = tmp_path / "broken.csv"
    table.to_csv(sheet, index=False)
    args = ["--checkpoint", trained, "--index", sheet, "--num-workers", 0, "--quiet"]
    code, _, err = run_cli(capsys, *args, "--out", tmp_path / "failed")
    assert code == 2 and err.count("\n") == 1
    assert f"index row {first_val + 2}" in err and str(broken) in err
    assert "pass --skip-bad-files" in err and not (tmp_path / "failed").exists()

    code, _, err = run_cli(capsys, *args, "--out", tmp_path / "ok", "--skip-bad-files")
    assert code == 0, err
    setup = read_report(tmp_path / "ok")["evaluation"]
    assert setup["n_samples"] == 35 and any("1 unreadable file" in n for n in setup["notes"])


def test_weights_of_another_model_config_are_named(trained, tmp_path):
    ckpt = torch.load(trained, weights_only=False)
    ckpt["config"]["model"]["cnn"]["width"] = 16
    ckpt["config"]["model"]["embedding_dim"] = 8
    other = tmp_path / "other.pt"
    torch.save(ckpt, other)
    with pytest.raises(CheckpointError) as info:
        load_trained(other)
    text = str(info.value)
    assert "shape mismatches" in text and "embedder.blocks.0.conv1.weight" in text
    assert "written by another model config" in text

    del ckpt["model"]["embedder.embedding.bias"]
    ckpt["model"]["extra.weight"] = torch.zeros(1)
    ckpt["config"]["model"]["cnn"]["width"] = 8
    ckpt["config"]["model"]["embedding_dim"] = 16
    torch.save(ckpt, other)
    with pytest.raises(
        CheckpointError,
        match=r"missing keys embedder\.embedding\.bias; "
        r"unexpected keys extra\.weight",
    ):
        load_trained(other)


def test_ddp_prefixed_weights_load(trained, tmp_path, tiny_demo):
    ckpt = torch.load(trained, weights_only=False)
    ckpt["model"] = {f"module.{k}": v for k, v in ckpt["model"].items()}
    wrapped = tmp_path / "wrapped.pt"
    torch.save(ckpt, wrapped)
    model = LoadedEmbedder.from_checkpoint(wrapped, torch.device("cpu"))
    reference = LoadedEmbedder.from_checkpoint(trained, torch.device("cpu"))
    files = load_index(model.data).table["path"].tolist()[:3]
    np.testing.assert_array_equal(embed_paths(model, files)[1], embed_paths(reference, files)[1])


def test_enrollment_split_is_by_item_and_keeps_both_sides():
    classes = np.array(["a"] * 6 + ["b"] * 3 + ["c"])
    items = np.array(["a1", "a1", "a2", "a2", "a3", "a3", "b1", "b1", "b1", "c1"])
    enroll = enrollment_split(classes, items, seed=0)
    for item in ("a1", "a2", "a3"):  # an item is wholly on one side
        assert len(set(enroll[items == item])) == 1
    assert enroll[classes == "a"].sum() == 2  # one of three items enrolls
    assert enroll[classes == "b"].sum() == 1  # a single item: its samples split
    assert not enroll[classes == "c"].any()  # a single sample only queries
    np.testing.assert_array_equal(enroll, enrollment_split(classes, items, seed=0))


@pytest.mark.slow
def test_help_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "audioclf.evaluate", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "MAP@R" in result.stdout and "--gallery" in result.stdout


# ---------------------------------------------------------------------------------------------
# --search: the retrieval metrics from a search index's neighbour lists


def test_exact_search_equals_the_full_scan_to_the_last_bit():
    from audioclf.evaluation.metrics import MetricOptions, compute_metrics
    from audioclf.metrics import retrieval_metrics

    rng = np.random.default_rng(0)
    classes = rng.integers(0, 9, 400)
    emb = (rng.normal(size=(9, 24))[classes] + rng.normal(size=(400, 24))).astype(np.float32)
    names = np.array([f"c{c}" for c in classes], dtype=object)
    items = np.array([f"i{i % 5}" for i in range(400)], dtype=object)
    evaluation = compute_metrics(emb, names, MetricOptions(search="exact"), items=items)
    labels = evaluation.labels
    cross = retrieval_metrics(emb, labels, items=items, return_per_sample=True)
    loo = retrieval_metrics(emb, labels, return_per_sample=True)
    assert evaluation.results["n_queries"] == cross["n_queries"]
    for key in ("precision_at_1", "map_at_r", "r_precision"):
        assert evaluation.results[key] == cross[key], key
        assert evaluation.results[f"loo_{key}"] == loo[key], key
    np.testing.assert_array_equal(
        evaluation.results["per_sample_correct_at_1"], cross["per_sample_correct_at_1"]
    )
    assert evaluation.setup["search"] == "exact" and evaluation.setup["search_k"] > 0
    assert not {"method", "k", "neighbour_recall"} & set(evaluation.results)


def test_auto_search_is_exact_and_a_missing_faiss_is_named(monkeypatch):
    from audioclf.evaluation import metrics as evaluation_metrics

    resolve = evaluation_metrics.resolve_search
    assert resolve("auto") == "exact" and resolve("exact") == "exact"
    if evaluation_metrics.faiss_available():
        assert resolve("hnsw") == "hnsw"
    monkeypatch.setattr(evaluation_metrics, "faiss_available", lambda: False)
    assert resolve("auto") == "exact"
    with pytest.raises(ValueError, match="--search ivf needs faiss, which is not installed"):
        resolve("ivf")
    with pytest.raises(ValueError, match="--search 'flat': use one of"):
        resolve("flat")


def test_each_search_backend_gives_the_exact_figures_and_says_so(trained, tmp_path, capsys):
    from audioclf.search import faiss_available

    methods = ["exact", "ivf", "hnsw"] if faiss_available() else ["exact"]
    reports = {}
    for method in methods:
        out = tmp_path / method
        code, stdout, err = run_cli(
            capsys, "--checkpoint", trained, "--out", out, "--num-workers", 0, "--quiet",
            "--gallery", "none", "--search", method, "--device", "cpu",
        )  # fmt: skip
        assert code == 0, err
        reports[method] = read_report(out)
        setup = reports[method]["evaluation"]
        assert setup["search"] == method and setup["search_requested"] == method
        search_line = [line for line in stdout.splitlines() if line.startswith("search ")]
        assert len(search_line) == 1 and f"{method} (--search {method}), k = " in search_line[0]
        assert f"- search: {method}" in (out / "report.md").read_text()
        if method != "exact":  # 36 samples: one IVF list, probed; HNSW visits every node
            assert setup["search_neighbour_recall"] == 1.0 and "neighbour recall" in stdout
    for method in methods:
        for key in ("precision_at_1", "map_at_r", "r_precision", "loo_precision_at_1"):
            assert reports[method]["metrics"][key] == reports["exact"]["metrics"][key], key
        assert reports[method]["per_class_p1"] == reports["exact"]["per_class_p1"]


def test_default_search_is_auto_and_exact_on_the_tiny_set(trained, tmp_path, capsys):
    out = tmp_path / "eval"
    args = ["--checkpoint", trained, "--out", out, "--num-workers", 0, "--quiet"]
    code, _, err = run_cli(capsys, *args, "--gallery", "none")
    assert code == 0, err
    setup = read_report(out)["evaluation"]
    assert (setup["search"], setup["search_requested"]) == ("exact", "auto")


def test_search_without_faiss_is_one_line_before_any_work(trained, tmp_path, capsys, monkeypatch):
    from audioclf.evaluation import metrics as evaluation_metrics

    monkeypatch.setattr(evaluation_metrics, "faiss_available", lambda: False)
    out = tmp_path / "eval"
    code, stdout, err = run_cli(capsys, "--checkpoint", trained, "--out", out, "--search", "hnsw")
    assert code == 2 and stdout == "" and err.count("\n") == 1
    assert "--search hnsw needs faiss" in err and not out.exists()


# ---------------------------------------------------------------------------------------------
# Score normalisation (--score-norm, --cohort, --cohort-top): verification raw and normalised


@pytest.mark.slow
def test_a_cohort_sheet_adds_normalised_verification_beside_the_raw(
    trained, closed_set_sheet, tmp_path, capsys
):
    evaluated = select_data(load_trained(trained)[1]).evaluated.classes
    table = pd.read_csv(closed_set_sheet, dtype=str)
    cohort = tmp_path / "cohort.csv"  # the 9 classes of the train split: none evaluated
    table[~table["a_cls"].isin(evaluated)].to_csv(cohort, index=False)
    common = ["--checkpoint", trained, "--num-workers", 0, "--quiet", "--gallery", "none"]
    code, _, err = run_cli(capsys, *common, "--out", tmp_path / "raw")
    assert code == 0, err
    code, stdout, err = run_cli(capsys, *common, "--out", tmp_path / "norm", "--cohort", cohort)
    assert code == 0, err
    raw, normalised = read_report(tmp_path / "raw"), read_report(tmp_path / "norm")
    for key in ("eer", "min_dcf", "eer_threshold", "n_pairs", "precision_at_1"):
        assert normalised["metrics"][key] == raw["metrics"][key], key
    assert not {"eer_asnorm", "min_dcf_asnorm"} & set(raw["metrics"])
    assert "score_norm" not in raw["evaluation"]
    for key in ("eer_asnorm", "min_dcf_asnorm"):
        assert math.isfinite(normalised["metrics"][key]), key
        assert any(line.split()[:1] == [key] for line in stdout.splitlines()), key
        assert f"| {key} |" in (tmp_path / "norm" / "report.md").read_text()
    setup = normalised["evaluation"]
    # 108 cohort clips: AS-norm keeps a fifth of them a side (fewer than 300).
    assert (setup["score_norm"], setup["cohort"], setup["n_cohort"]) == ("asnorm", str(cohort), 108)
    assert setup["cohort_top"] == 21 and "asnorm (top 21 of 108 cohort clips" in stdout
    assert not any("cohort shares" in note for note in setup["notes"])


def test_a_cohort_without_spread_keeps_the_raw_figures_and_says_why_not_the_normalised():
    from audioclf.evaluation.metrics import MetricOptions, compute_metrics

    rng = np.random.default_rng(0)
    names = np.repeat(np.array(["a", "b", "c"]), 4)
    emb = (rng.normal(size=(12, 8)) + 3 * np.eye(8)[np.repeat([0, 1, 2], 4)]).astype(np.float32)
    raw = compute_metrics(emb, names)
    one_clip = np.repeat(emb[:1], 3, axis=0)  # a cohort of three copies of one clip
    asnorm = MetricOptions(score_norm="asnorm")
    evaluation = compute_metrics(emb, names, asnorm, cohort_emb=one_clip)
    assert evaluation.verification is not None
    for key in ("eer", "min_dcf", "eer_threshold", "n_pairs"):
        assert evaluation.verification[key] == raw.verification[key], key
    assert "eer_asnorm" not in evaluation.verification
    reason = evaluation.setup["score_norm_skipped"]  # report.json's "evaluation", report.md
    assert reason.startswith("some trial embeddings have no spread")
    assert evaluation.notes == [
        f"score normalisation (asnorm) skipped: {reason}; the raw EER and minDCF are kept"
    ]


@pytest.mark.slow
def test_a_cohort_of_one_clip_copied_keeps_the_raw_figures_in_the_report(
    trained, closed_set_sheet, tmp_path, capsys
):
    table = pd.read_csv(closed_set_sheet, dtype=str)
    cohort = tmp_path / "cohort.csv"
    copies = table.iloc[[0, 0, 0]].copy()
    copies["a_id"] = [f"copy{i}" for i in range(3)]  # one clip three times (ids are unique)
    copies.to_csv(cohort, index=False)
    out = tmp_path / "eval"
    args = ["--checkpoint", trained, "--num-workers", 0, "--quiet", "--gallery", "none"]
    code, stdout, err = run_cli(capsys, *args, "--out", out, "--cohort", cohort)
    assert code == 0, err
    report = read_report(out)
    assert math.isfinite(report["metrics"]["eer"]) and math.isfinite(report["metrics"]["min_dcf"])
    assert "eer_asnorm" not in report["metrics"]
    skipped = report["evaluation"]["score_norm_skipped"]
    assert (
        "no spread" in skipped
        and f"- score_norm_skipped: {skipped}" in (out / "report.md").read_text()
    )
    assert "score normalisation (asnorm) skipped" in stdout
    assert any(line.split()[:1] == ["eer"] for line in stdout.splitlines())


@pytest.mark.slow
def test_score_norm_alone_takes_the_train_split_and_notes_its_shared_classes(
    trained, closed_set_sheet, tmp_path, capsys, monkeypatch
):
    from audioclf.evaluation import run as evaluation_run

    embedded = []
    embed_index = evaluation_run.embed_index
    monkeypatch.setattr(
        evaluation_run,
        "embed_index",
        lambda *args, **kwargs: (
            embedded.append(kwargs["description"]) or embed_index(*args, **kwargs)
        ),
    )
    out = tmp_path / "eval"
    code, stdout, err = run_cli(
        capsys, "--checkpoint", trained, "--index", closed_set_sheet, "--out", out,
        "--num-workers", 0, "--quiet", "--score-norm", "snorm",
    )  # fmt: skip
    assert code == 0, err
    assert embedded == ["embed val", "embed gallery"]  # the gallery's embeddings are the cohort's
    report = read_report(out)
    setup = report["evaluation"]
    assert setup["cohort"] == f"train split of {closed_set_sheet}" and setup["n_cohort"] == 72
    assert setup["score_norm"] == "snorm" and "cohort_top" not in setup
    assert math.isfinite(report["metrics"]["eer_snorm"]) and "eer_asnorm" not in report["metrics"]
    shared = [line for line in stdout.splitlines() if "cohort shares" in line]
    assert len(shared) == 1 and "shares 12 of the 12 evaluated classes" in shared[0]


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing sheet", "nope.csv: no such sheet; use --cohort train, or a sheet that exists"),
        ("not a sheet", "cohort.txt: no such sheet"),
        ("sheet without class column", "no_class.csv: index file"),
        ("one-row sheet", "has 1 row(s); it needs at least 2"),
        ("train cohort of the train split", "--split train overlaps the train cohort"),
        ("cohort with --score-norm none", "is unused with --score-norm none; drop one of them"),
        ("top of 1", "--cohort-top must be >= 2, got 1"),
        ("top with snorm", "--cohort-top 50 is AS-norm's; snorm takes no top N"),
    ],
)
@pytest.mark.filterwarnings("ignore:index file .* fewer than 2 items")  # the one-row sheet
def test_a_bad_cohort_is_one_line_exit_2_and_writes_nothing(
    trained, closed_set_sheet, tmp_path, capsys, case, message
):
    table = pd.read_csv(closed_set_sheet, dtype=str)
    out = tmp_path / "out"
    args = ["--checkpoint", trained, "--out", out, "--num-workers", 0, "--quiet"]
    sheet = tmp_path / {"missing sheet": "nope.csv", "not a sheet": "cohort.txt"}.get(case, "c.csv")
    if case == "not a sheet":
        sheet.write_text("path\n")
    elif case == "sheet without class column":
        sheet = tmp_path / "no_class.csv"
        table.drop(columns="a_cls").to_csv(sheet, index=False)
    elif case == "one-row sheet":
        table.head(1).to_csv(sheet, index=False)
    args += {
        "train cohort of the train split": ["--split", "train", "--gallery", "none", "--score-norm", "asnorm"],
        "cohort with --score-norm none": ["--cohort", sheet, "--score-norm", "none"],
        "top of 1": ["--cohort-top", 1],
        "top with snorm": ["--cohort-top", 50, "--score-norm", "snorm"],
    }.get(case, ["--cohort", sheet])  # fmt: skip
    code, stdout, err = run_cli(capsys, *args)
    assert code == 2 and stdout == ""
    assert err.startswith("python -m audioclf.evaluate: error: ") and err.count("\n") == 1
    assert message in err
    if case == "sheet without class column":
        assert "has no column 'a_cls'" in err and "Rename the column in the sheet" in err
    assert not out.exists()


def test_score_norm_and_cohort_default_from_each_other():
    from functools import partial

    from audioclf.metrics import resolve_score_norm

    score_norm_options = partial(resolve_score_norm, default_cohort="train")  # evaluate's
    assert score_norm_options(None, None, None) == ("none", None)  # off by default
    assert score_norm_options("none", None, None) == ("none", None)
    assert score_norm_options("asnorm", None, None) == ("asnorm", "train")
    assert score_norm_options("snorm", None, None) == ("snorm", "train")
    assert score_norm_options(None, "cohort.csv", None) == ("asnorm", "cohort.csv")
    assert score_norm_options(None, None, 50) == ("asnorm", "train")
    assert score_norm_options("snorm", "cohort.csv", None) == ("snorm", "cohort.csv")
    # search and the API have no default cohort: normalising needs one
    assert resolve_score_norm(None, None, None) == ("none", None)
    assert resolve_score_norm(None, "out/train", 50) == ("asnorm", "out/train")
    with pytest.raises(ValueError, match=r"score normalisation \(snorm\) needs a cohort"):
        resolve_score_norm("snorm", None, None)


def test_asnorm_keeps_300_cohort_scores_or_a_fifth_of_a_small_cohort():
    from audioclf.evaluation.metrics import MetricOptions, asnorm_top, compute_metrics

    assert [asnorm_top(None, n) for n in (10_000, 1500, 1000, 108, 4)] == [300, 300, 200, 21, 2]
    assert asnorm_top(50, 1000) == 50 and asnorm_top(50, 20) == 20  # at most the cohort: S-norm
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(40, 8)).astype(np.float32)
    names = np.array([f"c{i % 4}" for i in range(40)], dtype=object)
    asnorm = MetricOptions(score_norm="asnorm")
    evaluation = compute_metrics(emb, names, asnorm, cohort_emb=rng.normal(size=(60, 8)))
    assert (evaluation.setup["n_cohort"], evaluation.setup["cohort_top"]) == (60, 12)
    assert {"eer_asnorm", "min_dcf_asnorm"} <= set(evaluation.verification)
    with pytest.raises(ValueError, match="use none, or snorm / asnorm with cohort_emb"):
        compute_metrics(emb, names, MetricOptions(score_norm="snorm"))


def test_evaluate_options_are_named_as_python_callers_give_them(tmp_path, capsys):
    # Checked before anything is loaded (the checkpoint does not even exist): a Python caller
    # reads the option's name, the command line its flag; a misspelt option is a TypeError.
    from audioclf.evaluation import EvaluateOptions, evaluate

    missing = tmp_path / "none.pt"
    with pytest.raises(ValueError, match=r"^max_pairs must be >= 2, got 1$"):
        evaluate(missing, max_pairs=1)
    with pytest.raises(ValueError, match=r"^cohort_top must be >= 2, got 1$"):
        evaluate(missing, EvaluateOptions(cohort_top=1))
    with pytest.raises(TypeError, match="unknown option.s. max_pair; EvaluateOptions has"):
        evaluate(missing, max_pair=1)
    code, out, err = run_cli(capsys, "--checkpoint", missing, "--max-pairs", 1)
    assert code == 2 and err.endswith("error: --max-pairs must be >= 2, got 1\n")
    assert not (tmp_path / "eval").exists()
