"""Cross-rank triplet loss in a real 2-process gloo group: loss and DDP gradients equal the
single-process loss and gradients on the concatenated batch."""

import datetime
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from audioclf.config import LossConfig
from audioclf.losses import TripletLoss

WORLD = 2
MINERS = ["batch_hard", "semi_hard", "all"]
SPLITS = {"equal": 6, "unequal": 8}  # items on rank 0 out of 12; rank 1 holds the rest


def fixed_batch():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(12, 5, generator=generator)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 3, 3, 0, 1, 2, 3])
    return x, labels


def fresh_model():
    torch.manual_seed(3)
    return torch.nn.Linear(5, 4)


def loss_and_grads(model, x, labels, miner, cross_rank):
    loss, stats = TripletLoss(LossConfig(margin=0.3, miner=miner, cross_rank=cross_rank)).with_stats(
        F.normalize(model(x), dim=1), labels
    )
    loss.backward()
    return loss.item(), stats["triplets"], [p.grad.clone() for p in model.parameters()]


def _rank_main(rank, port, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        x, labels = fixed_batch()
        results = {}
        for split, first in SPLITS.items():
            part = slice(0, first) if rank == 0 else slice(first, None)
            for miner in MINERS:
                model = DistributedDataParallel(fresh_model())
                results[split, miner] = loss_and_grads(model, x[part], labels[part], miner, True)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ranks")
    context = mp.spawn(_rank_main, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):  # raises if a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("ranks still running after 120 s (hang in a collective?)")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("miner", MINERS)
def test_cross_rank_loss_and_grads_equal_single_process(rank_results, miner, split):
    x, labels = fixed_batch()
    loss, triplets, grads = loss_and_grads(fresh_model(), x, labels, miner, cross_rank=False)
    assert triplets > 0  # the comparison is not vacuous
    for rank, results in enumerate(rank_results):
        rank_loss, rank_triplets, rank_grads = results[split, miner]
        assert rank_triplets == triplets, f"rank {rank} mined another set of triplets"
        assert rank_loss == pytest.approx(loss, abs=1e-5)
        for expected, got in zip(grads, rank_grads, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_local_loss_differs_from_the_global_one():
    """Guards the comparison above: the halves alone do not give the global loss or gradient."""
    x, labels = fixed_batch()
    global_loss, _, global_grads = loss_and_grads(fresh_model(), x, labels, "all", cross_rank=False)
    half_loss, _, half_grads = loss_and_grads(fresh_model(), x[:6], labels[:6], "all", cross_rank=False)
    assert abs(half_loss - global_loss) > 1e-3
    assert (half_grads[0] - global_grads[0]).abs().max() > 1e-3
