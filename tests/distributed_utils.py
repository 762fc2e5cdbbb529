"""Run a function in N real processes joined in a gloo process group (no mocks)."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, out_dir, backend):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        extra = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60),
                                **extra)
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # reported to the parent, which asserts
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_in_group(fn, tmp_path, *args, world_size: int = 2, timeout: float = 120.0,
                 backend: str = "gloo") -> list:
    """fn(rank, world_size, *args) on each rank; returns results by rank; raises on any error."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, str(tmp_path), backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{len(alive)} rank(s) still running after {timeout} s (hang)"
    results = []
    for r in range(world_size):
        status, value = pickle.loads(Path(tmp_path, f"rank{r}.pkl").read_bytes())
        if status != "ok":
            raise AssertionError(f"rank {r} failed: {value}")
        results.append(value)
    return results
