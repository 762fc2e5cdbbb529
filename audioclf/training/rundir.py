"""The run folder and a run's life in it: the lock (one live run per folder), the resume
point (which checkpoint a run starts from, and whether it fits), and how a run stops (on
request, on failure).

The lock is outputs.FolderLock on <run dir>/run.lock (fcntl.flock, released by the kernel when
the process dies), held by the rank that writes the folder (rank 0) for the run. A second run
into a held folder (a fresh start, a resume, `./run.sh --bg` twice) stops before writing
anything, with one line naming the holder (pid, host, start time) and the fix.

Resuming: the architecture (config.architecture: the model with its head, and the features)
must be the checkpoint's: a difference is refused with the keys named, unless
checkpoint.resume_strict=false, which takes the checkpoint's. Everything else (crops, evaluation
clips, augmentation, the loss weights, the schedule) may change between the runs of one model.

Stopping: SIGTERM / SIGINT finish the step, save last.pt and exit (`StopRequested`); on failure
each rank logs once and its console shows one line (`reported`).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from audioclf import checkpoint, distributed
from audioclf.config import Config, architecture, config_from_dict, differences, save_config
from audioclf.errors import AlreadyReported, is_user_error, one_line
from audioclf.fileio import DiskWriteError, remove_stale_temps, write_failure_message
from audioclf.outputs import FolderLock
from audioclf.training.logs import log_failure_to_file

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


class RunLock(FolderLock):
    """The run's hold on its folder (rank 0): outputs.FolderLock on <run dir>/run.lock;
    `acquire` once the input is known to be valid."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        super().__init__(
            self.run_dir / LOCK_FILE,
            what=f"run folder {run_dir}",
            by="another run",
            fix=f"start this one with another train.name, or stop that run first "
            f"(./run.sh stop {self.run_dir.name})",
            remove=False,
        )


def check_free(run_dir: Path) -> None:
    """Raise outputs.FolderBusy when a live run holds `run_dir`; creates nothing."""
    RunLock(run_dir).check_free()


def check_before_ranks(cfg: Config) -> None:
    """What every rank would refuse alike, checked once by a launcher before it starts them
    (so a mistake is one line, not one per rank): the run folder free and fit for this start,
    the resume checkpoint there, the tracker's package, and the sheet (which this read caches
    for the ranks)."""
    from audioclf.data.index import load_index  # noqa: PLC0415 - the launcher's check only
    from audioclf.training.trackers import check_tracker  # noqa: PLC0415

    run_dir = Path(cfg.train.runs_dir) / cfg.train.name
    check_free(run_dir)
    resume_path(cfg, run_dir)
    check_tracker(cfg, run_dir)
    load_index(cfg.data)


# ------------------------------------------------------------------------------ resume point


def resume_path(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint to resume from (None: a fresh start); ValueError for a fresh start into
    a folder that holds a run, CheckpointError for a checkpoint.resume file that is missing."""
    path = checkpoint.resolve_resume(cfg.checkpoint.resume, run_dir)
    if path is None and (run_dir / checkpoint.LAST).exists():
        raise ValueError(
            f"{run_dir} already holds a run ({checkpoint.LAST}); continue it with "
            "checkpoint.resume=auto, or start a new one with another train.name (or delete "
            "the folder)"
        )
    return path


def resume_point(cfg: Config, run_dir: Path) -> tuple[Path | None, dict | None, list[str]]:
    """(checkpoint path, its dict, notes for train.log), or (None, None, []) for a fresh start.

    A fresh start into a folder that holds a run is refused. With resume_strict=false the
    checkpoint's architecture replaces cfg's (cfg.model, cfg.features are set in place).
    """
    path = resume_path(cfg, run_dir)
    if path is None:
        return None, None, []
    ckpt = checkpoint.load(path, trust=cfg.checkpoint.trust)
    saved = config_from_dict(ckpt["config"])
    changed = [
        f"{key} {old!r} (now {new!r})"
        for key, (old, new) in differences(architecture(saved), architecture(cfg)).items()
    ]
    notes = []
    if changed and cfg.checkpoint.resume_strict:
        raise checkpoint.CheckpointError(
            f"{path} was trained with other settings: {'; '.join(changed[:6])}"
            f"{' and more' if len(changed) > 6 else ''}. Resume with the run's own settings, "
            "start a new run (another train.name), or set checkpoint.resume_strict=false to "
            "continue with the checkpoint's"
        )
    if changed:
        notes.append(
            f"resuming {path} with its own settings, not the requested "
            f"({'; '.join(changed)}): checkpoint.resume_strict=false"
        )
    cfg.model, cfg.features = saved.model, saved.features  # the architecture
    return path, ckpt, notes


# ---------------------------------------------------------------------------------- stopping


class StopRequested:
    """SIGTERM / SIGINT set a flag; the loop finishes the step, saves last.pt and exits (0 after
    SIGTERM, 130 after Ctrl-C). A second Ctrl-C stops the process at once: last.pt stays the
    last one written (checkpoint writes are atomic, so it is whole)."""

    def __init__(self, every: int = 1):
        self.every = every  # steps between the ranks' stop votes (train.log_every_steps)
        self.flag = False
        self.signal: str | None = None  # the signal that asked to stop, e.g. "SIGINT"
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a test thread)
                pass
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.flag and signum == signal.SIGINT:
            log.error("second Ctrl-C: stopping at once; last.pt is the last one saved")
            os._exit(130)
        if not self.flag:
            when = (
                "at the next step"
                if self.every <= 1
                else f"within {self.every} steps (the ranks vote every "
                f"train.log_every_steps={self.every})"
            )
            log.warning(
                "received %s: stopping %s, then saving last.pt%s",
                name,
                when,
                " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else "",
            )
        self.flag = True
        self.signal = self.signal or name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def reported(
    exc: Exception, env: distributed.DistEnv, *, setting_up: bool, stopping: bool
) -> Exception:
    """Log a rank's failure once and decide what its console shows.

    The rank that failed says why (and leaves its reason for the others, whose train.log lines
    name it); the ranks that lost it say nothing more, unless it vanished without a word (killed,
    or its node's agent was): rank 0 then says so, and so does the first rank of every other
    node (LOCAL_RANK 0), whose console may be the only one its user reads. Set-up errors are the
    same on every rank (same config, same sheet): rank 0 alone prints them.
    """
    if distributed.is_peer_failure(exc):
        exc = distributed.peer_failure(exc)
    else:
        distributed.announce_failure(one_line(exc))
    log_failure_to_file(exc, env.rank, traceback=not is_user_error(exc))
    if stopping:
        log.error("last.pt was not updated by the stop request: %s", one_line(exc))
    peer = isinstance(exc, distributed.PeerFailure)
    speaks_for_node = env.is_primary or env.local_rank == 0
    quiet = (peer and (exc.reported or not speaks_for_node)) or (setting_up and not env.is_primary)
    return AlreadyReported() if quiet else exc
