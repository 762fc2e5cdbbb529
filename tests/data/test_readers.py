"""Reading audio and precomputed features (audioclf.data.readers)."""

import io
import os

import numpy as np
import pytest
import soundfile
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from audioclf.data import readers
from audioclf.data.readers import (
    AudioReadError,
    AudioTooLong,
    FeatureFileError,
    crop_or_pad,
    load_audio,
    read_npy_crop,
    seeded_or_centred,
    window_starts,
)
from tests.helpers import write_unknown_length_audio

# ---------------------------------------------------------------------------------------------
# load_audio


def test_load_audio_mixes_stereo_down_and_resamples(tmp_path):
    seconds, rate = 0.5, 44100
    t = np.arange(int(seconds * rate)) / rate
    left = 0.5 * np.sin(2 * np.pi * 440 * t)
    right = 0.1 * np.ones_like(t)
    path = tmp_path / "stereo.wav"
    soundfile.write(path, np.stack([left, right], axis=1), rate, subtype="FLOAT")

    wave = load_audio(path, 16000)

    assert wave.dtype == torch.float32 and wave.dim() == 1
    assert wave.shape[0] == int(seconds * 16000)
    # The mono mix of a sine and a constant has mean = constant / 2 (well inside the clip).
    assert wave[2000:-2000].mean().item() == pytest.approx(0.05, abs=5e-3)
    assert wave.abs().max().item() == pytest.approx(0.3, abs=0.02)


def test_load_audio_keeps_rate_and_reads_flac(tmp_path):
    path = tmp_path / "mono.flac"
    data = np.random.default_rng(0).uniform(-0.5, 0.5, 1600)
    soundfile.write(path, data, 16000)
    wave = load_audio(path, 16000)
    np.testing.assert_allclose(wave.numpy(), data, atol=1e-4)  # 16-bit FLAC quantisation


@pytest.mark.parametrize("content", [b"", b"RIFF\x00\x00garbage, not audio" * 10])
def test_corrupt_audio_names_the_file(tmp_path, content):
    path = tmp_path / "broken.wav"
    path.write_bytes(content)
    with pytest.raises(AudioReadError, match="broken.wav"):
        load_audio(path, 16000)


def test_missing_audio_names_the_file(tmp_path):
    with pytest.raises(AudioReadError, match="nowhere.wav"):
        load_audio(tmp_path / "nowhere.wav", 16000)


# ---------------------------------------------------------------------------------------------
# crop_or_pad


def test_crop_centred_without_rng():
    wave = torch.arange(10.0)
    assert crop_or_pad(wave, 4, None).tolist() == [3.0, 4.0, 5.0, 6.0]


def test_random_crop_is_a_window_and_seeded():
    wave = torch.arange(1000.0)
    crops = [crop_or_pad(wave, 50, np.random.default_rng(seed)) for seed in range(20)]
    starts = {int(c[0]) for c in crops}
    assert len(starts) > 10  # random offsets
    for c in crops:
        assert c.tolist() == list(range(int(c[0]), int(c[0]) + 50))
    again = crop_or_pad(wave, 50, np.random.default_rng(3))
    assert torch.equal(again, crops[3])


def test_short_clip_is_tiled_or_zero_padded():
    wave = torch.tensor([1.0, 2.0, 3.0])
    assert crop_or_pad(wave, 8, None, "repeat").tolist() == [1, 2, 3, 1, 2, 3, 1, 2]
    assert crop_or_pad(wave, 5, np.random.default_rng(0), "zeros").tolist() == [1, 2, 3, 0, 0]


def test_crop_or_pad_rejects_bad_input():
    with pytest.raises(ValueError, match="pad_mode"):
        crop_or_pad(torch.ones(4), 8, None, "mirror")
    with pytest.raises(ValueError, match="empty"):
        crop_or_pad(torch.ones(0), 8, None)


@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(1, 300),
    length=st.integers(1, 300),
    seed=st.integers(0, 2**32),
    pad_mode=st.sampled_from(["repeat", "zeros"]),
)
def test_crop_or_pad_always_gives_the_length(total, length, seed, pad_mode):
    wave = torch.arange(1, total + 1, dtype=torch.float32)
    out = crop_or_pad(wave, length, np.random.default_rng(seed), pad_mode)
    assert out.shape == (length,)
    kept = out[out != 0]
    assert bool(((kept >= 1) & (kept <= total)).all())


# ---------------------------------------------------------------------------------------------
# read_npy_crop


def test_window_starts_are_uniform_in_range_and_the_same_one_by_one_or_vectorised():
    seeds = np.arange(200_000, dtype=np.int64) * 1_000_003 + 7
    totals = np.random.default_rng(0).integers(300, 400, len(seeds))
    starts = window_starts(seeds, totals, 300)
    assert starts.min() == 0 and (starts <= totals - 300).all()
    assert (starts == totals - 300).any()  # the last start is reachable
    single = [int(window_starts(int(s), int(t), 300)[0]) for s, t in zip(seeds[:50], totals[:50])]
    assert single == starts[:50].tolist()
    counts = np.bincount(window_starts(seeds, 309, 300), minlength=10)  # 10 starts
    assert counts.min() > 0.95 * len(seeds) / 10 and counts.max() < 1.05 * len(seeds) / 10
    assert window_starts(2**63 - 1, 10, 10).tolist() == [0]  # the largest seed, one start
    # one crop at a time (read_npy_crop, a pack's read_window): the same starts on Python ints
    picked = list(range(0, len(seeds), 997)) + [len(seeds) - 1]
    scalar = [seeded_or_centred(int(totals[i]), 300, int(seeds[i])) for i in picked]
    assert scalar == starts[picked].tolist()
    extremes = [(2**63 - 1, 10**9, 1), (-5, 2**31, 7), (0, 301, 300), (12345, 2**40, 2**39)]
    for seed, total, length in extremes:
        assert seeded_or_centred(total, length, seed) == window_starts(seed, total, length)[0]
    assert seeded_or_centred(1000, 100, None) == 450  # no seed: centred


def _write(path, array):
    np.save(path, array)
    return path


def test_npy_window_both_layouts(tmp_path):
    frames = np.arange(1000 * 8, dtype=np.float32).reshape(1000, 8)
    fb = _write(tmp_path / "fb.npy", frames)
    bf = _write(tmp_path / "bf.npy", np.ascontiguousarray(frames.T))
    for path, layout in [(fb, "frames_bins"), (bf, "bins_frames")]:
        centred = read_npy_crop(path, 100, None, layout, 8)
        np.testing.assert_array_equal(centred, frames[450:550])
        crop = read_npy_crop(path, 100, 5, layout, 8)
        start = int(window_starts(5, 1000, 100)[0])
        np.testing.assert_array_equal(crop, frames[start : start + 100])
        assert crop.dtype == np.float32 and crop.flags["C_CONTIGUOUS"] and crop.flags["WRITEABLE"]
        np.testing.assert_array_equal(read_npy_crop(path, None, None, layout, 8), frames)


def test_npy_headers_numpy_writes_and_others_it_reads(tmp_path, monkeypatch):
    # np.save's own header is parsed without numpy's parser; any other spelling (here a header
    # written by another tool, keys in another order) still goes through numpy's
    frames = np.arange(30 * 4, dtype="<f4").reshape(30, 4)
    saved = _write(tmp_path / "saved.npy", frames)
    with open(saved, "rb") as handle:
        raw = handle.read()
    dict_text = "{'shape': (30, 4), 'fortran_order': False, 'descr': '<f4'}"
    header = dict_text.ljust(117) + "\n"  # magic 6 + version 2 + length 2 + 118 = 128
    other = tmp_path / "other.npy"
    other.write_bytes(raw[:8] + len(header).to_bytes(2, "little") + header.encode() + raw[128:])
    parsed_by_numpy = []
    numpy_parser = np.lib.format.read_array_header_1_0
    monkeypatch.setattr(
        np.lib.format,
        "read_array_header_1_0",
        lambda stream: parsed_by_numpy.append(1) or numpy_parser(stream),
    )
    for path, by_numpy in ((saved, []), (other, [1])):
        parsed_by_numpy.clear()
        fd = os.open(path, os.O_RDONLY)
        try:
            assert readers.read_npy_header(fd) == ((30, 4), False, np.dtype("<f4"), 128)
        finally:
            os.close(fd)
        assert parsed_by_numpy == by_numpy
        np.testing.assert_array_equal(
            read_npy_crop(path, 10, 3, "frames_bins", 4),
            frames[seeded_or_centred(30, 10, 3) :][:10],
        )


@pytest.mark.parametrize("layout", ["frames_bins", "bins_frames"])
def test_npy_crop_reads_only_the_window_of_a_large_file(tmp_path, monkeypatch, layout):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((23_400, 64)).astype(np.float32)  # ~6 MB, like real feature files
    path = _write(tmp_path / "big.npy", big if layout == "frames_bins" else big.T.copy())
    bytes_read = []
    real_read_at = readers._read_at

    def spy(fd, offset, count, dtype):
        bytes_read.append(count * dtype.itemsize)
        return real_read_at(fd, offset, count, dtype)

    monkeypatch.setattr(readers, "_read_at", spy)
    for seed in range(5):
        bytes_read.clear()
        crop = read_npy_crop(path, 200, seed, layout, 64)
        matches = np.flatnonzero(big[:, 0] == crop[0, 0])
        assert len(matches) == 1
        np.testing.assert_array_equal(crop, big[matches[0] : matches[0] + 200])
        assert sum(bytes_read) == 200 * 64 * 4  # the window's bytes, nothing more


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f2", "<f8"])
@pytest.mark.parametrize("fortran", [False, True])
def test_npy_dtypes_byte_orders_and_fortran_order(tmp_path, dtype, fortran):
    frames = (np.arange(40 * 6).reshape(40, 6) / 8).astype(dtype)
    for layout, stored in [("frames_bins", frames), ("bins_frames", frames.T)]:
        stored = np.asfortranarray(stored) if fortran else np.ascontiguousarray(stored)
        path = _write(tmp_path / f"{layout}.npy", stored)
        crop = read_npy_crop(path, 10, None, layout, 6)
        np.testing.assert_array_equal(crop, frames[15:25].astype(np.float32))
        assert crop.dtype == np.float32


def test_short_npy_is_padded_like_audio(tmp_path):
    frames = np.arange(3 * 2, dtype=np.float32).reshape(3, 2) + 1
    path = _write(tmp_path / "short.npy", frames)
    np.testing.assert_array_equal(
        read_npy_crop(path, 7, None, "frames_bins", 2, "repeat"), frames[[0, 1, 2, 0, 1, 2, 0]]
    )
    zeros = read_npy_crop(path, 5, None, "frames_bins", 2, "zeros")
    np.testing.assert_array_equal(zeros[:3], frames)
    assert not zeros[3:].any()
    assert read_npy_crop(path, 5, None, "frames_bins", 2, "none").shape == (3, 2)


@pytest.mark.parametrize(
    "array, layout, expected",
    [
        (np.zeros((10, 8, 2), np.float32), "frames_bins", r"shape \(10, 8, 2\).*\(frames, 8\)"),
        (np.zeros((10, 7), np.float32), "frames_bins", r"shape \(10, 7\).*\(frames, 8\)"),
        (np.zeros((10, 8), np.float32), "bins_frames", r"shape \(10, 8\).*\(8, frames\)"),
        (np.zeros((10, 8), np.int16), "frames_bins", r"dtype int16"),
        (np.zeros((0, 8), np.float32), "frames_bins", r"shape \(0, 8\)"),
    ],
)
def test_wrong_feature_file_names_file_shape_and_expectation(tmp_path, array, layout, expected):
    path = _write(tmp_path / "feat_bad.npy", array)
    with pytest.raises(FeatureFileError, match="feat_bad.npy") as info:
        read_npy_crop(path, 4, None, layout, 8)
    assert info.match(expected)


def test_corrupt_or_missing_npy_names_the_file(tmp_path):
    path = _write(tmp_path / "trunc.npy", np.zeros((1000, 8), np.float32))
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(FeatureFileError, match="trunc.npy"):
        read_npy_crop(path, 4, None, "frames_bins", 8)
    (tmp_path / "text.npy").write_text("not numpy")
    with pytest.raises(FeatureFileError, match="text.npy"):
        read_npy_crop(tmp_path / "text.npy", 4, None, "frames_bins", 8)
    with pytest.raises(FeatureFileError, match="absent.npy"):
        read_npy_crop(tmp_path / "absent.npy", 4, None, "frames_bins", 8)


def test_nonfinite_samples_and_truncated_wavs_name_the_file(tmp_path):
    wave = np.zeros(1600, dtype=np.float32)
    wave[100] = np.nan
    soundfile.write(tmp_path / "nan.wav", wave, 16000, subtype="FLOAT")
    with pytest.raises(AudioReadError, match=r"nan\.wav has 1 non-finite samples"):
        load_audio(tmp_path / "nan.wav", 16000)
    soundfile.write(tmp_path / "full.wav", np.full(1600, 0.1, np.float32), 16000, subtype="PCM_16")
    data = (tmp_path / "full.wav").read_bytes()
    (tmp_path / "cut.wav").write_bytes(data[: len(data) // 2])
    assert len(load_audio(tmp_path / "full.wav", 16000)) == 1600
    with pytest.raises(AudioReadError, match=r"cut\.wav.*truncated"):
        load_audio(tmp_path / "cut.wav", 16000)


def test_nonfinite_feature_frames_name_the_file(tmp_path):
    frames = np.zeros((50, 8), dtype=np.float32)
    frames[20, 3] = np.inf
    path = tmp_path / "bad.npy"
    np.save(path, frames)
    with pytest.raises(FeatureFileError, match=r"bad\.npy has non-finite values"):
        read_npy_crop(path, None, None, "frames_bins", 8)


def test_load_audio_reads_the_bytes_of_a_file_as_the_file(tmp_path):
    path = tmp_path / "stereo.flac"
    data = np.random.default_rng(1).uniform(-0.5, 0.5, (4410, 2))
    soundfile.write(path, data, 44100)
    from_bytes = load_audio(io.BytesIO(path.read_bytes()), 16000, name="in part 1 (x.flac)")
    assert torch.equal(from_bytes, load_audio(path, 16000))
    with pytest.raises(AudioReadError, match=r"^cannot read audio in part 2 \(y\): Format not"):
        load_audio(io.BytesIO(b"not audio" * 10), 16000, name="in part 2 (y)")
    soundfile.write(tmp_path / "full.wav", np.full(1600, 0.1, np.float32), 16000)
    cut = (tmp_path / "full.wav").read_bytes()[:2000]
    with pytest.raises(AudioReadError, match=r"^cannot read audio the body: .*truncated"):
        load_audio(io.BytesIO(cut), 16000, name="the body")


@pytest.mark.parametrize("suffix", [".flac", ".wav"])
def test_audio_of_unknown_length_is_read_to_its_end_and_limited_by_what_is_read(tmp_path, suffix):
    wave = np.random.default_rng(2).uniform(-0.5, 0.5, 3 * 16000 + 123).astype(np.float32)
    known = tmp_path / f"known{suffix}"
    soundfile.write(known, wave, 16000)
    path = write_unknown_length_audio(tmp_path / f"piped{suffix}", wave, 16000)
    whole = load_audio(known, 16000)
    assert len(whole) == len(wave)
    assert torch.equal(load_audio(path, 16000), whole)  # to the last frame
    assert torch.equal(load_audio(io.BytesIO(path.read_bytes()), 16000, name="x"), whole)
    assert torch.equal(load_audio(path, 16000, (1.0, 2.5)), whole[16000:40000])
    assert torch.equal(load_audio(path, 16000, (2.5, 9.0)), whole[40000:])
    assert torch.equal(load_audio(path, 16000, max_seconds=4), whole)
    assert readers.audio_seconds(path) == pytest.approx(len(wave) / 16000)
    with pytest.raises(
        AudioTooLong, match=r"^the audio in part 1 \(p\) is (more than 2 s|3.0 s) long$"
    ):
        load_audio(io.BytesIO(path.read_bytes()), 16000, name="in part 1 (p)", max_seconds=2)
    with pytest.raises(AudioReadError, match="segment 4-5 s starts at or past the end"):
        load_audio(path, 16000, (4.0, 5.0))
