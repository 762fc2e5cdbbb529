"""The generated demo dataset: layout, determinism, a valid index, reruns, features."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import soundfile
import torch

from audioclf.config import DataConfig, FeaturesConfig
from audioclf.data import demo
from audioclf.data.demo import generate_demo
from audioclf.data.index import load_index
from audioclf.spectrogram import log_mel

SMALL = {"classes": 4, "items": 3, "ids": 2}


def wav_bytes(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*.wav"))}


def test_layout_and_index(tmp_path):
    sheet = generate_demo(tmp_path / "demo", **SMALL)
    assert sheet == tmp_path / "demo" / "index.xlsx"
    table = pd.read_excel(sheet, dtype=str, engine="openpyxl")
    assert list(table.columns) == ["a_cls", "a_item", "a_id", "path"]
    assert len(table) == 24 and table["a_cls"].nunique() == 4 and table["a_item"].nunique() == 12
    assert table.groupby("a_cls")["a_item"].nunique().eq(3).all()
    assert table["path"].iloc[0] == "wav/c00/c00_i0/c00_i0_00.wav"
    for rel in table["path"]:
        wave, rate = soundfile.read(tmp_path / "demo" / rel, dtype="float32")
        assert rate == 16000 and 1.0 <= len(wave) / rate <= 2.0
        assert soundfile.info(tmp_path / "demo" / rel).subtype == "PCM_16"
        assert 0.05 < np.abs(wave).max() < 1.0
    assert len(wav_bytes(tmp_path / "demo")) == 24

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no class is short of items
        index = load_index(DataConfig(index=str(sheet)))
    assert len(index) == 24 and index.classes == ["c00", "c01", "c02", "c03"]


def test_same_seed_same_bytes_other_seed_other_audio(tmp_path):
    generate_demo(tmp_path / "a", **SMALL, seed=3)
    generate_demo(tmp_path / "b", **SMALL, seed=3)
    generate_demo(tmp_path / "c", **SMALL, seed=4)
    a, b, c = (wav_bytes(tmp_path / name) for name in "abc")
    assert a == b
    assert a.keys() == c.keys() and all(a[k] != c[k] for k in a)


def test_class_sound_does_not_depend_on_the_number_of_classes(tmp_path):
    generate_demo(tmp_path / "few", classes=2, items=3, ids=2)
    generate_demo(tmp_path / "more", classes=3, items=3, ids=2)
    few, more = wav_bytes(tmp_path / "few"), wav_bytes(tmp_path / "more")
    assert few == {k: v for k, v in more.items() if k in few}


def test_rerun_is_a_no_op_unless_forced(tmp_path, monkeypatch, capsys):
    generate_demo(tmp_path / "demo", **SMALL)
    before = wav_bytes(tmp_path / "demo")
    monkeypatch.setattr(demo, "render_class", lambda *a: pytest.fail("regenerated"))
    generate_demo(tmp_path / "demo", **SMALL)
    assert "already holds the demo dataset" in capsys.readouterr().out
    monkeypatch.undo()
    generate_demo(tmp_path / "demo", **SMALL, force=True)
    assert wav_bytes(tmp_path / "demo") == before
    generate_demo(tmp_path / "demo", **{**SMALL, "ids": 1})  # other parameters: replaced
    assert len(wav_bytes(tmp_path / "demo")) == 12


def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    calls = []
    render = demo.render_class

    def render_then_stop(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return render(*args)

    monkeypatch.setattr(demo, "render_class", render_then_stop)
    with pytest.raises(KeyboardInterrupt):
        generate_demo(tmp_path / "demo", **SMALL)
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_replace_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"mine exists and is not a demo dataset.*--force"):
        generate_demo(tmp_path / "mine", **SMALL)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_features_match_log_mel_of_the_wav(tmp_path):
    generate_demo(tmp_path / "demo", **SMALL, features=True)
    sheet = tmp_path / "demo" / "index_features.xlsx"
    index = load_index(DataConfig(index=str(sheet)))
    assert len(index) == 24
    cfg = FeaturesConfig()
    for row in index.table.itertuples():
        feats = np.load(row.path)
        wav = row.path.replace("/features/", "/wav/").replace(".npy", ".wav")
        wave, _ = soundfile.read(wav, dtype="float32")
        assert feats.dtype == np.float32
        valid = max(1, (len(wave) - cfg.n_fft // 2) // cfg.hop_length + 1)  # windows inside
        assert feats.shape == (valid, cfg.n_mels)
    np.testing.assert_allclose(feats, log_mel(torch.from_numpy(wave), cfg), rtol=1e-5, atol=1e-5)
    # an existing demo without features is completed when features are asked for
    generate_demo(tmp_path / "plain", **SMALL)
    generate_demo(tmp_path / "plain", **SMALL, features=True)
    assert (tmp_path / "plain" / "index_features.xlsx").is_file()


def test_classes_are_learnable_but_not_trivial(tmp_path):
    """Nearest class centroid on log-mel statistics, fitted on the other items, recognises a
    held-out item's clips well above chance but far from perfectly (item EQ, reverb, pitch and
    background get in the way: an embedding has to learn what a class sounds like)."""
    classes, items, ids = 8, 4, 4
    generate_demo(tmp_path / "demo", classes=classes, items=items, ids=ids)
    index = load_index(DataConfig(index=str(tmp_path / "demo" / "index.xlsx")))
    stats = []
    for path in index.table["path"]:
        wave, _ = soundfile.read(path, dtype="float32")
        feats = log_mel(torch.from_numpy(wave), FeaturesConfig())
        stats.append(np.concatenate([feats.mean(0), feats.std(0)]))
    stats = np.array(stats)
    stats = (stats - stats.mean(0)) / stats.std(0)
    labels = index.labels()
    item_number = index.table["item"].str.rsplit("_i", n=1).str[1].astype(int).to_numpy()
    correct = []
    for held in range(items):
        test = item_number == held
        centroids = np.stack([stats[~test & (labels == c)].mean(0) for c in range(classes)])
        distance = ((stats[test, None] - centroids[None]) ** 2).sum(-1)
        correct.extend(distance.argmin(1) == labels[test])
    accuracy = float(np.mean(correct))
    assert 3 / classes <= accuracy <= 0.9, f"held-out-item accuracy {accuracy:.2f}"
    assert len(np.unique(stats.round(3), axis=0)) == len(stats)  # no two clips alike


def test_command_line(tmp_path, capsys):
    assert (
        demo.main(
            [
                "--out",
                str(tmp_path / "d"),
                "--classes",
                "2",
                "--items",
                "2",
                "--ids",
                "1",
                "--seed",
                "1",
                "--sample-rate",
                "8000",
            ]
        )
        == 0
    )
    assert "index:" in capsys.readouterr().out
    wave, rate = soundfile.read(tmp_path / "d" / "wav" / "c01" / "c01_i1" / "c01_i1_00.wav")
    assert rate == 8000
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--help"])
    assert exit_info.value.code == 0
    with pytest.raises(SystemExit):
        demo.main(["--out", str(tmp_path / "e"), "--classes", "1"])
    assert "classes=1 must be >= 2" in capsys.readouterr().err
