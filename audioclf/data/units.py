"""Training batches read a unit at a time: the one loader shape of every training set.

The sampler's batches go to a DataLoader worker as units of `data.pack_read_batches` batches
(`Units`, under `batch_size=None`). A unit reader turns a unit's keys into its batches, written
into one shared-memory buffer of the worker that the main process gets without a copy and hands
out batch by batch (`batches_of`). Buffers are reused once the main process has let go of them
(`BufferLeases`): a fresh shared buffer per batch costs its page faults and zeroing, about as
much CPU as reading the batch's crops (benchmarks/data_scale.py).

Two readers fill a unit: `FileBatchReader` here, from each key's `AudioDataset[key]` (audio or
.npy files, augmented in the worker, unreadable files skipped as data.skip_bad_files says), and
`audioclf.data.pack.batches.PackedBatchReader`, straight from a feature pack's data files.

A unit is (x [K, B, ...], small [K, 3, B] int64 with each batch's lengths, labels and positions,
per-bin offsets [K, B, F] or None, its lease): tensors on one storage, so the DataLoader's
pin_memory thread pins them all at once. A slot whose file was skipped has position -1 and is
left out of its batch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from audioclf.data.dataset import Batch

log = logging.getLogger("audioclf")

# A unit: x [K, B, ...], small [K, 3, B] int64 (lengths, labels, positions), offsets [K, B, F]
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
    """The unit's batches in sampler order, as collate_padded gives them: views of its buffer,
    cut to the batch's longest item; a batch with skipped slots is a copy of its kept rows."""
    x, small, offsets, _lease = unit
    for k in range(x.shape[0]):
        lengths, labels, positions = small[k]  # contiguous rows
        batch = Batch(x[k], lengths, labels, positions, None if offsets is None else offsets[k])
        kept = positions >= 0
        if not bool(kept.all()):
            batch = Batch(*(t if t is None else t[kept] for t in batch))
        if x.dim() > 2 and (longest := int(batch.lengths.numpy().max(initial=0))) < x.shape[2]:
            batch = batch._replace(x=batch.x[:, :longest])
        yield batch


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


class UnitReader(torch.utils.data.Dataset):
    """Map-style dataset over units (`reader[unit]`): what both readers share, the unit's
    buffer, taken from its worker's leased buffers (`leases`: None = a new buffer per unit)."""

    def __init__(self, leases: BufferLeases | None):
        self.leases = leases
        self._buffers: list[torch.UntypedStorage] = []  # this worker's, by buffer number

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _buffers=[])

    def _buffer(
        self, shape: tuple[int, ...], dtype: torch.dtype, bins: int | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None, tuple[int, int]]:
        """x [K, B, ...] of `shape` and `dtype`, its int64 rows [K, 3, B] and, with `bins`, its
        offsets [K, B, bins], views of one storage; and its lease (worker, buffer; buffer -1:
        not leased)."""
        k, b = shape[:2]
        x_bytes = -(-math.prod(shape) * dtype.itemsize // 8) * 8  # int64-aligned
        small_bytes = k * 3 * b * 8
        nbytes = x_bytes + small_bytes + (k * b * bins * 4 if bins else 0)
        info = torch.utils.data.get_worker_info()
        if info is None or self.leases is None:
            storage, lease = torch.UntypedStorage(nbytes), (0, -1)
        else:
            storage, lease = self._leased(info.id, nbytes)
        x = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        small = torch.empty(0, dtype=torch.int64).set_(storage, x_bytes // 8, (k, 3, b))
        offsets = None
        if bins:
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


class FileBatchReader(UnitReader):
    """Units of a per-file training set: each key's item `dataset[key]` ((x, label, position),
    or None for a skipped file), zero-padded along x's first axis to the unit's longest, as
    collate_padded pads a batch. A unit with no readable item has x of shape [K, B, 0]."""

    def __init__(self, dataset: torch.utils.data.Dataset, leases: BufferLeases | None = None):
        super().__init__(leases)
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, unit: list[list[tuple]]) -> Unit:
        items = [[self.dataset[key] for key in batch] for batch in unit]
        read = [item[0] for batch in items for item in batch if item is not None]
        size = max(len(batch) for batch in unit)
        if read:
            longest = max(x.shape[0] for x in read)
            shape, dtype = (len(unit), size, longest, *read[0].shape[1:]), read[0].dtype
        else:
            shape, dtype = (len(unit), size, 0), torch.float32
        x, small, _, lease = self._buffer(shape, dtype)
        out, rows = x.numpy(), small.numpy()  # numpy: a tenth of torch's cost per slot
        rows[:] = -1
        for k, batch in enumerate(items):
            dropped = batch.count(None)
            if dropped:
                log.warning("dropped %d unreadable item(s) from a batch of %d", dropped, len(batch))
            for slot, item in enumerate(batch):
                if item is not None:
                    features, label, position = item
                    length = features.shape[0]
                    out[k, slot, :length] = features.numpy()
                    out[k, slot, length:] = 0
                    rows[k, :, slot] = (length, label, position)
        return x, small, None, np.asarray(lease, dtype=np.int64)
