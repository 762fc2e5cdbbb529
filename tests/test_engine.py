"""Engine, precision, optimizer and LR: scaling, schedule, accumulation, non-finite handling."""

import math

import pytest
import torch
from torch import nn

from audioclf.config import OptimConfig, TrainConfig
from audioclf.engine import NonFiniteGuard, NonFiniteLossError, train_one_epoch
from audioclf.optim import LRSchedule, build_optimizer, learning_rate, lr_scale
from audioclf.precision import resolve_precision

CPU = torch.device("cpu")


class Linear(nn.Module):
    """Takes (x, lengths) like the real nets; no BatchNorm so accumulation is exact."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, lengths):
        return self.fc(x)


def mse(output, labels):
    target = nn.functional.one_hot(labels, 3).float()
    return nn.functional.mse_loss(output.float(), target)


def batches(n_batches, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        x = torch.randn(size, 4, generator=g)
        labels = torch.randint(0, 3, (size,), generator=g)
        out.append((x, torch.full((size,), 4), labels, torch.arange(size)))
    return out


@pytest.mark.parametrize("world, ref, mode, expected", [
    (4, 1, "sqrt", 2.0), (2, 1, "sqrt", math.sqrt(2)), (8, 2, "sqrt", 2.0),
    (4, 1, "linear", 4.0), (2, 4, "linear", 0.5), (4, 1, "none", 1.0), (1, 1, "sqrt", 1.0),
])
def test_lr_scaling(world, ref, mode, expected):
    assert lr_scale(world, ref, mode) == pytest.approx(expected)


@pytest.mark.parametrize("overrides, name, dtype, scaler", [
    ({}, "fp32", None, False),
    ({"precision": "bf16"}, "bf16", torch.bfloat16, False),
    ({"precision": "fp16"}, "fp16", torch.float16, True),
    ({"opt_level": "O0", "precision": "bf16"}, "fp32", None, False),
    ({"opt_level": "O1"}, "fp16", torch.float16, True),
])
def test_precision_resolution(overrides, name, dtype, scaler):
    p = resolve_precision(TrainConfig(**overrides), CPU)
    assert (p.name, p.dtype, p.scaler.is_enabled()) == (name, dtype, scaler)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_apex_o2_o3_map_to_o1_with_warning(level):
    with pytest.warns(UserWarning, match=f"opt_level={level}.*no torch.amp equivalent"):
        p = resolve_precision(TrainConfig(opt_level=level), CPU)
    assert p.name == "fp16"


def test_bf16_autocast_context_is_active():
    p = resolve_precision(TrainConfig(precision="bf16"), CPU)
    with p.autocast():
        y = nn.Linear(4, 4)(torch.randn(2, 4))
    assert y.dtype == torch.bfloat16


def test_fused_adam_without_apex_is_a_clear_error():
    with pytest.raises(ValueError, match="needs NVIDIA apex.*use optim.name=adamw"):
        build_optimizer(nn.Linear(2, 2).parameters(), OptimConfig(name="fused_adam"), CPU)


def test_warmup_then_cosine():
    cfg = OptimConfig(warmup_steps=4, scheduler="cosine")
    lrs = [learning_rate(cfg, 1.0, 4, step=step, epoch=0) for step in range(6)]
    assert lrs[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    sched = LRSchedule(opt, cfg, base=1.0, epochs=4)
    sched.epoch_end(1.0)
    sched.apply(step=5, epoch=1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    state = sched.state_dict()
    opt2 = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    sched2 = LRSchedule(opt2, cfg, 1.0, 4)
    sched2.load_state_dict(state)
    sched2.apply(step=5, epoch=1)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_step_and_plateau_schedules():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    step = LRSchedule(opt, OptimConfig(scheduler="step", step_size=2, gamma=0.1), 1.0, 10)
    step.apply(step=0, epoch=2)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    plateau = LRSchedule(opt, OptimConfig(scheduler="plateau", plateau_patience=1, gamma=0.5), 1.0, 10)
    for loss in [1.0, 0.9, 0.95, 0.95]:  # best 0.9, then two bad epochs > patience 1
        plateau.epoch_end(loss)
    plateau.apply(step=0, epoch=4)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


def test_accumulation_matches_one_update_on_the_union():
    k, size = 4, 8
    micro = batches(k, size)
    union = [(torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro]),
              torch.cat([b[2] for b in micro]), torch.cat([b[3] for b in micro]))]
    results = []
    for loader, accumulate in ((micro, k), (union, 1)):
        model = Linear()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        precision = resolve_precision(TrainConfig(), CPU)
        r = train_one_epoch(model, loader, mse, opt, precision, accumulate=accumulate)
        assert r.steps == 1
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_exact_mean_loss_and_sample_count():
    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = batches(3, 5)
    r = train_one_epoch(model, loader, mse, opt, resolve_precision(TrainConfig(), CPU))
    expected = sum(mse(model(x, lengths), y).item() * len(y) for x, lengths, y, _ in loader) / 15
    assert r.samples == 15 and r.loss == pytest.approx(expected)


def test_nonfinite_steps_are_skipped_and_counted():
    model = Linear()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bad = batches(2, 4)
    bad = [(torch.full_like(x, float("nan")), n, y, p) for x, n, y, p in bad]
    guard = NonFiniteGuard(patience=5)
    r = train_one_epoch(model, bad, mse, opt, resolve_precision(TrainConfig(), CPU), guard=guard)
    assert guard.total == 2 and r.steps == 2 and math.isnan(r.loss)
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)  # skipped: parameters untouched, not NaN
    with pytest.raises(NonFiniteLossError, match="3 consecutive steps.*nonfinite_patience"):
        train_one_epoch(model, bad + bad, mse, opt, resolve_precision(TrainConfig(), CPU),
                        guard=NonFiniteGuard(patience=3))


def test_on_step_can_stop_and_limit_batches():
    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    r = train_one_epoch(model, batches(6, 4), mse, opt, resolve_precision(TrainConfig(), CPU),
                        on_step=lambda step, pos: seen.append((step, pos)) or step == 2)
    assert r.stopped and seen == [(1, 1), (2, 2)]
    r = train_one_epoch(model, batches(6, 4), mse, opt, resolve_precision(TrainConfig(), CPU),
                        limit_batches=3)
    assert r.batches == 3 and r.steps == 3
