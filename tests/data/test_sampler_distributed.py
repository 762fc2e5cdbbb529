"""MPerClassSampler in a real 2-process gloo group: equal batch counts, disjoint class shares.

Each rank also runs one all_reduce per batch, as DDP's backward does, so unequal counts would
hang the group; the process-group timeout and the parent's join deadline turn a hang into a
failure.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from audioclf.data.sampler import MPerClassSampler

pytestmark = pytest.mark.slow  # every test here starts processes

WORLD_SIZE = 2
TIMEOUT_S = 60


def skewed_index() -> tuple[np.ndarray, np.ndarray]:
    """Classes of very different sizes, so a naive per-rank length would differ between ranks."""
    rng = np.random.default_rng(0)
    classes, items = [], []
    for cls in range(30):
        for item in range(rng.integers(1, 7)):
            ids = int(rng.integers(1, 40 if cls % 5 == 0 else 6))
            classes += [f"class{cls}"] * ids
            items += [f"take{item}"] * ids
    return np.asarray(classes), np.asarray(items)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, port: int, split: str, result_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        classes, items = skewed_index()
        sampler = MPerClassSampler(
            classes, items, batch_size=8, m=2, rank=rank, world_size=WORLD_SIZE, seed=3, split=split
        )
        report = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            batches = 0
            used = set()
            for batch in sampler:
                dist.all_reduce(torch.ones(1))  # stands in for DDP's gradient all-reduce
                batches += 1
                used.update(classes[batch].tolist())
            gathered = [None] * WORLD_SIZE
            mine = {"batches": batches, "len": len(sampler), "classes": sorted(used)}
            dist.all_gather_object(gathered, mine)
            report.append(gathered)
        if rank == 0:
            Path(result_dir, "report.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _run_group(split: str, tmp_path: Path) -> list:
    context = mp.start_processes(
        _worker,
        args=(_free_port(), split, str(tmp_path)),
        nprocs=WORLD_SIZE,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while not context.join(timeout=1):  # join raises if a worker failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"2-rank gloo group did not finish within {2 * TIMEOUT_S} s (hang?)")
    return json.loads((tmp_path / "report.json").read_text())


@pytest.mark.parametrize("split", ["classes", "batches"])
def test_ranks_agree_on_batch_count(split, tmp_path):
    report = _run_group(split, tmp_path)
    assert len(report) == 3
    for epoch_report in report:
        rank0, rank1 = epoch_report
        assert rank0["batches"] == rank1["batches"] > 0
        assert rank0["len"] == rank1["len"] == rank0["batches"]
        if split == "classes":
            assert not set(rank0["classes"]) & set(rank1["classes"]), "class shares overlap"
