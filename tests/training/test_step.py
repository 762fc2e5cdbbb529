"""The training step (audioclf.training.step): accumulation, exact loss, non-finite steps, host syncs,
dropped batches; and the train loader's position and limit."""

import math

import pytest
import torch
from torch import nn

from audioclf.config import OptimConfig, TrainConfig
from audioclf.precision import resolve_precision
from audioclf.training.optim import build_optimizer
from audioclf.training.step import NonFiniteGuard, NonFiniteLossError, TrainStep
from tests.helpers import Linear, count_host_syncs, mse, random_batches, run_epoch

CPU = torch.device("cpu")


def test_accumulation_matches_one_update_on_the_union():
    k, size = 4, 8
    micro = random_batches(k, size)
    union = [
        (
            torch.cat([b[0] for b in micro]),
            torch.cat([b[1] for b in micro]),
            torch.cat([b[2] for b in micro]),
            torch.cat([b[3] for b in micro]),
        )
    ]
    results = []
    for loader, accumulate in ((micro, k), (union, 1)):
        model = Linear()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        precision = resolve_precision(TrainConfig(), CPU)
        r, steps = run_epoch(model, loader, mse, opt, precision, accumulate=accumulate)
        assert steps == 1
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_exact_mean_loss_and_sample_count():
    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = random_batches(3, 5)
    r, _ = run_epoch(model, loader, mse, opt, resolve_precision(TrainConfig(), CPU))
    expected = sum(mse(model(x, lengths), y).item() * len(y) for x, lengths, y, _ in loader) / 15
    assert r.samples == 15 and r.loss == pytest.approx(expected)


def test_nonfinite_steps_are_skipped_and_counted():
    model = Linear()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bad = random_batches(2, 4)
    bad = [(torch.full_like(x, float("nan")), n, y, p) for x, n, y, p in bad]
    guard = NonFiniteGuard(patience=5)
    r, steps = run_epoch(model, bad, mse, opt, resolve_precision(TrainConfig(), CPU), guard=guard)
    assert guard.total == 2 and steps == 2 and math.isnan(r.loss)
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)  # skipped: parameters untouched, not NaN
    with pytest.raises(NonFiniteLossError, match="3 consecutive steps.*nonfinite_patience"):
        run_epoch(
            model,
            bad + bad,
            mse,
            opt,
            resolve_precision(TrainConfig(), CPU),
            guard=NonFiniteGuard(patience=3),
        )


def test_the_stop_vote_and_the_guard_are_one_sync():
    model = Linear()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        resolve_precision(TrainConfig(), CPU),
        mse,
        guard=NonFiniteGuard(5),
    )
    step.start_epoch()
    step.micro_batch(random_batches(1, 4)[0])
    step.update()
    assert step.sync(False, 1)[0] is False
    halt, loss = step.sync(True, 1)
    assert halt is True and loss > 0
    with pytest.raises(RuntimeError, match="needs a micro_batch"):
        step.update()


class _Sampler:
    """A stand-in batch sampler with MPerClassSampler's epoch / length / state protocol."""

    def __init__(self, batches=6):
        self.batches, self.epoch, self.start = batches, 0, 0

    def set_epoch(self, epoch):
        if epoch != self.epoch:
            self.epoch, self.start = epoch, 0

    batches_per_epoch = property(lambda self: self.batches)

    def __len__(self):
        return self.batches - self.start

    def __iter__(self):
        start, self.start = self.start, 0
        return iter([[2 * b, 2 * b + 1] for b in range(start, self.batches)])

    def state_dict(self, position=0):
        return {"epoch": self.epoch, "position": position}

    def load_state_dict(self, state):
        self.epoch, self.start = state["epoch"], state["position"]


def _loader(**kwargs):
    from audioclf.data.loader import TrainLoader

    class Positions(torch.utils.data.Dataset):  # an item holds its position (keys: position, seed)
        def __len__(self):
            return 12

        def __getitem__(self, key):
            return torch.full((1,), float(key[0])), 0, key[0]

    loader = TrainLoader(Positions(), _Sampler(), seed=0, **kwargs)
    return _Positions(loader)


class _Positions:
    """A train loader whose batches are read as their lists of positions."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return (batch.positions.tolist() for batch in self.loader)


def test_the_train_loader_counts_what_it_hands_out_and_resumes_there():
    loader = _loader()
    taken = []
    for batch in loader:
        taken.append(batch)
        if len(taken) == 2:
            break
    assert loader.position == 2 and loader.state_dict() == {"epoch": 0, "position": 2}
    resumed = _loader()
    resumed.load_state_dict(loader.state_dict())
    resumed.set_epoch(0)  # the same epoch: the position stays
    assert len(resumed) == 4 and list(resumed)[0] == [4, 5] and resumed.position == 6
    restarted = _loader(restart_epoch=True)
    restarted.load_state_dict(loader.state_dict())
    assert restarted.position == 0 and len(restarted) == 6
    resumed.set_epoch(1)
    assert resumed.position == 0


def test_the_train_loader_limits_batches_and_groups_micro_batches():
    limited = _loader(limit_batches=3)
    assert len(limited) == 3 and len(list(limited)) == 3 and limited.position == 3
    groups = [last for _, last in _loader().micro_batches(4)]
    assert groups == [False, False, False, True, False, False]  # the trailing 2 close no group


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bn = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, lengths, labels=None):
        return self.fc(self.bn(x))


def _state_of(model, optimizer, scaler):
    """Everything a training step may change, as plain tensors."""
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for per_param in optimizer.state.values():
        tensors += [v.detach().clone() for v in per_param.values() if torch.is_tensor(v)]
    if scaler.is_enabled():
        tensors += [scaler._scale.clone(), scaler._growth_tracker.clone()]
    return tensors


def infinite_mse(output, labels, positions=None):
    return mse(output, labels) + math.inf  # an infinite loss with finite gradients


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("bad", ["nan input", "inf loss"])
def test_a_nonfinite_step_changes_no_state(precision, bad):
    model = WithBatchNorm()
    optimizer = build_optimizer(model.parameters(), OptimConfig(name="adamw"), CPU)
    settings = resolve_precision(TrainConfig(precision=precision), CPU)
    good = random_batches(2, 8)
    run_epoch(model, good, mse, optimizer, settings)  # optimizer state and scale exist
    before = _state_of(model, optimizer, settings.scaler)
    x, lengths, labels, positions = random_batches(1, 8, seed=5)[0]
    if bad == "nan input":
        x[3, 1] = float("nan")  # one NaN sample, as a corrupt file would give
    objective = infinite_mse if bad == "inf loss" else mse
    guard = NonFiniteGuard(patience=5)
    result, steps = run_epoch(
        model, [(x, lengths, labels, positions)], objective, optimizer, settings, guard=guard
    )
    assert steps == 1 and guard.total == 1 and guard.consecutive == 1
    after = _state_of(model, optimizer, settings.scaler)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert torch.equal(a, b)  # parameters, BatchNorm statistics, Adam moments, loss scale


def test_fp16_overflow_steps_are_not_failures():
    model = Linear()
    optimizer = build_optimizer(model.parameters(), OptimConfig(name="adamw"), CPU)
    settings = resolve_precision(TrainConfig(precision="fp16"), CPU)
    settings.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # overflows at first
    guard = NonFiniteGuard(patience=1)
    result, steps = run_epoch(
        model, random_batches(6, 8), mse, optimizer, settings, guard=guard, sync_every=2
    )
    assert guard.overflow >= 1 and guard.total == 0 and steps == 6
    assert settings.scaler.get_scale() < 2.0**127  # GradScaler lowered the scale as designed


def sync_free_mse(output, labels, positions=None):
    return nn.functional.mse_loss(output.float(), torch.eye(3)[labels])  # one_hot reads .max()


def test_the_loop_reads_the_device_once_per_sync_interval():
    model = Linear()
    optimizer = build_optimizer(model.parameters(), OptimConfig(name="adamw"), CPU)
    settings = resolve_precision(TrainConfig(), CPU)
    loader = random_batches(40, 4)
    run_epoch(model, loader[:2], mse, optimizer, settings)  # warm-up
    syncs = count_host_syncs(
        lambda: run_epoch(
            model,
            loader,
            sync_free_mse,
            optimizer,
            settings,
            sync_every=10,
            should_stop=lambda: False,
        )
    )
    # 40 steps, a sync every 10, plus the epoch's all-reduced totals (and no per-step reads)
    assert syncs <= 40 // 10 + 1, syncs


def test_a_batch_with_no_readable_item_is_dropped_and_counted():
    model = WithBatchNorm()
    optimizer = build_optimizer(model.parameters(), OptimConfig(name="adamw"), CPU)
    empty = (
        torch.zeros(0, 4),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
    )
    loader = random_batches(2, 8)
    short = tuple(t[:5] for t in random_batches(1, 8, seed=3)[0])
    running = model.bn.running_mean.clone()
    placeholder = (torch.zeros(2, 4), torch.tensor([4, 4]))
    result, _ = run_epoch(
        model,
        [empty],
        mse,
        optimizer,
        resolve_precision(TrainConfig(), CPU),
        batch_size=8,
        placeholder=placeholder,
    )
    assert torch.equal(model.bn.running_mean, running)  # the placeholder taught BatchNorm nothing
    assert (result.skipped_batches, result.skipped_items, result.samples) == (1, 8, 0)
    result, _ = run_epoch(
        model,
        [loader[0], short, loader[1]],
        mse,
        optimizer,
        resolve_precision(TrainConfig(), CPU),
        batch_size=8,
        placeholder=placeholder,
    )
    assert (result.skipped_batches, result.skipped_items, result.samples) == (0, 3, 21)


def test_the_ema_update_reads_nothing_from_the_device():
    from audioclf.training.averaging import WeightEMA

    model = WithBatchNorm()
    ema = WeightEMA(model, decay=0.99)
    model(torch.randn(8, 4), None)  # BatchNorm statistics and the batch count move
    assert count_host_syncs(lambda: [ema.update() for _ in range(10)]) == 0
    assert torch.equal(ema.state_dict()["bn.num_batches_tracked"], torch.tensor(1))


def test_the_guard_keeps_its_counts_on_a_device_named_with_its_index():
    # A device given as "cuda" (or "cpu:0") is the one its tensors report as "cuda:0" ("cpu"):
    # the counts recorded between two syncs were dropped when the names differed.
    x, lengths, labels, positions = random_batches(1, 8)[0]
    x[0, 0] = float("nan")
    model = Linear()
    optimizer = build_optimizer(model.parameters(), OptimConfig(name="adamw"), CPU)
    guard = NonFiniteGuard(patience=10)
    indexed = resolve_precision(TrainConfig(), torch.device("cpu", 0))
    bad = [(x, lengths, labels, positions)] * 2
    run_epoch(model, bad, mse, optimizer, indexed, guard=guard, sync_every=2)
    assert guard.total == 2 and guard.consecutive == 2
