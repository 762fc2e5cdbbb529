"""Everything that talks to torch.distributed or unwraps `.module` lives here.

Process-group set-up and teardown (the launcher's ranks come from audioclf.launch), model
wrapping (DDP / DataParallel / SyncBN), gathers that keep gradients, reductions, the failure
protocol between ranks, and the parameter-consistency check. Every function here that runs a
collective says so: every rank must call it.
"""

from __future__ import annotations

import datetime
import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from audioclf import launch

log = logging.getLogger("audioclf")


@dataclass
class DistEnv:
    """Where this process sits: rank, world size, device and the strategy in use."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    strategy: str = "single"  # ddp | dp | single
    backend: str = ""  # "" when no process group

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.strategy == "ddp" and self.world_size > 1


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def setup(
    *,
    strategy: str = "auto",
    backend: str = "auto",
    device: str = "auto",
    timeout_minutes: float = 30.0,
    local_rank_arg: int | None = None,
) -> DistEnv:
    """Initialise the process group (when launched by torchrun) and pick the device.

    NCCL on CUDA (after `torch.cuda.set_device(local_rank)`), gloo on CPU. The timeout bounds
    every collective, including the barrier other ranks wait at while rank 0 evaluates.
    """
    rank, local_rank, world_size = launch.env_ranks(local_rank_arg)
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
    if strategy == "auto":
        strategy = "ddp" if world_size > 1 else "single"
    if strategy == "ddp" and world_size == 1:
        strategy = "single"
    if strategy != "ddp" and world_size > 1:
        raise RuntimeError(
            f"dist.strategy={strategy} but WORLD_SIZE={world_size}: launch {strategy} with plain "
            "python (one process), or use dist.strategy=ddp under torchrun"
        )
    if strategy == "dp" and not use_cuda:
        log.info("dist.strategy=dp needs CUDA devices; running single-process on CPU")
        strategy = "single"

    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")

    chosen_backend = ""
    if strategy == "ddp":
        chosen_backend = ("nccl" if use_cuda else "gloo") if backend == "auto" else backend
        if chosen_backend == "nccl" and not use_cuda:
            raise RuntimeError("dist.backend=nccl needs CUDA; use dist.backend=gloo (or auto) on CPU")
        if not is_initialized():
            timeout = datetime.timedelta(minutes=timeout_minutes)
            extra = {"device_id": dev} if chosen_backend == "nccl" else {}
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
            if restart is not None:
                # After a torchrun restart the rendezvous store can still hold the previous
                # attempt's peer addresses (seen with gloo: "connectFullMesh ... Connection
                # refused"); a per-attempt key prefix keeps the attempts apart.
                store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
                store = dist.PrefixStore(f"audioclf/attempt_{restart}", store)
                dist.init_process_group(backend=chosen_backend, store=store, rank=rank,
                                        world_size=world_size, timeout=timeout, **extra)
            else:
                dist.init_process_group(backend=chosen_backend, timeout=timeout, **extra)
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return DistEnv(rank, local_rank, world_size, dev, strategy, chosen_backend)


def teardown() -> None:
    if is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------------------------
# Model wrapping


class AutocastReplica(nn.Module):
    """Runs the wrapped module's forward under autocast with a fixed dtype.

    DataParallel calls each replica's forward in a worker thread and re-enters autocast there
    with the caller's enabled flag but not its dtype, so bf16 would silently run as fp16 without
    loss scaling; inside the replica the dtype is set again.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        device_type = next(self.module.parameters()).device.type
        with torch.autocast(device_type=device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module inside DDP / DataParallel wrappers (for saving, evaluation, export)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel, AutocastReplica)):
        model = model.module
    return model


def wrap(model: nn.Module, env: DistEnv, *, sync_bn: bool, find_unused_parameters: bool,
         autocast_dtype: torch.dtype | None = None) -> nn.Module:
    """Move to the device and wrap for the strategy; SyncBN only where torch supports it (CUDA,
    DDP). `autocast_dtype` is the run's mixed-precision dtype (needed by DataParallel)."""
    model = model.to(env.device)
    if env.strategy == "ddp":
        if sync_bn and env.device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            log.info("SyncBatchNorm: BatchNorm layers synchronised across %d ranks", env.world_size)
        elif sync_bn:
            log.info("SyncBatchNorm needs CUDA; using plain BatchNorm on %s", env.device.type)
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(
            model, device_ids=device_ids, find_unused_parameters=find_unused_parameters
        )
    if env.strategy == "dp":
        if sync_bn:
            log.warning("model.sync_bn has no effect with dist.strategy=dp: BatchNorm statistics "
                        "stay per GPU replica; launch with torchrun (DDP) to synchronise them")
        if autocast_dtype is not None:
            model = AutocastReplica(model, autocast_dtype)
        return nn.DataParallel(model)
    return model


def no_sync(model: nn.Module, skip: bool):
    """DDP's no_sync() on non-final accumulation micro-steps; a no-op otherwise."""
    if skip and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return nullcontext()


# ---------------------------------------------------------------------------------------------
# Collectives


def all_reduce_sum(values: list[float] | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Sum a small vector across ranks (float64, on the process group's device)."""
    t = torch.as_tensor(values, dtype=torch.float64, device=device)
    if is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of a small tensor over ranks, in place (identity without a group)."""
    if is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
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


def broadcast_object(obj=None, src: int = 0):
    """Send a picklable object from rank `src` to every rank (identity without a group)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def primary_first(fn, *args, **kwargs):
    """Run fn on rank 0 first (e.g. to build a cache), then on the other ranks.

    Rank 0's failure is broadcast, so the other ranks raise the same message at once instead of
    waiting at a barrier until the timeout.
    """
    if not is_initialized():
        return fn(*args, **kwargs)
    error = None
    result = None
    if get_rank() == 0:
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # re-raised below on every rank
            error = exc
    message = broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"rank 0 failed: {message}")
    if get_rank() != 0:
        result = fn(*args, **kwargs)
    return result


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True when `flag` is set on any rank (one tiny all_reduce; plain flag without a group)."""
    if not is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


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


# ---------------------------------------------------------------------------------------------
# Failures


class PeerFailure(RuntimeError):
    """This rank stopped because another rank failed or vanished mid-collective; `reported`
    when that rank said why itself (then this one need not say it again)."""

    def __init__(self, message: str, reported: bool):
        super().__init__(message)
        self.reported = reported


_FAILED_KEY = "audioclf/failed/{}"
# How gloo and NCCL report a collective whose peer is gone (besides torch's DistError types).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "NCCL communicator was aborted", "Socket Timeout", "connection refused")


def announce_failure(reason: str) -> None:
    """Leave this rank's one-line reason in the rendezvous store, so the ranks that lose it
    can name it (best effort; not a collective)."""
    if not is_initialized():
        return
    try:
        dist.distributed_c10d._get_default_store().set(_FAILED_KEY.format(dist.get_rank()), reason)
    except Exception:  # noqa: BLE001 - the store may be gone with the failing peer
        pass


def is_peer_failure(exc: BaseException) -> bool:
    if not is_initialized():
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_GONE)


def peer_failure(exc: BaseException, wait_seconds: float = 3.0) -> PeerFailure:
    """What to say when a collective failed because of a peer: the lowest rank that announced
    its reason within `wait_seconds`, else that a rank stopped without a word."""
    import time

    deadline = time.monotonic() + wait_seconds
    reports: dict[int, str] = {}
    try:
        store = dist.distributed_c10d._get_default_store()
        keys = [_FAILED_KEY.format(r) for r in range(dist.get_world_size()) if r != dist.get_rank()]
        while not reports and time.monotonic() < deadline:
            for key in keys:
                if store.check([key]):
                    reports[int(key.rsplit("/", 1)[1])] = store.get(key).decode()
            if not reports:
                time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store went down with the failing peer
        pass
    if reports:
        rank, reason = min(reports.items())
        return PeerFailure(f"stopped because rank {rank} failed: {reason}", reported=True)
    detail = " ".join(str(exc).split())[:200]
    return PeerFailure("stopped because another rank stopped without a word (killed? out of "
                       f"memory? torchrun's summary names it): {detail}", reported=False)


# ---------------------------------------------------------------------------------------------
# Parameter consistency


class ParameterDriftError(RuntimeError):
    """Ranks hold different parameters: some update bypassed DDP's gradient all-reduce."""


def parameter_checksums(model: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Two float64 checksums per parameter tensor (plain sum and position-weighted sum)."""
    names, sums = [], []
    for name, p in unwrap(model).named_parameters():
        flat = p.detach().reshape(-1).double()
        weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
        weights = torch.remainder(weights * 0.6180339887, 1.0) + 0.5
        names.append(name)
        sums.append(torch.stack([flat.sum(), (flat * weights).sum()]))
    if not sums:
        return names, torch.zeros(0, 2, dtype=torch.float64)
    return names, torch.stack(sums)


def check_parameter_consistency(model: nn.Module, *, action: str = "error",
                                device: torch.device | None = None) -> str | None:
    """All-reduce per-tensor checksums as max − min across ranks; name the first drifting tensor.

    Returns None when every rank agrees bit for bit (or without a process group); otherwise
    raises ParameterDriftError (action="error") or logs a warning and returns its message.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return None
    names, sums = parameter_checksums(model)
    sums = sums.to(device) if device is not None else sums
    high, low = sums.clone(), sums.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    spread = (high - low).abs().amax(dim=1).cpu()
    drifting = torch.nonzero(spread > 0).flatten().tolist()
    if not drifting:
        return None
    first = drifting[0]
    message = (
        f"parameters differ across ranks: {len(drifting)} of {len(names)} tensors drifted, first "
        f"'{names[first]}' (checksum spread {spread[first].item():.3g}). An update bypassed DDP's "
        "gradient all-reduce — compute the training loss from the DDP-wrapped model's output, "
        "never through model.module"
    )
    if action == "error":
        raise ParameterDriftError(message)
    log.warning(message)
    return message
