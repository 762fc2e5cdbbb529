"""python -m audioclf.prepare: audio index → log-mel .npy files + an index to train on."""

from __future__ import annotations

import re
import shlex
import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from audioclf.config import DataConfig, load_config
from audioclf.data import unlabelled as unlabelled_module
from audioclf.data.demo import generate_demo
from audioclf.data.index import load_index, read_table
from audioclf.data.readers import load_audio
from audioclf.models.frontend import FeatureFrontend
from audioclf.precompute import feature_paths, feature_settings
from audioclf.prepare import PROG, main

ROWS = 36  # 6 classes x 2 items x 3 ids


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """The tiny demo set, with index.xlsx and the same rows as index.csv."""
    sheet = generate_demo(
        tmp_path_factory.mktemp("prepare") / "demo", classes=6, items=2, ids=3, seed=0
    )
    read_table(sheet, DataConfig()).to_csv(sheet.with_suffix(".csv"), index=False)
    return sheet


def prepare(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in (*argv, "--quiet")])
    out, err = capsys.readouterr()
    return code, out, err


def npy_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*.npy"))}


def absolute_sheet(demo: Path, path: Path) -> pd.DataFrame:
    """The demo rows with absolute audio paths, written to `path` as csv."""
    table = pd.read_csv(demo.with_suffix(".csv"), dtype=str, keep_default_na=False)
    table["path"] = [str(demo.parent / p) for p in table["path"]]
    table.to_csv(path, index=False)
    return table


# ---------------------------------------------------------------------------------------------
# What the files hold


def test_npy_features_give_the_audio_front_end_output(demo, tmp_path, capsys):
    config = tmp_path / "feats.yaml"
    config.write_text("features:\n  n_mels: 32\n  f_max: 7000.0\n")
    out = tmp_path / "out"
    code, stdout, _ = prepare(
        capsys, "--index", demo, "--out", out, "--config", config, "--workers", 1
    )
    assert code == 0
    assert f"{ROWS} rows: {ROWS} files written, 0 already present, 0 skipped" in stdout

    cfg = load_config(config)
    prepared = load_index(DataConfig(index=str(out / "index.xlsx")))  # checks every file exists
    source = load_index(DataConfig(index=str(demo)))
    assert len(prepared) == ROWS
    assert prepared.table[["cls", "item", "id"]].equals(source.table[["cls", "item", "id"]])
    assert list(read_table(out / "index.xlsx", DataConfig()).columns) == [
        "a_cls",
        "a_item",
        "a_id",
        "path",
    ]
    audio_frontend = FeatureFrontend(cfg.features).eval()
    npy_cfg = load_config(config, ["features.kind=npy"]).features
    npy_frontend = FeatureFrontend(npy_cfg).eval()
    for position in (0, 17, 35):
        wave = load_audio(source.table["path"][position], cfg.features.sample_rate)
        mel = np.load(prepared.table["path"][position])
        assert mel.dtype == np.float32 and mel.shape[1] == 32
        with torch.no_grad():
            from_audio, audio_frames = audio_frontend(wave[None], torch.tensor([len(wave)]))
            from_npy, npy_frames = npy_frontend(
                torch.from_numpy(mel)[None], torch.tensor([len(mel)])
            )
        assert int(audio_frames) == int(npy_frames) == len(mel)
        torch.testing.assert_close(from_npy[0], from_audio[0, : len(mel)], rtol=0, atol=1e-5)

    # The printed command trains with the same feature settings on these files.
    command = shlex.split(stdout.split("train on it: ")[1].strip())
    assert command[:4] == ["./run.sh", "--nproc", "4", str(config)]
    trained = load_config(command[3], command[4:])
    assert trained.features.kind == "npy" and trained.data.index == str(out / "index.xlsx")
    assert feature_settings(trained.features) == feature_settings(cfg.features)


def test_same_bytes_as_the_demo_features(demo, tmp_path, capsys):
    with_features = generate_demo(
        tmp_path / "demo", classes=6, items=2, ids=3, seed=0, features=True
    ).parent
    code, _, _ = prepare(capsys, "--index", demo, "--out", tmp_path / "out", "--workers", 1)
    assert code == 0
    prepared = npy_files(tmp_path / "out" / "features")
    # the demo writes features/<cls>/<item>/<id>.npy
    reference = {
        f"{p.parent.parent.name}/{p.name}": p.read_bytes()
        for p in sorted((with_features / "features").rglob("*.npy"))
    }
    assert len(prepared) == ROWS and prepared == reference


# ---------------------------------------------------------------------------------------------
# Names


TRICKY_IDS = [
    "a/b",
    "a\\b",
    "a:b",
    "A:B",
    "a%2Fb",
    "a_b",
    "..",
    ".hidden",
    "a b",
    "名字",
    "x" * 300,
    "x" * 299 + "y",
    "CON",
    "a*b?",
    "Straße",
    "STRASSE",
]


def test_names_are_safe_and_distinct():
    classes = ["x/y"] * 8 + ["X/Y"] * 4 + [".."] * 4
    paths = feature_paths(classes, TRICKY_IDS)
    assert len(set(paths)) == len(paths)
    # distinct on a case-insensitive, Unicode-normalising file system too
    assert len({unicodedata.normalize("NFKC", p).casefold() for p in paths}) == len(paths)
    for path in paths:
        top, folder, name = path.split("/")
        assert top == "features" and name.endswith(".npy")
        for part in (folder, name):
            assert not part.startswith(".") and not set(part) & set('\\:*?" <>|')
            assert len(part.encode()) <= 210
    # readable where nothing collides; '~' + a hash where only case tells names apart
    assert paths[0].startswith("features/x%2Fy~") and paths[0].endswith("/a%2Fb.npy")
    assert paths[TRICKY_IDS.index("名字")].endswith("/名字.npy")
    assert paths[TRICKY_IDS.index("..")] == paths[0].rsplit("/", 1)[0] + "/%2E..npy"
    assert paths[TRICKY_IDS.index("a:b")] != paths[TRICKY_IDS.index("A:B")]
    assert paths[-1].split("/")[1] == "%2E."
    assert len({p.split("/")[1] for p in paths}) == 3


def test_tricky_ids_end_to_end(demo, tmp_path, capsys):
    table = absolute_sheet(demo, tmp_path / "all.csv").iloc[: len(TRICKY_IDS)].copy()
    table["a_cls"] = ["x/y", "X/Y"] * (len(TRICKY_IDS) // 2)
    table["a_id"] = TRICKY_IDS
    table.to_csv(tmp_path / "tricky.csv", index=False)
    out = tmp_path / "out"
    code, _, err = prepare(capsys, "--index", tmp_path / "tricky.csv", "--out", out, "--workers", 1)
    assert code == 0, err
    prepared = load_index(DataConfig(index=str(out / "index.csv")))
    assert prepared.table["id"].tolist() == TRICKY_IDS
    written = sorted(p for p in (out / "features").rglob("*") if p.is_file())
    assert len(written) == len(TRICKY_IDS)
    assert sorted(Path(p) for p in prepared.table["path"]) == written
    assert all(p.parent.parent == out / "features" for p in written)
    assert len({p.parent for p in written}) == 2


# ---------------------------------------------------------------------------------------------
# Shards, workers, resuming


def test_shards_together_equal_one_run(demo, tmp_path, capsys):
    sheet = demo.with_suffix(".csv")
    whole, first_last, last_first = tmp_path / "whole", tmp_path / "a", tmp_path / "b"
    assert prepare(capsys, "--index", sheet, "--out", whole, "--workers", 2)[0] == 0

    code, out, _ = prepare(
        capsys, "--index", sheet, "--out", last_first, "--shard", "1/2", "--workers", 1
    )
    assert code == 0 and "shard 1/2: 18 rows: 18 files written" in out
    assert "waiting for shard(s) 0/2" in out and not (last_first / "index.csv").exists()
    odd_rows = pd.read_csv(sheet, dtype=str)["a_id"].iloc[1::2]
    assert sorted(Path(p).stem for p in npy_files(last_first)) == sorted(odd_rows)
    code, out, _ = prepare(
        capsys, "--index", sheet, "--out", last_first, "--shard", "0/2", "--workers", 2
    )
    assert code == 0 and f"index: {last_first / 'index.csv'} ({ROWS} rows)" in out

    for shard in ("0/2", "1/2"):
        assert (
            prepare(
                capsys, "--index", sheet, "--out", first_last, "--shard", shard, "--workers", 1
            )[0]
            == 0
        )

    reference = npy_files(whole)
    assert len(reference) == ROWS
    for folder in (first_last, last_first):
        assert npy_files(folder) == reference
        assert (folder / "index.csv").read_bytes() == (whole / "index.csv").read_bytes()


def test_rerun_completes_what_a_killed_run_left(demo, tmp_path, capsys):
    out = tmp_path / "out"
    assert prepare(capsys, "--index", demo, "--out", out, "--workers", 1)[0] == 0
    reference = npy_files(out)
    files = [out / name for name in reference]
    for path in files[:3]:
        path.unlink()
    files[3].write_bytes(reference[files[3].relative_to(out).as_posix()][:300])  # truncated
    np.save(files[4], np.zeros((5, 7), np.float32))  # a valid file of the wrong shape
    stray_deleted = files[0].with_name(f".{files[0].name}.tmp")
    stray_complete = files[10].with_name(f".{files[10].name}.tmp")
    stray_deleted.write_bytes(b"\x93NUMPY half")
    stray_complete.write_bytes(b"\x93NUMPY half")

    code, stdout, _ = prepare(capsys, "--index", demo, "--out", out, "--workers", 2)
    assert code == 0
    assert f"{ROWS} rows: 5 files written, {ROWS - 5} already present, 0 skipped" in stdout
    assert npy_files(out) == reference
    assert not list(out.rglob("*.tmp"))


# ---------------------------------------------------------------------------------------------
# Errors


def test_unreadable_audio_stops_the_run_or_is_skipped(demo, tmp_path, capsys):
    table = absolute_sheet(demo, tmp_path / "index.csv")
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF....WAVEfmt not really")
    table.loc[7, "path"] = str(broken)
    table.to_csv(tmp_path / "index.csv", index=False)
    out = tmp_path / "out"

    code, _, err = prepare(capsys, "--index", tmp_path / "index.csv", "--out", out, "--workers", 2)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"{PROG}: error: row 9 of ") and str(broken) in err
    assert "--skip-bad" in err and not (out / "index.csv").exists()

    code, stdout, _ = prepare(
        capsys, "--index", tmp_path / "index.csv", "--out", out, "--workers", 2, "--skip-bad"
    )
    assert code == 0
    written, present, skipped = map(
        int,
        re.search(r"(\d+) files written, (\d+) already present, (\d+) skipped", stdout).groups(),
    )
    assert written + present == ROWS - 1 and skipped == 1 and present > 0  # resumed
    skipped = pd.read_csv(out / "skipped.csv", dtype=str)
    assert list(skipped.columns) == ["row", "id", "path", "reason"]
    assert skipped[["row", "id", "path"]].values.tolist() == [["9", table["a_id"][7], str(broken)]]
    assert str(broken) in skipped["reason"][0]
    written = pd.read_csv(out / "index.csv", dtype=str)
    assert len(written) == ROWS - 1 and table["a_id"][7] not in set(written["a_id"])

    shutil.copyfile(table["path"][6], broken)  # fixed: the next run takes it in
    code, stdout, _ = prepare(
        capsys, "--index", tmp_path / "index.csv", "--out", out, "--workers", 1, "--skip-bad"
    )
    assert code == 0 and f"1 files written, {ROWS - 1} already present, 0 skipped" in stdout
    assert not (out / "skipped.csv").exists()
    assert len(pd.read_csv(out / "index.csv")) == ROWS


def test_sharded_index_leaves_out_every_shards_skipped_rows(demo, tmp_path, capsys):
    table = absolute_sheet(demo, tmp_path / "index.csv")
    (tmp_path / "broken.wav").write_bytes(b"not audio at all")
    table.loc[7, "path"] = str(tmp_path / "broken.wav")  # position 7: shard 1/2
    table.to_csv(tmp_path / "index.csv", index=False)
    indexes = []
    for order in (("0/2", "1/2"), ("1/2", "0/2")):
        out = tmp_path / "".join(order).replace("/", "")
        for shard in order:
            code, stdout, _ = prepare(
                capsys,
                "--index",
                tmp_path / "index.csv",
                "--out",
                out,
                "--shard",
                shard,
                "--skip-bad",
                "--workers",
                1,
            )
            assert code == 0
        assert f"index: {out / 'index.csv'} ({ROWS - 1} rows)" in stdout
        assert not (out / "skipped-0-of-2.csv").exists()
        assert pd.read_csv(out / "skipped-1-of-2.csv")["row"].tolist() == [9]
        indexes.append((out / "index.csv").read_bytes())
    assert indexes[0] == indexes[1]
    assert table["a_id"][7] not in pd.read_csv(tmp_path / "0212" / "index.csv")["a_id"].tolist()


def _npy_sheet(tmp_path: Path) -> Path:
    np.save(tmp_path / "f.npy", np.zeros((3, 64), np.float32))
    pd.DataFrame(
        {"a_cls": ["c", "c"], "a_item": ["i", "j"], "a_id": ["1", "2"], "path": ["f.npy", "f.npy"]}
    ).to_csv(tmp_path / "feats.csv", index=False)
    return tmp_path / "feats.csv"


def _text_sheet(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("not audio")
    pd.DataFrame(
        {
            "a_cls": ["c", "c"],
            "a_item": ["i", "j"],
            "a_id": ["1", "2"],
            "path": ["notes.txt", "notes.txt"],
        }
    ).to_csv(tmp_path / "text.csv", index=False)
    return tmp_path / "text.csv"


def _bad_config(tmp_path: Path) -> list:
    (tmp_path / "bad.yaml").write_text("features:\n  n_mel: 32\n")
    return ["--config", tmp_path / "bad.yaml"]


def _file_as_parent(tmp_path: Path) -> Path:
    (tmp_path / "plain_file").write_text("")
    return tmp_path / "plain_file" / "out"


BAD_INPUTS = {
    "missing sheet": (lambda tmp, demo: ["--index", tmp / "nope.xlsx"], "does not exist"),
    "shard out of range": (lambda tmp, demo: ["--shard", "2/2"], "--shard '2/2' is invalid"),
    "shard not i/n": (lambda tmp, demo: ["--shard", "1"], "--shard '1' is invalid"),
    "unknown config key": (lambda tmp, demo: _bad_config(tmp), "unknown config key features.n_mel"),
    "features index": (lambda tmp, demo: ["--index", _npy_sheet(tmp)], "already a features index"),
    "non-audio file": (lambda tmp, demo: ["--index", _text_sheet(tmp)], "not audio files"),
    "output under a file": (lambda tmp, demo: ["--out", _file_as_parent(tmp)], "cannot be written"),
    "output not ours": (
        lambda tmp, demo: ["--out", demo.parent / "wav"],
        "not a folder written by prepare",
    ),
    "output overwrites the input": (
        lambda tmp, demo: ["--out", demo.parent],
        "would overwrite the input sheet",
    ),
    "zero workers": (lambda tmp, demo: ["--workers", 0], "--workers must be >= 1"),
}


def demo_files(demo: Path) -> list[Path]:
    """The demo folder's files, less the index cache that reading the sheet may write."""
    return sorted(p for p in demo.parent.rglob("*") if ".audioclf_cache" not in p.parts)


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_and_writes_nothing(case, demo, tmp_path, capsys):
    make_args, message = BAD_INPUTS[case]
    args = {"--index": demo, "--out": tmp_path / "out", "--workers": 1}
    extra = make_args(tmp_path, demo)
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        args[flag] = value
    before = demo_files(demo)
    code, out, err = prepare(capsys, *[x for pair in args.items() for x in pair])
    assert code == 2 and out == ""
    assert err.startswith(f"{PROG}: error: ") and len(err.strip().splitlines()) == 1
    assert message in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "plain_file" / "out").exists()
    assert demo_files(demo) == before


def test_other_settings_into_the_same_folder_are_refused(demo, tmp_path, capsys):
    out = tmp_path / "out"
    assert prepare(capsys, "--index", demo, "--out", out, "--workers", 1)[0] == 0
    files = npy_files(out)
    code, _, err = prepare(
        capsys, "--index", demo, "--out", out, "--workers", 1, "features.n_mels=32"
    )
    assert code == 2 and "holds features made with other settings" in err
    assert npy_files(out) == files


def test_help_explains_sharding_resuming_and_skipping(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    text = capsys.readouterr().out
    assert exit_info.value.code == 0
    for needle in (
        "--shard i/n",
        "the last shard to finish",
        "A rerun skips files",
        "skipped.csv",
        "features.kind=npy",
        "--workers N",
    ):
        assert needle in text


def test_segment_rows_are_prepared_from_their_span(demo, tmp_path, capsys):
    # A sheet of segments (prepare --from kaldi / nemo writes them): each row's features are
    # the log-mel of its span only, not of the whole file.
    from audioclf.spectrogram import log_mel

    table = absolute_sheet(demo, tmp_path / "whole.csv").head(2).copy()
    table["path"] = table["path"].iloc[0]  # two segments of one recording
    table["start"], table["end"] = [0.0, 0.25], [0.25, 0.5]
    table.to_csv(tmp_path / "segments.csv", index=False)
    out = tmp_path / "out"
    code, _, err = prepare(capsys, "--index", tmp_path / "segments.csv", "--out", out)
    assert code == 0, err
    (sheet,) = out.glob("index.*")
    prepared = load_index(DataConfig(index=str(sheet)))
    cfg = load_config(None)
    for row, (start, end) in zip(prepared.table.itertuples(), [(0.0, 0.25), (0.25, 0.5)]):
        expected = log_mel(
            load_audio(table["path"].iloc[0], cfg.features.sample_rate, (start, end)), cfg.features
        )
        np.testing.assert_allclose(np.load(row.path), expected, atol=1e-5)


def test_shard_records_of_another_sheet_do_not_make_an_index(demo, tmp_path, capsys):
    sheet, edited, out = demo.with_suffix(".csv"), tmp_path / "edited.csv", tmp_path / "out"
    table = pd.read_csv(sheet, dtype=str)
    table.loc[0, "a_id"] = "renamed"  # shard 0's row: shard 1 writes the same files as before
    table.to_csv(edited, index=False)
    for shard, index in (("1/2", sheet), ("0/2", edited)):
        code, out_text, err = prepare(capsys, "--index", index, "--out", out, "--shard", shard,
                                      "--workers", 1, "--root", demo.parent)  # fmt: skip
        assert code == 0, err
    assert "waiting for shard(s) 1/2" in out_text and not (out / "index.csv").exists()


# ---------------------------------------------------------------------------------------------
# --unlabelled: data.unlabelled's clips


def test_unlabelled_clips_get_the_labelled_features_and_a_sheet_training_reads(
    demo, tmp_path, capsys, monkeypatch
):
    from audioclf.config import FeaturesConfig
    from audioclf.data.unlabelled import load_unlabelled
    from audioclf.spectrogram import log_mel

    source = tmp_path / "new"
    shutil.copytree(demo.parent / "wav" / "c00", source / "c00")
    out = tmp_path / "out"
    code, stdout, _ = prepare(capsys, "--index", demo, "--out", out, "--workers", 1)
    assert code == 0
    code, stdout, _ = prepare(capsys, "--unlabelled", source, "--out", out, "--workers", 2)
    clips = sorted(source.rglob("*.wav"))
    assert code == 0 and len(clips) == 6
    assert "6 rows: 6 files written, 0 already present, 0 skipped" in stdout
    assert f"train on it: data.unlabelled={out / 'unlabelled.csv'} features.kind=npy" in stdout
    listed = pd.read_csv(out / "unlabelled.csv")
    assert list(listed.columns) == ["path"] and listed["path"].str.startswith("unlabelled/").all()
    npy = load_unlabelled(str(out / "unlabelled.csv"), FeaturesConfig(kind="npy"))
    features = FeaturesConfig()
    for clip, feature in zip(clips, npy.paths, strict=True):  # the source's (sorted) order
        assert Path(feature).name.startswith(clip.stem + "-")
        wave = load_audio(str(clip), features.sample_rate)
        np.testing.assert_array_equal(np.load(feature), log_mel(wave, features))
    assert (out / "index.xlsx").is_file() and len(npy_files(out)) == ROWS + 6  # both in one DIR

    extra = source / "later.wav"
    shutil.copy(clips[0], extra)  # a clip added to the source: only it is read and written
    headers = []
    monkeypatch.setattr(unlabelled_module.sf, "info", lambda path: headers.append(path))
    code, stdout, _ = prepare(capsys, "--unlabelled", source, "--out", out, "--workers", 1)
    assert code == 0 and "7 rows: 1 files written, 6 already present, 0 skipped" in stdout
    assert headers == [str(extra)]  # the six clips written before are not checked again
    assert len(pd.read_csv(out / "unlabelled.csv")) == 7


def test_unlabelled_bad_input_is_one_line(demo, tmp_path, capsys):
    source = tmp_path / "new"
    shutil.copytree(demo.parent / "wav" / "c01", source)
    out = tmp_path / "out"
    code, _, err = prepare(capsys, "--unlabelled", source, "--out", out, "--shard", "0/2")
    assert code == 2 and err.strip().endswith(
        "--unlabelled writes its files in one run: drop --shard"
    )
    code, _, err = prepare(capsys, "--unlabelled", source, "--out", out, "--pack", "--shard", "0/2")
    assert code == 2 and err.strip().endswith("--pack writes one pack in one run: drop --shard")
    code, _, err = prepare(capsys, "--unlabelled", tmp_path / "nowhere", "--out", out)
    assert code == 2 and f"data.unlabelled={tmp_path / 'nowhere'} does not exist" in err
    assert not out.exists()  # nothing written before the source was known good
    assert prepare(capsys, "--unlabelled", source, "--out", out, "--workers", 1)[0] == 0
    code, _, err = prepare(capsys, "--unlabelled", source, "--out", out, "features.n_mels=40")
    assert code == 2 and "holds features made with other settings" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("pack", [False, True], ids=["npy", "pack"])
def test_an_unreadable_unlabelled_clip_is_named_or_skipped(demo, tmp_path, capsys, pack):
    source = tmp_path / "new"
    shutil.copytree(demo.parent / "wav" / "c00", source / "c00")
    bad = source / "c00" / "broken.wav"
    bad.write_bytes(b"RIFF not a wave file")
    argv = ["--unlabelled", source, "--out", tmp_path / "out", "--workers", 1]
    argv += ["--pack", "--pack-dtype", "float32"] if pack else []
    code, _, err = prepare(capsys, *argv)
    assert code == 2 and str(bad) in err and "--skip-bad" in err
    assert len(err.strip().splitlines()) == 1
    code, stdout, err = prepare(capsys, *argv, "--skip-bad")  # resumes what the refusal left
    assert code == 0, err
    assert "7 rows" in stdout and "1 skipped" in stdout
    if pack:
        assert len(pd.read_parquet(tmp_path / "out" / "index.parquet")) == 6
    else:
        assert len(pd.read_csv(tmp_path / "out" / "unlabelled.csv")) == 6


def test_unlabelled_clips_packed_hold_their_prepared_features_in_the_source_order(
    demo, tmp_path, capsys, monkeypatch
):
    from audioclf.config import FeaturesConfig
    from audioclf.data.unlabelled import UnlabelledAudioError, load_unlabelled

    source = tmp_path / "new"
    shutil.copytree(demo.parent / "wav" / "c00", source / "c00")
    clips = sorted(map(str, source.rglob("*.wav")))
    assert (
        prepare(capsys, "--unlabelled", source, "--out", tmp_path / "npy", "--workers", 1)[0] == 0
    )
    argv = ["--unlabelled", source, "--out", tmp_path / "pack", "--pack", "--pack-dtype", "float32"]
    code, stdout, err = prepare(capsys, *argv, "--workers", 2)
    index = tmp_path / "pack" / "index.parquet"
    assert code == 0, err
    assert "6 rows: 6 packed" in stdout and f"index: {index}" in stdout
    assert (
        f"train on it: data.unlabelled={index} features.kind=npy, beside a data.index packed"
        in stdout
    )
    assert list(pd.read_parquet(index).columns) == ["clip", "path", "pack_offset", "pack_frames"]
    packed = load_unlabelled(str(index), FeaturesConfig(kind="npy"))
    npy = load_unlabelled(str(tmp_path / "npy" / "unlabelled.csv"), FeaturesConfig(kind="npy"))
    assert packed.paths == tuple(clips) and packed.source == str(index)  # the source's order
    for position, feature in enumerate(npy.paths):
        window = packed.pack.read_window(position, None, None, "none", "test")
        np.testing.assert_array_equal(window, np.load(feature))  # float32: the .npy, exactly
    headers = []
    monkeypatch.setattr(unlabelled_module.sf, "info", lambda path: headers.append(path))
    code, stdout, _ = prepare(capsys, *argv, "--workers", 1)  # a rerun: nothing to do
    assert code == 0 and "already holds this pack (nothing to do)" in stdout
    assert headers == []  # the packed clips' headers are not read again
    with pytest.raises(UnlabelledAudioError, match=r"is a feature pack: set features.kind=npy"):
        load_unlabelled(str(index), FeaturesConfig(kind="audio"))
    labelled = tmp_path / "labelled"
    assert prepare(capsys, "--index", demo, "--out", labelled, "--pack", "--workers", 1)[0] == 0
    with pytest.raises(UnlabelledAudioError, match="is a labelled feature pack's index"):
        load_unlabelled(str(labelled / "index.parquet"), FeaturesConfig(kind="npy"))
