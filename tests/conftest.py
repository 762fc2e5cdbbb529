"""Shared fixtures: a tiny generated demo dataset and tiny training configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Keep each test process (and the processes it spawns) on one thread: the machines have 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_demo(tmp_path_factory) -> Path:
    """12 classes x 3 items x 4 ids of generated audio; returns the index.xlsx path."""
    from audioclf.data.demo import generate_demo

    return generate_demo(tmp_path_factory.mktemp("demo"), classes=12, items=3, ids=4, seed=0)
