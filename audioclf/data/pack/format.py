"""The feature pack's format: its file names, version, dtypes and manifest, checked on reading.

What a pack folder holds and how it is read: audioclf.data.pack (the package's docstring).
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np

from audioclf.config import FeaturesConfig
from audioclf.data.index.table import PACK_MANIFEST
from audioclf.data.readers import FeatureFileError

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
