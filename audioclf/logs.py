"""Run-directory logging: train.log, metrics.csv and TensorBoard events.

Rank 0 logs INFO and up; other ranks log only warnings and errors (tagged with their rank), so
train.log holds rank 0's story plus every rank's problems.
"""

from __future__ import annotations

import csv
import faulthandler
import logging
import sys
from pathlib import Path

from audioclf.fileio import DiskWriteError, atomic_write_bytes, write_failure_message

log = logging.getLogger("audioclf")

METRIC_COLUMNS = [
    "epoch", "step", "train_loss", "lr", "samples_per_s", "epoch_seconds", "nonfinite_steps",
    "overflow_steps", "skipped_files", "skipped_batches", "precision_at_1", "map_at_r",
    "r_precision",
]


def setup_logging(run_dir: Path | None, rank: int) -> None:
    """Console + train.log handlers on the 'audioclf' logger (idempotent)."""
    for handler in list(log.handlers):
        if isinstance(handler, logging.FileHandler):
            faulthandler.enable(file=sys.__stderr__, all_threads=True)  # off the file closed next
        log.removeHandler(handler)
        handler.close()
    log.setLevel(logging.INFO)
    log.propagate = False
    prefix = "" if rank == 0 else f"[rank {rank}] "
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s {prefix}%(message)s", "%Y-%m-%d %H:%M:%S")
    level = logging.INFO if rank == 0 else logging.WARNING
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(fmt)
    console.setLevel(level)
    log.addHandler(console)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(run_dir / "train.log", mode="a")
        file_handler.setFormatter(fmt)
        file_handler.setLevel(level)
        log.addHandler(file_handler)
        # A process killed by a signal, e.g. NCCL's watchdog aborting a collective that ran
        # past dist.timeout_minutes, runs no Python handler: faulthandler still writes "Fatal
        # Python error" and every thread's stack (where the rank was waiting) into train.log.
        faulthandler.enable(file=file_handler.stream, all_threads=True)
    logging.captureWarnings(True)
    warn_logger = logging.getLogger("py.warnings")
    warn_logger.handlers = [h for h in log.handlers]
    warn_logger.propagate = False


class MetricsWriter:
    """Rank 0's metrics.csv (one row per epoch) and TensorBoard scalars."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled = enabled
        self.csv_path = run_dir / "metrics.csv"
        self.tb = None
        if not enabled:
            return
        if not self.csv_path.exists():
            atomic_write_bytes(self.csv_path, (",".join(METRIC_COLUMNS) + "\r\n").encode())
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        except ImportError:  # tensorboard is in requirements.txt, but stay usable without it
            log.warning("tensorboard is not installed; writing metrics.csv only")

    def scalar(self, name: str, value: float, step: int) -> None:
        if self.tb is not None:
            self.tb.add_scalar(name, value, step)

    def epoch_row(self, row: dict) -> None:
        if not self.enabled:
            return
        try:
            with open(self.csv_path, "a", newline="") as fh:
                csv.writer(fh).writerow([_fmt(row.get(c, "")) for c in METRIC_COLUMNS])
        except OSError as exc:
            raise DiskWriteError(exc.errno, write_failure_message(
                self.csv_path, exc.strerror or str(exc))) from exc
        for key, value in row.items():
            if key not in ("epoch", "step") and isinstance(value, (int, float)):
                self.scalar(f"epoch/{key}", value, row["epoch"])
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def log_failure_to_file(exc: BaseException, rank: int, *, traceback: bool = True) -> None:
    """Append this rank's failure to train.log (the console shows it already): one line, plus
    the traceback for errors that are not bad input."""
    files = [h for h in log.handlers if isinstance(h, logging.FileHandler)]
    if not files:
        return
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0,
                            "rank %d stopped with %s: %s", (rank, type(exc).__name__, exc),
                            (type(exc), exc, exc.__traceback__) if traceback else None)
    for handler in files:
        handler.handle(record)
