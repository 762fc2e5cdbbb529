"""Shared fixtures: a tiny generated demo dataset and tiny training configs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

# Each test process (and the processes it starts) on one thread: the machines have 2 cores,
# and the GPU check's CPU shards would each take every core of a GPU box. Set before torch is
# imported: torch reads them once, at its import (set after it, torch kept a thread per core).
for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")

import pytest  # noqa: E402 - after the thread variables
import torch  # noqa: E402


@pytest.fixture(scope="session")
def tiny_demo(tmp_path_factory) -> Path:
    """12 classes x 3 items x 4 ids of generated audio; returns the index.xlsx path."""
    from audioclf.data.demo import generate_demo

    return generate_demo(tmp_path_factory.mktemp("demo"), classes=12, items=3, ids=4, seed=0)


@pytest.fixture(autouse=True)
def cpu_suite_on_the_cpu(request, monkeypatch):
    """Every test not marked `cuda` runs on the CPU, also on a GPU machine: this process sees no
    CUDA device (so `auto` devices resolve to the CPU) and neither do the processes it starts
    (CUDA_VISIBLE_DEVICES is empty for them): the 2-rank tests would otherwise ask for a second
    GPU on a one-GPU box ("invalid device ordinal"). The `cuda` tests keep the GPUs."""
    if request.node.get_closest_marker("cuda"):
        return
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def notes() -> list[str]:
    """The INFO lines of the 'audioclf' logger (a handler of its own: setup_logging elsewhere
    in the session may have turned its propagation off)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("audioclf")
    handler, level = Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)
