"""Feature packs: prepare --pack (from .npy and from audio), the checks on read, kill -9 and
resume, and the batch-at-a-time loader giving the per-file loader's batches."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from audioclf.config import load_config
from audioclf.data.augment import Augmenter
from audioclf.data.dataset import AudioDataset
from audioclf.data.index import Index, load_index
from audioclf.data.loader import TrainLoader, loader_kwargs
from audioclf.data.pack.batches import PackedBatchReader
from audioclf.data.pack.format import PackError, manifest_checksum
from audioclf.data.pack.write import pack_features
from audioclf.data.sampler import MixedBatchSampler, MPerClassSampler
from audioclf.data.unlabelled import load_unlabelled
from audioclf.outputs import FolderBusy
from audioclf.precompute.unlabelled import pack_unlabelled
from audioclf.prepare import main as prepare_main
from tests.helpers import ROOT, LockHolder, child_env, run_in_group, tiny_config
from tests.train_hooks import digest_hooks, stop_at

BINS = 16


def npy_sheet(folder: Path, *, classes=6, items=3, ids=3, exact=True, layout="frames_bins"):
    """A sheet of .npy features of 40-300 frames (fp16-exact values when `exact`)."""
    rng = np.random.default_rng(0)
    rows = []
    (folder / "f").mkdir(parents=True, exist_ok=True)
    for c in range(classes):
        for i in range(items):
            for k in range(ids):
                frames = rng.standard_normal((int(rng.integers(40, 300)), BINS)) * 3
                frames = frames.astype(np.float16 if exact else np.float32).astype(np.float32)
                path = folder / "f" / f"c{c}_i{i}_{k}.npy"
                np.save(path, frames.T if layout == "bins_frames" else frames)
                rows.append(
                    {"a_cls": f"c{c}", "a_item": f"i{i}", "a_id": path.stem, "path": str(path)}
                )
    sheet = folder / "in.csv"
    pd.DataFrame(rows).to_csv(sheet, index=False)
    return sheet


def npy_config(index: Path, *extra: str):
    return load_config(
        None,
        [
            f"data.index={index}",
            "features.kind=npy",
            f"features.n_mels={BINS}",
            "clips.crop_seconds=1",  # 101 frames: some samples are shorter (tiled)
            "sampler.batch_size=8",
            "sampler.m=2",
            *extra,
        ],
    )


def pack(sheet: Path, out: Path, *extra: str, **kwargs):
    return pack_features(
        sheet, out, npy_config(sheet, *extra), workers=1, progress=False, skip_bad=False, **kwargs
    )


def loader_batches(index: Path, *extra: str, workers=0, read_batches=3, epoch=1):
    """Every training batch of one epoch as (x float32 on the CPU, ids, positions' ids), the
    table in id order so that the per-file sheet and the pack share positions."""
    cfg = npy_config(index, *extra)
    loaded = load_index(cfg.data)
    index = Index(loaded.table.sort_values("id").reset_index(drop=True), loaded.source)
    augment = Augmenter(cfg.augment, cfg.features, cfg.clips.crop_samples(cfg.features))
    dataset = AudioDataset.from_index(index, cfg, train=True, augment=augment)
    sampler = MPerClassSampler(
        index.codes.class_codes, index.codes.item_codes, batch_size=8, m=2, seed=3
    )
    options = loader_kwargs(workers, False, False, 2, torch.device("cpu"))
    loader = TrainLoader(dataset, sampler, seed=5, read_batches=read_batches, **options)
    loader.set_epoch(epoch)
    ids = index.table["id"].to_numpy()
    out = []
    for batch in loader:  # a Batch on both paths
        out.append((batch.model_input(torch.device("cpu")), ids[batch.positions.numpy()]))
    return loader, out


# ------------------------------------------------------------------------------ the same batches


@pytest.mark.parametrize("augment", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_packed_loader_gives_the_per_file_batches(tmp_path, augment, workers):
    sheet = npy_sheet(tmp_path)
    summary = pack(sheet, tmp_path / "pack")
    extra = (f"augment.enabled={augment}", "augment.eq_prob=0.7", "augment.gain_prob=0.7")
    per_file_loader, per_file = loader_batches(sheet, *extra, workers=workers)
    packed_loader, packed = loader_batches(summary.index_path, *extra, workers=workers)
    assert packed_loader.packed and not per_file_loader.packed
    assert len(packed) == len(per_file) == per_file_loader.sampler.batches_per_epoch > 3
    for (x_file, ids_file), (x_pack, ids_pack) in zip(per_file, packed):
        assert (ids_file == ids_pack).all()  # the same row in every slot
        assert x_pack.dtype == torch.float32 and x_pack.shape == x_file.shape
        assert torch.equal(x_pack, x_file)  # fp16-exact features: equal to the bit


@pytest.mark.parametrize("workers", [0, 2])
def test_unlabelled_clips_beside_a_pack_give_the_per_file_batches(tmp_path, workers):
    # data.unlabelled beside a pack: the clips sit past the pack's rows, read one by one from
    # their .npy files into the unit as the per-file loader reads them, or packed themselves
    # (prepare --unlabelled --pack) read as the pack's rows are
    sheet = npy_sheet(tmp_path)
    summary = pack(sheet, tmp_path / "pack")
    clips = [str(p) for p in sorted((tmp_path / "f").glob("c5_*.npy"))]  # 9 clips
    listing = tmp_path / "clips.csv"
    pd.DataFrame({"path": clips}).to_csv(listing, index=False)
    clips_pack = pack_unlabelled(
        str(listing), tmp_path / "clips", npy_config(sheet), workers=1, skip_bad=False
    )
    packed_clips = load_unlabelled(str(clips_pack.index_path), npy_config(sheet).features)
    assert packed_clips.paths == tuple(clips) and len(packed_clips.pack.frames) == 9
    extra = ("augment.enabled=true", "augment.eq_prob=0.7", "augment.gain_prob=0.7")
    batches = {}
    for name, index_path, clips_from in (
        ("per-file", sheet, None),
        ("packed", summary.index_path, None),
        ("both packed", summary.index_path, packed_clips.pack),
    ):
        cfg = npy_config(index_path, *extra)
        loaded = load_index(cfg.data)
        index = Index(loaded.table.sort_values("id").reset_index(drop=True), loaded.source)
        augment = Augmenter(cfg.augment, cfg.features, cfg.clips.crop_samples(cfg.features))
        dataset = AudioDataset.from_index(index, cfg, train=True, augment=augment)
        dataset = dataset.with_unlabelled(clips, clips_from)
        assert dataset.packed(len(dataset) - 1) == (name == "both packed")
        labelled = MPerClassSampler(
            index.codes.class_codes, index.codes.item_codes, batch_size=6, m=2, seed=3
        )
        sampler = MixedBatchSampler(labelled, len(clips), clips_per_batch=2)
        options = loader_kwargs(workers, False, False, 2, torch.device("cpu"))
        loader = TrainLoader(dataset, sampler, seed=5, read_batches=2, **options)
        loader.set_epoch(1)
        batches[name] = [(b.model_input(torch.device("cpu")), b.positions) for b in loader]
        assert loader.packed == (name != "per-file")
    assert len(batches["both packed"]) == len(batches["per-file"]) > 2
    n_rows = 6 * 3 * 3
    for (x_file, at_file), *packed in zip(*batches.values(), strict=True):
        for x_pack, at_pack in packed:
            assert torch.equal(at_file, at_pack) and (at_pack >= n_rows).sum() == 4  # 2 clips x 2
            assert torch.equal(x_pack, x_file)  # fp16-exact features: equal to the bit


def test_an_unlabelled_pack_goes_beside_a_packed_index_of_its_dtype(tmp_path):
    sheet = npy_sheet(tmp_path, classes=2)
    clips = tmp_path / "clips.csv"
    pd.DataFrame({"path": sorted(map(str, (tmp_path / "f").glob("c1_*.npy")))}).to_csv(clips)
    packs = {}
    for dtype in ("float16", "float32"):
        done = pack_unlabelled(
            str(clips), tmp_path / dtype, npy_config(sheet), workers=1, skip_bad=False, dtype=dtype
        )
        packs[dtype] = load_unlabelled(str(done.index_path), npy_config(sheet).features).pack
    cfg = npy_config(sheet)
    per_file = AudioDataset.from_index(load_index(cfg.data), cfg, train=True)
    with pytest.raises(
        PackError, match=r"data.unlabelled is a feature pack .* and data.index is not"
    ):
        per_file.with_unlabelled(["a.npy"] * 9, packs["float16"])
    cfg = npy_config(pack(sheet, tmp_path / "pack").index_path)
    packed = AudioDataset.from_index(load_index(cfg.data), cfg, train=True)
    with pytest.raises(
        PackError, match=r"16 bins of float32, the pack .* 16 of float16; pack both"
    ):
        packed.with_unlabelled(["a.npy"] * 9, packs["float32"])
    joined = packed.with_unlabelled(["a.npy"] * 9, packs["float16"])
    assert len(joined) == len(packed) + 18 and joined.pack.files[-1].startswith(
        str(tmp_path / "float16")
    )


@pytest.mark.parametrize("augment", [False, True])
def test_every_tensor_a_packed_step_moves_to_the_device_went_through_the_loaders_pinning(
    tmp_path, monkeypatch, augment
):
    """On CUDA (data.pin_memory) the DataLoader pins what a unit holds; it leaves numpy arrays
    alone, and a copy from one of those to the GPU is a pageable one. No GPU here: the loader
    is told there is an accelerator and pinning is a recorded copy. Every tensor of every batch
    (x, lengths, labels, positions, offsets) must live in a pinned copy."""
    pinned = []  # the pinned copies, kept alive so their addresses stay theirs

    def pin(tensor, *args, **kwargs):
        pinned.append(tensor.clone())
        return pinned[-1]

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    summary = pack(npy_sheet(tmp_path), tmp_path / "pack")
    cfg = npy_config(summary.index_path, f"augment.enabled={augment}", "augment.eq_prob=1")
    index = load_index(cfg.data)
    augmenter = Augmenter(cfg.augment, cfg.features, cfg.clips.crop_samples(cfg.features))
    dataset = AudioDataset.from_index(index, cfg, train=True, augment=augmenter)
    sampler = MPerClassSampler(index.codes.class_codes, index.codes.item_codes, batch_size=8, m=2)
    options = loader_kwargs(0, True, False, 2, torch.device("cuda"))
    loader = TrainLoader(dataset, sampler, seed=5, read_batches=3, **options)
    batches = list(loader)
    assert len(batches) > 3 and len(pinned) <= 3 * -(-len(batches) // 3)  # a few per unit
    addresses = {t.untyped_storage().data_ptr() for t in pinned}
    for batch in batches:
        tensors = [t for t in batch if t is not None]
        assert len(tensors) == (5 if augment else 4)
        for t in tensors:
            assert isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in addresses


def test_packed_crops_are_the_per_file_crops_to_fp16_rounding(tmp_path):
    sheet = npy_sheet(tmp_path, exact=False)
    summary = pack(sheet, tmp_path / "pack")
    _, per_file = loader_batches(sheet)
    _, packed = loader_batches(summary.index_path, read_batches=1)
    for (x_file, ids_file), (x_pack, ids_pack) in zip(per_file, packed, strict=True):
        assert (ids_file == ids_pack).all()
        assert torch.equal(x_pack, x_file.half().float())  # only fp16's rounding differs


def test_float32_packs_and_bins_frames_sources_are_exact(tmp_path):
    sheet = npy_sheet(tmp_path, exact=False, layout="bins_frames")
    summary = pack(sheet, tmp_path / "pack", "clips.npy_layout=bins_frames", dtype="float32")
    _, per_file = loader_batches(sheet, "clips.npy_layout=bins_frames")
    _, packed = loader_batches(summary.index_path)
    assert packed[0][0].shape[-1] == BINS
    for (x_file, _), (x_pack, _) in zip(per_file, packed, strict=True):
        assert torch.equal(x_pack, x_file)


def test_samples_across_several_data_files_and_evaluation_clips(tmp_path):
    sheet = npy_sheet(tmp_path)
    summary = pack(sheet, tmp_path / "pack", file_bytes=20_000)
    assert summary.files > 3 and summary.packed == 54
    cfg_file, cfg_pack = npy_config(sheet), npy_config(summary.index_path)
    by_file = AudioDataset.from_index(load_index(cfg_file.data), cfg_file, train=False)
    packed_index = load_index(cfg_pack.data)
    by_pack = AudioDataset.from_index(packed_index, cfg_pack, train=False)
    ids = list(load_index(cfg_file.data).table["id"])
    for position, sample_id in enumerate(packed_index.table["id"]):
        x_pack, label, _ = by_pack[position]
        x_file = by_file[ids.index(sample_id)][0]
        assert torch.equal(x_pack, x_file)  # the whole clip, as evaluation reads it


def test_the_pack_is_class_major_and_its_index_keeps_the_sheet_columns(tmp_path):
    sheet = npy_sheet(tmp_path)
    frame = pd.read_csv(sheet).sample(frac=1, random_state=1)  # rows in any order
    frame["note"] = "kept"
    frame.to_csv(sheet, index=False)
    summary = pack(sheet, tmp_path / "pack")
    index = pd.read_parquet(summary.index_path)
    assert list(index["a_id"]) == sorted(frame["a_id"])  # class, item, id order
    assert (index["note"] == "kept").all() and (index["path"] == "data-00000.bin").all()
    offsets, frames = index["pack_offset"].to_numpy(), index["pack_frames"].to_numpy()
    assert offsets[0] == 0 and (np.diff(offsets) == frames[:-1] * BINS * 2).all()
    manifest = json.loads((tmp_path / "pack" / "pack.json").read_text())
    assert manifest["files"][0]["bytes"] == frames.sum() * BINS * 2


def test_a_pack_from_audio_holds_the_front_ends_features(tmp_path, tiny_demo):
    from audioclf.data.readers import load_audio
    from audioclf.spectrogram import log_mel

    cfg = tiny_config(tiny_demo, tmp_path / "runs")
    summary = pack_features(
        tiny_demo, tmp_path / "pack", cfg, workers=2, skip_bad=False, progress=False
    )
    index = pd.read_parquet(summary.index_path).set_index("a_id")
    source = load_index(cfg.data).table.set_index("id")
    data = (tmp_path / "pack" / "data-00000.bin").read_bytes()
    for sample_id in index.index[:5]:
        offset, frames = index.loc[sample_id, ["pack_offset", "pack_frames"]]
        packed = np.frombuffer(data, np.float16, frames * 32, offset).reshape(frames, 32)
        expected = log_mel(load_audio(source.loc[sample_id, "path"], 16000), cfg.features)
        assert np.array_equal(packed, expected.astype(np.float16))
    other = tiny_config(
        summary.index_path, tmp_path, "cnn", "features.kind=npy", "features.hop_length=200"
    )
    with pytest.raises(PackError, match=r"features.hop_length=200 \(the pack: 160\)"):
        AudioDataset.from_index(load_index(other.data), other, train=True)


# ------------------------------------------------------------------------------ checked on read


def packed_dataset(index: Path, *extra: str) -> AudioDataset:
    cfg = npy_config(index, *extra)
    return AudioDataset.from_index(load_index(cfg.data), cfg, train=True)


def test_a_data_file_cut_short_is_one_line(tmp_path):
    summary = pack(npy_sheet(tmp_path), tmp_path / "pack")
    data = tmp_path / "pack" / "data-00000.bin"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(
        PackError, match=r"data-00000.bin has \d+ bytes, the pack wrote \d+ .cut short"
    ):
        packed_dataset(summary.index_path)


def test_a_sheet_re_pointed_since_packing_is_refused_and_a_subset_is_fine(tmp_path):
    summary = pack(npy_sheet(tmp_path), tmp_path / "pack")
    index = pd.read_parquet(summary.index_path)
    index.iloc[::2].to_parquet(tmp_path / "pack" / "half.parquet")  # rows dropped: fine
    assert len(packed_dataset(tmp_path / "pack" / "half.parquet")) == 27
    index.loc[3, "pack_offset"] += 32  # a row re-pointed into another sample
    index.to_parquet(tmp_path / "pack" / "edited.parquet")
    with pytest.raises(
        PackError, match="changed since packing: 1 row.s. .sheet row 5 first. points"
    ):
        packed_dataset(tmp_path / "pack" / "edited.parquet")


def test_other_features_and_audio_kind_are_refused_on_read(tmp_path):
    summary = pack(npy_sheet(tmp_path), tmp_path / "pack")
    with pytest.raises(PackError, match=r"features.n_mels=32 \(the pack: 16\)"):
        packed_dataset(summary.index_path, "features.n_mels=32")
    cfg = npy_config(summary.index_path, "features.kind=audio")
    with pytest.raises(PackError, match="is a feature pack .* set features.kind=npy"):
        AudioDataset.from_index(load_index(cfg.data), cfg, train=True)


def test_non_finite_bytes_in_a_pack_name_the_row(tmp_path):
    summary = pack(npy_sheet(tmp_path, classes=4), tmp_path / "pack")
    data = tmp_path / "pack" / "data-00000.bin"
    frames = int(pd.read_parquet(summary.index_path)["pack_frames"].iloc[0])
    raw = bytearray(data.read_bytes())
    raw[: 2 * BINS * frames] = np.full(BINS * frames, np.inf, np.float16).tobytes()  # sample 1
    data.write_bytes(bytes(raw))  # the same size: only the values changed
    with pytest.raises(PackError, match=r"index row 2: feature pack .* non-finite"):
        loader_batches(summary.index_path)


def test_crops_of_a_pack_as_packed_are_not_checked_again(tmp_path, monkeypatch, caplog):
    # the packer refused non-finite frames; data files of the size and mtime it recorded hold
    # them, so a training reader skips the per-unit finite check; another mtime (an edit, a
    # copy without times) brings it back, with one line saying so
    summary = pack(npy_sheet(tmp_path, classes=4), tmp_path / "pack")
    checked = []
    original = PackedBatchReader._check_finite
    monkeypatch.setattr(
        PackedBatchReader,
        "_check_finite",
        lambda self, *args: checked.append(1) or original(self, *args),
    )
    _, as_packed = loader_batches(summary.index_path)
    assert len(as_packed) > 3 and not checked
    data = tmp_path / "pack" / "data-00000.bin"
    stat = data.stat()
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # the bytes unchanged
    with caplog.at_level("INFO", logger="audioclf"):
        _, copied = loader_batches(summary.index_path)
    assert len(checked) == -(-len(copied) // 3)  # one check a unit of 3 batches
    assert "1 of 1 data file(s) have another mtime than when packed" in caplog.text
    for (x_packed, ids_packed), (x_copied, ids_copied) in zip(as_packed, copied, strict=True):
        assert torch.equal(x_packed, x_copied) and (ids_packed == ids_copied).all()
    manifest_path = tmp_path / "pack" / "pack.json"  # a pack from before mtimes were recorded
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        del entry["mtime_ns"]
    manifest["checksum"] = manifest_checksum(manifest)
    manifest_path.write_text(json.dumps(manifest))
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # its mtime back as packed
    checked.clear()
    caplog.clear()
    with caplog.at_level("INFO", logger="audioclf"):
        _, older = loader_batches(summary.index_path)
    assert len(checked) == -(-len(older) // 3)  # checked, and said for what it is
    assert "records no data-file mtimes (packed by an earlier audioclf)" in caplog.text
    assert "another mtime" not in caplog.text


def test_cached_and_uncached_crops_read_the_same(tmp_path, monkeypatch):
    # a crop the page cache holds is read at once (RWF_NOWAIT); the others are announced, then
    # read; a file system that refuses RWF_NOWAIT gets every crop announced
    summary = pack(npy_sheet(tmp_path, classes=4), tmp_path / "pack")
    data = tmp_path / "pack" / "data-00000.bin"
    real, calls = os.preadv, []

    def preadv(fd, buffers, offset, flags=0):
        calls.append(flags)
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", preadv)
    _, warm = loader_batches(summary.index_path)
    assert calls and all(flags == os.RWF_NOWAIT for flags in calls)  # cached: one read a crop
    calls.clear()
    descriptor = os.open(data, os.O_RDONLY)
    os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache
    os.close(descriptor)
    _, cold = loader_batches(summary.index_path)
    assert 0 in calls  # some crops were not cached: read after their announcement

    def refusing(fd, buffers, offset, flags=0):
        if flags:
            raise OSError(errno.EOPNOTSUPP, "not supported")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refusing)
    _, refused = loader_batches(summary.index_path)
    for batches in (cold, refused):
        for (x_warm, ids_warm), (x, ids) in zip(warm, batches, strict=True):
            assert torch.equal(x_warm, x) and (ids_warm == ids).all()


# ------------------------------------------------------------------------------ writing


def test_bad_sources_are_one_line_or_skipped(tmp_path):
    sheet = npy_sheet(tmp_path, classes=3)
    frame = pd.read_csv(sheet)
    np.save(frame.loc[4, "path"], np.full((50, BINS), 1e6, np.float32))  # beyond fp16
    np.save(frame.loc[7, "path"], np.zeros((50, BINS + 1), np.float32))  # wrong bins
    with pytest.raises(
        ValueError, match=r"row 6 of .*in.csv .*beyond float16's range .*--pack-dtype float32"
    ):
        pack(sheet, tmp_path / "a")
    assert not (tmp_path / "a" / "index.parquet").exists()
    summary = pack_features(  # the refused folder resumes (the refusal came in its first chunk)
        sheet, tmp_path / "a", npy_config(sheet), workers=1, progress=False, skip_bad=True
    )
    assert summary.skipped == 2 and summary.packed == len(frame) - 2
    listed = pd.read_csv(summary.skipped_path)
    assert list(listed["row"]) == [6, 9] and "not [frames, 16]" in listed["reason"].iloc[1]


def test_reruns_locks_and_other_sheets(tmp_path):
    sheet = npy_sheet(tmp_path, classes=3)
    first = pack(sheet, tmp_path / "pack")
    again = pack(sheet, tmp_path / "pack")
    assert again.already_complete and again.packed == first.packed
    with pytest.raises(ValueError, match="holds a feature pack of another sheet or settings"):
        pack(sheet, tmp_path / "pack", dtype="float32")
    with LockHolder(tmp_path / "other" / ".pack.lock"):
        with pytest.raises(FolderBusy, match="another prepare --pack"):
            pack(sheet, tmp_path / "other")


def test_prepare_pack_command(tmp_path, capsys):
    sheet = npy_sheet(tmp_path, classes=3)
    args = ["--index", str(sheet), "--out", str(tmp_path / "pack"), "--pack", "--quiet"]
    assert (
        prepare_main([*args, "features.kind=npy", f"features.n_mels={BINS}", "--workers", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert "27 rows: 27 packed" in out and "train on it: ./run.sh" in out and "kind=npy" in out
    assert prepare_main([*args, "--shard", "0/2"]) == 2
    assert "--pack writes one pack in one run" in capsys.readouterr().err


KILLER = """
import os, signal, sys
from pathlib import Path
from audioclf.data.pack import write as packing
from tests.data.test_pack import npy_config
packing.CHUNK_ROWS = 4
sheet, out = Path(sys.argv[1]), Path(sys.argv[2])

def die(rows_done):
    if rows_done >= 12:
        with open(out / "data-00000.bin", "ab") as handle:  # bytes past the last commit
            handle.write(b"x" * 1000)
        os.kill(os.getpid(), signal.SIGKILL)

packing.pack_features(sheet, out, npy_config(sheet), workers=1, skip_bad=False,
                      progress=False, on_chunk=die, file_bytes=20_000)
"""


@pytest.mark.slow
def test_a_pack_killed_mid_way_resumes_to_the_same_bytes(tmp_path):
    sheet = npy_sheet(tmp_path)
    straight = pack(sheet, tmp_path / "straight", file_bytes=20_000)
    out = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLER), str(sheet), str(out)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert not (out / "index.parquet").exists() and (out / ".pack-progress.json").exists()
    resumed = pack(sheet, out, file_bytes=20_000)
    assert resumed.resumed_at == 12 and resumed.packed == straight.packed
    for name in ["index.parquet", "rows.npy"] + [
        f"data-{i:05d}.bin" for i in range(straight.files)
    ]:
        assert (out / name).read_bytes() == (tmp_path / "straight" / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in (tmp_path / "straight").iterdir()
    )


# ------------------------------------------------------------------------------ training


def _fit_worker(rank, world, cfg, stop):
    from audioclf.training.trainer import fit

    return fit(cfg, hooks=stop_at(stop) if stop else digest_hooks())


@pytest.mark.slow
def test_two_ranks_stop_mid_epoch_and_resume_bit_exactly_on_a_pack(tmp_path, tiny_demo):
    cfg = tiny_config(tiny_demo, tmp_path / "runs")
    packed = pack_features(
        tiny_demo, tmp_path / "pack", cfg, workers=1, skip_bad=False, progress=False
    )
    # classes of uneven size: half the classes lose a third of their rows (dropped from the
    # pack's index, as a user may), so the ranks' class shares differ in rows
    index = pd.read_parquet(packed.index_path)
    small = index["a_cls"].isin(sorted(index["a_cls"].unique())[::2])
    uneven = index[~small | (np.arange(len(index)) % 3 != 0)]
    assert 0 < len(index) - len(uneven) < len(index) // 4
    uneven.to_parquet(tmp_path / "pack" / "uneven.parquet", index=False)

    def config(runs: str, *extra: str):
        return tiny_config(
            tmp_path / "pack" / "uneven.parquet",
            tmp_path / runs,
            "cnn",
            "features.kind=npy",
            "data.num_workers=1",
            "data.pack_read_batches=2",
            "sampler.batch_size=4",
            "train.epochs=2",
            *extra,
        )

    for name in "abc":
        (tmp_path / name).mkdir()
    straight = run_in_group(_fit_worker, tmp_path / "a", config("a"), 0, timeout=300)
    stopped = run_in_group(_fit_worker, tmp_path / "b", config("b"), 2, timeout=300)
    assert stopped[0]["stopped"] and stopped[0]["step"] == 2
    resumed = run_in_group(
        _fit_worker, tmp_path / "c", config("b", "checkpoint.resume=auto"), 0, timeout=300
    )
    assert resumed[0]["step"] == straight[0]["step"] > 2
    assert resumed[0]["parameters_sha256"] == straight[0]["parameters_sha256"]
    assert resumed[1]["parameters_sha256"] == resumed[0]["parameters_sha256"]


@pytest.mark.slow
def test_the_data_scale_benchmark_runs_at_its_smallest_size(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/data_scale.py", "--smoke", "--workdir", str(tmp_path)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a target missed at this size
    out = proc.stdout
    for row in (
        "ceiling os.preadv loop, warm",
        "packed loader, 1 worker, warm",
        "packed+augment loader, 1 worker, warm",
        "per-file loader, 1 worker, cold",
        "start-up from a cached index",
    ):
        assert row in out, out
    verdicts = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 9, out


# ------------------------------------------------------------------------------ packs that cannot lie


def test_an_edited_pack_json_is_refused_when_the_pack_is_opened(tmp_path):
    summary = pack(npy_sheet(tmp_path, classes=3), tmp_path / "pack")
    manifest = tmp_path / "pack" / "pack.json"
    edited = json.loads(manifest.read_text()) | {"dtype": "float32"}  # the values read as garbage
    manifest.write_text(json.dumps(edited, indent=2))
    with pytest.raises(PackError) as caught:
        packed_dataset(summary.index_path)
    message = str(caught.value)
    assert f"{manifest} does not match its checksum" in message, message
    assert "python -m audioclf.prepare --pack" in message and "\n" not in message


@pytest.mark.parametrize("damage", ["cut short", "edited"])
def test_a_damaged_rows_npy_is_one_line_naming_it(tmp_path, damage):
    summary = pack(npy_sheet(tmp_path, classes=3), tmp_path / "pack")
    rows = tmp_path / "pack" / "rows.npy"
    if damage == "cut short":
        os.truncate(rows, rows.stat().st_size - 100)
    else:
        table = np.load(rows)
        table[0, 2] += 1  # one sample's frame count
        np.save(rows, table)
    with pytest.raises(PackError) as caught:
        packed_dataset(summary.index_path)
    message = str(caught.value)
    assert f"{rows} does not match the checksum in pack.json (cut short or edited" in message
    assert "python -m audioclf.prepare --pack" in message


def test_a_pack_of_an_older_audioclf_is_refused_on_read_and_by_prepare(tmp_path):
    sheet = npy_sheet(tmp_path, classes=3)
    summary = pack(sheet, tmp_path / "pack")
    manifest = tmp_path / "pack" / "pack.json"
    old = json.loads(manifest.read_text()) | {"version": 1}
    del old["checksum"], old["rows_checksum"]
    manifest.write_text(json.dumps(old))
    with pytest.raises(PackError, match=r"made by an older audioclf \(format version 1; .*--pack"):
        packed_dataset(summary.index_path)
    with pytest.raises(ValueError, match=r"pack made by an older audioclf .*delete .*pack"):
        pack(sheet, tmp_path / "pack")


def test_a_source_rewritten_after_packing_is_named_by_the_next_prepare(tmp_path):
    sheet = npy_sheet(tmp_path, classes=3)
    pack(sheet, tmp_path / "pack")
    source = Path(pd.read_csv(sheet)["path"].iloc[4])
    np.save(source, np.zeros_like(np.load(source)))  # the same shape: the same size
    with pytest.raises(ValueError) as caught:
        pack(sheet, tmp_path / "pack")
    message = str(caught.value)
    assert (
        f"1 source file(s) that changed since they were packed (first: {source}, row 6" in message
    )
    assert "delete" in message and "prepare --pack again" in message


def test_a_source_rewritten_between_a_stopped_pack_and_its_rerun_is_named(tmp_path):
    sheet = npy_sheet(tmp_path, classes=3)

    def stop(rows_done):
        raise KeyboardInterrupt  # after the first durable chunk

    with pytest.raises(KeyboardInterrupt):
        pack(sheet, tmp_path / "pack", on_chunk=stop)
    assert (tmp_path / "pack" / ".pack-progress.json").is_file()
    first = pd.read_csv(sheet).sort_values(["a_cls", "a_item", "a_id"])["path"].iloc[0]
    np.save(first, np.load(first)[:-1])  # packed already, now shorter
    with pytest.raises(ValueError, match=f"changed since they were packed .first: {first}"):
        pack(sheet, tmp_path / "pack")


def test_a_cut_short_pack_index_names_it_and_prepare_pack(tmp_path):
    summary = pack(npy_sheet(tmp_path, classes=3), tmp_path / "pack")
    os.truncate(summary.index_path, summary.index_path.stat().st_size // 2)
    with pytest.raises(ValueError) as caught:
        packed_dataset(summary.index_path)
    message = str(caught.value)
    assert f"index file {summary.index_path} could not be read as .parquet" in message
    assert message.endswith("pack again with python -m audioclf.prepare --pack into a new folder")
