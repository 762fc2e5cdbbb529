"""The run folder: made once the input is known to be valid, and one live run per folder (an
OS lock on <run dir>/run.lock, held by the rank that writes the folder, rank 0, for the run).

The lock is `fcntl.flock` on an open file: the kernel releases it when the process dies,
however it dies, so a killed run never leaves a stale lock (the file stays, naming the last
holder; the next run takes it over). A second run into a held folder — a fresh start, a
resume, `./run.sh --bg` twice — stops before writing anything, with one line naming the
holder (pid, host, start time) and the fix.

Network file systems: Linux NFS (v4, or v3 with lockd) turns flock into a lock the server
sees, so runs on two machines sharing the folder exclude each other; file systems without
locks (some FUSE mounts) make flock fail, and the run then goes on unlocked with a warning.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
from pathlib import Path

from audioclf.config import save_config
from audioclf.fileio import DiskWriteError, remove_stale_temps, write_failure_message

log = logging.getLogger("audioclf")

LOCK_FILE = "run.lock"


def prepare_run_dir(run_dir: Path, cfg) -> tuple[RunLock, list[Path]]:
    """Create the folder, take its lock, remove what a killed write left, write config.yaml.
    Returns (the lock, the stale temporary files removed). Rank 0 only."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DiskWriteError(
            exc.errno, write_failure_message(run_dir, exc.strerror or str(exc))
        ) from exc
    lock = RunLock(run_dir)
    lock.acquire()  # before anything is written: a held folder stays as its run left it
    stale = remove_stale_temps(run_dir)  # left by a process killed mid-write
    save_config(cfg, run_dir / "config.yaml")
    return lock, stale


class RunFolderBusy(ValueError):
    """Another live run holds the run folder; the message names it and the fix."""


def check_free(run_dir: Path) -> None:
    """Raise RunFolderBusy when a live run holds `run_dir`; creates nothing."""
    path = Path(run_dir) / LOCK_FILE
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below; flock works on read-only files
    except OSError:
        return  # no lock file: nobody holds the folder
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunFolderBusy(_busy_message(run_dir, handle.read())) from None
    except OSError:
        return  # a file system without locks: RunLock.acquire says so
    finally:
        handle.close()


class RunLock:
    """The run's hold on its folder (rank 0); `acquire` once the input is known to be valid."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._handle = None

    def acquire(self) -> None:
        """Take the lock and write who holds it; RunFolderBusy when another run has it."""
        path = self.run_dir / LOCK_FILE
        try:
            handle = open(path, "a+b")  # noqa: SIM115 - held for the run
        except OSError as exc:  # a read-only or full runs folder: say so as every write does
            raise DiskWriteError(
                exc.errno, write_failure_message(path, exc.strerror or str(exc))
            ) from exc
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            message = _busy_message(self.run_dir, handle.read())
            handle.close()
            raise RunFolderBusy(message) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                handle.close()
                raise
            log.warning(
                "cannot lock %s (%s): this file system has no locks, so a second run "
                "into this folder would not be refused",
                self.run_dir,
                exc.strerror,
            )
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_holder()).encode() + b"\n")
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the file releases the lock
            self._handle = None


def _holder() -> dict:
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": started,
        "command": " ".join(sys.argv),
    }


def _busy_message(run_dir: Path, content: bytes) -> str:
    try:
        holder = json.loads(content.decode() or "{}")
    except ValueError:
        holder = {}
    who = (
        f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started "
        f"{holder.get('started', '?')}"
    )
    return (
        f"run folder {run_dir} is in use by another run ({who}); start this one with "
        f"another train.name, or stop that run first (./run.sh stop {Path(run_dir).name})"
    )
