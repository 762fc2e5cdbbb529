"""Optimizer and learning rate: scaling, schedules, fused kernels, state from other runs."""

import math
import sys

import pytest
import torch
from torch import nn

from audioclf.config import OptimConfig, TrainConfig
from audioclf.precision import resolve_precision
from audioclf.training.optim import (
    LRSchedule,
    OptimizerState,
    build_optimizer,
    learning_rate,
    lr_scale,
)
from tests.helpers import FIXTURES, Linear, mse, run_epoch

CPU = torch.device("cpu")
STUBS = FIXTURES / "stubs"


@pytest.mark.parametrize(
    "world, ref, mode, expected",
    [
        (4, 1, "sqrt", 2.0),
        (2, 1, "sqrt", math.sqrt(2)),
        (8, 2, "sqrt", 2.0),
        (4, 1, "linear", 4.0),
        (2, 4, "linear", 0.5),
        (4, 1, "none", 1.0),
        (1, 1, "sqrt", 1.0),
    ],
)
def test_lr_scaling(world, ref, mode, expected):
    assert lr_scale(world, ref, mode) == pytest.approx(expected)


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
    plateau = LRSchedule(
        opt, OptimConfig(scheduler="plateau", plateau_patience=1, gamma=0.5), 1.0, 10
    )
    for loss in [1.0, 0.9, 0.95, 0.95]:  # best 0.9, then two bad epochs > patience 1
        plateau.epoch_end(loss)
    plateau.apply(step=0, epoch=4)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


@pytest.fixture
def apex_stub(monkeypatch):
    """tests/fixtures/stubs/apex: apex.optimizers.FusedAdam with apex's signatures (zero_grad() takes no
    argument, the step count lives in each param group)."""

    def forget_apex():
        for name in [m for m in sys.modules if m == "apex" or m.startswith("apex.")]:
            del sys.modules[name]

    monkeypatch.syspath_prepend(str(STUBS))
    forget_apex()
    yield
    forget_apex()  # later tests must not import the stand-in


def _step_batches():
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(8, 4, generator=g),
            torch.full((8,), 4),
            torch.randint(0, 3, (8,), generator=g),
            torch.arange(8),
        )
        for _ in range(3)
    ]


def test_apex_fused_adam_trains_through_the_loop(apex_stub):
    model = Linear()
    optimizer = build_optimizer(model.parameters(), OptimConfig(name="fused_adam"), CPU)
    assert type(optimizer).__module__ == "apex.optimizers"
    _, steps = run_epoch(
        model, _step_batches(), mse, optimizer, resolve_precision(TrainConfig(), CPU)
    )
    assert steps == 3 and optimizer.param_groups[0]["step"] == 3


def test_torch_optimizers_run_fused():
    for name in ("adamw", "adam", "sgd"):
        optimizer = build_optimizer(nn.Linear(2, 2).parameters(), OptimConfig(name=name), CPU)
        assert optimizer.param_groups[0]["fused"] is True, name


def test_a_cpu_written_state_keeps_the_fused_kernel_and_fp16_scaling():
    # Resuming a non-fused state on a fused optimizer: torch's load_state_dict sets fused=None,
    # and GradScaler.step (which hands fused optimizers grad_scale/found_inf) then fails with
    # "Expected grad_scale and found_inf to be None".
    plain_model = Linear()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    run_epoch(plain_model, _step_batches(), mse, plain, resolve_precision(TrainConfig(), CPU))
    model = Linear()
    fused = build_optimizer(model.parameters(), OptimConfig(name="adamw"), CPU)
    OptimizerState(fused).load_state_dict(plain.state_dict())
    assert fused.param_groups[0]["fused"] is True
    fp16 = resolve_precision(TrainConfig(precision="fp16"), CPU)
    _, steps = run_epoch(model, _step_batches(), mse, fused, fp16)
    assert steps == 3 and int(fused.state[model.fc.weight]["step"]) == 6


def test_adam_state_moves_between_apex_and_torch(apex_stub):
    apex_model = Linear()
    apex = build_optimizer(apex_model.parameters(), OptimConfig(name="fused_adam"), CPU)
    run_epoch(apex_model, _step_batches(), mse, apex, resolve_precision(TrainConfig(), CPU))
    torch_model = Linear()
    adamw = build_optimizer(torch_model.parameters(), OptimConfig(name="adamw"), CPU)
    OptimizerState(adamw).load_state_dict(apex.state_dict())  # was KeyError: 'step'
    assert int(adamw.state[torch_model.fc.weight]["step"]) == 3
    run_epoch(torch_model, _step_batches(), mse, adamw, resolve_precision(TrainConfig(), CPU))
    assert int(adamw.state[torch_model.fc.weight]["step"]) == 6
    back_model = Linear()
    back = build_optimizer(back_model.parameters(), OptimConfig(name="fused_adam"), CPU)
    OptimizerState(back).load_state_dict(adamw.state_dict())
    assert back.param_groups[0]["step"] == 6


@pytest.mark.parametrize("source", ["adamw", "apex"])
def test_a_non_fused_state_continues_in_the_fused_adamw_as_it_would_have(source, apex_stub):
    # The CPU twin of test_cuda's resume into the fused CUDA AdamW (there a non-fused state
    # handed the kernel CPU step counts; on the CPU every tensor is on one device): the steps
    # after the resume equal those of a run that never stopped, to the fused kernel's rounding.
    reference_model = Linear()
    reference = build_optimizer(reference_model.parameters(), OptimConfig(name="adamw"), CPU)
    fp32 = resolve_precision(TrainConfig(), CPU)
    run_epoch(reference_model, _step_batches() * 2, mse, reference, fp32)
    first = Linear()
    if source == "apex":
        plain = build_optimizer(first.parameters(), OptimConfig(name="fused_adam"), CPU)
    else:
        cfg = OptimConfig(name="adamw")
        plain = torch.optim.AdamW(first.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    run_epoch(first, _step_batches(), mse, plain, fp32)
    model = Linear()
    model.load_state_dict(first.state_dict())
    fused = build_optimizer(model.parameters(), OptimConfig(name="adamw"), CPU)
    OptimizerState(fused).load_state_dict(plain.state_dict())
    step = fused.state[model.fc.weight]["step"]
    assert step.dtype == torch.float32 and step.device == model.fc.weight.device
    assert fused.param_groups[0]["fused"] is True
    run_epoch(model, _step_batches(), mse, fused, fp32)
    for a, b in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
