"""Map-style dataset of audio clips, precomputed log-mel files or a feature pack's samples
(audioclf.data.pack: an index with pack columns), and its padding collate.

Items are read in DataLoader workers; the log-mel front end runs later, batched, on the device.
A key is a position, `(position, crop_seed)` or `(position, crop_seed, crop_samples)`: the seed
fixes the training crop, so crops do not depend on which worker reads an item and a resumed run
reads exactly the same crops; `crop_samples` (None: clips.crop_seconds) is the epoch's crop
length (train.final_epochs). It travels with the key because persistent DataLoader workers hold
the copy of the dataset made when they started.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from audioclf.config import ClipsConfig, Config, FeaturesConfig
from audioclf.data.augment import Augmenter
from audioclf.data.index import Index, split_index
from audioclf.data.pack.format import PackError
from audioclf.data.pack.read import PackedFeatures
from audioclf.data.readers import (
    AudioReadError,
    FeatureFileError,
    crop_or_pad,
    load_audio,
    read_npy_crop,
)

log = logging.getLogger("audioclf")

Item = tuple[Tensor, int, int]  # (waveform [S] or features [T, F], label, position)
# How an unreadable file's message says to skip such files; a tool passes its own flag instead.
SKIP_HINT = "set data.skip_bad_files=true"


@dataclass(frozen=True)
class BadFiles:
    """What AudioDataset does with a file it cannot read: raise an error naming the file, its
    index row and `hint` (how to skip such files; a tool names its own flag), or with `skip`
    give None for the item."""

    skip: bool = False
    hint: str = SKIP_HINT


class AudioDataset(torch.utils.data.Dataset):
    """Clips at `paths` with integer `labels`; returns `(x, label, position)`.

    Training (`train=True`): a crop of `clips.crop_seconds` (random, seeded per item).
    Evaluation: the whole clip cut centred to `clips.eval_max_seconds`
    (`eval_crop="full"`), or a centred crop of `crop_seconds` (`eval_crop="center"`).
    x is a float32 waveform [samples] (`kind="audio"`) or log-mel [frames, n_mels] (`kind="npy"`).
    `spans` ([N, 2] seconds, NaN = the whole file): segment rows, of which only the span is read
    from disk (audio only); crops and evaluation clips are then cut from the span.

    A file that cannot be read raises an error naming the file, its index row and how to skip
    such files (`bad_files.hint`; default: the config key); with `bad_files.skip` the item is
    None instead (dropped by `collate_padded`) and counted in `self.skipped`. The counter lives
    in the process that read the item: with DataLoader workers each worker counts its own
    skips, and the main process sees them as shorter batches.
    """

    def __init__(
        self,
        paths: Sequence[str],
        labels: np.ndarray,
        cfg: FeaturesConfig,
        clips: ClipsConfig,
        *,
        train: bool,
        rows: Sequence[int] | None = None,
        bad_files: BadFiles | None = None,
        augment: Augmenter | None = None,
        spans: np.ndarray | None = None,
        pack: PackedFeatures | None = None,
    ):
        labels = np.asarray(labels)
        if labels.ndim != 1 or len(labels) != len(paths):
            raise ValueError(
                f"AudioDataset needs one label per path: got {len(paths)} paths and labels of "
                f"shape {labels.shape}"
            )
        if len(labels) and not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"AudioDataset labels must be integers, got dtype {labels.dtype}")
        if rows is not None and len(rows) != len(paths):
            raise ValueError(f"AudioDataset got {len(rows)} rows for {len(paths)} paths")
        # numpy, not Python lists: DataLoader workers share these pages with the main process,
        # and reading a list's str objects writes their reference counts (copy-on-read), which
        # copies the pages into every worker — hundreds of MB per worker at 400k rows.
        self.paths = PackedStrings([str(p) for p in paths])
        self.labels = labels.astype(np.int64)
        self.rows = None if rows is None else np.asarray(rows, dtype=np.int64)
        self.spans = _checked_spans(spans, len(labels), cfg.kind)
        self.cfg = cfg
        self.clips = clips
        self.train = train
        self.bad_files = bad_files or BadFiles()
        self.augment = augment if augment is not None and augment.enabled and train else None
        self.pack = pack
        self.skipped = 0

    @classmethod
    def from_index(
        cls,
        index: Index,
        cfg: Config,
        *,
        train: bool,
        augment: Augmenter | None = None,
        skip_bad_files: bool | None = None,
        skip_hint: str | None = None,
    ) -> AudioDataset:
        """The rows of a validated index (labels: its class codes), read as `cfg` says
        (features, clips, data.skip_bad_files unless `skip_bad_files` is given)."""
        table = index.table
        skip = cfg.data.skip_bad_files if skip_bad_files is None else skip_bad_files
        return cls(
            table["path"].tolist(),
            index.labels(),
            cfg.features,
            cfg.clips,
            train=train,
            rows=table["row"].tolist(),
            bad_files=BadFiles(skip, skip_hint or SKIP_HINT),
            augment=augment,
            spans=table[["start", "end"]].to_numpy(np.float64) if "start" in table else None,
            pack=PackedFeatures.of(table, cfg.features),
        )

    def with_unlabelled(
        self, paths: Sequence[str], pack: PackedFeatures | None = None
    ) -> AudioDataset:
        """This training set followed by unlabelled clips twice (label -1): positions
        [N, N + U) read a clip as a pseudo-class member, [N + U, N + 2U) as a view
        (data.sampler.MixedBatchSampler's layout). Beside a feature pack the clips are .npy
        files (prepare --unlabelled), read one by one, or, given their own `pack` (prepare
        --unlabelled --pack), read from it as the pack's rows are."""
        both = [*paths, *paths]
        spans = None
        if self.spans is not None:
            spans = np.concatenate([self.spans, np.full((len(both), 2), np.nan)])
        rows = None if self.rows is None else np.concatenate([self.rows, np.full(len(both), -1)])
        joined = self.pack
        if pack is not None:
            if self.pack is None:
                raise PackError(
                    f"data.unlabelled is a feature pack ({pack.folder}) and data.index is not: "
                    "pack data.index too (python -m audioclf.prepare --index SHEET --pack), or "
                    "prepare the unlabelled clips without --pack"
                )
            joined = self.pack.followed_by(pack, times=2)
        return AudioDataset(
            [*self.paths, *both],
            np.concatenate([self.labels, np.full(len(both), -1, dtype=np.int64)]),
            self.cfg,
            self.clips,
            train=self.train,
            rows=rows,
            bad_files=self.bad_files,
            augment=self.augment,
            spans=spans,
            pack=joined,
        )

    def packed(self, position: int) -> bool:
        """Whether the sample at `position` is read from the pack (a position past the pack's
        rows is an unlabelled clip's .npy file)."""
        return self.pack is not None and position < len(self.pack.frames)

    def __len__(self) -> int:
        return len(self.paths)

    def placeholder(self, crop_samples: int | None = None) -> tuple[Tensor, Tensor]:
        """(x [2, ...], lengths [2]): two silent training crops (of `crop_samples`, default
        clips.crop_seconds), what the loop feeds the model when a batch has no readable item, so
        every rank still takes part in the step (two rows: BatchNorm refuses a batch of one in
        training mode)."""
        cfg = self.cfg
        samples = self._crop_samples(crop_samples)
        if cfg.kind == "audio":
            x = torch.zeros(2, samples)
        else:
            x = torch.zeros(2, cfg.frames(samples), cfg.n_mels)
        return x, torch.full((2,), x.shape[1], dtype=torch.int64)

    def _crop_samples(self, crop_samples: int | None) -> int:
        return self.clips.crop_samples(self.cfg) if crop_samples is None else int(crop_samples)

    def __getitem__(self, key: int | tuple) -> Item | None:
        position, crop_seed, crop_samples = unpack_key(key)
        if not 0 <= position < len(self.paths):
            raise IndexError(f"position {position} is out of range for {len(self.paths)} items")
        seed = int(crop_seed) if self.train else None
        # a generator only where something draws from it: waveform crops and their
        # augmentation (crops of precomputed features start at window_starts(seed), and their
        # augmentation draws from the seed: Augmenter.log_mel_offsets)
        needs_rng = self.train and self.cfg.kind == "audio"
        rng = np.random.default_rng(seed) if needs_rng else None
        path = self.paths[position]
        if self.packed(position):  # a checked pack: nothing to skip, an error is the pack's
            x = self._read_packed(position, seed, crop_samples, self._where(position))
            return x, int(self.labels[position]), position
        try:
            x = self._read(path, seed, rng, self._crop_samples(crop_samples), self._span(position))
        except (AudioReadError, FeatureFileError) as exc:
            where = self._where(position)
            if not self.bad_files.skip:
                raise type(exc)(
                    f"{where}: {exc}. Fix or remove the file, or {self.bad_files.hint} to skip "
                    "unreadable files"
                ) from exc
            self.skipped += 1
            log.warning("skipping unreadable file at %s (%s): %s", where, path, exc)
            return None
        return x, int(self.labels[position]), position

    def _where(self, position: int) -> str:
        """How a message names the item at `position`: its sheet row when known."""
        if self.rows is None:
            return f"item {position}"
        row = self.rows[position]
        return f"index row {row}" if row >= 0 else f"unlabelled clip {self.paths[position]}"

    def _read_packed(
        self, position: int, seed: int | None, crop_samples: int | None, where: str
    ) -> Tensor:
        """A packed sample's crop (training, centre crops) or evaluation clip, float32."""
        cfg, clips = self.cfg, self.clips
        if self.train or clips.eval_crop == "center":
            n_frames, pad_mode = cfg.frames(self._crop_samples(crop_samples)), clips.pad_mode
        else:
            n_frames, pad_mode = clips.eval_max_frames(cfg), "none"
        feats = self.pack.read_window(position, n_frames, seed, pad_mode, where)
        if self.augment is not None:
            feats = self.augment.log_mel(feats, seed)
        return torch.from_numpy(feats)

    @staticmethod
    def eval_clip(wave: Tensor, cfg: FeaturesConfig, clips: ClipsConfig) -> Tensor:
        """The evaluation clip of a waveform [samples] at cfg.sample_rate, as a file is read: a
        centred crop of clips.crop_seconds (eval_crop=center), else the whole clip cut centred
        to clips.eval_max_seconds (also what audioclf.load(...).embed_waveforms embeds)."""
        if clips.eval_crop == "center":
            return crop_or_pad(wave, clips.crop_samples(cfg), None, clips.pad_mode)
        if wave.shape[0] > (longest := cfg.samples(clips.eval_max_seconds)):
            return crop_or_pad(wave, longest, None, clips.pad_mode)
        return wave

    def _span(self, position: int) -> tuple[float, float] | None:
        """(start, end) seconds of a segment row; None: the whole file."""
        if self.spans is None or np.isnan(self.spans[position, 0]):
            return None
        start, end = self.spans[position]
        return float(start), float(end)

    def _read(
        self,
        path: str,
        seed: int | None,
        rng: np.random.Generator | None,
        crop_samples: int,
        span: tuple[float, float] | None = None,
    ) -> Tensor:
        cfg, clips, augment = self.cfg, self.clips, self.augment
        cropped = self.train or clips.eval_crop == "center"
        if cfg.kind == "audio":
            wave = load_audio(path, cfg.sample_rate, span)
            if not self.train:
                return self.eval_clip(wave, cfg, clips)
            if augment is not None:  # speed / pitch / stretch: one crop of this length
                wave = augment.before_crop(wave, rng, crop_samples=crop_samples)
            crop = crop_or_pad(wave, crop_samples, rng, clips.pad_mode)
            return crop if augment is None else augment.after_crop(crop, rng)
        if cropped:
            feats = read_npy_crop(
                path, cfg.frames(crop_samples), seed, clips.npy_layout, cfg.n_mels, clips.pad_mode
            )
            if augment is not None:
                feats = augment.log_mel(feats, seed)
        else:
            feats = read_npy_crop(
                path, clips.eval_max_frames(cfg), None, clips.npy_layout, cfg.n_mels, "none"
            )
        return torch.from_numpy(feats)


def split_datasets(
    cfg: Config, index: Index
) -> tuple[Index, Index | None, AudioDataset, AudioDataset | None]:
    """A run's train split and validation split (eval.split; None when it has fewer than 2
    rows) with their datasets, the train one augmented (augment.*). ValueError when the train
    split is empty."""
    splits = split_index(index, cfg.data)
    train, val = splits["train"], splits.get(cfg.eval.split)
    if len(train) == 0:
        raise ValueError(
            f"{index.source}: the train split is empty; check data.split_column / data.val_ratio"
        )
    augment = Augmenter(cfg.augment, cfg.features, cfg.clips.crop_samples(cfg.features))
    train_set = AudioDataset.from_index(train, cfg, train=True, augment=augment)
    if val is None or len(val) < 2:
        return train, None, train_set, None
    return train, val, train_set, AudioDataset.from_index(val, cfg, train=False)


def _checked_spans(spans: np.ndarray | None, count: int, kind: str) -> np.ndarray | None:
    """The segment spans as float64 [N, 2], or None when no row is a segment (whole files)."""
    if spans is None:
        return None
    spans = np.asarray(spans, dtype=np.float64)
    if spans.shape != (count, 2):
        raise ValueError(f"AudioDataset spans have shape {spans.shape}, expected ({count}, 2)")
    if np.isnan(spans[:, 0]).all():
        return None
    if kind != "audio":
        raise ValueError(
            "the index has segment rows (start/end), which are read from audio files: set "
            "features.kind=audio (a precomputed .npy holds its own clip), or drop the start/end "
            "columns of a sheet whose paths are feature files of the segments"
        )
    return spans


def unpack_key(key: int | tuple) -> tuple[int, int, int | None]:
    """(position, crop seed, crop samples or None) of a dataset key."""
    if not isinstance(key, tuple):
        return int(key), int(key), None
    if len(key) == 2:
        return int(key[0]), key[1], None
    position, crop_seed, crop_samples = key
    return int(position), crop_seed, crop_samples


class PackedStrings:
    """Strings stored as one UTF-8 byte array and offsets: no Python object per string."""

    def __init__(self, strings: Sequence[str]):
        encoded = [s.encode() for s in strings]
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self._offsets[1:])
        self._data = np.frombuffer(b"".join(encoded), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, position: int) -> str:
        start, stop = self._offsets[position], self._offsets[position + 1]
        return self._data[start:stop].tobytes().decode()

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class Batch(NamedTuple):
    """A batch of clips, as every loader yields it: the per-file path (collate_padded) and the
    packed one (audioclf.data.pack.batches) alike. x is [B, L] samples or [B, T, F] features
    (a pack's in its dtype, e.g. float16); lengths, labels and positions are int64 [B];
    bin_offsets [B, F] is a pack's feature-domain augmentation, added on the device."""

    x: Tensor
    lengths: Tensor
    labels: Tensor
    positions: Tensor
    bin_offsets: Tensor | None = None

    def model_input(self, device: torch.device) -> Tensor:
        """x on the device as float32, with the augmentation offsets added there."""
        x = self.x.to(device, non_blocking=True).float()
        if self.bin_offsets is not None:
            x = x + self.bin_offsets.to(device, non_blocking=True)[:, None, :]
        return x


def collate_padded(batch: Sequence[Item | None]) -> Batch:
    """Stack items, zero-padding along their first axis; drops None (skipped) items.

    A batch whose items were all skipped gives B = 0 (x of shape [0, 0]).
    """
    items = [item for item in batch if item is not None]
    dropped = len(batch) - len(items)
    if dropped:
        log.warning("dropped %d unreadable item(s) from a batch of %d", dropped, len(batch))
    if not items:
        empty = torch.zeros(0, dtype=torch.int64)
        return Batch(torch.zeros(0, 0), empty, empty.clone(), empty.clone())
    xs = [x for x, _, _ in items]
    lengths = torch.tensor([x.shape[0] for x in xs], dtype=torch.int64)
    padded = _batch_buffer(xs[0], (len(xs), int(lengths.max()), *xs[0].shape[1:]))
    for i, x in enumerate(xs):
        padded[i, : x.shape[0]] = x
        padded[i, x.shape[0] :] = 0
    labels = torch.tensor([label for _, label, _ in items], dtype=torch.int64)
    positions = torch.tensor([position for _, _, position in items], dtype=torch.int64)
    return Batch(padded, lengths, labels, positions)


def _batch_buffer(like: Tensor, shape: tuple[int, ...]) -> Tensor:
    """An uninitialised tensor for a batch; in a DataLoader worker it is made in shared memory,
    as torch's default_collate does. Otherwise the worker's queue copies the batch into shared
    memory (~12 ms for a 12 MB batch) and frees it, and freeing blocks that large makes glibc
    keep later ones on the heap, which then swings by hundreds of MB per worker
    (benchmarks/data_scale.py)."""
    if torch.utils.data.get_worker_info() is None:
        return like.new_empty(shape)
    numel = math.prod(shape)
    storage = like.untyped_storage()._new_shared(numel * like.element_size(), device=like.device)
    return like.new_empty(0).set_(storage, 0, shape)
