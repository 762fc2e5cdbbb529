"""The files of an embed --index run: the PREFIX.* names, PREFIX.parts/ with its manifest, the
part files, each one finished chunk of rows (see index.py), and their assembly into
PREFIX.npy / .parquet / .skipped.csv.

A part is taken by a rerun only when it is whole and was made for the very rows it covers (their
ids and paths); the manifest says which model, features and chunk size made them all.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from audioclf.data.index import Index
from audioclf.fileio import (
    atomic_write_bytes,
    atomic_write_together,
    remove_temporaries,
)
from audioclf.inference.artefacts import LoadedEmbedder, model_record
from audioclf.outputs import (
    FolderLock,
    ManifestMismatch,
    check_manifest,
    write_manifest,
    write_skipped,
    write_table,
)

PARTS_VERSION = 2  # bump when the part files' layout or the manifest's keys change
PART_KEYS = ("embeddings", "positions", "rows", "skipped", "reasons")


@dataclass(frozen=True)
class IndexOutputs:
    """The files of one --index run, all named after --save PREFIX."""

    npy: Path
    parquet: Path
    skipped: Path
    parts: Path  # folder of finished chunks while the run is unfinished

    @classmethod
    def of(cls, prefix: str | Path) -> IndexOutputs:
        prefix = Path(prefix)
        name = prefix.name
        return cls(
            prefix.with_name(name + ".npy"),
            prefix.with_name(name + ".parquet"),
            prefix.with_name(name + ".skipped.csv"),
            prefix.with_name(name + ".parts"),
        )

    def part(self, chunk: int) -> Path:
        return self.parts / f"chunk-{chunk:06d}.npz"

    def lock(self) -> FolderLock:
        """PREFIX.lock: one embed --index per PREFIX, held for the whole run (by rank 0)."""
        prefix = self.npy.with_suffix("")
        return FolderLock(
            prefix.with_name(prefix.name + ".lock"),
            what=f"--save {prefix}",
            by="another embed --index",
            fix="wait for it to finish, or choose another --save PREFIX",
        )


def digest(data: bytes) -> str:
    """A short content key (blake2b, 16 bytes in hex): of a part's rows, of a gallery cache."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def parts_manifest(model: LoadedEmbedder, chunk_rows: int) -> dict:
    """What every part file of a run depends on besides its own rows' ids and paths: the model's
    record (model_record) and the chunk size."""
    return {"version": PARTS_VERSION, "model": model_record(model), "chunk_rows": chunk_rows}


def open_parts(outputs: IndexOutputs, manifest: dict, lock: FolderLock | None = None) -> None:
    """Take `lock` (outputs.lock(), rank 0 only: the ranks are one writer) and remove the
    temporary files a killed run left, then create PREFIX.parts/ with its manifest, or check
    that an earlier run's parts were made by the same model, features and chunk size."""
    if lock is not None:
        lock.acquire()
        remove_temporaries(outputs.npy, outputs.parquet, outputs.skipped)
    path = outputs.parts / "manifest.json"
    try:
        if check_manifest(path, manifest):
            return
    except ManifestMismatch as exc:
        what = (
            f"its {', '.join(exc.changed)} differ{'s' if len(exc.changed) == 1 else ''}"
            if exc.earlier is not None
            else f"its {path.name} is {exc.reason}"
        )
        raise ValueError(
            f"{outputs.parts} holds the unfinished work of another run ({what}); "
            "delete it to start over, or choose another --save PREFIX"
        ) from None
    if outputs.parts.is_dir() and any(outputs.parts.glob("chunk-*.npz")):
        raise ValueError(
            f"{outputs.parts} holds part files but no manifest.json, so their model "
            "is unknown; delete the folder to start over"
        )
    try:
        write_manifest(path, manifest)
    except OSError as exc:
        raise ValueError(
            f"--save {outputs.parts.parent}: cannot write {outputs.parts} ({exc.strerror or exc})"
        ) from None


def write_part(path: Path, part: dict[str, np.ndarray]) -> Path:
    """One finished chunk as an .npz, atomically: a killed run leaves whole parts only."""
    buffer = io.BytesIO()
    np.savez(buffer, **part)
    return atomic_write_bytes(path, buffer.getvalue())


def rows_digest(ids: np.ndarray, paths: np.ndarray) -> str:
    """What a part's rows were: their ids and paths (a digest; paths can be long)."""
    return digest("\0".join([*ids.tolist(), *paths.tolist()]).encode())


def read_part(
    path: Path, ids: np.ndarray, paths: np.ndarray, start: int, dim: int | None
) -> dict[str, np.ndarray] | None:
    """A finished chunk of rows start .. start + len(ids), if `path` holds one that is whole
    and was made for these very rows (same ids and paths); None otherwise."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            part = {key: stored[key] for key in PART_KEYS}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    emb, positions, skipped = part["embeddings"], part["positions"], part["skipped"]
    expected = np.arange(start, start + len(ids))
    whole = (
        str(part["rows"]) == rows_digest(ids, paths)
        and emb.dtype == np.float32
        and emb.ndim == 2
        and len(emb) == len(positions)
        and len(part["reasons"]) == len(skipped)
        and np.array_equal(np.union1d(positions, skipped), expected)
        and len(positions) + len(skipped) == len(expected)
        and (len(emb) == 0 or dim is None or emb.shape[1] == dim)
        and bool(np.isfinite(emb).all())
    )
    return part if whole else None


# ---------------------------------------------------------------------------------------------
# Assembling the outputs


def assemble(
    outputs: IndexOutputs, index: Index, chunks: int, made_by: dict | None = None
) -> tuple[int, int]:
    """PREFIX.npy, PREFIX.parquet (with `made_by`, the model's record, in its metadata) and
    PREFIX.skipped.csv from the part files (streamed, never all in memory at once), then
    PREFIX.parts/ removed. Returns (rows embedded, skipped)."""
    positions, skipped, reasons, dim = [], [], [], 0
    for chunk in range(chunks):
        with np.load(outputs.part(chunk), allow_pickle=False) as part:
            positions.append(part["positions"])
            skipped.append(part["skipped"])
            reasons.append(part["reasons"])
            dim = part["embeddings"].shape[1] if len(part["positions"]) else dim
    positions, skipped = np.concatenate(positions), np.concatenate(skipped)
    table = index.table
    write_skipped(
        outputs.skipped,
        table,
        dict(zip(skipped.tolist(), np.concatenate(reasons).tolist(), strict=True)),
    )
    if not len(positions):
        raise ValueError(
            f"none of the {len(table)} rows of {index.source} could be read "
            f"(listed in {outputs.skipped})"
        )

    def write_npy(handle) -> None:
        header = {
            "descr": np.lib.format.dtype_to_descr(np.dtype("<f4")),
            "fortran_order": False,
            "shape": (len(positions), dim),
        }
        np.lib.format.write_array_header_1_0(handle, header)
        for chunk in range(chunks):
            with np.load(outputs.part(chunk), allow_pickle=False) as part:
                handle.write(part["embeddings"].astype("<f4", copy=False).tobytes())

    rows = table.iloc[positions]
    frame = pd.DataFrame(
        {
            "row": rows["row"].to_numpy(dtype=np.int64),
            "id": rows["id"].to_numpy(),
            "class": rows["cls"].to_numpy(),
            "item": rows["item"].to_numpy(),
            "path": rows["path"].to_numpy(),
        }
    )
    # Together: a reader never meets a new PREFIX.npy beside an earlier run's PREFIX.parquet.
    atomic_write_together(
        {outputs.npy: write_npy, outputs.parquet: lambda h: write_table(h, frame, made_by)}
    )
    # The manifest goes last: a run killed here leaves a folder that a rerun completes.
    for chunk in range(chunks):
        outputs.part(chunk).unlink(missing_ok=True)
    shutil.rmtree(outputs.parts)
    return len(positions), len(skipped)
