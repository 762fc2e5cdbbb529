"""One feature file per audio file, written by a pool of worker processes.

Every file is written to .<name>.tmp beside its target and renamed into place, so a killed run
leaves no half file; a complete file (a valid .npy header for [frames, n_mels] float32 and the
size it promises) is left as it is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from audioclf.config import FeaturesConfig
from audioclf.data.readers import AudioReadError, load_audio, read_npy_header
from audioclf.outputs import in_workers
from audioclf.spectrogram import log_mel, one_torch_thread

CHUNK_FILES = 32  # files per task handed to a worker
WRITTEN, PRESENT, SKIPPED = "written", "present", "skipped"


@dataclass(frozen=True)
class Task:
    position: int  # row position in the validated index
    source: str  # absolute audio path
    target: str  # feature path relative to the output folder
    span: tuple[float, float] | None = None  # (start, end) seconds of a segment row


@dataclass(frozen=True)
class Outcome:
    position: int
    status: str  # WRITTEN, PRESENT or SKIPPED
    seconds: float = 0.0  # audio duration (of PRESENT files estimated from their frame count)
    nbytes: int = 0  # bytes written
    reason: str = ""  # why a file was skipped


def complete_frames(path: Path, n_mels: int) -> int | None:
    """Frames of a complete feature file at `path`, or None when it is missing or incomplete.

    Complete: a readable .npy header for a C-order float32 [frames >= 1, n_mels] array and
    exactly the file size that header promises (a truncated file is shorter).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        shape, fortran_order, dtype, offset = read_npy_header(fd)
        size = os.fstat(fd).st_size
    except (OSError, ValueError, EOFError):
        return None
    finally:
        os.close(fd)
    if (
        len(shape) != 2
        or shape[1] != n_mels
        or shape[0] < 1
        or fortran_order
        or dtype != np.dtype("<f4")
        or size != offset + shape[0] * n_mels * 4
    ):
        return None
    return int(shape[0])


def make_tasks(table, targets: list[str], positions, excluded) -> list[Task]:
    """One Task per row position not in `excluded`, a segment row's span (start, end) with it."""
    sources = table["path"].to_numpy()
    spans = table[["start", "end"]].to_numpy(np.float64) if "start" in table else None

    def span(p: int) -> tuple[float, float] | None:
        return None if spans is None or np.isnan(spans[p, 0]) else tuple(map(float, spans[p]))

    return [
        Task(int(p), str(sources[p]), targets[p], span(p))
        for p in positions
        if int(p) not in excluded
    ]


def temporary_path(target: Path) -> Path:
    """Where `target` is written before being renamed into place: one name per target, so a
    rerun overwrites what a killed run left (only one process ever writes a given target)."""
    return target.with_name(f".{target.name}.tmp")


def prepare_file(task: Task, out_dir: Path, features: FeaturesConfig) -> Outcome:
    """Write the log-mel of one audio file, unless a complete one is already there."""
    target = out_dir / task.target
    temp = temporary_path(target)
    frames = complete_frames(target, features.n_mels)
    if frames is not None:
        temp.unlink(missing_ok=True)
        # A clip of S samples has (S - n_fft // 2) // hop + 1 frames: invert it (within a hop).
        samples = (frames - 1) * features.hop_length + features.n_fft // 2
        return Outcome(task.position, PRESENT, seconds=samples / features.sample_rate)
    try:
        wave = load_audio(task.source, features.sample_rate, task.span)
    except AudioReadError as exc:
        return Outcome(task.position, SKIPPED, reason=str(exc))
    mel = log_mel(wave, features)
    try:
        with open(temp, "wb") as handle:
            np.lib.format.write_array(handle, mel, allow_pickle=False)
            nbytes = handle.tell()
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    return Outcome(task.position, WRITTEN, seconds=len(wave) / features.sample_rate, nbytes=nbytes)


_WORKER: dict = {}  # out_dir and features of this worker process (set by _init_worker)


def _init_worker(out_dir: Path, features: FeaturesConfig) -> None:
    # One clip is too small to share between threads; N processes × all threads oversubscribe.
    torch.set_num_threads(1)
    _WORKER.update(out_dir=out_dir, features=features)


def _prepare_chunk(tasks: list[Task]) -> list[Outcome]:
    return [prepare_file(task, _WORKER["out_dir"], _WORKER["features"]) for task in tasks]


def run_tasks(
    tasks: list[Task], out_dir: Path, features: FeaturesConfig, *, workers: int, progress: bool
) -> Iterator[Outcome]:
    """prepare_file over `tasks` in `workers` processes (1 = here), yielding outcomes as chunks
    finish; closing the iterator early stops the workers."""
    chunks = [tasks[i : i + CHUNK_FILES] for i in range(0, len(tasks), CHUNK_FILES)]
    bar = tqdm(
        total=len(tasks),
        desc="log-mel",
        unit="file",
        disable=None if progress else True,
        dynamic_ncols=True,
    )
    with one_torch_thread():  # in this process, for a single worker (_init_worker sets it)
        initargs = (out_dir, features)
        for outcomes in in_workers(
            _prepare_chunk, chunks, workers, _init_worker, initargs, bar, False
        ):
            yield from outcomes
