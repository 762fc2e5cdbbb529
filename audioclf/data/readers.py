"""Reading audio and precomputed features, in DataLoader workers (numpy / soundfile, no model).

    load_audio      any soundfile format (a file or its bytes) → float32 mono tensor at the target
                    rate (or a span of it)
    crop_or_pad     fixed-length waveform crop (random when given an rng, else centred)
    read_npy_crop   a window of a precomputed [frames, bins] .npy file (only its bytes are read)

The batched front end that turns these into model input runs on the device:
audioclf.models.frontend.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile
import torch
import torch.nn.functional as F
import torchaudio
from torch import Tensor

from audioclf.config import ClipsConfig, choices

PAD_MODES = choices(ClipsConfig, "pad_mode")
NPY_LAYOUTS = choices(ClipsConfig, "npy_layout")
# Audio file suffixes: those libsndfile reads, plus their usual aliases (RAW needs its format
# spelled out). What prepare accepts in a sheet and embed finds in a folder.
AUDIO_SUFFIXES = frozenset(
    {f".{name.lower()}" for name in soundfile.available_formats() if name != "RAW"}
    | {".aif", ".aifc", ".oga", ".opus", ".snd"}
)


class AudioReadError(ValueError):
    """An audio file that cannot be decoded; the message names the file."""


class FeatureFileError(ValueError):
    """A precomputed feature file that cannot be read or has the wrong shape/dtype."""


# ---------------------------------------------------------------------------------------------
# Reading audio and precomputed features


class AudioTooLong(AudioReadError):
    """Audio longer than the caller's `max_seconds` (load_audio); the message names it."""


# libsndfile's frame count of a stream whose header leaves its length open (a FLAC whose
# STREAMINFO says 0 samples, as pipe encoders write it): SF_COUNT_MAX, 2**63 - 1. Any count this
# large is no real file's.
UNKNOWN_FRAMES = 1 << 62
BLOCK_FRAMES = 1 << 16  # frames per read of such a stream


def load_audio(
    source: str | Path | BinaryIO,
    sample_rate: int,
    span: tuple[float, float] | None = None,
    *,
    name: str | None = None,
    max_seconds: float | None = None,
) -> Tensor:
    """Read an audio file (any AUDIO_SUFFIXES format), mix down to mono, resample: float32 [samples].

    `source` is a path, or an open binary file holding a whole audio file (an upload's bytes in
    io.BytesIO), which messages call `name` ("file <path>" by default). `span` (start, end) in
    seconds reads only those frames (a segment of a longer recording; an end past the file's
    end stops there). A file whose header leaves its length unknown (FLAC or WAV written to a
    pipe) is read to its real end. `max_seconds` bounds what is read: AudioTooLong when the
    audio is longer (by its header when that tells, else once that much has been decoded). A
    file whose samples are not all finite (float wavs can hold NaN / inf) or a wav cut short
    behind an intact header raises AudioReadError naming it: both would otherwise go on
    silently.
    """
    is_path = isinstance(source, (str, Path))
    what = name or f"file {source}"
    try:
        target = str(source) if is_path else source
        with soundfile.SoundFile(target) as handle:
            data = _read(handle, span, max_seconds, what)
            file_rate = handle.samplerate
        if not is_path:
            _check_wav_length(source)
        elif str(source).lower().endswith(".wav"):
            with open(source, "rb") as handle:
                _check_wav_length(handle)
    except AudioTooLong:
        raise
    except (RuntimeError, OSError, ValueError, TypeError, EOFError) as exc:
        # libsndfile names a file object by its repr: `name` says which it is
        reason = str(exc) if is_path else re.sub(r"^Error opening <[^>]*>: ", "", str(exc))
        raise AudioReadError(f"cannot read audio {what}: {reason}") from exc
    if data.shape[0] == 0:
        raise AudioReadError(f"audio {what} contains no samples")
    if not np.isfinite(data).all():
        bad = int(np.count_nonzero(~np.isfinite(data)))
        raise AudioReadError(f"audio {what} has {bad} non-finite samples (NaN or inf)")
    wave = torch.from_numpy(data.mean(axis=1, dtype=np.float32))
    if file_rate != sample_rate:
        wave = torchaudio.functional.resample(wave, int(file_rate), int(sample_rate))
    return wave.contiguous()


def audio_seconds(path: str | Path) -> float:
    """The length of an audio file in seconds: its header's, or, when the header leaves it
    unknown, what decoding it to its end finds."""
    with soundfile.SoundFile(str(path)) as handle:
        if handle.frames < UNKNOWN_FRAMES:
            return handle.frames / handle.samplerate
        frames, block = 0, np.empty((BLOCK_FRAMES, handle.channels), np.float32)
        while (got := _read_block(handle, block)) > 0:
            frames += got
        return frames / handle.samplerate


def _read(
    handle: soundfile.SoundFile, span: tuple[float, float] | None, max_seconds, what: str
) -> np.ndarray:
    """The frames of `span` (None: all) as float32 [frames, channels], at most `max_seconds`
    of them (AudioTooLong past it); ValueError when the span starts at or past the end."""
    rate, header = handle.samplerate, handle.frames
    known = header < UNKNOWN_FRAMES
    first = 0 if span is None else round(span[0] * rate)
    stop = header if span is None else round(span[1] * rate)
    if known:
        stop = min(stop, header)
        if first >= stop:
            raise ValueError(
                f"the segment {span[0]:g}-{span[1]:g} s starts at or past the end of the file "
                f"({header / rate:g} s): fix the row's start/end"
            )
        if first:
            handle.seek(first)
    limit = None if max_seconds is None else int(max_seconds * rate)
    if known and limit is not None and stop - first > limit:
        raise AudioTooLong(f"the audio {what} is {(stop - first) / rate:.1f} s long")
    if known:  # one read of what the header promises
        return handle.read(stop - first, dtype="float32", always_2d=True)
    data = _read_to_end(handle, first, None if span is None else stop - first, limit)
    if limit is not None and len(data) > limit:
        raise AudioTooLong(f"the audio {what} is more than {max_seconds:g} s long")
    if span is not None and len(data) == 0:
        raise ValueError(
            f"the segment {span[0]:g}-{span[1]:g} s starts at or past the end of the file: fix "
            "the row's start/end"
        )
    return data


def _read_to_end(handle: soundfile.SoundFile, skip: int, count: int | None, limit) -> np.ndarray:
    """A stream of unknown length, read in blocks: `skip` frames passed over, then up to
    `count` frames (None: to its end), stopping once more than `limit` frames are read."""
    blocks, block = [], np.empty((BLOCK_FRAMES, handle.channels), np.float32)
    kept = 0
    while count is None or kept < count:
        got = _read_block(handle, block)
        if got == 0:
            break
        part = block[min(skip, got) : got]
        skip -= min(skip, got)
        part = part if count is None else part[: count - kept]
        blocks.append(part.copy())
        kept += len(part)
        if limit is not None and kept > limit:
            break
    if not blocks:
        return np.zeros((0, handle.channels), np.float32)
    return np.concatenate(blocks)


def _read_block(handle: soundfile.SoundFile, block: np.ndarray) -> int:
    """Frames read into `block` from where the stream is. libsndfile's own call: soundfile's
    read() seeks to update its position after each read, which fails at the end of a FLAC
    stream of unknown length (the final frames would be lost)."""
    pointer = soundfile._ffi.cast("float *", block.ctypes.data)  # noqa: SLF001 - see above
    return int(soundfile._snd.sf_readf_float(handle._file, pointer, len(block)))  # noqa: SLF001


def _check_wav_length(handle: BinaryIO) -> None:
    """ValueError when a RIFF/WAVE file's data chunk promises more bytes than the file holds
    (libsndfile then returns the samples that are there, without a word)."""
    handle.seek(0)
    head = handle.read(12)
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return  # RF64 / other containers: libsndfile's own checks
    size = handle.seek(0, io.SEEK_END)
    offset = 12
    while offset + 8 <= size:
        handle.seek(offset)
        chunk, length = handle.read(4), int.from_bytes(handle.read(4), "little")
        if chunk == b"data":
            if length not in (0, 0xFFFFFFFF) and offset + 8 + length > size:
                raise ValueError(
                    f"the wav file is truncated: its data chunk promises "
                    f"{length} bytes, {size - offset - 8} are there"
                )
            return
        offset += 8 + length + (length & 1)


def crop_start(total: int, length: int, rng: np.random.Generator | None) -> int:
    """First index of a `length` window inside `total` items: random with rng, else centred."""
    if rng is None:
        return (total - length) // 2
    return int(rng.integers(0, total - length + 1))


def seeded_or_centred(total: int, length: int, crop_seed: int | None) -> int:
    """First frame of a `length` window of `total` frames: `window_starts` for a crop seed
    (the same arithmetic on Python ints), else centred."""
    if crop_seed is None:
        return (total - length) // 2
    z = _splitmix64_int(int(crop_seed) & _BITS64)
    return (((z >> 32) * ((total - length + 1) & _BITS64)) & _BITS64) >> 32


def window_starts(seeds, totals, lengths) -> np.ndarray:
    """First frames of seeded windows (int64 array): for each crop seed a start in [0, total -
    length], uniform, from splitmix64 of the seed scaled by a multiply-shift. Vectorised, so a
    batch of crops costs one numpy pass instead of a Generator per crop (10 µs each); every
    reader of precomputed features (files, packs, whole batches) crops through it."""
    z = _splitmix64(_as_uint64(seeds))
    span = np.asarray(totals, dtype=np.int64) - np.asarray(lengths, dtype=np.int64) + 1
    return ((z >> np.uint64(32)) * span.astype(np.uint64) >> np.uint64(32)).astype(np.int64)


def seeded_uniforms(seeds, count: int, stream: int) -> np.ndarray:
    """float64 [len(seeds), count] in [0, 1): draw j of each seed is output j of SplitMix64
    started at seed XOR `stream` (one constant per use, so the draws of one seed for different
    uses differ from each other and from its crop start). Vectorised like window_starts: a
    batch reader draws all its crops' augmentation in one numpy pass, where a Generator per crop
    costs ~9 µs to seed; and a crop's draws are the same bits whether drawn alone or in a
    batch."""
    if len(seeds) == 1:  # one crop (the per-file reader): on Python ints, 2x cheaper
        state = (int(seeds[0]) & _BITS64) ^ stream
        z = [_splitmix64_int((state + j * _GOLDEN_INT) & _BITS64) >> 11 for j in range(count)]
        return np.array([z], dtype=np.float64) * 2.0**-53
    state = _as_uint64(seeds) ^ np.uint64(stream)
    z = _splitmix64(state[:, None] + np.arange(count, dtype=np.uint64) * _GOLDEN)
    return (z >> np.uint64(11)) * 2.0**-53


def _as_uint64(seeds) -> np.ndarray:
    return np.atleast_1d(np.asarray(seeds, dtype=np.int64)).astype(np.uint64)


def _splitmix64_int(state: int) -> int:
    """_splitmix64 of one state (0 <= state < 2^64), on Python ints: 2 µs where numpy's
    arrays of one take 40."""
    z = (state + _GOLDEN_INT) & _BITS64
    z = ((z ^ (z >> 30)) * _MIX1_INT) & _BITS64
    z = ((z ^ (z >> 27)) * _MIX2_INT) & _BITS64
    return z ^ (z >> 31)


def _splitmix64(state: np.ndarray) -> np.ndarray:
    """SplitMix64's output for each uint64 state (the state advanced by the golden gamma, then
    mixed)."""
    z = state + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


_GOLDEN, _MIX1, _MIX2 = (
    np.uint64(0x9E3779B97F4A7C15),
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x94D049BB133111EB),
)
_BITS64 = (1 << 64) - 1
_GOLDEN_INT, _MIX1_INT, _MIX2_INT = int(_GOLDEN), int(_MIX1), int(_MIX2)


def _check_pad_mode(pad_mode: str) -> None:
    if pad_mode not in PAD_MODES:
        raise ValueError(f"pad_mode={pad_mode!r} is invalid: use one of {', '.join(PAD_MODES)}")


def crop_or_pad(
    wave: Tensor, length: int, rng: np.random.Generator | None, pad_mode: str = "repeat"
) -> Tensor:
    """Cut `wave` [S] to exactly `length` samples.

    Longer clips are cropped at a random offset when `rng` is given (training) and centred when
    it is None (evaluation). Shorter clips are tiled (`pad_mode="repeat"`) or zero-padded.
    """
    _check_pad_mode(pad_mode)
    if wave.dim() != 1:
        raise ValueError(f"crop_or_pad expects a 1-D waveform, got shape {tuple(wave.shape)}")
    if length < 1:
        raise ValueError(f"crop length must be >= 1 sample, got {length}")
    total = wave.shape[0]
    if total == 0:
        raise ValueError("crop_or_pad got an empty waveform (0 samples)")
    if total >= length:
        start = crop_start(total, length, rng)
        return wave[start : start + length]
    if pad_mode == "repeat":
        return wave.repeat(-(-length // total))[:length]
    return F.pad(wave, (0, length - total))


def read_npy_crop(
    path: str | Path,
    n_frames: int | None,
    crop_seed: int | None,
    layout: str = "frames_bins",
    n_bins: int = 64,
    pad_mode: str = "repeat",
) -> np.ndarray:
    """Read `n_frames` frames of a precomputed feature file as float32 [n_frames, n_bins].

    Only the window's bytes are read: the .npy header is parsed, then the frames are fetched
    with positioned reads (one read for frames_bins files, one per bin for bins_frames files),
    with kernel read-ahead switched off for the file. A 200-frame crop of a 6 MB file thus
    reads ~50 kB. (A memory map reads far more: each page fault makes the kernel read around
    it, read_ahead_kb at a time, 8 MB on some VMs; see benchmarks/feature_read.py.)

    The window starts at the frame `window_starts` gives for `crop_seed` (training crops) and
    is centred when it is None;
    `n_frames=None` reads the whole file. Files shorter than `n_frames` are tiled ("repeat")
    or zero-padded ("zeros"); with `pad_mode="none"` they are returned at their own length
    (n_frames is then a maximum, as for evaluation clips).
    """
    if layout not in NPY_LAYOUTS:
        raise ValueError(f"layout={layout!r} is invalid: use one of {', '.join(NPY_LAYOUTS)}")
    if pad_mode != "none":
        _check_pad_mode(pad_mode)
    if n_frames is not None and n_frames < 1:
        raise ValueError(f"n_frames must be >= 1 or None, got {n_frames}")
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FeatureFileError(f"feature file {path} does not exist") from None
    except OSError as exc:
        raise FeatureFileError(f"cannot open feature file {path}: {exc}") from exc
    try:
        window, total = _read_npy_window(fd, path, n_frames, crop_seed, layout, n_bins)
    except FeatureFileError:
        raise
    except (OSError, ValueError, EOFError) as exc:
        raise FeatureFileError(f"cannot read feature file {path}: {exc}") from exc
    finally:
        os.close(fd)
    return pad_window(window, total, n_frames, pad_mode)


def pad_window(window: np.ndarray, total: int, n_frames: int | None, pad_mode: str) -> np.ndarray:
    """A window [length, bins] cut from a sample of `total` frames, filled to `n_frames` when
    the sample is shorter: tiled ("repeat"), zero-padded ("zeros") or left ("none")."""
    if n_frames is None or total >= n_frames or pad_mode == "none":
        return window
    if pad_mode == "repeat":
        return np.resize(window, (n_frames, window.shape[1]))  # np.resize tiles whole frames
    return np.pad(window, ((0, n_frames - total), (0, 0)))


def _read_npy_window(
    fd: int, path, n_frames: int | None, crop_seed: int | None, layout: str, n_bins: int
) -> tuple[np.ndarray, int]:
    """(the checked window float32 [<= n_frames, n_bins], the file's frame count) of an open
    .npy file; FeatureFileError for a file of the wrong shape, truncated or non-finite."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead past the window
    shape, fortran_order, dtype, data_offset = read_npy_header(fd)
    _check_feature_array(path, shape, dtype, layout, n_bins)
    promised, actual = data_offset + int(np.prod(shape)) * dtype.itemsize, os.fstat(fd).st_size
    if actual < promised:
        raise FeatureFileError(
            f"feature file {path} is truncated: {actual} bytes, its header promises {promised}"
        )
    total = shape[0] if layout == "frames_bins" else shape[1]
    length = total if n_frames is None else min(n_frames, total)
    start = seeded_or_centred(total, length, crop_seed)
    # On disk, frames are the outer axis of C-order frames_bins and Fortran-order
    # bins_frames files: the window is then one contiguous block.
    frames_outer = (layout == "frames_bins") != fortran_order
    window = _read_window(fd, data_offset, dtype, total, n_bins, start, length, frames_outer)
    if not np.isfinite(window).all():
        raise FeatureFileError(
            f"feature file {path} has non-finite values (NaN or inf) in "
            f"frames {start}..{start + length - 1}"
        )
    return window, total


# The header dict as np.save writes it (any other spelling goes through numpy's own parser).
_NPY_HEADER = re.compile(
    r"\{'descr': '([<>|=]?[a-z]\d+)', 'fortran_order': (True|False), "
    r"'shape': \(((?:\d+, ?)*\d*)\), \} *\n"
)


def read_npy_header(fd: int) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran_order, dtype, byte offset of the data) of an open .npy file."""
    head = os.pread(fd, 4096, 0)
    version = np.lib.format.read_magic(io.BytesIO(head))
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f"unsupported .npy format version {version}")
    size_bytes = 2 if version == (1, 0) else 4  # little-endian header length after the magic
    data_offset = 8 + size_bytes + int.from_bytes(head[8 : 8 + size_bytes], "little")
    if data_offset > len(head):
        head = os.pread(fd, data_offset, 0)
    header = _NPY_HEADER.fullmatch(head[8 + size_bytes : data_offset].decode("latin1"))
    if header:  # the header numpy writes: parsed here, not by compiling it (50 µs a file)
        descr, fortran, dims = header.groups()
        shape = tuple(int(d) for d in dims.split(",") if d.strip())
        return shape, fortran == "True", np.dtype(descr), data_offset
    stream = io.BytesIO(head)
    np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
    else:
        shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(stream)
    return shape, fortran_order, dtype, data_offset


def _check_feature_array(path, shape: tuple, dtype: np.dtype, layout: str, n_bins: int) -> None:
    bins_axis = 1 if layout == "frames_bins" else 0
    expected = "(frames, {})" if layout == "frames_bins" else "({}, frames)"
    if (
        len(shape) != 2
        or shape[bins_axis] != n_bins
        or dtype.kind != "f"
        or shape[1 - bins_axis] == 0
    ):
        raise FeatureFileError(
            f"feature file {path} has shape {tuple(shape)} and dtype {dtype}; expected a "
            f"non-empty float array of shape {expected.format(n_bins)} "
            f"(clips.npy_layout={layout}, features.n_mels={n_bins})"
        )


def _read_window(
    fd: int,
    data_offset: int,
    dtype: np.dtype,
    total: int,
    n_bins: int,
    start: int,
    length: int,
    frames_outer: bool,
) -> np.ndarray:
    """Frames [start, start + length) as float32 [length, n_bins], reading only those bytes."""
    item = dtype.itemsize
    if frames_outer:
        block = _read_at(fd, data_offset + start * n_bins * item, length * n_bins, dtype)
        return block.reshape(length, n_bins).astype(np.float32, copy=False)
    rows = [
        _read_at(fd, data_offset + (b * total + start) * item, length, dtype) for b in range(n_bins)
    ]
    return np.stack(rows, axis=1).astype(np.float32, copy=False)


def _read_at(fd: int, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
    """`count` items of `dtype` at byte `offset` of the file (one positioned read), in a new
    writable array."""
    out = np.empty(count, dtype=dtype)
    view, done = memoryview(out).cast("B"), 0
    while done < len(view):  # short reads are allowed by POSIX; finish the request
        more = os.preadv(fd, [view[done:]], offset + done)
        if not more:
            raise EOFError(f"unexpected end of file at byte {offset + done}")
        done += more
    return out
