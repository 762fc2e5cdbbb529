"""CUDA-only checks (marker `cuda`; skipped on machines without a GPU).

Run them with `pytest -m cuda` (benchmarks/gpu_check.sh runs this file's and
tests/search/test_search.py's). They cover what the CPU suite
cannot: bf16/fp16 steps on the GPU, NCCL collectives, SyncBN under DDP, a GPU checkpoint
resumed on the CPU and exported, and DataParallel under bf16 autocast.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from audioclf import distributed
from tests.helpers import mixed_precision_steps, run_in_group, tiny_net_config, train_resume_export

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda", 0)


def needs(precision: str) -> None:
    """Skip a bf16 case on a GPU without native bfloat16 (compute capability below 8.0)."""
    if precision == "bf16" and torch.cuda.get_device_capability(CUDA) < (8, 0):
        pytest.skip(f"{torch.cuda.get_device_name(CUDA)} has no native bfloat16")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("model", ["cnn", "conformer"])
def test_mixed_precision_steps_learn_on_the_gpu(model, precision):
    needs(precision)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    run = mixed_precision_steps(model, precision, CUDA)
    assert run["steps"] == 6 and run["loss_finite"] and run["consecutive_bad"] == 0
    assert run["learned"] and run["weights_finite"] and run["fused"]
    assert run["embedding_layer_dtypes"] == {dtype}  # the matmuls ran in reduced precision
    assert run["output_dtypes"] == {torch.float32}  # F.normalize runs in fp32 under autocast


@pytest.mark.parametrize("source", ["adamw", "apex"])
def test_a_non_fused_state_resumes_into_the_fused_adamw(source, monkeypatch):
    # A non-fused, non-capturable AdamW keeps `step` on the CPU even for CUDA parameters, and
    # apex keeps it per group; torch's load_state_dict places `step` by the saved groups'
    # flags, so without OptimizerState the fused CUDA kernel got CPU step counts.
    from audioclf.config import OptimConfig, TrainConfig
    from audioclf.precision import resolve_precision
    from audioclf.training.optim import OptimizerState, build_optimizer
    from tests.helpers import Linear, mse, random_batches, run_epoch

    batches = [tuple(t.to(CUDA) for t in b) for b in random_batches(3, 8)]
    fp32 = resolve_precision(TrainConfig(precision="fp32"), CUDA)
    first = Linear().to(CUDA)
    plain = torch.optim.AdamW(first.parameters(), lr=1e-3, fused=False)
    run_epoch(first, batches, mse, plain, fp32)
    state = plain.state_dict()
    assert state["state"][0]["step"].device.type == "cpu"
    if source == "apex":  # apex FusedAdam's layout: one step count per group
        state["param_groups"][0]["step"] = 3
        for per_param in state["state"].values():
            del per_param["step"]
    model = Linear().to(CUDA)
    model.load_state_dict(first.state_dict())
    fused = build_optimizer(model.parameters(), OptimConfig(name="adamw"), CUDA)
    OptimizerState(fused).load_state_dict(state)
    step = fused.state[model.fc.weight]["step"]
    assert step.device == model.fc.weight.device and step.dtype == torch.float32
    for precision in ("fp32", "fp16"):
        _, steps = run_epoch(
            model, batches, mse, fused, resolve_precision(TrainConfig(precision=precision), CUDA)
        )
        assert steps == 3
    torch.cuda.synchronize()
    assert int(fused.state[model.fc.weight]["step"]) == 9
    assert all(p.isfinite().all() for p in model.parameters())


def test_the_guard_counts_on_an_index_less_cuda_device():
    # "cuda" and "cuda:0" are one device: the guard's counts must survive the sync.
    from audioclf.config import OptimConfig, TrainConfig
    from audioclf.precision import resolve_precision
    from audioclf.training.optim import build_optimizer
    from audioclf.training.step import NonFiniteGuard
    from tests.helpers import Linear, mse, random_batches, run_epoch

    x, lengths, labels, positions = random_batches(1, 8)[0]
    x[0, 0] = float("nan")
    model = Linear().to(CUDA)
    optimizer = build_optimizer(model.parameters(), OptimConfig(name="adamw"), CUDA)
    guard = NonFiniteGuard(patience=10)
    bad = [(x, lengths, labels, positions)] * 2
    precision = resolve_precision(TrainConfig(), torch.device("cuda"))
    run_epoch(model, bad, mse, optimizer, precision, guard=guard, sync_every=2)
    assert guard.total == 2


def _nccl_collectives(rank, world):
    from audioclf.models import build_net

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    env = distributed.DistEnv(
        rank=rank, world_size=world, device=device, strategy="ddp", backend="nccl"
    )
    distributed.barrier()
    total = distributed.all_reduce_sum([1.0, 2.0], device=device).tolist()
    gathered = distributed.gather_objects({"rank": rank})
    shared = distributed.broadcast_object("from 0" if rank == 0 else None)
    first = distributed.primary_first(lambda: "built")
    stop = bool(distributed.all_reduce_max(torch.zeros(1, device=device)).item() > 0)
    # Host tensors, as embed --index's failure vote and resumed count are: NCCL reduces CUDA
    # tensors only, so the collectives move them to the group's device (and the flag back).
    host_flag = distributed.all_reduce_max(torch.ones(1))
    host_sum = distributed.all_reduce_sum([3.0])
    x = torch.randn(4, 3, device=device, requires_grad=True)
    everything = distributed.all_gather_with_grad(x)
    everything.sum().backward()
    nograd = distributed.all_gather_nograd(torch.arange(4, device=device))
    cfg = tiny_net_config("cnn")
    model = distributed.wrap(build_net(cfg, 0), env, sync_bn=True, find_unused_parameters=False)
    synced = any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    output, _ = model(torch.randn(8, 120, 32, device=device), torch.full((8,), 120, device=device))
    output.sum().backward()
    drift = distributed.check_parameter_consistency(model, device=device)
    return (
        total,
        gathered,
        shared,
        first,
        stop,
        tuple(everything.shape),
        x.grad.sum().item(),
        nograd.tolist(),
        synced,
        drift,
        (host_flag.device.type, host_flag.item(), host_sum.device.type, host_sum.item()),
    )


def test_nccl_collectives_and_syncbn_at_world_size_1(tmp_path):
    (result,) = run_in_group(_nccl_collectives, tmp_path, world_size=1, backend="nccl")
    total, gathered, shared, first, stop, shape, grad_sum, nograd, synced, drift, host = result
    assert host == ("cpu", 1.0, "cuda", 3.0)
    assert total == [1.0, 2.0] and gathered == [{"rank": 0}] and shared == "from 0"
    assert first == "built" and stop is False
    assert shape == (4, 3) and grad_sum == pytest.approx(12.0)
    assert nograd == [0, 1, 2, 3] and synced and drift is None


def test_gpu_checkpoint_resumes_on_cpu_and_exports(tmp_path, tiny_demo):
    needs("bf16")
    run = train_resume_export(tiny_demo, tmp_path, "cuda", "bf16")
    assert run["fused"] and run["steps"] == (2 * run["first_steps"])
    assert max(run["parity"].values()) <= 1e-4


def test_data_parallel_runs_bf16_inside_the_replicas():
    needs("bf16")
    from audioclf.models import build_net

    cfg = tiny_net_config("conformer")
    env = distributed.DistEnv(device=CUDA, strategy="dp")
    model = distributed.wrap(
        build_net(cfg, 0),
        env,
        sync_bn=True,
        find_unused_parameters=False,
        autocast_dtype=torch.bfloat16,
    )
    dtypes = []
    inner = distributed.unwrap(model)
    inner.embedder.subsampling.proj.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(torch.randn(8, 120, 32, device=CUDA), torch.full((8,), 120, device=CUDA))
    assert dtypes and set(dtypes) == {torch.bfloat16}
