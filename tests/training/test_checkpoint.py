"""Checkpoint files: atomic writes, last/best/keep-k, clear errors, resume resolution."""

import random
import warnings

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


def test_a_torchscript_export_is_named_as_one_without_torchs_warning(tmp_path):
    # torch.load hands a TorchScript archive to torch.jit.load with a UserWarning: a second
    # line beside the one-line error a user gets for an export without its sidecar.
    export = tmp_path / "model.pt"
    with warnings.catch_warnings():  # torch.jit's deprecation notes
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), export)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError, match=r"model\.pt is a TorchScript export, not"):
            checkpoint.load(export)
        assert checkpoint.load(checkpoint.save_atomic(state(1.0), tmp_path / "c.pt"))["model"]


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


def test_cuda_rng_is_saved_and_restored_for_the_rank_device_only(monkeypatch):
    restored = []
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda device=None: torch.tensor([7, int(device.index)])
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device=None: restored.append((state, device))
    )
    gpu1 = torch.device("cuda", 1)
    saved = checkpoint.rng_state(gpu1)
    assert torch.equal(saved["cuda"], torch.tensor([7, 1])) and "cuda" not in checkpoint.rng_state()
    checkpoint.set_rng_state(saved, gpu1)
    assert torch.equal(restored[-1][0], torch.tensor([7, 1])) and restored[-1][1] == gpu1
    # A checkpoint of an older version saved one state per visible GPU (8 here); resuming on a
    # box with fewer GPUs must not raise IndexError.
    older = dict(saved, cuda=[torch.tensor([i]) for i in range(8)])
    checkpoint.set_rng_state(older, gpu1)
    assert torch.equal(restored[-1][0], torch.tensor([1]))
    checkpoint.set_rng_state(dict(saved, cuda=[torch.tensor([0])]), gpu1)  # fewer than needed
    assert len(restored) == 2


def test_fp16_resumes_from_a_checkpoint_without_a_loss_scale():
    bf16_state = torch.amp.GradScaler("cpu", enabled=False).state_dict()
    assert bf16_state == {}
    fp16 = torch.amp.GradScaler("cpu", init_scale=1024.0)
    checkpoint.ScalerState(fp16).load_state_dict(bf16_state)  # GradScaler itself raises here
    assert fp16.get_scale() == 1024.0
    checkpoint.ScalerState(torch.amp.GradScaler("cpu", enabled=False)).load_state_dict(
        fp16.state_dict()
    )
