"""Training batches from a feature pack, a whole batch at a time (no per-sample Dataset call).

The sampler's batches go to a DataLoader worker as units of `data.pack_read_batches` batches.
A worker works out every crop of the unit at once from the keys (position, crop seed[, crop
samples]): the start `window_starts` gives for the seed, as every reader of precomputed features
does. It reads each crop with one positioned read, sorted by (data file, offset) over the whole
unit (the read planner: a class-major pack and the ranks' disjoint class shares make those reads
close together; each is announced with POSIX_FADV_WILLNEED first, so the kernel fetches the
unit's uncached crops in parallel), straight into one shared-memory buffer [K, B, frames, bins] of the pack's dtype,
reused once the main process has let go of it (`BufferLeases`). The main process gets the buffer
without a copy and hands out its K batches in sampler order.

A batch is a data.dataset.Batch with bin_offsets: x in the pack's dtype (float16: half
the bytes to move to a GPU), made float32 on the device by `Batch.model_input`, which also adds the
feature-domain augmentation's per-bin offsets (`Augmenter.log_mel_offsets`, drawn in the worker
from each crop's seed, as the per-file reader draws them) — so a crop is the per-file reader's
crop to fp16 rounding, and exactly it for features that fp16 holds exactly.

Everything a unit carries to the device is a tensor carved from that one buffer: x, one int64
block [K, 3, B] whose rows are each batch's lengths, labels and positions, and the offsets. The
DataLoader's pin_memory thread (data.pin_memory on CUDA) therefore pins all of them, once per
unit, and every copy of a step to the device leaves from pinned memory (numpy arrays, which the
thread leaves alone, would make each of those copies a pageable one). No extra shared-memory
file per unit either: the small tensors ride in x's.

The finite check is one pass per unit over the fp16 exponent bits (a non-finite value has all
five set); a unit that fails names the sheet row and frames.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from audioclf.data.dataset import AudioDataset, Batch, unpack_key
from audioclf.data.pack.format import PackError
from audioclf.data.readers import pad_window, window_starts

# A unit: x [K, B, T, F], small [K, 3, B] int64 (lengths, labels, positions), offsets [K, B, F]
# float32 or None (tensors on one storage), and its buffer's lease, numpy [2] (worker, buffer)
Unit = tuple[Tensor, Tensor, Tensor | None, np.ndarray]


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
    x, small, offsets, _lease = unit
    for k in range(x.shape[0]):
        lengths, labels, positions = small[k]  # contiguous rows
        yield Batch(x[k], lengths, labels, positions, None if offsets is None else offsets[k])


class BufferLeases:
    """Which of each worker's unit buffers the main process still holds: one shared byte per
    (worker, buffer), set by the worker that fills the buffer, cleared here once every tensor of
    the main process on it is gone (a weak reference to its storage). A worker reuses only
    cleared buffers (no new pages to fault in: a fresh 25 MB buffer costs more than the reads
    into it) and allocates a new one when all are held, so a caller that keeps batches (a list
    of them) keeps them intact."""

    def __init__(self, workers: int, per_worker: int):
        self.flags = torch.zeros(max(workers, 1), per_worker, dtype=torch.uint8).share_memory_()
        self._held: list[tuple[StorageWeakRef, int, int]] = []  # main process only

    def hold(self, unit: Unit) -> None:
        """The main process got `unit`; release the buffers of units no longer referenced."""
        worker, buffer = (int(v) for v in unit[-1])
        if buffer >= 0:
            self._held.append((StorageWeakRef(unit[0].untyped_storage()), worker, buffer))
        flags, kept = self.flags.numpy(), []
        for ref, worker, buffer in self._held:
            if ref.expired():
                flags[worker, buffer] = 0
            else:
                kept.append((ref, worker, buffer))
        self._held = kept

    def __getstate__(self) -> dict:
        return {"flags": self.flags, "_held": []}  # workers only read and set flags


class PackedBatchReader(torch.utils.data.Dataset):
    """Map-style dataset over units: `reader[unit]` reads the unit's batches from the training
    dataset's pack (AudioDataset.pack), as `AudioDataset[key]` + collate_padded would give them
    (x in the pack's dtype, augmentation as offsets), into one of its worker's buffers
    (`leases`: None = a new buffer per unit)."""

    def __init__(self, dataset: AudioDataset, leases: BufferLeases | None = None):
        if dataset.pack is None or not dataset.train:
            raise ValueError("PackedBatchReader reads the training AudioDataset of a packed index")
        self.pack = dataset.pack
        self.labels = dataset.labels
        self.rows = dataset.rows
        self.augment = dataset.augment
        self.features, self.clips = dataset.cfg, dataset.clips
        self.default_crop = dataset.clips.crop_samples(dataset.cfg)
        self.leases = leases
        self._buffers: list[torch.UntypedStorage] = []  # this worker's, by buffer number
        self._scratch = np.empty(0, dtype=np.uint16)  # the finite check's, reused

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _buffers=[], _scratch=np.empty(0, dtype=np.uint16))

    def __getitem__(self, unit: list[list[tuple]]) -> Unit:
        keys = np.array([unpack_key(key)[:2] for batch in unit for key in batch], dtype=np.int64)
        crop = unpack_key(unit[0][0])[2]
        n_frames = self.features.frames(int(self.default_crop if crop is None else crop))
        if any(len(batch) != len(unit[0]) for batch in unit):
            raise ValueError("the batches of a unit must have one size")
        batch_shape = (len(unit), len(unit[0]))
        positions, seeds = keys[:, 0], keys[:, 1]
        offsets = self._offsets(seeds)
        x, small, bin_offsets, lease = self._buffer(
            (*batch_shape, n_frames, self.pack.n_bins), offsets is not None
        )
        flat = x.numpy().reshape(len(keys), -1)
        totals = self.pack.frames[positions]
        lengths = np.minimum(totals, n_frames)
        starts = window_starts(seeds, totals, lengths)
        view = memoryview(flat.reshape(-1).view(np.uint8))
        self.pack.read_crops(view, flat.shape[1] * flat.itemsize, positions, starts, lengths)
        self._fill_short(flat, lengths, n_frames)
        self._check_finite(flat, positions, starts, lengths)
        rows = small.numpy()
        rows[:, 0] = n_frames
        rows[:, 1] = self.labels[positions].reshape(batch_shape)
        rows[:, 2] = positions.reshape(batch_shape)
        if offsets is not None:
            bin_offsets.numpy()[:] = offsets.reshape(bin_offsets.shape)
        return x, small, bin_offsets, np.asarray(lease, dtype=np.int64)

    def _buffer(
        self, shape: tuple[int, ...], with_offsets: bool
    ) -> tuple[Tensor, Tensor, Tensor | None, tuple[int, int]]:
        """x [K, B, T, F] for a unit of `shape`, its int64 rows [K, 3, B] and its offsets
        [K, B, F] (or None), views of one storage; and its lease (worker, buffer; buffer -1: not
        leased)."""
        k, b, _, bins = shape
        x_bytes = -(-math.prod(shape) * self.pack.dtype.itemsize // 8) * 8  # int64-aligned
        small_bytes = k * 3 * b * 8
        nbytes = x_bytes + small_bytes + (k * b * bins * 4 if with_offsets else 0)
        info = torch.utils.data.get_worker_info()
        if info is None or self.leases is None:
            storage, lease = torch.UntypedStorage(nbytes), (0, -1)
        else:
            storage, lease = self._leased(info.id, nbytes)
        dtype = torch.float16 if self.pack.dtype == np.float16 else torch.float32
        x = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        small = torch.empty(0, dtype=torch.int64).set_(storage, x_bytes // 8, (k, 3, b))
        offsets = None
        if with_offsets:
            start = (x_bytes + small_bytes) // 4
            offsets = torch.empty(0, dtype=torch.float32).set_(storage, start, (k, b, bins))
        return x, small, offsets, lease

    def _leased(self, worker: int, nbytes: int) -> tuple[torch.UntypedStorage, tuple[int, int]]:
        """A cleared buffer of this worker with at least `nbytes` (grown when smaller), or a
        new one, not leased, when all are held."""
        flags = self.leases.flags.numpy()[worker]
        free = np.flatnonzero(flags == 0)
        if len(free) == 0:
            return torch.UntypedStorage._new_shared(nbytes), (worker, -1)
        buffer = int(free[0])
        while len(self._buffers) <= buffer:
            self._buffers.append(torch.UntypedStorage(0))
        if self._buffers[buffer].nbytes() < nbytes:
            self._buffers[buffer] = torch.UntypedStorage._new_shared(nbytes)
        flags[buffer] = 1
        return self._buffers[buffer], (worker, buffer)

    def _offsets(self, seeds: np.ndarray) -> np.ndarray | None:
        """The augmentation's per-bin offsets of each crop (None when no crop has any), drawn
        from each crop's seed as the dataset draws them."""
        if self.augment is None:
            return None
        drawn = [self.augment.log_mel_offsets(np.random.default_rng(int(s))) for s in seeds]
        if all(d is None for d in drawn):
            return None
        zeros = np.zeros(self.pack.n_bins, dtype=np.float32)
        return np.stack([zeros if d is None else d for d in drawn])

    def _fill_short(self, flat: np.ndarray, lengths: np.ndarray, n_frames: int) -> None:
        """Samples shorter than the crop: tiled or zero-padded as clips.pad_mode says."""
        bins = self.pack.n_bins
        for slot in np.flatnonzero(lengths < n_frames).tolist():
            length = int(lengths[slot])
            window = flat[slot, : length * bins].reshape(length, bins).copy()
            filled = pad_window(window, length, n_frames, self.clips.pad_mode)
            flat[slot] = filled.reshape(-1)

    def _check_finite(self, flat: np.ndarray, positions, starts, lengths) -> None:
        """One pass over the unit: a float16 value is non-finite when its 5 exponent bits are
        all set (float32 packs: np.isfinite)."""
        if self.pack.dtype == np.float16:
            if self._scratch.size < flat.size:
                self._scratch = np.empty(flat.size, dtype=np.uint16)
            bits = self._scratch[: flat.size].reshape(flat.shape)
            np.bitwise_and(flat.view(np.uint16), 0x7C00, out=bits)
            if bits.max() < 0x7C00:
                return
            bad = bits.max(axis=1) == 0x7C00
        else:
            bad = ~np.isfinite(flat).all(axis=1)
            if not bad.any():
                return
        slot = int(np.flatnonzero(bad)[0])
        where = f"index row {self.rows[positions[slot]]}" if self.rows is not None else "a row"
        raise PackError(
            f"{where}: feature pack {self.pack.folder} has non-finite values (NaN or inf) in "
            f"frames {starts[slot]}..{starts[slot] + lengths[slot] - 1}; pack again"
        )
