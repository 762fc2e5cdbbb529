"""The embed CLI: class ranking of new files against a gallery sheet, --save, cache, errors."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from audioclf.embed import main
from audioclf.embedding import gallery
from audioclf.embedding import index as index_embedding
from audioclf.embedding.parts import parts_manifest
from audioclf.export import export_model
from audioclf.inference import find_files, load_embedder
from audioclf.inference.adapt import adapt
from tests.helpers import make_checkpoint

CLASSES = ("c00", "c01", "c02", "c03")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_demo):
    """A gallery of one file per class, copies of those files as queries (in nested folders,
    beside a file that is not audio), and an untrained Conformer checkpoint.

    An untrained model is enough: a file identical to a gallery entry has the same embedding,
    so it scores 1.0 against its own class (a one-file class's centroid is that file). The tiny
    Conformer keeps other classes well below that (< 0.998); the untrained CNN does not.
    """
    root = tmp_path_factory.mktemp("embed")
    table = pd.read_excel(tiny_demo, dtype=str, engine="openpyxl")
    table = table[table["a_cls"].isin(CLASSES) & table["a_id"].str.endswith("_i0_00")].copy()
    table["path"] = [str(tiny_demo.parent / p) for p in table["path"]]
    gallery = root / "gallery.csv"
    table.to_csv(gallery, index=False)
    queries = root / "queries"
    expected = {}
    for i, (cls, path) in enumerate(zip(table["a_cls"], table["path"], strict=True)):
        copy = queries / ("nested" if i % 2 else "") / f"query_{cls}.wav"
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
        expected[str(copy)] = cls
    (queries / "notes.txt").write_text("not audio")
    (root / "model").mkdir()
    model = make_checkpoint(root / "model" / "best.pt", "conformer")
    return {
        "root": root,
        "gallery": gallery,
        "queries": queries,
        "expected": expected,
        "model": model,
    }


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def parse_rankings(stdout: str) -> dict[str, list[tuple[str, float]]]:
    """{file: [(class, score), ...]} from the printed blocks."""
    rankings: dict[str, list[tuple[str, float]]] = {}
    current = None
    for line in stdout.splitlines()[1:]:  # the first line describes model and gallery
        if line.startswith("saved "):
            break
        if not line.startswith(" "):
            current = line
            rankings[current] = []
        else:
            _, cls, score = line.split()
            rankings[current].append((cls, float(score)))
    return rankings


def embed_cli(capsys, setup, *extra, model=None):
    code, out, err = run_cli(
        capsys,
        "--model",
        model or setup["model"],
        "--gallery",
        setup["gallery"],
        "--quiet",
        "--device",
        "cpu",
        *extra,
        setup["queries"],
    )
    assert code == 0, err
    return out, parse_rankings(out)


def test_files_from_the_gallery_rank_their_own_class_first(setup, capsys):
    out, rankings = embed_cli(capsys, setup, "--top", "3")
    assert sorted(rankings) == sorted(setup["expected"])  # folders searched recursively
    for path, ranking in rankings.items():
        assert len(ranking) == 3
        assert [score for _, score in ranking] == sorted((s for _, s in ranking), reverse=True)
        top_class, top_score = ranking[0]
        assert top_class == setup["expected"][path]
        assert top_score == pytest.approx(1.0, abs=1e-4)
        assert ranking[1][1] < top_score - 1e-3
    assert "4 files, 4 classes" in out.splitlines()[0]


def test_save_writes_embeddings_and_file_names(setup, capsys, tmp_path):
    prefix = tmp_path / "out" / "new"
    out, rankings = embed_cli(capsys, setup, "--save", prefix, "--top", "1")
    embeddings = np.load(f"{prefix}.npy")
    table = pd.read_csv(f"{prefix}.csv")
    assert embeddings.shape == (4, 16) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    assert table["file"].tolist() == list(rankings)  # rows in the printed order
    assert table["top_class"].tolist() == [setup["expected"][f] for f in table["file"]]
    assert f"saved {prefix}.npy and {prefix}.csv" in out


def test_gallery_embeddings_are_cached_per_sheet_content(setup, capsys):
    cache = setup["model"].parent / gallery.CACHE_DIR
    shutil.rmtree(cache, ignore_errors=True)
    first, ranked_first = embed_cli(capsys, setup)
    assert "cached" not in first.splitlines()[0] and len(list(cache.glob("gallery-*.npz"))) == 1
    second, ranked_second = embed_cli(capsys, setup)
    assert "cached" in second.splitlines()[0]
    assert ranked_second == ranked_first

    edited = setup["root"] / "edited.csv"  # another sheet content → its own cache entry
    pd.read_csv(setup["gallery"]).iloc[:3].to_csv(edited, index=False)
    code, out, _ = run_cli(
        capsys, "--model", setup["model"], "--gallery", edited, "--quiet", setup["queries"]
    )
    assert code == 0 and "3 files, 3 classes)" in out.splitlines()[0]
    assert len(list(cache.glob("gallery-*.npz"))) == 2
    third, _ = embed_cli(capsys, setup, "--no-cache")
    assert "cached" not in third.splitlines()[0]


def test_an_adapted_model_says_so_and_keeps_its_own_gallery_cache(setup, capsys):
    cache = setup["model"].parent / gallery.CACHE_DIR
    shutil.rmtree(cache, ignore_errors=True)
    plain, _ = embed_cli(capsys, setup)
    source = setup["root"] / "gallery_audio"  # the new source: the gallery's own files
    source.mkdir(exist_ok=True)
    for path in pd.read_csv(setup["gallery"])["path"]:
        shutil.copyfile(path, source / Path(path).name)
    first, _ = embed_cli(capsys, setup, "--adapt", source)
    header = first.splitlines()[0]
    assert f"adapted by adabn on 4 unlabelled clips of {source}" in header
    assert "cached" not in header  # not the unadapted model's gallery
    again, _ = embed_cli(capsys, setup, "--adapt", source)
    assert "cached" in again.splitlines()[0] and len(list(cache.glob("gallery-*.npz"))) == 2
    assert first.splitlines()[1:] == again.splitlines()[1:]
    assert first.splitlines()[1:] != plain.splitlines()[1:]  # the statistics changed the scores


def test_index_parts_of_an_adapted_model_are_its_own(setup, tmp_path):
    model = load_embedder(setup["model"], torch.device("cpu"))
    adapted = adapt(model, [setup["queries"]])
    assert parts_manifest(model, 4096)["model"]["adaptation"] is None
    assert parts_manifest(adapted, 4096)["model"]["adaptation"] == adapted.adaptation
    sheet = setup["gallery"]
    assert gallery.gallery_cache_file(model, sheet, "") != gallery.gallery_cache_file(
        adapted, sheet, ""
    )


@pytest.mark.slow  # exports to TorchScript and ONNX
@pytest.mark.filterwarnings("ignore:`torch.jit")  # deprecated: Future- or DeprecationWarning (2.11)
def test_exports_rank_like_the_checkpoint(setup, capsys, tmp_path):
    # One file per batch: in a padded batch a clip's last log-mel frames see the batch's zero
    # padding (a lone clip sees a reflection), which would blur the comparison of a model
    # with the front end against one fed each file's own log-mel.
    lone = ("--no-cache", "--batch-size", "1")
    _, reference = embed_cli(capsys, setup, *lone)
    exports = [("torchscript", True)]
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401

        exports.append(("onnx", False))  # ONNX without the front end: log-mel computed here
    except ImportError:
        pass
    for fmt, frontend in exports:
        out = tmp_path / f"model.{fmt}"
        export_model(setup["model"], fmt, out, frontend=frontend)
        _, rankings = embed_cli(capsys, setup, *lone, model=out)
        assert list(rankings) == list(reference), fmt
        for path, ranking in rankings.items():
            assert ranking[0][0] == reference[path][0][0] == setup["expected"][path], fmt
            # Lower ranks may swap places where scores tie within the tolerance.
            scores, expected = dict(ranking), dict(reference[path])
            assert scores.keys() == expected.keys()
            for cls, score in scores.items():
                assert score == pytest.approx(expected[cls], abs=2e-4), (fmt, path, cls)


def write_sheet(path: Path, setup, drop: str | None = None) -> Path:
    table = pd.read_csv(setup["gallery"])
    (table.drop(columns=drop) if drop else table).to_csv(path, index=False)
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty folder", "no .wav / .flac / .ogg files found"),
        ("missing path", "does not exist"),
        ("npy for an audio model", "the model takes audio, not .npy files"),
        ("gallery without classes", "has no column 'a_cls'"),
        ("unreadable audio", "cannot read audio file"),
        ("export without sidecar", "needs its sidecar"),
    ],
)
def test_errors_exit_2_with_one_line(setup, capsys, tmp_path, case, message):
    gallery, inputs, model = setup["gallery"], [setup["queries"]], setup["model"]
    if case == "empty folder":
        (tmp_path / "empty" / "sub").mkdir(parents=True)
        inputs = [tmp_path / "empty"]
    elif case == "missing path":
        inputs = [tmp_path / "nothing.wav"]
    elif case == "npy for an audio model":
        np.save(tmp_path / "feats.npy", np.zeros((10, 32), np.float32))
        inputs = [tmp_path / "feats.npy"]
    elif case == "gallery without classes":
        gallery = write_sheet(tmp_path / "no_class.csv", setup, drop="a_cls")
    elif case == "unreadable audio":
        broken = tmp_path / "broken.wav"
        broken.write_bytes(b"RIFF but not really a wav file")
        inputs = [broken]
    else:
        model = tmp_path / "model.onnx"
        model.write_bytes(b"onnx")
    code, out, err = run_cli(capsys, "--model", model, "--gallery", gallery, "--quiet", *inputs)
    assert code == 2 and out == ""
    assert err.startswith("python -m audioclf.embed: error: ") and err.count("\n") == 1
    assert message in err
    if case == "unreadable audio":
        assert str(tmp_path / "broken.wav") in err


def test_folders_are_searched_for_every_audio_format_prepare_reads(tmp_path):
    from audioclf.config import FeaturesConfig

    for name in ("a.aiff", "b.flac", "sub/c.WAV", "d.mp3", "notes.txt", "e.npy"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    found = find_files([tmp_path], FeaturesConfig())
    assert [p.relative_to(tmp_path).as_posix() for p in found] == [
        "a.aiff",
        "b.flac",
        "d.mp3",
        "sub/c.WAV",
    ]


def test_help_explains_inputs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--gallery" in text and "centroid" in text and "sidecar" in text


def test_one_unreadable_file_is_named_and_the_others_are_embedded(setup, capsys, tmp_path):
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF but not really a wav file")
    code, out, err = run_cli(
        capsys,
        "--model",
        setup["model"],
        "--gallery",
        setup["gallery"],
        "--quiet",
        "--device",
        "cpu",
        setup["queries"],
        broken,
    )
    assert code == 1
    rankings = parse_rankings(out)
    assert set(rankings) == set(setup["expected"])  # every readable query was ranked
    assert err.count("\n") == 1 and "skipped" in err and str(broken) in err
    assert "cannot read audio file" in err


def test_a_model_that_gives_nan_is_refused(setup, capsys, tmp_path):
    import torch

    from audioclf import checkpoint

    ckpt = checkpoint.load(setup["model"])
    ckpt["model"] = {
        k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
        for k, v in ckpt["model"].items()
    }
    (tmp_path / "nan").mkdir()
    torch.save(ckpt, tmp_path / "nan" / "best.pt")
    code, out, err = run_cli(
        capsys,
        "--model",
        tmp_path / "nan" / "best.pt",
        "--gallery",
        setup["gallery"],
        "--quiet",
        "--device",
        "cpu",
        setup["queries"],
    )
    assert code == 2 and out == "" and "NaN/inf embeddings" in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------
# --index SHEET --save PREFIX: every row of a sheet, in resumable chunks


@pytest.fixture(scope="module")
def sheet(setup, tiny_demo):
    """48 rows of the demo (4 classes x 3 items x 4 ids) with absolute paths and a split
    column (id 00 of each item → val)."""
    table = pd.read_excel(tiny_demo, dtype=str, engine="openpyxl")
    table = table[table["a_cls"].isin(CLASSES)].copy()
    table["path"] = [str(tiny_demo.parent / p) for p in table["path"]]
    table["split"] = np.where(table["a_id"].str.endswith("_00"), "val", "train")
    path = setup["root"] / "sheet.csv"
    table.to_csv(path, index=False)
    return path


def index_cli(capsys, setup, sheet, prefix, *extra):
    return run_cli(
        capsys,
        "--model",
        setup["model"],
        "--index",
        sheet,
        "--save",
        prefix,
        "--quiet",
        "--device",
        "cpu",
        "--num-workers",
        0,
        *extra,
    )


def saved(prefix) -> tuple[np.ndarray, pd.DataFrame]:
    return np.load(f"{prefix}.npy"), pd.read_parquet(f"{prefix}.parquet")


def test_index_mode_matches_embed_paths_row_for_row(setup, sheet, capsys, tmp_path, monkeypatch):
    from audioclf.inference import LoadedEmbedder, embed_paths

    monkeypatch.setattr(index_embedding, "CHUNK_ROWS", 16)
    prefix = tmp_path / "out" / "all"
    code, out, err = index_cli(capsys, setup, sheet, prefix, "--batch-size", 8, "--num-workers", 1)
    assert code == 0, err
    table = pd.read_csv(sheet, dtype=str)
    embeddings, rows = saved(prefix)
    assert embeddings.shape == (48, 16) and embeddings.dtype == np.float32
    assert list(rows.columns) == ["row", "id", "class", "item", "path"]
    assert rows["row"].tolist() == list(range(2, 50))  # the sheet's own row numbers
    assert rows["id"].tolist() == table["a_id"].tolist()
    assert rows["class"].tolist() == table["a_cls"].tolist()
    assert rows["path"].tolist() == table["path"].tolist()
    model = LoadedEmbedder.from_checkpoint(setup["model"], torch.device("cpu"))
    reference = embed_paths(model, table["path"].tolist(), batch_size=8)[1]
    np.testing.assert_allclose(embeddings, reference, atol=1e-6)
    assert "48 rows in 3 chunk(s)" in out and f"saved {prefix}.npy (48 x 16 float32)" in out
    assert not (tmp_path / "out" / "all.parts").exists()  # parts removed once assembled
    assert not (tmp_path / "out" / "all.skipped.csv").exists()

    code, out, err = index_cli(capsys, setup, sheet, tmp_path / "val", "--split", "val")
    assert code == 0, err
    val_embeddings, val_rows = saved(tmp_path / "val")
    assert val_rows["id"].tolist() == [i for i in table["a_id"] if i.endswith("_00")]
    np.testing.assert_allclose(
        val_embeddings, embeddings[val_rows["row"].to_numpy() - 2], atol=1e-5
    )


class Killed(Exception):
    """The process dying after some chunks."""


def test_a_killed_run_resumes_without_recomputing_finished_chunks(
    setup, sheet, capsys, tmp_path, monkeypatch
):
    monkeypatch.setattr(index_embedding, "CHUNK_ROWS", 8)  # 6 chunks
    code, _, err = index_cli(capsys, setup, sheet, tmp_path / "straight")
    assert code == 0, err
    reference, reference_rows = saved(tmp_path / "straight")

    real_write = index_embedding.write_part
    writes = []

    def dying_write(path, part):
        if len(writes) == 3:
            raise Killed()
        writes.append(path.name)
        return real_write(path, part)

    monkeypatch.setattr(index_embedding, "write_part", dying_write)
    prefix = tmp_path / "resumed"
    with pytest.raises(Killed):
        index_cli(capsys, setup, sheet, prefix)
    parts = tmp_path / "resumed.parts"
    assert (
        sorted(p.name for p in parts.glob("chunk-*"))
        == writes
        == ["chunk-000000.npz", "chunk-000001.npz", "chunk-000002.npz"]
    )
    assert not (tmp_path / "resumed.npy").exists()
    (parts / "chunk-000002.npz").write_bytes(b"half a file")  # a damaged part is embedded again
    table = pd.read_csv(sheet, dtype=str)
    ids, paths = table["a_id"].to_numpy(str)[8:16], table["path"].to_numpy(str)[8:16]
    assert index_embedding.read_part(parts / "chunk-000001.npz", ids, paths, 8, 16) is not None
    edited = ids.copy()
    edited[3] = "renamed"  # a part made for other rows (an edited sheet) is not taken
    assert index_embedding.read_part(parts / "chunk-000001.npz", edited, paths, 8, 16) is None
    assert index_embedding.read_part(parts / "chunk-000001.npz", ids, paths[::-1], 8, 16) is None
    assert index_embedding.read_part(parts / "chunk-000002.npz", ids, paths, 16, 16) is None
    monkeypatch.setattr(index_embedding, "write_part", real_write)

    # Another model must not finish this run.
    other = make_checkpoint(tmp_path / "other.pt", "conformer", seed=1)
    code, out, err = run_cli(
        capsys, "--model", other, "--index", sheet, "--save", prefix, "--quiet", "--num-workers", 0
    )
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"{parts} holds the unfinished work of another run" in err and "model" in err

    embedded = []
    real_extract = index_embedding.embed_dataset

    def recording_extract(*args, positions, **kwargs):
        embedded.extend(positions)
        return real_extract(*args, positions=positions, **kwargs)

    monkeypatch.setattr(index_embedding, "embed_dataset", recording_extract)
    code, out, err = index_cli(capsys, setup, sheet, prefix)
    assert code == 0, err
    assert embedded == list(range(16, 48))  # chunks 0 and 1 were taken as they were
    assert "48 rows in 6 chunk(s), 2 finished earlier" in out
    embeddings, rows = saved(prefix)
    np.testing.assert_array_equal(embeddings, reference)
    pd.testing.assert_frame_equal(rows, reference_rows)
    assert not parts.exists()


def test_an_assembly_that_fails_leaves_the_earlier_pair_and_a_rerun_its_temporaries(
    setup, sheet, capsys, tmp_path, monkeypatch
):
    prefix = tmp_path / "all"
    assert index_cli(capsys, setup, sheet, prefix)[0] == 0
    earlier = {suffix: Path(f"{prefix}{suffix}").read_bytes() for suffix in (".npy", ".parquet")}
    reordered = tmp_path / "reordered.csv"  # the same rows in another order: as many rows
    pd.read_csv(sheet, dtype=str).iloc[::-1].to_csv(reordered, index=False)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    import pyarrow.parquet as pq  # noqa: PLC0415

    monkeypatch.setattr(pq, "write_table", full_disk)  # the disk fills while the table is written
    code, _, err = index_cli(capsys, setup, reordered, prefix)
    assert code == 2 and f"cannot write {prefix}.parquet: No space left" in err
    assert earlier == {s: Path(f"{prefix}{s}").read_bytes() for s in earlier}  # one run's pair
    monkeypatch.undo()
    killed = [tmp_path / f".all{suffix}.4242.0123abcd.tmp" for suffix in earlier]
    for path in killed:  # what a run killed while assembling leaves
        path.write_bytes(b"half")
    assert index_cli(capsys, setup, reordered, prefix)[0] == 0
    assert not [path for path in killed if path.exists()]
    embeddings, rows = saved(prefix)
    assert rows["id"].tolist() == pd.read_csv(reordered, dtype=str)["a_id"].tolist()
    np.testing.assert_allclose(embeddings[::-1], np.load(io.BytesIO(earlier[".npy"])), atol=1e-6)


def test_unreadable_files_stop_the_run_or_are_skipped(setup, sheet, capsys, tmp_path):
    table = pd.read_csv(sheet, dtype=str)
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF, but not audio")
    table.loc[5, "path"] = str(broken)
    bad = tmp_path / "bad.csv"
    table.to_csv(bad, index=False)
    code, out, err = index_cli(capsys, setup, bad, tmp_path / "failed")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "index row 7" in err and str(broken) in err and "pass --skip-bad-files" in err
    assert not (tmp_path / "failed.npy").exists()

    table.loc[9, "path"] = str(tmp_path / "missing.wav")
    table.to_csv(bad, index=False)
    code, out, err = index_cli(capsys, setup, bad, tmp_path / "failed")
    assert code == 2 and err.count("\n") == 1  # an index error, before anything is embedded
    assert "row 11: " in err and "missing.wav" in err and "pass --skip-bad-files" in err

    code, out, err = index_cli(capsys, setup, bad, tmp_path / "kept", "--skip-bad-files")
    assert code == 0, err
    embeddings, rows = saved(tmp_path / "kept")
    assert len(embeddings) == len(rows) == 46
    assert rows["id"].tolist() == table["a_id"].drop([5, 9]).tolist()
    skipped = pd.read_csv(tmp_path / "kept.skipped.csv")
    assert list(skipped.columns) == ["row", "id", "path", "reason"]
    assert skipped["row"].tolist() == [7, 11]
    assert skipped["path"].tolist() == [str(broken), str(tmp_path / "missing.wav")]
    assert all(
        str(path) in reason for path, reason in zip(skipped["path"], skipped["reason"], strict=True)
    )
    assert "skipped 2 unreadable file(s)" in out and "kept.skipped.csv" in out

    code, _, err = index_cli(capsys, setup, sheet, tmp_path / "kept")  # all readable now
    assert code == 0, err
    assert not (tmp_path / "kept.skipped.csv").exists()  # no stale list of the earlier run


@pytest.mark.parametrize(
    "case, message",
    [
        ("index without save", "--index needs --save PREFIX"),
        ("index with files", "drop audio files"),
        ("index with gallery", "drop --gallery"),
        ("nothing to do", "give audio files or folders and --gallery SHEET"),
        ("split without index", "--split applies to --index"),
        ("absent split", "has no 'test' split"),
        ("sheet without classes", "has no column 'a_cls'"),
        ("bad workers", "--num-workers must be >= 0"),
    ],
)
def test_index_errors_exit_2_with_one_line(setup, sheet, capsys, tmp_path, case, message):
    args = ["--model", setup["model"], "--quiet", "--index", sheet, "--save", tmp_path / "x"]
    if case == "index without save":
        args = args[:-2]
    elif case == "index with files":
        args.append(setup["queries"])
    elif case == "index with gallery":
        args += ["--gallery", setup["gallery"]]
    elif case == "nothing to do":
        args = args[:3]
    elif case == "split without index":
        args = [*args[:3], "--gallery", setup["gallery"], "--split", "val", setup["queries"]]
    elif case == "absent split":
        args += ["--split", "test"]
    elif case == "sheet without classes":
        args[4] = write_sheet(tmp_path / "no_class.csv", setup, drop="a_cls")
    else:
        args += ["--num-workers", "-1"]
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("python -m audioclf.embed: error: ") and err.count("\n") == 1
    assert message in err
    assert not list(tmp_path.glob("x.*"))


def test_knn_ranks_a_class_of_distinct_items_where_centroids_do_not():
    # Class "a" holds two distinct recordings (items) far apart, class "b" one compact blob in
    # between: a query next to one of a's items is nearest to an "a" clip, but "b"'s centroid
    # is nearer than a's (which lies between a's items) — the demo's wrong first impression.
    angle = np.deg2rad([0, 2, 90, 92, 40, 45, 50])
    gallery = np.stack([np.cos(angle), np.sin(angle)], 1).astype(np.float32)
    classes = np.array(["a", "a", "a", "a", "b", "b", "b"])
    query = np.array([[np.cos(np.deg2rad(5)), np.sin(np.deg2rad(5))]], dtype=np.float32)
    from audioclf.embedding.gallery import class_scores, top_classes

    names, scores, votes = class_scores(query, gallery, classes)
    assert names[top_classes(scores, 2, votes)[0][0]] == "a"
    names, scores, votes = class_scores(query, gallery, classes, rule="centroid")
    assert names[top_classes(scores, 2, votes)[0][0]] == "b"
    # k = 3: the three nearest are a, a, b (at 0, 2 and 40 degrees): a wins the vote
    names, scores, votes = class_scores(query, gallery, classes, k=3)
    assert votes.tolist() == [[2.0, 1.0]]
    # the query's own item (the first two rows) left out: b's blob is now nearest
    groups = (np.array([0]), np.array([0, 0, 1, 2, 3, 4, 5]))
    names, scores, votes = class_scores(query, gallery, classes, groups=groups)
    assert names[top_classes(scores, 2, votes)[0][0]] == "b"


def test_ranking_a_gallery_row_leaves_out_its_own_item(setup, tiny_demo):
    # Files that are rows of the gallery: with their own item left out they cannot find
    # themselves (an untrained model's nearest clip of the full gallery is the file itself).
    from audioclf.embedding.gallery import RankOptions, rank_files
    from audioclf.inference import load_embedder

    model = load_embedder(setup["model"], torch.device("cpu"))
    folder = tiny_demo.parent / "wav" / CLASSES[0]
    common = dict(root=None, batch_size=16, use_cache=False, progress=False)
    own = rank_files(model, [folder], tiny_demo, RankOptions(top=3), **common)
    assert own.first_right() == (len(own.files), len(own.files))  # each finds itself
    assert (own.scores.max(axis=1) > 0.9999).all()
    left_out = rank_files(
        model, [folder], tiny_demo, RankOptions(top=3, exclude_own_item=True), **common
    )
    assert all(left_out.own_item_left_out) and (left_out.scores.max(axis=1) < 0.9999).all()
    right, known = left_out.first_right()
    assert known == len(left_out.files) and 0 <= right <= known
    assert "each file's own item left out" in left_out.lines(model, tiny_demo)[0]


def test_the_cli_states_the_rule_and_counts_own_class_first(setup, tiny_demo, capsys):
    folder = tiny_demo.parent / "wav" / CLASSES[0]
    args = ["--model", setup["model"], "--gallery", tiny_demo, "--quiet", "--no-cache", folder]
    code, out, _ = run_cli(capsys, *args, "--exclude-own-item", "--knn", "3")
    assert code == 0
    header, *_, summary = out.splitlines()
    assert "kNN, k=3, the 3 nearest clips voting" in header and "own item left out" in header
    right, known = map(int, summary.split(" files ranked")[0].split(" of "))
    assert known == len(list(folder.rglob("*.wav"))) and 0 <= right <= known
    code, out, _ = run_cli(capsys, *args, "--rank-by", "centroid")
    assert code == 0 and "ranked by cosine to each class centroid" in out.splitlines()[0]
    assert "files ranked their own class first" not in out


def test_a_gallery_of_segment_rows_embeds_each_segment(setup, tmp_path):
    # A gallery sheet with start / end (an imported Kaldi or NeMo set): each row is the span
    # of its file, the same embedding as a file holding only that span.
    import soundfile

    from audioclf.embedding.gallery import load_gallery
    from audioclf.inference import embed_paths, load_embedder

    model = load_embedder(setup["model"], torch.device("cpu"))
    source = sorted(setup["queries"].rglob("*.wav"))[0]
    wave, rate = soundfile.read(str(source), dtype="float32")
    halves = [(0.0, len(wave) / rate / 2), (len(wave) / rate / 2, len(wave) / rate)]
    sheet = tmp_path / "segments.csv"
    pd.DataFrame(
        {
            "a_cls": ["x", "y"],
            "a_item": ["r", "r"],
            "a_id": ["x0", "y0"],
            "path": [str(source)] * 2,
            "start": [a for a, _ in halves],
            "end": [b for _, b in halves],
        }
    ).to_csv(sheet, index=False)
    gallery_emb, rows, _ = load_gallery(
        model, sheet, root=None, batch_size=1, use_cache=False, progress=False
    )
    for i, (a, b) in enumerate(halves):
        cut = tmp_path / f"cut{i}.wav"
        soundfile.write(str(cut), wave[int(round(a * rate)) : int(round(b * rate))], rate)
        alone = embed_paths(model, [cut], batch_size=1)[1]
        np.testing.assert_allclose(gallery_emb[i], alone[0], atol=1e-4)
    assert not np.allclose(gallery_emb[0], gallery_emb[1], atol=1e-3)
