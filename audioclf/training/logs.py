"""Run-directory logging: train.log, metrics.csv and TensorBoard events.

Rank 0 logs INFO and up; other ranks log only warnings and errors (tagged with their rank), so
train.log holds rank 0's story plus every rank's problems. At each validation, TensorBoard's
projector gets a class-stratified sample of the validation embeddings (MetricsWriter.projector).
"""

from __future__ import annotations

import csv
import faulthandler
import logging
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import pandas as pd

from audioclf.data.index import stratified_subset
from audioclf.errors import one_line  # a worker's error carries its whole traceback as text
from audioclf.fileio import DiskWriteError, atomic_write_bytes, tsv_cell, write_failure_message
from audioclf.metrics import RETRIEVAL_KEYS

log = logging.getLogger("audioclf")


@dataclass
class EpochRow:
    """One epoch of a run: a metrics.csv row, a TensorBoard point, an entry of the history a
    checkpoint keeps (as `as_dict()`)."""

    epoch: int
    step: int
    train_loss: float
    lr: float
    samples_per_s: float
    epoch_seconds: float
    nonfinite_steps: int
    overflow_steps: int
    skipped_files: int
    skipped_batches: int
    metrics: dict[str, float] = field(default_factory=dict)  # validation (RETRIEVAL_KEYS)

    def as_dict(self) -> dict:
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "metrics"}
        return {**row, **self.metrics}


METRIC_COLUMNS = [f.name for f in fields(EpochRow) if f.name != "metrics"] + list(RETRIEVAL_KEYS)
# Most validation embeddings given to TensorBoard's projector per validation: a class-stratified
# sample. tensors.tsv is text, about 2,000 x D x 9 bytes (2.3 MB at D = 128) per validation.
PROJECTOR_POINTS = 2000
PROJECTOR_DECIMALS = 5  # the projector draws; more digits only make tensors.tsv bigger


class _Backlog(logging.Handler):
    """What is logged before the run folder exists (the index read, its assumptions, warnings):
    kept to go into train.log once it is opened. Bounded: the last BACKLOG_RECORDS records."""

    def __init__(self, level: int):
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records = [*self.records[-(BACKLOG_RECORDS - 1) :], record]


BACKLOG_RECORDS = 1000


def setup_logging(run_dir: Path | None, rank: int) -> None:
    """Console + train.log handlers on the 'audioclf' logger (idempotent). Without a run folder
    the records are also kept, and the first call with one writes them into its train.log."""
    backlog = [r for h in log.handlers if isinstance(h, _Backlog) for r in h.records]
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
    if run_dir is None:
        log.addHandler(_Backlog(level))
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(run_dir / "train.log", mode="a")
        file_handler.setFormatter(fmt)
        file_handler.setLevel(level)
        for record in backlog:  # what was said before the folder could take it
            file_handler.handle(record)
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
    """Rank 0's metrics.csv (one row per epoch), TensorBoard scalars and projector embeddings."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled = enabled
        self.csv_path = run_dir / "metrics.csv"
        self.tb = None
        if not enabled:
            return
        if not self.csv_path.exists():
            atomic_write_bytes(self.csv_path, (",".join(METRIC_COLUMNS) + "\r\n").encode())
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            _restore_projector_config(self.tb)
        except ImportError:  # tensorboard is in requirements.txt, but stay usable without it
            log.warning("tensorboard is not installed; writing metrics.csv only")

    def scalar(self, name: str, value: float, step: int) -> None:
        if self.tb is not None:
            self.tb.add_scalar(name, value, step)

    def append_row(self, row: dict) -> None:
        """One row of metrics.csv: `row`'s values under METRIC_COLUMNS (missing ones empty)."""
        if not self.enabled:
            return
        try:
            with open(self.csv_path, "a", newline="") as fh:
                csv.writer(fh).writerow([_fmt(row.get(c, "")) for c in METRIC_COLUMNS])
        except OSError as exc:
            raise DiskWriteError(
                exc.errno, write_failure_message(self.csv_path, exc.strerror or str(exc))
            ) from exc

    def epoch_row(self, row: dict) -> None:
        """An EpochRow.as_dict(): appended to metrics.csv, its numbers to TensorBoard."""
        if not self.enabled:
            return
        self.append_row(row)
        for key, value in row.items():
            if key not in ("epoch", "step") and isinstance(value, (int, float)):
                self.scalar(f"epoch/{key}", value, row["epoch"])
        if self.tb is not None:
            self.tb.flush()

    def projector(
        self,
        embeddings: np.ndarray,
        classes: Sequence[str],
        items: Sequence[str],
        *,
        epoch: int,
        step: int,
        limit: int = PROJECTOR_POINTS,
        seed: int = 0,
    ) -> int:
        """Validation embeddings [N, D] into TensorBoard's projector, tagged
        "validation/epoch_<epoch>" at `step`, with [class, item] metadata per point.

        At most `limit` points, class-stratified (every class while it lasts; the same points
        every epoch when the validation set is the same). Rank 0 only: a no-op when disabled or
        without tensorboard; a write that fails (full disk) logs a warning and training goes
        on. Returns the number of points written.
        """
        if self.tb is None or len(embeddings) == 0:
            return 0
        classes, items = np.asarray(classes, dtype=str), np.asarray(items, dtype=str)
        if not len(embeddings) == len(classes) == len(items):
            raise ValueError(
                f"projector: {len(embeddings)} embeddings, {len(classes)} classes "
                f"and {len(items)} items; give one class and item per embedding"
            )
        keep = stratified_subset(pd.factorize(classes)[0], limit, seed)
        points = np.round(np.asarray(embeddings, dtype=np.float64)[keep], PROJECTOR_DECIMALS)
        metadata = [
            [tsv_cell(c), tsv_cell(i)] for c, i in zip(classes[keep], items[keep], strict=True)
        ]
        tag = f"validation/epoch_{epoch:03d}"
        try:
            _forget_projector_entry(self.tb, tag, step)  # a re-run epoch replaces its entry
            self.tb.add_embedding(
                points,
                metadata=metadata,
                metadata_header=["class", "item"],
                tag=tag,
                global_step=step,
            )
        except OSError as exc:
            log.warning(
                "could not write the validation embeddings to TensorBoard's projector "
                "(%s); training goes on",
                exc,
            )
            return 0
        return len(keep)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


# SummaryWriter keeps the projector's list of embeddings in memory and rewrites
# projector_config.pbtxt from it on every add_embedding; a resumed run's new writer would
# forget the epochs before the restart. These two keep that list in step with the folder.


def _restore_projector_config(tb) -> None:
    """Seed a new SummaryWriter with the projector entries already in its log folder."""
    path = Path(tb.log_dir) / "projector_config.pbtxt"
    if not path.is_file():
        return
    try:
        # tensorboard's own modules, optional like tensorboard itself
        from google.protobuf import text_format  # noqa: PLC0415
        from tensorboard.plugins.projector.projector_config_pb2 import (  # noqa: PLC0415
            ProjectorConfig,
        )

        tb._projector_config = text_format.Parse(path.read_text(), ProjectorConfig())
    except Exception as exc:  # a broken file costs the earlier entries, not the run
        log.warning("could not read %s (%s); it will list this run's embeddings only", path, exc)


def _forget_projector_entry(tb, tag: str, step: int) -> None:
    """Drop an entry (and its files) that add_embedding is about to write again, e.g. when a
    run resumed from before its last validation repeats that epoch."""
    config = getattr(tb, "_projector_config", None)
    name = f"{tag}:{str(step).zfill(5)}"
    if config is not None:
        kept = [entry for entry in config.embeddings if entry.tensor_name != name]
        if len(kept) != len(config.embeddings):
            del config.embeddings[:]
            config.embeddings.extend(kept)
    folder = Path(tb.log_dir) / str(step).zfill(5) / tb._encode(tag)
    if folder.is_dir():
        shutil.rmtree(folder)


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
    with_traceback = traceback and exc.__traceback__ is not None
    record = log.makeRecord(
        log.name,
        logging.ERROR,
        __file__,
        0,
        "rank %d stopped with %s: %s",
        (rank, type(exc).__name__, one_line(exc)),
        (type(exc), exc, exc.__traceback__) if with_traceback else None,
    )
    for handler in files:
        handler.handle(record)
