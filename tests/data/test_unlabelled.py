"""Unlabelled audio (data.unlabelled): reading and checking it, mixed batches, and that a run
without it draws the very batches main 1366f7d drew."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import soundfile as sf

from audioclf.config import FeaturesConfig
from audioclf.data.index import IndexValidationError, load_index
from audioclf.data.loader import TrainLoader
from audioclf.data.sampler import MixedBatchSampler, MPerClassSampler
from audioclf.data.unlabelled import UnlabelledAudioError, load_unlabelled
from tests.helpers import run_datasets, tiny_config

AUDIO = FeaturesConfig()


def _write_clips(folder: Path, count: int) -> list[Path]:
    paths = []
    for i in range(count):
        path = folder / f"part{i % 2}" / f"clip{i}.wav"
        path.parent.mkdir(parents=True, exist_ok=True)
        sf.write(path, np.zeros(1600, np.float32), 16000)
        paths.append(path)
    return paths


def test_a_folder_is_searched_recursively_in_sorted_order(tmp_path, monkeypatch):
    paths = _write_clips(tmp_path / "new", 5)
    (tmp_path / "new" / "notes.txt").write_text("not audio")
    clips = load_unlabelled(str(tmp_path / "new"), AUDIO)
    assert clips.paths == tuple(sorted(map(str, paths))) and len(clips) == 5
    monkeypatch.chdir(tmp_path)  # a relative folder: the clips are named absolute all the same
    assert load_unlabelled("new", AUDIO).paths == clips.paths


def test_a_sheet_gives_paths_and_its_split_keeps_train_rows(tmp_path):
    _write_clips(tmp_path, 4)
    sheet = tmp_path / "unlabelled.csv"
    pd.DataFrame(
        {
            "path": ["part0/clip0.wav", "part1/clip1.wav", "part0/clip2.wav", "part1/clip3.wav"],
            "split": ["train", "", "test", "TRAIN"],
        }
    ).to_csv(sheet, index=False)
    clips = load_unlabelled(str(sheet), AUDIO)
    assert [Path(p).name for p in clips.paths] == ["clip0.wav", "clip1.wav", "clip3.wav"]


def test_missing_and_unreadable_files_are_named(tmp_path):
    _write_clips(tmp_path, 2)
    sheet = tmp_path / "u.csv"
    pd.DataFrame({"path": ["part0/clip0.wav", "gone.wav"]}).to_csv(sheet, index=False)
    with pytest.raises(UnlabelledAudioError, match=r"1 of 2 files do not exist: .*gone\.wav"):
        load_unlabelled(str(sheet), AUDIO)
    (tmp_path / "part0" / "broken.wav").write_bytes(b"RIFF not really")
    with pytest.raises(UnlabelledAudioError, match=r"cannot be read as audio: .*broken\.wav"):
        load_unlabelled(str(tmp_path / "part0"), AUDIO)
    with pytest.raises(UnlabelledAudioError, match="no 'path' column"):
        pd.DataFrame({"file": ["x.wav"]}).to_csv(sheet, index=False)
        load_unlabelled(str(sheet), AUDIO)
    with pytest.raises(UnlabelledAudioError, match="does not exist"):
        load_unlabelled(str(tmp_path / "nowhere"), AUDIO)


def test_index_rows_without_a_class_are_refused_naming_data_unlabelled(tmp_path, tiny_demo):
    frame = pd.read_excel(tiny_demo, engine="openpyxl")
    frame.loc[:2, "a_cls"] = None
    sheet = tiny_demo.parent / "no_class.csv"
    frame.to_csv(sheet, index=False)
    cfg = tiny_config(sheet, tmp_path / "runs")
    with pytest.raises(IndexValidationError, match="data.unlabelled"):
        load_index(cfg.data)


# ---------------------------------------------------------------------------------------------
# Batches


def _labelled_index(seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    classes, items = [], []
    for c in range(12):
        for i in range(rng.integers(2, 6)):
            n = int(rng.integers(1, 4))
            classes += [c] * n
            items += [i] * n
    return np.asarray(classes), np.asarray(items)


def _mixed(rank=0, world=1, n_clips=40) -> MixedBatchSampler:
    classes, items = _labelled_index()
    labelled = MPerClassSampler(
        classes, items, batch_size=8, m=2, rank=rank, world_size=world, seed=5
    )
    return MixedBatchSampler(labelled, n_clips, clips_per_batch=3)


def test_without_pseudo_labels_the_labelled_part_is_the_m_per_class_draw():
    classes, items = _labelled_index()
    mixed = _mixed()
    plain = MPerClassSampler(classes, items, batch_size=8, m=2, seed=5)
    for epoch in range(3):
        mixed.set_epoch(epoch)
        plain.set_epoch(epoch)
        batches = list(mixed)
        assert [b[:8] for b in batches] == list(plain)
        n = len(classes)
        for batch in batches:
            views = batch[8:]
            assert views[0::2] == views[1::2]  # two views of each clip, adjacent
            clips = [v - n - 40 for v in views[0::2]]
            assert len(set(clips)) == 3 and all(0 <= c < 40 for c in clips)


def test_pseudo_classes_draw_m_distinct_clips_and_resume_mid_epoch():
    mixed = _mixed()
    n = mixed.n_labelled
    labels = np.full(40, -1)
    labels[:12] = np.repeat(np.arange(4), 3)  # four pseudo-classes of three clips
    mixed.set_pseudo_labels(labels)
    mixed.set_epoch(1)
    batches = list(mixed)
    members = [p for b in batches for p in b[:8] if n <= p < n + 40]
    assert members, "the pseudo-classes were never drawn"
    for batch in batches:
        drawn = [p - n for p in batch[:8] if n <= p < n + 40]
        by_class = Counter(labels[drawn].tolist())
        assert all(count == 2 for count in by_class.values())  # m = 2 per pseudo-class
        assert len(set(drawn)) == len(drawn)  # distinct clips: each its own item
    state = mixed.state_dict(position=3)
    again = _mixed()
    again.set_pseudo_labels(labels)
    again.load_state_dict(state)
    again.set_epoch(1)
    assert list(again) == batches[3:]


def test_ranks_get_equal_batch_counts_and_disjoint_view_clips():
    ranks = [_mixed(rank=r, world=2) for r in range(2)]
    for sampler in ranks:
        sampler.set_epoch(2)
    batches = [list(s) for s in ranks]
    assert len(batches[0]) == len(batches[1]) > 0
    views = [{p for b in rank for p in b[8:]} for rank in batches]
    assert not views[0] & views[1]


def test_too_few_clips_for_a_batch_is_one_clear_error():
    with pytest.raises(ValueError, match="unlabelled.share"):
        _mixed(world=2, n_clips=5)


# Digests of MPerClassSampler's batches (3 epochs, every rank) as main 1366f7d draws them
# (computed there with _golden_digest): without data.unlabelled a run's batches are unchanged.
MAIN_DIGESTS = {
    ("classes", 1, "replace"): "4c37918e05e2e1b9",
    ("classes", 2, "skip"): "ae850b8dd7307524",
    ("batches", 2, "replace"): "8453952ff6aacaba",
    ("batches", 1, "skip"): "76fc6af61c5a48ce",
}


def _golden_index() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(45)
    classes, items = [], []
    for c in range(30):
        for i in range(rng.integers(1, 7)):
            n = rng.integers(1, 5)
            classes += [c] * n
            items += [i] * n
    order = rng.permutation(len(classes))
    return np.asarray(classes)[order], np.asarray(items)[order]


def _golden_digest(sampler_for_rank, world: int) -> str:
    digest = hashlib.sha256()
    for rank in range(world):
        sampler = sampler_for_rank(rank)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            digest.update(json.dumps(list(sampler)).encode())
    return digest.hexdigest()[:16]


@pytest.mark.parametrize("split, world, small", sorted(MAIN_DIGESTS))
def test_without_unlabelled_audio_the_batches_are_main_s(split, world, small):
    classes, items = _golden_index()

    def sampler(rank):
        options = dict(batch_size=12, m=3, seed=7, split=split, small_classes=small)
        return MPerClassSampler(classes, items, rank=rank, world_size=world, **options)

    assert _golden_digest(sampler, world) == MAIN_DIGESTS[split, world, small]


def test_a_run_without_data_unlabelled_uses_the_plain_sampler(tmp_path, tiny_demo):
    cfg = tiny_config(tiny_demo, tmp_path / "runs")
    train, train_set, _ = run_datasets(cfg)
    loader = TrainLoader.for_run(cfg, train, train_set, rank=0, world_size=1, options={})
    assert type(loader.sampler) is MPerClassSampler
    plain = MPerClassSampler(
        train.codes.class_codes, train.codes.item_codes, batch_size=8, m=2, seed=0
    )
    loader.set_epoch(1)
    plain.set_epoch(1)
    assert list(loader.sampler) == list(plain)
