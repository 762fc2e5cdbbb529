"""distributed.py in real 2-process gloo groups: drift detection, no_sync, primary_first."""

import math

import pytest
import torch
from torch import nn

from audioclf import distributed
from tests.helpers import TINY_FEATURES, TINY_MODELS, run_in_group


def _ddp_mlp(rank, world):
    torch.manual_seed(0)
    env = distributed.DistEnv(rank=rank, world_size=world, strategy="ddp", backend="gloo")
    return distributed.wrap(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
        env,
        sync_bn=True,
        find_unused_parameters=False,
    )


def _sgd_step(model, forward, rank):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)  # different data on each rank
    loss = nn.functional.mse_loss(forward(torch.randn(16, 4)), torch.randn(16, 2))
    loss.backward()
    opt.step()


def _consistency_worker(rank, world):
    model = _ddp_mlp(rank, world)
    _sgd_step(model, model, rank)  # through DDP: gradients all-reduced
    through_ddp = distributed.check_parameter_consistency(model, action="error")
    _sgd_step(model, distributed.unwrap(model), rank)  # the classic bug: bypasses DDP
    warned = distributed.check_parameter_consistency(model, action="warn")
    try:
        distributed.check_parameter_consistency(model, action="error")
        raised = None
    except distributed.ParameterDriftError as exc:
        raised = str(exc)
    return through_ddp, warned, raised


@pytest.mark.slow
def test_consistency_check_passes_ddp_and_catches_unwrapped_update(tmp_path):
    for through_ddp, warned, raised in run_in_group(_consistency_worker, tmp_path):
        assert through_ddp is None
        assert "4 of 4 tensors drifted, first '0.weight'" in warned
        assert raised == warned and "never through model.module" in raised


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, lengths, labels=None):
        return self.fc(x)


def _accumulation_worker(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from audioclf.config import TrainConfig
    from audioclf.precision import resolve_precision
    from tests.helpers import run_epoch

    out = {}
    for accumulate in (1, 2, 4):
        torch.manual_seed(0)
        env = distributed.DistEnv(rank=rank, world_size=world, strategy="ddp", backend="gloo")
        model = distributed.wrap(_Net(), env, sync_bn=False, find_unused_parameters=False)
        calls = []

        def counting_hook(state, bucket, calls=calls):
            calls.append(1)
            return allreduce_hook(None, bucket)

        model.register_comm_hook(None, counting_hook)
        torch.manual_seed(rank)
        loader = [
            (torch.randn(8, 4), torch.full((8,), 4), torch.randint(0, 2, (8,)), torch.arange(8))
            for _ in range(4)
        ]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _, steps = run_epoch(
            model,
            loader,
            lambda output, labels, positions: nn.functional.cross_entropy(output, labels),
            opt,
            resolve_precision(TrainConfig(), torch.device("cpu")),
            accumulate=accumulate,
        )
        drift = distributed.check_parameter_consistency(model, action="warn")
        out[accumulate] = (len(calls), steps, drift)
    return out


@pytest.mark.slow
def test_accumulation_all_reduces_once_per_update(tmp_path):
    for per_rank in run_in_group(_accumulation_worker, tmp_path):
        for accumulate, (buckets, steps, drift) in per_rank.items():
            assert steps == 4 // accumulate
            assert buckets == steps  # one bucket (tiny model): one all-reduce per update
            assert drift is None


def _collectives_worker(rank, world):
    order = []

    def build(fail):
        order.append(rank)
        if fail:
            raise ValueError("sheet.xlsx row 7: empty a_cls")
        return f"built by {rank}"

    ok = distributed.primary_first(build, False)
    try:
        distributed.primary_first(build, True)
        failed = None
    except Exception as exc:
        failed = f"{type(exc).__name__}: {exc}"
    total = distributed.all_reduce_sum([rank + 1.0, 10.0]).tolist()
    stop = bool(distributed.all_reduce_max(torch.tensor([float(rank == 1)])).item() > 0)
    gathered = distributed.gather_objects({"rank": rank})
    return ok, failed, order, total, stop, gathered


@pytest.mark.slow
def test_primary_first_and_reductions(tmp_path):
    r0, r1 = run_in_group(_collectives_worker, tmp_path, timeout=60)
    assert r0[0] == "built by 0" and r1[0] == "built by 1"
    # rank 0's failure reaches rank 1 at once (no barrier wait), and rank 1 never ran build
    assert r0[1] == "ValueError: sheet.xlsx row 7: empty a_cls"
    assert r1[1] == "RuntimeError: rank 0 failed: ValueError: sheet.xlsx row 7: empty a_cls"
    assert r0[2] == [0, 0] and r1[2] == [1]
    for _, _, _, total, stop, gathered in (r0, r1):
        assert total == [3.0, 20.0] and stop is True
        assert gathered == [{"rank": 0}, {"rank": 1}]


def _slow_primary_worker(rank, world, timeout_s):
    import datetime
    import time

    def measure():
        time.sleep(4.0)  # longer than the group's 2 s timeout
        return "measured by 0"

    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    try:
        return distributed.primary_only(measure, timeout=timeout)
    except Exception as exc:  # the broadcast timed out: reported to the test
        return f"{type(exc).__name__}: {str(exc)[:80]}"


@pytest.mark.slow
def test_primary_only_waits_for_rank_0_as_long_as_it_is_told(tmp_path):
    # AdaBN under torchrun: rank 0 measures a large source for longer than the group's timeout
    # while the others wait in the broadcast; they wait for its timeout, not the group's.
    results = run_in_group(_slow_primary_worker, tmp_path, 30.0, group_timeout_s=2.0)
    assert results == ["measured by 0", "measured by 0"]
    (tmp_path / "hurried").mkdir()
    hurried = run_in_group(_slow_primary_worker, tmp_path / "hurried", None, group_timeout_s=2.0)
    assert hurried[1] != "measured by 0", hurried  # the group's timeout alone: rank 1 gives up


def _global_loss_worker(rank, world):
    from audioclf.config import TrainConfig
    from audioclf.precision import resolve_precision
    from tests.helpers import run_epoch

    torch.manual_seed(0)
    env = distributed.DistEnv(rank=rank, world_size=world, strategy="ddp", backend="gloo")
    model = distributed.wrap(_Net(), env, sync_bn=False, find_unused_parameters=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # frozen: per-sample losses are fixed
    torch.manual_seed(10 + rank)
    size = 3 if rank == 0 else 9  # unequal: a mean of rank means would be wrong
    loader = [
        (
            torch.randn(size, 4),
            torch.full((size,), 4),
            torch.randint(0, 2, (size,)),
            torch.arange(size),
        )
        for _ in range(2)
    ]

    def loss_fn(out, labels, positions=None):
        return nn.functional.cross_entropy(out, labels)

    result, _ = run_epoch(
        model, loader, loss_fn, opt, resolve_precision(TrainConfig(), torch.device("cpu"))
    )
    with torch.no_grad():
        per_sample = torch.cat(
            [nn.functional.cross_entropy(model(x, n), y, reduction="none") for x, n, y, _ in loader]
        )
    return result.loss, result.samples, per_sample.tolist()


@pytest.mark.slow
def test_epoch_loss_is_the_exact_global_mean(tmp_path):
    (loss0, n0, s0), (loss1, n1, s1) = run_in_group(_global_loss_worker, tmp_path)
    everything = torch.tensor(s0 + s1, dtype=torch.float64)
    assert n0 == n1 == 24
    assert abs(loss0 - everything.mean().item()) < 1e-6 and loss0 == loss1


def test_checkpoints_load_across_syncbn_and_batchnorm():
    from audioclf.config import load_config
    from audioclf.models import build_net

    cfg = load_config(
        None,
        [
            "model.name=conformer",
            "model.conformer.d_model=32",
            "model.conformer.num_heads=2",
            "model.conformer.num_layers=1",
        ],
    )
    plain = build_net(cfg, 0)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(build_net(cfg, 0))
    assert any(isinstance(m, nn.SyncBatchNorm) for m in synced.modules())
    plain.load_state_dict(synced.state_dict())  # GPU-trained (SyncBN) → CPU evaluation
    synced.load_state_dict(plain.state_dict())  # and back, e.g. resuming on a GPU box
    for (name, a), (_, b) in zip(plain.state_dict().items(), synced.state_dict().items()):
        assert torch.equal(a, b), name


def test_data_parallel_replicas_keep_the_autocast_dtype():
    # DataParallel runs each replica in a worker thread that re-enters autocast without the
    # dtype; AutocastReplica sets it again. A thread without autocast stands in for that.
    import threading

    dtypes = []
    inner = nn.Linear(4, 4)
    replica = distributed.AutocastReplica(inner, torch.bfloat16)
    thread = threading.Thread(target=lambda: dtypes.append(replica(torch.randn(2, 4)).dtype))
    thread.start()
    thread.join()
    assert dtypes == [torch.bfloat16]
    assert distributed.unwrap(nn.DataParallel(replica)) is inner


def test_dp_warns_that_sync_bn_has_no_effect(caplog):
    env = distributed.DistEnv(strategy="dp")
    with caplog.at_level("WARNING", logger="audioclf"):
        model = distributed.wrap(
            nn.Linear(2, 2),
            env,
            sync_bn=True,
            find_unused_parameters=False,
            autocast_dtype=torch.bfloat16,
        )
    assert "sync_bn has no effect with dist.strategy=dp" in caplog.text
    assert isinstance(model.module, distributed.AutocastReplica)


def _gather_worker(rank, world):
    return distributed.gather_to_primary({"rank": rank, "rows": list(range(rank + 1))})


@pytest.mark.slow
def test_gather_to_primary_reaches_rank_0_only(tmp_path):
    r0, r1 = run_in_group(_gather_worker, tmp_path, timeout=60)
    assert r0 == [{"rank": 0, "rows": [0]}, {"rank": 1, "rows": [0, 1]}]
    assert r1 is None


def test_cpu_ranks_are_pinned_to_their_own_share_of_the_cores(monkeypatch):
    import os

    from audioclf.distributed.group import pin_to_cores

    pinned = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.append(list(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert [pin_to_cores(rank) for rank in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pinned == [[0, 1], [2, 3], [4, 5], [6, 7]]
    monkeypatch.setattr(os, "cpu_count", lambda: 16)  # a launcher bound us already: keep it
    assert pin_to_cores(0) is None
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # more ranks than cores: leave it to the OS
    assert pin_to_cores(0) is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # not launched by torchrun
    assert pin_to_cores(0) is None and len(pinned) == 4


def _nonfinite_on_one_rank_worker(rank, world, precision, kind):
    from audioclf.config import OptimConfig, TrainConfig
    from audioclf.precision import resolve_precision
    from audioclf.training.optim import build_optimizer
    from audioclf.training.step import NonFiniteGuard
    from tests.helpers import Linear, mse, random_batches, run_epoch

    cpu = torch.device("cpu")
    env = distributed.DistEnv(rank=rank, world_size=world, strategy="ddp", backend="gloo")
    model = distributed.wrap(Linear(), env, sync_bn=False, find_unused_parameters=False)
    optimizer = build_optimizer(model.parameters(), OptimConfig(name="adamw"), cpu)
    settings = resolve_precision(TrainConfig(precision=precision), cpu)
    calls = []

    def objective(output, labels, positions=None):
        calls.append(1)
        loss = mse(output, labels)
        if rank == 1 and len(calls) == 2:  # this rank alone, at the second step
            # nan: NaN gradients on every rank after the all-reduce (in fp16 they look like a
            # routine overflow to rank 0); inf: an infinite loss with finite gradients
            return loss * math.nan if kind == "nan" else loss + math.inf
        return loss

    guard = NonFiniteGuard(patience=5)
    run_epoch(model, random_batches(4, 8, seed=rank), objective, optimizer, settings, guard=guard)
    scale = settings.scaler.get_scale() if settings.scaler.is_enabled() else None
    return [p.detach().clone() for p in model.parameters()], scale, guard.total, guard.overflow


@pytest.mark.slow
@pytest.mark.parametrize("precision, kind", [("fp16", "nan"), ("fp16", "inf"), ("fp32", "inf")])
def test_a_nonfinite_loss_on_one_rank_is_skipped_alike_on_every_rank(tmp_path, precision, kind):
    # fp16 autocast and GradScaler on the CPU: the ranks keep one loss scale and one set of
    # weights, and the step counts as bad (not as an fp16 overflow) on both.
    (params0, scale0, bad0, over0), (params1, scale1, bad1, over1) = run_in_group(
        _nonfinite_on_one_rank_worker, tmp_path, precision, kind
    )
    assert scale0 == scale1
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
    assert (bad0, over0) == (bad1, over1) == (1, 0)


def test_sync_bn_on_cuda_without_nccl_is_one_clear_error():
    env = distributed.DistEnv(
        world_size=2, device=torch.device("cuda", 0), strategy="ddp", backend="gloo"
    )
    with pytest.raises(ValueError, match="model.sync_bn=true on CUDA needs dist.backend=nccl"):
        distributed.wrap(nn.Linear(2, 2), env, sync_bn=True, find_unused_parameters=False)


@pytest.mark.slow  # starts a process
def test_the_cpu_suite_sees_no_gpu_in_this_process_or_the_ones_it_starts():
    # On a GPU machine the CPU tests must stay on the CPU (tests/conftest.py), or the 2-rank
    # tests ask a one-GPU box for cuda:1. Meaningful there; it holds trivially here.
    import subprocess
    import sys

    from audioclf.inference import resolve_device
    from tests.helpers import child_env

    probe = "import torch; print(torch.cuda.device_count(), torch.cuda.is_available())"
    seen = subprocess.run(
        [sys.executable, "-c", probe], env=child_env(), capture_output=True, text=True, check=True
    )
    assert seen.stdout.split() == ["0", "False"]
    assert resolve_device("auto") == torch.device("cpu")


def test_ddp_at_world_size_1_under_a_launcher_keeps_its_process_group(monkeypatch):
    # torchrun --nproc_per_node 1 with dist.strategy=ddp: a group of one (gloo here, NCCL on a
    # one-GPU box, where gpu_check trains so); plain python with the same setting runs single.
    from tests.helpers import free_port

    assert distributed.setup(strategy="ddp", device="cpu").strategy == "single"
    launched = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    for key, value in {**launched, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    try:
        env = distributed.setup(strategy="ddp", device="cpu")
        assert (env.strategy, env.backend, env.world_size) == ("ddp", "gloo", 1)
        assert distributed.is_initialized() and not env.distributed
        model = distributed.wrap(nn.Linear(2, 2), env, sync_bn=False, find_unused_parameters=False)
        assert isinstance(model, nn.parallel.DistributedDataParallel)
    finally:
        distributed.teardown()


def _domain_generalisation_worker(rank, world, early_norm):
    """Two training steps of a tiny CNN with an early norm, MixStyle and Freq-MixStyle through
    DDP, on other data per rank; then the parameter drift check (None: none)."""
    from audioclf.config import config_from_dict
    from audioclf.models import build_net

    cfg = config_from_dict(
        {
            "features": TINY_FEATURES,
            "model": {**TINY_MODELS["cnn"], "head": "none", "early_norm": early_norm},
            "spec_augment": {"enabled": False},
            "augment": {"freq_mixstyle": 1.0, "mixstyle": 1.0},
        }
    )
    torch.manual_seed(0)
    env = distributed.DistEnv(rank=rank, world_size=world, strategy="ddp", backend="gloo")
    model = distributed.wrap(build_net(cfg, 0), env, sync_bn=False, find_unused_parameters=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(10 + rank)  # other data and other style draws on each rank
    for _ in range(2):
        x, labels = 0.1 * torch.randn(6, 4000), torch.tensor([0, 0, 1, 1, 2, 2])
        embeddings, _ = model(x, torch.full((6,), 4000), labels)
        embeddings.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return distributed.check_parameter_consistency(model, action="warn")


@pytest.mark.slow
@pytest.mark.parametrize("early_norm", ["subspectral", "rfn"])
def test_early_norms_and_mixstyle_train_alike_on_every_rank(tmp_path, early_norm):
    # every parameter moved through DDP alike (no unused one, no drift); BatchNorm statistics
    # are rank 0's at each forward's start, as with plain BatchNorm
    assert run_in_group(_domain_generalisation_worker, tmp_path, early_norm) == [None, None]
