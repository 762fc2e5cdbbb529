"""Atomic file writes: a temporary file in the same folder, then os.replace.

A crash or an error mid-write leaves the previous file (or none), never half a file, and no
temporary file behind. Temporary names are unique per process and call, and files are created
with the usual umask (not mkstemp's 0600), so reports stay readable by others.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None], *,
                 sync: bool = False) -> Path:
    """Call write(handle) on a temporary file, fsync it when `sync`, then move it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as handle:
            write(handle)
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda handle: handle.write(data))


def atomic_copy(source: str | Path, path: str | Path) -> Path:
    """Copy a file's bytes to `path` atomically."""
    with open(source, "rb") as src:
        return atomic_write(path, lambda handle: shutil.copyfileobj(src, handle))
