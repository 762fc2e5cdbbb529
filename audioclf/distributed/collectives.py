"""Collectives: reductions, gathers (one keeps gradients), broadcast, rank 0 first. Each one
runs on every rank (every rank must call it) and is the identity without a process group."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from audioclf.distributed.group import is_initialized


def group_device() -> torch.device:
    """Where a collective's tensors must live: this rank's GPU under NCCL (which reduces CUDA
    tensors only), else the CPU."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(
    values: list[float] | torch.Tensor, device: torch.device | None = None
) -> torch.Tensor:
    """Sum a small vector across ranks (float64, on `device`; by default the process group's
    device)."""
    t = torch.as_tensor(values, dtype=torch.float64, device=device or group_device())
    if is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of a small tensor over ranks, in place (identity without a group).
    A tensor on another device than the group's (a CPU flag under NCCL) is reduced there and
    copied back."""
    if is_initialized():
        shared = values.to(group_device())
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        if shared is not values:
            values.copy_(shared)
    return values


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward hands each rank the gradient of its own slice.

    Every rank computes the same loss on the gathered batch, so the gradient of the slice owned
    by rank r is the sum over ranks of d(loss_k)/d(slice_r): reduced with SUM, then taken.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size()
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        rank, world = dist.get_rank(), dist.get_world_size()
        return grad.chunk(world, dim=0)[rank]


def all_gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-sized tensors from all ranks along dim 0; this rank's slice keeps its grad.

    The result is ordered by rank. Identity without a process group.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return tensor
    return _GatherWithGrad.apply(tensor)


def all_gather_nograd(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-sized tensors from all ranks along dim 0 (no gradient)."""
    if not is_initialized() or dist.get_world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


def broadcast_object(obj=None, src: int = 0, *, timeout: datetime.timedelta | None = None):
    """Send a picklable object from rank `src` to every rank (identity without a group).
    `timeout`: how long the receivers wait, instead of the process group's timeout (through a
    group of every rank made for this one broadcast)."""
    if not is_initialized():
        return obj
    box = [obj]
    if timeout is None:
        dist.broadcast_object_list(box, src=src)
        return box[0]
    group = dist.new_group(timeout=timeout)
    try:
        dist.broadcast_object_list(box, src=src, group=group)
    finally:
        dist.destroy_process_group(group)
    return box[0]


def primary_first(fn, *args, **kwargs):
    """Run fn on rank 0 first (e.g. to build a cache), then on the other ranks (collective).

    Rank 0's failure is broadcast, so the other ranks raise the same message at once instead of
    waiting at a barrier until the timeout.
    """
    if not is_initialized():
        return fn(*args, **kwargs)
    result, error = _on_primary(fn, args, kwargs)
    _raise_primary_failure(error, broadcast_object(_failure_text(error)))
    if dist.get_rank() != 0:
        result = fn(*args, **kwargs)
    return result


def primary_only(fn, *args, timeout: datetime.timedelta | None = None, **kwargs):
    """Run fn on rank 0 alone and hand its (picklable) result to every rank (collective); its
    failure is raised on every rank at once, as in primary_first. `timeout`: how long the other
    ranks wait for fn (default: the process group's timeout)."""
    if not is_initialized():
        return fn(*args, **kwargs)
    result, error = _on_primary(fn, args, kwargs)
    message, result = broadcast_object((_failure_text(error), result), timeout=timeout)
    _raise_primary_failure(error, message)
    return result


def _on_primary(fn, args, kwargs) -> tuple[object, Exception | None]:
    if dist.get_rank() != 0:
        return None, None
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:  # re-raised on every rank by _raise_primary_failure
        return None, exc


def _failure_text(error: Exception | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _raise_primary_failure(error: Exception | None, message: str | None) -> None:
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"rank 0 failed: {message}")


def gather_to_primary(obj) -> list | None:
    """Every rank's `obj`, ordered by rank, on rank 0 only (None elsewhere). Collective: every
    rank must call it. Unlike gather_objects, the other ranks receive nothing."""
    if not is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def gather_objects(obj) -> list:
    """Every rank's `obj`, ordered by rank, on every rank (a one-element list without a group)."""
    if not is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
