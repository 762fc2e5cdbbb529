"""Audio and feature I/O, and the batched log-mel front end.

Reading (in DataLoader workers):
    load_audio      any soundfile format → float32 mono tensor at the target rate
    crop_or_pad     fixed-length waveform crop (random when given an rng, else centred)
    read_npy_crop   a window of a precomputed [frames, bins] .npy file (only its bytes are read)
    log_mel         offline log-mel of one waveform (to precompute .npy features)

Front end (batched, on the training device):
    FeatureFrontend = [LogMel] → UtteranceNorm → SpecAugment, with lengths carried along so
    padding never changes an utterance's statistics.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import soundfile
import torch
import torch.nn.functional as F
import torchaudio
from torch import Tensor, nn

from audioclf.config import FeaturesConfig

LOG_OFFSET = 1e-6  # added to mel power before the log, so silence gives log(1e-6), not -inf
PAD_MODES = ("repeat", "zeros")
NPY_LAYOUTS = ("frames_bins", "bins_frames")


class AudioReadError(ValueError):
    """An audio file that cannot be decoded; the message names the file."""


class FeatureFileError(ValueError):
    """A precomputed feature file that cannot be read or has the wrong shape/dtype."""


# ---------------------------------------------------------------------------------------------
# Reading audio and precomputed features


def load_audio(path: str | Path, sample_rate: int) -> Tensor:
    """Read an audio file (wav/flac/ogg/...), mix down to mono, resample: float32 [samples]."""
    try:
        data, file_rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (RuntimeError, OSError, ValueError, TypeError, EOFError) as exc:
        raise AudioReadError(f"cannot read audio file {path}: {exc}") from exc
    if data.shape[0] == 0:
        raise AudioReadError(f"audio file {path} contains no samples")
    wave = torch.from_numpy(data.mean(axis=1, dtype=np.float32))
    if file_rate != sample_rate:
        wave = torchaudio.functional.resample(wave, int(file_rate), int(sample_rate))
    return wave.contiguous()


def _crop_start(total: int, length: int, rng: np.random.Generator | None) -> int:
    """First index of a `length` window inside `total` items: random with rng, else centred."""
    if rng is None:
        return (total - length) // 2
    return int(rng.integers(0, total - length + 1))


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
        start = _crop_start(total, length, rng)
        return wave[start : start + length]
    if pad_mode == "repeat":
        return wave.repeat(-(-length // total))[:length]
    return F.pad(wave, (0, length - total))


def read_npy_crop(
    path: str | Path,
    n_frames: int | None,
    rng: np.random.Generator | None,
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

    The window starts at a random frame when `rng` is given and is centred otherwise;
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
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead past the window
        shape, fortran_order, dtype, data_offset = _read_npy_header(fd)
        _check_feature_array(path, shape, dtype, layout, n_bins)
        promised, actual = data_offset + int(np.prod(shape)) * dtype.itemsize, os.fstat(fd).st_size
        if actual < promised:
            raise FeatureFileError(
                f"feature file {path} is truncated: {actual} bytes, its header promises {promised}"
            )
        total = shape[0] if layout == "frames_bins" else shape[1]
        length = total if n_frames is None else min(n_frames, total)
        start = _crop_start(total, length, rng)
        # On disk, frames are the outer axis of C-order frames_bins and Fortran-order
        # bins_frames files: the window is then one contiguous block.
        frames_outer = (layout == "frames_bins") != fortran_order
        window = _read_window(fd, data_offset, dtype, total, n_bins, start, length, frames_outer)
    except FeatureFileError:
        raise
    except (OSError, ValueError, EOFError) as exc:
        raise FeatureFileError(f"cannot read feature file {path}: {exc}") from exc
    finally:
        os.close(fd)
    if n_frames is None or total >= n_frames or pad_mode == "none":
        return window
    if pad_mode == "repeat":
        return np.resize(window, (n_frames, n_bins))  # np.resize tiles whole frames
    return np.pad(window, ((0, n_frames - total), (0, 0)))


def _read_npy_header(fd: int) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran_order, dtype, byte offset of the data) of an open .npy file."""
    head = os.pread(fd, 4096, 0)
    version = np.lib.format.read_magic(io.BytesIO(head))
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f"unsupported .npy format version {version}")
    size_bytes = 2 if version == (1, 0) else 4  # little-endian header length after the magic
    data_offset = 8 + size_bytes + int.from_bytes(head[8 : 8 + size_bytes], "little")
    if data_offset > len(head):
        head = os.pread(fd, data_offset, 0)
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
    if len(shape) != 2 or shape[bins_axis] != n_bins or dtype.kind != "f" or shape[1 - bins_axis] == 0:
        raise FeatureFileError(
            f"feature file {path} has shape {tuple(shape)} and dtype {dtype}; expected a "
            f"non-empty float array of shape {expected.format(n_bins)} "
            f"(features.npy_layout={layout}, features.n_mels={n_bins})"
        )


def _read_window(fd: int, data_offset: int, dtype: np.dtype, total: int, n_bins: int,
                 start: int, length: int, frames_outer: bool) -> np.ndarray:
    """Frames [start, start + length) as float32 [length, n_bins], reading only those bytes."""
    item = dtype.itemsize
    if frames_outer:
        block = _read_at(fd, data_offset + start * n_bins * item, length * n_bins, dtype)
        return block.reshape(length, n_bins).astype(np.float32)
    rows = [_read_at(fd, data_offset + (b * total + start) * item, length, dtype) for b in range(n_bins)]
    return np.stack(rows, axis=1).astype(np.float32)


def _read_at(fd: int, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
    """`count` items of `dtype` at byte `offset` of the file (one positioned read)."""
    nbytes = count * dtype.itemsize
    data = os.pread(fd, nbytes, offset)
    while len(data) < nbytes:  # short reads are allowed by POSIX; finish the request
        more = os.pread(fd, nbytes - len(data), offset + len(data))
        if not more:
            raise EOFError(f"unexpected end of file at byte {offset + len(data)}")
        data += more
    return np.frombuffer(data, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Front end modules


def _valid_frames(lengths: Tensor, max_len: int) -> Tensor:
    """Boolean [B, max_len] mask, True on the first lengths[b] positions of row b."""
    positions = torch.arange(max_len, device=lengths.device)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)


class LogMel(nn.Module):
    """Waveforms [B, S] → log-mel [B, T, n_mels], computed in fp32 even under autocast.

    Frames are centred (torchaudio's `center=True`): a clip of S samples gives S // hop + 1
    frames, which is how `frame_lengths` is derived from sample lengths.
    """

    def __init__(self, cfg: FeaturesConfig):
        super().__init__()
        self.n_fft = cfg.n_fft
        self.hop_length = cfg.hop_length
        self.log_offset = LOG_OFFSET
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=cfg.sample_rate,
            n_fft=cfg.n_fft,
            win_length=cfg.win_length,
            hop_length=cfg.hop_length,
            f_min=cfg.f_min,
            f_max=cfg.f_max,
            n_mels=cfg.n_mels,
            power=2.0,
        )

    def forward(self, waves: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        # Reflect padding needs more than n_fft // 2 samples; very short batches get zeros.
        waves = F.pad(waves.float(), (0, max(0, self.n_fft - waves.shape[-1])))
        if torch.jit.is_scripting():  # TorchScript cannot take the device type at run time
            feats = torch.log(self.mel(waves) + self.log_offset)
        else:
            # The mel matmul would run in fp16 under CUDA autocast, where power spectra overflow.
            with torch.autocast(device_type=waves.device.type, enabled=False):
                feats = torch.log(self.mel(waves) + self.log_offset)
        feats = feats.transpose(1, 2)
        # Valid frames are those whose window ends inside the clip: the last centred frames of a
        # short clip would see the batch's zero padding (alone they would see reflection), so
        # counting them would make an embedding depend on what else is in the batch.
        inside = torch.div(lengths - self.n_fft // 2, self.hop_length, rounding_mode="floor") + 1
        return feats, inside.clamp(min=1, max=feats.shape[1])


_LOG_MEL_CACHE: dict[tuple, LogMel] = {}


def log_mel(wave: Tensor, cfg: FeaturesConfig) -> np.ndarray:
    """Un-normalised log-mel of one waveform [S] as float32 [T, n_mels] (for offline .npy files).

    Gives the same frames as the training front end's LogMel, so precomputed features and
    on-the-fly features are interchangeable (normalisation happens later, per utterance).
    """
    key = (cfg.sample_rate, cfg.n_fft, cfg.win_length, cfg.hop_length, cfg.n_mels, cfg.f_min, cfg.f_max)
    if key not in _LOG_MEL_CACHE:
        _LOG_MEL_CACHE[key] = LogMel(cfg)
    wave = torch.as_tensor(wave, dtype=torch.float32)
    if wave.dim() != 1:
        raise ValueError(f"log_mel expects a 1-D waveform, got shape {tuple(wave.shape)}")
    with torch.no_grad():
        feats, frames = _LOG_MEL_CACHE[key](wave.unsqueeze(0), torch.tensor([wave.shape[0]]))
    return feats[0, : int(frames[0])].numpy()  # only the valid frames, as the front end counts them


class UtteranceNorm(nn.Module):
    """Per-utterance mean/variance normalisation over the valid frames only.

    mode="utterance" (default): one mean and variance over all valid frames and bins, which
    removes the recording gain but keeps the spectral envelope (often what tells classes apart).
    mode="utterance_bin": per mel bin (CMVN), which also removes the envelope / channel.
    mode="none": no normalisation. Statistics use frames < lengths[b], so padding does not change
    them; padded frames come out as zeros. Computed in fp32.
    """

    def __init__(self, mode: str = "utterance", eps: float = 1e-5):
        super().__init__()
        if mode not in ("utterance", "utterance_bin", "none"):
            raise ValueError(
                f"features.norm={mode!r} is invalid: use 'utterance', 'utterance_bin' or 'none'"
            )
        self.mode = mode
        self.eps = eps

    def forward(self, feats: Tensor, lengths: Tensor) -> Tensor:
        feats = feats.float()
        mask = _valid_frames(lengths, feats.shape[1]).unsqueeze(-1).to(feats.dtype)  # [B, T, 1]
        if self.mode == "none":
            return feats * mask
        dims = [1] if self.mode == "utterance_bin" else [1, 2]
        bins = 1.0 if self.mode == "utterance_bin" else float(feats.shape[2])
        count = (mask.sum(dim=1, keepdim=True) * bins).clamp(min=1.0)
        mean = (feats * mask).sum(dim=dims, keepdim=True) / count
        var = (((feats - mean) * mask) ** 2).sum(dim=dims, keepdim=True) / count
        return (feats - mean) / torch.sqrt(var + self.eps) * mask


class SpecAugment(nn.Module):
    """`num_masks` frequency and time masks per example (independent per example); training only.

    Masks write 0, which after UtteranceNorm is the utterance mean.
    """

    def __init__(self, freq_mask: int, time_mask: int, num_masks: int):
        super().__init__()
        if freq_mask < 0 or time_mask < 0 or num_masks < 0:
            raise ValueError(
                f"SpecAugment needs freq_mask, time_mask, num_masks >= 0, got "
                f"{freq_mask}, {time_mask}, {num_masks}"
            )
        self.freq_masks = nn.ModuleList(
            [torchaudio.transforms.FrequencyMasking(freq_mask, iid_masks=True) for _ in range(num_masks)]
        )
        self.time_masks = nn.ModuleList(
            [torchaudio.transforms.TimeMasking(time_mask, iid_masks=True) for _ in range(num_masks)]
        )

    def forward(self, feats: Tensor) -> Tensor:
        if not self.training:
            return feats
        spec = feats.transpose(1, 2)  # torchaudio masks expect (..., freq, time)
        for freq_mask in self.freq_masks:
            spec = freq_mask(spec)
        for time_mask in self.time_masks:
            spec = time_mask(spec)
        return spec.transpose(1, 2)


class FeatureFrontend(nn.Module):
    """Batched front end run on the training device, not in data workers.

    kind="audio": waveforms [B, S] + sample lengths → LogMel → UtteranceNorm → SpecAugment.
    kind="npy":   log-mel [B, T, F] + frame lengths →          UtteranceNorm → SpecAugment.
    `forward` returns (feats [B, T, n_mels] float32, feat_lengths [B]).
    """

    def __init__(self, cfg: FeaturesConfig):
        super().__init__()
        if cfg.kind not in ("audio", "npy"):
            raise ValueError(f"features.kind={cfg.kind!r} is invalid: use 'audio' or 'npy'")
        self.kind = cfg.kind
        self.n_mels = cfg.n_mels
        self.log_mel = LogMel(cfg) if cfg.kind == "audio" else None
        self.norm = UtteranceNorm(cfg.norm)
        num_masks = cfg.num_masks if cfg.spec_augment else 0
        self.spec_augment = SpecAugment(cfg.freq_mask, cfg.time_mask, num_masks)

    def forward(self, x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        if self.log_mel is not None:
            if x.dim() != 2:
                raise ValueError(
                    f"features.kind=audio expects waveforms [batch, samples], got shape {list(x.shape)}"
                )
            feats, lengths = self.log_mel(x, lengths)
        else:
            if x.dim() != 3 or x.shape[2] != self.n_mels:
                raise ValueError(
                    f"features.kind=npy expects features [batch, frames, {self.n_mels}], "
                    f"got shape {list(x.shape)}"
                )
            feats = x
        feats = self.norm(feats, lengths)
        return self.spec_augment(feats), lengths


def frames_for_samples(n_samples: int, hop_length: int, n_fft: int = 0) -> int:
    """Valid frames LogMel counts for `n_samples` samples (centred frames whose window ends
    inside the clip; with n_fft=0, every centred frame)."""
    return max(1, (n_samples - n_fft // 2) // hop_length + 1)


def eval_max_frames(cfg: FeaturesConfig) -> int:
    """Longest evaluation clip in feature frames (features.eval_max_seconds)."""
    return frames_for_samples(int(round(cfg.eval_max_seconds * cfg.sample_rate)), cfg.hop_length)
