"""Training batches from a feature pack, a whole batch at a time (no per-sample Dataset call).

The sampler's batches go to a DataLoader worker as units of `data.pack_read_batches` batches
(audioclf.data.units, the loader shape both paths share). A worker works out every crop of the
unit at once from the keys (position, crop seed[, crop samples]): the start `window_starts` gives for the seed, as every reader of precomputed features
does. It reads each crop with one positioned read, sorted by (data file, offset) over the whole
unit (the read planner: a class-major pack and the ranks' disjoint class shares make those reads
close together; each is announced with POSIX_FADV_WILLNEED first, so the kernel fetches the
unit's uncached crops in parallel), straight into one shared-memory buffer [K, B, frames, bins]
of the pack's dtype, reused once the main process has let go of it (`BufferLeases`). The main
process gets the buffer without a copy and hands out its K batches in sampler order.

A batch is a data.dataset.Batch with bin_offsets: x in the pack's dtype (float16: half the
bytes to move to a GPU), made float32 on the device by `Batch.model_input`, which also adds the
feature-domain augmentation's per-bin offsets (`Augmenter.log_mel_offsets`, drawn in the worker
from the unit's crop seeds in one pass, the bits the per-file reader draws for each crop) — so
a crop is the per-file reader's crop to fp16 rounding, and exactly it for features that fp16
holds exactly.

Everything a unit carries to the device is a tensor carved from that one buffer: x, one int64
block [K, 3, B] whose rows are each batch's lengths, labels and positions, and the offsets. The
DataLoader's pin_memory thread (data.pin_memory on CUDA) therefore pins all of them, once per
unit, and every copy of a step to the device leaves from pinned memory (numpy arrays, which the
thread leaves alone, would make each of those copies a pageable one). No extra shared-memory
file per unit either: the small tensors ride in x's.

The packer refuses non-finite frames, and a pack whose data files have the size and mtime it
recorded (`PackedFeatures.as_packed`) holds those frames: its crops are not checked again.
Otherwise (a data file edited, or copied without its times) and for .npy clips, a unit gets a
finite check, one pass over the fp16 exponent bits (a non-finite value has all five set); a
unit that fails names the sheet row and frames.

Unlabelled clips (data.unlabelled beside a pack: AudioDataset.with_unlabelled) sit past the
pack's rows. Packed themselves (`prepare --unlabelled --pack`) they are rows of the same
table (PackedFeatures.followed_by) and read like the rest; else their crops are read from
their prepared .npy files (`prepare --unlabelled`) one by one, into the same buffer in the
pack's dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from audioclf.data.dataset import AudioDataset
from audioclf.data.pack.format import PackError
from audioclf.data.readers import pad_window, read_npy_crop, window_starts
from audioclf.data.units import BufferLeases, Unit, UnitReader


class PackedBatchReader(UnitReader):
    """Units of a packed training set: `reader[unit]` reads the unit's batches from the training
    dataset's pack (AudioDataset.pack), as `AudioDataset[key]` + collate_padded would give them
    (x in the pack's dtype, augmentation as offsets), into one of its worker's buffers
    (`leases`: None = a new buffer per unit)."""

    def __init__(self, dataset: AudioDataset, leases: BufferLeases | None = None):
        if dataset.pack is None or not dataset.train:
            raise ValueError("PackedBatchReader reads the training AudioDataset of a packed index")
        super().__init__(leases)
        self.pack = dataset.pack
        self.labels = dataset.labels
        self.rows = dataset.rows
        self.augment = dataset.augment
        self.features, self.clips = dataset.cfg, dataset.clips
        self.default_crop = dataset.clips.crop_samples(dataset.cfg)
        # positions past the pack's rows: unlabelled clips' .npy files (with_unlabelled)
        self.n_packed = len(dataset.pack.frames)
        self.paths = dataset.paths
        self._scratch = np.empty(0, dtype=np.uint16)  # the finite check's, reused

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict:
        return dict(super().__getstate__(), _scratch=np.empty(0, dtype=np.uint16))

    def __getitem__(self, unit: list[list[tuple]]) -> Unit:
        if any(len(batch) != len(unit[0]) for batch in unit):
            raise ValueError("the batches of a unit must have one size")
        # SeededBatches' keys, (position, crop seed[, crop samples]) each: one array
        keys = np.array(unit, dtype=np.int64).reshape(-1, len(unit[0][0]))
        crop = int(keys[0, 2]) if keys.shape[1] > 2 else self.default_crop
        n_frames = self.features.frames(crop)
        batch_shape = (len(unit), len(unit[0]))
        positions, seeds = keys[:, 0], keys[:, 1]
        # the augmentation's per-bin offsets, drawn from the crops' seeds as the dataset draws
        offsets = None if self.augment is None else self.augment.log_mel_offsets(seeds)
        dtype = torch.float16 if self.pack.dtype == np.float16 else torch.float32
        bins = self.pack.n_bins
        x, small, bin_offsets, lease = self._buffer(
            (*batch_shape, n_frames, bins), dtype, bins if offsets is not None else None
        )
        flat = x.numpy().reshape(len(keys), -1)
        in_pack = positions < self.n_packed
        totals = self.pack.frames[np.where(in_pack, positions, 0)]
        lengths = np.minimum(totals, n_frames)
        starts = window_starts(seeds, totals, lengths)
        view = memoryview(flat.reshape(-1).view(np.uint8))
        slot_bytes = flat.shape[1] * flat.itemsize
        if in_pack.all():
            self.pack.read_crops(view, slot_bytes, positions, starts, lengths)
        else:
            slots = np.flatnonzero(in_pack)
            self.pack.read_crops(
                view, slot_bytes, positions[slots], starts[slots], lengths[slots], slots
            )
            lengths[~in_pack] = n_frames  # read whole, as AudioDataset reads them
            self._read_files(flat, positions, seeds, n_frames, np.flatnonzero(~in_pack))
        self._fill_short(flat, lengths, n_frames)
        if not (self.pack.as_packed and in_pack.all()):  # as packed: checked when written
            self._check_finite(flat, positions, starts, lengths)
        rows = small.numpy()
        rows[:, 0] = n_frames
        rows[:, 1] = self.labels[positions].reshape(batch_shape)
        rows[:, 2] = positions.reshape(batch_shape)
        if offsets is not None:
            bin_offsets.numpy()[:] = offsets.reshape(bin_offsets.shape)
        return x, small, bin_offsets, np.asarray(lease, dtype=np.int64)

    def _read_files(self, flat: np.ndarray, positions, seeds, n_frames: int, slots) -> None:
        """The crops of unlabelled clips (prepared .npy files), as the per-file reader cuts
        them, in the pack's dtype."""
        clips, bins = self.clips, self.pack.n_bins
        for slot in slots.tolist():
            path = self.paths[int(positions[slot])]
            crop = read_npy_crop(
                path, n_frames, int(seeds[slot]), clips.npy_layout, bins, clips.pad_mode
            )
            flat[slot] = crop.reshape(-1)

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
        position = int(positions[slot])
        if position >= self.n_packed:  # float32 features beyond float16's range
            raise PackError(
                f"unlabelled clip {self.paths[position]}: values beyond the "
                f"pack's {self.pack.dtype} range; prepare it again, or pack with float32"
            )
        row = None if self.rows is None else int(self.rows[position])
        where = f"item {position}" if row is None else f"index row {row}"
        if row is not None and row < 0:  # an unlabelled pack's clip
            where = f"unlabelled clip {self.paths[position]}"
        file = self.pack.files[int(self.pack.file_ids[position])]
        raise PackError(
            f"{where}: feature pack file {file} has non-finite values (NaN or inf) in "
            f"frames {starts[slot]}..{starts[slot] + lengths[slot] - 1}; pack again"
        )
