"""AudioDataset items, crop seeds, bad files, and the padding collate."""

import logging
import os
import pickle

import numpy as np
import pytest
import soundfile
import torch
from torch.utils.data import DataLoader

from audioclf.config import ClipsConfig, FeaturesConfig
from audioclf.data.dataset import AudioDataset, BadFiles, collate_padded
from audioclf.data.readers import AudioReadError, FeatureFileError

RATE = 8000


@pytest.fixture
def audio_files(tmp_path):
    """Three mono clips of 1.0, 0.5 and 0.1 s (distinct random content)."""
    rng = np.random.default_rng(0)
    paths = []
    for i, seconds in enumerate([1.0, 0.5, 0.1]):
        path = tmp_path / f"clip{i}.wav"
        soundfile.write(path, rng.uniform(-0.5, 0.5, int(seconds * RATE)), RATE, subtype="FLOAT")
        paths.append(str(path))
    return paths


@pytest.fixture
def npy_files(tmp_path):
    """Three [frames, 16] feature files of 300, 120 and 10 frames; value = frame index."""
    paths = []
    for i, frames in enumerate([300, 120, 10]):
        path = tmp_path / f"feat{i}.npy"
        np.save(
            path, np.repeat(np.arange(frames, dtype=np.float32)[:, None], 16, axis=1) + 1000 * i
        )
        paths.append(str(path))
    return paths


def audio_cfg(**kw):
    """(features, clips) of 8 kHz audio files."""
    return (
        FeaturesConfig(kind="audio", sample_rate=RATE),
        ClipsConfig(crop_seconds=0.25, eval_max_seconds=0.75, **kw),
    )


def npy_cfg(**kw):
    """(features, clips) of .npy files; hop 80 at 8 kHz: a crop of 0.5 s = 4000 samples = 51
    frames; eval max 1 s = 101 frames."""
    return (
        FeaturesConfig(kind="npy", sample_rate=RATE, hop_length=80, n_mels=16),
        ClipsConfig(crop_seconds=0.5, eval_max_seconds=1.0, **kw),
    )


LABELS = np.array([0, 1, 1])


def test_audio_training_items_are_crops(audio_files):
    ds = AudioDataset(audio_files, LABELS, *audio_cfg(), train=True)
    x, label, position = ds[(1, 42)]
    assert x.shape == (2000,) and x.dtype == torch.float32
    assert (label, position) == (1, 1)
    assert ds[2][0].shape == (2000,)  # 0.1 s clip tiled up to the crop


def test_a_key_may_carry_the_crop_length(audio_files, npy_files):
    audio = AudioDataset(audio_files, LABELS, *audio_cfg(), train=True)
    assert audio[(0, 42, 3000)][0].shape == (3000,)
    assert audio[(2, 42, 3000)][0].shape == (3000,)  # a short clip tiled up to it
    assert torch.equal(audio[(0, 42, None)][0], audio[(0, 42)][0])  # None: clips.crop_seconds
    npy = AudioDataset(npy_files, LABELS, *npy_cfg(), train=True)
    assert npy[(0, 7)][0].shape == (51, 16)
    assert npy[(0, 7, 8000)][0].shape == (101, 16)  # 1 s at hop 80: the frames of 8000 samples
    x, lengths = audio.placeholder(3000)
    assert x.shape == (2, 3000) and lengths.tolist() == [3000, 3000]
    assert audio.placeholder()[0].shape == (2, 2000)
    assert npy.placeholder(8000)[0].shape == (2, 101, 16)
    assert npy.placeholder()[0].shape == (2, 51, 16)


def test_audio_eval_full_and_centre(audio_files):
    full = AudioDataset(audio_files, LABELS, *audio_cfg(), train=False)
    assert [full[i][0].shape[0] for i in range(3)] == [6000, 4000, 800]  # 1.0 s cut to 0.75 s
    centre = AudioDataset(audio_files, LABELS, *audio_cfg(eval_crop="center"), train=False)
    assert [centre[i][0].shape[0] for i in range(3)] == [2000] * 3
    assert torch.equal(centre[(0, 1)][0], centre[(0, 2)][0])  # eval ignores crop seeds


def test_same_seed_same_crop_different_seed_different_crop(audio_files, npy_files):
    for ds in (
        AudioDataset(audio_files, LABELS, *audio_cfg(), train=True),
        AudioDataset(npy_files, LABELS, *npy_cfg(), train=True),
    ):
        assert torch.equal(ds[(0, 7)][0], ds[(0, 7)][0])
        crops = [ds[(0, seed)][0] for seed in range(8)]
        assert sum(not torch.equal(crops[0], c) for c in crops[1:]) >= 6
        assert torch.equal(ds[0][0], ds[0][0])  # plain int: seeded from the position


def test_crops_do_not_depend_on_workers(npy_files):
    ds = AudioDataset(npy_files, LABELS, *npy_cfg(), train=True)
    keys = [[(0, 11), (1, 12), (2, 13)], [(0, 14), (1, 15), (2, 16)]]
    in_process = [collate_padded([ds[k] for k in batch])[0] for batch in keys]
    loader = DataLoader(ds, batch_sampler=keys, num_workers=2, collate_fn=collate_padded)
    for expected, batch in zip(in_process, loader, strict=True):
        assert torch.equal(expected, batch.x)


def test_npy_items(npy_files):
    train = AudioDataset(npy_files, LABELS, *npy_cfg(), train=True)
    x, label, position = train[(0, 3)]
    assert x.shape == (51, 16) and x.dtype == torch.float32 and (label, position) == (0, 0)
    assert torch.equal(x[:, 0], x[0, 0] + torch.arange(51.0))  # a contiguous window
    full = AudioDataset(npy_files, LABELS, *npy_cfg(), train=False)
    assert [full[i][0].shape[0] for i in range(3)] == [101, 101, 10]
    assert full[0][0][0, 0].item() == (300 - 101) // 2  # cut centred
    centre = AudioDataset(npy_files, LABELS, *npy_cfg(eval_crop="center"), train=False)
    assert centre[2][0].shape == (51, 16)


def test_collate_pads_and_reports_lengths(npy_files, audio_files):
    ds = AudioDataset(npy_files, LABELS, *npy_cfg(), train=False)
    x, lengths, labels, positions, _ = collate_padded([ds[2], ds[1]])
    assert x.shape == (2, 101, 16) and lengths.tolist() == [10, 101]
    assert not x[0, 10:].any() and labels.tolist() == [1, 1] and positions.tolist() == [2, 1]
    assert lengths.dtype == labels.dtype == positions.dtype == torch.int64
    ads = AudioDataset(audio_files, LABELS, *audio_cfg(), train=False)
    x, lengths, _, _, _ = collate_padded([ads[0], ads[2]])
    assert x.shape == (2, 6000) and lengths.tolist() == [6000, 800] and not x[1, 800:].any()


def test_bad_file_error_names_file_row_and_fix(tmp_path, audio_files, npy_files):
    bad_wav = tmp_path / "bad.wav"
    bad_wav.write_bytes(b"not a wav file at all")
    ds = AudioDataset(
        [audio_files[0], str(bad_wav)], np.array([0, 1]), *audio_cfg(), train=True, rows=[2, 17]
    )
    with pytest.raises(AudioReadError) as info:
        ds[(1, 0)]
    message = str(info.value)
    assert "bad.wav" in message and "row 17" in message and "data.skip_bad_files=true" in message

    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((50, 3), np.float32))
    nds = AudioDataset(
        [npy_files[0], str(wrong)], np.array([0, 1]), *npy_cfg(), train=False, rows=[5, 9]
    )
    with pytest.raises(FeatureFileError, match=r"row 9.*wrong.npy.*skip_bad_files"):
        nds[1]


def test_skip_mode_skips_counts_and_collate_drops(tmp_path, npy_files, caplog):
    missing = str(tmp_path / "missing.npy")
    ds = AudioDataset(
        [npy_files[0], missing, npy_files[1]],
        LABELS,
        *npy_cfg(),
        train=True,
        rows=[2, 3, 4],
        bad_files=BadFiles(skip=True),
    )
    with caplog.at_level(logging.WARNING, logger="audioclf"):
        items = [ds[(i, i)] for i in range(3)]
        assert items[1] is None and ds.skipped == 1
        x, lengths, labels, positions, _ = collate_padded(items)
    assert x.shape[0] == 2 and positions.tolist() == [0, 2] and labels.tolist() == [0, 1]
    assert "row 3" in caplog.text and "missing.npy" in caplog.text and "dropped 1" in caplog.text
    x, lengths, labels, positions, _ = collate_padded([None, None])
    assert x.shape[0] == lengths.shape[0] == labels.shape[0] == positions.shape[0] == 0


def test_dataset_is_picklable_and_validates(npy_files):
    ds = AudioDataset(npy_files, LABELS, *npy_cfg(), train=True, rows=[1, 2, 3])
    copy = pickle.loads(pickle.dumps(ds))
    assert torch.equal(copy[(1, 5)][0], ds[(1, 5)][0])
    with pytest.raises(ValueError, match="one label per path"):
        AudioDataset(npy_files, np.array([0, 1]), *npy_cfg(), train=True)
    with pytest.raises(ValueError, match="2 rows for 3 paths"):
        AudioDataset(npy_files, LABELS, *npy_cfg(), train=True, rows=[1, 2])
    with pytest.raises(ValueError, match="integers"):
        AudioDataset(npy_files, np.array([0.5, 1.0, 1.0]), *npy_cfg(), train=True)
    with pytest.raises(IndexError, match="position 3"):
        ds[3]


def _private_dirty_kb() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1])
    raise RuntimeError("no Private_Dirty in smaps_rollup")


def _read_all_paths(paths, queue):
    before = _private_dirty_kb()
    total = sum(len(paths[i]) for i in range(len(paths)))
    queue.put((_private_dirty_kb() - before, total))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux /proc")
def test_workers_reading_the_paths_do_not_copy_them():
    # A forked DataLoader worker shares the dataset's pages; reading a Python list of str writes
    # every string's reference count, so the pages get copied into the worker (copy-on-read).
    import multiprocessing

    from audioclf.data.dataset import PackedStrings

    strings = [f"/data/features/class_{i % 2000:05d}/sample_{i:08d}.npy" for i in range(300_000)]
    context = multiprocessing.get_context("fork")
    grown = {}
    for name, paths in (("list", strings), ("packed", PackedStrings(strings))):
        queue = context.Queue()
        child = context.Process(target=_read_all_paths, args=(paths, queue))
        child.start()
        grown[name], total = queue.get(timeout=60)
        child.join()
        assert total == sum(len(s) for s in strings)
    assert grown["list"] > 10_000, grown  # the test can tell: a list copies > 10 MB
    assert grown["packed"] < 2_000, grown


class _Ragged(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.full((2 + i, 3), float(i + 1)), i, i


def test_a_worker_builds_padded_batches_in_shared_memory_with_zero_padding():
    loader = DataLoader(_Ragged(), batch_size=3, num_workers=1, collate_fn=collate_padded)
    for x, lengths, labels, _, _ in loader:
        assert x.is_shared()
        for row, length in enumerate(lengths.tolist()):
            assert torch.all(x[row, :length] == labels[row] + 1)
            assert torch.all(x[row, length:] == 0)  # the buffer starts uninitialised


@pytest.mark.parametrize("workers", [0, 2])
def test_the_final_epochs_crop_reaches_persistent_workers(tmp_path, tiny_demo, workers):
    # The crop length travels with the batch keys: a persistent worker's dataset is the copy it
    # got at its start, so a change made to the main process's dataset would never reach it.
    from audioclf.data.loader import TrainLoader, loader_options
    from audioclf.training.trainer import FinalEpochs
    from tests.helpers import run_datasets, tiny_config

    def train_loader(cfg):
        train, train_set, _ = run_datasets(cfg)
        final = FinalEpochs.of(cfg)
        crops = final.crop_samples if final.changes_crop else None
        options = loader_options(cfg, torch.device("cpu"))
        return TrainLoader.for_run(
            cfg, train, train_set, rank=0, world_size=1, options=options, crop_samples=crops
        )

    cfg = tiny_config(
        tiny_demo,
        tmp_path,
        "cnn",
        "train.epochs=4",
        "train.final_epochs=2",
        "clips.final_crop_seconds=0.75",
        f"data.num_workers={workers}",
        "data.persistent_workers=true",
        "train.limit_batches=2",
    )
    loader = train_loader(cfg)
    assert bool(loader.loader.persistent_workers) == (workers > 0)
    rate = cfg.features.sample_rate
    lengths = []
    for epoch in range(4):
        loader.set_epoch(epoch)
        lengths.append({int(x.shape[1]) for x, *_ in loader})
        loader.end_epoch()
    assert lengths == [{rate // 2}, {rate // 2}, {rate * 3 // 4}, {rate * 3 // 4}]
    final = FinalEpochs.of(cfg)
    assert [final.crop_samples(e) for e in range(4)] == [rate // 2] * 2 + [rate * 3 // 4] * 2
    unchanged = train_loader(tiny_config(tiny_demo, tmp_path, "cnn", "train.final_epochs=1"))
    assert unchanged.loader.sampler.batches.crop_samples is None  # keys as before: (position, seed)


def test_the_augmenter_crops_to_the_key_s_crop_length(audio_files):
    # Speed perturbation returns one crop of a long clip: of the key's length, not its own.
    from audioclf.config import AugmentConfig
    from audioclf.data.augment import Augmenter

    features, clips = audio_cfg(pad_mode="zeros")
    only_speed = AugmentConfig(
        enabled=True, speed_factors=(0.9,), reverb_prob=0, eq_prob=0, noise_prob=0, gain_prob=0
    )
    augment = Augmenter(only_speed, features, clips.crop_samples(features))
    ds = AudioDataset(audio_files, LABELS, features, clips, train=True, augment=augment)
    plain = AudioDataset(audio_files, LABELS, features, clips, train=True)
    for crop in (None, 2000, 5000):
        x = ds[(0, 3, crop)][0]
        assert x.shape == (crop or 2000,)
        assert x.abs().gt(0).float().mean() > 0.99  # filled with audio, not padded
        assert not torch.equal(x, plain[(0, 3, crop)][0])  # and perturbed
    assert torch.equal(ds[(0, 3, 2000)][0], ds[(0, 3)][0])  # its own length: as before
