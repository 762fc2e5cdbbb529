"""The process group: where this process sits (DistEnv), set-up and teardown, the barrier."""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from audioclf.distributed import launch

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
    use_cuda = launch.uses_cuda(device)
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
    if strategy == "auto":
        strategy = "ddp" if world_size > 1 else "single"
    if strategy == "ddp" and world_size == 1 and "MASTER_ADDR" not in os.environ:
        strategy = "single"  # plain python: no launcher to meet; under one launched rank
        # (torchrun --nproc_per_node 1) dist.strategy=ddp keeps the group: DDP, SyncBN, NCCL
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
        if world_size > 1:
            pin_to_cores(local_rank)

    chosen_backend = ""
    if strategy == "ddp":
        chosen_backend = ("nccl" if use_cuda else "gloo") if backend == "auto" else backend
        if chosen_backend == "nccl" and not use_cuda:
            raise RuntimeError(
                "dist.backend=nccl needs CUDA; use dist.backend=gloo (or auto) on CPU"
            )
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
                dist.init_process_group(
                    backend=chosen_backend,
                    store=store,
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                    **extra,
                )
            else:
                dist.init_process_group(backend=chosen_backend, timeout=timeout, **extra)
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return DistEnv(rank, local_rank, world_size, dev, strategy, chosen_backend)


def pin_to_cores(local_rank: int) -> list[int] | None:
    """Keep this rank on its own share of the machine's cores (CPU runs with several ranks per
    machine). Left to itself, the scheduler often stacks two busy ranks on one core while another
    idles (benchmarks/RESULTS.md, "Embedding a collection on every rank"). Nothing is pinned when there are
    fewer cores than local ranks, when a launcher bound the process already (srun --cpu-bind,
    taskset: fewer cores allowed than the machine has), or when the affinity cannot be set (not
    Linux); returns the cores, or None."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    bound = len(cores) < (os.cpu_count() or len(cores))
    if bound or local_ranks < 2 or len(cores) < local_ranks or local_rank >= local_ranks:
        return None
    share = len(cores) // local_ranks
    mine = cores[local_rank * share : (local_rank + 1) * share]
    try:
        os.sched_setaffinity(0, mine)
    except OSError:
        return None
    log.debug("rank with local rank %d pinned to cores %s", local_rank, mine)
    return mine


@contextmanager
def process_group(
    device: str | torch.device = "auto", *, timeout_minutes: float = 30.0
) -> Iterator[DistEnv]:
    """The launcher's process group around a tool's work: under torchrun or srun one rank per
    process (each on its own GPU), under plain python one process on `device` (which may name a
    GPU, cuda:N). Torn down after the block."""
    explicit = None if isinstance(device, str) and device == "auto" else torch.device(device)
    env = setup(
        device="auto" if explicit is None else explicit.type, timeout_minutes=timeout_minutes
    )
    if env.world_size == 1 and explicit is not None:
        env.device = explicit
    try:
        yield env
    finally:
        teardown()


def teardown() -> None:
    if is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if is_initialized():
        dist.barrier()
