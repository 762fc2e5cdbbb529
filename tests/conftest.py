"""Shared fixtures: a tiny generated demo dataset and tiny training configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from audioclf.config import Config, load_config

# Keep each test process (and the processes it spawns) on one thread: the machines have 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_demo(tmp_path_factory) -> Path:
    """12 classes x 3 items x 4 ids of generated audio; returns the index.xlsx path."""
    from audioclf.data.demo import generate_demo

    return generate_demo(tmp_path_factory.mktemp("demo"), classes=12, items=3, ids=4, seed=0)


TINY = {
    "cnn": ["model.name=cnn", "model.cnn.width=8", "model.cnn.depth=2"],
    "conformer": ["model.name=conformer", "model.conformer.d_model=32",
                  "model.conformer.num_heads=2", "model.conformer.ffn_dim=64",
                  "model.conformer.num_layers=1", "model.conformer.kernel_size=7"],
}


def tiny_config(index: Path, runs_dir: Path, model: str = "cnn", *extra: str) -> Config:
    """A config that trains in seconds on CPU: tiny model, short crops, small batches."""
    return load_config(None, [
        f"data.index={index}", "data.num_workers=0", "data.val_ratio=0.25",
        "sampler.batch_size=8", "sampler.m=2",
        "features.n_mels=32", "clips.crop_seconds=0.5", "clips.eval_max_seconds=1.0",
        "model.embedding_dim=16", *TINY[model],
        "optim.lr=0.003", "optim.warmup_steps=0",
        f"train.runs_dir={runs_dir}", "train.name=t", "train.epochs=2", "train.log_every_steps=0",
        "eval.every=1", "eval.batch_size=16", "checkpoint.keep_last=1", *extra,
    ])
