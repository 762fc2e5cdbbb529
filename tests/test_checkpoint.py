"""Checkpoint files: atomic writes, last/best/keep-k, clear errors, resume resolution."""

import random

import numpy as np
import pytest
import torch

from audioclf import checkpoint
from audioclf.checkpoint import CheckpointError, CheckpointSaver


def state(value: float) -> dict:
    return {"model": {"w": torch.tensor([value])}, "config": {}, "epoch": int(value)}


def test_save_atomic_leaves_only_the_file(tmp_path):
    path = checkpoint.save_atomic(state(1.0), tmp_path / "sub" / "last.pt")
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]
    assert checkpoint.load(path)["model"]["w"].item() == 1.0


def test_failed_save_keeps_previous_file(tmp_path):
    path = checkpoint.save_atomic(state(1.0), tmp_path / "last.pt")

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        checkpoint.save_atomic({"model": Unpicklable(), "config": {}}, path)
    assert checkpoint.load(path)["model"]["w"].item() == 1.0
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_saver_keeps_last_best_and_k_epochs(tmp_path):
    saver = CheckpointSaver(tmp_path, keep_last=2)
    metrics = [0.1, 0.5, 0.3, 0.4]
    for epoch, metric in enumerate(metrics, start=1):
        saver.save_epoch(state(epoch), epoch, metric)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["best.pt", "epoch_0003.pt", "epoch_0004.pt", "last.pt"]
    assert checkpoint.load(tmp_path / "best.pt")["epoch"] == 2
    assert checkpoint.load(tmp_path / "last.pt")["epoch"] == 4
    assert saver.best_metric == 0.5


def test_nan_metric_never_best(tmp_path):
    saver = CheckpointSaver(tmp_path, keep_last=0)
    saver.save_epoch(state(1), 1, float("nan"))
    saver.save_epoch(state(2), 2, None)
    assert not (tmp_path / "best.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing\.pt does not exist"):
        checkpoint.load(tmp_path / "missing.pt")
    good = checkpoint.save_atomic(state(1.0), tmp_path / "good.pt")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"truncated\.pt cannot be read"):
        checkpoint.load(truncated)
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(CheckpointError, match=r"foreign\.pt is not an audioclf checkpoint"):
        checkpoint.load(foreign)


def test_resolve_resume(tmp_path):
    assert checkpoint.resolve_resume("", tmp_path) is None
    assert checkpoint.resolve_resume("auto", tmp_path) is None
    checkpoint.save_atomic(state(1), tmp_path / "last.pt")
    assert checkpoint.resolve_resume("auto", tmp_path) == tmp_path / "last.pt"
    assert checkpoint.resolve_resume(str(tmp_path / "last.pt"), "elsewhere") == tmp_path / "last.pt"
    with pytest.raises(CheckpointError, match="checkpoint.resume=nope.pt: file not found"):
        checkpoint.resolve_resume("nope.pt", tmp_path)


def test_rng_state_round_trip():
    saved = checkpoint.rng_state()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_state(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_versions_recorded():
    versions = checkpoint.library_versions()
    assert versions["torch"] == torch.__version__ and "audioclf" in versions
