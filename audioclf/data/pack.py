"""A feature pack: many samples' log-mel frames in a few large files, read a crop at a time.

    python -m audioclf.prepare --index SHEET --out DIR --pack      # writes it (precompute.pack)
    data.index=DIR/index.parquet features.kind=npy                 # trains on it like any sheet

A pack folder holds:
    data-00000.bin ...  the samples' frames, back to back, class-major (class, item, id), each a
                        C-order [frames, bins] array of the pack's dtype (float16 by default), no
                        headers: a crop of a sample is one positioned read;
    rows.npy            int64 [N, 6]: (data file, byte offset, frames, the row's position in
                        the source sheet, its source file's bytes and mtime_ns when packed) of
                        every packed sample;
    pack.json           the manifest: format version, dtype, bins, the data files and their sizes,
                        the feature settings (when packed from audio), the source sheet, the
                        checksum of rows.npy and one of itself (an edited pack.json or rows.npy
                        is refused when the pack is opened);
    index.parquet       a sheet like any other (a_cls, a_item, a_id, ...; path = the sample's data
                        file) with two more columns, pack_offset and pack_frames. Written last.

An index whose table has those two columns is packed; `PackedFeatures.of(table, features)` opens
its pack, checked: pack.json and rows.npy match their checksums, every data file has the
manifest's size (a file cut short is one line), every row of the sheet is a sample of rows.npy (a
sheet edited to point elsewhere is one line; rows left out or re-split are fine), the bins and the
feature settings are the config's. A pack of another format version (an older audioclf's) is
refused with one line: pack again. Reading never parses a header or opens a file per crop: each
process opens the data files once, and every check above runs once, when the pack is opened.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd

from audioclf.config import FeaturesConfig
from audioclf.data.index.table import PACK_COLUMNS, PACK_MANIFEST
from audioclf.data.readers import FeatureFileError, pad_window, seeded_or_centred

MANIFEST = PACK_MANIFEST
ROWS = "rows.npy"
INDEX = "index.parquet"
FORMAT = "audioclf-pack"
VERSION = 2  # 2: checksums of pack.json and rows.npy, source stamps in rows.npy
ROW_FIELDS = 6  # rows.npy's columns: file, offset, frames, sheet position, source bytes, mtime_ns
AGAIN = "pack again with python -m audioclf.prepare --pack"
DTYPES = ("float16", "float32")
# the feature settings a pack made from audio records; training must use the same
FEATURE_KEYS = ("sample_rate", "n_fft", "win_length", "hop_length", "n_mels", "f_min", "f_max")


class PackError(FeatureFileError):
    """A pack that cannot be read as the sheet and the config say; the message names the fix."""


def data_file_name(number: int) -> str:
    return f"data-{number:05d}.bin"


def checksum(data: bytes) -> str:
    """The checksum a pack records of a file's bytes (128-bit BLAKE2b, hex)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def manifest_checksum(manifest: dict) -> str:
    """The checksum of a manifest's content (all but its own "checksum" key, as sorted JSON)."""
    content = {key: value for key, value in manifest.items() if key != "checksum"}
    return checksum(json.dumps(content, sort_keys=True).encode())


def feature_settings(features: FeaturesConfig) -> dict:
    """The settings that shape log-mel features (what a pack made from audio records)."""
    return {key: getattr(features, key) for key in FEATURE_KEYS}


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

    def check(self, manifest: dict, rows: np.ndarray) -> None:
        """Data files of the manifest's sizes; every table row (sheet `rows`) one of the packed
        samples."""
        for entry, path in zip(manifest["files"], self.files, strict=True):
            try:
                size = os.stat(path).st_size
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

    def read_crops(self, buffer: memoryview, slot_bytes: int, positions, starts, lengths) -> None:
        """The read planner: crop i (frames [starts[i], starts[i] + lengths[i]) of the sample at
        table position positions[i]) into bytes [i × slot_bytes, ...) of `buffer`. The crops are
        announced to the kernel (POSIX_FADV_WILLNEED) in (file, offset) order, so it fetches the
        uncached ones in parallel (cold: ~3x the crops/s and ~2.5x the crops per CPU-second of
        reading one after the other; ~0.5 µs a crop when cached: benchmarks/data_scale.py), then
        read in that order, one positioned read each."""
        file_ids = self.file_ids[positions]
        offsets = self.offsets[positions] + starts * self.frame_bytes
        order = np.lexsort((offsets, file_ids))
        fds = self.descriptors()
        nbytes = (lengths[order] * self.frame_bytes).tolist()
        plan = list(
            zip(
                order.tolist(),
                file_ids[order].tolist(),
                offsets[order].tolist(),
                nbytes,
                strict=True,
            )
        )
        if hasattr(os, "posix_fadvise"):
            advise, will_need = os.posix_fadvise, os.POSIX_FADV_WILLNEED
            for _, file_id, offset, count in plan:
                advise(fds[file_id], offset, count, will_need)
        preadv = os.preadv
        for slot, file_id, offset, count in plan:
            target = buffer[slot * slot_bytes : slot * slot_bytes + count]
            if preadv(fds[file_id], [target], offset) < count:  # short: finish it, or say why not
                self._read_fully(fds[file_id], target, offset, file_id)

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


def read_manifest(folder: Path) -> dict:
    """pack.json of a pack folder, checked against its checksum; PackError when it is missing,
    not a pack's, of another format version, or edited since packing."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ValueError("not a feature pack manifest")
    except (OSError, ValueError) as exc:
        raise PackError(
            f"the index names a feature pack in {folder}, but {path} cannot be read ({exc}); "
            f"the pack is incomplete or damaged: {AGAIN}"
        ) from None
    version = manifest.get("version")
    if version != VERSION:
        made = "an older" if isinstance(version, int) and version < VERSION else "another"
        raise PackError(
            f"feature pack {folder} was made by {made} audioclf (format version {version}; this "
            f"one reads version {VERSION}): {AGAIN} into a new folder"
        )
    if manifest.get("checksum") != manifest_checksum(manifest):
        raise PackError(
            f"feature pack {folder}: {path} does not match its checksum (edited or damaged since "
            f"packing); {AGAIN} into a new folder"
        )
    return manifest


def read_rows(folder: Path, manifest: dict) -> np.ndarray:
    """rows.npy of a pack folder (int64 [rows, ROW_FIELDS]), checked against the manifest's
    checksum; PackError naming the file when it is missing, cut short or edited."""
    path = folder / ROWS
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PackError(
            f"feature pack {folder}: cannot read {path} ({exc.strerror or exc}); {AGAIN}"
        ) from None
    if checksum(data) != manifest.get("rows_checksum"):
        raise PackError(
            f"feature pack {folder}: {path} does not match the checksum in {MANIFEST} (cut short "
            f"or edited since packing); {AGAIN} into a new folder"
        )
    return np.load(io.BytesIO(data), allow_pickle=False)


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
