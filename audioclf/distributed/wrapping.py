"""Model wrapping for the strategy (DDP / DataParallel / SyncBN), and the one place that
unwraps `.module`."""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
from torch import nn

from audioclf.distributed.group import DistEnv

log = logging.getLogger("audioclf")


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
    while isinstance(
        model, (nn.parallel.DistributedDataParallel, nn.DataParallel, AutocastReplica)
    ):
        model = model.module
    return model


def wrap(
    model: nn.Module,
    env: DistEnv,
    *,
    sync_bn: bool,
    find_unused_parameters: bool,
    autocast_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Move to the device and wrap for the strategy; SyncBN only where torch supports it (CUDA,
    DDP). `autocast_dtype` is the run's mixed-precision dtype (needed by DataParallel)."""
    if env.strategy == "ddp" and sync_bn and env.device.type == "cuda" and env.backend != "nccl":
        raise ValueError(
            f"model.sync_bn=true on CUDA needs dist.backend=nccl (this run uses {env.backend}): "
            "SyncBatchNorm's GPU kernels exchange statistics through NCCL; set "
            "dist.backend=nccl (or auto), or model.sync_bn=false"
        )
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
            log.warning(
                "model.sync_bn has no effect with dist.strategy=dp: BatchNorm statistics "
                "stay per GPU replica; launch with torchrun (DDP) to synchronise them"
            )
        if autocast_dtype is not None:
            model = AutocastReplica(model, autocast_dtype)
        return nn.DataParallel(model)
    return model


def no_sync(model: nn.Module, skip: bool):
    """DDP's no_sync() on non-final accumulation micro-steps; a no-op otherwise."""
    if skip and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return nullcontext()
