"""Output folders: the lock that keeps one writer per output (FolderLock: the run folder,
embed --index PREFIX, search indexes, prepare, evaluate --out, export), and the resumable
folders shared by prepare (DIR/prepare.json) and embed --index (PREFIX.parts/manifest.json).

The resumable folders are written in pieces, so that a rerun after a crash, a kill or a full disk
finishes what the killed run left. A manifest records what every piece depends on (settings,
model, format version); a folder whose manifest differs holds another run's work and must be
refused, not completed. The rows a run left out are listed in a skipped.csv (row, id, path,
reason); the pieces are made in a pool of worker processes with a progress bar (in_workers).
embed --index's PREFIX.parquet carries, in its schema metadata, the record of the model
that made the embeddings (write_table / read_made_by), which search indexes then keep.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import multiprocessing
import os
import socket
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pandas as pd

from audioclf.config import differences
from audioclf.fileio import DiskWriteError, atomic_write_bytes, write_failure_message

log = logging.getLogger("audioclf")


class ManifestMismatch(ValueError):
    """A folder's manifest records another run; `changed` names the differing keys (dotted for
    nested settings, e.g. "features.n_mels"), `earlier` is that manifest (None: unreadable)."""

    def __init__(self, path: Path, changed: list[str], earlier: dict | None, reason: str = ""):
        self.path, self.changed, self.earlier, self.reason = path, changed, earlier, reason
        what = reason or f"{', '.join(changed)} differ{'s' if len(changed) == 1 else ''}"
        super().__init__(f"{path} records another run ({what})")


def check_manifest(path: Path, wanted: dict) -> bool:
    """Whether `path` holds a manifest equal to `wanted` (True: the folder's work may be
    resumed; False: there is none). ManifestMismatch when it records another run or cannot
    be read."""
    if not path.is_file():
        return False
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ManifestMismatch(path, sorted(wanted), None, f"unreadable ({exc})") from None
    if not isinstance(earlier, dict):
        raise ManifestMismatch(path, sorted(wanted), None, "not a JSON object")
    changed = list(differences(earlier, wanted))
    if changed:
        raise ManifestMismatch(path, changed, earlier)
    return True


def write_manifest(path: Path, manifest: dict) -> Path:
    """The manifest as indented JSON, atomically (its folder is created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_bytes(path, (json.dumps(manifest, indent=2) + "\n").encode())


def write_skipped(path: Path, table: pd.DataFrame, reasons: Mapping[int, str]) -> Path | None:
    """row, id, path, reason of the rows of an index table at the positions of `reasons`
    (sorted, each reason on one line) as CSV at `path`; None and no file when nothing was
    skipped (a stale list of an earlier run is removed)."""
    if not reasons:
        path.unlink(missing_ok=True)
        return None
    positions = sorted(reasons)
    rows = table.iloc[positions]
    listing = pd.DataFrame(
        {
            "row": rows["row"].to_numpy(),
            "id": rows["id"].to_numpy(),
            "path": rows["path"].to_numpy(),
            "reason": [" ".join(str(reasons[p]).split()) for p in positions],
        }
    )
    return atomic_write_bytes(path, listing.to_csv(index=False).encode())


def in_workers(
    function: Callable,
    chunks: Sequence,
    workers: int,
    initializer: Callable,
    initargs: tuple,
    bar,
    ordered: bool,
) -> Iterator:
    """`function(chunk)` of each chunk in `workers` processes (1: in this one, after
    `initializer(*initargs)`), each result as its chunk finishes (in the chunks' order when
    `ordered`); `bar` (tqdm) advances by each result's length and is closed at the end. Closing
    the iterator early stops the workers."""
    workers = max(1, min(workers, len(chunks)))
    with contextlib.ExitStack() as stack:
        stack.callback(bar.close)
        if workers == 1:
            initializer(*initargs)
            results = map(function, chunks)
        else:
            # fork where there is one: workers start at once instead of importing torch anew
            # (seconds each); the parent has run no torch op, and each worker goes to one
            # thread before its first, as DataLoader workers do.
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            pool = stack.enter_context(context.Pool(workers, initializer, initargs))
            results = (pool.imap if ordered else pool.imap_unordered)(function, chunks)
        for result in results:
            bar.update(len(result))
            yield result


# --------------------------------------------------------------------- embed --index's table


MADE_BY_KEY = b"audioclf.model"  # PREFIX.parquet's schema metadata: the model's record (JSON)


def write_table(handle, frame: pd.DataFrame, made_by: dict | None) -> None:
    """`frame` as Parquet into the open binary `handle`, `made_by` (a JSON-able record of the
    model that made the rows' embeddings) in its schema metadata under MADE_BY_KEY."""
    import pyarrow as pa  # noqa: PLC0415 (pandas' Parquet engine: imported where it is used)
    import pyarrow.parquet as pq  # noqa: PLC0415

    table = pa.Table.from_pandas(frame, preserve_index=False)
    if made_by is not None:
        metadata = {**(table.schema.metadata or {}), MADE_BY_KEY: json.dumps(made_by).encode()}
        table = table.replace_schema_metadata(metadata)
    pq.write_table(table, handle)


def read_made_by(parquet: Path) -> dict | None:
    """The model record write_table put in `parquet` (None: none, or unreadable)."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        raw = (pq.read_schema(parquet).metadata or {}).get(MADE_BY_KEY)
        return None if raw is None else json.loads(raw)
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------ folder locks


class FolderBusy(ValueError):
    """Another live process holds an output (a run folder, an embed --index PREFIX, a search
    index, a prepare folder, an evaluate --out folder, an export); the message names it, its
    holder (pid, host, start time) and the fix."""


class FolderLock:
    """One writer per output: `fcntl.flock` on a lock file, held by the writing process for the
    whole write. The kernel releases it when the process dies, however it dies, so a killed
    writer never leaves a stale lock (its file stays, naming the last holder; the next writer
    takes it over). A second writer is refused at once with FolderBusy. A release removes the
    file (`remove`; the run folder's run.lock stays).

    On Linux NFS (v4, or v3 with lockd) flock is a lock the server sees, so writers on two
    machines exclude each other; file systems without locks (some FUSE mounts) make flock fail,
    and the write then goes on unlocked with a warning.

        with FolderLock(out / "evaluate.lock", what=f"--out {out}", by="another evaluate",
                        fix="wait for it to finish, or choose another --out"):
            ...  # write the folder
    """

    def __init__(self, path: str | Path, *, what: str, by: str, fix: str, remove: bool = True):
        self.path = Path(path)  # the lock file
        self.what, self.by, self.fix = what, by, fix  # "run folder runs/x", "another run", ...
        self.remove = remove  # delete the lock file on release (the run folder keeps its own)
        self._handle = None

    def check_free(self) -> None:
        """FolderBusy when a live process holds the lock; creates nothing."""
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 - closed below; flock works read-only
        except OSError:
            return  # no lock file: nobody holds it
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderBusy(self._busy(handle.read())) from None
        except OSError:
            return  # a file system without locks: acquire says so
        finally:
            handle.close()

    def acquire(self) -> FolderLock:
        """Take the lock and write who holds it; FolderBusy when another process has it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path, "a+b")  # noqa: SIM115 - held until release
        except OSError as exc:  # a read-only or full folder: say so as every write does
            raise DiskWriteError(
                exc.errno, write_failure_message(self.path, exc.strerror or str(exc))
            ) from exc
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            message = self._busy(handle.read())
            handle.close()
            raise FolderBusy(message) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                handle.close()
                raise
            log.warning(
                "cannot lock %s (%s): this file system has no locks, so a second writer "
                "would not be refused",
                self.path,
                exc.strerror,
            )
        if self.remove and not _still_at(handle, self.path):  # its holder removed it meanwhile
            handle.close()
            return self.acquire()
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(_holder()).encode() + b"\n")
            handle.flush()
        except OSError as exc:  # a full disk has no room even for the holder's line
            self._handle = handle
            self.release()  # its close cannot flush either: quiet, so this message stands
            reason = exc.strerror or str(exc)
            raise DiskWriteError(
                exc.errno, write_failure_message(self.path, reason, "nothing was written")
            ) from exc
        self._handle = handle
        return self

    def release(self) -> None:
        if self._handle is not None:
            if self.remove:  # while still held: a writer that opened it retries (_still_at)
                try:
                    self.path.unlink(missing_ok=True)
                except OSError:
                    pass
            try:
                self._handle.close()  # closing the file releases the lock
            except OSError:  # a full disk: the holder's line cannot be flushed even now, and
                pass  # the error that made us release is the one to report (the fd is closed)
            self._handle = None

    def __enter__(self) -> FolderLock:
        return self if self._handle is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _busy(self, content: bytes) -> str:
        try:
            holder = json.loads(content.decode() or "{}")
        except ValueError:
            holder = {}
        holder = holder if isinstance(holder, dict) else {}
        who = (
            f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started "
            f"{holder.get('started', '?')}"
        )
        return f"{self.what} is in use by {self.by} ({who}); {self.fix}"


def _still_at(handle, path: Path) -> bool:
    """Whether the locked file is still the one at `path` (not unlinked by a release)."""
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except OSError:
        return False


def _holder() -> dict:
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": started,
        "command": " ".join(sys.argv),
    }
