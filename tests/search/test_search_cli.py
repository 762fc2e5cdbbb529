"""python -m audioclf.search: build an index beside PREFIX.npy / .parquet and query it with
another PREFIX or with audio files (through a tiny checkpoint); one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from audioclf.embed import main as embed_main
from audioclf.search import faiss_available, load
from audioclf.search.cli import main
from audioclf.search.collection import Collection
from tests.helpers import ROOT, make_checkpoint

NEIGHBOUR_COLUMNS = ["rank", "score", "class", "item", "id", "path"]
PREFIX_QUERY_COLUMNS = ["query", "query_class", "query_item", "query_path"]
needs_faiss = pytest.mark.skipif(not faiss_available(), reason="faiss is not installed")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def write_prefix(prefix: Path, n: int, dim: int = 16, seed: int = 0) -> Path:
    """PREFIX.npy (unit rows around 6 class centres) + PREFIX.parquet, as embed --index writes."""
    rng = np.random.default_rng(seed)
    classes = rng.integers(0, 6, n)
    centres = rng.normal(size=(6, dim))
    rows = (centres[classes] + rng.normal(scale=0.7, size=(n, dim))).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    np.save(prefix.with_name(prefix.name + ".npy"), rows)
    pd.DataFrame(
        {
            "row": np.arange(n),
            "id": [f"{prefix.name}_{i:03d}" for i in range(n)],
            "class": [f"c{c}" for c in classes],
            "item": [f"i{i % 4}" for i in range(n)],
            "path": [f"/clips/{prefix.name}_{i:03d}.wav" for i in range(n)],
        }
    ).to_parquet(prefix.with_name(prefix.name + ".parquet"), index=False)
    return prefix


def brute_force(queries: np.ndarray, rows: np.ndarray, k: int, drop=None) -> np.ndarray:
    similarity = queries @ rows.T
    if drop is not None:
        similarity[drop] = -np.inf
    return np.argsort(-similarity, axis=1, kind="stable")[:, :k]


@pytest.fixture
def prefixes(tmp_path):
    return write_prefix(tmp_path / "big", 300), write_prefix(tmp_path / "new", 25, seed=1)


@pytest.mark.parametrize("method", ["exact", pytest.param("ivf", marks=needs_faiss)])
def test_build_and_query_from_a_prefix_give_the_brute_force_neighbours(
    prefixes, tmp_path, capsys, method
):
    index_prefix, query_prefix = prefixes
    built = ["--method", "ivf", "--nlist", 4] if method == "ivf" else []
    code, out, err = run_cli(capsys, "build", index_prefix, "--quiet", *built)
    assert code == 0, err
    assert (tmp_path / f"big.{method}.json").is_file() and "saved" in out
    csv = tmp_path / "hits.csv"
    extra = ["--nprobe", 4] if method == "ivf" else []  # every list probed: exact neighbours
    code, out, err = run_cli(
        capsys, "query", index_prefix, "--query-prefix", query_prefix, "--k", 5, "--csv", csv,
        "--quiet", *extra,
    )  # fmt: skip
    assert code == 0, err
    table = pd.read_csv(csv)
    assert list(table.columns) == PREFIX_QUERY_COLUMNS + NEIGHBOUR_COLUMNS
    rows, queries = np.load(tmp_path / "big.npy"), np.load(tmp_path / "new.npy")
    expected = brute_force(queries, rows, 5)
    found = table["id"].str.removeprefix("big_").astype(int).to_numpy().reshape(25, 5)
    np.testing.assert_array_equal(found, expected)
    assert (table.groupby("query")["rank"].apply(list) == [[1, 2, 3, 4, 5]] * 25).all()
    scores = table["score"].to_numpy().reshape(25, 5)
    np.testing.assert_allclose(scores, np.take_along_axis(queries @ rows.T, expected, 1), atol=1e-5)
    assert f"{method}" in out and "wrote 125 rows" in out


def test_exclude_same_item_never_returns_own_item_rows(prefixes, tmp_path, capsys):
    index_prefix, _ = prefixes
    out_json = tmp_path / "dups.json"
    code, out, err = run_cli(
        capsys, "query", index_prefix, "--query-prefix", f"{index_prefix}.npy", "--k", 7,
        "--exclude-same-item", "--json", out_json, "--quiet",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out_json.read_text())
    assert (result["method"], result["k"]) == ("exact", 7) and len(result["queries"]) == 300
    rows = pd.read_parquet(tmp_path / "big.parquet")
    own = rows["class"] + "/" + rows["item"]
    emb = np.load(tmp_path / "big.npy")
    expected = brute_force(emb, emb, 7, drop=own.to_numpy()[:, None] == own.to_numpy()[None, :])
    for q, query in enumerate(result["queries"]):
        assert set(query) == {*PREFIX_QUERY_COLUMNS, "neighbours"}
        assert query["query"] == rows["id"][q]
        neighbours = query["neighbours"]
        assert all(set(n) == set(NEIGHBOUR_COLUMNS) for n in neighbours)
        assert all(
            (n["class"], n["item"]) != (query["query_class"], query["query_item"])
            for n in neighbours
        )
        assert [n["id"] for n in neighbours] == rows["id"].to_numpy()[expected[q]].tolist()


def test_the_default_output_is_a_table_per_query(prefixes, capsys):
    index_prefix, query_prefix = prefixes
    code, out, err = run_cli(
        capsys, "query", index_prefix, "--query-prefix", query_prefix, "--k", 2, "--quiet"
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("index ") and "top 2" in lines[0]
    assert sum(line.startswith("query new_") for line in lines) == 25
    assert lines[2].split() == NEIGHBOUR_COLUMNS and lines[3].split()[0] == "1"


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, tiny_demo):
    """24 rows of the tiny demo embedded by embed --index with an untrained tiny checkpoint,
    and copies of 3 of their files (in nested folders, beside a file that is not audio)."""
    root = tmp_path_factory.mktemp("search_audio")
    table = pd.read_excel(tiny_demo, dtype=str, engine="openpyxl").iloc[::6].head(24)
    table["path"] = [str(tiny_demo.parent / p) for p in table["path"]]
    sheet = root / "sheet.csv"
    table.to_csv(sheet, index=False)
    model = make_checkpoint(root / "model.pt", "conformer")
    prefix = root / "emb"
    assert embed_main(
        ["--model", str(model), "--index", str(sheet), "--save", str(prefix), "--quiet",
         "--num-workers", "0"]
    ) == 0  # fmt: skip
    queries = root / "queries"
    copies = {}
    for i, (row_id, path) in enumerate(zip(table["a_id"][:3], table["path"][:3], strict=True)):
        copy = queries / ("nested" if i % 2 else "") / f"q{i}.wav"
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
        copies[str(copy)] = row_id
    (queries / "notes.txt").write_text("not audio")
    return {"root": root, "model": model, "prefix": prefix, "queries": queries, "copies": copies}


def test_audio_queries_through_a_checkpoint(embedded, capsys):
    prefix, model = embedded["prefix"], embedded["model"]
    code, _, err = run_cli(capsys, "build", prefix, "--model", model, "--quiet")
    assert code == 0, err
    info = load(f"{prefix}.exact.json").info
    assert info["model"]["path"] == str(model.resolve()) and info["model"]["dim"] == 16
    assert info["model"]["adaptation"] is None
    assert Collection.open(prefix).made_by == info["model"]  # what embed --index recorded
    assert info["embeddings"] == {"rows": 24, "dim": 16, "table": "emb.parquet"}
    out_json = embedded["root"] / "audio.json"
    code, _, err = run_cli(
        capsys, "query", prefix, embedded["queries"], "--model", model, "--k", 3,
        "--json", out_json, "--device", "cpu", "--quiet",
    )  # fmt: skip
    assert code == 0 and err == "", err
    queries = json.loads(out_json.read_text())["queries"]
    assert {q["query"] for q in queries} == set(embedded["copies"])  # notes.txt is not audio
    for query in queries:  # a copy of an indexed file finds that file first
        first = query["neighbours"][0]
        assert first["id"] == embedded["copies"][query["query"]]
        assert first["score"] == pytest.approx(1.0, abs=1e-5)
        assert len(query["neighbours"]) == 3


def test_the_api_search_takes_a_cohort_as_the_cli_does(embedded, tmp_path, capsys):
    from audioclf.api import load as load_model

    prefix, model = embedded["prefix"], embedded["model"]
    model_api = load_model(model, device="cpu")
    table = model_api.search([embedded["queries"]], prefix, k=3, cohort=prefix, cohort_top=5)
    out_json = tmp_path / "normed.json"
    code, _, err = run_cli(
        capsys, "query", prefix, embedded["queries"], "--model", model, "--k", 3, "--cohort",
        prefix, "--cohort-top", 5, "--json", out_json, "--device", "cpu", "--quiet",
    )  # fmt: skip
    assert code == 0, err
    queries = json.loads(out_json.read_text())["queries"]
    cli = {(q["query"], n["id"]): n["norm_score"] for q in queries for n in q["neighbours"]}
    api = {(q, i): s for q, i, s in zip(table["query"], table["id"], table["norm_score"])}
    assert len(table) == len(cli) == 9 and api.keys() == cli.keys()
    assert all(np.isfinite(api[key]) and api[key] == pytest.approx(cli[key]) for key in cli)


def test_a_cohort_of_another_dimension_is_refused_before_the_audio_is_embedded(
    embedded, tmp_path, capsys, monkeypatch
):
    def embedding(*args, **kwargs):
        raise AssertionError("the queries were embedded before the cohort was checked")

    monkeypatch.setattr("audioclf.search.cli.audio_queries", embedding)
    cohort = write_prefix(tmp_path / "cohort", 20, dim=8)
    code, out, err = run_cli(
        capsys, "query", embedded["prefix"], embedded["queries"], "--model", embedded["model"],
        "--cohort", cohort, "--device", "cpu",
    )  # fmt: skip
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "the cohort (20 rows of" in err and "is 8-d but the index" in err


def test_a_query_model_of_another_file_is_a_warning(embedded, tmp_path, capsys):
    other = make_checkpoint(tmp_path / "other.pt", "conformer", seed=1)
    code, _, err = run_cli(capsys, "build", embedded["prefix"], "--model", embedded["model"])
    assert code == 0, err
    code, out, err = run_cli(
        capsys, "query", embedded["prefix"], embedded["queries"], "--model", other, "--quiet",
        "--device", "cpu",
    )  # fmt: skip
    assert code == 0 and "query " in out
    assert err.count("\n") == 1 and "was embedded by" in err and f"not by --model {other}" in err


def test_an_adapted_collection_says_so_and_an_unadapted_query_model_is_a_warning(
    embedded, tmp_path, capsys
):
    model = make_checkpoint(tmp_path / "cnn.pt")  # BatchNorm layers: --adapt changes them
    prefix = tmp_path / "adapted"
    argv = ["--model", model, "--index", embedded["root"] / "sheet.csv", "--save", prefix]
    more = ["--adapt", embedded["queries"], "--quiet", "--num-workers", "0"]
    assert embed_main([str(arg) for arg in argv + more]) == 0
    made_by = Collection.open(prefix).made_by
    assert made_by["path"] == str(model.resolve()) and made_by["adaptation"]["clips"] == 3
    assert "adapted by adabn on 3 unlabelled clips" in made_by["description"]
    code, _, err = run_cli(capsys, "build", prefix, "--quiet")  # no --model: the table's record
    assert code == 0, err
    assert load(f"{prefix}.exact.json").info["model"] == made_by
    code, out, err = run_cli(
        capsys, "query", prefix, embedded["queries"], "--model", model, "--quiet",
        "--device", "cpu",
    )  # fmt: skip
    assert code == 0 and "query " in out
    assert err.count("\n") == 1 and "their BatchNorm statistics differ (--adapt)" in err


def test_a_model_of_another_dimension_is_one_line(embedded, tmp_path, capsys):
    small = write_prefix(tmp_path / "small", 40, dim=8)
    for argv in (
        ["build", small, "--model", embedded["model"]],
        ["query", small, embedded["queries"], "--model", embedded["model"], "--device", "cpu"],
    ):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1
        assert err.startswith("python -m audioclf.search: error: --model ")
        assert "16-d embeddings" in err and "8-d" in err


def test_query_prefix_of_another_dimension_is_one_line(prefixes, tmp_path, capsys):
    other = write_prefix(tmp_path / "other", 10, dim=8)
    code, out, err = run_cli(capsys, "query", prefixes[0], "--query-prefix", other, "--quiet")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "are 8-d but the index" in err and "is 16-d" in err and "other.npy" in err


def normalised_reference(queries, rows, cohort, top) -> np.ndarray:
    """S-norm / AS-norm of every (query, row) cosine, written out: each side's mean and
    population std over its `top` highest cosines against the cohort."""

    def stats(emb):
        against = np.sort(emb.astype(np.float64) @ cohort.T.astype(np.float64), axis=1)[:, -top:]
        return against.mean(axis=1, keepdims=True), against.std(axis=1, keepdims=True)

    (mean_q, std_q), (mean_r, std_r) = stats(queries), stats(rows)
    raw = queries.astype(np.float64) @ rows.T.astype(np.float64)
    return 0.5 * ((raw - mean_q) / std_q + (raw - mean_r.T) / std_r.T)


@pytest.mark.parametrize("norm", ["asnorm", "snorm"])
def test_a_cohort_adds_normalised_scores_and_keeps_the_ranking(prefixes, tmp_path, capsys, norm):
    index_prefix, query_prefix = prefixes
    cohort = write_prefix(tmp_path / "cohort", 60, seed=2)
    plain, normed = tmp_path / "plain.csv", tmp_path / "normed.json"
    query = ["query", index_prefix, "--query-prefix", query_prefix, "--k", 4, "--quiet"]
    assert run_cli(capsys, *query, "--csv", plain)[0] == 0
    flags = ["--cohort-top", 10] if norm == "asnorm" else ["--score-norm", "snorm"]
    code, out, err = run_cli(capsys, *query, "--cohort", cohort, *flags, "--json", normed)
    assert code == 0, err
    top = 10 if norm == "asnorm" else 60
    assert f"norm_score: {norm} (" in out and ("top 10 of 60 rows" in out) == (norm == "asnorm")
    result = json.loads(normed.read_text())
    assert result["score_norm"] == {"method": norm, "cohort": str(cohort), **(
        {"top": 10} if norm == "asnorm" else {}
    )}  # fmt: skip
    neighbours = [n for q in result["queries"] for n in q["neighbours"]]
    before = pd.read_csv(plain)
    assert [n["id"] for n in neighbours] == before["id"].tolist()  # the ranking stays by cosine
    np.testing.assert_allclose([n["score"] for n in neighbours], before["score"], atol=1e-6)
    rows, queries = np.load(tmp_path / "big.npy"), np.load(tmp_path / "new.npy")
    reference = normalised_reference(queries, rows, np.load(tmp_path / "cohort.npy"), top)
    hit = before["id"].str.removeprefix("big_").astype(int).to_numpy()
    expected = reference[np.repeat(np.arange(25), 4), hit]
    np.testing.assert_allclose([n["norm_score"] for n in neighbours], expected, atol=1e-6)
    assert list(neighbours[0]) == ["rank", "score", "norm_score", "class", "item", "id", "path"]
    code, out, _ = run_cli(capsys, *query, "--cohort", cohort, *flags)  # the table shows it
    assert code == 0 and out.splitlines()[2].split()[:3] == ["rank", "score", "norm_score"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--score-norm", "asnorm"], "score normalisation (asnorm) needs a cohort: --cohort C"),
        (["--cohort-top", 5], "score normalisation (asnorm) needs a cohort: --cohort C"),
        (["--cohort", "COHORT", "--score-norm", "none"], "is unused with --score-norm none"),
        (["--cohort", "COHORT", "--score-norm", "snorm", "--cohort-top", 5], "is AS-norm's"),
        (["--cohort", "COHORT", "--cohort-top", 1], "--cohort-top must be >= 2"),
        (["--cohort", "NOPE"], "--cohort "),
        (["--cohort", "OTHER_DIM"], "the cohort (60 rows of"),
        (["--cohort", "ONE_ROW"], "it needs >= 2"),
    ],
)
def test_score_norm_flags_that_do_not_fit_are_one_line(prefixes, tmp_path, capsys, flags, message):
    index_prefix, query_prefix = prefixes
    named = {
        "COHORT": write_prefix(tmp_path / "cohort", 60, seed=2),
        "NOPE": tmp_path / "nope",
        "OTHER_DIM": write_prefix(tmp_path / "other", 60, dim=8),
        "ONE_ROW": write_prefix(tmp_path / "one", 1),
    }
    flags = [named.get(flag, flag) for flag in flags]
    code, out, err = run_cli(capsys, "query", index_prefix, "--query-prefix", query_prefix, *flags)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("python -m audioclf.search: error: ") and message in err


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing prefix", "nope.npy and "),
        ("missing query prefix", "--query-prefix"),
        ("no queries", "give the queries as audio files"),
        ("audio without model", "audio queries need --model"),
        ("exclude with audio", "--exclude-same-item needs --query-prefix"),
        ("bad k", "--k must be >= 1"),
        ("no such index", "build it with python -m audioclf.search build"),
        ("stale index", "is stale"),
        ("nprobe on exact", "--nprobe and --ef-search apply to"),
    ],
)
def test_bad_input_is_one_line_with_exit_2(prefixes, tmp_path, capsys, case, message):
    index_prefix, query_prefix = prefixes
    argv = ["query", index_prefix, "--query-prefix", query_prefix]
    if case == "missing prefix":
        argv[1] = tmp_path / "nope"
    elif case == "missing query prefix":
        argv[3] = tmp_path / "nope"
    elif case == "no queries":
        argv = argv[:2]
    elif case == "audio without model":
        argv = [*argv[:2], tmp_path]
    elif case == "exclude with audio":
        argv = [*argv[:2], tmp_path, "--model", tmp_path / "m.pt", "--exclude-same-item"]
    elif case == "bad k":
        argv += ["--k", 0]
    elif case == "no such index":
        argv += ["--method", "hnsw"]
        if not faiss_available():
            message = "needs faiss"
    elif case == "stale index":
        assert main(["build", str(index_prefix), "--quiet"]) == 0
        np.save(f"{index_prefix}.npy", -np.load(f"{index_prefix}.npy"))  # rewritten since
    else:
        argv += ["--nprobe", 3]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("python -m audioclf.search: error: ") and message in err


def test_several_saved_indexes_need_a_method(prefixes, capsys, monkeypatch):
    index_prefix, query_prefix = prefixes
    assert main(["build", str(index_prefix), "--quiet"]) == 0
    Path(f"{index_prefix}.hnsw.json").write_text("{}")  # another saved index, as far as names go
    code, _, err = run_cli(capsys, "query", index_prefix, "--query-prefix", query_prefix)
    assert code == 2 and "2 saved indexes (exact, hnsw); pick one with --method" in err


def test_an_approximate_method_without_faiss_is_one_line(prefixes, capsys, monkeypatch):
    monkeypatch.setattr("audioclf.search.collection.faiss_available", lambda: False)
    code, out, err = run_cli(capsys, "build", prefixes[0], "--method", "ivf")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "needs faiss, which is not installed: pip install faiss-cpu" in err


@pytest.mark.slow
def test_help_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "audioclf.search", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--exclude-same-item" in result.stdout and "build PREFIX" in result.stdout


@pytest.fixture(scope="module")
def adapted(embedded, tmp_path_factory) -> dict:
    """A BatchNorm model, and the sheet embedded by it adapted on the queries (embed --adapt)."""
    root = tmp_path_factory.mktemp("adapted")
    model = make_checkpoint(root / "cnn.pt")
    prefix = root / "adapted"
    argv = ["--model", model, "--index", embedded["root"] / "sheet.csv", "--save", prefix]
    more = ["--adapt", embedded["queries"], "--quiet", "--num-workers", "0"]
    assert embed_main([str(arg) for arg in argv + more]) == 0
    return {"model": model, "prefix": prefix, "queries": embedded["queries"]}


def copy_collection(prefix: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for suffix in (".npy", ".parquet"):
        shutil.copy(f"{prefix}{suffix}", folder / f"c{suffix}")
    return folder / "c"


ADAPTED_WARNING = "their BatchNorm statistics differ (--adapt)"


@pytest.mark.parametrize("build", ["none", "without --model", "with --model"])
def test_every_cli_path_warns_of_an_unadapted_query_model(adapted, tmp_path, capsys, build):
    prefix = copy_collection(adapted["prefix"], tmp_path)  # straight from embed --adapt
    if build != "none":
        more = ["--model", adapted["model"]] if build == "with --model" else []
        code, out, err = run_cli(capsys, "build", prefix, "--quiet", *more)
        assert code == 0, err
        warned = more and err.count("\n") == 1 and ADAPTED_WARNING in err
        assert warned or (not more and err == ""), err  # build --model M: M is checked too
        assert load(f"{prefix}.exact.json").info["model"] == Collection.open(prefix).made_by
    code, out, err = run_cli(
        capsys, "query", prefix, adapted["queries"], "--model", adapted["model"], "--quiet",
        "--device", "cpu",
    )  # fmt: skip
    assert code == 0 and "query " in out
    assert err.count("\n") == 1 and ADAPTED_WARNING in err, err


def test_model_search_warns_of_an_unadapted_model_and_not_of_the_adapted_one(adapted):
    import audioclf

    model = audioclf.load(adapted["model"], device="cpu")
    with pytest.warns(UserWarning, match=r"was embedded by .* their BatchNorm statistics differ"):
        model.search([adapted["queries"]], adapted["prefix"], k=2)
    model.adapt([adapted["queries"]])  # the same statistics as the collection's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(model.search([adapted["queries"]], adapted["prefix"], k=2)) == 6
