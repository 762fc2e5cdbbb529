"""Reading a feature pack: `PackedFeatures`, the checked pack behind a packed index table.

The format: audioclf.data.pack.format; the batches of a training run: audioclf.data.pack.batches.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import numpy as np
import pandas as pd

from audioclf.config import FeaturesConfig
from audioclf.data.index.table import PACK_COLUMNS
from audioclf.data.pack.format import (
    PackError,
    feature_settings,
    read_manifest,
    read_rows,
)
from audioclf.data.readers import pad_window, seeded_or_centred

log = logging.getLogger("audioclf")
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)  # Linux 4.14+: a read the page cache answers, or EAGAIN


class PackedFeatures:
    """The pack behind a packed index table: where each table position's frames are, and the
    open data files (opened lazily, once per process; dropped when pickled into a worker)."""

    def __init__(
        self,
        folder: Path,
        manifest: dict,
        file_ids: np.ndarray,
        offsets: np.ndarray,
        frames: np.ndarray,
    ):
        self.folder = folder
        self.dtype = np.dtype(manifest["dtype"])
        self.n_bins = int(manifest["bins"])
        self.files = [str(folder / f["name"]) for f in manifest["files"]]
        self.file_ids = file_ids.astype(np.int32)  # per table position
        self.offsets = offsets.astype(np.int64)  # bytes, per table position
        self.frames = frames.astype(np.int64)  # per table position
        self.frame_bytes = self.n_bins * self.dtype.itemsize
        self._fds: list[int] = []
        self._pid = -1
        self._nowait = _NOWAIT != 0  # until a file system refuses it
        self.as_packed = False  # every data file's size and mtime those the packer recorded

    # ------------------------------------------------------------------------------ opening

    @classmethod
    def of(cls, table: pd.DataFrame, features: FeaturesConfig) -> PackedFeatures | None:
        """The checked pack of a packed index table (None for a table without pack columns)."""
        if PACK_COLUMNS[0] not in table.columns:
            return None
        # a few data files named by many rows: work on the distinct paths
        codes, paths = pd.factorize(table["path"])
        folder = _folder_of(paths)
        if features.kind != "npy":
            raise PackError(f"the index is a feature pack ({folder}): set features.kind=npy")
        manifest = read_manifest(folder)
        _check_settings(folder, manifest, features)
        names = {f["name"]: i for i, f in enumerate(manifest["files"])}
        path_file = np.array([names.get(os.path.basename(p), -1) for p in paths], dtype=np.int64)
        file_ids = path_file[codes]
        if (file_ids < 0).any():
            raise _sheet_changed(
                folder,
                table["row"].to_numpy(),
                file_ids < 0,
                "names a file that is not in the pack",
            )
        offsets = table[PACK_COLUMNS[0]].to_numpy(np.int64)
        frames = table[PACK_COLUMNS[1]].to_numpy(np.int64)
        pack = cls(folder, manifest, file_ids, offsets, frames)
        pack.check(manifest, table["row"].to_numpy())
        return pack

    def followed_by(self, other: PackedFeatures, times: int = 1) -> PackedFeatures:
        """This pack's positions, then `other`'s `times` over: one table over both packs' files
        (data.unlabelled's pack past a packed index's rows). PackError when they hold other
        dtypes or bins."""
        if (other.dtype, other.n_bins) != (self.dtype, self.n_bins):
            raise PackError(
                f"feature pack {other.folder} holds {other.n_bins} bins of {other.dtype}, the "
                f"pack {self.folder} beside it {self.n_bins} of {self.dtype}; pack both with the "
                "same features and --pack-dtype"
            )
        joined = copy.copy(self)
        joined.files = self.files + other.files
        joined.file_ids = np.concatenate(
            [self.file_ids, *[other.file_ids + len(self.files)] * times]
        ).astype(np.int32)
        joined.offsets = np.concatenate([self.offsets, *[other.offsets] * times])
        joined.frames = np.concatenate([self.frames, *[other.frames] * times])
        joined._fds, joined._pid = [], -1
        joined.as_packed = self.as_packed and other.as_packed
        return joined

    def check(self, manifest: dict, rows: np.ndarray) -> None:
        """Data files of the manifest's sizes; every table row (sheet `rows`) one of the packed
        samples. Sets `as_packed`: every data file also has the mtime the packer recorded, so
        its frames are those the packer checked finite (else a training reader checks each
        crop)."""
        recorded = all("mtime_ns" in entry for entry in manifest["files"])  # earlier packs: none
        changed = 0
        for entry, path in zip(manifest["files"], self.files, strict=True):
            try:
                stat = os.stat(path)
                size = stat.st_size
                changed += stat.st_mtime_ns != entry.get("mtime_ns")
            except OSError as exc:
                raise PackError(
                    f"feature pack {self.folder}: cannot read {path} ({exc.strerror or exc}); "
                    "pack again with python -m audioclf.prepare --pack"
                ) from None
            if size != entry["bytes"]:
                raise PackError(
                    f"feature pack {self.folder}: {path} has {size} bytes, the pack wrote "
                    f"{entry['bytes']} (cut short or changed since); pack again with python -m "
                    "audioclf.prepare --pack into a new folder"
                )
        self.as_packed = recorded and changed == 0
        if not recorded:
            log.info(
                "feature pack %s records no data-file mtimes (packed by an earlier audioclf): "
                "every training crop is checked for non-finite values",
                self.folder,
            )
        elif changed:
            log.info(
                "feature pack %s: %d of %d data file(s) have another mtime than when packed "
                "(edited, or copied without their times: cp -p / rsync -t keep them): every "
                "training crop is checked for non-finite values",
                self.folder,
                changed,
                len(self.files),
            )
        packed = read_rows(self.folder, manifest)
        key = packed[:, 0] * (1 << 48) + packed[:, 1]  # (file, offset) of each packed sample
        order = np.argsort(key)
        mine = self.file_ids.astype(np.int64) * (1 << 48) + self.offsets
        at = np.minimum(np.searchsorted(key[order], mine), len(key) - 1)
        found = (key[order][at] == mine) & (packed[order, 2][at] == self.frames)
        if not found.all():
            raise _sheet_changed(
                self.folder, rows, ~found, "points at frames that are not a packed sample"
            )

    # ------------------------------------------------------------------------------ reading

    def descriptors(self) -> list[int]:
        """This process's descriptors of the data files (opened on first use in a process)."""
        if self._pid != os.getpid():
            self._fds = [os.open(path, os.O_RDONLY) for path in self.files]
            self._pid = os.getpid()
            for fd in self._fds:
                if hasattr(os, "posix_fadvise"):  # crops are random: no read-ahead past them
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return self._fds

    def read_into(self, buffer: memoryview, position: int, start: int, length: int) -> None:
        """Frames [start, start + length) of the sample at table `position`, as the pack's dtype,
        into `buffer` (exactly length × frame_bytes bytes): one positioned read."""
        file_id = int(self.file_ids[position])
        offset = int(self.offsets[position]) + start * self.frame_bytes
        self._read_fully(self.descriptors()[file_id], buffer, offset, file_id)

    def read_crops(
        self, buffer: memoryview, slot_bytes: int, positions, starts, lengths, slots=None
    ) -> None:
        """The read planner: crop i (frames [starts[i], starts[i] + lengths[i]) of the sample at
        table position positions[i]) into bytes [s × slot_bytes, ...) of `buffer`, s = slots[i]
        (default i), in (file, offset) order, one positioned read each. A crop the page cache
        holds is read at once (RWF_NOWAIT: a cached crop costs its one read, nothing more);
        the others are first announced to the kernel (POSIX_FADV_WILLNEED), so it fetches them
        in parallel (cold: ~3x the crops/s and ~2.5x the crops per CPU-second of reading one
        after the other: benchmarks/data_scale.py), then read."""
        file_ids = self.file_ids[positions]
        offsets = self.offsets[positions] + starts * self.frame_bytes
        order = np.lexsort((offsets, file_ids))
        fds = self.descriptors()
        at = (order if slots is None else np.asarray(slots)[order]) * slot_bytes
        plan = list(  # (where in buffer, file, offset, bytes) of each read
            zip(
                at.tolist(),
                file_ids[order].tolist(),
                offsets[order].tolist(),
                (lengths[order] * self.frame_bytes).tolist(),
                strict=True,
            )
        )
        preadv, waiting = os.preadv, plan
        if self._nowait:  # cached crops: one read each, not announced first
            waiting = self._read_cached(buffer, plan, fds)
        if waiting and hasattr(os, "posix_fadvise"):
            advise, will_need = os.posix_fadvise, os.POSIX_FADV_WILLNEED
            for _, file_id, offset, count in waiting:
                advise(fds[file_id], offset, count, will_need)
        for at, file_id, offset, count in waiting:
            target = buffer[at : at + count]
            if preadv(fds[file_id], [target], offset) < count:  # short: finish it, or say why not
                self._read_fully(fds[file_id], target, offset, file_id)

    def _read_cached(self, buffer: memoryview, plan: list, fds: list) -> list:
        """Reads what the page cache holds of the reads of `plan` (RWF_NOWAIT: the kernel
        answers from the cache, as far as it holds a read, or not at all); returns the rest, to
        announce and read."""
        preadv, nowait, waiting = os.preadv, _NOWAIT, []
        for number, item in enumerate(plan):
            at, file_id, offset, count = item
            try:
                done = preadv(fds[file_id], [buffer[at : at + count]], offset, nowait)
            except BlockingIOError:  # not cached
                waiting.append(item)
                continue
            except OSError:  # a file system without RWF_NOWAIT reads: announce every crop
                self._nowait = False
                return waiting + plan[number:]
            if done < count:  # cached in part (or the end of the file: _read_fully says so)
                waiting.append((at + done, file_id, offset + done, count - done))
        return waiting

    def _read_fully(self, fd: int, buffer: memoryview, offset: int, file_id: int) -> None:
        done = 0
        while done < len(buffer):  # POSIX allows short reads; finish the request
            more = os.preadv(fd, [buffer[done:]], offset + done)
            if more == 0:
                raise PackError(
                    f"feature pack {self.folder}: {self.files[file_id]} ends at byte "
                    f"{offset + done}, inside a sample; pack again"
                )
            done += more

    def read_window(
        self,
        position: int,
        n_frames: int | None,
        crop_seed: int | None,
        pad_mode: str,
        where: str,
    ) -> np.ndarray:
        """A float32 [n_frames, bins] window of one sample, as `read_npy_crop` cuts it from a
        .npy file (the same start for the same crop seed; `n_frames=None`: the whole sample)."""
        total = int(self.frames[position])
        length = total if n_frames is None else min(n_frames, total)
        start = seeded_or_centred(total, length, crop_seed)
        window = np.empty((length, self.n_bins), dtype=self.dtype)
        self.read_into(memoryview(window.reshape(-1).view(np.uint8)), position, start, length)
        window = window.astype(np.float32)
        if not np.isfinite(window).all():
            raise PackError(f"{where}: non-finite values in frames {start}..{start + length - 1}")
        return pad_window(window, total, n_frames, pad_mode)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_fds=[], _pid=-1)  # descriptors belong to the process that opened them
        return state

    def __del__(self) -> None:
        if getattr(self, "_pid", -1) == os.getpid():
            for fd in self._fds:
                os.close(fd)


def _folder_of(paths) -> Path:
    """The one folder of a packed index's data files (`paths`: its distinct paths)."""
    folders = sorted({os.path.dirname(p) for p in paths})
    if len(folders) != 1:
        raise PackError(
            f"a packed index names data files in {len(folders)} folders ({', '.join(folders[:3])}"
            "); a pack is one folder: use the index.parquet that prepare --pack wrote"
        )
    return Path(folders[0])


def _check_settings(folder: Path, manifest: dict, features: FeaturesConfig) -> None:
    """The config's features are those the pack holds (bins; every setting when from audio)."""
    packed = {"n_mels": manifest["bins"], **(manifest.get("features") or {})}
    ours = feature_settings(features)
    changed = [
        f"features.{key}={ours[key]!r} (the pack: {value!r})"
        for key, value in packed.items()
        if ours[key] != value
    ]
    if changed:
        raise PackError(
            f"feature pack {folder} holds other features than the config asks for: "
            f"{'; '.join(changed)}; train with the pack's settings, or pack again with these"
        )


def _sheet_changed(folder: Path, rows: np.ndarray, bad: np.ndarray, what: str) -> PackError:
    first = int(rows[np.flatnonzero(bad)[0]])
    return PackError(
        f"the index of feature pack {folder} was changed since packing: {int(bad.sum())} row(s) "
        f"(sheet row {first} first) {what}; use the index.parquet that prepare --pack wrote (rows may be "
        "dropped or re-split, not re-pointed), or pack again"
    )
