"""Atomic file writes: a temporary file in the same folder, then os.replace.

An error mid-write leaves the previous file (or none), never half a file, and no temporary file
behind; a killed writer leaves its hidden temporary file, which the next writer of that output
removes (remove_temporaries, remove_stale_temps). Temporary names are unique per process and
call, and files are created with the usual umask (not mkstemp's 0600), so reports stay readable
by others.

Also `tsv_cell`, the one way a value becomes a cell of the TSV files the projectors read.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO


class DiskWriteError(OSError):
    """A file that could not be written (full disk, read-only or forbidden folder); the message
    names the path, the free space and says the previous file is unchanged."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # the message, without "[Errno 28]"


# torch.save reports a full disk as a RuntimeError of its zip writer.
_TORCH_WRITE_FAILURES = ("PytorchStreamWriter", "inline_container", "unexpected pos")


def atomic_write(
    path: str | Path, write: Callable[[IO[bytes]], None], *, sync: bool = False
) -> Path:
    """Call write(handle) on a temporary file, fsync it when `sync`, then move it to `path`.

    A write that fails on the disk (ENOSPC, EROFS, EACCES, ...) raises DiskWriteError; the
    temporary file is removed and any previous `path` stays as it was.
    """
    return atomic_write_together({Path(path): write}, sync=sync)[0]


def atomic_write_together(
    writes: Mapping[Path, Callable[[IO[bytes]], None]], *, sync: bool = False
) -> list[Path]:
    """Files that are read together (PREFIX.npy with PREFIX.parquet, an index with its data):
    each written to a temporary file in the order given; once all are complete the previous
    versions of all but the first are removed, then each is moved into place. A reader (or a
    kill, or a full disk) thus meets the previous set, the new one, or one with a file missing,
    which it refuses: never a new file beside an old one. Errors as atomic_write."""
    temps: dict[Path, Path] = {}
    try:
        for path, write in writes.items():
            path = Path(path)
            temps[path] = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(temps[path], "xb") as handle:
                write(handle)
                if sync:
                    handle.flush()
                    os.fsync(handle.fileno())
        for path in list(temps)[1:]:
            path.unlink(missing_ok=True)
        for path, tmp in temps.items():
            os.replace(tmp, path)
    except OSError as exc:
        if isinstance(exc, DiskWriteError):
            raise
        failed = next(reversed(temps))
        raise DiskWriteError(
            exc.errno, write_failure_message(failed, exc.strerror or str(exc))
        ) from exc
    except RuntimeError as exc:
        if not any(marker in str(exc) for marker in _TORCH_WRITE_FAILURES):
            raise
        failed = next(reversed(temps))
        raise DiskWriteError(
            errno.EIO, write_failure_message(failed, "the write stopped short (is the disk full?)")
        ) from exc
    finally:
        for tmp in temps.values():
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # e.g. a read-only file system: the error above is the one to report
                pass
    return list(temps)


def write_failure_message(path: Path, reason: str, kept: str | None = None) -> str:
    """The one line of a write that failed: the file, why, the free space of its folder, what
    is left (`kept`; by default the previous file unchanged, or nothing written) and the fix."""
    folder = next((p for p in (path.parent, *path.parents) if p.exists()), Path("/"))
    try:
        free = f"{shutil.disk_usage(folder).free / 2**30:.2f} GiB free on {folder}"
    except OSError:
        free = f"free space on {folder} unknown"
    if kept is None:
        kept = "the previous file is unchanged" if path.exists() else "nothing was written"
    return f"cannot write {path}: {reason} ({free}); {kept}. {_write_fix(reason, folder)}"


def _write_fix(reason: str, folder: Path) -> str:
    """The fix for a failed write, by its cause (`reason`: the OSError's strerror, which every
    caller passes): a read-only or forbidden folder is not fixed by freeing space."""
    if os.strerror(errno.EROFS) in reason:
        return f"{folder} is on a read-only file system: remount it writable, or write to another folder"
    if os.strerror(errno.EACCES) in reason or os.strerror(errno.EPERM) in reason:
        return (
            f"{folder} is not writable by you: change its permissions, or write to another folder"
        )
    return "Free some space there, or write to another folder"


def remove_stale_temps(folder: str | Path) -> list[Path]:
    """Delete temporary files that atomic_write left in `folder` when its process was killed
    (their process is gone); returns them."""
    removed = []
    for tmp in Path(folder).glob(".*.tmp"):
        pid = tmp.name.rsplit(".", 3)[-3] if tmp.name.count(".") >= 4 else ""
        if pid.isdigit() and not _alive(int(pid)):
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # read-only: the write that follows will say so
                continue
            removed.append(tmp)
    return removed


def remove_temporaries(*paths: str | Path) -> list[Path]:
    """Delete the temporary files atomic_write left for `paths` (a killed writer's), and the
    temporary folders of the same name a folder export builds; returns them. Only for the
    holder of the lock of these files: no other live process writes them (unlike
    remove_stale_temps, it needs no pid, which another host's writer would not share)."""
    removed = []
    for path in map(Path, paths):
        shape = re.compile(rf"\.{re.escape(path.name)}\.\d+\.[0-9a-f]{{8}}\.tmp")
        for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
            try:
                if not shape.fullmatch(tmp.name):
                    continue
                if tmp.is_dir():  # export --format folder builds the folder under such a name
                    shutil.rmtree(tmp)
                else:
                    tmp.unlink(missing_ok=True)
                removed.append(tmp)
            except OSError:  # read-only: the write that follows will say so
                continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def atomic_write_bytes(path: str | Path, data: bytes, *, sync: bool = False) -> Path:
    return atomic_write(path, lambda handle: handle.write(data), sync=sync)


def atomic_copy(source: str | Path, path: str | Path) -> Path:
    """Copy a file's bytes to `path` atomically."""
    with open(source, "rb") as src:
        return atomic_write(path, lambda handle: shutil.copyfileobj(src, handle))


def tsv_cell(text) -> str:
    """One cell of a TSV file for TensorBoard's / the web projector: tabs and line breaks would
    shift its columns and rows, and an empty cell reads as a missing value."""
    return " ".join(str(text).split()) or "-"


def file_stamp(path: Path, *, relative_to: Path | None = None, content: bool = False) -> dict:
    """What a cache, index or manifest records of a file to notice that it was rewritten: its
    path (resolved; relative to `relative_to` when it lies below it, so the two can move
    together), byte size and modification time, and with `content` a 128-bit hash of its bytes
    (a 10 MB sheet hashes in about 5 ms)."""
    path = Path(path)
    stat = path.stat()
    shown = str(path.resolve())
    if relative_to is not None:
        try:
            below = os.path.relpath(path.resolve(), Path(relative_to).resolve())
        except ValueError:  # another drive on Windows
            below = ".."
        shown = shown if below.startswith("..") else below
    stamp = {"path": shown, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if content:
        stamp["content"] = hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
    return stamp
