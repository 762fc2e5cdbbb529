"""Averaged weights without training: the EMA's arithmetic and checkpoint entry, checkpoint
averaging, avg.pt against best.pt, and which weights the artefacts load."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from audioclf import checkpoint
from audioclf.checkpoint import Checkpointer, CheckpointError, CheckpointSaver
from audioclf.config import config_from_dict
from audioclf.inference import describe_checkpoint, init_weights, load_trained
from audioclf.models import build_net
from audioclf.training.averaging import WeightEMA, average_checkpoints, average_state_dicts
from tests.helpers import make_checkpoint


class WithBatchNorm(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.fc(x))


def _trained_step(net: nn.Module, seed: int) -> None:
    """Change every tensor of the net's state: parameters, BN statistics, the batch count."""
    net.train()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    net(torch.randn(8, 4, generator=torch.Generator().manual_seed(seed + 1)))


def test_averaging_identical_state_dicts_is_the_identity(tmp_path):
    state = torch.load(make_checkpoint(tmp_path / "c.pt"), weights_only=True)["model"]
    averaged = average_state_dicts([state, state, state])
    assert list(averaged) == list(state)
    for key, value in state.items():
        assert averaged[key].dtype == value.dtype
        assert torch.equal(averaged[key], value), key  # bit for bit


def test_averaging_differing_state_dicts_is_the_element_wise_mean():
    states = []
    for seed in range(3):
        net = WithBatchNorm(seed)
        _trained_step(net, seed)
        states.append({k: v.clone() for k, v in net.state_dict().items()})
    states[-1]["bn.num_batches_tracked"].fill_(7)
    averaged = average_state_dicts(states)
    for key in ("fc.weight", "fc.bias", "bn.weight", "bn.running_mean", "bn.running_var"):
        expected = torch.stack([s[key].double() for s in states]).mean(0).float()
        assert torch.allclose(averaged[key], expected, atol=1e-7, rtol=0), key
        assert not torch.equal(averaged[key], states[0][key])
    assert averaged["bn.num_batches_tracked"].item() == 7  # integers: the newest file's


def test_averaging_refuses_different_models():
    with pytest.raises(ValueError, match="other keys"):
        average_state_dicts([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    with pytest.raises(ValueError, match="at least one"):
        average_state_dicts([])


def test_average_checkpoints_reads_model_or_ema_weights(tmp_path):
    paths = []
    for epoch in (1, 2):
        net = WithBatchNorm(epoch)
        ema = {k: v + 100 for k, v in net.state_dict().items()}
        paths.append(tmp_path / f"epoch_{epoch}.pt")
        checkpoint.save_atomic({"model": net.state_dict(), "ema": ema, "config": {}}, paths[-1])
    model = average_checkpoints(paths)
    ema = average_checkpoints(paths, "ema")
    assert torch.allclose(ema["fc.weight"], model["fc.weight"] + 100)
    checkpoint.save_atomic({"model": WithBatchNorm().state_dict(), "config": {}}, paths[0])
    with pytest.raises(CheckpointError, match="holds no 'ema' weights"):
        average_checkpoints(paths, "ema")


def test_the_ema_follows_the_definition_on_every_floating_point_tensor():
    net = WithBatchNorm()
    ema = WeightEMA(net, decay=0.75)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    assert all(not p.requires_grad for p in ema.module.parameters())
    assert not ema.module.training
    _trained_step(net, seed=3)
    ema.update()
    live = net.state_dict()
    for key, value in ema.state_dict().items():
        if value.is_floating_point():
            expected = 0.75 * start[key] + 0.25 * live[key]
            assert torch.allclose(value, expected, atol=1e-6), key
        else:
            assert torch.equal(value, live[key]), key  # num_batches_tracked: copied
    assert not torch.equal(ema.state_dict()["bn.running_mean"], start["bn.running_mean"])


def test_the_ema_decay_warms_up_with_the_step():
    ema = WeightEMA(WithBatchNorm(), decay=0.999)
    assert ema.decay_at(None) == 0.999
    assert ema.decay_at(1) == pytest.approx(2 / 11) and ema.decay_at(90) == pytest.approx(0.91)
    assert ema.decay_at(10**6) == 0.999  # the configured decay once warmed up


def test_the_ema_checkpoint_entry_round_trips_and_restarts_without_one():
    net = WithBatchNorm()
    ema = WeightEMA(net, decay=0.5)
    _trained_step(net, seed=1)
    ema.update()
    saved = {k: v.clone() for k, v in ema.state_dict().items()}
    other = WeightEMA(net, decay=0.5)
    other.load_state_dict(saved)
    for key, value in other.state_dict().items():
        assert torch.equal(value, saved[key])
    other.load_state_dict(None)  # a checkpoint of a run without an EMA: start from the net
    for key, value in other.state_dict().items():
        assert torch.equal(value, net.state_dict()[key])
    with pytest.raises(ValueError, match="train.ema_decay"):
        WeightEMA(net, decay=1.0)


def test_a_checkpointer_gives_an_optional_part_none_when_the_checkpoint_lacks_it(tmp_path):
    class Part:
        loaded = "nothing"

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            self.loaded = state

    ema, model = Part(), Part()
    saver = CheckpointSaver(tmp_path, keep_last=0)
    ckpt = Checkpointer(
        saver, states={"model": model, "ema": ema}, flat=[], meta=dict, primary=True
    )
    with pytest.raises(KeyError):
        ckpt.restore({"model": {"w": 1}})
    optional = Checkpointer(
        saver,
        states={"model": model, "ema": ema},
        flat=[],
        meta=dict,
        primary=True,
        optional=("ema",),
    )
    optional.restore({"model": {"w": 1}})
    assert model.loaded == {"w": 1} and ema.loaded is None


def _run_state(value: float, ema: bool = True) -> dict:
    state = {"model": {"w": torch.tensor([value])}, "config": {}, "epoch": int(value)}
    return {**state, "ema": {"w": torch.tensor([value + 0.5])}} if ema else state


class _Fixed:
    """A Checkpointer part whose state is a given dict (the run's state at the end)."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def _checkpointer(tmp_path, saver: CheckpointSaver, state: dict) -> Checkpointer:
    return Checkpointer(saver, states={}, flat=[_Fixed(state), saver], meta=dict, primary=True)


@pytest.mark.parametrize("avg_metric, avg_wins", [(0.9, True), (0.3, False), (None, False)])
def test_best_pt_is_avg_pt_when_the_average_beats_the_best_epoch(tmp_path, avg_metric, avg_wins):
    saver = CheckpointSaver(tmp_path, keep_last=0, average_last=2)
    for epoch, metric in enumerate([0.5, 0.7, 0.6], start=1):
        saver.save_epoch(_run_state(epoch), epoch, metric)
    assert sorted(p.name for p in tmp_path.glob("epoch_*.pt")) == ["epoch_0002.pt", "epoch_0003.pt"]
    end = dict(_run_state(3), averaged={"epochs": [2, 3]})
    written = _checkpointer(tmp_path, saver, end).save_average(
        {"w": torch.tensor([2.5])}, avg_metric, {"epochs": [2, 3], "weights": "ema"}
    )
    avg = checkpoint.load(tmp_path / checkpoint.AVG)
    assert avg["model"]["w"].item() == 2.5 and "ema" not in avg  # the average is its weights
    assert avg["average_of"] == {"epochs": [2, 3], "weights": "ema"}
    last = checkpoint.load(tmp_path / checkpoint.LAST)
    assert last["averaged"] == {"epochs": [2, 3]} and last["ema"]["w"].item() == 3.5
    best = checkpoint.load(tmp_path / checkpoint.BEST)
    assert ((tmp_path / checkpoint.BEST) in written) == avg_wins
    if avg_wins:
        assert best["model"]["w"].item() == 2.5 and saver.best_metric == avg_metric
        assert best["best_metric"] == avg_metric
    else:
        assert best["epoch"] == 2 and saver.best_metric == 0.7


def _config(tmp_path, ema_decay: float):
    path = make_checkpoint(tmp_path / f"run_{ema_decay}.pt", classes=("a", "b"))
    ckpt = torch.load(path, weights_only=True)
    ckpt["config"]["train"]["ema_decay"] = ema_decay
    ckpt["ema"] = {k: v + 1 if v.is_floating_point() else v for k, v in ckpt["model"].items()}
    torch.save(ckpt, path)
    return path, ckpt


@pytest.mark.parametrize("ema_decay", [0.0, 0.99])
def test_the_artefacts_load_the_ema_weights_when_the_run_kept_them(tmp_path, ema_decay):
    path, ckpt = _config(tmp_path, ema_decay)
    wanted = ckpt["ema"] if ema_decay else ckpt["model"]
    net, cfg, loaded = load_trained(path)
    for key, value in net.state_dict().items():
        assert torch.equal(value, wanted[key]), key
    assert ("EMA weights" in describe_checkpoint(loaded, cfg)) == bool(ema_decay)
    fresh = build_net(config_from_dict(ckpt["config"]), 2)
    notes = init_weights(fresh, path, ["a", "b"])
    assert ("EMA weights" in notes[0]) == bool(ema_decay)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, wanted[key]), key
