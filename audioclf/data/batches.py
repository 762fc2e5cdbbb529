"""Training batches from a feature pack, a whole batch at a time (no per-sample Dataset call).

The sampler's batches go to a DataLoader worker as units of `data.pack_read_batches` batches.
A worker works out every crop of the unit from its (position, crop seed[, crop samples]) key —
the very start the per-file reader would draw (`read_npy_crop`'s rule, same seed, same rng) —
and reads each with one positioned read, sorted by (data file, offset) over the whole unit (the
read planner: a class-major pack and the ranks' disjoint class shares make those reads close
together), straight into one shared-memory buffer [K, B, frames, bins] of the pack's dtype. The
main process gets the buffer without a copy and hands out its K batches in sampler order.

A batch is (x, lengths, labels, positions, bin_offsets): x in the pack's dtype (float16: half
the bytes to move to a GPU), made float32 on the device by `model_input`, which also adds the
feature-domain augmentation's per-bin offsets (`Augmenter.log_mel_offsets`, drawn in the worker
from each crop's rng, as the per-file reader draws them) — so a crop is the per-file reader's
crop to fp16 rounding, and exactly it for features that fp16 holds exactly.

The finite check is one pass per unit over the fp16 exponent bits (a non-finite value has all
five set); a unit that fails names the sheet row and frames.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from audioclf.data.dataset import AudioDataset, unpack_key
from audioclf.data.pack import PackError
from audioclf.data.readers import crop_start, pad_window

# A unit: (x [K, B, T, F], lengths [K, B], labels [K, B], positions [K, B], offsets [K, B, F])
Unit = tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]
Batch = tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]


class Units:
    """Wraps a batch sampler (SeededBatches): yields lists of up to `size` consecutive batches,
    the unit a worker reads in one go."""

    def __init__(self, batches, size: int):
        self.batches, self.size = batches, size

    def __len__(self) -> int:
        return -(-len(self.batches) // self.size)

    def __iter__(self) -> Iterator[list[list[tuple]]]:
        unit = []
        for batch in self.batches:
            unit.append(batch)
            if len(unit) == self.size:
                yield unit
                unit = []
        if unit:
            yield unit


def unit_as_is(unit: Unit) -> Unit:
    """The DataLoader's collate_fn for units: the worker already built the batch."""
    return unit


def batches_of(unit: Unit) -> Iterator[Batch]:
    """The unit's batches in sampler order (views of its buffer)."""
    x, lengths, labels, positions, offsets = unit
    for k in range(x.shape[0]):
        yield x[k], lengths[k], labels[k], positions[k], None if offsets is None else offsets[k]


def model_input(x: Tensor, bin_offsets: Tensor | None, device: torch.device) -> Tensor:
    """A batch's x on the device as float32, with its augmentation offsets added there."""
    x = x.to(device, non_blocking=True).float()
    if bin_offsets is not None:
        x = x + bin_offsets.to(device, non_blocking=True)[:, None, :]
    return x


class PackedBatchReader(torch.utils.data.Dataset):
    """Map-style dataset over units: `reader[unit]` reads the unit's batches from the training
    dataset's pack (AudioDataset.pack), as `AudioDataset[key]` + collate_padded would give them
    (x in the pack's dtype, augmentation as offsets)."""

    def __init__(self, dataset: AudioDataset):
        if dataset.pack is None or not dataset.train:
            raise ValueError("PackedBatchReader reads the training AudioDataset of a packed index")
        self.pack = dataset.pack
        self.labels = dataset.labels
        self.rows = dataset.rows
        self.augment = dataset.augment
        self.features, self.clips = dataset.cfg, dataset.clips
        self.default_crop = dataset.clips.crop_samples(dataset.cfg)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, unit: list[list[tuple]]) -> Unit:
        keys = [unpack_key(key) for batch in unit for key in batch]
        crop = keys[0][2] if keys[0][2] is not None else self.default_crop
        n_frames = self.features.frames(int(crop))
        positions = np.fromiter((k[0] for k in keys), dtype=np.int64, count=len(keys))
        shape = (len(unit), len(unit[0]), n_frames, self.pack.n_bins)
        if any(len(batch) != shape[1] for batch in unit):
            raise ValueError("the batches of a unit must have one size")
        x = _shared_empty(shape, self.pack.dtype)
        flat = x.numpy().reshape(len(keys), -1)
        starts, lengths, offsets = self._plan(keys, n_frames)
        self._read(flat, positions, starts, lengths)
        self._fill_short(flat, lengths, n_frames)
        self._check_finite(flat, positions, starts, lengths)
        batch_shape = shape[:2]
        return (
            x,
            torch.full(batch_shape, n_frames, dtype=torch.int64),
            torch.from_numpy(self.labels[positions].reshape(batch_shape)),
            torch.from_numpy(positions.reshape(batch_shape)),
            None if offsets is None else torch.from_numpy(offsets.reshape(*batch_shape, -1)),
        )

    def _plan(self, keys, n_frames: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Each crop's start and length (frames), and the augmentation's per-bin offsets (None
        when no crop of the unit has any), drawn from each crop's seed as the dataset does."""
        frames = self.pack.frames
        starts = np.empty(len(keys), dtype=np.int64)
        lengths = np.empty(len(keys), dtype=np.int64)
        offsets = None
        for slot, (position, seed, _) in enumerate(keys):
            rng = np.random.default_rng(int(seed))
            total = int(frames[position])
            lengths[slot] = length = min(n_frames, total)
            starts[slot] = crop_start(total, length, rng)
            if self.augment is not None:
                offset = self.augment.log_mel_offsets(rng)
                if offset is not None:
                    if offsets is None:
                        offsets = np.zeros((len(keys), self.pack.n_bins), dtype=np.float32)
                    offsets[slot] = offset
        return starts, lengths, offsets

    def _read(self, flat: np.ndarray, positions, starts, lengths) -> None:
        """Every crop into its slot: one positioned read each, in (file, offset) order."""
        pack = self.pack
        where = pack.offsets[positions] + starts * pack.frame_bytes
        order = np.lexsort((where, pack.file_ids[positions]))
        view = memoryview(flat.reshape(-1).view(np.uint8))
        slot_bytes = flat.shape[1] * flat.itemsize
        for slot in order.tolist():
            first, length = slot * slot_bytes, int(lengths[slot])
            buffer = view[first : first + length * pack.frame_bytes]
            pack.read_into(buffer, int(positions[slot]), int(starts[slot]), length)

    def _fill_short(self, flat: np.ndarray, lengths: np.ndarray, n_frames: int) -> None:
        """Samples shorter than the crop: tiled or zero-padded as clips.pad_mode says."""
        bins = self.pack.n_bins
        for slot in np.flatnonzero(lengths < n_frames).tolist():
            length = int(lengths[slot])
            window = flat[slot, : length * bins].reshape(length, bins).copy()
            filled = pad_window(window, length, n_frames, self.clips.pad_mode)
            flat[slot] = filled.reshape(-1)

    def _check_finite(self, flat: np.ndarray, positions, starts, lengths) -> None:
        if self.pack.dtype == np.float16:
            bits = flat.view(np.uint16)
            bad = np.bitwise_and(bits, 0x7C00).max(axis=1) == 0x7C00
        else:
            bad = ~np.isfinite(flat).all(axis=1)
        if bad.any():
            slot = int(np.flatnonzero(bad)[0])
            where = f"index row {self.rows[positions[slot]]}" if self.rows is not None else "a row"
            raise PackError(
                f"{where}: feature pack {self.pack.folder} has non-finite values (NaN or inf) in "
                f"frames {starts[slot]}..{starts[slot] + lengths[slot] - 1}; pack again"
            )


def _shared_empty(shape: tuple[int, ...], dtype: np.dtype) -> Tensor:
    """An uninitialised tensor in shared memory when in a DataLoader worker (the worker's queue
    then passes it without a copy), plain memory otherwise."""
    torch_dtype = torch.float16 if dtype == np.float16 else torch.float32
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=torch_dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=torch_dtype).set_(storage, 0, shape)
