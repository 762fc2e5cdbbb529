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


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--screenshots",
        metavar="DIR",
        help="the browser tests save their screenshots in DIR (docs/ holds the ones the docs "
        "show); default: each test's temporary folder",
    )


@pytest.fixture(scope="module")
def browser():
    """A headless Playwright Browser over the system's Chromium for one page test module;
    skipped, with the one reason, where Playwright or chromium is missing. Module scope: the
    sync API keeps an event loop running in this thread until it stops, and later tests of
    the worker call asyncio.run()."""
    from tests.helpers import browser_missing, chromium

    if (reason := browser_missing()) is not None:
        pytest.skip(reason)
    with chromium() as opened:
        yield opened


@pytest.fixture
def screenshots(request, tmp_path) -> Path:
    """Where a browser test saves its screenshots (--screenshots DIR, else its tmp_path)."""
    chosen = request.config.getoption("--screenshots")
    return Path(chosen) if chosen else tmp_path


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


# ----------------------------------------------------------------------------- time by room
# tests/ mirrors the package's rooms (data, training, evaluation, ...): the end of a run says
# how many tests each room holds and the seconds they took (setup, call and teardown, summed
# over the workers), beside --durations' slowest ones, so a room that grows slow is seen.
_ROOMS: dict[str, list[float]] = {}


def pytest_runtest_logreport(report) -> None:
    parts = report.nodeid.split("::", 1)[0].split("/")
    room = parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]
    tests_seconds = _ROOMS.setdefault(room, [0, 0.0])
    tests_seconds[0] += report.when == "call" or (report.when == "setup" and report.skipped)
    tests_seconds[1] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _ROOMS:
        return
    terminalreporter.section("tests and seconds by room")
    rooms = sorted(_ROOMS.items(), key=lambda item: -item[1][1])
    terminalreporter.line("  ".join(f"{room} {n} ({s:.0f} s)" for room, (n, s) in rooms))
